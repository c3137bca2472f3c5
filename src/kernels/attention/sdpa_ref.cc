// Scaled dot-product attention, reference version: every score, weight and
// gradient formed explicitly in double with plain loops, any strides. Slow
// and obviously right; the fast kernel (sdpa_fast.cc) is tested against it.
// Heads are a batch: query head bh = b H + h attends over key head
// b Hkv + h / (H / Hkv), as 3-D attention over B H batch elements with each
// key head repeated for its H / Hkv query heads.
#include <cmath>
#include <limits>

#include "kernels/attention/attend_ref.h"
#include "kernels/kernels.h"

namespace qkv::kernels::ref {
namespace {

// The key head query head bh reads, as (b, hk).
struct KeyHead {
  int64_t b, h;
};
template <class T>
KeyHead key_head(ConstView<T> q, ConstView<T> k, int64_t bh) {
  const int64_t heads = q.size(1), group = heads / k.size(1);
  return {bh / heads, (bh % heads) / group};
}

// scores (B H, Nq, Nk) = cap(scale q kᵀ) + bias + alibi per head; -inf where
// the window or a mask leaves the key out (AttentionConfig). cap(x) =
// softcap tanh(x / softcap) with a softcap, else x; cap_grad, when given,
// gets d cap / dx = 1 - tanh² of each score (1 without a softcap).
template <class T>
Matrix dot_product_scores(ConstView<T> q, ConstView<T> k, const AttentionConfig& config,
                          Matrix* cap_grad = nullptr) {
  const double scale = config.scale, softcap = config.softcap;
  const int64_t heads = q.size(0) * q.size(1), nq = q.size(2), nk = k.size(2), d = q.size(3);
  Matrix scores(heads * nq * nk);
  if (cap_grad) cap_grad->assign(heads * nq * nk, 1.0);
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / q.size(1), h = bh % q.size(1);
    const KeyHead kh = key_head(q, k, bh);
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t e = (bh * nq + i) * nk + j;
        double s = 0.0;
        for (int64_t c = 0; c < d; ++c)
          s += static_cast<double>(q(b, h, i, c)) * k(kh.b, kh.h, j, c);
        s *= scale;
        if (softcap > 0.0) {
          const double t = std::tanh(s / softcap);
          s = softcap * t;
          if (cap_grad) (*cap_grad)[e] = 1.0 - t * t;
        }
        const bool seen = j >= config.window_begin(i, nq, nk) && j < config.window_end(i, nq, nk) &&
                          config.mask_keeps(bh, i, j);
        scores[e] = seen ? s + config.bias_at(bh, i, j) + config.alibi_at(bh, i, j, nq, nk)
                         : -std::numeric_limits<double>::infinity();
      }
    }
  }
  return scores;
}

// The values of every query head's key head as one (B H, Nk, Dv) array.
template <class Out, class T>
std::vector<Out> values_per_query_head(ConstView<T> q, ConstView<T> k, ConstView<T> v) {
  const int64_t heads = q.size(0) * q.size(1), nk = v.size(2), dv = v.size(3);
  std::vector<Out> out(heads * nk * dv);
  for (int64_t bh = 0; bh < heads; ++bh) {
    const KeyHead kh = key_head(q, k, bh);
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t c = 0; c < dv; ++c) out[(bh * nk + j) * dv + c] = v(kh.b, kh.h, j, c);
    }
  }
  return out;
}

// A contiguous (B, H, N, D) buffer as (B H, N, D).
template <class T>
TensorView<T> flat_heads(T* data, int64_t heads, int64_t n, int64_t d) {
  return TensorView<T>(data, Shape{heads, n, d});
}

// x (B, H, N, D) of any strides -> (B H, N, D) contiguous, and back.
template <class T>
std::vector<double> gather(ConstView<T> x) {
  std::vector<double> out(x.numel());
  int64_t e = 0;
  for (int64_t b = 0; b < x.size(0); ++b)
    for (int64_t h = 0; h < x.size(1); ++h)
      for (int64_t n = 0; n < x.size(2); ++n)
        for (int64_t c = 0; c < x.size(3); ++c) out[e++] = x(b, h, n, c);
  return out;
}
template <class T>
void scatter(const Matrix& m, TensorView<T> x) {
  int64_t e = 0;
  for (int64_t b = 0; b < x.size(0); ++b)
    for (int64_t h = 0; h < x.size(1); ++h)
      for (int64_t n = 0; n < x.size(2); ++n)
        for (int64_t c = 0; c < x.size(3); ++c) x(b, h, n, c) = static_cast<T>(m[e++]);
}

}  // namespace

// q: (B, H, Nq, D)   k: (B, Hkv, Nk, D)   v: (B, Hkv, Nk, Dv)  ->  out (B, H, Nq, Dv),
// weights (B, H, Nq, Nk) and lse (B, H, Nq) (contiguous) when they have data.
template <class T>
void sdpa(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
          const ForwardViews<T>& out) {
  const int64_t heads = q.size(0) * q.size(1), nq = q.size(2), nk = k.size(2), dv = v.size(3);
  const std::vector<T> values = values_per_query_head<T>(q, k, v);
  std::vector<T> output(heads * nq * dv);
  const ForwardViews<T> flat{
      flat_heads(output.data(), heads, nq, dv),
      out.weights.data() ? flat_heads(out.weights.data(), heads, nq, nk) : TensorView<T>(),
      out.lse.data() ? TensorView<T>(out.lse.data(), Shape{heads, nq}) : TensorView<T>()};
  attend(dot_product_scores(q, k, config), heads, nq, nk,
         ConstView<T>(flat_heads(values.data(), heads, nk, dv)), config, flat);
  scatter(Matrix(output.begin(), output.end()), out.output);
  // The weights are exp(score - lse), in double: the pair (lse, 1), or
  // (-inf, 0) for a row with no key (kernels.h).
  if (T* stats = out.softmax_stats.data()) {
    for (int64_t r = 0; r < heads * nq; ++r) {
      const T row_lse = out.lse.data()[r];
      stats[2 * r] = row_lse;
      stats[2 * r + 1] = row_lse == -std::numeric_limits<T>::infinity() ? T(0) : T(1);
    }
  }
}

// Gradients dQ (B, H, Nq, D), dK (B, Hkv, Nk, D) and dV (B, Hkv, Nk, Dv),
// the key heads' summed over the query heads that read them; saved is not read.
template <class T>
void sdpa_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
                   const SavedViews<T>& saved, ConstView<T> d_output,
                   const SdpaGradViews<T>& grads) {
  const int64_t heads = q.size(0) * q.size(1), nq = q.size(2), nk = k.size(2);
  const int64_t d = q.size(3), dv = v.size(3);
  // In double throughout, so the sums over query heads round once.
  const std::vector<double> values = values_per_query_head<double>(q, k, v);
  const std::vector<double> d_out = gather(d_output);
  std::vector<double> d_lse;  // (B H Nq), row-major over the lse's own shape
  if (saved.d_lse.data() != nullptr) {
    const ConstView<T>& g = saved.d_lse;
    for (int64_t e = 0; e < heads * nq; ++e) {
      int64_t rest = e, offset = 0;
      for (int axis = g.rank() - 1; axis >= 0; --axis) {
        offset += (rest % g.size(axis)) * g.stride(axis);
        rest /= g.size(axis);
      }
      d_lse.push_back(static_cast<double>(g.data()[offset]));
    }
  }
  std::vector<double> dv_per_head(heads * nk * dv);
  Matrix cap_grad;  // d score / d (scale q.k): the softcap's 1 - tanh²
  const Matrix ds = attend_backward(
      dot_product_scores(q, k, config, &cap_grad), heads, nq, nk,
      ConstView<double>(flat_heads(values.data(), heads, nk, dv)), config,
      ConstView<double>(flat_heads(d_out.data(), heads, nq, dv)),
      flat_heads(dv_per_head.data(), heads, nk, dv), d_lse.empty() ? nullptr : d_lse.data());
  // Key heads in (B, Hkv, Nk, ·) order, summed over their query heads.
  const int64_t kv_heads = k.size(0) * k.size(1);
  Matrix dq(heads * nq * d, 0.0), dk(kv_heads * nk * d, 0.0), dvs(kv_heads * nk * dv, 0.0);
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / q.size(1), h = bh % q.size(1);
    const KeyHead kh = key_head(q, k, bh);
    const int64_t bkv = kh.b * k.size(1) + kh.h;
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t e = (bh * nq + i) * nk + j;
        const double g = ds[e] * cap_grad[e] * config.scale;
        if (g == 0.0) continue;
        for (int64_t c = 0; c < d; ++c) {
          dq[(bh * nq + i) * d + c] += g * static_cast<double>(k(kh.b, kh.h, j, c));
          dk[(bkv * nk + j) * d + c] += g * static_cast<double>(q(b, h, i, c));
        }
      }
    }
    for (int64_t e = 0; e < nk * dv; ++e) {
      dvs[bkv * nk * dv + e] += dv_per_head[bh * nk * dv + e];
    }
  }
  scatter(dq, grads.d_queries);
  scatter(dk, grads.d_keys);
  scatter(dvs, grads.d_values);
  if (grads.d_bias.data() != nullptr) {
    // d bias = dS, summed in double over the axes the bias broadcasts along.
    const TensorView<T>& db = grads.d_bias;
    Matrix sums(bias_grad_extent(db), 0.0);
    for (int64_t bh = 0; bh < heads; ++bh) {
      const int64_t b = bh / q.size(1), h = bh % q.size(1);
      for (int64_t i = 0; i < nq; ++i) {
        for (int64_t j = 0; j < nk; ++j) {
          sums[b * db.stride(0) + h * db.stride(1) + i * db.stride(2) + j * db.stride(3)] +=
              ds[(bh * nq + i) * nk + j];
        }
      }
    }
    for (size_t e = 0; e < sums.size(); ++e) db.data()[e] = static_cast<T>(sums[e]);
  }
}

template void sdpa<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                          const AttentionConfig&, const ForwardViews<float>&);
template void sdpa<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                           const AttentionConfig&, const ForwardViews<double>&);
template void sdpa_backward<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                   const AttentionConfig&, const SavedViews<float>&,
                                   ConstView<float>, const SdpaGradViews<float>&);
template void sdpa_backward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                    const AttentionConfig&, const SavedViews<double>&,
                                    ConstView<double>, const SdpaGradViews<double>&);

}  // namespace qkv::kernels::ref
