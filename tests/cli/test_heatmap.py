#!/usr/bin/python3
"""Tests of `qkv heatmap`: weights of 2, 3 and 4 axes drawn to PNG, SVG and
PDF through gnuplot (the files are checked for their format, the PNG's size
for the panel layout), and every bad input exits 2 without writing. The
harness (running qkv, temporary directories, expect_error) is test_cli.py's.

Usage: test_heatmap.py --qkv PATH [unittest arguments, e.g. a TestCase name]
NumPy is required: if it cannot be imported this script fails.
"""

import os
import struct
import sys
import xml.dom.minidom

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())


class HeatmapTest(test_cli.CliTest):
    def check_figure(self, path):
        """Asserts `path` is a complete figure of its extension's format;
        returns (width, height) in pixels for a PNG."""
        self.assertTrue(os.path.exists(path), f"qkv wrote no {path}")
        with open(path, "rb") as f:
            data = f.read()
        ext = os.path.splitext(path)[1]
        if ext == ".png":
            self.assertEqual(data[:8], b"\x89PNG\r\n\x1a\n")
            self.assertEqual(data[12:16], b"IHDR")
            self.assertIn(b"IEND", data[-16:])
            return struct.unpack(">II", data[16:24])
        if ext == ".svg":
            self.assertEqual(xml.dom.minidom.parseString(data).documentElement.tagName, "svg")
        else:
            self.assertEqual(data[:5], b"%PDF-")
            self.assertIn(b"%%EOF", data[-64:])
        return None


class ShapesTest(HeatmapTest):
    def test_ranks_and_formats(self):
        # (Nq, Nk) is one panel, (B, Nq, Nk) B panels in a row, (R, C, Nq, Nk) a grid:
        # the figure grows by 2.5 in (250 px) per panel column and row.
        sizes = {}
        for name, shape in [("two", (4, 6)), ("three", (3, 4, 6)), ("four", (2, 3, 4, 6))]:
            for dtype in (np.float32, np.float64):
                w = self.save(f"{name}-{np.dtype(dtype).name}.npy",
                              self.rng.random(shape).astype(dtype))
                for ext in ("png", "svg", "pdf"):
                    out = self.path(f"{name}-{np.dtype(dtype).name}.{ext}")
                    self.ok("heatmap", "--weights", w, "--out", out)
                    size = self.check_figure(out)
                    if size:
                        sizes[name] = size
        self.assertGreaterEqual(sizes["three"][0] - sizes["two"][0], 2 * 250)
        self.assertEqual(sizes["three"][1], sizes["two"][1])
        self.assertEqual(sizes["four"][0], sizes["three"][0])
        self.assertGreaterEqual(sizes["four"][1] - sizes["three"][1], 250)

    def test_options(self):
        w = self.save("w.npy", np.eye(5)[None].repeat(2, axis=0))
        for cmap in ("Reds", "Blues", "viridis", "gray"):
            out = self.path(f"w-{cmap}.svg")
            self.ok("heatmap", "--weights", w, "--xlabel", "Sorted testing inputs", "--ylabel",
                    "Sorted training inputs", "--titles", "first,second", "--cmap", cmap,
                    "--out", out)
            with open(out, encoding="utf-8") as f:
                text = f.read()
            for label in ("Sorted testing inputs", "Sorted training inputs", "first", "second"):
                self.assertIn(label, text)

    def test_replaces_existing_output(self):
        w = self.save("w.npy", np.eye(3))
        out = self.path("fig.png")
        with open(out, "wb") as f:
            f.write(b"old")
        self.ok("heatmap", "--weights", w, "--out", out)
        self.check_figure(out)
        self.assertEqual(sorted(os.listdir(self.dir)), ["fig.png", "w.npy"])


class ErrorsTest(HeatmapTest):
    def test_bad_input(self):
        out = self.path("fig.png")
        good = self.save("good.npy", np.eye(3))
        cases = [
            (["--weights", self.save("one.npy", np.ones(4)), "--out", out],
             ["--weights", "has shape [4]", "(Nq, Nk)"]),
            (["--weights", self.save("three.npy", np.ones((2, 3, 3))), "--titles", "a,b,c",
              "--out", out], ["--titles has 3 titles", "[2, 3, 3]", "2 columns"]),
            (["--weights", good, "--out", self.path("fig.jpg")],
             ["fig.jpg", ".png, .svg or .pdf"]),
            (["--weights", good, "--cmap", "jet", "--out", out], ["--cmap"]),
            (["--weights", self.save("ints.npy", np.eye(3, dtype=np.int64)), "--out", out],
             ["--weights"]),
            (["--weights", self.save("nan.npy", np.full((2, 2), np.nan)), "--out", out],
             ["is nan"]),
            (["--weights", self.path("missing.npy"), "--out", out], ["missing.npy"]),
            (["--out", out], ["--weights"]),
        ]
        for args, fragments in cases:
            with self.subTest(args=args):
                outputs = [a for a in args if a.endswith((".png", ".jpg"))]
                self.expect_error("heatmap", ["heatmap"] + args, outputs=outputs,
                                  fragments=fragments)

    def test_missing_gnuplot(self):
        empty = self.path("empty")
        os.mkdir(empty)
        out = self.path("fig.png")
        r = test_cli.run("heatmap", "--weights", self.save("w.npy", np.eye(3)), "--out", out,
                         env=dict(os.environ, PATH=empty))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(r.stderr, "qkv heatmap: error: heatmaps: gnuplot not found: "
                                   "install Debian package gnuplot-nox\n")
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    test_cli.main()
