// libFuzzer harness for the WordPiece tokenizer (apps/search/wordpiece.h):
// the first byte picks what the rest is.
//   0   a vocabulary file (through a memfd): loads or throws qkv::Error, and
//       what loads encodes a text
//   1+  a text (any bytes) for a small vocabulary of ASCII, accented, CJK
//       and "##" entries, or for $QKV_FUZZ_VOCAB (e.g. all-MiniLM-L6-v2's
//       vocab.txt) when set: encode never fails for max_length >= 2 (the
//       first byte picks it: 2 to 256), gives [CLS] ids... [SEP] with ids in
//       range, at most max_length of them, the untruncated ids cut at
//       max_length; tokens() gives one entry per id; and the words,
//       re-joined by spaces, give the same tokens (normalising twice
//       changes nothing).
// Anything else (a crash, a hang, an out-of-bounds read under ASan, an
// exception of another type) is a failure.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/error.h"
#include "search/wordpiece.h"

namespace {

using qkv::search::WordPieceTokenizer;

// A file of `bytes` that open() reads as a regular file: /proc/self/fd/N of a memfd.
class MemFile {
 public:
  explicit MemFile(std::string_view bytes) : fd_(::memfd_create("vocab.txt", MFD_CLOEXEC)) {
    if (fd_ < 0 || ::write(fd_, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size()))
      std::abort();
  }
  ~MemFile() { ::close(fd_); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

const WordPieceTokenizer& tokenizer() {
  static const WordPieceTokenizer t = [] {
    if (const char* path = std::getenv("QKV_FUZZ_VOCAB")) return WordPieceTokenizer::load(path);
    const MemFile file(
        "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nplay\n##ing\n##s\n##a\na\nb\n##b\n!\n,\n.\n"
        "[\n]\n#\n##\nun\n##aff\n##able\ncafe\ncrème\n\xe4\xb8\xad\n\xe6\x96\x87\n##\xe6\x96\x87\n"
        "\xe1\x84\x92\n##\xe1\x85\xa1\n##\xe1\x86\xab\n\xcf\x89\n##\xcc\x81\n\xf0\x9f\x98\x80\n");
    return WordPieceTokenizer::load(file.path());
  }();
  return t;
}

void check_encoding(const WordPieceTokenizer& t, std::string_view text, int64_t max_length) {
  const std::vector<int32_t> ids = t.encode(text, max_length);
  if (ids.size() < 2 || static_cast<int64_t>(ids.size()) > max_length ||
      ids.front() != t.cls_id() || ids.back() != t.sep_id())
    std::abort();
  for (const int32_t id : ids)
    if (id < 0 || id >= t.vocab_size()) std::abort();
  const std::vector<int32_t> all = t.encode(text, int64_t{1} << 40);
  if (all.size() > ids.size() && static_cast<int64_t>(ids.size()) != max_length) std::abort();
  for (size_t i = 0; i + 1 < ids.size(); ++i)
    if (ids[i] != all[i]) std::abort();
  const std::vector<std::string> tokens = t.tokens(text);
  if (tokens.size() != all.size() - 2) std::abort();
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] != t.token(all[i + 1])) std::abort();
  std::string rejoined;
  for (const std::string& w : t.words(text)) rejoined += w + " ";
  if (t.tokens(rejoined) != tokens) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] == 0) {
    std::optional<WordPieceTokenizer> t;
    try {
      t = WordPieceTokenizer::load(MemFile(rest).path());
    } catch (const qkv::Error&) {
      return 0;  // bad input, reported as it should be
    }
    check_encoding(*t, "the Playing [SEP] cr\xc3\xa8me \xe4\xb8\xad!", 16);
    return 0;
  }
  check_encoding(tokenizer(), rest, 2 + (data[0] - 1) % 255);
  return 0;
}
