// Printing a tensor: `std::cout << t` for a Tensor or a view writes its shape
// and its values as NumPy's np.array2string(a, separator=", ") would: nested
// brackets, rows of the last axis wrapped at 75 characters, every number
// right-aligned to the widest one shown, and, past 1000 elements (NumPy's
// threshold), only the first and last 3 entries of each axis longer than 6,
// with "..." between.
// Floating-point values are written as the stream's default format writes
// them (6 significant digits), so the numbers, not the brackets, may read
// differently from NumPy's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "qkv/bfloat16.h"
#include "qkv/tensor.h"

namespace qkv {
namespace detail {

// NumPy's print options: summarise above 1000 elements, keeping 3 at each end.
inline constexpr int64_t kPrintThreshold = 1000;
inline constexpr int64_t kPrintEdgeItems = 3;
inline constexpr size_t kPrintLineWidth = 75;

template <class T>
std::string format_element(const T& x) {
  std::ostringstream s;
  if constexpr (std::is_same_v<T, bfloat16>) {
    s << static_cast<float>(x);
  } else if constexpr (std::is_same_v<T, int8_t> || std::is_same_v<T, uint8_t>) {
    s << static_cast<int>(x);  // a number, not a character
  } else {
    s << x;
  }
  return s.str();
}

// The indices of one axis that are printed: all of them, or the first and
// last kPrintEdgeItems with -1 standing for the "..." between.
inline std::vector<int64_t> printed_indices(int64_t size, bool summarise) {
  std::vector<int64_t> indices;
  if (summarise && size > 2 * kPrintEdgeItems) {
    for (int64_t i = 0; i < kPrintEdgeItems; ++i) indices.push_back(i);
    indices.push_back(-1);
    for (int64_t i = size - kPrintEdgeItems; i < size; ++i) indices.push_back(i);
  } else {
    for (int64_t i = 0; i < size; ++i) indices.push_back(i);
  }
  return indices;
}

// Calls f(offset) for every element printed, in order.
template <class T, class F>
void for_each_printed(const TensorView<const T>& t, bool summarise, int axis, int64_t offset,
                      F&& f) {
  if (axis == t.rank()) {
    f(offset);
    return;
  }
  for (int64_t i : printed_indices(t.size(axis), summarise)) {
    if (i >= 0) for_each_printed(t, summarise, axis + 1, offset + i * t.stride(axis), f);
  }
}

// NumPy's _extendLine: `word` onto `line`, first moving a line that would
// pass `width` into `text` (unless the line holds only its indent).
inline void extend_line(std::string& text, std::string& line, const std::string& word, size_t width,
                        const std::string& indent) {
  if (line.size() + word.size() > width && line.size() > indent.size()) {
    text += line.substr(0, line.find_last_not_of(' ') + 1) + '\n';
    line = indent;
  }
  line += word;
}

// NumPy 1.24's _formatArray, which np.array2string runs: the entries of
// `axis` at `offset` in brackets; rows of the last axis wrapped to `width`
// (75 at the top, one less per bracket), other axes one entry per line with
// a blank line per axis below the next, "..." for what a summary leaves out.
template <class T>
std::string format_axis(const TensorView<const T>& t, bool summarise, size_t element_width,
                        int axis, int64_t offset, const std::string& indent, size_t width) {
  if (axis == t.rank()) {
    const std::string x = format_element(t.data()[offset]);
    return std::string(element_width > x.size() ? element_width - x.size() : 0, ' ') + x;
  }
  const std::string next_indent = indent + ' ';
  const size_t next_width = width - 1;  // the "]" that closes this axis
  const int below = t.rank() - axis - 1;
  std::string text;
  if (below == 0) {
    std::string line = indent;
    bool first = true;
    for (int64_t i : printed_indices(t.size(axis), summarise)) {
      if (!first) line += ", ";
      first = false;
      const std::string word =
          i < 0 ? "..."
                : format_axis(t, summarise, element_width, axis + 1, offset + i * t.stride(axis),
                              next_indent, next_width);
      extend_line(text, line, word, width - 1, indent);
    }
    text += line;
  } else {
    const std::string separator = "," + std::string(static_cast<size_t>(below), '\n');
    bool first = true;
    for (int64_t i : printed_indices(t.size(axis), summarise)) {
      if (!first) text += separator;
      first = false;
      text += indent;
      text += i < 0 ? "..."
                    : format_axis(t, summarise, element_width, axis + 1,
                                  offset + i * t.stride(axis), next_indent, next_width);
    }
  }
  return "[" + text.substr(indent.size()) + "]";
}

}  // namespace detail

// "shape [2, 3]" on the first line, then the values:
//   shape [2, 3]
//   [[0, 1, 2],
//    [3, 4, 5]]
template <class T>
std::ostream& operator<<(std::ostream& os, const TensorView<T>& view) {
  using Element = std::remove_const_t<T>;
  const TensorView<const Element> t = view;
  os << "shape " << t.shape().str() << '\n';
  if (t.numel() == 0) return os << "[]";
  const bool summarise = t.numel() > detail::kPrintThreshold;
  size_t width = 0;
  detail::for_each_printed(t, summarise, 0, 0, [&](int64_t offset) {
    width = std::max(width, detail::format_element(t.data()[offset]).size());
  });
  os << detail::format_axis(t, summarise, width, 0, 0, " ", detail::kPrintLineWidth);
  return os;
}

template <class T>
std::ostream& operator<<(std::ostream& os, const Tensor<T>& tensor) {
  return os << tensor.view();
}

}  // namespace qkv
