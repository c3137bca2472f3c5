// Fused attention for small feature sizes (small_dim_attention.h), fast
// version only: its references are ref::sdpa and, for the
// Gaussian scores, ref::nadaraya_watson (tests hold it to a float64 plain
// loop). Compiled once per SIMD target through hwy/foreach_target.h; the
// HWY_ONCE part at the bottom prepares the keys, cuts the work into tasks
// and dispatches.
//
// Per task: blocks of kR queries of one batch element. Keys and values are
// stored feature-major (D, Nk) and (Dv, Nk), so one vector holds one feature
// of Lanes() consecutive keys, and each key load serves all kR queries. Two
// passes over the keys per block, the scores formed in registers both times:
//   pass 1: the row max m of the valid scores (kNegSq: the min distance);
//   pass 2: e = exp(score - m), sum e, and sum e * v for each value column.
// At D = 1 the exp is ~3/4 of the instructions, so the kernel runs at the
// rate of its exp (kernels/simd/exp-inl.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/small_dim_attention.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/highway.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/attention/attention_common.h"
#include "kernels/simd/exp-inl.h"
#include "kernels/runtime/parallel.h"
#include "kernels/attention/small_dim_attention.h"
#include "kernels/runtime/workspace.h"

#ifndef QKV_SMALL_DIM_SHARED_
#define QKV_SMALL_DIM_SHARED_
namespace qkv::kernels::fast {

// Everything a block of queries needs, prepared once per call (target
// independent). Keys, values and biases are padded with zeros to nk_pad, a
// multiple of every target's vector length, so a vector load never leaves
// the buffers; padded and masked lanes are excluded by masks, never by
// multiplying with 0 (a NaN there must not reach a valid query).
template <class T>
struct SmallDimProblem {
  int64_t batch = 0, nq = 0, nk = 0, nk_pad = 0, d = 0, dv = 0;
  const T* q = nullptr;     // (B, Nq, D), the caller's
  const T* kt = nullptr;    // (B, D, nk_pad)
  const T* vt = nullptr;    // (B, Dv, nk_pad)
  const T* bias = nullptr;  // (B, nk_pad) or null
  ScoreKind kind = ScoreKind::kDotProduct;
  T scale = 0;
  const ValidLens* lens = nullptr;
  T* out = nullptr;        // (B, Nq, Dv)
  T* lse = nullptr;        // (B, Nq) or null
  int64_t block_rows = 1;  // kR of the kernel chosen for dv
};

// Keys are padded to a multiple of this many bytes, the longest vector of
// any target compiled in (checked per target below); also the alignment.
constexpr int64_t kSmallDimPadBytes = 64;

// Queries per register block for value_dim dv: each query keeps 1 + dv
// accumulators in registers, so kR (1 + dv) stays at or below ~16 of
// AVX-512's 32 vector registers, leaving the rest to the exp in flight.
constexpr int64_t small_dim_block_rows(int64_t dv) { return dv <= 3 ? 4 : 2; }

}  // namespace qkv::kernels::fast
#endif  // QKV_SMALL_DIM_SHARED_

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

static_assert(HWY_MAX_BYTES <= kSmallDimPadBytes, "vectors longer than the key padding");

using ::qkv::kernels::fast::HWY_NAMESPACE::ExpNaNCostsABlend;
using ::qkv::kernels::fast::HWY_NAMESPACE::ExpNonPositive;

// The kR-query block kernel. kKind: the score function; kDv the number of
// value columns.
enum KindId { kDot = 0, kDotBias = 1, kNegSq = 2 };

// raw[r] for keys [j, j + Lanes) and query r of the block: the score for the
// dot products (qs already times scale), the squared distance |q - k|^2 for
// kNegSq (score = -scale * raw; pass 2 folds -scale into one FMA with the
// max). qs holds the block's kR queries, dim values each.
template <class D, int kKind, int kR>
HWY_INLINE void RawScores(D d, const hn::TFromD<D>* HWY_RESTRICT kt, int64_t nk_pad, int64_t dim,
                          const hn::TFromD<D>* HWY_RESTRICT qs,
                          const hn::TFromD<D>* HWY_RESTRICT bias, int64_t j, hn::Vec<D>* raw) {
  using V = hn::Vec<D>;
  const V k0 = hn::Load(d, kt + j);
  if constexpr (kKind == kNegSq) {
    for (int r = 0; r < kR; ++r) {
      const V diff = hn::Sub(hn::Set(d, qs[r * dim]), k0);
      raw[r] = hn::Mul(diff, diff);
    }
    for (int64_t c = 1; c < dim; ++c) {
      const V kc = hn::Load(d, kt + c * nk_pad + j);
      for (int r = 0; r < kR; ++r) {
        const V diff = hn::Sub(hn::Set(d, qs[r * dim + c]), kc);
        raw[r] = hn::MulAdd(diff, diff, raw[r]);
      }
    }
  } else {
    if constexpr (kKind == kDotBias) {
      const V b = hn::Load(d, bias + j);
      for (int r = 0; r < kR; ++r) raw[r] = hn::MulAdd(hn::Set(d, qs[r * dim]), k0, b);
    } else {
      for (int r = 0; r < kR; ++r) raw[r] = hn::Mul(hn::Set(d, qs[r * dim]), k0);
    }
    for (int64_t c = 1; c < dim; ++c) {
      const V kc = hn::Load(d, kt + c * nk_pad + j);
      for (int r = 0; r < kR; ++r) raw[r] = hn::MulAdd(hn::Set(d, qs[r * dim + c]), kc, raw[r]);
    }
  }
}

// The score from RawScores (for HasNan; the passes fold it into their ops).
template <int kKind, class D>
HWY_INLINE hn::Vec<D> Score(D d, hn::Vec<D> raw, hn::TFromD<D> neg_scale) {
  if constexpr (kKind == kNegSq) return hn::Mul(raw, hn::Set(d, neg_scale));
  return raw;
}

// Lanes of keys [j, j + Lanes) below len.
template <class D>
HWY_INLINE hn::Mask<D> ValidLanes(D d, int64_t len, int64_t j) {
  const int64_t n = std::clamp<int64_t>(len - j, 0, static_cast<int64_t>(hn::Lanes(d)));
  return hn::FirstN(d, static_cast<size_t>(n));
}

// True if a valid score of query r of the block (queries qs) is NaN: the
// same score arithmetic as the block. Run only for rows whose max is -inf,
// where the max cannot tell "all -inf" from "NaN among -inf".
template <class D, int kKind, int kR>
bool HasNan(D d, const SmallDimProblem<hn::TFromD<D>>& pr, const hn::TFromD<D>* kt,
            const hn::TFromD<D>* bias, const hn::TFromD<D>* qs, int r, int64_t len) {
  using V = hn::Vec<D>;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  V raw[kR];
  for (int64_t j = 0; j < len; j += lanes) {
    RawScores<D, kKind, kR>(d, kt, pr.nk_pad, pr.d, qs, bias, j, raw);
    const V s = Score<kKind>(d, raw[r], -pr.scale);
    if (!hn::AllFalse(d, hn::And(ValidLanes(d, len, j), hn::IsNaN(s)))) return true;
  }
  return false;
}

template <class T, int kKind, int kDv, int kR>
void RunBlock(const SmallDimProblem<T>& pr, int64_t b, int64_t i0) {
  const hn::ScalableTag<T> d;
  using V = hn::Vec<decltype(d)>;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dim = pr.d, nk_pad = pr.nk_pad;
  const T* kt = pr.kt + b * dim * nk_pad;
  const T* vt = pr.vt + b * kDv * nk_pad;
  const T* bias = pr.bias ? pr.bias + b * nk_pad : nullptr;
  const T neg_scale = -pr.scale;
  const T inf = std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const int rows = static_cast<int>(std::min<int64_t>(kR, pr.nq - i0));

  // The block's queries (the last one repeated to fill a short block),
  // times scale for the dot product, and their valid lengths.
  T qs[kR * kSmallDimMaxDim];
  int64_t len[kR];
  for (int r = 0; r < kR; ++r) {
    const int64_t i = i0 + std::min(r, rows - 1);
    const T* qi = pr.q + (b * pr.nq + i) * dim;
    for (int64_t c = 0; c < dim; ++c) qs[r * dim + c] = kKind == kNegSq ? qi[c] : qi[c] * pr.scale;
    len[r] = (*pr.lens)(b, i, pr.nk);
  }
  int64_t len_min = len[0], len_max = len[0];
  for (int r = 1; r < kR; ++r) {
    len_min = std::min(len_min, len[r]);
    len_max = std::max(len_max, len[r]);
  }
  // Key vectors [0, full_end) are valid for every query of the block;
  // [full_end, end) for some, and there each query masks its own.
  const int64_t full_end = len_min / lanes * lanes;
  const int64_t end = ceil_div(len_max, lanes) * lanes;

  // ---- pass 1: the row max over the valid scores ----
  // For kNegSq the min of the squared distances instead (scale > 0): pass 2
  // then forms s - m as scale (min - raw), the difference before the scaling,
  // exactly 0 at the nearest key (its weight exactly 1, as the reference's)
  // and without the rounding of large scores of far queries.
  // kNegSq also looks for NaN distances here (the max cannot show them: Min
  // drops a NaN operand), so that pass 2's exp can skip its NaN blend where
  // that costs instructions: 6 % of the kernel at D = 1 on AVX2, where this
  // search costs 2 %; not at AVX-512 (Exp512 keeps NaN for free, and the
  // search cost 5 % there).
  constexpr bool kNanInPass1 = kKind == kNegSq && ExpNaNCostsABlend(d);
  V raw[kR], vext[kR];
  hn::Mask<decltype(d)> nan_seen[kR];
  const T ext_init = kKind == kNegSq ? inf : -inf;
  auto extreme = [&](V a, V b) {
    if constexpr (kKind == kNegSq) return hn::Min(a, b);
    return hn::Max(a, b);
  };
  for (int r = 0; r < kR; ++r) {
    vext[r] = hn::Set(d, ext_init);
    nan_seen[r] = hn::FirstN(d, 0);
  }
  int64_t j = 0;
  for (; j < full_end; j += lanes) {
    RawScores<decltype(d), kKind, kR>(d, kt, nk_pad, dim, qs, bias, j, raw);
    for (int r = 0; r < kR; ++r) {
      vext[r] = extreme(vext[r], raw[r]);
      if constexpr (kNanInPass1) nan_seen[r] = hn::Or(nan_seen[r], hn::IsNaN(raw[r]));
    }
  }
  for (; j < end; j += lanes) {
    RawScores<decltype(d), kKind, kR>(d, kt, nk_pad, dim, qs, bias, j, raw);
    for (int r = 0; r < kR; ++r) {
      const auto valid = ValidLanes(d, len[r], j);
      vext[r] = hn::IfThenElse(valid, extreme(vext[r], raw[r]), vext[r]);
      if constexpr (kNanInPass1)
        nan_seen[r] = hn::Or(nan_seen[r], hn::And(valid, hn::IsNaN(raw[r])));
    }
  }
  // DESIGN.md §3 per row. Max (Min) ignores or keeps a NaN depending on the
  // lane and operand order, but a NaN or +inf among the valid scores always
  // shows: m is NaN or +inf (-> NaN row), or m is -inf (HasNan decides
  // between the NaN row and the zero row with lse -inf of an all -inf or
  // empty row), or m is finite and exp(NaN) makes the pass-2 sum NaN (-> NaN
  // row; without a NaN, s - m <= 0 and the sum is finite and >= 1).
  // Finished rows still run through pass 2 with ext = 0, results discarded.
  T m[kR], ext[kR];
  bool finished[kR];
  T finished_value[kR], finished_lse[kR];
  for (int r = 0; r < kR; ++r) {
    if constexpr (kKind == kNegSq) {
      ext[r] = hn::GetLane(hn::MinOfLanes(d, vext[r]));
      m[r] = neg_scale * ext[r];
    } else {
      ext[r] = m[r] = hn::GetLane(hn::MaxOfLanes(d, vext[r]));
    }
    finished[r] = true;
    if (m[r] == inf || std::isnan(m[r]) || (kNanInPass1 && !hn::AllFalse(d, nan_seen[r]))) {
      finished_value[r] = finished_lse[r] = nan;
    } else if (m[r] == -inf) {
      const bool has_nan = HasNan<decltype(d), kKind, kR>(d, pr, kt, bias, qs, r, len[r]);
      finished_value[r] = has_nan ? nan : T(0);
      finished_lse[r] = has_nan ? nan : -inf;
    } else {
      finished[r] = false;
    }
    if (finished[r]) ext[r] = 0;
  }

  // ---- pass 2: e = exp(s - m), its sum and the weighted value sums ----
  V sum[kR], acc[kR][kDv], vx[kR];
  for (int r = 0; r < kR; ++r) {
    sum[r] = hn::Zero(d);
    for (int c = 0; c < kDv; ++c) acc[r][c] = hn::Zero(d);
    vx[r] = hn::Set(d, ext[r]);
  }
  const V vscale = hn::Set(d, pr.scale);
  // s - m, computed so that it is exactly 0 at the row's best key.
  auto shifted = [&](V raw_r, int r) {
    if constexpr (kKind == kNegSq) return hn::Mul(hn::Sub(vx[r], raw_r), vscale);
    return hn::Sub(raw_r, vx[r]);
  };
  j = 0;
  for (; j < full_end; j += lanes) {
    RawScores<decltype(d), kKind, kR>(d, kt, nk_pad, dim, qs, bias, j, raw);
    V v[kDv];
    for (int c = 0; c < kDv; ++c) v[c] = hn::Load(d, vt + c * nk_pad + j);
    for (int r = 0; r < kR; ++r) {
      const V e = ExpNonPositive<kNanInPass1>(d, shifted(raw[r], r));
      sum[r] = hn::Add(sum[r], e);
      for (int c = 0; c < kDv; ++c) acc[r][c] = hn::MulAdd(e, v[c], acc[r][c]);
    }
  }
  for (; j < end; j += lanes) {
    RawScores<decltype(d), kKind, kR>(d, kt, nk_pad, dim, qs, bias, j, raw);
    V v[kDv];
    for (int c = 0; c < kDv; ++c) v[c] = hn::Load(d, vt + c * nk_pad + j);
    for (int r = 0; r < kR; ++r) {
      const auto valid = ValidLanes(d, len[r], j);
      const V e = hn::IfThenElseZero(valid, ExpNonPositive<kNanInPass1>(d, shifted(raw[r], r)));
      sum[r] = hn::Add(sum[r], e);
      for (int c = 0; c < kDv; ++c) {
        acc[r][c] = hn::IfThenElse(valid, hn::MulAdd(e, v[c], acc[r][c]), acc[r][c]);
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    const int64_t row = b * pr.nq + i0 + r;
    T* o = pr.out + row * kDv;
    if (!finished[r]) {
      const T total = hn::GetLane(hn::SumOfLanes(d, sum[r]));
      if (!std::isnan(total)) {
        const T inv = T(1) / total;
        for (int c = 0; c < kDv; ++c) o[c] = hn::GetLane(hn::SumOfLanes(d, acc[r][c])) * inv;
        if (pr.lse) pr.lse[row] = m[r] + std::log(total);
        continue;
      }
      finished_value[r] = finished_lse[r] = nan;  // a NaN among the valid scores
    }
    for (int c = 0; c < kDv; ++c) o[c] = finished_value[r];
    if (pr.lse) pr.lse[row] = finished_lse[r];
  }
}

// Runs query blocks [first, first + count) (numbered across the batch).
template <class T, int kKind, int kDv>
void RunBlocksFor(const SmallDimProblem<T>& pr, int64_t first, int64_t count) {
  constexpr int kR = static_cast<int>(small_dim_block_rows(kDv));
  const int64_t blocks_per_batch = ceil_div(pr.nq, kR);
  for (int64_t blk = first; blk < first + count; ++blk) {
    const int64_t b = blk / blocks_per_batch, i0 = (blk % blocks_per_batch) * kR;
    RunBlock<T, kKind, kDv, kR>(pr, b, i0);
  }
}

template <class T, int kKind>
void RunBlocksKind(const SmallDimProblem<T>& pr, int64_t first, int64_t count) {
  switch (pr.dv) {
    case 1:
      return RunBlocksFor<T, kKind, 1>(pr, first, count);
    case 2:
      return RunBlocksFor<T, kKind, 2>(pr, first, count);
    case 3:
      return RunBlocksFor<T, kKind, 3>(pr, first, count);
    case 4:
      return RunBlocksFor<T, kKind, 4>(pr, first, count);
    case 5:
      return RunBlocksFor<T, kKind, 5>(pr, first, count);
    case 6:
      return RunBlocksFor<T, kKind, 6>(pr, first, count);
    case 7:
      return RunBlocksFor<T, kKind, 7>(pr, first, count);
    case 8:
      return RunBlocksFor<T, kKind, 8>(pr, first, count);
    default:
      assert(false);
  }
}

template <class T>
void RunBlocks(const SmallDimProblem<T>& pr, int64_t first, int64_t count) {
  if (pr.kind == ScoreKind::kNegSquaredDistance) {
    RunBlocksKind<T, kNegSq>(pr, first, count);
  } else if (pr.bias) {
    RunBlocksKind<T, kDotBias>(pr, first, count);
  } else {
    RunBlocksKind<T, kDot>(pr, first, count);
  }
}

// Non-template entry points, one per type, for HWY_EXPORT.
void RunBlocksF32(const SmallDimProblem<float>& pr, int64_t first, int64_t count) {
  RunBlocks(pr, first, count);
}
void RunBlocksF64(const SmallDimProblem<double>& pr, int64_t first, int64_t count) {
  RunBlocks(pr, first, count);
}
// The exp above on n elements (exp_non_positive).
template <class T>
void ExpRow(const T* x, T* out, int64_t n) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(ExpNonPositive(d, hn::LoadU(d, x + i)), d, out + i);
  if (i < n) {
    HWY_ALIGN T buf[hn::MaxLanes(d)];
    for (int64_t l = 0; l < lanes; ++l) buf[l] = i + l < n ? x[i + l] : T(0);
    hn::Store(ExpNonPositive(d, hn::Load(d, buf)), d, buf);
    for (int64_t l = 0; l < lanes && i + l < n; ++l) out[i + l] = buf[l];
  }
}
void ExpRowF32(const float* x, float* out, int64_t n) { ExpRow(x, out, n); }
void ExpRowF64(const double* x, double* out, int64_t n) { ExpRow(x, out, n); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels::fast {

HWY_EXPORT(RunBlocksF32);
HWY_EXPORT(RunBlocksF64);
HWY_EXPORT(ExpRowF32);
HWY_EXPORT(ExpRowF64);

namespace {

// Keys per feature row of the transposed copies: whole 64-byte vectors.
template <class T>
int64_t padded_keys(int64_t nk) {
  constexpr int64_t kPad = kSmallDimPadBytes / sizeof(T);
  return std::max<int64_t>(kPad, ceil_div(nk, kPad) * kPad);
}

void run_blocks(const SmallDimProblem<float>& pr, int64_t first, int64_t count) {
  HWY_DYNAMIC_DISPATCH(RunBlocksF32)(pr, first, count);
}
void run_blocks(const SmallDimProblem<double>& pr, int64_t first, int64_t count) {
  HWY_DYNAMIC_DISPATCH(RunBlocksF64)(pr, first, count);
}

// Query blocks per task: at least ~2^16 score evaluations per task (tens of
// microseconds), so scheduling does not dominate short key sequences.
// Depends on the shapes only (determinism).
int64_t blocks_per_task(int64_t block_rows, int64_t nk) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, block_rows * nk));
}

// Feature-major keys and values, zero padded, and the padded bias: B (D +
// Dv + 1) nk_pad elements, the size of the inputs; no (Nq, Nk) buffer.
template <class T>
struct SmallDimScratch {
  T *kt, *vt, *bias;
};

template <class T>
SmallDimScratch<T> small_dim_scratch(Slicer& slicer, int64_t batch, int64_t nk, int64_t dim,
                                     int64_t dv, bool key_bias) {
  const int64_t nk_pad = padded_keys<T>(nk);
  SmallDimScratch<T> sc;
  sc.kt = slicer.take<T>(batch * dim * nk_pad);
  sc.vt = slicer.take<T>(batch * dv * nk_pad);
  sc.bias = key_bias ? slicer.take<T>(batch * nk_pad) : nullptr;
  return sc;
}

}  // namespace

void exp_non_positive(const float* x, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ExpRowF32)(x, out, n);
}
void exp_non_positive(const double* x, double* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ExpRowF64)(x, out, n);
}

bool small_dim_applies(int64_t d, int64_t dv, const AttentionConfig& config) {
  return d >= 1 && d <= kSmallDimMaxDim && dv >= 1 && dv <= kSmallDimMaxValueDim &&
         config.dropout == 0.0;
}

template <class T>
size_t small_dim_workspace_size(int64_t batch, int64_t nk, int64_t dim, int64_t dv, bool key_bias) {
  return counted_words(
      [&](Slicer& count) { small_dim_scratch<T>(count, batch, nk, dim, dv, key_bias); });
}

template <class T>
void small_dim_forward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const T* key_bias,
                       ScoreKind kind, const AttentionConfig& config, TensorView<T> output,
                       TensorView<T> lse, Workspace workspace) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dim = q.size(2);
  const int64_t dv = v.size(2);
  assert(small_dim_applies(dim, dv, config));
  assert(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && output.is_contiguous());
  assert(k.size(2) == dim && v.size(1) == nk && output.size(2) == dv);
  assert(kind == ScoreKind::kDotProduct || key_bias == nullptr);
  // The Gaussian exponent: scale > 0 (pass 1 looks for the nearest key) and
  // finite (pass 2's exp skips its NaN blend: (min - raw) * scale is NaN
  // only for a NaN distance, which pass 1 finds).
  assert(kind == ScoreKind::kDotProduct || (config.scale > 0 && std::isfinite(config.scale)));
  if (batch == 0 || nq == 0) return;
  const int64_t nk_pad = padded_keys<T>(nk);
  Slicer slicer(workspace.data);
  const SmallDimScratch<T> sc =
      small_dim_scratch<T>(slicer, batch, nk, dim, dv, key_bias != nullptr);
  std::fill_n(sc.kt, batch * dim * nk_pad, T(0));
  std::fill_n(sc.vt, batch * dv * nk_pad, T(0));
  for (int64_t b = 0; b < batch; ++b) {
    const T* kb = k.data() + b * nk * dim;
    const T* vb = v.data() + b * nk * dv;
    T* ktb = sc.kt + b * dim * nk_pad;
    T* vtb = sc.vt + b * dv * nk_pad;
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t c = 0; c < dim; ++c) ktb[c * nk_pad + j] = kb[j * dim + c];
      for (int64_t c = 0; c < dv; ++c) vtb[c * nk_pad + j] = vb[j * dv + c];
    }
  }
  if (key_bias) {
    std::fill_n(sc.bias, batch * nk_pad, T(0));
    for (int64_t b = 0; b < batch; ++b) {
      std::copy(key_bias + b * nk, key_bias + (b + 1) * nk, sc.bias + b * nk_pad);
    }
  }
  SmallDimProblem<T> pr;
  pr.batch = batch;
  pr.nq = nq;
  pr.nk = nk;
  pr.nk_pad = nk_pad;
  pr.d = dim;
  pr.dv = dv;
  pr.q = q.data();
  pr.kt = sc.kt;
  pr.vt = sc.vt;
  pr.bias = sc.bias;
  pr.kind = kind;
  pr.scale = static_cast<T>(config.scale);
  pr.lens = &config.valid_lens;
  pr.out = output.data();
  pr.lse = lse.data();
  pr.block_rows = small_dim_block_rows(dv);

  const int64_t blocks = batch * ceil_div(nq, pr.block_rows);
  const int64_t per_task = blocks_per_task(pr.block_rows, nk);
  const int64_t tasks = ceil_div(blocks, per_task);
  qkv::kernels::parallel_for(tasks, [&](int64_t task) {
    const int64_t first = task * per_task;
    run_blocks(pr, first, std::min(per_task, blocks - first));
  });
}

template void small_dim_forward<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                       const float*, ScoreKind, const AttentionConfig&,
                                       TensorView<float>, TensorView<float>, Workspace);
template void small_dim_forward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                        const double*, ScoreKind, const AttentionConfig&,
                                        TensorView<double>, TensorView<double>, Workspace);
template size_t small_dim_workspace_size<float>(int64_t, int64_t, int64_t, int64_t, bool);
template size_t small_dim_workspace_size<double>(int64_t, int64_t, int64_t, int64_t, bool);

}  // namespace qkv::kernels::fast
#endif  // HWY_ONCE
