"""qkv: attention pooling in fast, exact C++, for NumPy (and, in qkv.torch, PyTorch).

The functions here take NumPy arrays (float32 or float64, any strides: they
are read in place, never copied) and return new arrays:

    masked_softmax, masked_softmax_backward
    scaled_dot_product_attention, scaled_dot_product_attention_backward
    additive_attention, additive_attention_backward
    bilinear_attention, bilinear_attention_backward
    distance_attention, distance_attention_backward
    attention_pooling, average_pooling, one_hot_lookup, one_hot_weights, uniform_weights
    merge_attention (attention over parts of a key set, merged by their lse)
    show_heatmaps (d2l's: attention weights drawn to a PNG, SVG or PDF file)
    KeyValueStore (an on-disk key-value store: create, open, append, verify,
        keys, values, attend) and Index (an index over one: build, open,
        verify, check_built_over, attend, certified or exact)
    nadaraya_watson, KernelRegression, silverman_bandwidth, scott_bandwidth, train_parametric
    set_num_threads, get_num_threads, simd_target, simd_targets, set_simd_target, simd_info

Shapes are d2l's: queries (B, Nq, D), keys (B, Nk, D), values (B, Nk, Dv),
valid_lens None, (B) or (B, Nq); 2-D inputs are a batch of one. Bad
arguments raise qkv.Error (a ValueError) with the C++ library's message, or
a TypeError for a wrong dtype, an unknown keyword or a value of the wrong
kind (named, with the nearest keyword for a typo). The computing calls
release the GIL. A store and its index hold float32 or bfloat16 and compute
in float32: float64 arrays given to them are rounded to float32.

`import qkv.torch` for autograd functions and d2l's modules on the same
kernels; `import qkv.search` for the search engine's parts (so far the
sentence encoder's WordPiece tokenizer). docs/python.md has the whole story.
"""

import numpy as _numpy

# The bindings are compiled against Debian 12's pybind11 2.10, which reads a
# dtype's item size where NumPy 1.x keeps it; NumPy 2 moved it, so every
# array would be refused ("float32; expected float32") or made with wrong
# strides. Said here, once, instead.
if int(_numpy.__version__.split(".")[0]) >= 2:
    raise ImportError(
        f"qkv: this build's NumPy bindings (pybind11 2.10) read NumPy 1.x arrays only, and this "
        f"Python has NumPy {_numpy.__version__} ({_numpy.__file__}); install NumPy 1.x beside "
        f"it (pip install 'numpy<2'), or use Debian's /usr/bin/python3 with python3-numpy")

__license__ = "MIT"  # SPDX identifier, as LICENSE, the package metadata and `qkv --version` say

from . import _arguments  # noqa: E402
from ._heatmaps import show_heatmaps  # noqa: E402
from ._qkv import (  # noqa: F401, E402  (the public API, re-exported)
    AdditiveAttentionGrads,
    BilinearAttentionGrads,
    Error,
    Index,
    IndexAttentionResult,
    IoError,
    KernelRegression,
    KeyValueStore,
    MergedAttention,
    ScaledDotProductAttentionGrads,
    ScaledDotProductAttentionBiasGrads,
    StoreAttentionResult,
    __version__,
    additive_attention,
    additive_attention_backward,
    attention_pooling,
    average_pooling,
    bilinear_attention,
    bilinear_attention_backward,
    distance_attention,
    distance_attention_backward,
    get_num_threads,
    masked_softmax,
    masked_softmax_backward,
    merge_attention,
    nadaraya_watson,
    one_hot_lookup,
    one_hot_weights,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    scott_bandwidth,
    set_num_threads,
    set_simd_target,
    silverman_bandwidth,
    simd_info,
    simd_target,
    simd_targets,
    train_parametric,
    uniform_weights,
)

__all__ = [
    "AdditiveAttentionGrads",
    "BilinearAttentionGrads",
    "Error",
    "Index",
    "IndexAttentionResult",
    "IoError",
    "KernelRegression",
    "KeyValueStore",
    "MergedAttention",
    "ScaledDotProductAttentionGrads",
    "ScaledDotProductAttentionBiasGrads",
    "StoreAttentionResult",
    "__version__",
    "additive_attention",
    "additive_attention_backward",
    "attention_pooling",
    "average_pooling",
    "bilinear_attention",
    "bilinear_attention_backward",
    "distance_attention",
    "distance_attention_backward",
    "get_num_threads",
    "masked_softmax",
    "masked_softmax_backward",
    "merge_attention",
    "nadaraya_watson",
    "one_hot_lookup",
    "one_hot_weights",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "scott_bandwidth",
    "set_num_threads",
    "set_simd_target",
    "show_heatmaps",
    "silverman_bandwidth",
    "simd_info",
    "simd_target",
    "simd_targets",
    "train_parametric",
    "uniform_weights",
]

# Arguments that do not fit a signature are named, not answered with
# pybind11's listing of it (python/qkv/_arguments.py).
for _name in __all__:
    if type(globals()[_name]).__name__ == "builtin_function_or_method":
        globals()[_name] = _arguments.named_errors(globals()[_name], f"qkv.{_name}")
for _name in ("__init__", "fit", "predict", "weights", "loo_error"):
    setattr(KernelRegression, _name,
            _arguments.named_errors(getattr(KernelRegression, _name), f"qkv.KernelRegression.{_name}"
                                    if _name != "__init__" else "qkv.KernelRegression"))
# The store's and the index's factories (static methods, wrapped again as
# such) and methods.
for _class, _static, _methods in ((KeyValueStore, ("create", "open"),
                                   ("append", "verify", "keys", "values", "attend")),
                                  (Index, ("build", "open", "update"),
                                   ("verify", "check_built_over", "attend", "attend_backward"))):
    for _name in _static:
        setattr(_class, _name, staticmethod(_arguments.named_errors(
            getattr(_class, _name), f"qkv.{_class.__name__}.{_name}")))
    for _name in _methods:
        setattr(_class, _name, _arguments.named_errors(getattr(_class, _name),
                                                       f"qkv.{_class.__name__}.{_name}"))
del _name, _class, _static, _methods
