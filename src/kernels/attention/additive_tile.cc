// The fused additive attention tiles of additive_tile.h, and the float tanh
// they fall back on: Highway, compiled once per SIMD target through
// hwy/foreach_target.h; the HWY_ONCE part at the bottom dispatches.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/additive_tile.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>

#include "kernels/attention/additive_tile.h"
#include "kernels/simd/exp-inl.h"
#include "kernels/simd/tail-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using ::qkv::kernels::fast::HWY_NAMESPACE::LoadTail;
using ::qkv::kernels::fast::HWY_NAMESPACE::StoreTail;

// ---- tanh ---------------------------------------------------------------------

// tanh in float as x P(x^2) / Q(x^2), the [13/6] rational minimax fit Eigen
// uses (generic_fast_tanh_float): within 2.3e-7 of tanh on |x| <= 7.905 before
// rounding, 2.7e-7 relative in float with FMA (4.5 units in the last place
// near 1), 3.7e-7 without (SSE4, scalar: each Horner step rounds twice). Past |x| = 7.905 it is
// clamped, where tanh is 1 to 2.7e-7, and past 9 it is ±1 exactly (as float tanh rounds there). 19
// vector operations and one division, against about 40 for hn::Tanh (an
// expm1 and a division). The fused kernels use it only for tiles with
// features past ±20 (see below), so the exact division stays.
template <class D>
HWY_INLINE hn::Vec<D> TanhRational(D d, hn::Vec<D> x) {
  const auto limit = hn::Set(d, 7.90531110763549805f);
  // Past |x| = 9 tanh rounds to ±1 in float; the clamped fit would say 1 - 2.7e-7.
  const auto saturated = hn::Ge(hn::Abs(x), hn::Set(d, 9.0f));
  const auto sign_one = hn::CopySign(hn::Set(d, 1.0f), x);
  // Highway leaves Min/Max of NaN to the target (x86 returns the second
  // operand, the scalar target the other one, which would clamp NaN to a
  // number), so NaN is passed through explicitly.
  const auto nan = hn::IsNaN(x);
  const auto x_in = x;
  x = hn::Min(limit, hn::Max(hn::Neg(limit), x));
  const auto x2 = hn::Mul(x, x);
  auto p = hn::MulAdd(x2, hn::Set(d, -2.76076847742355e-16f), hn::Set(d, 2.00018790482477e-13f));
  p = hn::MulAdd(x2, p, hn::Set(d, -8.60467152213735e-11f));
  p = hn::MulAdd(x2, p, hn::Set(d, 5.12229709037114e-08f));
  p = hn::MulAdd(x2, p, hn::Set(d, 1.48572235717979e-05f));
  p = hn::MulAdd(x2, p, hn::Set(d, 6.37261928875436e-04f));
  p = hn::MulAdd(x2, p, hn::Set(d, 4.89352455891786e-03f));
  auto q = hn::MulAdd(x2, hn::Set(d, 1.19825839466702e-06f), hn::Set(d, 1.18534705686654e-04f));
  q = hn::MulAdd(x2, q, hn::Set(d, 2.26843463243900e-03f));
  q = hn::MulAdd(x2, q, hn::Set(d, 4.89352518554385e-03f));
  // x last: x P / Q is within a rounding of x for tiny x, subnormals included.
  return hn::IfThenElse(nan, x_in, hn::IfThenElse(saturated, sign_one, hn::Mul(x, hn::Div(p, q))));
}

// The tanh of the fused kernels: the rational one in float, Highway's
// accurate one in double.
template <class D>
HWY_INLINE hn::Vec<D> TanhOf(D d, hn::Vec<D> x) {
  if constexpr (sizeof(hn::TFromD<D>) == 4) {
    return TanhRational(d, x);
  } else {
    return hn::Tanh(d, x);
  }
}

template <class T>
void TanhRow(const T* x, T* out, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(TanhOf(d, hn::LoadU(d, x + i)), d, out + i);
  if (i < n) StoreTail(d, TanhOf(d, LoadTail(d, x + i, n - i, T(0))), out + i, n - i);
}

// ---- fused additive attention ---------------------------------------------------
//
// The kernels carry r = 1 / (1 + exp(2 x)) rather than t = tanh(x) = 1 - 2 r,
// because in float r comes cheaply from exp(2 x) = exp(2 fq) exp(2 fk): with
// both exponentials computed once per query and once per key, each (query,
// key, h) costs one FMA for 1 + exp(2 fq) exp(2 fk), a 14-bit reciprocal and
// one Newton step, 4 operations and a reciprocal instead of the 19 of the
// rational tanh (3x faster here). The error of t is absolute, at most about
// 2e-7 (exp's and the product's rounding at x near 0), not relative; sums
// over h of w_v t carry that much times sum |w_v| anyway from rounding.
// Products stay finite while |fq|, |fk| <= kExpRange (e^{4 * 20} < FLT_MAX);
// a tile with a feature outside that (or NaN) takes the tanh path. double
// always takes the tanh path (hn::Tanh, full accuracy).
// Score: sum_h wv t = sum_h wv - 2 sum_h wv r. Backward: 1 - t^2 = 4 r (1 - r),
// sum ds t = sum ds - 2 sum ds r.

constexpr float kExpRange = 20.0f;
// The scratch sizes (additive_tile.h) count on at most kAdditivePad lanes.
static_assert(HWY_MAX_BYTES / sizeof(float) <= kAdditivePad, "vectors longer than the key padding");

template <class T>
constexpr bool kExpProduct = sizeof(T) == 4;

// r for one vector of keys from the exponentials (the fast path).
template <class D>
HWY_INLINE hn::Vec<D> RFromExps(D d, hn::Vec<D> eq, hn::Vec<D> ek) {
  const auto one = hn::Set(d, hn::TFromD<D>(1));
  const auto den = hn::MulAdd(eq, ek, one);
  if constexpr (kExpProduct<hn::TFromD<D>>) {
    auto r = hn::ApproximateReciprocal(den);
    return hn::Mul(r, hn::NegMulAdd(den, r, hn::Set(d, hn::TFromD<D>(2))));
  } else {
    return hn::Div(one, den);  // not reached: double takes the tanh path
  }
}

// r from the features through tanh (the exact path).
template <class D>
HWY_INLINE hn::Vec<D> RFromTanh(D d, hn::Vec<D> x) {
  const auto half = hn::Set(d, hn::TFromD<D>(0.5));
  return hn::NegMulAdd(half, TanhOf(d, x), half);
}

// additive_key_exps (additive_tile.h) for one batch element: every key of
// the padded rows, ldk a multiple of kAdditivePad and so of the lane count.
void AdditiveKeyExpsF32(const float* fkt, int64_t hidden, int64_t ldk, float* ekt,
                        uint8_t* block_ok) {
  const hn::ScalableTag<float> d;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto range = hn::Set(d, kExpRange);
  std::fill(block_ok, block_ok + ldk / kAdditivePad, uint8_t{1});
  for (int64_t h = 0; h < hidden; ++h) {
    for (int64_t j = 0; j < ldk; j += lanes) {
      const auto x = hn::LoadU(d, fkt + h * ldk + j);
      // Not(a <= b) rather than a > b: NaN fails the test.
      if (!hn::AllTrue(d, hn::Le(hn::Abs(x), range))) block_ok[j / kAdditivePad] = 0;
      hn::StoreU(hn::Exp(d, hn::Add(x, x)), d, ekt + h * ldk + j);
    }
  }
}

// Per query of a group: exp(2 fq[r, h]) into eq[r * H + h]; returns whether
// every feature of the group is within kExpRange. Vectorised like the keys'
// (hn::Exp, so both factors of exp(2 fq) exp(2 fk) carry the same error):
// libm's scalar expf here was 2.8 % of the forward's samples at (4, 512,
// 512), h = 64, AVX-512, 2 threads.
template <class D, class T>
bool QueryExps(D d, const T* const* fq, int64_t rows, int64_t hidden, T* eq) {
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto range = hn::Set(d, T(kExpRange));
  bool ok = true;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t h = 0;
    // Not(a <= b) rather than a > b: NaN fails the test.
    for (; h + lanes <= hidden; h += lanes) {
      const auto x = hn::LoadU(d, fq[r] + h);
      ok = ok && hn::AllTrue(d, hn::Le(hn::Abs(x), range));
      hn::StoreU(hn::Exp(d, hn::Add(x, x)), d, eq + r * hidden + h);
    }
    if (h < hidden) {  // the pad lanes hold 0, in range
      const auto n = static_cast<size_t>(hidden - h);
      const auto x = LoadTail(d, fq[r] + h, n);
      ok = ok && hn::AllTrue(d, hn::Le(hn::Abs(x), range));
      StoreTail(d, hn::Exp(d, hn::Add(x, x)), eq + r * hidden + h, n);
    }
  }
  return ok;
}

// One vector of keys (from key j) scored by a group of R queries:
// acc[r] = sum_h wv[h] r(q_r, k, h), the score being sum wv - 2 acc. From the
// exponentials when the group's and the key block's features are in range,
// through tanh otherwise. The forward and the gradient tile share it; the
// gradient also keeps each r in r_buf[(r * H + h) * lanes] (kKeepR).
template <bool kKeepR, class D, class T, size_t R>
HWY_INLINE void ScoreKeyBlock(D d, const AdditiveFeatures<T>& f, const T* const* fq, const T* eq,
                              bool queries_ok, int64_t j, hn::Vec<D> (&acc)[R], T* r_buf) {
  using V = hn::Vec<D>;
  const int64_t hidden = f.hidden;
  // Where r of query r, feature h goes in r_buf (kKeepR).
  [[maybe_unused]] const auto r_at = [&](size_t r, int64_t h) {
    return r_buf + (static_cast<int64_t>(r) * hidden + h) * static_cast<int64_t>(hn::Lanes(d));
  };
  for (auto& a : acc) a = hn::Zero(d);
  if (queries_ok && f.block_ok[j / kAdditivePad]) {
    const T* ek = f.ekt + j;
    for (int64_t h = 0; h < hidden; ++h) {
      const V ek_h = hn::LoadU(d, ek + h * f.ldk);
      const V w = hn::Set(d, f.wv[h]);
#pragma GCC unroll 4
      for (size_t r = 0; r < R; ++r) {
        const V rv = RFromExps(d, hn::Set(d, eq[static_cast<int64_t>(r) * hidden + h]), ek_h);
        if constexpr (kKeepR) hn::Store(rv, d, r_at(r, h));
        acc[r] = hn::MulAdd(w, rv, acc[r]);
      }
    }
  } else {
    const T* fk = f.fkt + j;
    for (int64_t h = 0; h < hidden; ++h) {
      const V fk_h = hn::LoadU(d, fk + h * f.ldk);
      const V w = hn::Set(d, f.wv[h]);
#pragma GCC unroll 4
      for (size_t r = 0; r < R; ++r) {
        const V rv = RFromTanh(d, hn::Add(fk_h, hn::Set(d, fq[r][h])));
        if constexpr (kKeepR) hn::Store(rv, d, r_at(r, h));
        acc[r] = hn::MulAdd(w, rv, acc[r]);
      }
    }
  }
}

template <class T>
void AdditiveScores(const AdditiveFeatures<T>& f, int64_t rows, const int64_t* lens, T* s,
                    int64_t lds, double* scratch) {
  const hn::ScalableTag<T> d;
  using V = hn::Vec<decltype(d)>;
  constexpr int64_t R = kAdditiveRows;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t hidden = f.hidden;
  T wv_sum = 0;
  for (int64_t h = 0; h < hidden; ++h) wv_sum += f.wv[h];
  T* eq = nullptr;  // exp(2 fq) of a query group
  if constexpr (kExpProduct<T>) {
    assert(f.ekt != nullptr && f.block_ok != nullptr);
    eq = take_slice<T>(&scratch, R * hidden + 1);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    // A short last group repeats its last query; those scores are not stored.
    const T* fq[R];
    int64_t n_max = 0;
    for (int64_t r = 0; r < R; ++r) {
      fq[r] = f.fq + std::min(r0 + r, rows - 1) * f.ldq;
      if (r0 + r < rows) n_max = std::max(n_max, lens[r0 + r]);
    }
    bool queries_ok = false;
    if constexpr (kExpProduct<T>) queries_ok = QueryExps(d, fq, R, hidden, eq);
    for (int64_t j = 0; j < n_max; j += lanes) {
      V acc[R];  // sum_h wv r
      ScoreKeyBlock<false>(d, f, fq, eq, queries_ok, j, acc, static_cast<T*>(nullptr));
      for (int64_t r = 0; r < R && r0 + r < rows; ++r) {
        const int64_t len = lens[r0 + r];
        const V score = hn::NegMulAdd(hn::Set(d, T(2)), acc[r], hn::Set(d, wv_sum));
        T* dst = s + (r0 + r) * lds + j;
        if (j + lanes <= len) {
          hn::StoreU(score, d, dst);
        } else if (j < len) {
          StoreTail(d, score, dst, static_cast<size_t>(len - j));
        }
      }
    }
  }
}

template <class T>
void AdditiveGradTileImpl(const AdditiveFeatures<T>& f, const AdditiveGradTile<T>& tile,
                          double* scratch) {
  const hn::ScalableTag<T> d;
  using V = hn::Vec<decltype(d)>;
  constexpr int64_t R = kAdditiveRows;
  const auto lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t hidden = f.hidden;
  T wv_sum = 0;
  for (int64_t h = 0; h < hidden; ++h) wv_sum += f.wv[h];
  // Per thread, in L1 at H = 64 (float, 16 lanes): r for R queries (16 KiB),
  // their d_fq partial sums by lane (16 KiB) and d_wv's (4 KiB).
  const auto hl = static_cast<size_t>(hidden * lanes);
  T* r_buf = take_slice<T>(&scratch, static_cast<int64_t>((2 * R + 1) * hl + 1));
  T* dfq_acc = r_buf + R * hl;
  T* dwv_acc = dfq_acc + R * hl;  // sum ds r
  for (int64_t h = 0; h < hidden; ++h) hn::Store(hn::Zero(d), d, dwv_acc + h * lanes);
  V ds_total = hn::Zero(d);  // sum ds, for sum ds t = sum ds - 2 sum ds r
  T* eq = nullptr;           // exp(2 fq) of a query group
  if constexpr (kExpProduct<T>) {
    assert(f.ekt != nullptr && f.block_ok != nullptr);
    eq = take_slice<T>(&scratch, R * hidden + 1);
  }

  for (int64_t r0 = 0; r0 < tile.rows; r0 += R) {
    const T* fq[R];
    int64_t len[R];
    int64_t n_max = 0;
    for (int64_t r = 0; r < R; ++r) {
      fq[r] = f.fq + std::min(r0 + r, tile.rows - 1) * f.ldq;
      len[r] = r0 + r < tile.rows ? tile.lens[r0 + r] : 0;  // a repeated query adds nothing
      n_max = std::max(n_max, len[r]);
    }
    bool queries_ok = false;
    if constexpr (kExpProduct<T>) queries_ok = QueryExps(d, fq, R, hidden, eq);
    for (int64_t i = 0; i < R * hidden; ++i) hn::Store(hn::Zero(d), d, dfq_acc + i * lanes);

    for (int64_t j = 0; j < n_max; j += lanes) {
      // Scores, keeping r.
      V acc[R];
      ScoreKeyBlock<true>(d, f, fq, eq, queries_ok, j, acc, r_buf);
      // dS, and the dropped weights for dV.
      V ds[R];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t valid_n = std::clamp<int64_t>(len[r] - j, 0, lanes);
        const auto valid = hn::FirstN(d, static_cast<size_t>(valid_n));
        if (valid_n == 0) {
          ds[r] = hn::Zero(d);
        } else {
          const int64_t row = r0 + r;
          const V score = hn::NegMulAdd(hn::Set(d, T(2)), acc[r], hn::Set(d, wv_sum));
          const V p = hn::Exp(d, hn::Sub(score, hn::Set(d, tile.lse[row])));
          const V scale =
              tile.drop ? hn::LoadU(d, tile.drop + row * tile.ld + j) : hn::Set(d, T(1));
          const V dp = hn::Mul(hn::LoadU(d, tile.dp + row * tile.ld + j), scale);
          // Masked lanes may hold anything (even NaN): select, do not multiply by 0.
          ds[r] = hn::IfThenElseZero(valid, hn::Mul(p, hn::Sub(dp, hn::Set(d, tile.d_row[row]))));
          hn::StoreU(hn::IfThenElseZero(valid, hn::Mul(p, scale)), d,
                     tile.p_dropped + row * tile.ld + j);
          ds_total = hn::Add(ds_total, ds[r]);
        }
        if (valid_n < lanes) {
          // r of masked lanes to 0 too, so a NaN key seen by another query of
          // the tile cannot reach this one's sums through 0 * NaN.
          for (int64_t h = 0; h < hidden; ++h) {
            T* rp = r_buf + (r * hidden + h) * lanes;
            hn::Store(hn::IfThenElseZero(valid, hn::Load(d, rp)), d, rp);
          }
        }
      }
      // Back through tanh and w_v: u = ds wv (1 - t^2) = 4 ds wv r (1 - r).
      T* dfk = tile.d_fkt + j;
      for (int64_t h = 0; h < hidden; ++h) {
        const V w4 = hn::Set(d, 4 * f.wv[h]);
        V dfk_sum = hn::LoadU(d, dfk + h * f.ldk);
        V dwv = hn::Load(d, dwv_acc + h * lanes);
#pragma GCC unroll 4
        for (int64_t r = 0; r < R; ++r) {
          const V rv = hn::Load(d, r_buf + (r * hidden + h) * lanes);
          const V u = hn::Mul(hn::Mul(ds[r], w4), hn::NegMulAdd(rv, rv, rv));
          dfk_sum = hn::Add(dfk_sum, u);
          T* acc = dfq_acc + (r * hidden + h) * lanes;
          hn::Store(hn::Add(hn::Load(d, acc), u), d, acc);
          dwv = hn::MulAdd(ds[r], rv, dwv);
        }
        hn::StoreU(dfk_sum, d, dfk + h * f.ldk);
        hn::Store(dwv, d, dwv_acc + h * lanes);
      }
    }
    for (int64_t r = 0; r < R && r0 + r < tile.rows; ++r) {
      T* dfq = tile.d_fq + (r0 + r) * tile.ld_dfq;
      for (int64_t h = 0; h < hidden; ++h) {
        dfq[h] += hn::GetLane(hn::SumOfLanes(d, hn::Load(d, dfq_acc + (r * hidden + h) * lanes)));
      }
      // Weights of keys this query cannot see, up to the tile's width.
      T* p = tile.p_dropped + (r0 + r) * tile.ld;
      const int64_t written = (len[r] + lanes - 1) / lanes * lanes;
      for (int64_t j = written; j < tile.cols; ++j) p[j] = T(0);
    }
  }
  const T ds_sum = hn::GetLane(hn::SumOfLanes(d, ds_total));
  for (int64_t h = 0; h < hidden; ++h) {
    tile.d_wv[h] += ds_sum - 2 * hn::GetLane(hn::SumOfLanes(d, hn::Load(d, dwv_acc + h * lanes)));
  }
}

// Non-template entry points, one per type, for HWY_EXPORT.
void TanhRowF32(const float* x, float* o, int64_t n) { TanhRow(x, o, n); }
void TanhRowF64(const double* x, double* o, int64_t n) { TanhRow(x, o, n); }
void AdditiveScoresF32(const AdditiveFeatures<float>& f, int64_t rows, const int64_t* lens,
                       float* s, int64_t lds, double* scratch) {
  AdditiveScores(f, rows, lens, s, lds, scratch);
}
void AdditiveScoresF64(const AdditiveFeatures<double>& f, int64_t rows, const int64_t* lens,
                       double* s, int64_t lds, double* scratch) {
  AdditiveScores(f, rows, lens, s, lds, scratch);
}
void AdditiveGradTileF32(const AdditiveFeatures<float>& f, const AdditiveGradTile<float>& t,
                         double* scratch) {
  AdditiveGradTileImpl(f, t, scratch);
}
void AdditiveGradTileF64(const AdditiveFeatures<double>& f, const AdditiveGradTile<double>& t,
                         double* scratch) {
  AdditiveGradTileImpl(f, t, scratch);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels::fast {

HWY_EXPORT(TanhRowF32);
HWY_EXPORT(TanhRowF64);
HWY_EXPORT(AdditiveScoresF32);
HWY_EXPORT(AdditiveScoresF64);
HWY_EXPORT(AdditiveGradTileF32);
HWY_EXPORT(AdditiveGradTileF64);
HWY_EXPORT(AdditiveKeyExpsF32);

void tanh_row(const float* x, float* o, int64_t n) { HWY_DYNAMIC_DISPATCH(TanhRowF32)(x, o, n); }
void tanh_row(const double* x, double* o, int64_t n) { HWY_DYNAMIC_DISPATCH(TanhRowF64)(x, o, n); }
void additive_scores(const AdditiveFeatures<float>& f, int64_t rows, const int64_t* lens, float* s,
                     int64_t lds, double* scratch) {
  HWY_DYNAMIC_DISPATCH(AdditiveScoresF32)(f, rows, lens, s, lds, scratch);
}
void additive_scores(const AdditiveFeatures<double>& f, int64_t rows, const int64_t* lens,
                     double* s, int64_t lds, double* scratch) {
  HWY_DYNAMIC_DISPATCH(AdditiveScoresF64)(f, rows, lens, s, lds, scratch);
}
void additive_key_exps(const float* fkt, int64_t hidden, int64_t ldk, float* ekt,
                       uint8_t* block_ok) {
  HWY_DYNAMIC_DISPATCH(AdditiveKeyExpsF32)(fkt, hidden, ldk, ekt, block_ok);
}
void additive_grad_tile(const AdditiveFeatures<float>& f, const AdditiveGradTile<float>& t,
                        double* scratch) {
  HWY_DYNAMIC_DISPATCH(AdditiveGradTileF32)(f, t, scratch);
}
void additive_grad_tile(const AdditiveFeatures<double>& f, const AdditiveGradTile<double>& t,
                        double* scratch) {
  HWY_DYNAMIC_DISPATCH(AdditiveGradTileF64)(f, t, scratch);
}

}  // namespace qkv::kernels::fast
#endif  // HWY_ONCE
