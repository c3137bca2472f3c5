#!/usr/bin/python3
"""Tests of `qkv lookup`: the key-value database of d2l §11.1 through the
command line — exact, approximate and average lookups of the chapter's names
and of a CSV table, the text and --json outputs (the top K by default, every
record's weight with --all), the approximate weights against a plain Python
loop, bit for bit, and every error path with its exit status. The harness
(running qkv, temporary directories, expect_error) is test_cli.py's.

Usage: test_lookup.py --qkv PATH [unittest arguments, e.g. a TestCase name]
"""

import csv
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cli  # noqa: E402  (the harness; its QKV is set in main())

NAMES = [("Zhang", "Aston"), ("Lipton", "Zachary"), ("Li", "Mu"), ("Smola", "Alex"),
         ("Hu", "Rachel"), ("Werness", "Brent")]


class LookupTest(test_cli.CliTest):
    def lookup(self, *args):
        """Runs `qkv lookup ARGS --json`, which must succeed; returns the result
        (with "records", every record's weight, when ARGS hold --all)."""
        r = self.ok("lookup", *args, "--json")
        lines = r.stdout.strip().splitlines()
        self.assertEqual(len(lines), 1, f"--json prints one line\n{r.stdout}")
        return json.loads(lines[0])

    def write_table(self, text, name="table.csv"):
        path = self.path(name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def records(self, result):
        return [(r["key"], r["value"]) for r in result["records"]]

    def weights(self, result):
        return [r["weight"] for r in result["records"]]


class ExactTest(LookupTest):
    def test_li_is_mu_with_one_hot_weights(self):
        result = self.lookup("--query", "Li", "--mode", "exact", "--all")
        self.assertEqual(self.records(result), NAMES)
        self.assertEqual(result["match"], {"key": "Li", "value": "Mu"})
        self.assertEqual(self.weights(result), [0, 0, 1, 0, 0, 0])
        self.assertEqual((result["top"][0]["key"], result["top"][0]["value"]), ("Li", "Mu"))
        self.assertIsNone(result["temperature"])

    def test_text_output(self):
        out = self.ok("lookup", "--query", "Li", "--mode", "exact").stdout
        self.assertEqual(out, 'query "Li", mode exact, 6 records\n'
                              "match: Li -> Mu\n"
                              "\n"
                              "top 3\n"
                              "  rank  key     value    weight\n"
                              "  1     Li      Mu       1.000000\n"
                              "  2     Zhang   Aston    0.000000\n"
                              "  3     Lipton  Zachary  0.000000\n")

    def test_missing_key_exits_1(self):
        for args in (["--query", "Lee"], ["--query", "Li", "--remove", "Li"],
                     ["--query", "Lee", "--all"], ["--query", "Lee", "--json", "--all"]):
            r = test_cli.run("lookup", "--mode", "exact", *args)
            self.assertEqual(r.returncode, 1, r.stderr)
            key = args[1]
            self.assertEqual(r.stderr, f'qkv lookup: error: no record with key "{key}"\n')
            self.assertEqual(r.stdout, "")


class ApproximateTest(LookupTest):
    def test_li_without_mu_retrieves_lipton(self):
        result = self.lookup("--query", "Li", "--remove", "Li")
        self.assertEqual(result["num_records"], 5)
        top = result["top"][0]
        self.assertEqual((top["key"], top["value"]), ("Lipton", "Zachary"))
        self.assertEqual(result["mode"], "approximate")
        self.assertEqual(result["temperature"], 0.1)
        self.assertIsNone(result["match"])

    def test_weights_positive_and_sum_to_one(self):
        for query in ("Li", "Smola", "nobody"):
            w = self.weights(self.lookup("--query", query, "--temperature", "0.5", "--all"))
            self.assertTrue(all(x > 0 for x in w), w)
            self.assertAlmostEqual(sum(w), 1.0, places=12)

    def test_lower_temperature_sharpens(self):
        maxima = [self.lookup("--query", "Li", "--remove", "Li", "--temperature", t)["top"][0]
                  ["weight"] for t in ("5", "1", "0.1", "0.02")]
        self.assertEqual(maxima, sorted(maxima))
        self.assertEqual(len(set(maxima)), len(maxima))

    def test_the_smallest_temperatures_give_the_limit_and_valid_json(self):
        """A temperature as small as 5e-324 gave NaN weights and bare `nan`
        in the JSON (similarity / T overflowed): the limit T -> 0 is the
        weight shared by the keys of the largest similarity, and the output
        is JSON that a strict parser reads."""
        def strict(text):
            raise ValueError(f"not JSON: {text}")
        for t in ("5e-324", "1e-310", "1e-300"):
            r = self.ok("lookup", "--query", "Li", "--remove", "Li", "--temperature", t, "--json",
                        "--all")
            result = json.loads(r.stdout, parse_constant=strict)
            w = self.weights(result)
            self.assertTrue(all(x in (0.0, 1.0) for x in w), (t, w))
            self.assertEqual(sum(w), 1.0)
            # The nearest key at T = 0.02 holds the whole weight at T -> 0.
            near = self.weights(self.lookup("--query", "Li", "--remove", "Li",
                                            "--temperature", "0.02", "--all"))
            self.assertEqual(w.index(1.0), near.index(max(near)))

    def test_top_k_order(self):
        result = self.lookup("--query", "Li", "--top-k", "4")
        top = result["top"]
        self.assertEqual([t["rank"] for t in top], [1, 2, 3, 4])
        self.assertEqual([t["key"] for t in top[:2]], ["Li", "Lipton"])
        ws = [t["weight"] for t in top]
        self.assertEqual(ws, sorted(ws, reverse=True))
        self.assertEqual(len(self.lookup("--query", "Li", "--top-k", "100")["top"]), 6)
        self.assertEqual(len(self.lookup("--query", "Li")["top"]), 3)

    def test_the_old_top_spelling_still_works_and_says_it_is_deprecated(self):
        r = test_cli.run("lookup", "--query", "Li", "--top", "4", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr, "qkv lookup: warning: --top is deprecated and goes in the "
                                   "next release; use --top-k K\n")
        self.assertEqual(json.loads(r.stdout), self.lookup("--query", "Li", "--top-k", "4"))

    def test_text_output(self):
        out = self.ok("lookup", "--query", "Li", "--remove", "Li").stdout
        self.assertIn('query "Li", mode approximate, temperature 0.1, 5 records', out)
        top = out[out.index("top 3"):].splitlines()
        self.assertTrue(top[2].split()[:3] == ["1", "Lipton", "Zachary"], out)


class TopAndAllTest(LookupTest):
    """By default the top K only; --all adds every record's weight."""

    def table(self, n, seed):
        """A CSV of n distinct random keys over a small alphabet (many shared
        n-grams, many equal weights), with multibyte UTF-8; returns (path, keys)."""
        rng = random.Random(seed)
        pieces = ["a", "b", "c", "A", "ab", "ba", "-", "\u00e9", "\u65e5", "lib", "py"]
        keys = []
        seen = set()
        while len(keys) < n:
            key = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
            if key not in seen:
                seen.add(key)
                keys.append(key)
        path = self.path(f"table{n}.csv")
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["key", "value"])
            for i, key in enumerate(keys):
                w.writerow([key, f"v{i}"])
        return path, keys

    def test_default_prints_the_top_k_only(self):
        path, keys = self.table(2000, 1)
        out = self.ok("lookup", "--table", path, "--query", "abc").stdout
        lines = out.splitlines()
        self.assertEqual(lines[0], 'query "abc", mode approximate, temperature 0.1, 2000 records')
        self.assertNotIn("weights", out)
        self.assertEqual(lines[2:4], ["top 3", lines[3]])
        self.assertEqual(len(lines), 7, out)
        result = self.lookup("--table", path, "--query", "abc", "--top-k", "5")
        self.assertNotIn("records", result)
        self.assertEqual(result["num_records"], 2000)
        self.assertEqual([t["rank"] for t in result["top"]], [1, 2, 3, 4, 5])

    def test_all_prints_every_weight_and_the_same_top(self):
        path, keys = self.table(300, 2)
        for k in ("1", "3", "400"):
            with self.subTest(k=k):
                top = self.lookup("--table", path, "--query", "liba", "--top-k", k)
                every = self.lookup("--table", path, "--query", "liba", "--top-k", k, "--all")
                self.assertEqual(every["top"], top["top"])
                self.assertEqual([r["key"] for r in every["records"]], keys)
                w = self.weights(every)
                self.assertAlmostEqual(sum(w), 1.0, places=12)
                # The top K are the K largest of --all's weights, equal ones in table order.
                order = sorted(range(len(w)), key=lambda j: (-w[j], j))[:int(k)]
                self.assertEqual([t["key"] for t in top["top"]], [keys[j] for j in order])
                self.assertEqual([t["weight"] for t in top["top"]], [w[j] for j in order])
        out = self.ok("lookup", "--table", path, "--query", "liba", "--all").stdout
        self.assertIn("\nweights\n", out)
        # The header line, a blank line, "weights" and its column names, 300
        # records; a blank line, "top 3" and its column names, 3 records.
        self.assertEqual(len(out.splitlines()), 4 + 300 + 3 + 3, out[:300])

    def test_weights_are_the_plain_loops_bit_for_bit(self):
        """The index's weights against a loop over every key in Python: the
        cosine of bigram and trigram counts (bytes of the ASCII-lower-cased key
        padded as ^key$), exp((s - max) / T), over math.fsum of them."""
        path, keys = self.table(400, 3)

        def grams(key):
            b = key.encode()
            p = b"^" + bytes(c + 32 if 65 <= c <= 90 else c for c in b) + b"$"
            g = {}
            for n in (2, 3):
                for i in range(len(p) - n + 1):
                    g[p[i:i + n]] = g.get(p[i:i + n], 0) + 1
            return g

        def cosine(q, k):
            dot = sum(c * k.get(g, 0) for g, c in q.items())
            return dot / (math.sqrt(sum(c * c for c in q.values()))
                          * math.sqrt(sum(c * c for c in k.values())))

        key_grams = [grams(k) for k in keys]
        for query in ("abc", "LIB\u00e9", "zzz", "", keys[7]):
            for t in (0.1, 1.0, 1e-300):
                with self.subTest(query=query, t=t):
                    q = grams(query)
                    s = [cosine(q, g) for g in key_grams]
                    m = max(s)
                    e = [math.exp((x - m) / t) for x in s]
                    z = math.fsum(e)
                    ref = [x / z for x in e]
                    got = self.lookup("--table", path, "--query", query, "--temperature",
                                      repr(t), "--all", "--top-k", "10")
                    self.assertEqual(self.weights(got), ref)
                    order = sorted(range(len(ref)), key=lambda j: (-ref[j], j))[:10]
                    self.assertEqual([r["key"] for r in got["top"]], [keys[j] for j in order])


class AverageTest(LookupTest):
    def test_uniform_weights(self):
        result = self.lookup("--query", "anything", "--mode", "average", "--remove", "Hu",
                             "--all")
        self.assertEqual(self.weights(result), [0.2] * 5)
        self.assertEqual([t["key"] for t in result["top"]], ["Zhang", "Lipton", "Li"])


class TableTest(LookupTest):
    def test_custom_csv(self):
        path = self.write_table('value,key,note\nred,apple,x\nyellow,banana,y\n'
                                '"purple, dark",grape,z\n')
        result = self.lookup("--table", path, "--query", "grape", "--mode", "exact", "--all")
        self.assertEqual(self.records(result),
                         [("apple", "red"), ("banana", "yellow"), ("grape", "purple, dark")])
        self.assertEqual(result["match"]["value"], "purple, dark")
        result = self.lookup("--table", path, "--query", "banan", "--top-k", "1")
        self.assertEqual(result["top"][0]["value"], "yellow")

    def test_bad_tables_exit_2(self):
        cases = {
            "nokey.csv": ("name,value\na,1\n", ["key and value"]),
            "dup.csv": ("key,value\na,1\nb,2\na,3\n", ["dup.csv", '"a"', "twice"]),
            "empty.csv": ("key,value\n", ["no data rows"]),
            "ragged.csv": ("key,value\na,1\nb\n", ["line 3"]),
            "quote.csv": ('key,value\n"a,1\n', ["never closed"]),
        }
        for name, (text, fragments) in cases.items():
            with self.subTest(name):
                path = self.write_table(text, name)
                self.expect_error("lookup", ["lookup", "--table", path, "--query", "a"], [],
                                  fragments)
        missing = self.path("missing.csv")
        self.expect_error("lookup", ["lookup", "--table", missing, "--query", "a"], [],
                          ["missing.csv"])


class UsageTest(LookupTest):
    def test_bad_options_exit_2(self):
        cases = [
            (["--query", "Li", "--temperature", "0"], ["--temperature"]),
            (["--query", "Li", "--temperature", "-1"], ["--temperature"]),
            (["--query", "Li", "--temperature", "nan"], ["--temperature"]),
            (["--query", "Li", "--top-k", "0"], ["--top-k"]),
            (["--query", "Li", "--top", "0"], ["--top"]),
            (["--query", "Li", "--top-k", "2", "--top", "2"], ["--top", "excludes"]),
            (["--query", "Li", "--mode", "fuzzy"], ["--mode"]),
            (["--query", "Li", "--mode", "exact", "--temperature", "1"], ["--temperature"]),
            (["--query", "Li", "--remove", "Lee"], ["--remove", '"Lee"']),
            (["--mode", "exact"], ["--query"]),
        ]
        for args, fragments in cases:
            with self.subTest(args=args):
                self.expect_error("lookup", ["lookup"] + args, [], fragments)


if __name__ == "__main__":
    test_cli.main()
