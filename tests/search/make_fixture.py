#!/usr/bin/python3
"""Writes tests/search/lists/, the search tests' small apt lists directory.

From an apt lists directory (default /var/lib/apt/lists, Debian 12 with
Translation-en fetched), it keeps a fixed set of well-known packages plus
every package whose name's MD5 starts below 0x0104 (260 in 65536: ~250 picked
blindly), of bookworm main. Their stanzas keep only Package, Version,
Section, Tag, Description, Description-md5 (Translation-en: all three fields),
as apt wrote them. Also:
  - a bookworm-updates Packages list with the real updated stanza of one
    package that bookworm main has at a lower version (one package, two lists);
  - one package's Translation-en stanza left out (no long description);
  - only packages whose non-ASCII characters the tests' plain BM25 tokenizer
    (test_bm25.cc) classifies as FTS5's unicode61 does: U+00C0-U+024F
    (but for x and /) and U+0370-U+052F are word characters there, any other
    non-ASCII character a separator; unicode61's word characters are the
    letters, numbers and private-use characters.
Rerun with the same lists to get the same files:
  tests/search/make_fixture.py [LISTS_DIR]
"""
import hashlib
import os
import subprocess
import sys
import unicodedata

NAMED = """gnuplot gnuplot-nox gnuplot-qt gnuplot-x11 gnuplot-data gnuplot-doc sqlite3
libsqlite3-dev python3-numpy python3-scipy lz4 liblz4-dev curl wget vim vim-tiny emacs
emacs-nox git git-doc openmpi-bin libopenmpi-dev r-base r-base-core octave maxima
libapt-pkg-dev apt openssh-client python3 gcc g++ make cmake libstdc++6 grep sed
tar gzip xz-utils zstd bc dc sl coreutils""".split()
UPDATED = "openssh-client"  # also in bookworm-updates, at a higher version
NO_TRANSLATION = "sl"       # its Translation-en stanza left out

KEEP = ["Package", "Version", "Section", "Tag", "Description", "Description-md5"]
KEEP_TR = ["Package", "Description-md5", "Description-en"]


def read_list(path):
    """Stanzas of a deb822 list as lists of (field, raw value with continuation lines)."""
    text = subprocess.run(["lz4cat", path], check=True, capture_output=True).stdout.decode("utf-8")
    for block in text.split("\n\n"):
        fields = []
        for line in block.split("\n"):
            if not line:
                continue
            if line[0] in " \t":
                name, value = fields[-1]
                fields[-1] = (name, value + "\n" + line)
            else:
                name, _, value = line.partition(":")
                fields.append((name, value.strip()))
        if fields:
            yield fields


def write(path, stanzas, keep):
    with open(path, "w", encoding="utf-8") as out:
        out.write("\n".join("".join(f"{n}: {v}\n" for n, v in s if n in keep) for s in stanzas))


def text_of(stanza):
    return "".join(v for _, v in stanza)


def word_range(c):
    """test_bm25.cc's word characters beyond ASCII."""
    o = ord(c)
    return (0xC0 <= o < 0x250 and o not in (0xD7, 0xF7)) or 0x370 <= o < 0x530


def non_ascii_ok(text):
    """Whether every non-ASCII character is classified alike by test_bm25.cc and unicode61."""
    for c in text:
        if ord(c) < 128:
            continue
        category = unicodedata.category(c)
        if (category[0] in "LN" or category == "Co") != word_range(c):
            return False
    return True


def main():
    lists = sys.argv[1] if len(sys.argv) > 1 else "/var/lib/apt/lists"
    here = os.path.dirname(os.path.abspath(__file__))
    out_dir = os.path.join(here, "lists")
    prefix = os.path.join(lists, "deb.debian.org_debian_dists_")
    packages = list(read_list(prefix + "bookworm_main_binary-amd64_Packages.lz4"))
    updates = {dict(s)["Package"]: s for s in read_list(prefix + "bookworm-updates_main_binary-amd64_Packages.lz4")}
    translations = {(dict(s)["Package"], dict(s)["Description-md5"]): s
                    for s in read_list(prefix + "bookworm_main_i18n_Translation-en.lz4")}

    picked, seen, utf8 = [], set(), []
    for stanza in packages:
        fields = dict(stanza)
        name = fields["Package"]
        if name in seen:
            continue
        if name not in NAMED and not int(hashlib.md5(name.encode()).hexdigest()[:4], 16) < 260:
            continue
        tr = translations.get((name, fields.get("Description-md5")))
        text = text_of(stanza) + (text_of(tr) if tr else "")
        if not non_ascii_ok(text):
            print(f"left out {name}: non-ASCII characters the tests' tokenizer does not know")
            continue
        if any(ord(c) > 127 for c in text):
            utf8.append(name)
        picked.append(stanza)
        seen.add(name)
    missing = set(NAMED) - seen
    assert not missing, f"named packages not in the lists (or not ASCII): {sorted(missing)}"
    assert UPDATED in updates, UPDATED

    os.makedirs(out_dir, exist_ok=True)
    write(os.path.join(out_dir, "fixture_dists_bookworm_main_binary-amd64_Packages"), picked, KEEP)
    write(os.path.join(out_dir, "fixture_dists_bookworm-updates_main_binary-amd64_Packages"),
          [updates[UPDATED]], KEEP)
    kept = [translations[(dict(s)["Package"], dict(s)["Description-md5"])] for s in picked
            if dict(s)["Package"] != NO_TRANSLATION
            and (dict(s)["Package"], dict(s).get("Description-md5")) in translations]
    write(os.path.join(out_dir, "fixture_dists_bookworm_main_i18n_Translation-en"), kept, KEEP_TR)
    print(f"{len(picked)} packages ({len(kept)} with Translation-en), non-ASCII text in {utf8}")


if __name__ == "__main__":
    main()
