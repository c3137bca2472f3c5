// The WordPiece tokenizer (apps/search/wordpiece.h) on small vocabularies
// written here: the vocabulary reader's errors, hand-checked cases of each
// rule (expected values worked out from the rules and Unicode's data, not
// produced by the code), and random texts against a plain ASCII reference
// written here. tests/search/test_tokenizer_peer.py holds it to Hugging
// Face's tokenizer with the real vocabulary.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "search/wordpiece.h"
#include "search_testing.h"
#include "test_util.h"

namespace qkv::search {
namespace {

using Ids = std::vector<int32_t>;
using Strings = std::vector<std::string>;
using testing::contains;
using testing::error_of;
using testing::TempDir;

constexpr int64_t kNoLimit = int64_t{1} << 40;

std::string join_lines(const Strings& lines) {
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  return text;
}

// ids: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, then the rest in order.
const Strings kVocab = {"[PAD]", "[UNK]",  "[CLS]", "[SEP]", "[MASK]",  // 0-4
                        "play",  "##ing",  "!",     ",",     "un",      // 5-9
                        "##aff", "##able", "unaff", "a",     "##a",     // 10-14
                        "cafe",  "$",      "5",     "creme", "brulee",  // 15-19
                        "ß",     "i",      "中",    "文",    "?",       // 20-24
                        "¿",     "que",    "[",     "sep",   "]",       // 25-29
                        "x",     "y",      "ab",    "ω",     "k"};      // 30-34

class WordPiece : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_.write("vocab.txt", join_lines(kVocab));
    tokenizer_ =
        std::make_unique<WordPieceTokenizer>(WordPieceTokenizer::load(dir_.file("vocab.txt")));
  }
  const WordPieceTokenizer& t() const { return *tokenizer_; }
  int32_t id(const std::string& token) const {
    const auto it = std::find(kVocab.begin(), kVocab.end(), token);
    EXPECT_NE(it, kVocab.end()) << token;
    return static_cast<int32_t>(it - kVocab.begin());
  }
  // [CLS] ids of `tokens` [SEP].
  Ids wrapped(const Strings& tokens) const {
    Ids ids{2};
    for (const std::string& s : tokens) ids.push_back(id(s));
    ids.push_back(3);
    return ids;
  }

  TempDir dir_;
  std::unique_ptr<WordPieceTokenizer> tokenizer_;
};

// ---- the vocabulary reader ----------------------------------------------------

std::string load_error(const TempDir& dir, const std::string& text) {
  dir.write("v.txt", text);
  return error_of([&] { WordPieceTokenizer::load(dir.file("v.txt")); });
}

TEST(WordPieceVocab, IdsAreLineNumbersAndTheLastNewlineIsOptional) {
  TempDir dir;
  dir.write("v.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello");
  const WordPieceTokenizer t = WordPieceTokenizer::load(dir.file("v.txt"));
  EXPECT_EQ(t.vocab_size(), 5);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.unk_id(), 1);
  EXPECT_EQ(t.cls_id(), 2);
  EXPECT_EQ(t.sep_id(), 3);
  EXPECT_EQ(t.token(4), "hello");
  EXPECT_EQ(t.encode("Hello", 10), (Ids{2, 4, 3}));
  // The specials anywhere in the file.
  dir.write("w.txt", "x\n[SEP]\n[CLS]\ny\n[UNK]\n[PAD]\n");
  const WordPieceTokenizer u = WordPieceTokenizer::load(dir.file("w.txt"));
  EXPECT_EQ(u.encode("y x z", 10), (Ids{2, 3, 0, 4, 1}));  // z is [UNK]
}

TEST(WordPieceVocab, BadLinesAreNamed) {
  TempDir dir;
  const std::string base = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n";
  struct Case {
    std::string text, message;
  };
  const std::vector<Case> cases = {
      {base + "a\n\nb\n", "v.txt: line 6: the token is empty"},
      {base + "play\n##ing\nplay\n", "v.txt: line 7: the token \"play\" is also line 5"},
      {base + "a\r\nb\n", "v.txt: line 5: the token ends in a carriage return"},
      {base + "a b\n", "v.txt: line 5: the token holds a space at byte 1"},
      {base + "ab\tc\n", "v.txt: line 5: the token holds the control character 0x09 at byte 2"},
      {base + "x\x7f\n", "holds the control character 0x7f at byte 1"},
      {base + "ok\nca\xff\n", "v.txt: line 6: the token is not UTF-8 (byte 2 is 0xff)"},
      {base + "\xe2\x82\n", "line 5: the token is not UTF-8 (byte 0 is 0xe2)"},
      {base + "\xed\xa0\x80\n", "line 5: the token is not UTF-8"},  // a surrogate
  };
  for (const Case& c : cases) {
    const std::string message = load_error(dir, c.text);
    EXPECT_TRUE(contains(message, "WordPieceTokenizer::load: ")) << message;
    EXPECT_TRUE(contains(message, c.message)) << message << "\nexpected: " << c.message;
  }
}

TEST(WordPieceVocab, EachSpecialTokenIsRequired) {
  TempDir dir;
  const Strings specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]"};
  for (const std::string& missing : specials) {
    Strings lines = {"hello"};
    for (const std::string& s : specials)
      if (s != missing) lines.push_back(s);
    const std::string message = load_error(dir, join_lines(lines));
    EXPECT_TRUE(contains(message, "v.txt: no line " + missing +
                                      " (4 tokens); a BERT vocabulary "
                                      "has [PAD], [UNK], [CLS] and [SEP]"))
        << message;
  }
  EXPECT_TRUE(contains(load_error(dir, ""), "no line [PAD] (0 tokens)"));
}

TEST(WordPieceVocab, FilesThatAreNoRegularFileAreRefusedByName) {
  TempDir dir;
  const std::string missing = error_of([&] { WordPieceTokenizer::load(dir.file("none.txt")); });
  EXPECT_TRUE(contains(missing, "WordPieceTokenizer::load: " + dir.file("none.txt") +
                                    ": cannot open: No such file or directory"))
      << missing;
  const std::string directory = error_of([&] { WordPieceTokenizer::load(dir.path()); });
  EXPECT_TRUE(contains(directory, dir.path() + ": not a regular file (a directory)")) << directory;
  // A FIFO without a writer: refused at once, never waited on.
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  const std::string fifo = error_of([&] { WordPieceTokenizer::load(dir.file("fifo")); });
  EXPECT_TRUE(contains(fifo, "fifo: not a regular file (a FIFO)")) << fifo;
  // A device would be read forever (/dev/zero) or read as empty (/dev/null).
  for (const char* device : {"/dev/zero", "/dev/null"}) {
    const std::string message = error_of([&] { WordPieceTokenizer::load(device); });
    EXPECT_TRUE(contains(message, std::string(device) + ": not a regular file (a character "
                                                        "device)"))
        << message;
  }
}

TEST(WordPieceVocab, TooLargeAFileIsRefused) {
  TempDir dir;
  std::string text = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n";
  for (int64_t i = 0; text.size() <= (int64_t{64} << 20); ++i) text += std::to_string(i) + "\n";
  const std::string message = load_error(dir, text);
  EXPECT_TRUE(contains(message, "v.txt: larger than 64 MiB; not a WordPiece vocabulary"))
      << message;
}

// ---- encode's argument ---------------------------------------------------------

TEST_F(WordPiece, MaxLengthBelowTwoIsAnError) {
  for (const int64_t bad : {int64_t{1}, int64_t{0}, int64_t{-5}}) {
    const std::string message = error_of([&] { t().encode("play", bad); });
    EXPECT_EQ(message, "WordPieceTokenizer::encode: max_length is " + std::to_string(bad) +
                           "; expected at least 2 (for [CLS] and [SEP])");
  }
  EXPECT_THROW(t().encode("play", 1), Error);
  EXPECT_EQ(t().encode("play play", 2), (Ids{2, 3}));
}

// ---- the rules, by hand ---------------------------------------------------------

TEST_F(WordPiece, LongestEntryFirstAndWholeWordsUnknown) {
  EXPECT_EQ(t().encode("Playing!", kNoLimit), wrapped({"play", "##ing", "!"}));
  // "unaff" is longer than "un": taken first, then "##able".
  EXPECT_EQ(t().tokens("unaffable"), (Strings{"unaff", "##able"}));
  // "unaffa": unaff + ##a. "unable": un + ##able.
  EXPECT_EQ(t().tokens("unaffa unable"), (Strings{"unaff", "##a", "un", "##able"}));
  // A word whose rest no "##" entry starts is one [UNK], though a prefix matched.
  EXPECT_EQ(t().tokens("playx play"), (Strings{"[UNK]", "play"}));
  // "##ing" is no word start.
  EXPECT_EQ(t().tokens("ing"), (Strings{"[UNK]"}));
  EXPECT_EQ(t().encode("", kNoLimit), (Ids{2, 3}));
  EXPECT_EQ(t().encode(" \t\n ", kNoLimit), (Ids{2, 3}));
}

TEST_F(WordPiece, WordsOfMoreThan100CharactersAfterNormalisingAreUnknown) {
  Strings hundred = {"a"};
  for (int i = 1; i < 100; ++i) hundred.push_back("##a");
  EXPECT_EQ(t().tokens(std::string(100, 'a')), hundred);
  EXPECT_EQ(t().tokens(std::string(101, 'a')), (Strings{"[UNK]"}));
  // Counted after the accents are stripped: 100 x (a + U+0301) is 100 characters.
  std::string accented;
  for (int i = 0; i < 100; ++i) accented += "a\xcc\x81";
  EXPECT_EQ(t().tokens(accented), hundred);
  EXPECT_EQ(t().tokens(accented + "a"), (Strings{"[UNK]"}));
  // Controls dropped before counting: 100 a's with a ZERO WIDTH SPACE (Cf) inside.
  EXPECT_EQ(t().tokens(std::string(50, 'a') + "\xe2\x80\x8b" + std::string(50, 'a')), hundred);
}

TEST_F(WordPiece, LowerCaseAndAccentsStripped) {
  EXPECT_EQ(t().words("CAFÉ Crème BRÛLÉE"), (Strings{"cafe", "creme", "brulee"}));
  EXPECT_EQ(t().encode("CAFÉ Crème BRÛLÉE", kNoLimit), wrapped({"cafe", "creme", "brulee"}));
  // Decomposed input: e + U+0301.
  EXPECT_EQ(t().words("cafe\xcc\x81"), (Strings{"cafe"}));
  // U+0130 (I with dot above): NFD is I + U+0307, the dot dropped, then i.
  EXPECT_EQ(t().words("\xc4\xb0"), (Strings{"i"}));
  // ß has no one-letter upper case; ẞ (U+1E9E) lowers to it. Ω (U+2126 OHM
  // SIGN) is Ω by NFD, ω in lower case; K (U+212A KELVIN SIGN) is K, then k.
  EXPECT_EQ(t().tokens("ß \xe1\xba\x9e \xe2\x84\xa6 \xe2\x84\xaa"), (Strings{"ß", "ß", "ω", "k"}));
  // Σ lowers to σ even at a word's end (the reference has no final-sigma rule).
  EXPECT_EQ(t().words("ΟΔΟΣ"), (Strings{"οδοσ"}));
}

TEST_F(WordPiece, PunctuationIsAWordOfItsOwn) {
  EXPECT_EQ(t().tokens("play,play!"), (Strings{"play", ",", "play", "!"}));
  // ASCII punctuation includes symbols ($, ^, `): "$5".
  EXPECT_EQ(t().tokens("$5"), (Strings{"$", "5"}));
  EXPECT_EQ(t().words("a^b`c"), (Strings{"a", "^", "b", "`", "c"}));
  // Unicode punctuation (P*): ¿ (Po); not symbols such as © (So) or € (Sc).
  EXPECT_EQ(t().tokens("¿Qué?"), (Strings{"¿", "que", "?"}));
  EXPECT_EQ(t().words("a©b€c"), (Strings{"a©b€c"}));
  // U+037E GREEK QUESTION MARK is ';' by NFD: punctuation.
  EXPECT_EQ(t().words("a\xcd\xbe"
                      "b"),
            (Strings{"a", ";", "b"}));
}

TEST_F(WordPiece, WhitespaceSplitsAndControlsVanish) {
  // \t \n \r, NO-BREAK SPACE, IDEOGRAPHIC SPACE, EN QUAD split words.
  EXPECT_EQ(t().words("a\tb\nc\rd\xc2\xa0"
                      "e\xe3\x80\x80"
                      "f\xe2\x80\x80g"),
            (Strings{"a", "b", "c", "d", "e", "f", "g"}));
  // Vertical tab, form feed and NEL are controls (Cc), not whitespace, for
  // the reference: dropped, joining what is around them. So are ZERO WIDTH
  // SPACE (Cf), NUL, U+FFFD and private-use characters (Co).
  EXPECT_EQ(t().words("a\vb\fa\xc2\x85"
                      "b"),
            (Strings{"abab"}));
  EXPECT_EQ(t().words(std::string("a\xe2\x80\x8b"
                                  "b\0a\xef\xbf\xbd"
                                  "b\xee\x80\x80",
                                  14)),
            (Strings{"abab"}));
  EXPECT_EQ(t().tokens("a\xe2\x80\x8b"
                       "b"),
            (Strings{"ab"}));
}

TEST_F(WordPiece, IdeographsAreWordsOfTheirOwnAndHangulDecomposes) {
  EXPECT_EQ(t().tokens("中文abc"), (Strings{"中", "文", "[UNK]"}));
  EXPECT_EQ(t().words("x中y"), (Strings{"x", "中", "y"}));
  // U+F9B1 (CJK COMPATIBILITY IDEOGRAPH) is U+9234 by NFD, alone.
  EXPECT_EQ(t().words("a\xef\xa6\xb1"
                      "b"),
            (Strings{"a", "\xe9\x88\xb4", "b"}));
  // 한 (U+D55C) is ᄒ ᅡ ᆫ (U+1112 U+1161 U+11AB); not isolated.
  EXPECT_EQ(t().words("x한"), (Strings{"x\xe1\x84\x92\xe1\x85\xa1\xe1\x86\xab"}));
  // Hiragana and Hangul are no "Chinese characters": part of words.
  EXPECT_EQ(t().words("aあb"), (Strings{"aあb"}));
}

TEST_F(WordPiece, SpecialTokensInTheRawTextAreTheirIds) {
  EXPECT_EQ(t().encode("play [SEP] play", kNoLimit), (Ids{2, 5, 3, 5, 3}));
  EXPECT_EQ(t().encode("x[MASK]y", kNoLimit), (Ids{2, 30, 4, 31, 3}));
  EXPECT_EQ(t().encode("[CLS][PAD][UNK]", kNoLimit), (Ids{2, 2, 0, 1, 3}));
  // Exactly as written: lower case, or broken by a control, is ordinary text.
  EXPECT_EQ(t().tokens("[sep] [SE\x01P]"), (Strings{"[", "sep", "]", "[", "sep", "]"}));
  EXPECT_EQ(t().tokens("[[SEP]]"), (Strings{"[", "[SEP]", "]"}));
  // A vocabulary without [MASK] has no such special token.
  TempDir dir;
  dir.write("v.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\nmask\n[\n]\n");
  const WordPieceTokenizer u = WordPieceTokenizer::load(dir.file("v.txt"));
  EXPECT_EQ(u.encode("[MASK]", kNoLimit), (Ids{2, 5, 4, 6, 3}));
}

TEST_F(WordPiece, InvalidUtf8IsDropped) {
  // A stray continuation byte, a lead byte without its continuation, an
  // overlong '/', a surrogate, past U+10FFFF, a cut 4-byte sequence at the end.
  EXPECT_EQ(t().words("ca\x80"
                      "fe"),
            (Strings{"cafe"}));
  EXPECT_EQ(t().words("ca\xe2\x82"
                      "fe"),
            (Strings{"cafe"}));
  EXPECT_EQ(t().words("a\xc0\xaf"
                      "b"),
            (Strings{"ab"}));
  EXPECT_EQ(t().words("a\xed\xa0\x80"
                      "b"),
            (Strings{"ab"}));
  EXPECT_EQ(t().words("a\xf4\x90\x80\x80"
                      "b"),
            (Strings{"ab"}));
  EXPECT_EQ(t().words("ab\xf0\x9f\x98"), (Strings{"ab"}));
  // The byte after a cut sequence starts afresh: E2 82 then "¿" (C2 BF).
  EXPECT_EQ(t().words("x\xe2\x82\xc2\xbfy"), (Strings{"x", "¿", "y"}));
  // \xff and a lone \xc3 around a valid é (C3 A9).
  EXPECT_EQ(t().words("\xff\xc3\xc3\xa9\xc3"), (Strings{"e"}));
}

TEST_F(WordPiece, KeptMarksAreInCanonicalOrder) {
  // U+302E (HANGUL SINGLE DOT TONE MARK, Mc, class 224) and U+1D165
  // (MUSICAL SYMBOL COMBINING STEM, Mc, 216) are spacing marks: kept by
  // strip_accents, but NFD orders them by class.
  const std::string tone = "\xe3\x80\xae", stem = "\xf0\x9d\x85\xa5";
  EXPECT_EQ(t().words("x" + tone + stem), (Strings{"x" + stem + tone}));
  EXPECT_EQ(t().words("x" + stem + tone), (Strings{"x" + stem + tone}));
  // A dropped nonspacing mark of class 230 (U+0301) between them moves
  // nothing; a dropped format character (ZERO WIDTH JOINER) is gone before NFD.
  EXPECT_EQ(t().words("x" + tone + "\xcc\x81" + stem), (Strings{"x" + stem + tone}));
  EXPECT_EQ(t().words("x" + tone + "\xe2\x80\x8d" + stem), (Strings{"x" + stem + tone}));
  // A dropped starter (U+0900 DEVANAGARI SIGN INVERTED CANDRABINDU, Mn,
  // class 0) ends the run: no reordering across it.
  EXPECT_EQ(t().words("x" + tone + "\xe0\xa4\x80" + stem), (Strings{"x" + tone + stem}));
  // A long run in reverse order: sorted (stably) when it ends, not by
  // insertion (200,000 marks: inserting each in place is quadratic).
  std::string run = "x", sorted = "x";
  for (int i = 0; i < 100000; ++i) run += tone + stem;
  for (int i = 0; i < 100000; ++i) sorted += stem;
  for (int i = 0; i < 100000; ++i) sorted += tone;
  EXPECT_EQ(t().words(run + " y"), (Strings{sorted, "y"}));
  EXPECT_EQ(t().words(run + "y" + stem + tone), (Strings{sorted + "y" + stem + tone}));
}

TEST_F(WordPiece, TruncationKeepsTheFirstPieces) {
  // play ##ing ! play ##ing !
  const Ids all = wrapped({"play", "##ing", "!", "play", "##ing", "!"});
  for (int64_t max_length = 2; max_length <= 10; ++max_length) {
    Ids expected(all.begin(), all.begin() + std::min<int64_t>(max_length - 1, all.size() - 1));
    expected.push_back(3);
    EXPECT_EQ(t().encode("Playing! PLAYING!", max_length), expected) << max_length;
  }
  // Cut inside a special token's run as well.
  EXPECT_EQ(t().encode("[SEP][SEP][SEP]", 4), (Ids{2, 3, 3, 3}));
}

// ---- random texts against a plain ASCII reference ------------------------------

// BERT's rules for ASCII alone: lower case, split at whitespace, isolate
// punctuation, controls other than \t \n \r dropped, longest entry first.
Strings ascii_reference(const std::string& text, const Strings& vocab) {
  auto in_vocab = [&](const std::string& s) {
    return std::find(vocab.begin(), vocab.end(), s) != vocab.end();
  };
  Strings words;
  std::string word;
  auto flush = [&] {
    if (!word.empty()) words.push_back(word);
    word.clear();
  };
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      flush();
    } else if (u < 0x20 || u == 0x7f) {
      continue;
    } else if (std::ispunct(u)) {
      flush();
      words.push_back(std::string(1, c));
    } else {
      word += static_cast<char>(std::tolower(u));
    }
  }
  flush();
  Strings out;
  for (const std::string& w : words) {
    if (w.size() > 100) {
      out.push_back("[UNK]");
      continue;
    }
    Strings pieces;
    size_t start = 0;
    bool unknown = false;
    while (start < w.size() && !unknown) {
      size_t end = w.size();
      for (; end > start; --end) {
        const std::string piece = (start ? "##" : "") + w.substr(start, end - start);
        if (in_vocab(piece)) {
          pieces.push_back(piece);
          break;
        }
      }
      unknown = end == start;
      start = end;
    }
    if (unknown) pieces = {"[UNK]"};
    out.insert(out.end(), pieces.begin(), pieces.end());
  }
  return out;
}

TEST(WordPieceRandom, AsciiTextsMatchAPlainReference) {
  const uint64_t seed = qkv::test::test_seed();
  SCOPED_TRACE(qkv::test::seed_note(seed));
  qkv::test::Rng rng(seed);
  const std::string letters = "abcdeABC";
  TempDir dir;
  for (int round = 0; round < 20; ++round) {
    // A random vocabulary of short strings and "##" strings over few letters.
    Strings vocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]"};
    for (int i = 0; i < 40; ++i) {
      std::string s = rng.uniform_int(0, 1) ? "##" : "";
      const int64_t n = rng.uniform_int(1, 4);
      for (int64_t k = 0; k < n; ++k) s += letters[rng.uniform_int(0, 4)];
      if (std::find(vocab.begin(), vocab.end(), s) == vocab.end()) vocab.push_back(s);
    }
    for (const char* p : {"!", ",", "$"}) vocab.push_back(p);
    dir.write("v.txt", join_lines(vocab));
    const WordPieceTokenizer t = WordPieceTokenizer::load(dir.file("v.txt"));
    for (int text_round = 0; text_round < 50; ++text_round) {
      std::string text;
      const std::string alphabet = letters + " \t\n,!$.\x01\x0b";
      const int64_t n = rng.uniform_int(0, 60);
      for (int64_t k = 0; k < n; ++k)
        text += alphabet[static_cast<size_t>(rng.uniform_int(0, alphabet.size() - 1))];
      if (rng.uniform_int(0, 9) == 0) text += std::string(rng.uniform_int(99, 102), 'a');
      ASSERT_EQ(t.tokens(text), ascii_reference(text, vocab)) << "text \"" << text << "\"";
    }
  }
}

// Random bytes (any UTF-8, invalid too): encode never fails, its ids are in
// range, truncation keeps a prefix, and the words re-tokenised give the
// same pieces (normalising twice changes nothing).
TEST_F(WordPiece, RandomBytesAreSafeAndConsistent) {
  const uint64_t seed = qkv::test::test_seed();
  SCOPED_TRACE(qkv::test::seed_note(seed));
  qkv::test::Rng rng(seed);
  const Strings pieces = {"a",
                          "PLAY",
                          "ing",
                          " ",
                          "!",
                          "\xc3\xa9",
                          "\xcc\x81",
                          "\xe4\xb8\xad",
                          "\xed\x95\x9c",
                          "\xff",
                          "\xe2\x82",
                          "\x0b",
                          "[SEP]",
                          "\xf0\x9f\x98\x80",
                          "\xe3\x80\xae",
                          "\xf0\x9d\x85\xa5",
                          "\xe0\xa4\x80",
                          "\xc4\xb0"};
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int64_t n = rng.uniform_int(0, 40);
    for (int64_t k = 0; k < n; ++k) {
      if (rng.uniform_int(0, 3) == 0) {
        text += static_cast<char>(rng.uniform_int(0, 255));
      } else {
        text += pieces[static_cast<size_t>(rng.uniform_int(0, pieces.size() - 1))];
      }
    }
    SCOPED_TRACE("round " + std::to_string(round));
    const Ids all = t().encode(text, kNoLimit);
    ASSERT_GE(all.size(), 2u);
    EXPECT_EQ(all.front(), 2);
    EXPECT_EQ(all.back(), 3);
    for (const int32_t id : all) ASSERT_TRUE(id >= 0 && id < t().vocab_size()) << id;
    const int64_t max_length = rng.uniform_int(2, static_cast<int64_t>(all.size()) + 2);
    Ids cut(all.begin(), all.begin() + std::min<int64_t>(max_length - 1, all.size() - 1));
    cut.push_back(3);
    EXPECT_EQ(t().encode(text, max_length), cut) << max_length;
    std::string rejoined;
    for (const std::string& w : t().words(text)) rejoined += w + " ";
    EXPECT_EQ(t().tokens(rejoined), t().tokens(text));
  }
}

}  // namespace
}  // namespace qkv::search
