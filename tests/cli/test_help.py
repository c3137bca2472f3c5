#!/usr/bin/python3
"""Tests of the `qkv` command's --help (docs/cli.md, "Conventions"): every
command's help, found by walking the "Subcommands:" lists from `qkv --help`,
ends with "Examples:" and a "More:" line naming pages (and sections) of
docs/ that exist; the examples run as written, in a directory holding the
files they read (made here), in an order where each one's inputs were made
by the ones before; no option shows CLI11's type names or its checks'
descriptions ("K:INT in [0 - 68719476736]", "TEXT:{dot,additive}"); and
the top-level summary names every command. The harness is test_cli.py's.

Usage: test_help.py --qkv PATH [unittest arguments, e.g. a TestCase name]
QKV_SEARCH_MODEL must name the sentence encoder's directory (as for
test_search.py): the `qkv search` examples run on the fixture lists.
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())

SOURCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# The order the examples run in: each command's examples read what earlier
# ones wrote (softmax writes weights.npy for heatmap, store create makes kv,
# index update appends to kv before updating kv-index, ...). "" is `qkv`
# itself. A command missing here, or named here but gone, fails the test.
ORDER = ["info", "softmax", "heatmap", "store create", "store info", "store verify",
         "index build", "index update", "store append", "index info", "index verify",
         "store", "index", "attend", "regress", "lookup", "demo",
         "search index", "search query", "search verify", "search eval", "search encode",
         "search", ""]

# Examples not run here, each with the reason.
NOT_RUN = {
    'qkv search index --out search-index --model "$(scripts/model-dir.sh)"':
        "reads the machine's whole apt lists (63,681 packages: about 14 min on 2 cores); "
        "the next example builds the same kind of index from tests/search/lists",
}

# What CLI11 shows when an option has no type name of its own, and what it
# appends from a check: a range or a set of choices.
NOISE = re.compile(r" in \[|:\{|\b(?:TEXT|INT|UINT|FLOAT|NUMBER|BOOLEAN)\b")

FOOTER = re.compile(r"\nExamples:\n((?:  qkv[^\n]*\n)+)More: ([^\n]*)\n*$")


def help_text(path):
    r = test_cli.run(*path.split(), "--help")
    assert r.returncode == 0 and r.stderr == "", f"qkv {path} --help: {r.returncode} {r.stderr}"
    return r.stdout


def subcommands(text):
    """The names listed under "Subcommands:" in a help text."""
    if "\nSubcommands:\n" not in text:
        return []
    section = text.split("\nSubcommands:\n", 1)[1]
    names = []
    for line in section.split("\n"):
        if not line.startswith("  "):
            break
        if not line.startswith("   "):  # a wrapped description is indented further
            names.append(line.split()[0])
    return names


def every_help():
    """{command path ("" for qkv, "store create", ...): its --help}"""
    helps, todo = {}, [""]
    while todo:
        path = todo.pop(0)
        helps[path] = help_text(path)
        todo += [f"{path} {name}".strip() for name in subcommands(helps[path])]
    return helps


def github_anchor(heading):
    """The anchor GitHub gives a Markdown heading: lower case, punctuation
    dropped, spaces as hyphens ("`qkv attend`" -> "qkv-attend")."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page):
    with open(os.path.join(SOURCE, page), encoding="utf-8") as f:
        return {github_anchor(line.lstrip("#")) for line in f if re.match(r"#{1,6} ", line)}


def footer(text):
    """(examples, the "More:" line) of a help text, or None."""
    m = FOOTER.search(text)
    if m is None:
        return None
    return [line.strip() for line in m.group(1).splitlines()], m.group(2)


class HelpTest(test_cli.CliTest):
    helps = None  # every command's --help, read once

    @classmethod
    def setUpClass(cls):
        cls.helps = every_help()

    def test_commands_are_all_found(self):
        # The walk finds what docs/cli.md documents; ORDER must name each.
        self.assertIn("store create", self.helps)
        self.assertIn("search encode", self.helps)
        self.assertEqual(sorted(self.helps), sorted(ORDER))

    def test_every_help_ends_with_examples_and_docs(self):
        for path, text in self.helps.items():
            with self.subTest(command=path):
                parts = footer(text)
                self.assertIsNotNone(parts, f"qkv {path} --help ends without Examples:\n{text}")
                examples, more = parts
                self.assertIn(len(examples), (1, 2), examples)
                pages = re.findall(r"(docs/[\w.-]+\.md)(?:#([\w-]+))?", more)
                self.assertTrue(pages, f"no docs/ page in {more!r}")
                for page, anchor in pages:
                    self.assertTrue(os.path.isfile(os.path.join(SOURCE, page)), page)
                    if anchor:
                        self.assertIn(anchor, anchors(page), f"{page}#{anchor}")
                # Examples may show a command with the ones it works with (store
                # append before index update), but at least one runs it.
                self.assertTrue(any(e.startswith(f"qkv {path}".strip()) for e in examples),
                                examples)

    def test_no_parser_noise_in_option_lists(self):
        for path, text in self.helps.items():
            for line in text.splitlines():
                with self.subTest(command=path, line=line):
                    self.assertIsNone(NOISE.search(line), f"qkv {path} --help: {line}")

    def test_summary_names_every_command(self):
        summary = self.helps[""].splitlines()[0]
        for name in subcommands(self.helps[""]):
            self.assertIn(f"({name})", summary)
        self.assertIn("regression", summary)
        self.assertIn("search engine", summary)

    def make_inputs(self):
        rng = np.random.default_rng()
        self.save("scores.npy", rng.normal(size=(3, 10)).astype(np.float32))
        self.save("lens.npy", np.array([2, 6, 10], dtype=np.int32))
        self.save("queries.npy", rng.normal(size=(3, 2)).astype(np.float32))
        self.save("keys.npy", rng.normal(size=(10, 2)).astype(np.float32))
        self.save("values.npy", rng.normal(size=(10, 4)).astype(np.float32))
        # The chapter's regression data: y = 2 sin x + x^0.8 + noise on [0, 5).
        x = np.sort(rng.uniform(0, 5, 50))
        y = 2 * np.sin(x) + x ** 0.8 + rng.normal(0, 0.5, 50)
        np.savetxt(self.path("data.csv"), np.column_stack([x, y]), delimiter=",", header="x,y",
                   comments="")
        # From a checkout the examples name tests/search/lists and scripts/.
        os.symlink(os.path.join(SOURCE, "tests"), self.path("tests"))
        os.symlink(os.path.join(SOURCE, "scripts"), self.path("scripts"))
        bin_dir = self.path("bin")
        os.mkdir(bin_dir)
        os.symlink(test_cli.QKV, os.path.join(bin_dir, "qkv"))
        return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"])

    def test_examples_run_as_written(self):
        model = os.environ.get("QKV_SEARCH_MODEL", "")
        self.assertTrue(os.path.isfile(os.path.join(model, "model.safetensors")),
                        f"QKV_SEARCH_MODEL={model!r} is not all-MiniLM-L6-v2's directory "
                        "(scripts/model-dir.sh prints it)")
        env = self.make_inputs()
        done = set()
        for path in ORDER:
            examples, _ = footer(self.helps[path])
            for example in examples:
                if example in done or example in NOT_RUN:
                    continue
                done.add(example)
                with self.subTest(example=example):
                    r = subprocess.run(["bash", "-c", example], cwd=self.dir, env=env,
                                       capture_output=True, text=True, timeout=600)
                    self.assertEqual(r.returncode, 0,
                                     f"{example}\nstdout: {r.stdout}\nstderr: {r.stderr}")
                    # What the example says it writes is there.
                    words = shlex.split(example)
                    for option, value in zip(words, words[1:]):
                        if option in ("--out", "--weights", "--plot", "--top-ids", "--ids"):
                            self.assertTrue(os.path.exists(self.path(value)), f"{example}: {value}")
        every = {e for path in ORDER for e in footer(self.helps[path])[0]}
        self.assertEqual(set(NOT_RUN) - every, set(), "NOT_RUN names an example no help shows")


if __name__ == "__main__":
    test_cli.main()
