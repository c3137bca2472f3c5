// What the index's tests share (test_index.cc, and tests/mpi/'s attention
// through an index per rank): clustered keys, exact attention and
// Nadaraya-Watson's compact kernels in float64 over every row, and the check
// of a result through an index against exact attention (its certificate,
// output and top-k).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "qkv/index.h"
#include "qkv/kernel_regression.h"
#include "test_util.h"

namespace qkv::test {

// Keys from `clusters` Gaussian blobs (spread 0.1 around centres in [-2, 2)),
// or isotropic when clusters = 0.
inline Tensor<float> clustered_keys(Rng& rng, int64_t n, int64_t d, int64_t clusters) {
  if (clusters == 0) return random_tensor<float>(rng, Shape{n, d}, -1.0, 1.0);
  const Tensor<float> centres = random_tensor<float>(rng, Shape{clusters, d}, -2.0, 2.0);
  std::normal_distribution<double> noise(0.0, 0.1);
  Tensor<float> keys(Shape{n, d});
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = rng.uniform_int(0, clusters - 1);
    for (int64_t j = 0; j < d; ++j) {
      keys(i, j) = static_cast<float>(centres(c, j) + noise(rng.engine()));
    }
  }
  return keys;
}

// Exact attention in double over every row (as the index stores them), and
// per query how far float scores and a float lse may be from it: a float
// score of D terms is within (D + 2) 2^-23 sum |terms| of the exact one,
// and the lse rounds to float (an error in the lse of t changes a weight
// by a factor exp(t)).
struct Exact {
  Tensor<double> output, lse, rounding;
  std::vector<std::vector<double>> scores;  // per query, per store row
};
inline Exact exact_attention(const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
                             bool distance, double scale) {
  const int64_t nq = q.size(0), n = k.size(0), d = k.size(1), dv = v.size(1);
  Exact e{Tensor<double>(Shape{nq, dv}),
          Tensor<double>(Shape{nq}, -INFINITY),
          Tensor<double>(Shape{nq}),
          {}};
  for (int64_t i = 0; i < nq; ++i) {
    std::vector<double> s(static_cast<size_t>(n));
    double m = -INFINITY, magnitude = 0.0;
    for (int64_t r = 0; r < n; ++r) {
      double acc = 0.0, terms = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        const double term = distance ? (double{q(i, c)} - k(r, c)) * (double{q(i, c)} - k(r, c))
                                     : double{q(i, c)} * k(r, c);
        acc += term;
        terms += std::abs(term);
      }
      s[static_cast<size_t>(r)] = distance ? -0.5 * scale * acc : scale * acc;
      magnitude = std::max(magnitude, std::abs(scale) * terms * (distance ? 0.5 : 1.0));
      m = std::max(m, s[static_cast<size_t>(r)]);
    }
    double sum = 0.0;
    for (int64_t r = 0; r < n; ++r) {
      const double w = std::exp(s[static_cast<size_t>(r)] - m);
      sum += w;
      for (int64_t c = 0; c < dv; ++c) e.output(i, c) += w * v(r, c);
    }
    if (n > 0) {
      for (int64_t c = 0; c < dv; ++c) e.output(i, c) /= sum;
      e.lse(i) = m + std::log(sum);
    }
    e.rounding(i) =
        2 * (static_cast<double>(d + 2) * 0x1.0p-23 * magnitude + 0x1.0p-24 * std::abs(e.lse(i))) +
        1e-6;
    e.scores.push_back(std::move(s));
  }
  return e;
}

// Checks one attention through the index against exact attention: the
// certificate (as the missed weight over the visited), the output, the lse
// and the top-k.
inline void check_against_exact(const IndexAttentionResult& got, const Exact& exact,
                                const Tensor<float>& values, const IndexAttentionOptions& options,
                                const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t nq = exact.lse.numel(), dv = values.size(1);
  double max_v = 0.0;
  for (int64_t r = 0; r < values.size(0); ++r) {
    double s = 0.0;
    for (int64_t c = 0; c < dv; ++c) s += double{values(r, c)} * values(r, c);
    max_v = std::max(max_v, std::sqrt(s));
  }
  for (int64_t i = 0; i < nq; ++i) {
    const double cert = got.certificate(i);
    if (options.probe == 0) {
      ASSERT_LE(cert, options.epsilon) << "query " << i;
    }
    if (options.epsilon == 0 && options.probe == 0) {
      ASSERT_EQ(cert, 0.0) << "query " << i;
    }
    // The weight missed over the weight visited, exactly: exp(lse - lse_visited) - 1,
    // give or take the float scores' rounding.
    const double rounding = exact.rounding(i);
    const double missed = std::expm1(exact.lse(i) - double{got.lse(i)});
    ASSERT_LE(missed, cert + (1 + cert) * std::expm1(rounding))
        << "query " << i << ": the certificate failed";
    double error = 0.0;
    for (int64_t c = 0; c < dv; ++c) {
      const double diff = got.output(i, c) - exact.output(i, c);
      error += diff * diff;
    }
    ASSERT_LE(std::sqrt(error), 2 * (cert + std::expm1(rounding)) * max_v + 1e-5 * (1 + max_v))
        << "query " << i;
    if (options.top_k > 0 && got.top_certified[static_cast<size_t>(i)]) {
      // The exact top k by score, ties to the smaller row.
      const std::vector<double>& s = exact.scores[static_cast<size_t>(i)];
      std::vector<int64_t> rows(s.size());
      std::iota(rows.begin(), rows.end(), 0);
      std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) {
        return s[static_cast<size_t>(a)] > s[static_cast<size_t>(b)];
      });
      for (int64_t t = 0; t < options.top_k && t < static_cast<int64_t>(rows.size()); ++t) {
        const int64_t id = got.top_ids(i, t);
        // Equal up to float scores: the row given scores as the exact t-th.
        ASSERT_GE(id, 0);
        ASSERT_NEAR(s[static_cast<size_t>(id)],
                    s[static_cast<size_t>(rows[static_cast<size_t>(t)])], rounding)
            << "query " << i << " rank " << t;
        const double weight = std::exp(s[static_cast<size_t>(id)] - exact.lse(i));
        ASSERT_NEAR(got.top_weights(i, t), weight,
                    (cert + 2 * std::expm1(rounding)) * weight + 1e-6);
      }
    }
  }
}

// Nadaraya-Watson's product kernel with a compact profile, in double, over
// every row: the reference of attention through the index with one.
struct KernelExact {
  Tensor<double> output, lse;
  std::vector<int64_t> in_reach;
};
inline KernelExact kernel_exact(const Tensor<float>& q, const Tensor<float>& k,
                                const Tensor<float>& v, Kernel kernel, double h) {
  const int64_t nq = q.size(0), n = k.size(0), d = k.size(1), dv = v.size(1);
  KernelExact e{Tensor<double>(Shape{nq, dv}), Tensor<double>(Shape{nq}, -INFINITY),
                std::vector<int64_t>(static_cast<size_t>(nq))};
  for (int64_t i = 0; i < nq; ++i) {
    double sum = 0.0;
    for (int64_t r = 0; r < n; ++r) {
      double w = 1.0;
      for (int64_t c = 0; c < d; ++c) {
        const double u = (double{q(i, c)} - k(r, c)) / h;
        if (std::abs(u) > 1) w = 0;
        w *= kernel == Kernel::kBoxcar         ? 1.0
             : kernel == Kernel::kEpanechnikov ? 1 - u * u
                                               : 1 - std::abs(u);
      }
      if (!(w > 0)) continue;
      ++e.in_reach[static_cast<size_t>(i)];
      sum += w;
      for (int64_t c = 0; c < dv; ++c) e.output(i, c) += w * v(r, c);
    }
    if (sum > 0) {
      for (int64_t c = 0; c < dv; ++c) e.output(i, c) /= sum;
      e.lse(i) = std::log(sum);
    }
  }
  return e;
}

}  // namespace qkv::test
