// Helpers shared by qkv's GoogleTest suites: per-test seeds, random tensors and
// valid lengths, strided (non-contiguous) copies, element-wise comparison that
// names the coordinates of a failure, a file-size limit that fails writes like
// a full disk, error checks and finite differences.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <source_location>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/qkv.h"
#include "tolerances.h"

namespace qkv {
// Lets gtest print shapes in assertion messages ("[2, 4, 5]").
inline void PrintTo(const Shape& shape, std::ostream* os) { *os << shape.str(); }
}  // namespace qkv

namespace qkv::test {

// ---- seeds ---------------------------------------------------------------------

// splitmix64's finaliser: a bijection that spreads every input bit.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The current test's full name, "Suite.Name" (with any parameter suffix).
inline std::string current_test_name() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return "(no test)";
  return std::string(info->test_suite_name()) + "." + info->name();
}

// The seed of the current test: gtest's random seed (fresh each run unless
// --gtest_random_seed=N is given, which replays a run) mixed with the test's
// full name, so tests of one run draw different inputs.
inline uint64_t test_seed() {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a over the name
  for (char c : current_test_name()) {
    h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
  }
  const int run_seed = ::testing::UnitTest::GetInstance()->random_seed();
  return mix64(h ^ mix64(static_cast<uint64_t>(run_seed)));
}

// What to put in SCOPED_TRACE so a failure can be replayed:
//   const uint64_t seed = test_seed();
//   SCOPED_TRACE(seed_note(seed));
inline std::string seed_note(uint64_t seed) {
  return "seed " + std::to_string(seed) + " (replay: --gtest_filter=" + current_test_name() +
         " --gtest_random_seed=" +
         std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + ")";
}

// Whether this build runs under AddressSanitizer (QKV_SANITIZE): sweeps that
// take seconds in Release take minutes there, and take a sample instead.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

// ---- random numbers ------------------------------------------------------------

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  // Uniform in [lo, hi).
  double uniform(double lo = 0.0, double hi = 1.0) {
    return std::uniform_real_distribution<double>(lo, hi)(engine_);
  }
  // Uniform integer in [lo, hi] (both ends included).
  int64_t uniform_int(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(engine_);
  }
  // True with probability p.
  bool bernoulli(double p) { return uniform() < p; }
  // A fresh 64-bit value, e.g. a seed for a library call.
  uint64_t next() { return engine_(); }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

// A tensor of `shape` with elements uniform in [lo, hi), drawn in double and
// rounded to T.
template <class T>
Tensor<T> random_tensor(Rng& rng, const Shape& shape, double lo = -1.0, double hi = 1.0) {
  Tensor<T> out(shape);
  for (T& x : out.values()) x = static_cast<T>(rng.uniform(lo, hi));
  return out;
}
template <class T>
Tensor<T> random_tensor(uint64_t seed, const Shape& shape, double lo = -1.0, double hi = 1.0) {
  Rng rng(seed);
  return random_tensor<T>(rng, shape, lo, hi);
}

// ---- valid lengths -------------------------------------------------------------

enum class LensForm { kNone, kPerBatch, kPerQuery };

inline const char* to_string(LensForm form) {
  switch (form) {
    case LensForm::kNone:
      return "no valid_lens";
    case LensForm::kPerBatch:
      return "valid_lens (B)";
    case LensForm::kPerQuery:
      return "valid_lens (B, Nq)";
  }
  return "?";
}
inline std::ostream& operator<<(std::ostream& os, LensForm form) { return os << to_string(form); }

inline constexpr LensForm kAllLensForms[] = {LensForm::kNone, LensForm::kPerBatch,
                                             LensForm::kPerQuery};

// Random valid lengths in [0, num_keys] of the given form: (B) or (B, Nq), an
// empty Tensor for kNone. About `zero_fraction` of them are 0 and a fifth are
// num_keys; with two or more lengths, one (at a random place) is always 0.
template <class I = int64_t>
Tensor<I> random_lens(Rng& rng, LensForm form, int64_t batch, int64_t num_queries, int64_t num_keys,
                      double zero_fraction = 0.2) {
  static_assert(std::is_same_v<I, int32_t> || std::is_same_v<I, int64_t>);
  if (form == LensForm::kNone) return {};
  Tensor<I> lens(form == LensForm::kPerBatch ? Shape{batch} : Shape{batch, num_queries});
  for (I& len : lens.values()) {
    const double u = rng.uniform();
    if (u < zero_fraction) {
      len = 0;
    } else if (u < zero_fraction + 0.2) {
      len = static_cast<I>(num_keys);
    } else {
      len = static_cast<I>(rng.uniform_int(0, num_keys));
    }
  }
  if (lens.numel() >= 2 && zero_fraction > 0.0) {
    lens.values()[static_cast<size_t>(rng.uniform_int(0, lens.numel() - 1))] = 0;
  }
  return lens;
}

// The ValidLens for an owning tensor of lengths; absent for an empty tensor.
// The tensor must outlive the returned ValidLens (it borrows the memory).
template <class I>
ValidLens as_valid_lens(const Tensor<I>& lens) {
  if (lens.empty()) return ValidLens{};
  return ValidLens(lens);
}

// ---- views and conversions -----------------------------------------------------

template <class T>
ConstView<T> as_const_view(const Tensor<T>& t) {
  return t.view();
}
template <class T>
ConstView<std::remove_const_t<T>> as_const_view(const TensorView<T>& v) {
  return ConstView<std::remove_const_t<T>>(v.data(), v.shape(), v.strides());
}

// An owning contiguous copy with elements converted to To (e.g. float -> double).
template <class To, class X>
Tensor<To> cast(const X& x) {
  const auto src = as_const_view(x);
  using From = typename decltype(src)::value_type;
  const Tensor<From> contiguous = Tensor<From>::copy_of(src);
  Tensor<To> out(contiguous.shape());
  std::transform(contiguous.values().begin(), contiguous.values().end(), out.values().begin(),
                 [](From v) { return static_cast<To>(v); });
  return out;
}

// Calls f(index) for every index of `shape` in row-major order; index is a
// std::array<int64_t, kMaxRank> whose first shape.rank() entries are used.
template <class F>
void for_each_index(const Shape& shape, F&& f) {
  const int64_t n = shape.numel();
  std::array<int64_t, kMaxRank> index{};
  for (int64_t count = 0; count < n; ++count) {
    f(index);
    for (int a = shape.rank() - 1; a >= 0; --a) {
      if (++index[a] < shape[a]) break;
      index[a] = 0;
    }
  }
}

// Offset of an element of a strided view from its data pointer.
inline int64_t offset_of(const Shape& strides, const std::array<int64_t, kMaxRank>& index,
                         int rank) {
  int64_t offset = 0;
  for (int a = 0; a < rank; ++a) offset += index[a] * strides[a];
  return offset;
}

// The values of a view, laid out in memory that is NOT contiguous: the last
// axis has stride `step`, every outer axis has `pad` unused elements after
// each of its sub-blocks, and the first element sits `offset` elements into
// the buffer (a misaligned pointer). With `reversed`, the axes are stored in
// reverse order (column-major), so the first axis has the smallest stride.
// Unused elements hold `filler` (NaN for floating types), so a kernel that
// reads outside the view is likely to be caught.
template <class T>
class Strided {
 public:
  struct Layout {
    int64_t step = 2;
    int64_t pad = 3;
    int64_t offset = 1;
    bool reversed = false;
  };

  explicit Strided(ConstView<T> src) : Strided(src, Layout{}) {}
  Strided(ConstView<T> src, Layout layout) {
    const Shape& shape = src.shape();
    const int rank = shape.rank();
    Shape strides = shape;
    int64_t extent = 1;  // elements spanned by the axes laid out so far
    for (int k = 0; k < rank; ++k) {
      const int a = layout.reversed ? k : rank - 1 - k;
      if (k == 0) {
        strides[a] = layout.step;
        extent = std::max<int64_t>(1, (shape[a] - 1) * layout.step + 1);
      } else {
        strides[a] = extent + layout.pad;
        extent = std::max<int64_t>(1, (shape[a] - 1) * strides[a] + extent);
      }
    }
    storage_.assign(static_cast<size_t>(layout.offset + extent + 1), filler());
    view_ = TensorView<T>(storage_.data() + layout.offset, shape, strides);
    for_each_index(shape, [&](const std::array<int64_t, kMaxRank>& index) {
      view_.data()[offset_of(strides, index, rank)] =
          src.data()[offset_of(src.strides(), index, rank)];
    });
  }
  Strided(const Strided&) = delete;
  Strided& operator=(const Strided&) = delete;

  TensorView<T> view() const { return view_; }
  ConstView<T> const_view() const { return as_const_view(view_); }
  // The buffer, including the unused elements (to check they were not written).
  const std::vector<T>& storage() const { return storage_; }

  static T filler() {
    if constexpr (std::is_floating_point_v<T>) {
      return std::numeric_limits<T>::quiet_NaN();
    } else {
      return static_cast<T>(-7777);
    }
  }

 private:
  std::vector<T> storage_;
  TensorView<T> view_;
};

// sum over all elements of a * b, accumulated in long double (a linear loss).
template <class A, class B>
double sum_product(const A& a_in, const B& b_in) {
  const auto a = as_const_view(a_in);
  const auto b = as_const_view(b_in);
  EXPECT_EQ(a.shape(), b.shape()) << "sum_product of different shapes";
  if (!(a.shape() == b.shape())) return std::numeric_limits<double>::quiet_NaN();
  long double sum = 0;
  for_each_index(a.shape(), [&](const std::array<int64_t, kMaxRank>& index) {
    sum += static_cast<long double>(a.data()[offset_of(a.strides(), index, a.rank())]) *
           static_cast<long double>(b.data()[offset_of(b.strides(), index, b.rank())]);
  });
  return static_cast<double>(sum);
}

// ---- comparison ----------------------------------------------------------------

// "b=1 q=3 d=7" for index (1, 3, 7) and axes "b q d". Without axes names (or
// with too few), the defaults for the rank: "i"; "b q"; "b q k"; "a b q k".
inline std::string coordinates(const std::array<int64_t, kMaxRank>& index, int rank,
                               std::string_view axes = {}) {
  std::vector<std::string> names;
  std::istringstream words{std::string(axes)};
  for (std::string w; words >> w;) names.push_back(w);
  if (static_cast<int>(names.size()) != rank) {
    static const std::vector<std::string> kDefaults[kMaxRank + 1] = {
        {}, {"i"}, {"b", "q"}, {"b", "q", "k"}, {"a", "b", "q", "k"}};
    names = kDefaults[rank];
  }
  std::string s;
  for (int a = 0; a < rank; ++a) {
    if (a) s += ' ';
    s += names[static_cast<size_t>(a)] + "=" + std::to_string(index[a]);
  }
  return rank == 0 ? std::string("(scalar)") : s;
}

// An element with enough digits to tell neighbouring values of its type apart.
template <class T>
std::string format_value(T v) {
  std::ostringstream os;
  os.precision(std::numeric_limits<T>::max_digits10);
  os << v;
  return os.str();
}

// An error or a tolerance, to three significant digits.
inline std::string format_short(double v) {
  std::ostringstream os;
  os.precision(3);
  os << v;
  return os.str();
}

// The worst error seen per comparison name, printed at exit when the
// environment variable QKV_TEST_REPORT_ERRORS is set (for tolerance reviews).
class ErrorLog {
 public:
  static ErrorLog& instance() {
    static ErrorLog log;
    return log;
  }
  void record(const std::string& name, double abs_err, double ratio) {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[name];
    e.abs_err = std::max(e.abs_err, abs_err);
    e.ratio = std::max(e.ratio, ratio);
  }
  ~ErrorLog() {
    if (std::getenv("QKV_TEST_REPORT_ERRORS") == nullptr) return;
    for (const auto& [name, e] : entries_) {
      std::fprintf(stderr, "qkv-test worst error %-40s |err| %.3g  (%.3g of tolerance)\n",
                   name.c_str(), e.abs_err, e.ratio);
    }
  }

 private:
  struct Entry {
    double abs_err = 0.0;
    double ratio = 0.0;
  };
  std::mutex mutex_;
  std::map<std::string, Entry> entries_;
};

// Element-wise |got - ref| <= tol.atol + tol.rtol * |ref|. A NaN ref requires
// a NaN; an infinite ref requires the same infinity; a non-finite got with a
// finite ref fails. The message gives the number of mismatches, the first ten
// with coordinates ("b=1 q=3 d=7: got 0.4121, ref 0.4125") and the worst error.
template <class G, class R>
::testing::AssertionResult all_close(const G& got_in, const R& ref_in, Tol tol,
                                     std::string_view name, std::string_view axes = {}) {
  const auto got = as_const_view(got_in);
  const auto ref = as_const_view(ref_in);
  if (!(got.shape() == ref.shape())) {
    return ::testing::AssertionFailure()
           << name << ": got shape " << got.shape().str() << ", ref shape " << ref.shape().str();
  }
  const int rank = got.rank();
  int64_t mismatches = 0;
  double worst_err = 0.0, worst_ratio = 0.0;
  std::array<int64_t, kMaxRank> worst_index{};
  std::string worst_got, worst_ref;
  std::ostringstream first;
  for_each_index(got.shape(), [&](const std::array<int64_t, kMaxRank>& index) {
    const auto got_value = got.data()[offset_of(got.strides(), index, rank)];
    const auto ref_value = ref.data()[offset_of(ref.strides(), index, rank)];
    const double g = static_cast<double>(got_value);
    const double r = static_cast<double>(ref_value);
    const double allowed = tol.atol + tol.rtol * std::abs(r);
    double err;
    bool ok;
    if (std::isnan(r)) {
      ok = std::isnan(g);
      err = ok ? 0.0 : std::numeric_limits<double>::infinity();
    } else if (std::isinf(r)) {
      ok = g == r;
      err = ok ? 0.0 : std::numeric_limits<double>::infinity();
    } else if (!std::isfinite(g)) {
      ok = false;
      err = std::numeric_limits<double>::infinity();
    } else {
      err = std::abs(g - r);
      ok = err <= allowed;
    }
    const double ratio = allowed > 0 ? err / allowed : (err > 0 ? err / 0.0 : 0.0);
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst_err = err;
      worst_index = index;
      worst_got = format_value(got_value);
      worst_ref = format_value(ref_value);
    }
    if (!ok) {
      if (mismatches < 10) {
        first << "\n  " << coordinates(index, rank, axes) << ": got " << format_value(got_value)
              << ", ref " << format_value(ref_value) << " (|err| " << format_short(err) << " > "
              << format_short(allowed) << ")";
      }
      ++mismatches;
    }
  });
  ErrorLog::instance().record(std::string(name), worst_err, worst_ratio);
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << name << ": " << mismatches << " of " << got.numel() << " elements of shape "
         << got.shape().str() << " differ (atol " << format_short(tol.atol) << ", rtol "
         << format_short(tol.rtol) << "); worst at " << coordinates(worst_index, rank, axes)
         << ": got " << worst_got << ", ref " << worst_ref << ", |err| " << format_short(worst_err)
         << first.str() << (mismatches > 10 ? "\n  ..." : "");
}

// EXPECT-style all_close that reports the caller's file and line. Returns
// whether it passed, so a loop over many cases can stop at the first failure.
template <class G, class R>
bool expect_close(const G& got, const R& ref, Tol tol, std::string_view name,
                  std::string_view axes = {},
                  std::source_location loc = std::source_location::current()) {
  const ::testing::AssertionResult result = all_close(got, ref, tol, name, axes);
  if (!result) ADD_FAILURE_AT(loc.file_name(), static_cast<int>(loc.line())) << result.message();
  return static_cast<bool>(result);
}

// Bitwise equality of two views of the same element type (memcmp of each
// element, so it tells -0 from 0 and compares NaN payloads). Reports the first
// differing coordinates.
template <class A, class B>
::testing::AssertionResult bitwise_equal(const A& a_in, const B& b_in, std::string_view name,
                                         std::string_view axes = {}) {
  const auto a = as_const_view(a_in);
  const auto b = as_const_view(b_in);
  static_assert(std::is_same_v<decltype(a), decltype(b)>, "compare views of one element type");
  if (!(a.shape() == b.shape())) {
    return ::testing::AssertionFailure()
           << name << ": shapes " << a.shape().str() << " and " << b.shape().str() << " differ";
  }
  const int rank = a.rank();
  int64_t differ = 0;
  std::ostringstream first;
  for_each_index(a.shape(), [&](const std::array<int64_t, kMaxRank>& index) {
    const auto& x = a.data()[offset_of(a.strides(), index, rank)];
    const auto& y = b.data()[offset_of(b.strides(), index, rank)];
    if (std::memcmp(&x, &y, sizeof x) != 0) {
      if (differ < 5) {
        first << "\n  " << coordinates(index, rank, axes) << ": " << format_value(x) << " vs "
              << format_value(y);
      }
      ++differ;
    }
  });
  if (differ == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": " << differ << " of " << a.numel()
                                       << " elements are not bitwise equal" << first.str();
}

template <class A, class B>
bool expect_bitwise_equal(const A& a, const B& b, std::string_view name, std::string_view axes = {},
                          std::source_location loc = std::source_location::current()) {
  const ::testing::AssertionResult result = bitwise_equal(a, b, name, axes);
  if (!result) ADD_FAILURE_AT(loc.file_name(), static_cast<int>(loc.line())) << result.message();
  return static_cast<bool>(result);
}

// ---- files -------------------------------------------------------------------

// Caps the size of files this process may write, so writes fail with EFBIG
// partway through (works as root, unlike read-only directories).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of death
    ::getrlimit(RLIMIT_FSIZE, &old_);
    struct rlimit lower = old_;
    lower.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &lower), 0) << std::strerror(errno);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  struct rlimit old_ = {};
  sighandler_t old_handler_ = SIG_DFL;
};

// ---- errors --------------------------------------------------------------------

static_assert(std::is_base_of_v<std::invalid_argument, Error>,
              "qkv::Error must be a std::invalid_argument");

// Expects f() to throw qkv::Error (checked by catching std::invalid_argument
// and then the exact type) whose message contains every fragment, e.g.
//   expect_error([&] { masked_softmax(x); }, {"masked_softmax", "[2, 4]"});
// Returns the message ("" if nothing or something else was thrown).
template <class F>
std::string expect_error(F&& f, std::initializer_list<std::string_view> fragments,
                         std::source_location loc = std::source_location::current()) {
  const char* file = loc.file_name();
  const int line = static_cast<int>(loc.line());
  try {
    f();
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    if (dynamic_cast<const Error*>(&e) == nullptr) {
      ADD_FAILURE_AT(file, line) << "threw std::invalid_argument but not qkv::Error: " << message;
    }
    for (std::string_view fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        ADD_FAILURE_AT(file, line) << "error message lacks \"" << fragment << "\":\n  " << message;
      }
    }
    return message;
  } catch (const std::exception& e) {
    ADD_FAILURE_AT(file, line) << "threw an exception that is not qkv::Error: " << e.what();
    return "";
  } catch (...) {
    ADD_FAILURE_AT(file, line) << "threw something that is not an exception";
    return "";
  }
  ADD_FAILURE_AT(file, line) << "expected qkv::Error, nothing was thrown";
  return "";
}

// Expects f() to throw qkv::IoError (a failure of the system, not of the
// arguments) whose message contains every fragment; returns the message.
template <class F>
std::string expect_io_error(F&& f, std::initializer_list<std::string_view> fragments,
                            std::source_location loc = std::source_location::current()) {
  const char* file = loc.file_name();
  const int line = static_cast<int>(loc.line());
  try {
    f();
  } catch (const IoError& e) {
    const std::string message = e.what();
    for (std::string_view fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        ADD_FAILURE_AT(file, line) << "error message lacks \"" << fragment << "\":\n  " << message;
      }
    }
    return message;
  } catch (const std::exception& e) {
    ADD_FAILURE_AT(file, line) << "threw an exception that is not qkv::IoError: " << e.what();
    return "";
  } catch (...) {
    ADD_FAILURE_AT(file, line) << "threw something that is not an exception";
    return "";
  }
  ADD_FAILURE_AT(file, line) << "expected qkv::IoError, nothing was thrown";
  return "";
}

// ---- gradients -----------------------------------------------------------------

// Central differences of a scalar function of a double tensor:
//   grad[n] = (f(x + h e_n) - f(x - h e_n)) / (2h).
// f takes const Tensor<double>& and returns double; it is called 2 * numel times.
template <class F>
Tensor<double> numerical_gradient(F&& f, const Tensor<double>& x, double h = 1e-5) {
  Tensor<double> work = x;
  Tensor<double> grad(x.shape());
  for (size_t n = 0; n < work.values().size(); ++n) {
    const double saved = work.values()[n];
    work.values()[n] = saved + h;
    const double up = f(static_cast<const Tensor<double>&>(work));
    work.values()[n] = saved - h;
    const double down = f(static_cast<const Tensor<double>&>(work));
    work.values()[n] = saved;
    grad.values()[n] = (up - down) / (2 * h);
  }
  return grad;
}

// ---- threads -------------------------------------------------------------------

// Sets qkv's thread count for a scope and restores the default
// (set_num_threads(0)) when it ends.
class ThreadCount {
 public:
  explicit ThreadCount(int n) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(0); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;
};

}  // namespace qkv::test
