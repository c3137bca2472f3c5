// Tests for the fast 1-D Gaussian Nadaraya–Watson kernel (src/kernels/regression/gauss1d_fast.h):
// every method ("exact", "window", "taylor") against a float64 softmax-form
// reference written here, on uniform, duplicate, clustered and constant keys,
// with queries inside and far outside the data, at rel_tol 1e-6 and 1e-9.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "kernels/regression/gauss1d_fast.h"
#include "test_util.h"

namespace qkv::test {
namespace {

// gauss1d as the front end calls it: a workspace of the queried size for
// the threads qkv runs.
const char* gauss1d(const double* keys, const double* values, int64_t n, int64_t m,
                    const double* queries, int64_t t, double h, double rel_tol, double* out) {
  const int threads = num_threads();
  std::vector<double> workspace(
      kernels::fast::gauss1d_workspace_size(keys, n, m, queries, t, h, rel_tol, threads));
  return kernels::fast::gauss1d(keys, values, n, m, queries, t, h, rel_tol, out,
                                {.data = workspace.data(), .num_threads = threads});
}

struct Data {
  std::vector<double> keys;    // sorted
  std::vector<double> values;  // (n, m)
  int64_t m = 1;
  int64_t n() const { return static_cast<int64_t>(keys.size()); }
};

// The float64 evaluation in softmax form: weights relative to the nearest
// key, exp(-((q - x)^2 - (q - xa)^2) / 2h^2) with the exponent formed as
// (xa - x)(2q - x - xa) / 2h^2 in long double (no cancellation of squares),
// each weight rounded to double (so a weight below 2^-1074 is 0, as in any
// float64 evaluation), sums in long double. Also returns the scale of the
// error bound, sum w|v| / sum w, per output.
void reference(const Data& d, const std::vector<double>& queries, double h,
               std::vector<double>& out, std::vector<double>& scale) {
  const int64_t n = d.n(), m = d.m, t = static_cast<int64_t>(queries.size());
  out.assign(static_cast<size_t>(t * m), 0.0);
  scale.assign(out.size(), 0.0);
  std::vector<long double> num(static_cast<size_t>(m)), mag(static_cast<size_t>(m));
  for (int64_t i = 0; i < t; ++i) {
    const long double q = queries[i];
    // The nearest key by the sign of (xa - x)(2q - x - xa) = (q - x)^2 -
    // (q - xa)^2: |q - x| itself can round alike for keys 1e-133 and
    // -1e229 seen from 6e260, even in long double.
    int64_t a = 0;
    for (int64_t j = 1; j < n; ++j) {
      const long double x = d.keys[j], xa = d.keys[a];
      if ((xa - x) * ((q - x) + (q - xa)) < 0) a = j;
    }
    const long double xa = d.keys[a];
    const long double inv = 1.0L / (2.0L * static_cast<long double>(h) * h);
    long double den = 0;
    std::fill(num.begin(), num.end(), 0.0L);
    std::fill(mag.begin(), mag.end(), 0.0L);
    for (int64_t j = 0; j < n; ++j) {
      const long double x = d.keys[j];
      const long double arg = (xa - x) * ((q - x) + (q - xa)) * inv;
      const double w = static_cast<double>(std::exp(-arg));
      den += w;
      for (int64_t c = 0; c < m; ++c) {
        const long double v = d.values[j * m + c];
        num[c] += w * v;
        mag[c] += w * std::abs(v);
      }
    }
    for (int64_t c = 0; c < m; ++c) {
      out[i * m + c] = static_cast<double>(num[c] / den);
      scale[i * m + c] = static_cast<double>(mag[c] / den);
    }
  }
}

// max over outputs of |got - ref| / (sum w|v| / sum w); infinite for a NaN.
// Beyond `floor`: weights (relative to the nearest key's 1) below 2^-1022
// are subnormal doubles, each rounded to 2^-1075 absolute, so an output made
// of such weights alone (a query among zero values, the nonzero ones 7+
// bandwidths away) can be off by n 2^-1075 max |v| whatever the tolerance
// (seen: 5e-324 x 1000 at an output of 6.3e-320).
double max_rel_error(const std::vector<double>& got, const std::vector<double>& ref,
                     const std::vector<double>& scale, int64_t m, double floor,
                     std::string* where) {
  double worst = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    const double err = std::max(0.0, std::abs(got[k] - ref[k]) - floor);
    double rel;
    if (std::isnan(got[k])) {
      rel = std::numeric_limits<double>::infinity();
    } else if (scale[k] > 0) {
      rel = err / scale[k];
    } else {
      rel = err == 0 ? 0.0 : std::numeric_limits<double>::infinity();
    }
    if (rel > worst) {
      worst = rel;
      *where = "i=" + std::to_string(k / m) + " c=" + std::to_string(k % m) + ": got " +
               format_value(got[k]) + ", ref " + format_value(ref[k]) + ", scale " +
               format_value(scale[k]);
    }
  }
  return worst;
}

// Runs the kernel, compares with the reference, checks the bound and the
// method; returns the method.
std::string check(const Data& d, const std::vector<double>& queries, double h, double rel_tol,
                  const std::string& expect_method, const std::string& label) {
  SCOPED_TRACE(label + " n=" + std::to_string(d.n()) + " t=" + std::to_string(queries.size()) +
               " m=" + std::to_string(d.m) + " h=" + format_short(h) +
               " rel_tol=" + format_short(rel_tol));
  const int64_t t = static_cast<int64_t>(queries.size());
  std::vector<double> got(static_cast<size_t>(t * d.m), -12345.0);
  const std::string method = gauss1d(d.keys.data(), d.values.data(), d.n(), d.m, queries.data(), t,
                                     h, rel_tol, got.data());
  if (!expect_method.empty()) EXPECT_EQ(method, expect_method);
  std::vector<double> ref, scale;
  reference(d, queries, h, ref, scale);
  std::string where;
  double max_abs_value = 0;
  for (const double v : d.values) max_abs_value = std::max(max_abs_value, std::abs(v));
  // n 2^-1075 max|v|, formed as 2^-1074 times the rest: the literal 0x1p-1075
  // alone rounds to 0 in double (halfway to the smallest subnormal, ties to
  // even), which made the floor 0 and failed ~4 % of seeds (seed 16 at h=0.01:
  // got 4.9e-324 = 2^-1074 where the reference is 0).
  const double subnormal_floor = 0x1p-1074 * (0.5 * static_cast<double>(d.n()) * max_abs_value);
  const double err = max_rel_error(got, ref, scale, d.m, subnormal_floor, &where);
  EXPECT_LE(err, rel_tol) << "method " << method << ", worst at " << where;
  ErrorLog::instance().record("gauss1d " + method + " rel_tol " + format_short(rel_tol), err,
                              err / rel_tol);
  return method;
}

Data uniform_data(Rng& rng, int64_t n, int64_t m, double lo, double hi) {
  Data d;
  d.m = m;
  for (int64_t j = 0; j < n; ++j) d.keys.push_back(rng.uniform(lo, hi));
  std::sort(d.keys.begin(), d.keys.end());
  // A smooth signal plus noise, like the chapter's 2 sin x + x^0.8 + N(0, 0.5).
  for (int64_t j = 0; j < n; ++j) {
    const double x = (d.keys[j] - lo) / (hi - lo) * 5.0;
    for (int64_t c = 0; c < m; ++c) {
      d.values.push_back(2 * std::sin(x + c) + std::pow(x, 0.8) + rng.uniform(-0.5, 0.5));
    }
  }
  return d;
}

std::vector<double> uniform_queries(Rng& rng, int64_t t, double lo, double hi) {
  std::vector<double> q(static_cast<size_t>(t));
  for (double& x : q) x = rng.uniform(lo, hi);
  return q;
}

constexpr double kTolerances[] = {1e-6, 1e-9};

// The expected method for uniform keys on [0, 1]: tiny problems are exact,
// tiny bandwidths sum windows directly, the rest expand in boxes.
std::string expected_method(int64_t n, int64_t t, double h) {
  if (n <= 32 || n * t <= (int64_t{1} << 16)) return "exact";
  return h < 1e-3 ? "window" : "taylor";
}

TEST(Gauss1dFast, SizesBandwidthsAndColumnsMatchTheFloat64Reference) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  struct Size {
    int64_t n, t;
  };
  const Size sizes[] = {{1, 7}, {2, 50}, {17, 300}, {1000, 300}, {20000, 120}};
  const double bandwidths[] = {1e-4, 0.05, 10.0, 100.0};  // x spread (keys on [0, 1))
  for (const Size& size : sizes) {
    for (int64_t m : {1, 3}) {
      const Data d = uniform_data(rng, size.n, m, 0.0, 1.0);
      const double spread = std::max(d.keys.back() - d.keys.front(), 1e-3);
      // Mostly inside the data, a few past its ends.
      const std::vector<double> queries = uniform_queries(rng, size.t, -0.1, 1.1);
      for (double bw : bandwidths) {
        for (double tol : kTolerances) {
          check(d, queries, bw * spread, tol, expected_method(size.n, size.t, bw * spread),
                "uniform");
        }
      }
    }
  }
}

TEST(Gauss1dFast, EveryMethodIsExercised) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Data d = uniform_data(rng, 5000, 1, 0.0, 1.0);
  const std::vector<double> queries = uniform_queries(rng, 400, 0.0, 1.0);
  EXPECT_EQ(check(d, queries, 1e-5, 1e-7, "", "tiny"), "window");
  EXPECT_EQ(check(d, queries, 0.02, 1e-7, "", "typical"), "taylor");
  EXPECT_EQ(check(d, queries, 10.0, 1e-7, "", "huge"), "taylor");
  const std::vector<double> few(queries.begin(), queries.begin() + 10);
  EXPECT_EQ(check(d, few, 0.02, 1e-7, "", "few queries"), "exact");
  // rel_tol below what the fast paths' rounding analysis covers: exact.
  EXPECT_EQ(check(d, queries, 0.02, 1e-13, "", "tight tolerance"), "exact");
}

TEST(Gauss1dFast, WeightSumsMatchTheFloat64Sums) {
  // weight_sums: each query's sum of weights relative to its nearest key,
  // against long double sums, by every method; queries at the keys (as
  // KernelRegression's fast cv asks) and between them, +-inf and NaN.
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Data d = uniform_data(rng, 5000, 2, 0.0, 1.0);
  std::fill(d.keys.begin() + 100, d.keys.begin() + 110, d.keys[100]);  // copies
  std::vector<double> queries = uniform_queries(rng, 300, -0.1, 1.1);
  for (int64_t j = 0; j < 5000; j += 50) queries.push_back(d.keys[j]);
  for (const auto& [h, want] : {std::pair{1e-5, "window"}, {0.02, "taylor"}, {10.0, "taylor"}}) {
    for (const bool few : {false, true}) {
      SCOPED_TRACE("h " + std::to_string(h) + (few ? ", few queries" : ""));
      const std::vector<double> q(queries.begin(), few ? queries.begin() + 10 : queries.end());
      const int64_t t = static_cast<int64_t>(q.size());
      std::vector<double> out(static_cast<size_t>(2 * t)), w(static_cast<size_t>(t));
      const int threads = num_threads();
      std::vector<double> workspace(kernels::fast::gauss1d_workspace_size(
          d.keys.data(), d.n(), 2, q.data(), t, h, 1e-7, threads));
      const std::string method = kernels::fast::gauss1d(
          d.keys.data(), d.values.data(), d.n(), 2, q.data(), t, h, 1e-7, out.data(),
          {.data = workspace.data(), .num_threads = threads}, w.data());
      EXPECT_EQ(method, few ? "exact" : want);
      for (int64_t i = 0; i < t; ++i) {
        const long double qi = q[i];
        int64_t a = 0;
        for (int64_t j = 1; j < d.n(); ++j) {
          if (std::abs(qi - d.keys[j]) < std::abs(qi - d.keys[a])) a = j;
        }
        const long double xa = d.keys[a], inv = 1.0L / (2.0L * h * h);
        long double sum = 0;
        for (const double x : d.keys) sum += std::exp(-(xa - x) * ((qi - x) + (qi - xa)) * inv);
        ASSERT_GE(w[i], 1.0);
        EXPECT_NEAR(w[i], static_cast<double>(sum), 0.5e-7 * static_cast<double>(sum))
            << "query " << i << " at " << q[i];
      }
    }
  }
  const std::vector<double> odd{std::numeric_limits<double>::infinity(),
                                -std::numeric_limits<double>::infinity(),
                                std::numeric_limits<double>::quiet_NaN()};
  std::vector<double> out(6), w(3);
  std::vector<double> workspace(
      kernels::fast::gauss1d_workspace_size(d.keys.data(), d.n(), 2, odd.data(), 3, 0.1, 1e-7, 1));
  kernels::fast::gauss1d(d.keys.data(), d.values.data(), d.n(), 2, odd.data(), 3, 0.1, 1e-7,
                         out.data(), {.data = workspace.data(), .num_threads = 1}, w.data());
  EXPECT_EQ(w[0], 1.0);  // the largest key, once
  EXPECT_EQ(w[1], 1.0);
  EXPECT_TRUE(std::isnan(w[2]));
}

TEST(Gauss1dFast, DuplicateKeys) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t m : {1, 3}) {
    Data d = uniform_data(rng, 3000, m, 0.0, 1.0);
    // 3000 keys on 40 distinct values (each about 75 times), and one value
    // repeated 500 times in a row.
    for (double& x : d.keys) x = std::floor(x * 40.0) / 40.0;
    std::fill(d.keys.begin() + 1000, d.keys.begin() + 1500, d.keys[1000]);
    ASSERT_TRUE(std::is_sorted(d.keys.begin(), d.keys.end()));
    const std::vector<double> queries = uniform_queries(rng, 200, -0.2, 1.2);
    for (double h : {1e-5, 1e-3, 0.05, 3.0}) {
      for (double tol : kTolerances) check(d, queries, h, tol, "", "duplicates");
    }
  }
}

TEST(Gauss1dFast, FarQueriesGiveTheNearestKeysValue) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t m : {1, 3}) {
    Data d = uniform_data(rng, 2000, m, 0.0, 1.0);
    d.keys.back() = d.keys[d.keys.size() - 2];  // the largest key twice
    std::vector<double> queries = uniform_queries(rng, 100, 0.0, 1.0);
    const double lo = d.keys.front(), hi = d.keys.back();
    for (double far : {1e6, 1e3, 50.0, 2.0}) {
      queries.push_back(lo - far);
      queries.push_back(hi + far);
    }
    for (double h : {1e-4, 0.01, 0.3, 10.0, 100.0}) {
      for (double tol : kTolerances) check(d, queries, h, tol, "", "far");
    }
    // Small h: the far queries return their nearest keys' values (the mean
    // of the two equal largest keys' on the right), never NaN.
    std::vector<double> got(queries.size() * static_cast<size_t>(m));
    const std::vector<double> far = {lo - 1e6, hi + 1e6};
    got.resize(far.size() * static_cast<size_t>(m));
    gauss1d(d.keys.data(), d.values.data(), d.n(), m, far.data(), 2, 0.01, 1e-7, got.data());
    const int64_t last = d.n() - 1;
    for (int64_t c = 0; c < m; ++c) {
      EXPECT_NEAR(got[c], d.values[c], 1e-12) << "c=" << c;
      const double mean = 0.5 * (d.values[(last - 1) * m + c] + d.values[last * m + c]);
      EXPECT_NEAR(got[m + c], mean, 1e-12) << "c=" << c;
    }
  }
}

TEST(Gauss1dFast, ClusteredDataWithOutliers) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t m : {1, 3}) {
    Data d;
    d.m = m;
    // Five tight clusters (width 1e-4) of 1000 keys each and 30 outliers on [0, 10].
    for (int k = 0; k < 5; ++k) {
      const double centre = rng.uniform(0.0, 10.0);
      for (int j = 0; j < 1000; ++j) d.keys.push_back(centre + rng.uniform(-5e-5, 5e-5));
    }
    for (int j = 0; j < 30; ++j) d.keys.push_back(rng.uniform(0.0, 10.0));
    std::sort(d.keys.begin(), d.keys.end());
    for (size_t j = 0; j < d.keys.size() * static_cast<size_t>(m); ++j) {
      d.values.push_back(rng.uniform(-2.0, 3.0));
    }
    std::vector<double> queries = uniform_queries(rng, 150, -1.0, 11.0);
    for (int k = 0; k < 50; ++k) {  // right at the clusters and outliers
      queries.push_back(d.keys[static_cast<size_t>(rng.uniform_int(0, d.n() - 1))] +
                        rng.uniform(-1e-4, 1e-4));
    }
    for (double h : {1e-6, 1e-4, 1e-2, 0.3, 5.0}) {
      for (double tol : kTolerances) check(d, queries, h, tol, "", "clustered");
    }
  }
}

TEST(Gauss1dFast, AllKeysEqual) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t m : {1, 3}) {
    Data d = uniform_data(rng, 1500, m, 0.0, 1.0);
    std::fill(d.keys.begin(), d.keys.end(), 0.75);
    std::vector<double> queries = uniform_queries(rng, 100, -2.0, 3.0);
    queries.push_back(0.75 + 1e6);
    for (double h : {1e-4, 0.1, 10.0}) {
      for (double tol : kTolerances) check(d, queries, h, tol, "", "equal keys");
    }
  }
}

// Values that vanish near the query but not far away: the kept window's
// numerator is 0, so the dropped keys' share cannot be bounded from it and
// the kernel must widen the window until the float64 weights underflow.
TEST(Gauss1dFast, ZeroValuesNearTheQueryWidenTheWindow) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Data d = uniform_data(rng, 4000, 1, 0.0, 1.0);
  for (int64_t j = 0; j < d.n(); ++j) d.values[j] = d.keys[j] < 0.5 ? 0.0 : 1.0 + d.keys[j];
  std::vector<double> queries = uniform_queries(rng, 100, 0.0, 0.5);
  for (double x : {0.1, 0.2, 0.3, 0.45}) queries.push_back(x);
  for (double h : {1e-3, 0.01, 0.05}) {
    for (double tol : kTolerances) check(d, queries, h, tol, "", "zero values");
  }
}

TEST(Gauss1dFast, NonFiniteQueries) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Data d = uniform_data(rng, 3000, 2, 0.0, 1.0);
  d.keys[0] = d.keys[1];
  std::vector<double> queries = uniform_queries(rng, 100, 0.0, 1.0);
  queries[3] = std::numeric_limits<double>::quiet_NaN();
  queries[4] = std::numeric_limits<double>::infinity();
  queries[5] = -std::numeric_limits<double>::infinity();
  std::vector<double> got(queries.size() * 2);
  gauss1d(d.keys.data(), d.values.data(), d.n(), 2, queries.data(),
          static_cast<int64_t>(queries.size()), 0.05, 1e-7, got.data());
  const int64_t n = d.n();
  for (int c = 0; c < 2; ++c) {
    EXPECT_TRUE(std::isnan(got[3 * 2 + c]));
    EXPECT_DOUBLE_EQ(got[4 * 2 + c], d.values[(n - 1) * 2 + c]);
    EXPECT_DOUBLE_EQ(got[5 * 2 + c], 0.5 * (d.values[c] + d.values[2 + c]));
  }
  for (size_t k = 0; k < got.size(); ++k) {
    if (k / 2 != 3) EXPECT_TRUE(std::isfinite(got[k])) << "k=" << k;
  }
}

// A number of magnitude 10^U(lo, hi) with a random sign.
double log_uniform(Rng& rng, double lo, double hi) {
  const double v = std::pow(10.0, rng.uniform(lo, hi));
  return rng.bernoulli(0.5) ? v : -v;
}

// For the queries at +-1e308 and +-DBL_MAX: when every key other than the
// nearest (and its duplicates) has a relative exponent above 2000 in long
// double, its weight is 0 in float64 and the output is exactly the nearest
// key's value (the mean over its duplicates, within rounding).
void expect_far_queries_get_the_nearest_keys_value(const Data& d, double h, double rel_tol) {
  const double far[] = {1e308, -1e308, std::numeric_limits<double>::max(),
                        -std::numeric_limits<double>::max()};
  const int64_t n = d.n(), m = d.m;
  std::vector<double> got(4 * static_cast<size_t>(m));
  gauss1d(d.keys.data(), d.values.data(), n, m, far, 4, h, rel_tol, got.data());
  for (int i = 0; i < 4; ++i) {
    const long double q = far[i];
    int64_t a = 0;  // the nearest key, as in reference()
    for (int64_t j = 1; j < n; ++j) {
      const long double x = d.keys[j], xa = d.keys[a];
      if ((xa - x) * ((q - x) + (q - xa)) < 0) a = j;
    }
    const long double xa = d.keys[a];
    long double next = std::numeric_limits<long double>::infinity();
    std::vector<int64_t> tied;
    for (int64_t j = 0; j < n; ++j) {
      const long double x = d.keys[j];
      if (x == xa) {
        tied.push_back(j);
      } else {
        next = std::min(next, (xa - x) * ((q - x) + (q - xa)) / (2.0L * h * h));
      }
    }
    if (!(next > 2000)) continue;
    for (int64_t c = 0; c < m; ++c) {
      long double mean = 0;
      for (int64_t j : tied) mean += d.values[j * m + c];
      mean /= static_cast<long double>(tied.size());
      EXPECT_NEAR(got[i * m + c], static_cast<double>(mean),
                  1e-15 * std::abs(static_cast<double>(mean)))
          << "q=" << far[i] << " c=" << c << " h=" << h << ": nearest key " << d.keys[a];
    }
  }
}

// Issue 9: keys spread over the whole double range (magnitudes 1e-300 to
// 1e308, both signs, +-DBL_MAX), queries likewise and at +-1e308, and
// bandwidths from the smallest normal double to 1e300 gave NaN. Every
// method, within rel_tol of the long double reference; far queries their
// nearest key's value.
TEST(Gauss1dFast, KeysOverTheWholeDoubleRange) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int64_t n : {20, 1500}) {
    for (int64_t m : {1, 2}) {
      Data d;
      d.m = m;
      for (int64_t j = 0; j < n; ++j) d.keys.push_back(log_uniform(rng, -300, 308));
      d.keys[0] = std::numeric_limits<double>::max();
      d.keys[1] = -std::numeric_limits<double>::max();
      std::sort(d.keys.begin(), d.keys.end());
      for (int64_t j = 0; j < n * m; ++j) d.values.push_back(rng.uniform(-2.0, 3.0));
      std::vector<double> queries;
      for (int i = 0; i < 400; ++i) queries.push_back(log_uniform(rng, -300, 308));
      for (double q : {1e308, -1e308, std::numeric_limits<double>::max(), 0.0, d.keys[5],
                       d.keys[static_cast<size_t>(n / 2)]}) {
        queries.push_back(q);
      }
      for (double h : {std::numeric_limits<double>::min(), 1e-150, 1.0, 1e150, 1e300}) {
        for (double tol : {1e-7, 1e-9}) {
          check(d, queries, h, tol, n <= 32 ? "exact" : "", "whole range");
          expect_far_queries_get_the_nearest_keys_value(d, h, tol);
        }
      }
    }
  }
}

// One problem at scales 2^-1000 .. 2^1020 (the last with queries up to
// 1.7e308, where q - x overflows): within rel_tol, and the Taylor boxes
// still serve it (h is 200 key spacings).
TEST(Gauss1dFast, ScaledProblemsKeepTheirMethod) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (int e : {-1000, -500, 500, 1000, 1020}) {
    const double scale = std::ldexp(1.0, e);
    Data d = uniform_data(rng, 3000, 1, -7.0, 7.0);
    for (double& x : d.keys) x *= scale;
    std::vector<double> queries = uniform_queries(rng, 300, -15.0, 15.0);
    for (double& q : queries) q *= scale;
    const double h = rng.uniform(0.3, 3.0) * scale;
    EXPECT_EQ(check(d, queries, h, 1e-7, "", "scale 2^" + std::to_string(e)), "taylor");
    expect_far_queries_get_the_nearest_keys_value(d, h, 1e-7);
  }
}

// Ordinary keys with bandwidths from the smallest normal double (each
// query its nearest key) to 1e300 (the mean of the values), far queries
// included.
TEST(Gauss1dFast, BandwidthsFromTheSmallestNormalTo1e300) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Data d = uniform_data(rng, 2000, 2, 0.0, 5.0);
  std::vector<double> queries = uniform_queries(rng, 300, -1.0, 6.0);
  queries.push_back(1e308);
  queries.push_back(-1e308);
  queries.push_back(d.keys[100]);
  for (double h : {std::numeric_limits<double>::min(), 1e-300, 1e-160, 1e-100, 1e-5, 0.5, 1e5,
                   1e100, 1e160, 1e300}) {
    for (double tol : kTolerances) check(d, queries, h, tol, "", "ordinary keys");
    expect_far_queries_get_the_nearest_keys_value(d, h, 1e-7);
  }
}

TEST(Gauss1dFast, SameBitsForOneAndTwoThreads) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Data d = uniform_data(rng, 20000, 1, 0.0, 1.0);
  const std::vector<double> queries = uniform_queries(rng, 3000, -0.1, 1.1);
  for (double h : {1e-5, 0.01, 1.0}) {
    std::vector<double> one(queries.size()), two(queries.size());
    {
      ThreadCount threads(1);
      gauss1d(d.keys.data(), d.values.data(), d.n(), 1, queries.data(),
              static_cast<int64_t>(queries.size()), h, 1e-7, one.data());
    }
    {
      ThreadCount threads(2);
      gauss1d(d.keys.data(), d.values.data(), d.n(), 1, queries.data(),
              static_cast<int64_t>(queries.size()), h, 1e-7, two.data());
    }
    EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * sizeof(double))) << "h=" << h;
  }
}

// The size the header documents, in doubles, as an upper bound from the
// arguments alone: 5 t (sorted queries, their merge, the 1/16 copies), n
// (1/16 keys), m + t / 256, the boxes (B <= n / 12, moments <= 2 (m + 1) n,
// P <= 60), per thread a query's scratch and the boxes' moments, and 64
// bytes of alignment slack (9 words with rounding) for each of the at most
// 13 + 6 T slices.
double documented_bound(int64_t n, int64_t m, int64_t t, int threads) {
  const double nd = static_cast<double>(n), md = static_cast<double>(m);
  const double td = static_cast<double>(t), b = nd / 12.0;
  const double per_thread =
      2.0 * (md + 1) * 60 + std::max(1024.0, b) + b + std::max(md, b) + md + 1;
  return 5 * td + nd + md + td / 256 + 1 + (b + 1) + nd / 2 + 2 * b + 2 * (md + 1) * nd +
         threads * per_thread + 9.0 * (13 + 6 * threads);
}

// The size query is honoured: a workspace of exactly gauss1d_workspace_size
// doubles, filled with a sentinel, at every offset from a cache line (the
// kernel cuts 64-byte aligned slices), with guard words on both sides, gives
// the bits of a call with a generous zeroed workspace and leaves the guards
// alone. Workspaces sized for 1, 2 and 3 threads, run on 1 and 2; random
// sizes, bandwidths and tolerances that reach every path: exact, window,
// Taylor with few and many boxes, coordinates beyond 2^1020 (the 1/16
// copies), tiny h far from 0 (the careful exponents), NaN and infinite
// queries. The kernel cannot see a workspace's size (Workspace carries
// none), so a short one is caught here, by the guards, not by the kernel.
TEST(Gauss1dFast, WorkspaceOfTheQueriedSizeSuffices) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  constexpr int64_t kGuard = 64;
  constexpr uint64_t kSentinel = 0x7FF4DEADBEEF1234ull;  // a signalling NaN's bits
  double sentinel;
  std::memcpy(&sentinel, &kSentinel, sizeof sentinel);
  auto untouched = [&](const double* p, int64_t len) {
    return std::memcmp(p, std::vector<double>(static_cast<size_t>(len), sentinel).data(),
                       static_cast<size_t>(len) * sizeof(double)) == 0;
  };
  std::set<std::string> methods;
  const int num_problems = kSanitized ? 12 : 48;
  for (int problem = 0; problem < num_problems; ++problem) {
    const int kind = problem % 6;
    int64_t n = static_cast<int64_t>(std::pow(10.0, rng.uniform(0.0, 4.3)));
    int64_t t = static_cast<int64_t>(std::pow(10.0, rng.uniform(0.0, 3.3)));
    const int64_t m = rng.uniform_int(1, 4);
    const double tols[] = {1e-6, 1e-7, 1e-9, 1e-13};
    double rel_tol = tols[rng.uniform_int(0, 3)];
    if (kind == 3 || kind == 5) {  // sure to take the fast paths: window and Taylor
      n = rng.uniform_int(5000, 20000);
      t = rng.uniform_int(100, 2000);
      rel_tol = tols[rng.uniform_int(0, 2)];
    }
    if (rel_tol < 1e-12) t = std::min<int64_t>(t, 200);  // the exact path: n t exps
    Data d = uniform_data(rng, n, m, 0.0, 1.0);
    std::vector<double> queries = uniform_queries(rng, t, -0.2, 1.2);
    double h = std::pow(10.0, rng.uniform(-5.5, 1.5));
    if (kind == 1) {  // duplicates and a run of equal keys
      for (double& x : d.keys) x = std::floor(x * 40.0) / 40.0;
    } else if (kind == 2) {  // beyond 2^1020: the 1/16 copies
      for (double& x : d.keys) x *= 0x1p1021;
      for (double& q : queries) q *= 0x1p1021;
      h = std::min(h, 4.0) * 0x1p1021;  // finite
    } else if (kind == 3) {             // h below 2^-1020 of the largest coordinate: careful
      d.keys.back() = 1e300;
      h = 1e-8;
    } else if (kind == 4 && t >= 3) {  // non-finite queries
      queries[0] = std::numeric_limits<double>::quiet_NaN();
      queries[1] = std::numeric_limits<double>::infinity();
      queries[2] = -std::numeric_limits<double>::infinity();
    } else if (kind == 5) {  // typical Taylor problems: many keys per box
      h = rng.uniform(0.02, 0.5);
    }
    const std::string label = "problem " + std::to_string(problem) + " n=" + std::to_string(n) +
                              " t=" + std::to_string(t) + " m=" + std::to_string(m) +
                              " h=" + format_short(h) + " rel_tol=" + format_short(rel_tol);
    SCOPED_TRACE(label);

    std::vector<double> want(static_cast<size_t>(t * m));
    std::string want_method;
    {
      const size_t size = kernels::fast::gauss1d_workspace_size(d.keys.data(), n, m, queries.data(),
                                                                t, h, rel_tol, 2);
      std::vector<double> generous(2 * size + 4096, 0.0);
      want_method = kernels::fast::gauss1d(d.keys.data(), d.values.data(), n, m, queries.data(), t,
                                           h, rel_tol, want.data(), {generous.data(), 2});
    }
    methods.insert(want_method);
    for (int ws_threads : {1, 2, 3}) {
      const size_t size = kernels::fast::gauss1d_workspace_size(d.keys.data(), n, m, queries.data(),
                                                                t, h, rel_tol, ws_threads);
      EXPECT_LE(static_cast<double>(size), documented_bound(n, m, t, ws_threads))
          << "threads " << ws_threads;
      for (int running : {1, 2}) {
        ThreadCount threads(running);
        const int64_t offset = rng.uniform_int(0, 7);  // words past a 64-byte line
        // Up to 7 words to the cache line, kGuard, 7 of offset, size, kGuard.
        std::vector<double> buffer(static_cast<size_t>(14 + 2 * kGuard) + size, sentinel);
        double* const start = reinterpret_cast<double*>(
            (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
        double* const data = start + kGuard + offset;
        std::vector<double> got(static_cast<size_t>(t * m), -12345.0);
        const std::string method =
            kernels::fast::gauss1d(d.keys.data(), d.values.data(), n, m, queries.data(), t, h,
                                   rel_tol, got.data(), {data, ws_threads});
        const std::string where = "workspace for " + std::to_string(ws_threads) +
                                  " threads, run on " + std::to_string(running) + ", offset " +
                                  std::to_string(offset) + ", size " + std::to_string(size);
        EXPECT_TRUE(untouched(data - kGuard, kGuard)) << "guard before overwritten, " << where;
        EXPECT_TRUE(untouched(data + size, kGuard)) << "guard after overwritten, " << where;
        EXPECT_EQ(method, want_method) << where;
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(double)))
            << "results differ from the generous workspace's, " << where;
      }
    }
  }
  // Every method was reached (kinds 3 and 5 take the window and Taylor paths).
  if (!kSanitized) {
    EXPECT_TRUE(methods.count("exact") && methods.count("window") && methods.count("taylor"))
        << "methods seen: " << methods.size();
  }
}

}  // namespace
}  // namespace qkv::test
