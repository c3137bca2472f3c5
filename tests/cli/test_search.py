#!/usr/bin/python3
"""Tests of `qkv search` (index, query, verify, eval, encode) through the
command line, on the small apt lists directory tests/search/lists (274 real
bookworm packages) with the real sentence encoder (all-MiniLM-L6-v2 in the
registry peers' venv, $QKV_SEARCH_MODEL; scripts/model-dir.sh prints it): an
index built, its files, the same bits at 1 and 2 threads, rankings by the
three engines, a query naming a package finding it first, plain-English
queries finding the package they describe, BM25's against SQLite FTS5's own
ranking of the index's table (Python's sqlite3, the peer), the pooled
sections, many queries as JSON lines, the metrics table, the encodings
`encode` writes as the learned engine's queries (attention over the
document store with them gives its weights), verify finding a changed byte,
and bad input (no model, no lists, an existing output, a missing or damaged
index, a query without words) exiting 2 and leaving nothing. The harness is
test_cli.py's.

Usage: test_search.py --qkv PATH [unittest arguments, e.g. a TestCase name]
"""

import ctypes
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())

# XXH3-64 from Debian's libxxhash (libxxhash-dev, which qkv builds with):
# the peer that forms a manifest's checksum as a hand edit would.
_XXHASH = ctypes.CDLL("libxxhash.so.0")
_XXHASH.XXH3_64bits.restype = ctypes.c_uint64
_XXHASH.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3_64_hex(data):
    return f"{_XXHASH.XXH3_64bits(data, len(data)):016x}"


LISTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "search", "lists")


def model_dir():
    """The sentence encoder's directory: a test that cannot find it fails."""
    model = os.environ.get("QKV_SEARCH_MODEL", "")
    if not os.path.isfile(os.path.join(model, "model.safetensors")):
        raise RuntimeError(f"QKV_SEARCH_MODEL={model!r} is not all-MiniLM-L6-v2's directory "
                           "(make the venv: scripts/install-deps.sh test; "
                           "scripts/model-dir.sh prints the directory)")
    return model


# Documents cut at 32 tokens and 2 epochs, so an index of the fixture builds
# in a few seconds (about 40 under the sanitizers).
SMALL = ["--document-tokens", "32", "--epochs", "2", "--batch", "64", "--quiet"]


def index_args(out, *extra):
    return ["search", "index", "--out", out, "--lists", LISTS, "--model", model_dir(), *SMALL,
            *extra]


class SearchCase(test_cli.CliTest):
    index = None  # one index of the fixture, built once for every test

    @classmethod
    def setUpClass(cls):
        cls._shared = tempfile.TemporaryDirectory(prefix="qkv-search-test-")
        cls.index = os.path.join(cls._shared.name, "index")
        r = test_cli.run(*index_args(cls.index))
        assert r.returncode == 0, r.stderr

    @classmethod
    def tearDownClass(cls):
        cls._shared.cleanup()

    def query(self, text, *extra):
        return json.loads(self.ok("search", "query", "--index", self.index, text, "--json",
                                  *extra).stdout)

    def damaged_copy(self, name="damaged"):
        damaged = self.path(name)
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(self.index, damaged)
        return damaged


def flip_middle_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes([byte[0] ^ 0x20]))


class SearchIndexTest(SearchCase):
    def test_files_and_manifest(self):
        names = sorted(os.listdir(self.index))
        self.assertEqual(names, ["bm25.sqlite", "documents", "manifest.json", "model",
                                 "packages.json", "query_head.npy"])
        with open(os.path.join(self.index, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual((m["format"], m["version"]), ("qkv search index", 2))
        self.assertEqual(m["packages"], 274)
        self.assertEqual((m["dim"], m["document_tokens"], m["epochs"]), (384, 32, 2))
        self.assertEqual(len(m["validation_mrr_at_10"]), 3)  # untrained, then each epoch
        self.assertEqual(m["validation_mrr_at_10"][m["best_epoch"]],
                         max(m["validation_mrr_at_10"]))
        with open(os.path.join(self.index, "packages.json")) as f:
            packages = json.load(f)
        held = [p for p in packages if p["held_out"]]
        self.assertTrue(0 < len(held) < 60, len(held))
        self.assertEqual(m["training_queries"] + m["validation_queries"] + len(held), 274)
        # The model, copied: the index needs nothing outside itself.
        for name in ("config.json", "1_Pooling/config.json", "sentence_bert_config.json",
                     "vocab.txt", "model.safetensors"):
            with open(os.path.join(model_dir(), name), "rb") as a, \
                    open(os.path.join(self.index, "model", name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)
            self.assertIn(f"model/{name}", m["files"])
        head = np.load(os.path.join(self.index, "query_head.npy"))
        self.assertEqual((head.shape, head.dtype), ((384, 384), np.float32))
        # The documents' store: one row per package, sections one-hot.
        info = json.loads(self.ok("store", "info", os.path.join(self.index, "documents"),
                                  "--json").stdout)
        self.assertEqual((info["rows"], info["key_dim"], info["value_dim"], info["dtype"]),
                         (274, 384, len(m["sections"]), "bfloat16"))

    def test_same_bits_at_any_thread_count(self):
        a, b = self.path("a"), self.path("b")
        for out, threads in ((a, 1), (b, 2)):
            r = self.ok(*index_args(out, "--seed", 5, "--threads", threads, "--json"))
            # --json: the manifest on stdout, as the index holds it.
            with open(os.path.join(out, "manifest.json")) as f:
                self.assertEqual(json.loads(r.stdout), json.load(f))
        read = lambda d, n: open(os.path.join(d, n), "rb").read()  # noqa: E731
        for name in ("query_head.npy", "documents/keys-000000.npy"):
            self.assertEqual(read(a, name), read(b, name), name)

    def test_the_summary_is_one_line_naming_the_next_command(self):
        # A name that needs quoting in a shell: the printed command still runs.
        out = self.path("it's an index")
        r = self.ok(*index_args(out))
        lines = r.stdout.splitlines()
        self.assertEqual(len(lines), 1, r.stdout)
        self.assertTrue(lines[0].startswith(f"{out}: 274 packages from {LISTS}; next: "), r.stdout)
        command = lines[0].split("; next: ", 1)[1]
        self.assertTrue(command.startswith("qkv search query --index "), command)
        shell = subprocess.run(["/bin/sh", "-c", shlex.quote(test_cli.QKV) + command[3:] +
                                " --json"], capture_output=True, text=True, timeout=600)
        self.assertEqual(shell.returncode, 0, shell.stderr)
        self.assertEqual(json.loads(shell.stdout)["query"], "a text editor")
        self.assertGreater(len(json.loads(shell.stdout)["results"]), 0)

    def test_the_model_comes_from_the_option_or_the_environment(self):
        out = self.path("i")
        no_model = [arg for arg in index_args(out) if arg != model_dir() and arg != "--model"]
        env = dict(os.environ, QKV_SEARCH_MODEL="")
        r = subprocess.run([test_cli.QKV, *no_model], capture_output=True, text=True,
                           timeout=600, env=env)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("give --model DIR", r.stderr)
        self.assertIn("scripts/model-dir.sh", r.stderr)
        self.assertFalse(os.path.exists(out))
        env["QKV_SEARCH_MODEL"] = model_dir()
        r = subprocess.run([test_cli.QKV, *no_model], capture_output=True, text=True,
                           timeout=600, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(os.listdir(self.dir)), ["i"])
        # A directory that is not a model: named, nothing written.
        not_model = self.path("not-a-model")
        os.mkdir(not_model)
        args = index_args(self.path("j"))
        args[args.index(model_dir())] = not_model
        self.expect_error("search", args, fragments=[not_model, "config.json"])
        self.assertFalse(os.path.exists(self.path("j")))
        self.expect_error("search", index_args(self.path("j")) + ["--document-tokens", "513"],
                          [], ["--document-tokens"])

    def test_existing_output_is_kept(self):
        out = self.path("taken")
        os.mkdir(out)
        with open(os.path.join(out, "mine"), "w") as f:
            f.write("mine")
        r = test_cli.run(*index_args(out))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("already exists", r.stderr)
        self.assertEqual(os.listdir(out), ["mine"])
        self.assertEqual(sorted(os.listdir(self.dir)), ["taken"])

    def test_no_lists(self):
        empty = self.path("empty")
        os.mkdir(empty)
        args = index_args(self.path("i"))
        args[args.index(LISTS)] = empty
        self.expect_error("search", args, fragments=[empty, "Packages"])
        self.assertFalse(os.path.exists(self.path("i")))
        # Packages lists without Translation-en: the command that fetches them.
        no_translations = self.path("no-translations")
        os.mkdir(no_translations)
        for name in os.listdir(LISTS):
            if "Translation" not in name:
                shutil.copy(os.path.join(LISTS, name), no_translations)
        args[args.index(empty)] = no_translations
        self.expect_error("search", args, fragments=["Translation-en", "Acquire::Languages=en"])


class SearchQueryTest(SearchCase):
    def test_engines_rank(self):
        for engine in ("learned", "bm25", "hybrid"):
            r = self.query("interactive plotting program", "--engine", engine, "--top-k", "4")
            self.assertEqual(r["engine"], engine)
            self.assertEqual(len(r["results"]), 4)
            scores = [h["score"] for h in r["results"]]
            self.assertEqual(scores, sorted(scores, reverse=True), engine)
            self.assertTrue(r["results"][0]["package"].startswith("gnuplot"), r)
        # The default engine is the hybrid.
        self.assertEqual(self.query("gnuplot")["engine"], "hybrid")

    def test_a_query_that_names_a_package_finds_it_first(self):
        for engine in ("learned", "hybrid"):  # BM25 is FTS5's ranking as it is
            for text, name in (("gnuplot", "gnuplot"), (" Git ", "git"), ("bc", "bc"),
                               ("libgsl27", "libgsl27")):
                r = self.query(text, "--engine", engine, "--top-k", "3")
                self.assertEqual(r["results"][0]["package"], name, (engine, text))
                names = [h["package"] for h in r["results"]]
                self.assertEqual(len(set(names)), len(names))

    def test_an_unknown_word_falls_back_to_the_nearest_name(self):
        """"gnuplt" is in no document: the engines run "gnuplot", and say so."""
        for engine in ("learned", "hybrid"):
            r = self.query("gnuplt", "--engine", engine, "--top-k", "3")
            self.assertEqual(r["corrected"], "gnuplot")
            self.assertEqual(r["results"][0]["package"], "gnuplot")
        # BM25 is FTS5's ranking as it is.
        r = self.query("gnuplt", "--engine", "bm25")
        self.assertNotIn("corrected", r)
        self.assertEqual(r["results"], [])
        self.assertNotIn("corrected", self.query("gnuplot"))
        out = self.ok("search", "query", "--index", self.index, "plot with gnuplt").stdout
        self.assertEqual(out.splitlines()[0], "(a word of the query is in no package; results "
                                              "for the nearest name: plot with gnuplot)")

    def test_plain_english_finds_what_it_describes(self):
        """Queries in the user's words, none a package's own description and
        none used in training (the hybrid, the default engine): the package
        described is in the top 10."""
        cases = {"draw graphs of data": "gnuplot", "version control system": "git",
                 "compress files": "gzip", "text editor": "emacs",
                 "calculator for the command line": "bc", "compile C programs": "gcc",
                 "search text in files with patterns": "grep", "boot loader": "grub-efi-amd64"}
        for text, name in cases.items():
            names = [h["package"] for h in self.query(text)["results"]]
            self.assertIn(name, names, text)

    def test_many_queries_as_json_lines(self):
        texts = ["interactive plotting program", "gnuplot", "  ", "?!", "compress files"]
        single = [self.query(t) for t in texts if t.strip() and t != "?!"]
        path = self.path("queries.txt")
        with open(path, "w") as f:
            f.write("\n".join(texts) + "\r\n")
        for source, stdin in ((path, None), ("-", "\n".join(texts) + "\n")):
            r = subprocess.run([test_cli.QKV, "search", "query", "--index", self.index,
                                "--queries-file", source], input=stdin, capture_output=True,
                               text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stderr)
            lines = [json.loads(line) for line in r.stdout.splitlines()]
            # Blank lines are skipped; a line without words has no results.
            self.assertEqual([j["query"] for j in lines],
                             ["interactive plotting program", "gnuplot", "?!", "compress files"])
            self.assertEqual(lines[2]["results"], [])
            answered = [j for j in lines if j["query"] != "?!"]
            if stdin is not None:  # one at a time, as `query` answers one
                self.assertEqual(answered, single)
                continue
            # A file's queries are encoded together (the batching moves the
            # embeddings by float32 roundings): the same packages, and the
            # same scores to 1e-5.
            for got, want in zip(answered, single):
                self.assertEqual([h["package"] for h in got["results"]][:3],
                                 [h["package"] for h in want["results"]][:3], got["query"])
                scores = {h["package"]: h["score"] for h in want["results"]}
                for h in got["results"]:
                    if h["package"] in scores:
                        self.assertAlmostEqual(h["score"], scores[h["package"]],
                                               delta=1e-5 * abs(h["score"]) + 1e-7)
        self.expect_error("search", ["search", "query", "--index", self.index, "gnuplot",
                                     "--queries-file", path], [], ["not both"])
        self.expect_error("search", ["search", "query", "--index", self.index], [],
                          ["give a query", "--queries-file"])
        missing = self.path("none.txt")
        self.expect_error("search", ["search", "query", "--index", self.index,
                                     "--queries-file", missing], [], [missing, "no such file"])
        fifo = self.path("fifo")
        os.mkfifo(fifo)
        self.expect_error("search", ["search", "query", "--index", self.index,
                                     "--queries-file", fifo], [], [fifo, "not a regular file"])

    def test_learned_weights_and_sections(self):
        r = self.query("interactive plotting program", "--top-k", "274", "--engine", "learned")
        weights = [h["score"] for h in r["results"]]
        # Softmax weights over every package: all of them sum to 1.
        self.assertAlmostEqual(sum(weights), 1.0, places=4)
        self.assertAlmostEqual(sum(r["sections"].values()), 1.0, places=4)
        # The pooled value is the weights summed per section.
        with open(os.path.join(self.index, "packages.json")) as f:
            packages = {p["name"]: p for p in json.load(f)}
        per_section = {}
        for h in r["results"]:
            s = packages[h["package"]]["section"]
            per_section[s] = per_section.get(s, 0.0) + h["score"]
        for s, w in r["sections"].items():
            self.assertAlmostEqual(w, per_section.get(s, 0.0), places=4, msg=s)

    def test_bm25_is_fts5s_ranking(self):
        """Our BM25 against SQLite FTS5 ranking the index's own table."""
        db = sqlite3.connect(f"file:{os.path.join(self.index, 'bm25.sqlite')}?mode=ro", uri=True)
        with open(os.path.join(self.index, "packages.json")) as f:
            names = [p["name"] for p in json.load(f)]
        queries = ["gnuplot plotting", "interactive plotting program", "python numerical library",
                   "GNU C compiler", "compression tool lz4", "message passing MPI binaries"]
        for text in queries:
            words = sorted(set(re.findall(r"[a-z0-9]+", text.lower())))
            match = " OR ".join(f'"{w}"' for w in words)
            want = [(names[rowid - 1], score) for rowid, score in db.execute(
                "SELECT rowid, bm25(docs) FROM docs WHERE docs MATCH ? "
                "ORDER BY bm25(docs), rowid LIMIT 10", (match,))]
            got = self.query(text, "--engine", "bm25")["results"]
            self.assertEqual([h["package"] for h in got], [n for n, _ in want], text)
            for h, (_, score) in zip(got, want):
                self.assertAlmostEqual(h["score"], -score, places=9, msg=text)

    def test_text_output(self):
        r = self.ok("search", "query", "--index", self.index, "gnuplot", "--top-k", "3",
                    "--engine", "learned")
        lines = r.stdout.splitlines()
        self.assertTrue(lines[0].startswith("rank"))
        self.assertEqual(len(lines), 5)  # header, 3 packages, the sections
        self.assertTrue(lines[-1].startswith("sections"))
        # The old spelling, for one release: the same output and a warning.
        old = test_cli.run("search", "query", "--index", self.index, "gnuplot", "--top", "3",
                           "--engine", "learned")
        self.assertEqual(old.returncode, 0, old.stderr)
        self.assertEqual(old.stdout, r.stdout)
        self.assertEqual(old.stderr, "qkv search query: warning: --top is deprecated and goes "
                                     "in the next release; use --top-k K\n")
        self.expect_error("search", ["search", "query", "--index", self.index, "gnuplot",
                                     "--top", "3", "--top-k", "3"], [], ["--top", "excludes"])
        self.expect_error("search", ["search", "query", "--index", self.index, "gnuplot",
                                     "--top", "0"], [], ["--top"])

    def test_bad_queries_and_indexes(self):
        self.expect_error("search", ["search", "query", "--index", self.index, " !? "],
                          fragments=["no words"])
        missing = self.path("missing")
        self.expect_error("search", ["search", "query", "--index", missing, "gnuplot"],
                          fragments=[missing, "no such index"])
        # What open() reads is checked when it is read; every other file by
        # --verify and qkv search verify.
        for name in ("packages.json", os.path.join("documents", "manifest.json")):
            damaged = self.damaged_copy()
            flip_middle_byte(os.path.join(damaged, name))
            self.expect_error("search", ["search", "query", "--index", damaged, "gnuplot"],
                              fragments=[damaged])
        for name in ("query_head.npy", "bm25.sqlite", "model/model.safetensors",
                     "model/vocab.txt", "documents/keys-000000.npy"):
            damaged = self.damaged_copy()
            flip_middle_byte(os.path.join(damaged, name))
            path = os.path.join(damaged, name)
            self.expect_error("search", ["search", "verify", "--index", damaged],
                              fragments=[path])
            self.expect_error("search", ["search", "query", "--index", damaged, "gnuplot",
                                         "--verify"], fragments=[path])
        os.remove(os.path.join(damaged, "manifest.json"))
        self.expect_error("search", ["search", "eval", "--index", damaged],
                          fragments=["manifest.json"])

    def test_verify(self):
        r = self.ok("search", "verify", "--index", self.index)
        self.assertEqual(r.stdout, f"{self.index}: intact (every file matches its checksum; "
                                   "274 packages)\n")
        self.assertEqual(self.ok("search", "query", "--index", self.index, "gnuplot",
                                 "--verify").stdout,
                         self.ok("search", "query", "--index", self.index, "gnuplot").stdout)

    def test_the_manifest_is_checked_and_checksummed(self):
        """Every number of the manifest that open() uses is checked, and the
        manifest has its own checksum: 1e308 gave NaN scores and invalid
        JSON, -16 reversed the ranking, -1 wrapped to 2^64 - 1; all exit 0."""
        def edited(change, recompute):
            damaged = self.path("edited")
            shutil.rmtree(damaged, ignore_errors=True)
            shutil.copytree(self.index, damaged)
            path = os.path.join(damaged, "manifest.json")
            with open(path) as f:
                manifest = json.load(f)
            change(manifest)
            if recompute:  # a hand edit that fixes the checksum up, as qkv forms it
                body = dict(manifest)
                body.pop("xxh3", None)
                text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
                manifest["xxh3"] = xxh3_64_hex(text.encode())
            with open(path, "w") as f:
                json.dump(manifest, f, indent=1)
            return damaged, path

        # The checksum is formed as this test forms it: a reformatted
        # manifest with its checksum recomputed opens, and ranks the same.
        damaged, _ = edited(lambda m: None, recompute=True)
        self.assertEqual(
            self.ok("search", "query", "--index", damaged, "gnuplot", "--json").stdout,
            self.ok("search", "query", "--index", self.index, "gnuplot", "--json").stdout)
        for member, value, expected in (
                ("score_scale", 1e308, "(0, 1e+06]"),
                ("score_scale", -16.0, "(0, 1e+06]"),
                ("score_scale", "16", "(0, 1e+06]"),
                ("hybrid_weight", float("nan"), "[0, 1e+06]"),
                ("dim", 0, "[1, 65536]"),
                ("dim", 38.4, "[1, 65536]"),
                ("hybrid_fusion", "max", '"linear", "normalized" or "ranks"')):
            def change(m, member=member, value=value):
                m[member] = value
            damaged, path = edited(change, recompute=True)
            shown = "NaN" if value != value else json.dumps(value)
            if member == "hybrid_weight":
                shown = "null"  # json.dump writes NaN; qkv's parser refuses it first
            r = test_cli.run("search", "query", "--index", damaged, "gnuplot", "--json")
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(path, r.stderr)
            if member != "hybrid_weight":
                self.assertIn(f'"{member}" is {shown}', r.stderr)
                self.assertIn(expected, r.stderr)
        # An edit that keeps every number in range is found by the checksum.
        def scale(m):
            m["score_scale"] = m["score_scale"] * 2
        damaged, path = edited(scale, recompute=False)
        self.expect_error("search", ["search", "query", "--index", damaged, "gnuplot"],
                          fragments=[path, '"xxh3"', "does not match", "edited or damaged"])
        # Non-UTF-8 bytes of a damaged manifest reach the message escaped.
        with open(path, "wb") as f:
            f.write(b'{"format": "qkv search index\x93\xff')
        r = subprocess.run([test_cli.QKV, "search", "query", "--index", damaged, "gnuplot"],
                           capture_output=True, timeout=120)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(b"not valid JSON", r.stderr)
        self.assertIn(b"last read: '\"qkv search index\\x93'", r.stderr)
        self.assertTrue(all(32 <= b < 127 for b in r.stderr.rstrip(b"\n")), r.stderr)

    def test_special_files_are_refused_at_once(self):
        """A FIFO in place of an index's file would block its open, and
        /dev/zero would be read until memory runs out: both are refused by
        what they are, exit 2, before a byte is read (test_cli's runs time
        out after 120 s, so a blocked open fails the test)."""
        for name, make, what in (
                ("packages.json", os.mkfifo, "a FIFO"),
                ("manifest.json", os.mkfifo, "a FIFO"),
                ("query_head.npy", lambda p: os.symlink("/dev/zero", p), "a special file"),
                ("bm25.sqlite", os.mkfifo, "a FIFO"),
                (os.path.join("model", "vocab.txt"), os.mkfifo, "a FIFO"),
                ("manifest.json", os.mkdir, "a directory"),
                (os.path.join("documents", "manifest.json"), os.mkfifo, "a FIFO")):
            damaged = self.path("special")
            shutil.rmtree(damaged, ignore_errors=True)
            shutil.copytree(self.index, damaged)
            path = os.path.join(damaged, name)
            os.remove(path)
            make(path)
            self.expect_error("search", ["search", "query", "--index", damaged, "gnuplot"],
                              fragments=[path, "not a regular file", what])


class SearchEvalTest(SearchCase):
    def test_table(self):
        r = self.ok("search", "eval", "--index", self.index, "--quiet")
        self.assertIn("BM25 (SQLite FTS5)", r.stdout)
        self.assertIn("learned (attention)", r.stdout)
        self.assertIn("hybrid vs BM25 MRR@10", r.stdout)
        j = json.loads(self.ok("search", "eval", "--index", self.index, "--json",
                               "--quiet").stdout)
        with open(os.path.join(self.index, "packages.json")) as f:
            held = sum(p["held_out"] for p in json.load(f))
        self.assertEqual(j["queries"], held)
        for engine in ("bm25", "learned", "hybrid"):
            m = j[engine]
            self.assertTrue(0 <= m["recall_at_1"] <= m["mrr_at_10"] <= m["recall_at_10"] <= 1, m)
            self.assertGreater(m["ms_per_query"], 0)
        # Our BM25 gives FTS5's own query's top 10 on every query checked.
        self.assertEqual(j["fts5_check"]["compared"], held)
        self.assertEqual(j["fts5_check"]["same_top_10"], held)
        # BM25 finds most held-out packages of this small corpus by their words.
        self.assertGreater(j["bm25"]["recall_at_10"], 0.5)


class SearchEncodeTest(SearchCase):
    def test_encodings_are_the_queries_the_learned_engine_attends_with(self):
        """Attention over the index's document store with the encodings, at
        the manifest's score scale, gives the learned engine's weights."""
        texts = ["interactive plotting program", "compress files"]
        out = self.path("q.npy")
        self.ok("search", "encode", "--index", self.index, *texts, "--out", out)
        q = np.load(out)
        self.assertEqual((q.shape, q.dtype), ((2, 384), np.float32))
        with open(os.path.join(self.index, "manifest.json")) as f:
            scale = json.load(f)["score_scale"]
        with open(os.path.join(self.index, "packages.json")) as f:
            names = [p["name"] for p in json.load(f)]
        ids, weights = self.path("ids.npy"), self.path("w.npy")
        self.ok("attend", "--store", os.path.join(self.index, "documents"), "--queries", out,
                "--scale", repr(scale), "--out", self.path("o.npy"), "--top-k", len(names),
                "--top-ids", ids, "--top-weights", weights, "--quiet")
        ids, weights = np.load(ids), np.load(weights)
        for i, text in enumerate(texts):
            got = {names[j]: w for j, w in zip(ids[i], weights[i])}
            for hit in self.query(text, "--top-k", len(names), "--engine", "learned")["results"]:
                self.assertAlmostEqual(got[hit["package"]], hit["score"], places=5,
                                       msg=f"{text}: {hit['package']}")

    def test_held_out_queries_in_the_indexs_order(self):
        out, ids = self.path("h.npy"), self.path("hid.npy")
        self.ok("search", "encode", "--index", self.index, "--held-out", "--out", out,
                "--ids", ids)
        with open(os.path.join(self.index, "packages.json")) as f:
            packages = json.load(f)
        want = [i for i, p in enumerate(packages) if p["held_out"]]
        q, got_ids = np.load(out), np.load(ids)
        self.assertEqual(got_ids.dtype, np.int64)
        self.assertEqual(got_ids.tolist(), want)
        # Row i is the encoding of package ids[i]'s short description.
        texts = [packages[i]["short_description"] for i in want[:3]]
        self.ok("search", "encode", "--index", self.index, *texts, "--out", self.path("t.npy"))
        # Encoded in other batches (grouped by length, padded otherwise): the
        # same to float32 rounding (9e-8 seen).
        np.testing.assert_allclose(np.load(self.path("t.npy")), q[:3], rtol=0, atol=1e-6)

    def test_errors(self):
        out = self.path("q.npy")
        encode = ["search", "encode", "--index", self.index]
        self.expect_error("search", encode + ["--out", out], [out], ["texts to encode",
                                                                     "--held-out"])
        self.expect_error("search", encode + ["--held-out", "x", "--out", out], [out],
                          ["not both"])
        self.expect_error("search", encode + ["x", "--out", out, "--ids", self.path("i.npy")],
                          [out, self.path("i.npy")], ["--ids", "goes with --held-out"])
        inside = os.path.join(self.index, "documents", "manifest.json")
        with open(inside, "rb") as f:
            manifest = f.read()
        self.expect_error("search", encode + ["x", "--out", inside], [],
                          ["--out " + inside, "is inside --index", "search index's files"])
        with open(inside, "rb") as f:
            self.assertEqual(f.read(), manifest)
        self.expect_error("search", ["search", "encode", "--index", self.path("none"), "x",
                                     "--out", out], [out], ["none"])
        self.expect_error("search", encode + ["x"], [], ["--out"])


if __name__ == "__main__":
    test_cli.main()
