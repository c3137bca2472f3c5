// BERT's WordPiece tokenizer (wordpiece.h): one pass over the text that
// normalises, pre-tokenises and hands each word to WordPiece as soon as it
// ends, stopping at the truncation length. ASCII goes through a 128-entry
// table; other characters through the generated tables (unicode_data.h).
// On one core of a shared 2-core VM (CPU time, best of 5): the 63,681
// documents of Debian 12's package lists (27.4 MB) at max_length 256 in
// 0.23 s; 63,681 texts of at least 1,000 bytes (82.9 MB) in 0.57 s. Half of
// it is the vocabulary's lookups (token_table.h).
#include "search/wordpiece.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "qkv/error.h"
#include "qkv/store.h"
#include "search/unicode_data.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace qkv::search {

void TokenTable::build(const std::vector<std::pair<std::string_view, int32_t>>& entries) {
  size_t capacity = 16;
  while (capacity < 2 * entries.size()) capacity *= 2;
  slots_.assign(capacity, Slot{});
  mask_ = capacity - 1;
  keys_.clear();
  max_length_ = 0;
  for (const auto& [key, id] : entries) {
    size_t i = XXH3_64bits(key.data(), key.size()) & mask_;
    while (slots_[i].id >= 0) i = (i + 1) & mask_;
    slots_[i] = Slot{static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(key.size()), id};
    keys_.append(key);
    max_length_ = std::max(max_length_, key.size());
  }
}

int32_t TokenTable::find(std::string_view key) const {
  if (key.size() > max_length_) return -1;
  for (size_t i = XXH3_64bits(key.data(), key.size()) & mask_;; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.id < 0) return -1;
    if (s.length == key.size() && std::memcmp(keys_.data() + s.offset, key.data(), key.size()) == 0)
      return s.id;
  }
}

namespace {

using unicode::CharKind;

constexpr size_t kMaxVocabBytes = size_t{64} << 20;
constexpr char32_t kInvalid = 0xFFFFFFFF;
constexpr std::string_view kSpecialNames[] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};

bool is_continuation_byte(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// The character at p[0..n): sets cp and returns its length in bytes; for an
// ill-formed subsequence, sets cp = kInvalid and returns its length (the
// lead byte and the continuation bytes that fit it, as Python's decoder
// with errors="replace" makes one U+FFFD of them; Unicode 15, 3.9 "U+FFFD
// Substitution of Maximal Subparts").
size_t decode_utf8(const unsigned char* p, size_t n, char32_t& cp) {
  const unsigned b = p[0];
  if (b < 0x80) {
    cp = b;
    return 1;
  }
  size_t need;
  char32_t c;
  unsigned low = 0x80, high = 0xBF;  // the second byte's range
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1, c = b & 0x1F;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2, c = b & 0x0F;
    if (b == 0xE0) low = 0xA0;   // no overlong forms
    if (b == 0xED) high = 0x9F;  // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3, c = b & 0x07;
    if (b == 0xF0) low = 0x90;   // no overlong forms
    if (b == 0xF4) high = 0x8F;  // nothing past U+10FFFF
  } else {
    cp = kInvalid;
    return 1;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (k >= n || p[k] < low || p[k] > high) {
      cp = kInvalid;
      return k;
    }
    c = (c << 6) | (p[k] & 0x3F);
    low = 0x80, high = 0xBF;
  }
  cp = c;
  return need + 1;
}

// `cp` as UTF-8 into out; returns the length.
size_t encode_utf8(char32_t cp, char* out) {
  if (cp < 0x80) {
    out[0] = static_cast<char>(cp);
    return 1;
  }
  if (cp < 0x800) {
    out[0] = static_cast<char>(0xC0 | (cp >> 6));
    out[1] = static_cast<char>(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = static_cast<char>(0xE0 | (cp >> 12));
    out[1] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out[2] = static_cast<char>(0x80 | (cp & 0x3F));
    return 3;
  }
  out[0] = static_cast<char>(0xF0 | (cp >> 18));
  out[1] = static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
  out[2] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
  out[3] = static_cast<char>(0x80 | (cp & 0x3F));
  return 4;
}

// The rules of the 128 ASCII characters, read once from the generated
// tables (each maps to at most one ASCII character: the generator checks).
struct AsciiRule {
  CharKind kind;
  char normalized;
};
const std::array<AsciiRule, 128>& ascii_rules() {
  static const std::array<AsciiRule, 128> rules = [] {
    std::array<AsciiRule, 128> r{};
    for (char32_t c = 0; c < 128; ++c) {
      const unicode::CharInfo info = unicode::char_info(c);
      r[c] = {info.kind, info.mapped && !info.text.empty() ? info.text[0] : static_cast<char>(c)};
    }
    return r;
  }();
  return rules;
}

// The word being read: normalised UTF-8, its character count, and the run
// of kept marks (combining class > 0) at its end, which NFD's canonical
// ordering sorts by class (a stable sort; a starter ends the run). Marks
// that come in order are appended; a run that is not is sorted when it
// ends, so a long run costs O(n log n), not the O(n^2) of insertions.
class WordBuilder {
 public:
  void add_ascii(char c) {
    if (!run_.empty()) end_run();
    word_.push_back(c);
    ++chars_;
  }
  void add(std::string_view utf8, uint8_t combining_class) {
    ++chars_;
    if (combining_class == 0) {
      if (!run_.empty()) end_run();
      word_.append(utf8);
      return;
    }
    // Rare: marks new in Unicode 9, musical symbols.
    if (run_.empty()) run_begin_ = word_.size();
    if (!run_.empty() && combining_class < run_.back().combining_class) run_sorted_ = false;
    word_.append(utf8);
    run_.push_back(Mark{combining_class, static_cast<uint8_t>(utf8.size())});
  }
  void end_run() {
    if (!run_sorted_) {
      std::vector<std::pair<Mark, size_t>> marks;  // each with its offset in the run
      size_t offset = run_begin_;
      for (const Mark& m : run_) {
        marks.emplace_back(m, offset);
        offset += m.bytes;
      }
      std::stable_sort(marks.begin(), marks.end(), [](const auto& x, const auto& y) {
        return x.first.combining_class < y.first.combining_class;
      });
      std::string sorted;
      for (const auto& [m, at] : marks) sorted.append(word_, at, m.bytes);
      word_.replace(run_begin_, std::string::npos, sorted);
      run_sorted_ = true;
    }
    run_.clear();
  }
  bool empty() const { return word_.empty(); }
  // The word, its run of marks sorted.
  std::string_view word() {
    end_run();
    return word_;
  }
  int64_t chars() const { return chars_; }
  void clear() {
    word_.clear();
    chars_ = 0;
    run_.clear();
    run_sorted_ = true;
  }

 private:
  struct Mark {
    uint8_t combining_class, bytes;
  };
  std::string word_;
  int64_t chars_ = 0;
  std::vector<Mark> run_;  // the marks of class > 0 at the end of word_, from run_begin_
  size_t run_begin_ = 0;
  bool run_sorted_ = true;
};

// The whole of a regular file, through qkv::MappedFile, which refuses a
// FIFO or device before reading a byte.
std::string read_regular_file(std::string_view fn, const std::string& path) {
  const MappedFile file(fn, path);
  if (file.size() > kMaxVocabBytes) {
    fail(fn, path + ": larger than " + std::to_string(kMaxVocabBytes >> 20) +
                 " MiB; not a WordPiece vocabulary");
  }
  std::string text(reinterpret_cast<const char*>(file.data()), file.size());
  file.check_unchanged(fn);
  return text;
}

// Why `token` (a line of a vocabulary) is no token, or "".
std::string token_problem(std::string_view token) {
  if (token.empty()) return "is empty; a vocabulary has one token a line";
  const auto* p = reinterpret_cast<const unsigned char*>(token.data());
  for (size_t i = 0; i < token.size();) {
    if (p[i] == '\r') {
      return "ends in a carriage return (\\r): a file with CRLF line ends? A vocabulary's "
             "lines end in \\n";
    }
    if (p[i] == ' ') return "holds a space at byte " + std::to_string(i) + "; a token has none";
    if (p[i] < 0x20 || p[i] == 0x7F) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", p[i]);
      return "holds the control character " + std::string(hex) + " at byte " + std::to_string(i) +
             "; a token has none";
    }
    char32_t cp;
    const size_t length = decode_utf8(p + i, token.size() - i, cp);
    if (cp == kInvalid) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", p[i]);
      return "is not UTF-8 (byte " + std::to_string(i) + " is " + hex + ")";
    }
    i += length;
  }
  return "";
}

}  // namespace

WordPieceTokenizer WordPieceTokenizer::load(const std::string& vocab_path) {
  constexpr std::string_view kFn = "WordPieceTokenizer::load";
  const std::string text = read_regular_file(kFn, vocab_path);
  WordPieceTokenizer t;
  std::unordered_map<std::string_view, size_t> line_of;  // views into `text`
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();  // the last line may lack its '\n'
    const std::string_view token(text.data() + begin, end - begin);
    const size_t line = t.vocab_.size() + 1;
    const std::string where = vocab_path + ": line " + std::to_string(line);
    if (const std::string problem = token_problem(token); !problem.empty())
      fail(kFn, where + ": the token " + problem);
    if (const auto [it, added] = line_of.emplace(token, line); !added) {
      fail(kFn, where + ": the token \"" + std::string(token) + "\" is also line " +
                    std::to_string(it->second) + "; each token has one line (its id)");
    }
    if (t.vocab_.size() == static_cast<size_t>(INT32_MAX))
      fail(kFn, vocab_path + ": more than 2^31 - 1 tokens");
    t.vocab_.emplace_back(token);
    begin = end + 1;
  }
  std::vector<std::pair<std::string_view, int32_t>> whole, rest;
  for (size_t id = 0; id < t.vocab_.size(); ++id) {
    const std::string_view token = t.vocab_[id];
    whole.emplace_back(token, static_cast<int32_t>(id));
    if (token.size() > 2 && token.substr(0, 2) == "##")
      rest.emplace_back(token.substr(2), static_cast<int32_t>(id));
  }
  t.whole_.build(whole);
  t.rest_.build(rest);
  for (const std::string_view name : kSpecialNames) {
    const int32_t id = t.whole_.find(name);
    if (id >= 0) t.specials_.push_back(Special{std::string(name), id});
    int32_t* field = name == "[PAD]"   ? &t.pad_
                     : name == "[UNK]" ? &t.unk_
                     : name == "[CLS]" ? &t.cls_
                     : name == "[SEP]" ? &t.sep_
                                       : nullptr;
    if (field == nullptr) continue;
    if (id < 0) {
      fail(kFn, vocab_path + ": no line " + std::string(name) + " (" +
                    std::to_string(t.vocab_.size()) +
                    " tokens); a BERT vocabulary has [PAD], [UNK], [CLS] and [SEP]");
    }
    *field = id;
  }
  return t;
}

template <class OnWord, class OnSpecial>
void WordPieceTokenizer::walk(std::string_view text, OnWord&& on_word,
                              OnSpecial&& on_special) const {
  const std::array<AsciiRule, 128>& ascii = ascii_rules();
  WordBuilder w;
  // Ends the current word (and any run of marks); false once on_word says stop.
  auto flush = [&] {
    if (w.empty()) {
      w.end_run();
      return true;
    }
    const bool more = on_word(w.word(), w.chars());
    w.clear();
    return more;
  };
  // A character that is a word of its own (punctuation, an ideograph).
  auto alone = [&](std::string_view c) { return flush() && on_word(c, int64_t{1}); };

  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  char utf8[4];
  for (size_t i = 0; i < n;) {
    if (p[i] < 0x80) {
      const AsciiRule rule = ascii[p[i]];
      if (rule.kind == CharKind::kWord) {
        w.add_ascii(rule.normalized);
      } else if (rule.kind == CharKind::kSpace) {
        if (!flush()) return;
      } else if (rule.kind == CharKind::kPunctuation) {
        if (p[i] == '[') {  // every special token starts with '['
          const Special* found = nullptr;
          for (const Special& s : specials_) {
            if (text.compare(i, s.text.size(), s.text) == 0) found = &s;
          }
          if (found != nullptr) {
            if (!flush() || !on_special(found->id)) return;
            i += found->text.size();
            continue;
          }
        }
        if (!alone(std::string_view(&rule.normalized, 1))) return;
      }  // else kDrop
      ++i;
      continue;
    }
    char32_t cp;
    const size_t length = decode_utf8(p + i, n - i, cp);
    const std::string_view bytes = text.substr(i, length);
    i += length;
    if (cp == kInvalid) continue;  // U+FFFD for the reference, which clean_text drops
    char32_t jamo[3];
    if (const int count = unicode::hangul_jamo(cp, jamo)) {
      for (int k = 0; k < count; ++k) w.add(std::string_view(utf8, encode_utf8(jamo[k], utf8)), 0);
      continue;
    }
    const unicode::CharInfo info = unicode::char_info(cp);
    switch (info.kind) {
      case CharKind::kWord:
        if (!info.mapped) {
          w.add(bytes, info.combining_class);
          break;
        }
        // Its decomposition starts with a starter (the generator checks);
        // then each output character with its own class.
        w.end_run();
        for (size_t k = 0; k < info.text.size();) {
          char32_t c;
          const size_t c_length =
              decode_utf8(reinterpret_cast<const unsigned char*>(info.text.data()) + k,
                          info.text.size() - k, c);
          w.add(info.text.substr(k, c_length),
                c < 0x80 ? 0 : unicode::char_info(c).combining_class);
          k += c_length;
        }
        break;
      case CharKind::kDrop:
      case CharKind::kMarkCombining:
        break;
      case CharKind::kMarkStarter:
        w.end_run();
        break;
      case CharKind::kSpace:
        if (!flush()) return;
        break;
      case CharKind::kPunctuation:
      case CharKind::kChinese:
        if (!alone(info.mapped ? info.text : bytes)) return;
        break;
    }
  }
  flush();
}

void WordPieceTokenizer::wordpiece(std::string_view word, int64_t chars,
                                   std::vector<int32_t>& out) const {
  if (chars > kMaxWordChars) {
    out.push_back(unk_);
    return;
  }
  const size_t first = out.size();
  for (size_t start = 0; start < word.size();) {
    const TokenTable& table = start == 0 ? whole_ : rest_;
    // The longest candidate no longer than the table's longest key, ending
    // on a character boundary; then shorter ones, a character at a time.
    size_t end = std::min(word.size(), start + table.max_length());
    while (end < word.size() && is_continuation_byte(word[end])) --end;
    int32_t id = -1;
    while (end > start) {
      id = table.find(word.substr(start, end - start));
      if (id >= 0) break;
      do --end;
      while (end > start && is_continuation_byte(word[end]));
    }
    if (id < 0) {
      out.resize(first);
      out.push_back(unk_);
      return;
    }
    out.push_back(id);
    start = end;
  }
}

std::vector<int32_t> WordPieceTokenizer::encode(std::string_view utf8_text,
                                                int64_t max_length) const {
  if (max_length < 2) {
    fail("WordPieceTokenizer::encode", "max_length is " + std::to_string(max_length) +
                                           "; expected at least 2 (for [CLS] and [SEP])");
  }
  std::vector<int32_t> ids{cls_};
  // Where [SEP] goes: the wordpieces stop before it.
  const size_t limit = static_cast<size_t>(std::min<int64_t>(max_length - 1, INT32_MAX));
  std::vector<int32_t> pieces;
  if (ids.size() < limit) {
    walk(
        utf8_text,
        [&](std::string_view word, int64_t chars) {
          pieces.clear();
          wordpiece(word, chars, pieces);
          for (const int32_t id : pieces) {
            ids.push_back(id);
            if (ids.size() == limit) return false;
          }
          return true;
        },
        [&](int32_t id) {
          ids.push_back(id);
          return ids.size() < limit;
        });
  }
  ids.push_back(sep_);
  return ids;
}

std::vector<std::string> WordPieceTokenizer::tokens(std::string_view utf8_text) const {
  std::vector<int32_t> ids;
  walk(
      utf8_text,
      [&](std::string_view word, int64_t chars) {
        wordpiece(word, chars, ids);
        return true;
      },
      [&](int32_t id) {
        ids.push_back(id);
        return true;
      });
  std::vector<std::string> out;
  out.reserve(ids.size());
  for (const int32_t id : ids) out.push_back(token(id));
  return out;
}

std::vector<std::string> WordPieceTokenizer::words(std::string_view utf8_text) const {
  std::vector<std::string> out;
  walk(
      utf8_text,
      [&](std::string_view word, int64_t) {
        out.emplace_back(word);
        return true;
      },
      [&](int32_t id) {
        out.push_back(token(id));
        return true;
      });
  return out;
}

}  // namespace qkv::search
