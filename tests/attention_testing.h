// Helpers of the attention and module suites: plain double loops for scaled
// dot-product and additive attention, forward and backward, written straight
// from DESIGN.md §3 and independent of the library's kernels (only
// qkv::dropout_keep, the public definition of the mask, is shared), plus the
// owning valid lengths and the double tensors the comparisons take.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/attention.h"
#include "qkv/dropout.h"
#include "qkv/tensor.h"
#include "qkv/threads.h"
#include "qkv/valid_lens.h"
#include "test_util.h"

namespace qkv::test {

// A row-major double tensor of `shape` holding `values`.
inline Tensor<double> as_tensor(const Shape& shape, std::vector<double> values) {
  return Tensor<double>(shape, std::move(values));
}

// Valid lengths owned as int32 or int64, handed out as a ValidLens view.
struct OwnedLens {
  Tensor<int32_t> lens32;
  Tensor<int64_t> lens64;
  bool use32 = false;
  ValidLens get() const { return use32 ? as_valid_lens(lens32) : as_valid_lens(lens64); }
  // The length of row (b, i), or num_keys when absent.
  int64_t at(int64_t b, int64_t i, int64_t num_keys) const { return get()(b, i, num_keys); }
};

inline OwnedLens make_lens(Rng& rng, LensForm form, bool use32, int64_t batch, int64_t num_queries,
                           int64_t num_keys, double zero_fraction = 0.2) {
  OwnedLens lens;
  lens.use32 = use32;
  if (use32) {
    lens.lens32 = random_lens<int32_t>(rng, form, batch, num_queries, num_keys, zero_fraction);
  } else {
    lens.lens64 = random_lens<int64_t>(rng, form, batch, num_queries, num_keys, zero_fraction);
  }
  return lens;
}

// Names the float and double instances of typed tests.
struct TypeNames {
  template <class T>
  static std::string GetName(int) {
    return std::is_same_v<T, float> ? "float" : "double";
  }
};

// The exact masking contract of attention: weights at key positions j >= L
// are 0, and a row with L = 0 has a zero output and lse = -inf. Empty weights
// or lse are skipped.
template <class T>
void expect_exact_masking(const Tensor<T>& output, const Tensor<T>& weights, const Tensor<T>& lse,
                          const OwnedLens& lens, int64_t num_keys, const char* what) {
  const int64_t batch = output.size(0), nq = output.size(1), dv = output.size(2);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = lens.at(b, i, num_keys);
      if (!weights.empty()) {
        for (int64_t j = len; j < num_keys; ++j) {
          ASSERT_EQ(weights(b, i, j), T(0)) << what << ": masked weight b=" << b << " q=" << i
                                            << " k=" << j << " (L=" << len << ")";
        }
      }
      if (len != 0) continue;
      for (int64_t d = 0; d < dv; ++d) {
        ASSERT_EQ(output(b, i, d), T(0))
            << what << ": output of a row with L=0, b=" << b << " q=" << i << " d=" << d;
      }
      if (!lse.empty()) {
        ASSERT_TRUE(std::isinf(lse(b, i)) && lse(b, i) < 0)
            << what << ": lse of a row with L=0 is " << lse(b, i) << ", b=" << b << " q=" << i;
      }
    }
  }
}

// The largest |a - b| over two tensors of one shape (to show two results differ).
template <class A, class B>
double max_abs_diff(const Tensor<A>& a, const Tensor<B>& b) {
  double worst = 0.0;
  const size_t n = std::min(a.values().size(), b.values().size());
  for (size_t e = 0; e < n; ++e) {
    worst = std::max(worst, std::abs(double(a.values()[e]) - double(b.values()[e])));
  }
  return worst;
}

// Standard normal elements (the chapter draws its queries this way).
template <class T>
Tensor<T> normal_tensor(Rng& rng, const Shape& shape) {
  Tensor<T> out(shape);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (T& x : out.values()) x = static_cast<T>(normal(rng.engine()));
  return out;
}

// Row-major double tensors of the results: out (B, Nq, Dv), weights
// (B, Nq, Nk) before dropout, lse (B, Nq).
struct NaiveForward {
  int64_t batch = 0, num_queries = 0, num_keys = 0, value_dim = 0;
  std::vector<double> out, weights, lse;
  double out_at(int64_t b, int64_t i, int64_t d) const {
    return out[static_cast<size_t>((b * num_queries + i) * value_dim + d)];
  }
  double weight_at(int64_t b, int64_t i, int64_t j) const {
    return weights[static_cast<size_t>((b * num_queries + i) * num_keys + j)];
  }
  double lse_at(int64_t b, int64_t i) const {
    return lse[static_cast<size_t>(b * num_queries + i)];
  }
};

// The dropout multiplier of weight (b, i, j): 0 or 1 / (1 - p) in training
// mode, 1 otherwise.
struct NaiveDropout {
  double p = 0.0;
  bool training = false;
  uint64_t seed = 0;
  double factor(int64_t b, int64_t i, int64_t j) const {
    if (!training || p == 0.0) return 1.0;
    return qkv::dropout_keep(seed, p, b, i, j) ? 1.0 / (1.0 - p) : 0.0;
  }
};

// Masked softmax, lse and pooling, given scores (B, Nq, Nk) row-major.
template <class T>
NaiveForward naive_pool(const std::vector<double>& scores, int64_t batch, int64_t num_queries,
                        int64_t num_keys, ConstView<T> values, const ValidLens& lens,
                        const NaiveDropout& dropout) {
  NaiveForward r;
  r.batch = batch;
  r.num_queries = num_queries;
  r.num_keys = num_keys;
  r.value_dim = values.size(2);
  r.out.assign(static_cast<size_t>(batch * num_queries * r.value_dim), 0.0);
  r.weights.assign(static_cast<size_t>(batch * num_queries * num_keys), 0.0);
  r.lse.assign(static_cast<size_t>(batch * num_queries), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_queries; ++i) {
      const int64_t len = lens(b, i, num_keys);
      const size_t row = static_cast<size_t>((b * num_queries + i) * num_keys);
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < len; ++j) m = std::max(m, scores[row + j]);
      if (len == 0) {
        r.lse[static_cast<size_t>(b * num_queries + i)] = -std::numeric_limits<double>::infinity();
        continue;
      }
      double sum = 0.0;
      for (int64_t j = 0; j < len; ++j) sum += std::exp(scores[row + j] - m);
      r.lse[static_cast<size_t>(b * num_queries + i)] = m + std::log(sum);
      for (int64_t j = 0; j < len; ++j) {
        const double w = std::exp(scores[row + j] - m) / sum;
        r.weights[row + j] = w;
        const double wd = w * dropout.factor(b, i, j);
        for (int64_t d = 0; d < r.value_dim; ++d) {
          r.out[static_cast<size_t>((b * num_queries + i) * r.value_dim + d)] +=
              wd * static_cast<double>(values(b, j, d));
        }
      }
    }
  }
  return r;
}

// scores[b, i, j] = scale * <q_bi, k_bj>.
template <class T>
std::vector<double> naive_dot_scores(ConstView<T> q, ConstView<T> k, double scale) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dim = q.size(2);
  std::vector<double> s(static_cast<size_t>(batch * nq * nk));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < dim; ++d) {
          dot += static_cast<double>(q(b, i, d)) * static_cast<double>(k(b, j, d));
        }
        s[static_cast<size_t>((b * nq + i) * nk + j)] = scale * dot;
      }
    }
  }
  return s;
}

template <class T>
NaiveForward naive_sdpa(ConstView<T> q, ConstView<T> k, ConstView<T> v, const ValidLens& lens,
                        double scale, const NaiveDropout& dropout) {
  return naive_pool<T>(naive_dot_scores<T>(q, k, scale), q.size(0), q.size(1), k.size(1), v, lens,
                       dropout);
}

// w_v read as H numbers from a (H) or (1, H) view.
template <class T>
double naive_wv(ConstView<T> w_v, int64_t h) {
  return static_cast<double>(w_v.rank() == 1 ? w_v(h) : w_v(0, h));
}

// Projections: a[b, i, h] = sum_d W[h, d] x[b, i, d].
template <class T>
std::vector<double> naive_project(ConstView<T> x, ConstView<T> w) {
  const int64_t batch = x.size(0), n = x.size(1), dim = x.size(2), hidden = w.size(0);
  std::vector<double> a(static_cast<size_t>(batch * n * hidden), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < hidden; ++h) {
        double acc = 0.0;
        for (int64_t d = 0; d < dim; ++d) {
          acc += static_cast<double>(w(h, d)) * static_cast<double>(x(b, i, d));
        }
        a[static_cast<size_t>((b * n + i) * hidden + h)] = acc;
      }
    }
  }
  return a;
}

template <class T>
std::vector<double> naive_additive_scores(ConstView<T> q, ConstView<T> k, ConstView<T> w_q,
                                          ConstView<T> w_k, ConstView<T> w_v) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = w_q.size(0);
  const std::vector<double> a = naive_project<T>(q, w_q);
  const std::vector<double> c = naive_project<T>(k, w_k);
  std::vector<double> s(static_cast<size_t>(batch * nq * nk));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double acc = 0.0;
        for (int64_t h = 0; h < hidden; ++h) {
          acc += naive_wv<T>(w_v, h) * std::tanh(a[static_cast<size_t>((b * nq + i) * hidden + h)] +
                                                 c[static_cast<size_t>((b * nk + j) * hidden + h)]);
        }
        s[static_cast<size_t>((b * nq + i) * nk + j)] = acc;
      }
    }
  }
  return s;
}

template <class T>
NaiveForward naive_additive(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w_q,
                            ConstView<T> w_k, ConstView<T> w_v, const ValidLens& lens,
                            const NaiveDropout& dropout) {
  return naive_pool<T>(naive_additive_scores<T>(q, k, w_q, w_k, w_v), q.size(0), q.size(1),
                       k.size(1), v, lens, dropout);
}

// d_scores (B, Nq, Nk) and d_values (B, Nk, Dv) of the pooling stage, given
// the forward's weights and d_out (B, Nq, Dv).
template <class T>
void naive_pool_backward(const NaiveForward& fwd, ConstView<T> v, ConstView<T> d_out,
                         const NaiveDropout& dropout, std::vector<double>& d_scores,
                         std::vector<double>& d_values) {
  const int64_t batch = fwd.batch, nq = fwd.num_queries, nk = fwd.num_keys, dv = fwd.value_dim;
  d_scores.assign(static_cast<size_t>(batch * nq * nk), 0.0);
  d_values.assign(static_cast<size_t>(batch * nk * dv), 0.0);
  std::vector<double> d_w(static_cast<size_t>(nk));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      double weighted = 0.0;
      for (int64_t j = 0; j < nk; ++j) {
        const double factor = dropout.factor(b, i, j);
        const double w = fwd.weight_at(b, i, j);
        double g = 0.0;
        for (int64_t d = 0; d < dv; ++d) {
          const double go = static_cast<double>(d_out(b, i, d));
          g += go * static_cast<double>(v(b, j, d));
          d_values[static_cast<size_t>((b * nk + j) * dv + d)] += w * factor * go;
        }
        d_w[static_cast<size_t>(j)] = factor * g;
        weighted += w * d_w[static_cast<size_t>(j)];
      }
      for (int64_t j = 0; j < nk; ++j) {
        d_scores[static_cast<size_t>((b * nq + i) * nk + j)] =
            fwd.weight_at(b, i, j) * (d_w[static_cast<size_t>(j)] - weighted);
      }
    }
  }
}

// Gradients as row-major double vectors in the shapes of the inputs.
struct NaiveDotGrads {
  std::vector<double> d_queries, d_keys, d_values;
};

template <class T>
NaiveDotGrads naive_sdpa_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                  const ValidLens& lens, double scale, const NaiveDropout& dropout,
                                  ConstView<T> d_out) {
  const NaiveForward fwd = naive_sdpa<T>(q, k, v, lens, scale, dropout);
  std::vector<double> ds;
  NaiveDotGrads g;
  naive_pool_backward<T>(fwd, v, d_out, dropout, ds, g.d_values);
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dim = q.size(2);
  g.d_queries.assign(static_cast<size_t>(batch * nq * dim), 0.0);
  g.d_keys.assign(static_cast<size_t>(batch * nk * dim), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double s = scale * ds[static_cast<size_t>((b * nq + i) * nk + j)];
        for (int64_t d = 0; d < dim; ++d) {
          g.d_queries[static_cast<size_t>((b * nq + i) * dim + d)] +=
              s * static_cast<double>(k(b, j, d));
          g.d_keys[static_cast<size_t>((b * nk + j) * dim + d)] +=
              s * static_cast<double>(q(b, i, d));
        }
      }
    }
  }
  return g;
}

struct NaiveAdditiveGrads {
  std::vector<double> d_queries, d_keys, d_values, d_w_q, d_w_k, d_w_v;  // d_w_v: H numbers
};

template <class T>
NaiveAdditiveGrads naive_additive_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                           ConstView<T> w_q, ConstView<T> w_k, ConstView<T> w_v,
                                           const ValidLens& lens, const NaiveDropout& dropout,
                                           ConstView<T> d_out) {
  const NaiveForward fwd = naive_additive<T>(q, k, v, w_q, w_k, w_v, lens, dropout);
  std::vector<double> ds;
  NaiveAdditiveGrads g;
  naive_pool_backward<T>(fwd, v, d_out, dropout, ds, g.d_values);
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1);
  const int64_t dq = q.size(2), dk = k.size(2), hidden = w_q.size(0);
  const std::vector<double> a = naive_project<T>(q, w_q);
  const std::vector<double> c = naive_project<T>(k, w_k);
  std::vector<double> da(a.size(), 0.0), dc(c.size(), 0.0);
  g.d_w_v.assign(static_cast<size_t>(hidden), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double s = ds[static_cast<size_t>((b * nq + i) * nk + j)];
        for (int64_t h = 0; h < hidden; ++h) {
          const size_t ia = static_cast<size_t>((b * nq + i) * hidden + h);
          const size_t ic = static_cast<size_t>((b * nk + j) * hidden + h);
          const double t = std::tanh(a[ia] + c[ic]);
          g.d_w_v[static_cast<size_t>(h)] += s * t;
          const double dz = s * naive_wv<T>(w_v, h) * (1.0 - t * t);
          da[ia] += dz;
          dc[ic] += dz;
        }
      }
    }
  }
  g.d_queries.assign(static_cast<size_t>(batch * nq * dq), 0.0);
  g.d_keys.assign(static_cast<size_t>(batch * nk * dk), 0.0);
  g.d_w_q.assign(static_cast<size_t>(hidden * dq), 0.0);
  g.d_w_k.assign(static_cast<size_t>(hidden * dk), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t h = 0; h < hidden; ++h) {
        const double x = da[static_cast<size_t>((b * nq + i) * hidden + h)];
        for (int64_t d = 0; d < dq; ++d) {
          g.d_queries[static_cast<size_t>((b * nq + i) * dq + d)] +=
              x * static_cast<double>(w_q(h, d));
          g.d_w_q[static_cast<size_t>(h * dq + d)] += x * static_cast<double>(q(b, i, d));
        }
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t h = 0; h < hidden; ++h) {
        const double x = dc[static_cast<size_t>((b * nk + j) * hidden + h)];
        for (int64_t d = 0; d < dk; ++d) {
          g.d_keys[static_cast<size_t>((b * nk + j) * dk + d)] +=
              x * static_cast<double>(w_k(h, d));
          g.d_w_k[static_cast<size_t>(h * dk + d)] += x * static_cast<double>(k(b, j, d));
        }
      }
    }
  }
  return g;
}

// ---- bilinear and distance attention ---------------------------------------------

// scores[b, i, j] = (q_bi W) . k_bj with W (Dq, Dk).
template <class T>
std::vector<double> naive_bilinear_scores(ConstView<T> q, ConstView<T> k, ConstView<T> w) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dq = q.size(2), dk = k.size(2);
  std::vector<double> s(static_cast<size_t>(batch * nq * nk)), qw(static_cast<size_t>(dk));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t e = 0; e < dk; ++e) {
        double acc = 0.0;
        for (int64_t c = 0; c < dq; ++c) {
          acc += static_cast<double>(q(b, i, c)) * static_cast<double>(w(c, e));
        }
        qw[static_cast<size_t>(e)] = acc;
      }
      for (int64_t j = 0; j < nk; ++j) {
        double acc = 0.0;
        for (int64_t e = 0; e < dk; ++e) {
          acc += qw[static_cast<size_t>(e)] * static_cast<double>(k(b, j, e));
        }
        s[static_cast<size_t>((b * nq + i) * nk + j)] = acc;
      }
    }
  }
  return s;
}

template <class T>
NaiveForward naive_bilinear(ConstView<T> q, ConstView<T> k, ConstView<T> v, ConstView<T> w,
                            const ValidLens& lens, const NaiveDropout& dropout) {
  return naive_pool<T>(naive_bilinear_scores<T>(q, k, w), q.size(0), q.size(1), k.size(1), v,
                       lens, dropout);
}

struct NaiveBilinearGrads {
  std::vector<double> d_queries, d_keys, d_values, d_w;
};

template <class T>
NaiveBilinearGrads naive_bilinear_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                           ConstView<T> w, const ValidLens& lens,
                                           const NaiveDropout& dropout, ConstView<T> d_out) {
  const NaiveForward fwd = naive_bilinear<T>(q, k, v, w, lens, dropout);
  std::vector<double> ds;
  NaiveBilinearGrads g;
  naive_pool_backward<T>(fwd, v, d_out, dropout, ds, g.d_values);
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dq = q.size(2), dk = k.size(2);
  g.d_queries.assign(static_cast<size_t>(batch * nq * dq), 0.0);
  g.d_keys.assign(static_cast<size_t>(batch * nk * dk), 0.0);
  g.d_w.assign(static_cast<size_t>(dq * dk), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double s = ds[static_cast<size_t>((b * nq + i) * nk + j)];
        if (s == 0.0) continue;  // a key the query does not see (it may hold NaN)
        for (int64_t c = 0; c < dq; ++c) {
          for (int64_t e = 0; e < dk; ++e) {
            const double qv = static_cast<double>(q(b, i, c)), kv = static_cast<double>(k(b, j, e)),
                         wv = static_cast<double>(w(c, e));
            g.d_queries[static_cast<size_t>((b * nq + i) * dq + c)] += s * wv * kv;
            g.d_keys[static_cast<size_t>((b * nk + j) * dk + e)] += s * qv * wv;
            g.d_w[static_cast<size_t>(c * dk + e)] += s * qv * kv;
          }
        }
      }
    }
  }
  return g;
}

// scores[b, i, j] = -scale/2 |q_bi - k_bj|^2 from the differences themselves.
template <class T>
std::vector<double> naive_distance_scores(ConstView<T> q, ConstView<T> k, double scale) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dim = q.size(2);
  std::vector<double> s(static_cast<size_t>(batch * nq * nk));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        double sq = 0.0;
        for (int64_t d = 0; d < dim; ++d) {
          const double x = static_cast<double>(q(b, i, d)) - static_cast<double>(k(b, j, d));
          sq += x * x;
        }
        s[static_cast<size_t>((b * nq + i) * nk + j)] = -0.5 * scale * sq;
      }
    }
  }
  return s;
}

template <class T>
NaiveForward naive_distance(ConstView<T> q, ConstView<T> k, ConstView<T> v, const ValidLens& lens,
                            double scale, const NaiveDropout& dropout) {
  return naive_pool<T>(naive_distance_scores<T>(q, k, scale), q.size(0), q.size(1), k.size(1), v,
                       lens, dropout);
}

template <class T>
NaiveDotGrads naive_distance_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                      const ValidLens& lens, double scale,
                                      const NaiveDropout& dropout, ConstView<T> d_out) {
  const NaiveForward fwd = naive_distance<T>(q, k, v, lens, scale, dropout);
  std::vector<double> ds;
  NaiveDotGrads g;
  naive_pool_backward<T>(fwd, v, d_out, dropout, ds, g.d_values);
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dim = q.size(2);
  g.d_queries.assign(static_cast<size_t>(batch * nq * dim), 0.0);
  g.d_keys.assign(static_cast<size_t>(batch * nk * dim), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const double s = ds[static_cast<size_t>((b * nq + i) * nk + j)];
        if (s == 0.0) continue;  // a key the query does not see (it may hold NaN)
        for (int64_t d = 0; d < dim; ++d) {
          // d score / d q = -scale (q - k) = -d score / d k
          const double x =
              -scale * s * (static_cast<double>(q(b, i, d)) - static_cast<double>(k(b, j, d)));
          g.d_queries[static_cast<size_t>((b * nq + i) * dim + d)] += x;
          g.d_keys[static_cast<size_t>((b * nk + j) * dim + d)] -= x;
        }
      }
    }
  }
  return g;
}

// sum(output * d_out) of scaled dot-product attention in float64: the loss
// whose gradients the backward gives for d_output = d_out, for finite
// differences.
inline double sdpa_dot_loss(const Tensor<double>& q, const Tensor<double>& k,
                            const Tensor<double>& v, const AttentionOptions& options,
                            const Tensor<double>& d_out) {
  const Tensor<double> out = scaled_dot_product_attention(q, k, v, {}, options).output;
  double sum = 0;
  for (int64_t e = 0; e < out.numel(); ++e) sum += out.data()[e] * d_out.data()[e];
  return sum;
}

// Scaled dot-product attention, forward and backward, at 1 and at 2
// threads: the same bits in the output, lse and every gradient (d_bias too
// when options ask for it).
template <class T>
void expect_sdpa_same_bits_for_thread_counts(const Tensor<T>& q, const Tensor<T>& k,
                                             const Tensor<T>& v, const ValidLens& lens,
                                             AttentionOptions options, const Tensor<T>& d_out) {
  options.return_lse = true;
  const int before = num_threads();
  AttentionResult<T> one, two;
  DotProductGrads<T> g_one, g_two;
  for (const int threads : {1, 2}) {
    set_num_threads(threads);
    AttentionResult<T>& r = threads == 1 ? one : two;
    r = scaled_dot_product_attention(q, k, v, lens, options);
    (threads == 1 ? g_one : g_two) =
        scaled_dot_product_attention_backward(q, k, v, lens, options, {r.output, r.lse}, d_out);
  }
  set_num_threads(before);
  expect_bitwise_equal(two.output, one.output, "output");
  expect_bitwise_equal(two.lse, one.lse, "lse");
  expect_bitwise_equal(g_two.d_queries, g_one.d_queries, "d_queries");
  expect_bitwise_equal(g_two.d_keys, g_one.d_keys, "d_keys");
  expect_bitwise_equal(g_two.d_values, g_one.d_values, "d_values");
  if (options.want_bias_grad) expect_bitwise_equal(g_two.d_bias, g_one.d_bias, "d_bias");
}

}  // namespace qkv::test
