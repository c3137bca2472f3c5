// `qkv regress`: Nadaraya–Watson kernel regression (d2l §11.2) from a CSV or
// .npy table, with a fixed, rule-of-thumb, cross-validated or learned bandwidth.
//   train: (n, p) x columns and (n) y   queries: (t, p)   predictions: (t)   weights: (t, n)
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "common.h"
#include "csv.h"
#include "progress.h"
#include "qkv/error.h"
#include "qkv/kernel_regression.h"
#include "qkv/npy.h"
#include "qkv/plot.h"
#include "qkv/threads.h"

namespace qkv::cli {
namespace {

// Grids above this many points are refused (numpy.arange would make them, but
// 1e8 queries is 1.6 GB of output CSV).
constexpr double kMaxGridPoints = 1e8;
// Above this many training points the leave-one-out error (n^2 kernel
// evaluations) is computed only on request (--loo); --bandwidth cv always has it.
constexpr int64_t kMaxAutoLooPoints = 50000;
// --weights above this many elements (4 GB of float64) is refused before the work.
constexpr double kMaxWeights = 5e8;

struct RegressArgs {
  std::string train, x_cols, y_col, query, grid, kernel, bandwidth, out, weights, plot;
  std::optional<int> epochs;
  std::optional<double> lr;
  uint64_t seed = 0;
  bool exact = false, json = false, verbose = false, quiet = false, loo = false;
  std::optional<int> threads;
  CLI::App* app = nullptr;  // to ask which options were given
  bool given(const char* option) const { return app->count(option) > 0; }
};

const char* const kBandwidthHelp =
    "a number > 0, a comma-separated list of them (one per x column), or silverman, scott, cv, "
    "cv-fast or learn";

std::string quote(const std::string& text) { return "\"" + text + "\""; }

// The comma-separated items of an option's value, spaces around them removed;
// an empty item is an error.
std::vector<std::string> split_list(const std::string& option, const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? comma : comma - start);
    const size_t first = item.find_first_not_of(" \t");
    const size_t last = item.find_last_not_of(" \t");
    item = first == std::string::npos ? std::string() : item.substr(first, last - first + 1);
    if (item.empty()) throw UsageError(option + " " + quote(text) + " has an empty item");
    items.push_back(item);
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

// ---- option values -------------------------------------------------------------

// --grid start:stop:step, the points of numpy.arange(start, stop, step).
struct Grid {
  double start = 0, step = 1;
  int64_t count = 0;
};

Grid parse_grid(const std::string& text) {
  const auto bad = [&](const std::string& why) -> UsageError {
    return UsageError("--grid " + quote(text) + ": " + why);
  };
  std::vector<double> parts;
  size_t start = 0;
  for (;;) {
    const size_t colon = text.find(':', start);
    const std::string part = text.substr(start, colon == std::string::npos ? colon : colon - start);
    const std::optional<double> value = parse_number(part);
    if (!value || !std::isfinite(*value)) {
      throw bad(quote(part) + " is not a finite number; expected start:stop:step");
    }
    parts.push_back(*value);
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (parts.size() != 3) {
    throw bad("expected start:stop:step (three numbers), got " + std::to_string(parts.size()));
  }
  const double first = parts[0], stop = parts[1], step = parts[2];
  if (step <= 0) throw bad("the step must be > 0");
  const double count = std::ceil((stop - first) / step);  // numpy.arange's length
  if (!(count >= 1)) throw bad("has no points: stop must be above start");
  if (count > kMaxGridPoints) {
    throw bad("has " + format_number(count, "%.6g") + " points; at most 1e8 are allowed");
  }
  return {first, step, static_cast<int64_t>(count)};
}

// --bandwidth: a rule's name or the numbers.
struct Bandwidth {
  std::string rule;            // "fixed", "silverman", "scott", "cv", "learn"
  std::vector<double> values;  // for "fixed": one, or one per x column
};

Bandwidth parse_bandwidth(const std::string& text) {
  for (const char* rule : {"silverman", "scott", "cv", "cv-fast", "learn"}) {
    if (text == rule) return {rule, {}};
  }
  Bandwidth b{"fixed", {}};
  for (const std::string& item : split_list("--bandwidth", text)) {
    const std::optional<double> h = parse_number(item);
    if (!h || !std::isfinite(*h) || *h <= 0) {
      throw UsageError("--bandwidth " + quote(text) + ": " + quote(item) +
                       " is not a bandwidth; expected " + kBandwidthHelp);
    }
    if (*h < std::numeric_limits<double>::min()) {
      throw UsageError("--bandwidth " + quote(text) + ": " + quote(item) + " is " +
                       exact_number(*h) +
                       ", a subnormal number below the smallest normal double "
                       "(2.2250738585072014e-308); a bandwidth that small cannot be represented "
                       "sensibly (1/h^2 overflows)");
    }
    b.values.push_back(*h);
  }
  return b;
}

// Option combinations and values that cannot mean anything, found before any
// file is read.
void check_options(const RegressArgs& args, const Bandwidth& bandwidth) {
  const bool learn = bandwidth.rule == "learn";
  if (args.given("--query") && args.given("--grid")) {
    throw UsageError("--query and --grid are alternatives; give one");
  }
  if (!args.given("--query") && !args.given("--grid")) {
    throw UsageError("give the points to predict at: --query FILE or --grid start:stop:step");
  }
  if (bandwidth.rule == "cv-fast" && kernel_from_name(args.kernel) != Kernel::kGaussian) {
    throw UsageError("--bandwidth cv-fast is cv through the fast 1-D Gaussian path; --kernel " +
                     args.kernel + " has none (use --bandwidth cv)");
  }
  if (learn && kernel_from_name(args.kernel) != Kernel::kGaussian) {
    throw UsageError("--bandwidth learn trains the chapter's Gaussian model; --kernel " +
                     args.kernel + " cannot be learned (use a number, silverman, scott or cv)");
  }
  if (!learn) {
    std::vector<std::string> misplaced;
    for (const char* option : {"--epochs", "--lr", "--seed"}) {
      if (args.given(option)) misplaced.push_back(option);
    }
    if (!misplaced.empty()) {
      throw UsageError(join(misplaced, " and ") + (misplaced.size() == 1 ? " is" : " are") +
                       " for --bandwidth learn; --bandwidth " + args.bandwidth + " trains nothing");
    }
  }
  if (args.epochs && *args.epochs < 1) {
    throw UsageError("--epochs must be >= 1, got " + std::to_string(*args.epochs));
  }
  if (args.lr && !(std::isfinite(*args.lr) && *args.lr > 0)) {
    throw UsageError("--lr must be a finite number > 0, got " + exact_number(*args.lr));
  }
}

// ---- input ------------------------------------------------------------------------

Tensor<double> as_double(FloatTensor tensor) {
  if (auto* d = std::get_if<Tensor<double>>(&tensor)) return std::move(*d);
  const Tensor<float>& f = std::get<Tensor<float>>(tensor);
  return Tensor<double>(f.shape(), std::vector<double>(f.values().begin(), f.values().end()));
}

// The training data: x (n, p) and y (n), with their column names.
struct Training {
  Tensor<double> x, y;
  std::vector<std::string> x_names;
  std::string y_name;
  std::string source;  // the file, for messages
  bool csv = false;
};

// Splits a (rows, p + 1) table whose last column is y.
void split_table(const Tensor<double>& table, Training& data) {
  const int64_t n = table.size(0), p = table.size(1) - 1;
  data.x = Tensor<double>(Shape{n, p});
  data.y = Tensor<double>(Shape{n});
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < p; ++c) data.x(i, c) = table(i, c);
    data.y(i) = table(i, p);
  }
}

void check_selection(const std::vector<std::string>& x_names, const std::string& y_name,
                     bool y_given) {
  for (size_t c = 0; c < x_names.size(); ++c) {
    for (size_t d = 0; d < c; ++d) {
      if (x_names[c] == x_names[d]) {
        throw UsageError("--x-cols names " + quote(x_names[c]) + " twice");
      }
    }
    if (x_names[c] == y_name) {
      throw UsageError(y_given ? "--y-col " + quote(y_name) + " is also one of --x-cols"
                               : "--y-col defaults to the last column, " + quote(y_name) +
                                     ", which is one of --x-cols; name the y column with "
                                     "--y-col");
    }
  }
}

// The training data from a CSV file whose first bytes (`prefix`) were read to
// tell it from .npy.
Training load_csv_training(const RegressArgs& args, OpenInput& file, std::string_view prefix) {
  const CsvFile csv = CsvFile::read(file.fd(), args.train, prefix);
  const std::vector<std::string>& columns = csv.columns();
  const auto column = [&](const std::string& option, const std::string& name) {
    const std::optional<int> c = csv.find(name);
    if (!c) {
      std::vector<std::string> listed(columns.begin(), columns.end());
      throw UsageError(option + " " + quote(name) + " is not a column of " + csv.name() +
                       " (columns: " + join(listed) + ")");
    }
    return *c;
  };
  Training data;
  data.source = csv.name();
  data.csv = true;
  const int y =
      args.given("--y-col") ? column("--y-col", args.y_col) : static_cast<int>(columns.size()) - 1;
  data.y_name = columns[y];
  std::vector<int> selected;
  if (args.given("--x-cols")) {
    data.x_names = split_list("--x-cols", args.x_cols);
    for (const std::string& name : data.x_names) selected.push_back(column("--x-cols", name));
  } else {
    for (size_t c = 0; c < columns.size(); ++c) {
      if (static_cast<int>(c) == y) continue;
      selected.push_back(static_cast<int>(c));
      data.x_names.push_back(columns[c]);
    }
    if (selected.empty()) {
      throw UsageError(csv.name() + " has only the column " + quote(data.y_name) +
                       "; it needs x columns besides the y column");
    }
  }
  check_selection(data.x_names, data.y_name, args.given("--y-col"));
  selected.push_back(y);
  split_table(csv.numbers(selected), data);
  return data;
}

// A column index of a .npy table for --x-cols or --y-col.
int column_index(const std::string& option, const std::string& text, const Input& input,
                 int64_t width) {
  int64_t c = -1;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), c);
  if (ec != std::errc() || ptr != text.data() + text.size() || c < 0 || c >= width) {
    throw UsageError(option + " " + quote(text) + " is not a column of " + input.describe() +
                     ", a .npy table of " + std::to_string(width) +
                     " columns: give column indices 0 to " + std::to_string(width - 1));
  }
  return static_cast<int>(c);
}

// Every value in the selected columns of `table` (rows, width) must be finite.
void check_finite(const Tensor<double>& table, const std::vector<int>& columns,
                  const Input& input) {
  const int64_t width = table.rank() == 2 ? table.size(1) : 1;
  const double* v = table.data();
  for (int64_t i = 0; i < table.size(0); ++i) {
    for (const int c : columns) {
      const double value = v[i * width + c];
      if (!std::isfinite(value)) {
        throw UsageError(input.describe() + ": row " + std::to_string(i) + ", column " +
                         std::to_string(c) + " is " + exact_number(value) +
                         "; the data must be finite numbers");
      }
    }
  }
}

Training load_npy_training(const RegressArgs& args, const Input& input, OpenInput& file,
                           std::string_view prefix) {
  const Tensor<double> table = as_double(load_float(input, file, prefix));
  if (table.rank() != 2 || table.size(1) < 2) {
    throw UsageError(input.describe() + " has shape " + table.shape().str() +
                     "; expected a 2-D table (n, k), k >= 2: x columns and a y column (by "
                     "default the last)");
  }
  if (table.size(0) == 0) throw UsageError(input.describe() + " has no rows");
  const int64_t width = table.size(1);
  Training data;
  data.source = input.path;
  const int y = args.given("--y-col") ? column_index("--y-col", args.y_col, input, width)
                                      : static_cast<int>(width - 1);
  std::vector<int> selected;
  if (args.given("--x-cols")) {
    for (const std::string& item : split_list("--x-cols", args.x_cols)) {
      selected.push_back(column_index("--x-cols", item, input, width));
    }
  } else {
    for (int c = 0; c < width; ++c) {
      if (c != y) selected.push_back(c);
    }
  }
  // .npy columns are called x<j> and y in outputs (and in a CSV --query).
  for (const int c : selected) data.x_names.push_back("x" + std::to_string(c));
  data.y_name = "y";
  for (const int c : selected) {
    if (c == y) {
      throw UsageError((args.given("--y-col")
                            ? "--y-col " + std::to_string(y)
                            : "--y-col (by default the last column, " + std::to_string(y) + ")") +
                       " is also one of --x-cols");
    }
  }
  check_selection(data.x_names, data.y_name, args.given("--y-col"));
  selected.push_back(y);
  check_finite(table, selected, input);
  const int64_t n = table.size(0);
  Tensor<double> picked(Shape{n, static_cast<int64_t>(selected.size())});
  for (int64_t i = 0; i < n; ++i) {
    for (size_t c = 0; c < selected.size(); ++c) picked(i, c) = table(i, selected[c]);
  }
  split_table(picked, data);
  return data;
}

// The queries, (t, p).
Tensor<double> load_queries(const RegressArgs& args, const Training& data) {
  const int64_t p = data.x.size(1);
  const std::string x_cols = join(data.x_names);
  if (args.given("--grid")) {
    if (p != 1) {
      throw UsageError("--grid makes 1-D queries but there are " + std::to_string(p) +
                       " x columns (" + x_cols + "); give --query FILE");
    }
    const Grid grid = parse_grid(args.grid);
    Tensor<double> q(Shape{grid.count, 1});
    for (int64_t i = 0; i < grid.count; ++i) {
      q(i, 0) = grid.start + static_cast<double>(i) * grid.step;
    }
    return q;
  }
  const Input input{"--query", args.query};
  // Opened once and told apart by its first bytes: a FIFO can be read only once.
  OpenInput file(input);
  const std::string prefix = file.read_prefix(kNpyMagicLength);
  if (!is_npy_prefix(prefix)) {
    const CsvFile csv = CsvFile::read(file.fd(), args.query, prefix);
    std::vector<int> selected;
    for (const std::string& name : data.x_names) {
      const std::optional<int> c = csv.find(name);
      if (!c) {
        throw UsageError(input.describe() + " has no column " + quote(name) + " (columns: " +
                         join(csv.columns()) + "); the queries need the x columns " + x_cols);
      }
      selected.push_back(*c);
    }
    return csv.numbers(selected);
  }
  Tensor<double> q = as_double(load_float(input, file, prefix));
  const Shape& shape = q.shape();
  const bool fits = (shape.rank() == 1 && p == 1) || (shape.rank() == 2 && shape[1] == p);
  if (!fits) {
    throw UsageError(input.describe() + " has shape " + shape.str() + " but there " +
                     (p == 1 ? "is 1 x column" : "are " + std::to_string(p) + " x columns") + " (" +
                     x_cols + "); expected " + (p == 1 ? "(t) or (t, 1)" : "(t, p)") +
                     " with p = " + std::to_string(p));
  }
  if (shape[0] == 0) throw UsageError(input.describe() + " holds no queries");
  q = std::move(q).reshaped(Shape{shape[0], p});
  std::vector<int> all;
  for (int c = 0; c < p; ++c) all.push_back(c);
  check_finite(q, all, input);
  return q;
}

// A (rows, p) table as the library takes it: (rows) when p is 1.
ConstView<double> features(const Tensor<double>& t) {
  return t.size(1) == 1 ? ConstView<double>(t.data(), Shape{t.size(0)}) : t.view();
}

// ---- output -----------------------------------------------------------------------

std::string predictions_csv(const Training& data, const Tensor<double>& queries,
                            const Tensor<double>& predictions) {
  std::string out;
  for (const std::string& name : data.x_names) out += csv_field(name) + ",";
  out += csv_field(data.y_name + "_pred") + "\n";
  const int64_t t = queries.size(0), p = queries.size(1);
  char text[64];
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t c = 0; c < p; ++c) {
      out.append(text, std::snprintf(text, sizeof text, "%.17g,", queries(i, c)));
    }
    const double f = predictions(i);
    if (std::isnan(f)) {
      out += "nan\n";  // printf may write "-nan"
    } else {
      out.append(text, std::snprintf(text, sizeof text, "%.17g\n", f));
    }
  }
  return out;
}

// The leave-one-out error when it is +inf because it exceeds the largest
// double (y beyond ~1e154: its squared errors overflow), in decimal; empty
// when it is +inf because no point has a leave-one-out estimate. The
// library's value cannot say which: the error is computed again (n^2 work,
// only in this case) with y divided by 2^k, exactly, and multiplied back
// through its logarithm.
std::string overflowed_loo_text(const Training& data, Kernel kernel,
                                const std::vector<double>& bandwidth) {
  double y_max = 0.0;
  for (const double v : data.y.values()) y_max = std::max(y_max, std::abs(v));
  if (!(y_max > 0.0)) return {};
  const int k = std::ilogb(y_max);
  Tensor<double> y = data.y;
  for (double& v : y.values()) v = std::ldexp(v, -k);
  KernelRegression scaled(features(data.x), y.view(), kernel);
  scaled.set_bandwidth(bandwidth);
  const double loo = scaled.loo_error();
  if (!std::isfinite(loo) || !(loo > 0.0)) return {};
  const double log10_loo = std::log10(loo) + 2.0 * k * std::log10(2.0);
  const double exponent = std::floor(log10_loo);
  return format_number(std::pow(10.0, log10_loo - exponent), "%.6g") + "e+" +
         format_number(exponent, "%.0f") + " (beyond the largest double, 1.8e308: null in --json)";
}

// ---- the figure (--plot) -----------------------------------------------------------

// --plot's format follows its extension, as qkv heatmap's --out.
void check_plot_path(const std::string& path) {
  const std::string ext = std::filesystem::path(path).extension().string();
  if (ext != ".png" && ext != ".svg" && ext != ".pdf") {
    throw UsageError("--plot " + path + " has extension " + quote(ext) +
                     "; expected .png, .svg or .pdf (the format follows the extension)");
  }
}

// [lo, hi] widened by `margin` of its width on each side (by 0.5 when it is a
// point), so no dot sits on the frame.
std::array<double, 2> padded(double lo, double hi, double margin) {
  const double pad = hi > lo ? margin * (hi - lo) : 0.5;
  return {lo - pad, hi + pad};
}

// The fit's figure as bytes: qkv::plot_kernel_regression (gnuplot) draws it
// into a private temporary directory, and the bytes go out with the other
// outputs through write_outputs, so all are written or none. The curve joins
// the defined predictions in order of x (a CSV --query may list them in any
// order); undefined ones (nan: no key in reach) are left out.
std::string fit_figure(const Training& data, const Tensor<double>& queries,
                       const Tensor<double>& predictions, Kernel kernel, double h,
                       const std::string& path) {
  std::vector<std::pair<double, double>> curve;
  for (int64_t i = 0; i < queries.size(0); ++i) {
    if (std::isfinite(predictions(i))) curve.emplace_back(queries(i, 0), predictions(i));
  }
  if (curve.empty()) {
    throw UsageError("--plot " + path +
                     ": every prediction is undefined (nan: no training "
                     "point within reach of any query), so there is no fit to draw");
  }
  std::sort(curve.begin(), curve.end());
  const int64_t t = static_cast<int64_t>(curve.size()), n = data.x.size(0);
  Tensor<double> xs(Shape{t}), fs(Shape{t});
  double x_lo = curve.front().first, x_hi = curve.back().first;
  double y_lo = curve[0].second, y_hi = y_lo;
  for (int64_t i = 0; i < t; ++i) {
    xs(i) = curve[i].first;
    fs(i) = curve[i].second;
    y_lo = std::min(y_lo, fs(i));
    y_hi = std::max(y_hi, fs(i));
  }
  for (int64_t i = 0; i < n; ++i) {
    x_lo = std::min(x_lo, data.x(i, 0));
    x_hi = std::max(x_hi, data.x(i, 0));
    y_lo = std::min(y_lo, data.y(i));
    y_hi = std::max(y_hi, data.y(i));
  }
  RegressionPlotOptions options;
  options.xlim = padded(x_lo, x_hi, 0.02);
  options.ylim = padded(y_lo, y_hi, 0.05);
  options.xlabel = data.x_names[0];
  options.ylabel = data.y_name;
  options.labels = {"", "Nadaraya-Watson, " + std::string(kernel_name(kernel)) +
                            ", h = " + format_number(h, "%.4g")};
  options.figsize = {6.0, 4.0};  // inches: 600 x 400 pixels in PNG

  std::string dir = (std::filesystem::temp_directory_path() / "qkv-plot-XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) {
    throw std::runtime_error("--plot: cannot make a temporary directory " + dir + ": " +
                             std::strerror(errno));
  }
  struct Remove {
    std::string dir;
    ~Remove() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } remove{dir};
  const std::string staged = dir + "/fit" + std::filesystem::path(path).extension().string();
  plot_kernel_regression(xs.view(), ConstView<double>(nullptr, Shape{0}), fs.view(),
                         ConstView<double>(data.x.data(), Shape{n}), data.y.view(), staged,
                         options);
  std::ifstream in(staged, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw std::runtime_error("--plot: cannot read back " + staged);
  return bytes;
}

// ---- the cost of --bandwidth cv -------------------------------------------------------

// One evaluation of the Gaussian leave-one-out error (and its gradient, which
// costs about the same per point) takes this many CPU seconds per pair of
// points: 3.25 s of user time for the 64 evaluations of cv at n = 3000 on one
// thread, 5.6 ns a pair (2026-11-30, AVX2 EPYC; the machine was busy, so the
// wall time was 17 s). cv makes about kCvEvaluations of them for 1-D data:
// 49 for its scan, 14 for BFGS there (6 iterations), and the error at the
// result; the estimate counts twice as many for compact kernels and several
// x columns, whose searches are longer.
constexpr double kCvSecondsPerPair = 5.6e-9;
constexpr double kCvEvaluations = 65;
// Above this estimate, --bandwidth cv warns before it starts: a minute is
// where a run stops feeling like a command and starts needing a plan.
constexpr double kCvWarnSeconds = 60;

// The warning, on stderr before the work, when cv will take long.
void warn_if_cv_is_long(int64_t n, int64_t p, Kernel kernel) {
  const double pairs = static_cast<double>(n) * static_cast<double>(n);
  const double evaluations = kCvEvaluations * (p == 1 && kernel == Kernel::kGaussian ? 1 : 2);
  const double seconds = evaluations * pairs * static_cast<double>(p) * kCvSecondsPerPair /
                         static_cast<double>(num_threads());
  if (seconds <= kCvWarnSeconds) return;
  std::cerr << "qkv regress: warning: --bandwidth cv on n = " << n
            << " points evaluates the leave-one-out error about "
            << format_number(evaluations, "%.0f")
            << " times, n^2 = " << format_number(pairs, "%.3g")
            << " kernel evaluations each: about " << seconds_text(seconds) << " on "
            << num_threads() << (num_threads() == 1 ? " thread" : " threads")
            << " (estimated). A rule of thumb takes milliseconds: --bandwidth scott or "
               "silverman"
            << (p == 1 && kernel == Kernel::kGaussian
                    ? "; --bandwidth cv-fast minimises the same error through the fast 1-D "
                      "path in seconds"
                    : "")
            << "\n";
}

// Wall-clock seconds since construction or the last lap.
class Stopwatch {
 public:
  double lap() {
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return s;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// The phases' lines on stderr: when stderr is a terminal, or with --verbose
// (none with --quiet).
class PhaseLog {
 public:
  PhaseLog(bool verbose, bool quiet) : on_(!quiet && (verbose || ::isatty(STDERR_FILENO))) {}
  void say(const std::string& line) const {
    if (on_) std::cerr << "qkv regress: " << line << std::endl;
  }

 private:
  bool on_;
};

void run_regress(const RegressArgs& args) {
  const Bandwidth bandwidth = parse_bandwidth(args.bandwidth);
  check_options(args, bandwidth);
  if (args.given("--grid")) parse_grid(args.grid);  // its errors before any file is read
  const Kernel kernel = kernel_from_name(args.kernel);
  std::vector<std::pair<std::string, std::string>> outputs{{"--out", args.out}};
  if (!args.weights.empty()) outputs.emplace_back("--weights", args.weights);
  if (!args.plot.empty()) {
    check_plot_path(args.plot);
    outputs.emplace_back("--plot", args.plot);
  }
  check_output_paths(outputs);
  if (!args.plot.empty()) gnuplot_path();  // missing: an Error naming the package, before the work
  apply_threads(args.threads);
  const PhaseLog progress(args.verbose, args.quiet);
  Stopwatch clock;

  // ---- load
  const Input train_input{"--train", args.train};
  OpenInput train_file(train_input);  // once, and told apart by its first bytes
  const std::string train_prefix = train_file.read_prefix(kNpyMagicLength);
  const Training data = is_npy_prefix(train_prefix)
                            ? load_npy_training(args, train_input, train_file, train_prefix)
                            : load_csv_training(args, train_file, train_prefix);
  const int64_t n = data.x.size(0), p = data.x.size(1);
  if (!bandwidth.values.empty() && bandwidth.values.size() != 1 &&
      static_cast<int64_t>(bandwidth.values.size()) != p) {
    throw UsageError("--bandwidth has " + std::to_string(bandwidth.values.size()) +
                     " values but there " +
                     (p == 1 ? "is 1 x column" : "are " + std::to_string(p) + " x columns") + " (" +
                     join(data.x_names) + "); give one value, or one per x column");
  }
  if (bandwidth.rule == "cv-fast" && p != 1) {
    throw UsageError("--bandwidth cv-fast is cv through the fast 1-D Gaussian path; there are " +
                     std::to_string(p) + " x columns (" + join(data.x_names) +
                     "): use --bandwidth cv");
  }
  if (!args.plot.empty() && p != 1) {
    throw UsageError("--plot draws y against one x column; there are " + std::to_string(p) +
                     " x columns (" + join(data.x_names) + "); choose one with --x-cols");
  }
  const Tensor<double> queries = load_queries(args, data);
  const int64_t t = queries.size(0);
  if (!args.weights.empty() && static_cast<double>(t) * static_cast<double>(n) > kMaxWeights) {
    throw UsageError(
        "--weights would be a (t, n) = (" + std::to_string(t) + ", " + std::to_string(n) +
        ") float64 matrix, " +
        format_number(8.0 * static_cast<double>(t) * static_cast<double>(n) / 1e9, "%.6g") +
        " GB; at most 5e8 weights can be written");
  }
  const double load_s = clock.lap();
  progress.say("read " + std::to_string(n) + " training points, " + std::to_string(p) +
               (p == 1 ? " x column" : " x columns") + ", and " + std::to_string(t) + " queries (" +
               format_number(load_s, "%.6g") + " s)");

  // ---- bandwidth
  KernelRegression model(features(data.x), data.y.view(), kernel);
  double loo = std::nan("");  // NaN: not computed
  std::optional<CvResult> cv;
  std::optional<ParametricResult> learned;
  if (bandwidth.rule == "fixed") {
    if (bandwidth.values.size() == 1) {
      model.set_bandwidth(bandwidth.values[0]);
    } else {
      model.set_bandwidth(bandwidth.values);
    }
  } else if (bandwidth.rule == "silverman") {
    model.set_bandwidth(silverman_bandwidth(features(data.x)));
  } else if (bandwidth.rule == "scott") {
    model.set_bandwidth(scott_bandwidth(features(data.x)));
  } else if (bandwidth.rule == "cv" || bandwidth.rule == "cv-fast") {
    const bool fast = bandwidth.rule == "cv-fast";
    progress.say(bandwidth.rule + ": minimising the leave-one-out error over the bandwidth");
    if (!fast) warn_if_cv_is_long(n, p, kernel);
    Progress bar("qkv regress: " + bandwidth.rule, args.quiet, "points");
    const CvProgress report = [&](int64_t done, int64_t total) { bar.update(done, total); };
    cv = fast ? cv_bandwidth_fast_1d(model, report) : cv_bandwidth(model, report);
    bar.finish();
    model.set_bandwidth(cv->bandwidth);
  } else {
    ParametricOptions options;
    options.epochs = args.epochs.value_or(options.epochs);
    options.lr = args.lr.value_or(options.lr);
    options.seed = args.seed;
    progress.say("learn: " + std::to_string(options.epochs) + " epochs of SGD, lr " +
                 format_number(options.lr, "%.6g"));
    learned = train_parametric(features(data.x), data.y.view(), options);
    for (size_t e = 0; e < learned->losses.size(); ++e) {
      progress.say("learn: epoch " + std::to_string(e + 1) + ", loss " +
                   format_number(learned->losses[e], "%.6g") + ", w " +
                   format_number(learned->ws[e], "%.6g"));
    }
    const double h = 1.0 / std::abs(learned->w);
    if (!std::isfinite(h) || h < std::numeric_limits<double>::min()) {
      throw std::runtime_error(
          "learn: the learned w is " + exact_number(learned->w) +
          ", so the bandwidth 1/|w| = " + exact_number(h) +
          (std::isfinite(h) ? " is below the smallest normal double" : " is not finite") +
          "; try another --lr or --seed");
    }
    model.set_bandwidth(h);
  }
  if (cv) {
    loo = cv->loo_error;
  } else if (n <= kMaxAutoLooPoints || args.loo) {
    progress.say("computing the leave-one-out error");
    loo = model.loo_error();
  }
  std::string loo_text;
  if (std::isnan(loo)) {
    loo_text = "not computed (n > " + std::to_string(kMaxAutoLooPoints) + "; see --loo)";
  } else if (std::isinf(loo)) {
    loo_text = overflowed_loo_text(data, kernel, model.bandwidth());
    if (loo_text.empty()) loo_text = "undefined (no training point has a leave-one-out estimate)";
  } else {
    loo_text = format_number(loo, "%.6g");
  }
  const double bandwidth_s = clock.lap();
  std::vector<std::string> shown;
  for (const double h : model.bandwidth()) shown.push_back(format_number(h, "%.6g"));
  progress.say("bandwidth (" + bandwidth.rule + ") " + join(shown) + ", LOO error " + loo_text +
               " (" + format_number(bandwidth_s, "%.6g") + " s)");

  // ---- predict
  Tensor<double> predictions;
  int64_t num_undefined = 0;
  bool fast_path = false;
  const ConstView<double> q = features(queries);
  if (learned) {
    predictions = parametric_predict(features(data.x), data.y.view(), learned->w, q);
    for (const double f : predictions.values()) num_undefined += std::isnan(f);
  } else {
    KernelPrediction prediction = model.predict(q, args.exact);
    predictions = std::move(prediction.values);
    num_undefined = prediction.num_undefined;
    fast_path = prediction.used_fast_path;
  }
  Tensor<double> weights;
  if (!args.weights.empty()) weights = model.weights(q);
  const double predict_s = clock.lap();
  progress.say("predicted " + std::to_string(t) + " queries (" + format_number(predict_s, "%.6g") +
               " s)");

  // ---- write
  std::vector<OutputFile> files{{"--out", args.out, predictions_csv(data, queries, predictions)}};
  if (!args.weights.empty())
    files.push_back({"--weights", args.weights, npy_bytes(weights.view())});
  if (!args.plot.empty()) {
    files.push_back(
        {"--plot", args.plot,
         fit_figure(data, queries, predictions, kernel, model.bandwidth()[0], args.plot)});
  }
  write_outputs(files);
  const double write_s = clock.lap();

  if (args.json) {
    std::vector<std::string> hs, x_cols;
    for (const double h : model.bandwidth()) hs.push_back(json_number(h));
    for (const std::string& name : data.x_names) x_cols.push_back(json_string(name));
    std::string json =
        "{\"kernel\": " + json_string(std::string(kernel_name(kernel))) + ", \"bandwidth\": [" +
        join(hs) + "], \"bandwidth_rule\": " + json_string(bandwidth.rule) +
        ", \"loo_error\": " + json_number(loo) + ", \"num_train\": " + std::to_string(n) +
        ", \"num_queries\": " + std::to_string(t) +
        ", \"num_undefined\": " + std::to_string(num_undefined) +
        ", \"fast_path\": " + (fast_path ? "true" : "false") + ", \"x_cols\": [" + join(x_cols) +
        "], \"y_col\": " + json_string(data.y_name);
    if (cv) json += ", \"cv_iterations\": " + std::to_string(cv->iterations);
    if (learned) {
      json += ", \"w\": " + json_number(learned->w) + ", \"epochs\": [";
      for (size_t e = 0; e < learned->losses.size(); ++e) {
        json += std::string(e == 0 ? "" : ", ") + "{\"epoch\": " + std::to_string(e + 1) +
                ", \"loss\": " + json_number(learned->losses[e]) +
                ", \"w\": " + json_number(learned->ws[e]) + "}";
      }
      json += "]";
    }
    json += ", \"timings_s\": {\"load\": " + json_number(load_s) +
            ", \"bandwidth\": " + json_number(bandwidth_s) +
            ", \"predict\": " + json_number(predict_s) + ", \"write\": " + json_number(write_s) +
            "}}";
    std::cout << json << std::endl;
  } else {
    std::cerr << "qkv regress: " << n << " training points, " << t << " queries, "
              << kernel_name(kernel) << " kernel\n"
              << "  bandwidth (" << bandwidth.rule << "): " << join(shown) << "\n";
    if (learned) {
      std::cerr << "  learned w: " << format_number(learned->w, "%.6g") << " after "
                << learned->losses.size() << " epochs (loss "
                << format_number(learned->losses.front(), "%.6g") << " at the start of epoch 1, "
                << format_number(learned->losses.back(), "%.6g") << " at the start of the last)\n";
    }
    std::cerr << "  LOO error: " << loo_text << "\n"
              << "  undefined predictions: " << num_undefined << "\n";
  }
}

}  // namespace

Command add_regress_command(CLI::App& parent) {
  auto args = std::make_shared<RegressArgs>();
  CLI::App* app = parent.add_subcommand(
      "regress",
      "Nadaraya-Watson kernel regression (attention pooling by similarity) on a CSV or .npy "
      "table");
  args->app = app;
  require_path(
      app->add_option("--train", args->train,
                      "Training data: a CSV file with a header row, or a 2-D .npy table (n, k)"))
      ->type_name("DATA")
      ->required();
  app->add_option("--x-cols", args->x_cols,
                  "The x columns, comma-separated: names (CSV) or indices (.npy); default: "
                  "every column but the y column")
      ->type_name("a,b");
  app->add_option("--y-col", args->y_col,
                  "The y column: a name (CSV) or an index (.npy); default: the last column")
      ->type_name("y");
  require_path(app->add_option("--query", args->query,
                               "Where to predict: a CSV file holding the x columns (by name), or "
                               ".npy (t) or (t, p)"))
      ->type_name("FILE");
  app->add_option("--grid", args->grid,
                  "Where to predict, one x column only: numpy.arange(start, stop, step)")
      ->type_name("start:stop:step");
  app->add_option("--kernel", args->kernel,
                  "gaussian exp(-u^2/2); boxcar (or uniform) 1{|u|<=1}; epanechnikov "
                  "(1-u^2) 1{|u|<=1}; triangular (1-|u|) 1{|u|<=1}")
      ->type_name("KERNEL")
      ->required()
      ->check(CLI::IsMember({"gaussian", "boxcar", "uniform", "epanechnikov", "triangular"}));
  app->add_option("--bandwidth", args->bandwidth,
                  std::string("h: ") + kBandwidthHelp +
                      " (learn: the chapter's parametric model, h = 1/|w|, Gaussian only)")
      ->type_name("H|silverman|scott|cv|cv-fast|learn")
      ->required();
  require_integer(
      app->add_option("--epochs", args->epochs, "learn only: SGD epochs, >= 1 (default 5)"))
      ->type_name("N");
  require_number(
      app->add_option("--lr", args->lr, "learn only: SGD learning rate, > 0 (default 0.5)"))
      ->type_name("LR");
  add_seed_option(*app, args->seed, "learn only: draws the initial w ~ U(0, 1)");
  app->add_flag("--exact", args->exact,
                "Evaluate every kernel exactly (no fast 1-D Gaussian approximation)");
  require_path(
      app->add_option("--out", args->out, "Output PRED.csv: the query columns, then <y-col>_pred"))
      ->type_name("PRED.csv")
      ->required();
  require_path(app->add_option("--weights", args->weights,
                               "Also write the attention weights (t, n), float64, rows summing "
                               "to 1"))
      ->type_name("W.npy");
  require_path(app->add_option("--plot", args->plot,
                               "Also draw the fit with gnuplot: the training points and the "
                               "predictions as a curve over x (one x column); the format "
                               "follows the extension"))
      ->type_name("FIG.png|svg|pdf");
  app->add_flag("--loo", args->loo,
                "Compute the leave-one-out error also for more than 50000 training points "
                "(n^2 kernel evaluations)");
  app->add_flag("--json", args->json,
                "Print a JSON summary on stdout (bandwidth, LOO error, epochs, timings)");
  app->add_flag("--verbose", args->verbose, "Each phase on stderr even when it is not a terminal");
  app->add_flag("--quiet", args->quiet, "No progress on stderr (warnings stay)");
  add_threads_option(*app, args->threads);
  set_help_footer(*app,
                  {"qkv regress --train data.csv --grid 0:5:0.1 --kernel gaussian --bandwidth cv "
                   "--out pred.csv --plot fit.png",
                   "qkv regress --train data.csv --query data.csv --kernel epanechnikov "
                   "--bandwidth silverman --out pred.csv --json"},
                  "docs/cli.md#qkv-regress");
  return {app, [args] { run_regress(*args); }};
}

}  // namespace qkv::cli
