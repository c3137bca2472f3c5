"""qkv.show_heatmaps: d2l's show_heatmaps for Python users, drawn by the qkv
command's `heatmap` (gnuplot), so the package needs no matplotlib (Debian
12's /usr/bin/python3 has none unless python3-matplotlib is installed).
"""

import os
import shutil
import subprocess
import tempfile

import numpy as np

_FN = "show_heatmaps"
_FORMATS = (".png", ".svg", ".pdf")
_CMAPS = ("Reds", "Blues", "viridis", "gray")  # qkv heatmap --cmap


def _qkv_command():
    """The qkv command: $QKV_CLI, else the build tree's (this package built in
    <build>/python/qkv, the command at <build>/qkv), else `qkv` on PATH."""
    given = os.environ.get("QKV_CLI")
    if given:
        return given
    build_tree = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "qkv")
    if os.path.isfile(build_tree) and os.access(build_tree, os.X_OK):
        return build_tree
    on_path = shutil.which("qkv")
    if on_path:
        return on_path
    raise RuntimeError(f"{_FN}: draws with the qkv command (qkv heatmap, through gnuplot), "
                       f"which is not in the build tree beside this package nor on PATH; "
                       f"set QKV_CLI=/path/to/qkv (cmake --install build/release installs it)")


def show_heatmaps(matrices, xlabel="Keys", ylabel="Queries", titles=None, figsize=None,
                  cmap="Reds", *, out):
    """Attention weights as a grid of heatmaps, written to a figure file (d2l's
    show_heatmaps, which draws with matplotlib; this draws with gnuplot
    through `qkv heatmap`).

    Arguments:
        matrices: (rows, cols, Nq, Nk) weights (also (Nq, Nk): one panel, or
            (cols, Nq, Nk): a row), a NumPy array or anything np.asarray
            takes (a CPU torch tensor); float32 or float64, finite.
        xlabel, ylabel: the labels under the bottom row and left of the first
            column.
        titles: None, or one title per column.
        figsize: accepted for d2l's signature and ignored: each panel is 2.5
            inches (250 pixels in a PNG) square, as d2l's default.
        cmap: "Reds", "Blues", "viridis" or "gray".
        out: the figure's path; .png, .svg or .pdf.

    Returns:
        out.

    Raises:
        ValueError: matrices of another rank, out of another format, titles
            that do not match the columns; qkv.Error with the command's
            message for what it refuses.
        RuntimeError: the qkv command not found.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "eye.png")
    >>> qkv.show_heatmaps(np.eye(10).reshape(1, 1, 10, 10), out=path) == path
    True
    """
    del figsize  # d2l's; the panels' size is fixed (see above)
    weights = np.asarray(matrices.detach() if hasattr(matrices, "detach") else matrices)
    if weights.dtype not in (np.float32, np.float64):
        if not np.issubdtype(weights.dtype, np.number) or np.iscomplexobj(weights):
            raise TypeError(f"{_FN}: matrices has dtype {weights.dtype}; expected float32 or "
                            f"float64 weights")
        weights = weights.astype(np.float64)
    if weights.ndim not in (2, 3, 4):
        raise ValueError(f"{_FN}: matrices has shape {list(weights.shape)}; expected (rows, "
                         f"cols, Nq, Nk), (cols, Nq, Nk) or (Nq, Nk)")
    out = os.fspath(out)
    if os.path.splitext(out)[1].lower() not in _FORMATS:
        raise ValueError(f"{_FN}: out = {out!r} names no figure format; expected a path "
                         f"ending in .png, .svg or .pdf")
    if cmap not in _CMAPS:
        raise ValueError(f"{_FN}: cmap = {cmap!r} is not one of {', '.join(_CMAPS)}")
    if titles is not None:
        titles = [str(t) for t in titles]
        cols = 1 if weights.ndim == 2 else weights.shape[-3]
        if len(titles) != cols:
            raise ValueError(f"{_FN}: titles has {len(titles)} titles but matrices (shape "
                             f"{list(weights.shape)}) has {cols} column{'s' * (cols != 1)}")
        if any("," in t for t in titles):
            raise ValueError(f"{_FN}: titles = {titles} holds a comma, which the qkv command "
                             f"reads as a separator")
    command = _qkv_command()
    with tempfile.TemporaryDirectory(prefix="qkv-heatmaps-") as scratch:
        path = os.path.join(scratch, "weights.npy")
        np.save(path, np.ascontiguousarray(weights))
        args = [command, "heatmap", "--weights", path, "--xlabel", str(xlabel), "--ylabel",
                str(ylabel), "--cmap", str(cmap), "--out", out]
        if titles is not None:
            args += ["--titles", ",".join(titles)]
        run = subprocess.run(args, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        from ._qkv import Error
        message = run.stderr.strip().removeprefix("qkv heatmap: error: ")
        raise Error(f"{_FN}: {message}")
    return out
