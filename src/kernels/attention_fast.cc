// Scaled dot-product and additive attention, fast version (BLAS + SIMD +
// threads). Forward: tasks of kQueryBlock queries; per task the scores of its
// queries against the keys any of them may see (keys past the longest valid
// length are never touched), the masked softmax row by row, dropout
// regenerated from the counter-based generator, and one GEMM with the values.
// Backward: pass 1 over query blocks recomputes the weights from the saved
// lse and forms dS (and dQ); pass 2 over key blocks forms dK and dV from the
// stored dS and dropped weights. Each output element is written by exactly
// one task, so results do not depend on the thread count.
//
// This version keeps (B, Nq, Nk) buffers in the backward and forms scores per
// query block in the forward; the fully fused flash-style kernels replace
// these bodies behind the same interface.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/vecmath.h"
#include "parallel.h"
#include "philox.h"

namespace qkv::kernels::fast {
namespace {

// 64 queries x Nk scores per task: 256 KiB at Nk = 1024 in float, inside L2,
// and enough rows for the BLAS to run near its peak rate.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The longest valid length among queries [i0, i1) of batch element b.
int64_t longest_len(const ValidLens& lens, int64_t b, int64_t i0, int64_t i1, int64_t nk) {
  if (!lens.present()) return nk;
  if (lens.rank() == 1) return lens(b, 0, nk);
  int64_t longest = 0;
  for (int64_t i = i0; i < i1; ++i) longest = std::max(longest, lens(b, i, nk));
  return longest;
}

// Dropout for one row of weights: w[j] = kept ? w[j] / (1 - p) : 0, j < n.
template <class T>
void dropout_row(const AttentionConfig& config, int64_t b, int64_t i, T* w, int64_t n,
                 std::vector<uint8_t>& keep) {
  keep.resize(static_cast<size_t>(n));
  detail::dropout_row_mask(config.seed, config.dropout, b, i, 0, n, keep.data());
  const T inv = config.dropout < 1.0 ? static_cast<T>(1.0 / (1.0 - config.dropout)) : T(0);
  for (int64_t j = 0; j < n; ++j) w[j] = keep[j] ? w[j] * inv : T(0);
}

// The forward's second half for one task, shared by both scoring functions:
// scores s (rows x n_eff, leading dimension lds; only j < len read) become
// weights in place, then dropout and pooling with the values.
template <class T>
void softmax_dropout_pool(T* s, int64_t lds, int64_t rows, int64_t n_eff, int64_t b, int64_t i0,
                          const AttentionConfig& config, int64_t nk, const T* v_b, int64_t dv,
                          T* out, T* lse, bool weights_are_output, std::vector<T>& scratch,
                          std::vector<uint8_t>& keep) {
  for (int64_t r = 0; r < rows; ++r) {
    T* row = s + r * lds;
    const T row_lse = softmax_row(row, (*config.valid_lens)(b, i0 + r, nk), n_eff, row);
    if (lse) lse[r] = row_lse;
    if (weights_are_output) std::fill(row + n_eff, row + nk, T(0));
  }
  const T* pooled = s;
  int64_t ldp = lds;
  if (config.dropout > 0.0) {
    // The returned weights are the ones before dropout, so drop a copy.
    T* p = s;
    if (weights_are_output) {
      scratch.resize(static_cast<size_t>(rows * n_eff));
      p = scratch.data();
      for (int64_t r = 0; r < rows; ++r) std::copy_n(s + r * lds, n_eff, p + r * n_eff);
      ldp = n_eff;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t len = (*config.valid_lens)(b, i0 + r, nk);
      dropout_row(config, b, i0 + r, p + r * ldp, len, keep);
    }
    pooled = p;
  }
  detail::gemm(false, false, rows, dv, n_eff, T(1), pooled, ldp, v_b, dv, T(0), out, dv);
}

// Runs the forward over tasks (b, query block); `scores` fills rows x n_eff
// scores for a task: scores(b, i0, rows, n_eff, dst, ld).
template <class T, class ScoreFn>
void forward_tasks(int64_t batch, int64_t nq, int64_t nk, ConstView<T> v,
                   const AttentionConfig& config, TensorView<T> output, TensorView<T> weights,
                   TensorView<T> lse, ScoreFn&& scores) {
  const int64_t dv = v.size(2);
  const int64_t blocks = ceil_div(nq, kQueryBlock);
  const bool want_weights = weights.data() != nullptr;
  detail::parallel_for(batch * blocks, [&](int64_t task) {
    const int64_t b = task / blocks, i0 = (task % blocks) * kQueryBlock;
    const int64_t rows = std::min(kQueryBlock, nq - i0);
    const int64_t n_eff = longest_len(*config.valid_lens, b, i0, i0 + rows, nk);
    std::vector<T> s_local, scratch;
    std::vector<uint8_t> keep;
    T* s;
    int64_t lds;
    if (want_weights) {
      s = weights.data() + (b * nq + i0) * nk;
      lds = nk;
    } else {
      s_local.resize(static_cast<size_t>(rows * n_eff));
      s = s_local.data();
      lds = n_eff;
    }
    scores(b, i0, rows, n_eff, s, lds);
    softmax_dropout_pool(s, lds, rows, n_eff, b, i0, config, nk, v.data() + b * nk * dv, dv,
                         output.data() + (b * nq + i0) * dv,
                         lse.data() ? lse.data() + b * nq + i0 : nullptr, want_weights, scratch,
                         keep);
  });
}

// Backward pass 1 for one task, after its scores are in ds (ld nk): turns
// them into dS, and the dropped weights into pd (ld nk). Returns nothing; the
// caller then uses dS for dQ (or dFq).
template <class T>
void softmax_dropout_backward_rows(T* ds, T* pd, int64_t rows, int64_t n_eff, int64_t b, int64_t i0,
                                   int64_t nq, int64_t nk, const T* v_b, int64_t dv,
                                   const T* out_blk, const T* lse_b, const T* d_out_blk,
                                   const AttentionConfig& config, std::vector<T>& dpd,
                                   std::vector<uint8_t>& keep) {
  (void)nq;
  // dLoss/d(dropped weights) = dO V^T over the keys this block can see.
  dpd.resize(static_cast<size_t>(rows * n_eff));
  detail::gemm(false, true, rows, n_eff, dv, T(1), d_out_blk, dv, v_b, dv, T(0), dpd.data(), n_eff);
  const T inv = config.dropout < 1.0 ? static_cast<T>(1.0 / (1.0 - config.dropout)) : T(0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = (*config.valid_lens)(b, i0 + r, nk);
    const T row_lse = lse_b[i0 + r];
    T* s = ds + r * nk;
    T* p = pd + r * nk;
    T* g = dpd.data() + r * n_eff;
    if (len == 0 || row_lse == -std::numeric_limits<T>::infinity()) {
      std::fill(p, p + n_eff, T(0));  // an empty row: no weight, no gradient
    } else if (std::isnan(row_lse)) {
      std::fill(p, p + len, std::numeric_limits<T>::quiet_NaN());
      std::fill(p + len, p + n_eff, T(0));
    } else {
      vecmath::exp_shift_sum(s, row_lse, p, len);
      std::fill(p + len, p + n_eff, T(0));
    }
    if (config.dropout > 0.0) {
      keep.resize(static_cast<size_t>(len));
      detail::dropout_row_mask(config.seed, config.dropout, b, i0 + r, 0, len, keep.data());
      for (int64_t j = 0; j < len; ++j) g[j] = keep[j] ? g[j] * inv : T(0);
    }
    // D_i = sum_j P_ij dP_ij = dO_i . O_i (O already includes the dropout).
    const T d_i = vecmath::dot(d_out_blk + r * dv, out_blk + r * dv, dv);
    vecmath::softmax_grad(p, g, d_i, s, len);
    std::fill(s + len, s + n_eff, T(0));
    if (config.dropout > 0.0) {
      for (int64_t j = 0; j < len; ++j) p[j] = keep[j] ? p[j] * inv : T(0);
    }
  }
}

}  // namespace

// q: (B, Nq, D)   k: (B, Nk, D)   v: (B, Nk, Dv)   all contiguous
// output: (B, Nq, Dv)   weights: (B, Nq, Nk) or null   lse: (B, Nq) or null
template <class T>
void dot_product_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                           const AttentionConfig& config, TensorView<T> output,
                           TensorView<T> weights, TensorView<T> lse) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  const T scale = static_cast<T>(config.scale);
  forward_tasks(batch, nq, nk, v, config, output, weights, lse,
                [&](int64_t b, int64_t i0, int64_t rows, int64_t n_eff, T* s, int64_t lds) {
                  detail::gemm(false, true, rows, n_eff, d, scale, q.data() + (b * nq + i0) * d, d,
                               k.data() + b * nk * d, d, T(0), s, lds);
                });
}

template <class T>
void dot_product_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const AttentionConfig& config, ConstView<T> output,
                                    ConstView<T> lse, ConstView<T> d_output,
                                    DotProductGrads<T>& grads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  const int64_t dv = v.size(2);
  const T scale = static_cast<T>(config.scale);
  grads.d_queries = Tensor<T>(Shape{batch, nq, d});
  grads.d_keys = Tensor<T>(Shape{batch, nk, d});
  grads.d_values = Tensor<T>(Shape{batch, nk, dv});
  Tensor<T> ds(Shape{batch, nq, nk}), pd(Shape{batch, nq, nk});

  const int64_t q_blocks = ceil_div(nq, kQueryBlock);
  detail::parallel_for(batch * q_blocks, [&](int64_t task) {
    const int64_t b = task / q_blocks, i0 = (task % q_blocks) * kQueryBlock;
    const int64_t rows = std::min(kQueryBlock, nq - i0);
    const int64_t n_eff = longest_len(*config.valid_lens, b, i0, i0 + rows, nk);
    const T* k_b = k.data() + b * nk * d;
    T* ds_blk = ds.data() + (b * nq + i0) * nk;
    detail::gemm(false, true, rows, n_eff, d, scale, q.data() + (b * nq + i0) * d, d, k_b, d, T(0),
                 ds_blk, nk);
    std::vector<T> dpd;
    std::vector<uint8_t> keep;
    softmax_dropout_backward_rows(ds_blk, pd.data() + (b * nq + i0) * nk, rows, n_eff, b, i0, nq,
                                  nk, v.data() + b * nk * dv, dv,
                                  output.data() + (b * nq + i0) * dv, lse.data() + b * nq,
                                  d_output.data() + (b * nq + i0) * dv, config, dpd, keep);
    detail::gemm(false, false, rows, d, n_eff, scale, ds_blk, nk, k_b, d, T(0),
                 grads.d_queries.data() + (b * nq + i0) * d, d);
  });

  const int64_t k_blocks = ceil_div(nk, kKeyBlock);
  detail::parallel_for(batch * k_blocks, [&](int64_t task) {
    const int64_t b = task / k_blocks, j0 = (task % k_blocks) * kKeyBlock;
    const int64_t cols = std::min(kKeyBlock, nk - j0);
    detail::gemm(true, false, cols, dv, nq, T(1), pd.data() + b * nq * nk + j0, nk,
                 d_output.data() + b * nq * dv, dv, T(0),
                 grads.d_values.data() + (b * nk + j0) * dv, dv);
    detail::gemm(true, false, cols, d, nq, scale, ds.data() + b * nq * nk + j0, nk,
                 q.data() + b * nq * d, d, T(0), grads.d_keys.data() + (b * nk + j0) * d, d);
  });
}

namespace {

// fq = x W^T for all rows of x: (B*N, dim) x (H, dim)^T -> (B*N, H).
template <class T>
Tensor<T> project(ConstView<T> x, ConstView<T> w) {
  const int64_t rows = x.size(0) * x.size(1), dim = x.size(2), hidden = w.size(0);
  Tensor<T> f(Shape{x.size(0), x.size(1), hidden});
  detail::parallel_gemm(false, true, rows, hidden, dim, T(1), x.data(), dim, w.data(), dim, T(0),
                        f.data(), hidden);
  return f;
}

}  // namespace

// q: (B, Nq, Dq)   k: (B, Nk, Dk)   v: (B, Nk, Dv)   w_q: (H, Dq)   w_k: (H, Dk)   w_v: (H)
template <class T>
void additive_attention(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                        const AdditiveParams<T>& params, const AttentionConfig& config,
                        TensorView<T> output, TensorView<T> weights, TensorView<T> lse) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  // The (B, Nq, Nk, H) features are never formed: W_q q and W_k k once, then
  // each score's tanh-and-reduce happens in registers.
  const Tensor<T> fq = project(q, params.w_q), fk = project(k, params.w_k);
  const T* wv = params.w_v.data();
  forward_tasks(batch, nq, nk, v, config, output, weights, lse,
                [&](int64_t b, int64_t i0, int64_t rows, int64_t, T* s, int64_t lds) {
                  for (int64_t r = 0; r < rows; ++r) {
                    const int64_t len = (*config.valid_lens)(b, i0 + r, nk);
                    const T* fq_i = fq.data() + (b * nq + i0 + r) * hidden;
                    for (int64_t j = 0; j < len; ++j) {
                      s[r * lds + j] = vecmath::additive_score(
                          fq_i, fk.data() + (b * nk + j) * hidden, wv, hidden);
                    }
                  }
                });
}

template <class T>
void additive_attention_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                 const AdditiveParams<T>& params, const AttentionConfig& config,
                                 ConstView<T> output, ConstView<T> lse, ConstView<T> d_output,
                                 AdditiveGrads<T>& grads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), hidden = params.w_q.size(0);
  const int64_t dq = q.size(2), dk = k.size(2), dv = v.size(2);
  const Tensor<T> fq = project(q, params.w_q), fk = project(k, params.w_k);
  const T* wv = params.w_v.data();
  Tensor<T> ds(Shape{batch, nq, nk}), pd(Shape{batch, nq, nk});
  Tensor<T> dfq(Shape{batch, nq, hidden}), dfk(Shape{batch, nk, hidden});
  grads.d_values = Tensor<T>(Shape{batch, nk, dv});

  // Pass 1, query blocks: dS, the dropped weights, d(fq), and this task's
  // share of d(w_v), summed below in task order.
  const int64_t q_blocks = ceil_div(nq, kQueryBlock);
  Tensor<T> dwv_parts(Shape{batch * q_blocks, hidden});
  detail::parallel_for(batch * q_blocks, [&](int64_t task) {
    const int64_t b = task / q_blocks, i0 = (task % q_blocks) * kQueryBlock;
    const int64_t rows = std::min(kQueryBlock, nq - i0);
    const int64_t n_eff = longest_len(*config.valid_lens, b, i0, i0 + rows, nk);
    T* ds_blk = ds.data() + (b * nq + i0) * nk;
    const T* fk_b = fk.data() + b * nk * hidden;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t len = (*config.valid_lens)(b, i0 + r, nk);
      const T* fq_i = fq.data() + (b * nq + i0 + r) * hidden;
      for (int64_t j = 0; j < len; ++j) {
        ds_blk[r * nk + j] = vecmath::additive_score(fq_i, fk_b + j * hidden, wv, hidden);
      }
    }
    std::vector<T> dpd;
    std::vector<uint8_t> keep;
    softmax_dropout_backward_rows(ds_blk, pd.data() + (b * nq + i0) * nk, rows, n_eff, b, i0, nq,
                                  nk, v.data() + b * nk * dv, dv,
                                  output.data() + (b * nq + i0) * dv, lse.data() + b * nq,
                                  d_output.data() + (b * nq + i0) * dv, config, dpd, keep);
    T* dwv_part = dwv_parts.data() + task * hidden;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t len = (*config.valid_lens)(b, i0 + r, nk);
      const T* fq_i = fq.data() + (b * nq + i0 + r) * hidden;
      T* dfq_i = dfq.data() + (b * nq + i0 + r) * hidden;
      for (int64_t j = 0; j < len; ++j) {
        const T g = ds_blk[r * nk + j];
        if (g == T(0)) continue;
        vecmath::additive_score_grad(fq_i, fk_b + j * hidden, wv, hidden, g, dfq_i, dwv_part);
      }
    }
  });

  // Pass 2, key blocks: d(fk) and dV.
  const int64_t k_blocks = ceil_div(nk, kKeyBlock);
  detail::parallel_for(batch * k_blocks, [&](int64_t task) {
    const int64_t b = task / k_blocks, j0 = (task % k_blocks) * kKeyBlock;
    const int64_t cols = std::min(kKeyBlock, nk - j0);
    detail::gemm(true, false, cols, dv, nq, T(1), pd.data() + b * nq * nk + j0, nk,
                 d_output.data() + b * nq * dv, dv, T(0),
                 grads.d_values.data() + (b * nk + j0) * dv, dv);
    for (int64_t j = j0; j < j0 + cols; ++j) {
      const T* fk_j = fk.data() + (b * nk + j) * hidden;
      T* dfk_j = dfk.data() + (b * nk + j) * hidden;
      for (int64_t i = 0; i < nq; ++i) {
        const T g = ds.data()[(b * nq + i) * nk + j];
        if (g == T(0)) continue;
        vecmath::additive_score_grad(fk_j, fq.data() + (b * nq + i) * hidden, wv, hidden, g, dfk_j,
                                     nullptr);
      }
    }
  });

  // Back through the projections: dQ = d(fq) W_q, dW_q = d(fq)^T Q, and the same for K.
  grads.d_queries = Tensor<T>(q.shape());
  grads.d_keys = Tensor<T>(k.shape());
  grads.d_w_q = Tensor<T>(Shape{hidden, dq});
  grads.d_w_k = Tensor<T>(Shape{hidden, dk});
  detail::parallel_gemm(false, false, batch * nq, dq, hidden, T(1), dfq.data(), hidden,
                        params.w_q.data(), dq, T(0), grads.d_queries.data(), dq);
  detail::parallel_gemm(false, false, batch * nk, dk, hidden, T(1), dfk.data(), hidden,
                        params.w_k.data(), dk, T(0), grads.d_keys.data(), dk);
  detail::parallel_gemm(true, false, hidden, dq, batch * nq, T(1), dfq.data(), hidden, q.data(), dq,
                        T(0), grads.d_w_q.data(), dq);
  // dW_k = sum_b dFk_b^T K_b over the keys some query of b may see: keys past
  // every valid length are never read, not even to be multiplied by zero.
  detail::parallel_for(ceil_div(hidden, detail::kGemmRowBlock), [&](int64_t blk) {
    const int64_t h0 = blk * detail::kGemmRowBlock;
    const int64_t rows = std::min(detail::kGemmRowBlock, hidden - h0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t seen = longest_len(*config.valid_lens, b, 0, nq, nk);
      detail::gemm(true, false, rows, dk, seen, T(1), dfk.data() + b * nk * hidden + h0, hidden,
                   k.data() + b * nk * dk, dk, b == 0 ? T(0) : T(1), grads.d_w_k.data() + h0 * dk,
                   dk);
    }
  });
  grads.d_w_v = Tensor<T>(Shape{hidden});
  for (int64_t t = 0; t < dwv_parts.size(0); ++t) {
    for (int64_t h = 0; h < hidden; ++h) grads.d_w_v(h) += dwv_parts(t, h);
  }
}

#define QKV_INSTANTIATE(T)                                                                        \
  template void dot_product_attention<T>(ConstView<T>, ConstView<T>, ConstView<T>,                \
                                         const AttentionConfig&, TensorView<T>, TensorView<T>,    \
                                         TensorView<T>);                                          \
  template void dot_product_attention_backward<T>(                                                \
      ConstView<T>, ConstView<T>, ConstView<T>, const AttentionConfig&, ConstView<T>,             \
      ConstView<T>, ConstView<T>, DotProductGrads<T>&);                                           \
  template void additive_attention<T>(ConstView<T>, ConstView<T>, ConstView<T>,                   \
                                      const AdditiveParams<T>&, const AttentionConfig&,           \
                                      TensorView<T>, TensorView<T>, TensorView<T>);               \
  template void additive_attention_backward<T>(                                                   \
      ConstView<T>, ConstView<T>, ConstView<T>, const AdditiveParams<T>&, const AttentionConfig&, \
      ConstView<T>, ConstView<T>, ConstView<T>, AdditiveGrads<T>&);
QKV_INSTANTIATE(float)
QKV_INSTANTIATE(double)
#undef QKV_INSTANTIATE

}  // namespace qkv::kernels::fast
