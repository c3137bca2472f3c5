// Tabular input for the qkv command: a strict CSV reader (header row required,
// comma separated, numbers only in the columns a command reads) whose errors
// name the file, line and column, and the quoting the CSV writers use.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/tensor.h"

namespace qkv::cli {

// A CSV file held in memory, its header parsed.
//
// Format: the first non-blank line is the header, one name per column; every
// later non-blank line is a data row with exactly as many fields. Fields are
// separated by commas; spaces and tabs around a field are ignored. A field may
// be quoted ("a, b" with "" for a quote inside, newlines allowed), which is
// how a header name holding a comma is written. Line ends are \n or \r\n; a
// UTF-8 byte order mark at the start is skipped; blank lines are skipped.
// Header names must be non-empty and distinct. A NUL byte anywhere is an
// error: a file holding one is not text (a binary file, /dev/zero).
//
// Every problem is a qkv::Error whose message starts with the file's name and
// says where: "data.csv: line 7, column 3 ("price"): "abc" is not a number".
class CsvFile {
 public:
  // Parses `text`; `name` (usually the path) goes into error messages.
  CsvFile(std::string text, std::string name);
  // Reads and parses the file at `path`; a file that cannot be read is an Error.
  static CsvFile read(const std::string& path);
  // Reads and parses the rest of an open file (a regular file, pipe or
  // device), whose first bytes `consumed` the caller already read. Each chunk
  // is checked for NUL bytes as it arrives, so a binary stream such as
  // /dev/zero fails after its first chunk instead of being read until memory
  // runs out.
  static CsvFile read(int fd, std::string name, std::string_view consumed = {});

  const std::string& name() const { return name_; }
  const std::vector<std::string>& columns() const { return columns_; }
  // The index of the column called `column`, if there is one.
  std::optional<int> find(std::string_view column) const;

  // The numbers in the given columns (indices into columns()) of every data
  // row: (rows, columns.size()), row-major, in file order. Every row is
  // checked for its field count; the selected cells must be finite numbers in
  // the syntax of std::from_chars (optionally with a leading '+'). An empty
  // cell, text, "nan", "inf", or a magnitude beyond the double range is an
  // Error naming line and column; so is a file without data rows.
  Tensor<double> numbers(const std::vector<int>& columns) const;
  // The text of the given columns of every data row, rows in file order
  // (quotes removed, "" unescaped). Field counts are checked as by numbers();
  // a file without data rows is an Error.
  std::vector<std::vector<std::string>> text(const std::vector<int>& columns) const;
  // At least as many as the data rows: the lines after the header (blank
  // lines and line breaks inside quotes count too), to reserve room for them.
  size_t max_rows() const;
  // The same rows one at a time: on_row(cells) with the text of the given
  // columns, views that last until on_row returns (63,697 rows of two
  // columns made into qkv lookup's records: 14 ms through text() and its
  // copies, 8 ms this way).
  void for_each_text(const std::vector<int>& columns,
                     const std::function<void(const std::vector<std::string_view>&)>& on_row) const;

 private:
  std::string text_;
  std::string name_;
  std::vector<std::string> columns_;
  size_t body_ = 0;        // offset of the first byte after the header row
  int64_t body_line_ = 1;  // the line number at body_
};

// Parses a whole cell as a number like CsvFile::numbers does; nullopt if the
// text is not one. Non-finite values ("nan", "inf") are returned as parsed,
// and a magnitude beyond the double range as +-inf, for the caller to judge.
std::optional<double> parse_number(std::string_view text);

// A header name as a CSV field: quoted (with "" for a quote) if it holds a
// comma, a quote, a line break or surrounding whitespace, else as it is.
std::string csv_field(std::string_view text);

}  // namespace qkv::cli
