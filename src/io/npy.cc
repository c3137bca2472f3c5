// NumPy .npy reading and writing: format versions 1.0/2.0/3.0, dtypes <f4 <f8
// <i4 <i8, C order. The header dict is parsed as a small Python literal, and
// every malformed or unsupported file is a qkv::Error naming the file and the
// byte offset; pipes and devices are checked as their bytes arrive; writes go
// through a StagedFile (a temporary file renamed into place).
#include "qkv/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "io/npy_header.h"
#include "qkv/error.h"
#include "qkv/staged_file.h"

namespace qkv {
namespace {

// Elements are copied bytewise between memory and file, which is only right
// on a little-endian host; this also lets '=' (native order) mean '<'.
static_assert(std::endian::native == std::endian::little, "qkv's .npy I/O assumes little-endian");

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// NumPy aligns the start of the data to 64 bytes (numpy.lib.format.ARRAY_ALIGN).
constexpr size_t kAlign = 64;
// Nesting of tuples/lists allowed in a header: descr lists of structured
// dtypes nest a few levels; the limit keeps hostile headers off the stack.
constexpr int kMaxDepth = 32;

// kB1 (bool) and kU1 are both read into Tensor<uint8_t>, which is written as |u1.
// kU2 (<u2, the bits of bfloat16 data) only through parse_npy_header: the
// readers into tensors refuse it like any other unsupported dtype.
enum class Dtype { kF4, kF8, kI4, kI8, kB1, kU1, kU2 };

size_t item_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF4:
    case Dtype::kI4:
      return 4;
    case Dtype::kB1:
    case Dtype::kU1:
      return 1;
    case Dtype::kU2:
      return 2;
    default:
      return 8;
  }
}

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF4:
      return "<f4";
    case Dtype::kF8:
      return "<f8";
    case Dtype::kI4:
      return "<i4";
    case Dtype::kI8:
      return "<i8";
    case Dtype::kB1:
      return "|b1";
    case Dtype::kU1:
      return "|u1";
    case Dtype::kU2:
      return "<u2";
  }
  return "?";
}

template <class T>
constexpr Dtype dtype_of();
template <>
constexpr Dtype dtype_of<float>() {
  return Dtype::kF4;
}
template <>
constexpr Dtype dtype_of<double>() {
  return Dtype::kF8;
}
template <>
constexpr Dtype dtype_of<int32_t>() {
  return Dtype::kI4;
}
template <>
constexpr Dtype dtype_of<int64_t>() {
  return Dtype::kI8;
}
template <>
constexpr Dtype dtype_of<uint8_t>() {
  return Dtype::kU1;
}

// Who is reading what, for error messages: "<function>: <name>: <what>".
struct Where {
  std::string_view function;
  const std::string& name;

  [[noreturn]] void fail(const std::string& what) const { qkv::fail(function, name + ": " + what); }
};

std::string at(size_t offset) { return " at offset " + std::to_string(offset); }

// "[2, 3]"; a hostile header's long shape is cut short after 8 axes.
std::string shape_str(const std::vector<int64_t>& sizes) {
  std::string s = "[";
  for (size_t a = 0; a < sizes.size(); ++a) {
    if (a) s += ", ";
    if (a == 8) return s + "... (" + std::to_string(sizes.size()) + " axes)]";
    s += std::to_string(sizes[a]);
  }
  return s + "]";
}

// Printable form of header text for messages: non-printable bytes as \xNN,
// cut short so a hostile header cannot flood the message.
std::string quoted(std::string_view text, size_t max_len = 40) {
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < max_len; ++i) {
    auto c = static_cast<unsigned char>(text[i]);
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (text.size() > max_len) out += "...";
  return out + "'";
}

// ---- the header dict: a Python literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }

struct Value {
  enum class Kind { kString, kTrue, kFalse, kNone, kInt, kTuple, kList };
  Kind kind = Kind::kNone;
  size_t offset = 0;  // in the file, where the value starts
  std::string text;   // kString
  int64_t integer = 0;
  std::vector<Value> items;  // kTuple, kList
};

const char* kind_name(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::kString:
      return "a string";
    case Value::Kind::kTrue:
    case Value::Kind::kFalse:
      return "a bool";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kInt:
      return "an integer";
    case Value::Kind::kTuple:
      return "a tuple";
    case Value::Kind::kList:
      return "a list";
  }
  return "?";
}

class HeaderParser {
 public:
  // `text` is the header as it sits in the file, starting at byte `base`.
  HeaderParser(std::string_view text, size_t base, const Where& where)
      : text_(text), base_(base), where_(where) {}

  // Parses the whole header: one dict, then only whitespace (NumPy pads with
  // spaces and ends with '\n'). Returns the dict's (key, value) pairs in order.
  std::vector<std::pair<Value, Value>> parse_dict() {
    skip_space();
    if (peek() != '{') error("expected '{' to open the header dict");
    ++pos_;
    std::vector<std::pair<Value, Value>> entries;
    for (;;) {
      skip_space();
      if (peek() == '}') break;
      Value key = parse_value(0);
      skip_space();
      if (peek() != ':') error("expected ':' after a key of the header dict");
      ++pos_;
      Value value = parse_value(0);
      entries.emplace_back(std::move(key), std::move(value));
      skip_space();
      if (peek() == ',') {
        ++pos_;
      } else if (peek() != '}') {
        error("expected ',' or '}' in the header dict");
      }
    }
    ++pos_;
    skip_space();
    if (pos_ != text_.size()) error("unexpected text after the header dict");
    return entries;
  }

 private:
  // -1 at the end of the header, so callers never read past it.
  int peek() const { return pos_ < text_.size() ? static_cast<unsigned char>(text_[pos_]) : -1; }

  [[noreturn]] void error(const std::string& what) const {
    std::string found = pos_ < text_.size() ? "found " + quoted(text_.substr(pos_, 1), 1)
                                            : "found the end of the header";
    where_.fail("malformed header: " + what + ", " + found + at(base_ + pos_));
  }

  void skip_space() {
    while (is_space(peek())) ++pos_;
  }

  static bool is_space(int c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  }

  static bool is_digit(int c) { return c >= '0' && c <= '9'; }
  static bool is_ident(int c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || is_digit(c) || c == '_';
  }

  Value parse_value(int depth) {
    skip_space();
    Value v;
    v.offset = base_ + pos_;
    int c = peek();
    if (c == '\'' || c == '"') {
      v.kind = Value::Kind::kString;
      v.text = parse_string();
    } else if (c == '(' || c == '[') {
      if (depth >= kMaxDepth) error("tuples and lists nested too deeply");
      v = parse_sequence(depth);
    } else if (is_digit(c) || c == '-' || c == '+') {
      v.kind = Value::Kind::kInt;
      v.integer = parse_int();
    } else if (is_ident(c)) {
      size_t start = pos_;
      while (is_ident(peek())) ++pos_;
      std::string_view word = text_.substr(start, pos_ - start);
      if (word == "True") {
        v.kind = Value::Kind::kTrue;
      } else if (word == "False") {
        v.kind = Value::Kind::kFalse;
      } else if (word == "None") {
        v.kind = Value::Kind::kNone;
      } else {
        pos_ = start;
        error("unknown name " + quoted(word) +
              " (expected a string, number, tuple, True or False)");
      }
    } else {
      error("expected a value (a string, number, tuple, True or False)");
    }
    return v;
  }

  // A Python string literal without escapes (NumPy never writes any).
  std::string parse_string() {
    char quote = text_[pos_++];
    size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != quote && text_[pos_] != '\n') {
      if (text_[pos_] == '\\') error("escape sequences in strings are not supported");
      ++pos_;
    }
    if (pos_ == text_.size() || text_[pos_] == '\n') {
      pos_ = start - 1;  // report where the string opened
      error("unterminated string");
    }
    std::string s(text_.substr(start, pos_ - start));
    ++pos_;
    return s;
  }

  // A decimal integer, optionally signed; Python 2 writers added an 'L'.
  int64_t parse_int() {
    bool negative = false;
    if (peek() == '-' || peek() == '+') {
      negative = peek() == '-';
      ++pos_;
      skip_space();
    }
    if (!is_digit(peek())) error("expected digits");
    size_t start = pos_;
    // Accumulate the magnitude as a negative number so INT64_MIN fits.
    int64_t value = 0;
    while (is_digit(peek())) {
      int digit = peek() - '0';
      if (value < (std::numeric_limits<int64_t>::min() + digit) / 10) {
        pos_ = start;
        while (is_digit(peek())) ++pos_;
        where_.fail("malformed header: integer " + quoted(text_.substr(start, pos_ - start), 30) +
                    " does not fit in 64 bits" + at(base_ + start));
      }
      value = value * 10 - digit;
      ++pos_;
    }
    if (peek() == 'L' || peek() == 'l') ++pos_;
    if (is_ident(peek()) || peek() == '.') error("expected an integer");
    if (!negative) {
      if (value == std::numeric_limits<int64_t>::min()) {
        where_.fail("malformed header: integer " + quoted(text_.substr(start, pos_ - start), 30) +
                    " does not fit in 64 bits" + at(base_ + start));
      }
      value = -value;
    }
    return value;
  }

  // '(' or '[' ... : a tuple, a list, or a parenthesised single value, as in
  // Python: "(3)" is the integer 3, "(3,)" the tuple.
  Value parse_sequence(int depth) {
    Value v;
    v.offset = base_ + pos_;
    char open = text_[pos_++];
    char close = open == '(' ? ')' : ']';
    v.kind = open == '(' ? Value::Kind::kTuple : Value::Kind::kList;
    bool trailing_comma = false;
    for (;;) {
      skip_space();
      if (peek() == close) break;
      v.items.push_back(parse_value(depth + 1));
      skip_space();
      trailing_comma = false;
      if (peek() == ',') {
        ++pos_;
        trailing_comma = true;
      } else if (peek() != close) {
        error(std::string("expected ',' or '") + close + "'");
      }
    }
    ++pos_;
    if (open == '(' && v.items.size() == 1 && !trailing_comma) {
      Value inner = std::move(v.items[0]);
      return inner;
    }
    return v;
  }

  std::string_view text_;
  size_t base_;
  const Where& where_;
  size_t pos_ = 0;
};

// What a .npy header says.
struct Header {
  Dtype dtype = Dtype::kF4;
  std::vector<int64_t> shape;
  size_t data_offset = 0;  // where the data starts in the file
  size_t nbytes = 0;       // how long the data is
};

// The fixed part before the dict: magic, version, header length.
struct Preamble {
  size_t header_start = 0;
  size_t header_len = 0;
};

// Reads the magic, version and header length from the first bytes of a file
// of `file_size` bytes (`p` holds at least min(file_size, 12) of them).
// Checks the first min(size, 6) bytes at `p` against the magic string.
void check_magic(const unsigned char* p, size_t size, const Where& where) {
  size_t n = std::min(size, kMagicLen);
  if (std::memcmp(p, kMagic, n) != 0) {
    size_t i = 0;
    while (i < n && p[i] == static_cast<unsigned char>(kMagic[i])) ++i;
    where.fail("not a .npy file: bad magic" + at(i) + " (expected \\x93NUMPY, found " +
               quoted(std::string_view(reinterpret_cast<const char*>(p), n), kMagicLen) + ")");
  }
}

Preamble parse_preamble(const unsigned char* p, size_t file_size, const Where& where) {
  check_magic(p, file_size, where);
  if (file_size < kMagicLen + 2) {
    where.fail("file too short: " + std::to_string(file_size) +
               " bytes end inside the .npy preamble");
  }
  int major = p[6], minor = p[7];
  if (minor != 0 || major < 1 || major > 3) {
    where.fail("unsupported .npy format version " + std::to_string(major) + "." +
               std::to_string(minor) + at(6) + " (supported: 1.0, 2.0, 3.0)");
  }
  Preamble pre;
  size_t len_size = major == 1 ? 2 : 4;
  pre.header_start = 8 + len_size;
  if (file_size < pre.header_start) {
    where.fail("file too short: " + std::to_string(file_size) +
               " bytes end inside the header length field" + at(8));
  }
  for (size_t i = 0; i < len_size; ++i) pre.header_len |= size_t{p[8 + i]} << (8 * i);
  if (pre.header_len > file_size - pre.header_start) {
    where.fail("header length " + std::to_string(pre.header_len) + at(8) +
               " runs past the end of the file: only " +
               std::to_string(file_size - pre.header_start) + " bytes follow" +
               at(pre.header_start));
  }
  return pre;
}

// `allow_u2`: also take '<u2' (parse_npy_header's readers of bfloat16 bits).
Dtype parse_descr(const Value& v, const Where& where, bool allow_u2) {
  if (v.kind == Value::Kind::kList) {
    where.fail("structured dtypes (a list 'descr'" + at(v.offset) +
               ") are not supported; expected one of <f4, <f8, <i4, <i8, |b1, |u1");
  }
  if (v.kind != Value::Kind::kString) {
    where.fail(std::string("'descr'") + at(v.offset) + " is " + kind_name(v.kind) +
               ", expected a dtype string such as '<f4'");
  }
  const std::string& d = v.text;
  std::string_view type = d.size() == 3 ? std::string_view(d).substr(1) : std::string_view();
  std::optional<Dtype> dtype;
  if (type == "f4") dtype = Dtype::kF4;
  if (type == "f8") dtype = Dtype::kF8;
  if (type == "i4") dtype = Dtype::kI4;
  if (type == "i8") dtype = Dtype::kI8;
  if (type == "u2" && allow_u2) dtype = Dtype::kU2;
  // One-byte types have no byte order: '|' (NumPy's), or any of '<', '>', '='.
  if (type == "b1" || type == "u1") {
    if (d[0] == '|' || d[0] == '<' || d[0] == '>' || d[0] == '=') {
      return type == "b1" ? Dtype::kB1 : Dtype::kU1;
    }
  }
  if (dtype && d[0] == '>') {
    where.fail("big-endian dtype " + quoted(d) + at(v.offset) +
               " is not supported; expected little-endian '<" + std::string(type) + "'");
  }
  // '=' is native order, which is little-endian here (see the static_assert).
  if (dtype && (d[0] == '<' || d[0] == '=')) return *dtype;
  if (d.size() >= 2 && d[1] == 'O') {
    where.fail("object arrays (dtype " + quoted(d) + at(v.offset) + ") are not supported");
  }
  where.fail("unsupported dtype " + quoted(d) + at(v.offset) +
             "; expected one of <f4, <f8, <i4, <i8, |b1, |u1");
}

// Parses the dict of `header_len` bytes at `p` (file offset `base`) and checks
// the shape against the dtype; the data length is left to the caller.
Header parse_header_dict(const unsigned char* p, const Preamble& pre, const Where& where,
                         bool allow_u2 = false) {
  std::string_view text(reinterpret_cast<const char*>(p), pre.header_len);
  HeaderParser parser(text, pre.header_start, where);
  auto entries = parser.parse_dict();

  const Value* descr = nullptr;
  const Value* fortran_order = nullptr;
  const Value* shape = nullptr;
  for (const auto& [key, value] : entries) {
    if (key.kind != Value::Kind::kString) {
      where.fail("header key" + at(key.offset) + " is " + kind_name(key.kind) +
                 ", expected a string");
    }
    const Value** slot = key.text == "descr"           ? &descr
                         : key.text == "fortran_order" ? &fortran_order
                         : key.text == "shape"         ? &shape
                                                       : nullptr;
    if (!slot) {
      where.fail("unexpected header key " + quoted(key.text) + at(key.offset) +
                 " (expected 'descr', 'fortran_order' and 'shape')");
    }
    if (*slot) where.fail("duplicate header key " + quoted(key.text) + at(key.offset));
    *slot = &value;
  }
  std::string missing;
  for (auto [value, name] :
       {std::pair{descr, "'descr'"}, std::pair{fortran_order, "'fortran_order'"},
        std::pair{shape, "'shape'"}}) {
    if (!value) missing += (missing.empty() ? "" : ", ") + std::string(name);
  }
  if (!missing.empty()) {
    where.fail("header" + at(pre.header_start) + " is missing key(s) " + missing + ": " +
               quoted(text, 120));
  }

  Header h;
  h.dtype = parse_descr(*descr, where, allow_u2);

  if (fortran_order->kind == Value::Kind::kTrue) {
    where.fail("Fortran-order arrays are not supported ('fortran_order': True" +
               at(fortran_order->offset) + "); save a C-order array");
  }
  if (fortran_order->kind != Value::Kind::kFalse) {
    where.fail(std::string("'fortran_order'") + at(fortran_order->offset) + " is " +
               kind_name(fortran_order->kind) + ", expected False");
  }

  if (shape->kind != Value::Kind::kTuple) {
    where.fail(std::string("'shape'") + at(shape->offset) + " is " + kind_name(shape->kind) +
               ", expected a tuple such as (2, 3)");
  }
  for (const Value& size : shape->items) {
    if (size.kind != Value::Kind::kInt) {
      where.fail(std::string("shape entry") + at(size.offset) + " is " + kind_name(size.kind) +
                 ", expected an integer");
    }
    if (size.integer < 0) {
      where.fail("negative size " + std::to_string(size.integer) + " in shape" + at(size.offset));
    }
    h.shape.push_back(size.integer);
  }
  if (h.shape.size() > static_cast<size_t>(kMaxRank)) {
    where.fail("shape " + shape_str(h.shape) + at(shape->offset) + " has rank " +
               std::to_string(h.shape.size()) + "; at most " + std::to_string(kMaxRank) +
               " is supported");
  }
  // The byte count must fit in int64 even ignoring zero sizes (as NumPy
  // checks), so element counts and strides computed from it never overflow.
  int64_t nbytes = static_cast<int64_t>(item_size(h.dtype));
  bool empty = false;
  for (int64_t size : h.shape) {
    if (size == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(nbytes, size, &nbytes)) {
      where.fail("shape " + shape_str(h.shape) + at(shape->offset) + " of " + dtype_name(h.dtype) +
                 " is too large: its byte count overflows 64 bits");
    }
  }
  h.nbytes = empty ? 0 : static_cast<size_t>(nbytes);
  h.data_offset = pre.header_start + pre.header_len;
  return h;
}

// The data must be exactly as long as the header says.
void check_data_length(const Header& h, size_t available, const Where& where) {
  std::string what = "shape " + shape_str(h.shape) + " of " + dtype_name(h.dtype) + " (" +
                     std::to_string(h.nbytes) + " bytes)";
  if (available < h.nbytes) {
    where.fail("truncated data: header says " + what + " but only " + std::to_string(available) +
               " bytes follow" + at(h.data_offset));
  }
  if (available > h.nbytes) {
    where.fail("header lies about size: it says " + what + " but " + std::to_string(available) +
               " bytes follow" + at(h.data_offset) + " (" + std::to_string(available - h.nbytes) +
               " extra)");
  }
}

// A zero-filled tensor of the header's dtype and shape.
NpyArray make_array(const Header& h) {
  Shape shape(h.shape.begin(), h.shape.end());
  switch (h.dtype) {
    case Dtype::kF4:
      return Tensor<float>(shape);
    case Dtype::kF8:
      return Tensor<double>(shape);
    case Dtype::kI4:
      return Tensor<int32_t>(shape);
    case Dtype::kI8:
      return Tensor<int64_t>(shape);
    case Dtype::kB1:
    case Dtype::kU1:
      return Tensor<uint8_t>(shape);
    case Dtype::kU2:  // refused by parse_descr here
      break;
  }
  return {};
}

NpyArray parse(const void* bytes, size_t size, const Where& where) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  Preamble pre = parse_preamble(p, size, where);
  Header h = parse_header_dict(p + pre.header_start, pre, where);
  check_data_length(h, size - h.data_offset, where);
  NpyArray array = make_array(h);
  void* data = std::visit([](auto& t) -> void* { return t.data(); }, array);
  if (h.nbytes) std::memcpy(data, p + h.data_offset, h.nbytes);
  return array;
}

// ---- reading from a file descriptor

std::string errno_text(int err) { return std::strerror(err); }

// Closes a file descriptor when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, reporting the error close() may carry (deferred write errors).
  int close() {
    if (fd_ < 0) return 0;
    int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

// Reads up to `n` bytes at `offset` (or from the current position if offset
// is -1), fewer only at end of file; throws on read errors.
size_t read_fully(int fd, void* buf, size_t n, off_t offset, const Where& where) {
  size_t done = 0;
  while (done < n) {
    ssize_t got = offset < 0 ? ::read(fd, static_cast<char*>(buf) + done, n - done)
                             : ::pread(fd, static_cast<char*>(buf) + done, n - done,
                                       offset + static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) where.fail("cannot read: " + errno_text(errno));
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

// A pipe or device has no size up front. The preamble and header are checked
// as they arrive, and the data is read only as far as the header says plus
// one byte (to find any excess): a stream that is not a .npy file, such as
// /dev/zero, fails after its first bytes, and one that never ends is not read
// to the end of memory. Buffers grow as bytes arrive, not from the header's
// claims, so a short stream claiming a huge shape allocates little.
// `consumed` holds the stream's first bytes, already read by the caller.
template <class T>
Tensor<T> read_stream_data(int fd, const Header& h, std::string_view consumed, const Where& where) {
  const size_t total = h.nbytes;
  if (consumed.size() > total) check_data_length(h, consumed.size(), where);
  std::vector<T> values;
  const auto room = [&] { return values.size() * sizeof(T); };
  const auto grow_to = [&](size_t bytes) {
    values.resize((std::min(bytes, total) + sizeof(T) - 1) / sizeof(T));
  };
  constexpr size_t kFirstChunk = size_t{1} << 20;
  grow_to(std::max(consumed.size(), kFirstChunk));
  if (!consumed.empty()) std::memcpy(values.data(), consumed.data(), consumed.size());
  size_t have = consumed.size();
  while (have < total) {
    if (have == room()) grow_to(2 * room());
    const size_t got =
        read_fully(fd, reinterpret_cast<char*>(values.data()) + have, room() - have, -1, where);
    have += got;
    if (have < room()) break;  // the stream ended
  }
  if (have < total) check_data_length(h, have, where);
  char extra;
  if (read_fully(fd, &extra, 1, -1, where) > 0) {
    where.fail("header lies about size: it says shape " + shape_str(h.shape) + " of " +
               dtype_name(h.dtype) + " (" + std::to_string(total) +
               " bytes) but more bytes follow" + at(h.data_offset + total));
  }
  return Tensor<T>(Shape(h.shape.begin(), h.shape.end()), std::move(values));
}

NpyArray read_stream(int fd, std::string_view consumed, const Where& where) {
  std::string head(consumed);
  // Reads until `head` holds n bytes or the stream ends.
  const auto fill = [&](size_t n) {
    constexpr size_t kStep = size_t{1} << 20;
    while (head.size() < n) {
      const size_t old = head.size(), want = std::min(n - old, kStep);
      head.resize(old + want);
      const size_t got = read_fully(fd, head.data() + old, want, -1, where);
      head.resize(old + got);
      if (got < want) return;
    }
  };
  const auto bytes = [&] { return reinterpret_cast<const unsigned char*>(head.data()); };
  fill(kMagicLen);
  check_magic(bytes(), head.size(), where);
  constexpr size_t kLongestPreamble = kMagicLen + 2 + 4;
  fill(kLongestPreamble);
  // A stream too short for a preamble: the whole-file parser says what is wrong.
  if (head.size() < kLongestPreamble) return parse(head.data(), head.size(), where);
  const Preamble pre = parse_preamble(bytes(), std::numeric_limits<size_t>::max(), where);
  fill(pre.header_start + pre.header_len);
  if (head.size() < pre.header_start + pre.header_len) {
    where.fail("file too short: header of " + std::to_string(pre.header_len) + " bytes" +
               at(pre.header_start) + " ends after " +
               std::to_string(head.size() - std::min(head.size(), pre.header_start)));
  }
  const Header h = parse_header_dict(bytes() + pre.header_start, pre, where);
  const std::string_view data = std::string_view(head).substr(h.data_offset);
  switch (h.dtype) {
    case Dtype::kF4:
      return read_stream_data<float>(fd, h, data, where);
    case Dtype::kF8:
      return read_stream_data<double>(fd, h, data, where);
    case Dtype::kI4:
      return read_stream_data<int32_t>(fd, h, data, where);
    case Dtype::kI8:
      return read_stream_data<int64_t>(fd, h, data, where);
    case Dtype::kB1:
    case Dtype::kU1:
      return read_stream_data<uint8_t>(fd, h, data, where);
    case Dtype::kU2:  // refused by parse_descr here
      break;
  }
  return {};
}

// A regular file: the header is checked against the file size before
// anything is allocated, then the data is read straight into the tensor.
NpyArray read_regular(int fd, size_t file_size, const Where& where) {
  unsigned char head[12] = {};
  size_t got = read_fully(fd, head, std::min(file_size, sizeof head), 0, where);
  if (got < std::min(file_size, sizeof head)) file_size = got;  // it shrank under us
  Preamble pre = parse_preamble(head, file_size, where);

  std::string header(pre.header_len, '\0');
  got = read_fully(fd, header.data(), header.size(), static_cast<off_t>(pre.header_start), where);
  if (got < header.size()) {
    where.fail("file too short: header of " + std::to_string(pre.header_len) + " bytes" +
               at(pre.header_start) + " ends after " + std::to_string(got));
  }
  Header h = parse_header_dict(reinterpret_cast<const unsigned char*>(header.data()), pre, where);
  check_data_length(h, file_size - h.data_offset, where);

  NpyArray array = make_array(h);
  void* data = std::visit([](auto& t) -> void* { return t.data(); }, array);
  auto data_offset = static_cast<off_t>(h.data_offset);
  got = read_fully(fd, data, h.nbytes, data_offset, where);
  if (got < h.nbytes) check_data_length(h, got, where);
  // The file may also have grown since fstat.
  char extra[4096];
  size_t more = 0;
  while ((got = read_fully(fd, extra, sizeof extra,
                           data_offset + static_cast<off_t>(h.nbytes + more), where)) > 0) {
    more += got;
  }
  if (more > 0) check_data_length(h, h.nbytes + more, where);
  return array;
}

NpyArray read_fd(int fd, std::string_view consumed, const Where& where) {
  struct stat st;
  if (::fstat(fd, &st) != 0) where.fail("cannot stat: " + errno_text(errno));
  if (S_ISDIR(st.st_mode)) where.fail("cannot read: " + errno_text(EISDIR));
  // A regular file is read by offset from its start, so what the caller
  // consumed is simply read again.
  if (S_ISREG(st.st_mode)) return read_regular(fd, static_cast<size_t>(st.st_size), where);
  return read_stream(fd, consumed, where);
}

// ---- writing

template <class T>
void check_view(ConstView<T> array, std::string_view function) {
  for (int64_t size : array.shape()) {
    if (size < 0) {
      fail(function, "array has negative size in shape " + array.shape().str());
    }
  }
  int64_t nbytes = sizeof(T);
  for (int64_t size : array.shape()) {
    if (size != 0 && __builtin_mul_overflow(nbytes, size, &nbytes)) {
      fail(function, "array of shape " + array.shape().str() + " is too large");
    }
  }
  if (array.numel() > 0 && array.data() == nullptr) {
    fail(function, "array of shape " + array.shape().str() + " has no data");
  }
}

// NumPy's header for this dtype and shape, padded with spaces and a final
// '\n' so that the data starts at a multiple of 64 bytes.
std::string header_bytes(Dtype dtype, const Shape& shape) {
  std::string dict = "{'descr': '";
  dict += dtype_name(dtype);
  dict += "', 'fortran_order': False, 'shape': (";
  for (int a = 0; a < shape.rank(); ++a) {
    if (a) dict += ", ";
    dict += std::to_string(shape[a]);
  }
  dict += shape.rank() == 1 ? ",), }" : "), }";

  // Version 1.0 stores the header length in 2 bytes; 2.0 is needed past that.
  int major = 1;
  size_t prefix = kMagicLen + 2 + 2;
  size_t total = (prefix + dict.size() + 1 + kAlign - 1) / kAlign * kAlign;
  if (total - prefix > 0xffff) {
    major = 2;
    prefix = kMagicLen + 2 + 4;
    total = (prefix + dict.size() + 1 + kAlign - 1) / kAlign * kAlign;
  }
  size_t header_len = total - prefix;
  dict.append(header_len - dict.size() - 1, ' ');
  dict += '\n';

  std::string out(kMagic, kMagicLen);
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < (major == 1 ? 2u : 4u); ++i) {
    out += static_cast<char>((header_len >> (8 * i)) & 0xff);
  }
  return out + dict;
}

// Emits the elements of `array` in row-major order as bytes, in chunks.
template <class T>
void emit_data(ConstView<T> array, const std::function<void(const void*, size_t)>& sink) {
  int64_t n = array.numel();
  if (n == 0) return;
  if (array.is_contiguous()) {
    sink(array.data(), static_cast<size_t>(n) * sizeof(T));
    return;
  }
  // Strided: gather into a buffer walking the indices like an odometer.
  constexpr int64_t kChunk = 16384 / sizeof(T);
  std::vector<T> buf;
  buf.reserve(static_cast<size_t>(std::min(n, kChunk)));
  const Shape& shape = array.shape();
  std::array<int64_t, kMaxRank> index{};
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (int a = 0; a < shape.rank(); ++a) offset += index[a] * array.stride(a);
    buf.push_back(array.data()[offset]);
    if (static_cast<int64_t>(buf.size()) == kChunk) {
      sink(buf.data(), buf.size() * sizeof(T));
      buf.clear();
    }
    for (int a = shape.rank() - 1; a >= 0; --a) {
      if (++index[a] < shape[a]) break;
      index[a] = 0;
    }
  }
  if (!buf.empty()) sink(buf.data(), buf.size() * sizeof(T));
}

template <class T>
std::string to_bytes(ConstView<T> array) {
  check_view(array, "npy_bytes");
  std::string out = header_bytes(dtype_of<T>(), array.shape());
  out.reserve(out.size() + static_cast<size_t>(array.numel()) * sizeof(T));
  emit_data<T>(array, [&](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); });
  return out;
}

template <class T>
void write_file(const std::string& path, ConstView<T> array) {
  check_view(array, "write_npy");
  StagedFile file("write_npy", "", path);
  file.write(header_bytes(dtype_of<T>(), array.shape()));
  emit_data<T>(array, [&](const void* p, size_t n) {
    file.write(std::string_view(static_cast<const char*>(p), n));
  });
  file.commit();
}

}  // namespace

NpyArray parse_npy(const void* bytes, size_t size, const std::string& name) {
  if (bytes == nullptr && size > 0) {
    fail("parse_npy", name + ": null buffer of " + std::to_string(size) + " bytes");
  }
  static const unsigned char kNothing = 0;
  return parse(bytes ? bytes : &kNothing, size, Where{"parse_npy", name});
}

NpyHeader parse_npy_header(const void* bytes, size_t size, const std::string& name) {
  const Where where{"parse_npy_header", name};
  if (bytes == nullptr && size > 0) where.fail("null buffer of " + std::to_string(size) + " bytes");
  static const unsigned char kNothing = 0;
  const auto* p = bytes ? static_cast<const unsigned char*>(bytes) : &kNothing;
  const Preamble pre = parse_preamble(p, size, where);
  const Header h = parse_header_dict(p + pre.header_start, pre, where, /*allow_u2=*/true);
  check_data_length(h, size - h.data_offset, where);
  return {dtype_name(h.dtype), Shape(h.shape.begin(), h.shape.end()), h.data_offset, h.nbytes};
}

std::string npy_header_bytes(std::string_view descr, const Shape& shape) {
  for (Dtype dtype : {Dtype::kF4, Dtype::kF8, Dtype::kI4, Dtype::kI8, Dtype::kU1, Dtype::kU2}) {
    if (descr == dtype_name(dtype)) return header_bytes(dtype, shape);
  }
  fail("npy_header_bytes", "unsupported dtype " + quoted(descr) +
                               "; expected one of <f4, <f8, <i4, <i8, |u1, <u2");
}

NpyArray read_npy(const std::string& path) {
  Where where{"read_npy", path};
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) where.fail("cannot open: " + errno_text(errno));
  Fd fd(raw);
  return read_fd(fd.get(), {}, where);
}

NpyArray read_npy(int fd, const std::string& name, std::string_view consumed) {
  return read_fd(fd, consumed, Where{"read_npy", name});
}

std::string npy_bytes(ConstView<float> array) { return to_bytes(array); }
std::string npy_bytes(ConstView<double> array) { return to_bytes(array); }
std::string npy_bytes(ConstView<int32_t> array) { return to_bytes(array); }
std::string npy_bytes(ConstView<int64_t> array) { return to_bytes(array); }
std::string npy_bytes(ConstView<uint8_t> array) { return to_bytes(array); }

void write_npy(const std::string& path, ConstView<float> array) { write_file(path, array); }
void write_npy(const std::string& path, ConstView<double> array) { write_file(path, array); }
void write_npy(const std::string& path, ConstView<int32_t> array) { write_file(path, array); }
void write_npy(const std::string& path, ConstView<int64_t> array) { write_file(path, array); }
void write_npy(const std::string& path, ConstView<uint8_t> array) { write_file(path, array); }

}  // namespace qkv
