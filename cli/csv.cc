// The CSV reader of the qkv command (csv.h): a single-pass tokenizer over the
// file held in memory. Unquoted fields are views into the text, so reading a
// million rows allocates only the output.
#include "csv.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <system_error>

#include "qkv/error.h"

namespace qkv::cli {
namespace {

bool is_blank(char c) { return c == ' ' || c == '\t'; }

// Quotes `text` for an error message: "abc". Long cells are cut short and
// control characters shown as \xNN, so a message stays one line.
std::string quoted(std::string_view text) {
  constexpr size_t kMaxShown = 40;
  std::string shown = "\"";
  for (const char c : text.substr(0, kMaxShown)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\x%02x", byte);
      shown += escape;
    } else {
      shown += c;
    }
  }
  return shown + (text.size() > kMaxShown ? "...\"" : "\"");
}

struct Field {
  std::string_view text;  // without the quotes and surrounding whitespace
  bool quoted = false;
};

// Splits the text into records of fields; blank lines are skipped.
class Tokenizer {
 public:
  // `columns`, the header's names (null while reading the header), name the
  // columns in messages.
  Tokenizer(std::string_view text, const std::string& name, size_t pos, int64_t line,
            const std::vector<std::string>* columns)
      : text_(text), name_(name), columns_(columns), pos_(pos), line_(line) {}

  size_t pos() const { return pos_; }
  int64_t line() const { return line_; }

  // Reads the next record into `fields` and its first line into `line`;
  // false at the end of the text.
  bool next(std::vector<Field>& fields, int64_t& line) {
    fields.clear();
    unescaped_.clear();
    if (!skip_blank_lines()) return false;
    line = line_;
    for (;;) {
      fields.push_back(field(line, static_cast<int64_t>(fields.size()) + 1));
      // field() stops at a comma, a line end or the end of the text. After a
      // comma another field follows, empty if the line ends there.
      if (pos_ == text_.size()) return true;
      if (text_[pos_++] == '\n') {
        ++line_;
        return true;
      }
    }
  }

  // "<file>: line 7, column 3 ("price"): <what>"; the column's name is shown
  // once the header is known.
  [[noreturn]] void fail(int64_t line, int64_t column, const std::string& what) const {
    std::string where =
        name_ + ": line " + std::to_string(line) + ", column " + std::to_string(column);
    if (columns_ != nullptr && column >= 1 && static_cast<size_t>(column) <= columns_->size()) {
      where += " (" + quoted((*columns_)[column - 1]) + ")";
    }
    throw Error(where + ": " + what);
  }

 private:
  // Moves past blank lines (only spaces, tabs and \r); false at the end.
  bool skip_blank_lines() {
    while (pos_ < text_.size()) {
      size_t p = pos_;
      while (p < text_.size() && (is_blank(text_[p]) || text_[p] == '\r')) ++p;
      if (p == text_.size()) {
        pos_ = p;
        return false;
      }
      if (text_[p] != '\n') return true;
      pos_ = p + 1;
      ++line_;
    }
    return false;
  }

  // One field, leaving pos_ at the comma, line end or end of text after it.
  Field field(int64_t record_line, int64_t column) {
    while (pos_ < text_.size() && is_blank(text_[pos_])) ++pos_;
    if (pos_ < text_.size() && text_[pos_] == '"') return quoted_field(record_line, column);
    const size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '\n') {
      if (text_[pos_] == '"') {
        fail(line_, column, "a quote inside an unquoted field (quote the whole field)");
      }
      ++pos_;
    }
    size_t end = pos_;
    while (end > start && (is_blank(text_[end - 1]) || text_[end - 1] == '\r')) --end;
    return {text_.substr(start, end - start), false};
  }

  Field quoted_field(int64_t record_line, int64_t column) {
    const int64_t open_line = line_;
    ++pos_;  // the opening quote
    const size_t start = pos_;
    bool escaped = false;
    for (;;) {
      const size_t q = text_.find('"', pos_);
      if (q == std::string_view::npos) {
        fail(open_line, column, "the quote that opens this field is never closed");
      }
      for (size_t p = pos_; p < q; ++p) line_ += text_[p] == '\n';
      if (q + 1 < text_.size() && text_[q + 1] == '"') {
        escaped = true;
        pos_ = q + 2;
        continue;
      }
      pos_ = q + 1;
      break;
    }
    std::string_view inner = text_.substr(start, pos_ - 1 - start);
    if (escaped) {
      std::string& s = unescaped_.emplace_back();
      for (size_t i = 0; i < inner.size(); ++i) {
        s += inner[i];
        if (inner[i] == '"') ++i;  // "" stands for one quote
      }
      inner = s;
    }
    while (pos_ < text_.size() && (is_blank(text_[pos_]) || text_[pos_] == '\r')) ++pos_;
    if (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '\n') {
      fail(line_, column,
           "unexpected " + quoted(text_.substr(pos_, 1)) + " after the closing quote" +
               (line_ != record_line
                    ? " (the record starts on line " + std::to_string(record_line) + ")"
                    : std::string()));
    }
    return {inner, true};
  }

 private:
  std::string_view text_;
  const std::string& name_;
  const std::vector<std::string>* columns_;
  size_t pos_;
  int64_t line_;
  std::deque<std::string> unescaped_;  // quoted fields with "" escapes (stable addresses)
};

// A NUL byte in text[from, to) is an error naming its line and byte offset.
// The line is counted only then, from the start of the text: counting the
// lines of every chunk as it was checked, and of the whole text again, was
// 2.3 ms of the 3.7 ms that reading a table of 63,697 package names (2.3 MB)
// took.
void check_no_nul(std::string_view text, size_t from, size_t to, const std::string& name) {
  const void* nul = std::memchr(text.data() + from, '\0', to - from);
  if (nul == nullptr) return;
  const auto end = static_cast<size_t>(static_cast<const char*>(nul) - text.data());
  const int64_t line = 1 + std::count(text.data(), text.data() + end, '\n');
  throw Error(name + ": line " + std::to_string(line) + ": a NUL byte at byte offset " +
              std::to_string(end) + "; a CSV file is text (is this a binary file?)");
}

// The data rows of a CSV body (from offset `body`, line `body_line`) under
// the header `header`, for CsvFile::numbers and CsvFile::text: checks that
// `selected` are columns of the header and that every row has the header's
// field count, calls on_row(fields, line, tokens) for each row and returns
// how many there were; a body without rows is an Error.
template <class OnRow>
int64_t for_each_row(std::string_view text, const std::string& name, size_t body, int64_t body_line,
                     const std::vector<std::string>& header, const std::vector<int>& selected,
                     OnRow on_row) {
  const size_t width = header.size();
  for (const int c : selected) {
    if (c < 0 || static_cast<size_t>(c) >= width) {
      throw Error(name + ": no column " + std::to_string(c) + " (the file has " +
                  std::to_string(width) + ")");
    }
  }
  Tokenizer tokens(text, name, body, body_line, &header);
  std::vector<Field> fields;
  int64_t rows = 0;
  int64_t line = 0;
  while (tokens.next(fields, line)) {
    if (fields.size() != width) {
      throw Error(name + ": line " + std::to_string(line) + " has " +
                  std::to_string(fields.size()) + (fields.size() == 1 ? " field" : " fields") +
                  " but the header has " + std::to_string(width));
    }
    on_row(fields, line, tokens);
    ++rows;
  }
  if (rows == 0) throw Error(name + ": no data rows after the header");
  return rows;
}

}  // namespace

std::optional<double> parse_number(std::string_view text) {
  if (text.empty()) return std::nullopt;
  // from_chars takes no '+'; allow one before a digit or a point.
  if (text[0] == '+') {
    if (text.size() < 2 || !(std::isdigit(static_cast<unsigned char>(text[1])) || text[1] == '.')) {
      return std::nullopt;
    }
    text.remove_prefix(1);
  }
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value, std::chars_format::general);
  if (ptr != end) return std::nullopt;
  if (ec == std::errc::result_out_of_range) {
    // Too large (+-inf, for the caller to reject) or too small (underflow,
    // which strtod rounds to the nearest subnormal or zero).
    const std::string copy(text);
    errno = 0;
    value = std::strtod(copy.c_str(), nullptr);
    return value;
  }
  if (ec != std::errc()) return std::nullopt;
  return value;
}

std::string csv_field(std::string_view text) {
  const bool needs_quotes = text.empty() ||
                            text.find_first_of(",\"\r\n") != std::string_view::npos ||
                            is_blank(text.front()) || is_blank(text.back());
  if (!needs_quotes) return std::string(text);
  std::string out = "\"";
  for (const char c : text) {
    out += c;
    if (c == '"') out += '"';
  }
  return out + "\"";
}

CsvFile::CsvFile(std::string text, std::string name)
    : text_(std::move(text)), name_(std::move(name)) {
  check_no_nul(text_, 0, text_.size(), name_);
  size_t start = 0;
  if (text_.compare(0, 3, "\xEF\xBB\xBF") == 0) start = 3;  // UTF-8 byte order mark
  Tokenizer tokens(text_, name_, start, 1, nullptr);
  std::vector<Field> fields;
  int64_t line = 0;
  if (!tokens.next(fields, line))
    throw Error(name_ + ": the file is empty; expected a header row of column names");
  for (size_t c = 0; c < fields.size(); ++c) {
    const std::string name(fields[c].text);
    if (name.empty()) {
      tokens.fail(line, static_cast<int64_t>(c) + 1, "empty column name in the header");
    }
    for (size_t d = 0; d < c; ++d) {
      if (columns_[d] == name) {
        throw Error(name_ + ": line " + std::to_string(line) + ": column name " + quoted(name) +
                    " appears twice in the header (columns " + std::to_string(d + 1) + " and " +
                    std::to_string(c + 1) + ")");
      }
    }
    columns_.push_back(name);
  }
  body_ = tokens.pos();
  body_line_ = tokens.line();
}

CsvFile CsvFile::read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  try {
    CsvFile csv = read(fd, path);
    ::close(fd);
    return csv;
  } catch (...) {
    ::close(fd);
    throw;
  }
}

CsvFile CsvFile::read(int fd, std::string name, std::string_view consumed) {
  std::string text(consumed);
  check_no_nul(text, 0, text.size(), name);
  constexpr size_t kChunk = size_t{1} << 16;
  // A regular file's size is known: one allocation instead of a doubling
  // string's copies (a table of 2.3 MB read and checked in 3 ms, not 5).
  struct stat st;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    text.reserve(text.size() + static_cast<size_t>(st.st_size) + kChunk);
  }
  for (;;) {
    const size_t old = text.size();
    text.resize(old + kChunk);
    const ssize_t got = ::read(fd, text.data() + old, kChunk);
    if (got < 0 && errno == EINTR) {
      text.resize(old);
      continue;
    }
    if (got < 0) throw Error(name + ": cannot read: " + std::strerror(errno));
    text.resize(old + static_cast<size_t>(got));
    if (got == 0) break;
    check_no_nul(text, old, text.size(), name);
  }
  return CsvFile(std::move(text), std::move(name));
}

std::optional<int> CsvFile::find(std::string_view column) const {
  for (size_t c = 0; c < columns_.size(); ++c) {
    if (columns_[c] == column) return static_cast<int>(c);
  }
  return std::nullopt;
}

size_t CsvFile::max_rows() const {
  return 1 + static_cast<size_t>(std::count(text_.begin() + body_, text_.end(), '\n'));
}

Tensor<double> CsvFile::numbers(const std::vector<int>& columns) const {
  std::vector<double> values;
  const int64_t rows = for_each_row(
      text_, name_, body_, body_line_, columns_, columns,
      [&](const std::vector<Field>& fields, int64_t line, const Tokenizer& tokens) {
        for (const int c : columns) {
          const std::string_view cell = fields[c].text;
          const auto where = [&](const std::string& what) { tokens.fail(line, c + 1, what); };
          if (cell.empty()) where("empty cell; expected a number");
          const std::optional<double> value = parse_number(cell);
          if (!value) where(quoted(cell) + " is not a number");
          if (!std::isfinite(*value)) {
            where(quoted(cell) + (std::isnan(*value) ? " is not a number" : " is not finite") +
                  "; the data must be finite numbers");
          }
          values.push_back(*value);
        }
      });
  return Tensor<double>(Shape{rows, static_cast<int64_t>(columns.size())}, std::move(values));
}

std::vector<std::vector<std::string>> CsvFile::text(const std::vector<int>& columns) const {
  std::vector<std::vector<std::string>> rows;
  for_each_text(columns, [&](const std::vector<std::string_view>& cells) {
    rows.emplace_back(cells.begin(), cells.end());
  });
  return rows;
}

void CsvFile::for_each_text(
    const std::vector<int>& columns,
    const std::function<void(const std::vector<std::string_view>&)>& on_row) const {
  std::vector<std::string_view> cells(columns.size());
  for_each_row(text_, name_, body_, body_line_, columns_, columns,
               [&](const std::vector<Field>& fields, int64_t, const Tokenizer&) {
                 for (size_t i = 0; i < columns.size(); ++i) cells[i] = fields[columns[i]].text;
                 on_row(cells);
               });
}

}  // namespace qkv::cli
