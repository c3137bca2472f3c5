#!/usr/bin/python3
"""Writes apps/search/unicode_data.inc: what the WordPiece tokenizer's
normaliser and pre-tokeniser need to know of each code point.

Run by hand, with Debian 12's /usr/bin/python3 (3.11, whose unicodedata is
Unicode 14.0.0), from the top of the source tree:

    scripts/gen-unicode-data.py > apps/search/unicode_data.inc

The tokenizer (apps/search/wordpiece.cc) must give the same ids as the
reference, Hugging Face's tokenizers (0.23.3) with the all-MiniLM-L6-v2
tokenizer.json: BertNormalizer (clean_text, handle_chinese_chars,
strip_accents, lowercase) then BertPreTokenizer. Their rules, per code point:

  clean_text    drop U+0000, U+FFFD and "control" characters (general
                category Cc, Cf, Co or Cs, but not \\t \\n \\r); make
                "whitespace" (\\t \\n \\r and the White_Space property) a space
  chinese       put spaces around the CJK ideograph blocks (a fixed list)
  strip_accents NFD over the whole text, then drop nonspacing marks (Mn)
  lowercase     each character's full lower case (not the final-sigma rule)
  pre-tokenise  split at spaces; isolate punctuation (ASCII punctuation and
                general category P*)

The reference is written in Rust and reads its Unicode data from crates
of different ages (the ages are what the differences below show): the
general categories (Mn, Cc/Cf/Co, P*) from unicode_categories (Unicode
8.0), NFD and the canonical combining classes from
unicode-normalization-alignments (Unicode 9.0), lower case and White_Space
from Rust's standard library (Unicode 17). This script starts from
Python's Unicode 14.0 and applies the differences listed below (REFERENCE_*),
which were found by comparing every code point with the reference
(tests/search/test_tokenizer_peer.py, CodePointTest, does it on every run and
names any code point that disagrees; after a change of the reference, run it,
update the lists, and run this script again).

The output, for the C++ in apps/search/unicode_data.cc:

  kRanges    code points by kind, as sorted ranges [first, last] (with the
             combining class of marks that are kept); a code point in no
             range is a word character that stays as it is
  kMappings  code points whose normalised form differs from themselves
             (lower case, accents stripped), sorted, as UTF-8 in
             kMappingText; Hangul syllables are left out (wordpiece.cc
             decomposes them by the algorithm of Unicode 3.12)

and the script asserts what the C++ relies on (see check_invariants).
"""

import sys
import unicodedata

UNICODE_VERSION = "14.0.0"

# ---- where the reference's crates differ from Python's Unicode 14.0 ----

# Nonspacing marks (Mn) in Unicode 14.0 that unicode_categories (8.0) does
# not know: strip_accents keeps them.
REFERENCE_NOT_MN = [
    (0x07FD, 0x07FD), (0x0898, 0x089F), (0x08CA, 0x08E1), (0x09FE, 0x09FE), (0x0AFA, 0x0AFF),
    (0x0B55, 0x0B55), (0x0C04, 0x0C04), (0x0C3C, 0x0C3C), (0x0D00, 0x0D00), (0x0D3B, 0x0D3C),
    (0x0D81, 0x0D81), (0x0EBA, 0x0EBA), (0x180F, 0x180F), (0x1885, 0x1886), (0x1ABF, 0x1ACE),
    (0x1DF6, 0x1DFB), (0xA82C, 0xA82C), (0xA8C5, 0xA8C5), (0xA8FF, 0xA8FF), (0xA9BD, 0xA9BD),
    (0x10D24, 0x10D27), (0x10EAB, 0x10EAC), (0x10F46, 0x10F50), (0x10F82, 0x10F85),
    (0x11070, 0x11070), (0x11073, 0x11074), (0x110C2, 0x110C2), (0x111C9, 0x111C9),
    (0x111CF, 0x111CF), (0x1123E, 0x1123E), (0x1133B, 0x1133B), (0x11438, 0x1143F),
    (0x11442, 0x11444), (0x11446, 0x11446), (0x1145E, 0x1145E), (0x1182F, 0x11837),
    (0x11839, 0x1183A), (0x1193B, 0x1193C), (0x1193E, 0x1193E), (0x11943, 0x11943),
    (0x119D4, 0x119D7), (0x119DA, 0x119DB), (0x119E0, 0x119E0), (0x11A01, 0x11A0A),
    (0x11A33, 0x11A38), (0x11A3B, 0x11A3E), (0x11A47, 0x11A47), (0x11A51, 0x11A56),
    (0x11A59, 0x11A5B), (0x11A8A, 0x11A96), (0x11A98, 0x11A99), (0x11C30, 0x11C36),
    (0x11C38, 0x11C3D), (0x11C3F, 0x11C3F), (0x11C92, 0x11CA7), (0x11CAA, 0x11CB0),
    (0x11CB2, 0x11CB3), (0x11CB5, 0x11CB6), (0x11D31, 0x11D36), (0x11D3A, 0x11D3A),
    (0x11D3C, 0x11D3D), (0x11D3F, 0x11D45), (0x11D47, 0x11D47), (0x11D90, 0x11D91),
    (0x11D95, 0x11D95), (0x11D97, 0x11D97), (0x11EF3, 0x11EF4), (0x16F4F, 0x16F4F),
    (0x16FE4, 0x16FE4), (0x1CF00, 0x1CF2D), (0x1CF30, 0x1CF46), (0x1E000, 0x1E006),
    (0x1E008, 0x1E018), (0x1E01B, 0x1E021), (0x1E023, 0x1E024), (0x1E026, 0x1E02A),
    (0x1E130, 0x1E136), (0x1E2AE, 0x1E2AE), (0x1E2EC, 0x1E2EF), (0x1E944, 0x1E94A),
]
# Spacing marks (Mc) in 14.0 that were Mn in 8.0 (HANUNOO SIGN PAMUDPOD): dropped.
REFERENCE_MN_ONLY = [(0x1734, 0x1734)]
# Format characters (Cf) new since 8.0: the reference keeps them.
REFERENCE_NOT_CF = [(0x0890, 0x0891), (0x08E2, 0x08E2), (0x110CD, 0x110CD), (0x13430, 0x13438)]
# Punctuation (P*) new since 8.0: not isolated by the reference.
REFERENCE_NOT_PUNCTUATION = [
    (0x061D, 0x061D), (0x09FD, 0x09FD), (0x0A76, 0x0A76), (0x0C77, 0x0C77), (0x0C84, 0x0C84),
    (0x1B7D, 0x1B7E), (0x2E43, 0x2E4F), (0x2E52, 0x2E5D), (0x10EAD, 0x10EAD),
    (0x10F55, 0x10F59), (0x10F86, 0x10F89), (0x1144B, 0x1144F), (0x1145A, 0x1145B),
    (0x1145D, 0x1145D), (0x11660, 0x1166C), (0x116B9, 0x116B9), (0x1183B, 0x1183B),
    (0x11944, 0x11946), (0x119E2, 0x119E2), (0x11A3F, 0x11A46), (0x11A9A, 0x11A9C),
    (0x11A9E, 0x11AA2), (0x11C41, 0x11C45), (0x11C70, 0x11C71), (0x11EF7, 0x11EF8),
    (0x11FFF, 0x11FFF), (0x12FF1, 0x12FF2), (0x16E97, 0x16E9A), (0x16FE2, 0x16FE2),
    (0x1E95E, 0x1E95F),
]
# Punctuation in 8.0 that 14.0 made a symbol (CANADIAN SYLLABICS CHI SIGN,
# So) or a mark (SHARADA SANDHI MARK, Mn): isolated by the reference.
REFERENCE_PUNCTUATION_ONLY = [(0x166D, 0x166D), (0x111C9, 0x111C9)]
# Canonical decompositions new since 9.0 (DIVES AKURU VOWEL SIGN O, 13.0):
# NFD leaves the character as it is.
REFERENCE_NO_DECOMPOSITION = [(0x11938, 0x11938)]
# Marks with a non-zero combining class in 14.0 that are new since 9.0:
# for the reference's NFD they are starters (class 0), never reordered.
# Only those that strip_accents keeps matter (listed).
REFERENCE_STARTERS = [
    (0x07FD, 0x07FD), (0x0898, 0x089F), (0x08CA, 0x08D3), (0x09FE, 0x09FE), (0x0C3C, 0x0C3C),
    (0x0D3B, 0x0D3C), (0x0EBA, 0x0EBA), (0x1715, 0x1715), (0x1ABF, 0x1ACE), (0x1DF6, 0x1DFA),
    (0xA82C, 0xA82C), (0x10D24, 0x10D27), (0x10EAB, 0x10EAC), (0x10F46, 0x10F50),
    (0x10F82, 0x10F85), (0x11070, 0x11070), (0x1133B, 0x1133B), (0x1145E, 0x1145E),
    (0x11839, 0x1183A), (0x1193D, 0x1193E), (0x11943, 0x11943), (0x119E0, 0x119E0),
    (0x11A34, 0x11A34), (0x11A47, 0x11A47), (0x11A99, 0x11A99), (0x11D42, 0x11D42),
    (0x11D44, 0x11D45), (0x11D97, 0x11D97), (0x16FF0, 0x16FF1), (0x1E130, 0x1E136),
    (0x1E2AE, 0x1E2AE), (0x1E2EC, 0x1E2EF),
]
# Lower case of letters new since 14.0 (Rust's standard library, Unicode 17).
REFERENCE_LOWERCASE = {
    0x1C89: 0x1C8A, 0xA7CB: 0x0264, 0xA7CC: 0xA7CD, 0xA7CE: 0xA7CF, 0xA7D2: 0xA7D3,
    0xA7D4: 0xA7D5, 0xA7DA: 0xA7DB, 0xA7DC: 0x019B,
    **{cp: cp + 0x20 for cp in range(0x10D50, 0x10D66)},  # GARAY CAPITAL LETTER A ..
    **{cp: cp + 0x1B for cp in range(0x16EA0, 0x16EB9)},  # BERIA ERFE CAPITAL LETTER ARKAB ..
}

# White_Space (PropList.txt, unchanged since Unicode 6.3): Rust's char::is_whitespace.
WHITE_SPACE = [(0x0009, 0x000D), (0x0020, 0x0020), (0x0085, 0x0085), (0x00A0, 0x00A0),
               (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F),
               (0x205F, 0x205F), (0x3000, 0x3000)]
# BertNormalizer's "Chinese characters" (is_chinese_char, a fixed list of blocks).
CHINESE = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
           (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]

HANGUL_FIRST, HANGUL_LAST = 0xAC00, 0xD7A3
MAX_CP = 0x10FFFF

# Kinds, as apps/search/unicode_data.h's enum CharKind numbers them.
WORD, DROP, MARK_STARTER, MARK_COMBINING, SPACE, PUNCTUATION, CHINESE_KIND = range(7)
KIND_NAMES = ["kWord", "kDrop", "kMarkStarter", "kMarkCombining", "kSpace", "kPunctuation",
              "kChinese"]


def in_ranges(cp, ranges):
    return any(a <= cp <= b for a, b in ranges)


def is_surrogate(cp):
    return 0xD800 <= cp <= 0xDFFF


def category(cp):
    return unicodedata.category(chr(cp))


def is_mn(cp):
    if in_ranges(cp, REFERENCE_MN_ONLY):
        return True
    return category(cp) == "Mn" and not in_ranges(cp, REFERENCE_NOT_MN)


def is_other(cp):  # clean_text's "control": Cc, Cf, Co, Cs (not Cn)
    if category(cp) == "Cf" and in_ranges(cp, REFERENCE_NOT_CF):
        return False
    return category(cp) in ("Cc", "Cf", "Co", "Cs")


def is_punctuation(cp):
    if cp < 0x80:
        c = chr(cp)
        return c.isprintable() and not c.isalnum() and c != " "
    if in_ranges(cp, REFERENCE_PUNCTUATION_ONLY):
        return True
    return category(cp).startswith("P") and not in_ranges(cp, REFERENCE_NOT_PUNCTUATION)


def combining_class(cp):
    if in_ranges(cp, REFERENCE_STARTERS):
        return 0
    return unicodedata.combining(chr(cp))


def nfd(cp):
    if in_ranges(cp, REFERENCE_NO_DECOMPOSITION):
        return [cp]
    return [ord(c) for c in unicodedata.normalize("NFD", chr(cp))]


def lower(cp):
    if cp in REFERENCE_LOWERCASE:
        return [REFERENCE_LOWERCASE[cp]]
    return [ord(c) for c in chr(cp).lower()]


def entry(cp):
    """(kind, combining class, normalised code points) of one code point."""
    if cp == 0 or cp == 0xFFFD or (cp not in (0x9, 0xA, 0xD) and is_other(cp)):
        return DROP, 0, []
    if cp in (0x9, 0xA, 0xD) or in_ranges(cp, WHITE_SPACE):
        return SPACE, 0, [0x20]
    decomposed = nfd(cp)
    out = [x for c in decomposed if not is_mn(c) for x in lower(c)]
    if not out:
        # Dropped by strip_accents: a starter ends a run of combining marks.
        return (MARK_STARTER if combining_class(decomposed[0]) == 0 else MARK_COMBINING), 0, []
    if in_ranges(cp, CHINESE):
        return CHINESE_KIND, 0, out
    if len(out) == 1 and is_punctuation(out[0]):
        return PUNCTUATION, 0, out
    ccc = combining_class(cp) if out == [cp] else 0
    return WORD, ccc, out


def check_invariants(entries):
    """What apps/search/unicode_data.cc and wordpiece.cc rely on."""
    for cp, (kind, ccc, out) in entries.items():
        # The ASCII fast path: ASCII maps to ASCII, one byte.
        if cp < 0x80:
            assert all(o < 0x80 for o in out) and len(out) <= 1, hex(cp)
        if kind == WORD:
            # A word character's output holds no punctuation and no space.
            assert all(not is_punctuation(o) and o != 0x20 for o in out), hex(cp)
        if out and out != [cp]:
            decomposed = nfd(cp)
            # A mapped character starts with a starter (it ends a run of
            # combining marks before its own output), and a starter that
            # strip_accents drops later in its decomposition ends no run
            # (only dropped marks since the last starter: ORIYA VOWEL SIGN
            # AI is 0B47 0B56, both starters), so the C++ ends a run only
            # before the output and then reads each output character's class.
            assert combining_class(decomposed[0]) == 0, hex(cp)
            open_run = False
            for c in decomposed:
                if combining_class(c) == 0:
                    assert not (is_mn(c) and open_run), hex(cp)
                    open_run = False
                elif not is_mn(c):
                    open_run = True
            # Each output character is a fixed point of the same kind, so
            # the C++ reads its combining class from its own entry.
            for o in out:
                ok, occc, oout = entries.get(o, (WORD, 0, [o]))
                assert oout == [o], (hex(cp), hex(o))
                assert ok == kind or (kind == WORD and ok == WORD), (hex(cp), hex(o))
        if kind in (PUNCTUATION, CHINESE_KIND):
            assert len(out) == 1 and ccc == 0, hex(cp)
        if ccc:
            assert kind == WORD and out == [cp], hex(cp)
    # Hangul syllables: NFD is the algorithm's L V (T), jamo that are word
    # characters and stay as they are.
    for cp in range(HANGUL_FIRST, HANGUL_LAST + 1):
        s = cp - HANGUL_FIRST
        jamo = [0x1100 + s // 588, 0x1161 + (s % 588) // 28] + ([0x11A7 + s % 28] if s % 28 else [])
        assert entries[cp] == (WORD, 0, jamo), hex(cp)
        for j in jamo:
            assert j not in entries, hex(j)


def main():
    if unicodedata.unidata_version != UNICODE_VERSION:
        sys.exit(f"{sys.argv[0]}: this Python's unicodedata is Unicode "
                 f"{unicodedata.unidata_version}; the lists of differences are against "
                 f"{UNICODE_VERSION} (Debian 12's /usr/bin/python3)")
    entries = {}  # every code point that is not a word character staying as it is
    for cp in range(MAX_CP + 1):
        if is_surrogate(cp):
            continue
        e = entry(cp)
        if e != (WORD, 0, [cp]):
            entries[cp] = e
    check_invariants(entries)

    # Ranges of equal (kind, ccc); word characters without a class are the default.
    ranges = []
    for cp in sorted(entries):
        kind, ccc, _ = entries[cp]
        if kind == WORD and ccc == 0:
            continue
        if ranges and ranges[-1][1] == cp - 1 and ranges[-1][2:] == [kind, ccc]:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp, kind, ccc])
    mappings = [(cp, out) for cp, (kind, ccc, out) in sorted(entries.items())
                if out and out != [cp] and kind != SPACE
                and not HANGUL_FIRST <= cp <= HANGUL_LAST]
    text = bytearray()
    offsets = {}
    rows = []
    for cp, out in mappings:
        utf8 = "".join(map(chr, out)).encode()
        if utf8 not in offsets:  # shared outputs ("a" for the 30-odd accented a's)
            offsets[utf8] = len(text)
            text += utf8
        assert len(utf8) < 256
        rows.append((cp, offsets[utf8], len(utf8)))
    assert len(text) < 1 << 16

    w = sys.stdout.write
    w("// GENERATED by scripts/gen-unicode-data.py from Python "
      f"{sys.version.split()[0]}'s unicodedata (Unicode {UNICODE_VERSION})\n"
      "// with the reference's differences listed there; do not edit. What the\n"
      "// WordPiece tokenizer's normaliser and pre-tokeniser know of each code\n"
      "// point (apps/search/unicode_data.h): included by unicode_data.cc only.\n")
    w(f"// {len(ranges)} ranges, {len(rows)} mappings, {len(text)} bytes of mapped text.\n\n")
    w("constexpr CharRange kRanges[] = {\n")
    for a, b, kind, ccc in ranges:
        w(f"    {{0x{a:04X}, 0x{b:04X}, CharKind::{KIND_NAMES[kind]}, {ccc}}},\n")
    w("};\n\n")
    w("constexpr CharMapping kMappings[] = {\n")
    for i in range(0, len(rows), 4):
        w("   " + "".join(f" {{0x{cp:04X}, {off}, {n}}}," for cp, off, n in rows[i:i + 4]) + "\n")
    w("};\n\n")
    w("constexpr char kMappingText[] =\n")
    for i in range(0, len(text), 24):
        w('    "' + "".join(f"\\x{b:02x}" for b in text[i:i + 24]) + '"\n')
    w(";\n")


if __name__ == "__main__":
    main()
