// BERT's uncased WordPiece tokenizer, as the pretrained sentence encoder
// all-MiniLM-L6-v2 reads text: the same ids as the reference, Hugging
// Face's tokenizers (its tokenizer.json: BertNormalizer, BertPreTokenizer,
// WordPiece, [CLS] $A [SEP]), without ICU (unicode_data.h).
//
// Steps, as the reference takes them:
//  1. [PAD] [UNK] [CLS] [SEP] [MASK], where the vocabulary has them, are
//     found in the raw text (exactly, case and all) and become their ids;
//     the text between them goes through steps 2-4 on its own.
//  2. Normalise: drop U+0000, U+FFFD and control and format characters
//     (not \t \n \r); whitespace becomes a space; spaces around CJK
//     ideographs; NFD, then drop nonspacing marks; lower case.
//  3. Pre-tokenise: words are split at spaces, and each punctuation
//     character (ASCII punctuation and Unicode P*) is a word of its own.
//  4. WordPiece: a word of more than 100 characters is [UNK]; else the
//     longest vocabulary entry that starts it, then the longest "##" entry
//     that starts the rest, and so on; a word with a rest no entry starts
//     is one [UNK].
//
// Invalid UTF-8: each ill-formed subsequence is dropped, as the reference
// drops the U+FFFD that Python's bytes.decode("utf-8", errors="replace")
// puts in its place (the "maximal subpart" rule: a lead byte and the
// continuation bytes that fit it are one subsequence; the next byte starts
// afresh). So qkv's ids for bytes b equal the reference's for
// b.decode("utf-8", "replace").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "search/token_table.h"

namespace qkv::search {

class WordPieceTokenizer {
 public:
  // The reference's max_input_chars_per_word: longer words are [UNK].
  static constexpr int64_t kMaxWordChars = 100;

  // Reads a vocabulary: vocab.txt, one token a line in UTF-8, a token's id
  // its line number from 0, lines ended by '\n' (the last one may lack it).
  // Throws qkv::Error naming the function, the file and the line for a file
  // that is not a regular one (a FIFO, a device, a directory), cannot be
  // read or is larger than 64 MiB; for an empty line, a token that holds
  // whitespace, a control character or invalid UTF-8; a token already on
  // another line; and a vocabulary without [PAD], [UNK], [CLS] or [SEP].
  static WordPieceTokenizer load(const std::string& vocab_path);

  // [CLS], the wordpieces of `utf8_text`, [SEP]: at most `max_length` ids
  // (the wordpieces cut after the first max_length - 2, as the reference's
  // truncation does). Throws qkv::Error if max_length < 2.
  std::vector<int32_t> encode(std::string_view utf8_text, int64_t max_length) const;

  // The wordpieces of `utf8_text` as vocabulary entries ("play", "##ing";
  // "[UNK]"), without [CLS] and [SEP], untruncated: for tests and debugging.
  std::vector<std::string> tokens(std::string_view utf8_text) const;

  // The words WordPiece is given (steps 1-3: normalised, pre-tokenised; a
  // special token as its text), for tests against the reference's
  // normalizer and pre_tokenizer.
  std::vector<std::string> words(std::string_view utf8_text) const;

  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  // The entry of `id` (0 <= id < vocab_size()).
  const std::string& token(int32_t id) const { return vocab_[static_cast<size_t>(id)]; }
  int32_t pad_id() const { return pad_; }
  int32_t unk_id() const { return unk_; }
  int32_t cls_id() const { return cls_; }
  int32_t sep_id() const { return sep_; }

 private:
  struct Special {
    std::string text;
    int32_t id;
  };
  WordPieceTokenizer() = default;

  // Steps 1-3 over `text`: on_word(word, characters) for each word,
  // on_special(id) for each special token, in order, until one returns false.
  template <class OnWord, class OnSpecial>
  void walk(std::string_view text, OnWord&& on_word, OnSpecial&& on_special) const;
  // Step 4: appends the wordpieces of `word` (of `chars` characters) to `out`.
  void wordpiece(std::string_view word, int64_t chars, std::vector<int32_t>& out) const;

  std::vector<std::string> vocab_;  // by id
  TokenTable whole_;                // every entry
  TokenTable rest_;                 // the "##" entries, without "##"
  std::vector<Special> specials_;   // those of the five the vocabulary has
  int32_t pad_ = -1, unk_ = -1, cls_ = -1, sep_ = -1;
};

}  // namespace qkv::search
