// Fused attention for small feature sizes (small_dim_attention.h), fast
// version only: its references are ref::dot_product_attention and, for the
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
// rate of its exp: on AVX-512 a 16-entry table plus a degree-6 polynomial
// and vscalefpd (15 instructions per vector of doubles; hn::Exp takes ~30),
// elsewhere Highway's polynomial with the exponent added as an integer.
// Measured at n = t = 30000, D = Dv = 1, float64, one thread (CPU time,
// bench/bench_nw_exact.cc): 0.44 s with the table (2.0 G scores/s), 0.62 s
// with the generic form, 0.90 s with hn::Exp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/small_dim_attention.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/highway.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>

#include "kernels/attention_common.h"
#include "kernels/small_dim_attention.h"
#include "parallel.h"

#ifndef QKV_SMALL_DIM_SHARED_
#define QKV_SMALL_DIM_SHARED_
namespace qkv::kernels::small_dim::impl {

// Everything a block of queries needs, prepared once per call (target
// independent). Keys, values and biases are padded with zeros to nk_pad, a
// multiple of every target's vector length, so a vector load never leaves
// the buffers; padded and masked lanes are excluded by masks, never by
// multiplying with 0 (a NaN there must not reach a valid query).
template <class T>
struct Problem {
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
constexpr int64_t kPadBytes = 64;

// Queries per register block for value_dim dv: each query keeps 1 + dv
// accumulators in registers, so kR (1 + dv) stays at or below ~16 of
// AVX-512's 32 vector registers, leaving the rest to the exp in flight.
constexpr int64_t block_rows_for(int64_t dv) { return dv <= 3 ? 4 : 2; }

}  // namespace qkv::kernels::small_dim::impl
#endif  // QKV_SMALL_DIM_SHARED_

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::small_dim {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using impl::Problem;
static_assert(HWY_MAX_BYTES <= impl::kPadBytes, "vectors longer than the key padding");

// Constants of ExpNonPositive per type.
template <class T>
struct ExpConstants;

template <>
struct ExpConstants<double> {
  // Below this the result would be subnormal (2^k with k < -1021 times a
  // polynomial value >= 1/sqrt 2): the weight is taken as exactly 0. The
  // weights are relative to the row's best key (weight 1), so a dropped
  // weight is below 1e-307 of the sum.
  static constexpr double kMinArg = -708.0;
  static constexpr double kShifter = 0x1.8p52;  // adding it rounds to an integer in the low bits
  static constexpr int kMantissaBits = 52;
  static constexpr double kLn2Hi = 0.6931471805596629565116018;  // Highway's split of ln 2
  static constexpr double kLn2Lo = 0.28235290563031577122588448175e-12;
  // e^r = 1 + r + r^2 (c0 + c1 r + ... + c10 r^10) on |r| <= ln(2)/2:
  // Highway's coefficients (hwy/contrib/math ExpImpl<double>), here in Horner form.
  static constexpr double kPoly[] = {+0.5,
                                     +0.166666666666666851703837,
                                     +0.0416666666666665047591422,
                                     +0.00833333333331652721664984,
                                     +0.00138888888889774492207962,
                                     +0.000198412698960509205564975,
                                     +2.4801587159235472998791e-5,
                                     +2.75572362911928827629423e-6,
                                     +2.75573911234900471893338e-7,
                                     +2.51112930892876518610661e-8,
                                     +2.08860621107283687536341e-9};
};

template <>
struct ExpConstants<float> {
  static constexpr float kMinArg = -86.5f;  // k >= -125: the result stays normal
  static constexpr float kShifter = 0x1.8p23f;
  static constexpr int kMantissaBits = 23;
  static constexpr float kLn2Hi = 0.693145751953125f;  // Highway's split of ln 2
  static constexpr float kLn2Lo = 1.428606765330187045e-6f;
  static constexpr float kPoly[] = {+0.5f,
                                    +0.166666671633720397949219f,
                                    +0.0416664853692054748535156f,
                                    +0.00833336077630519866943359f,
                                    +0.00139304355252534151077271f,
                                    +0.000198527617612853646278381f};
};

// exp(x) for x <= ~0 (a score minus the row max). x below kMinArg
// (incl. -inf) gives exactly 0; NaN gives NaN (the caller detects NaN scores
// through the row's sum). Range reduction x = k ln2 + r with k = round(x /
// ln2) from the shifter trick (k sits in the low mantissa bits of t), e^r by
// the polynomial, then 2^k enters as k added to the exponent field: one
// integer add instead of Highway's two multiplies by constructed powers of
// two (those cover the subnormal range, which we do not need).
template <class D, class V = hn::Vec<D>>
HWY_INLINE V ExpNonPositiveGeneric(D d, V x) {
  using T = hn::TFromD<D>;
  using C = ExpConstants<T>;
  const hn::RebindToSigned<D> di;
  const auto tiny = hn::Lt(x, hn::Set(d, C::kMinArg));
  const V xc = hn::IfThenElse(tiny, hn::Set(d, C::kMinArg), x);
  const V shifter = hn::Set(d, C::kShifter);
  const V t = hn::MulAdd(xc, hn::Set(d, static_cast<T>(1.442695040888963407359924681)), shifter);
  const V k = hn::Sub(t, shifter);
  V r = hn::NegMulAdd(k, hn::Set(d, C::kLn2Hi), xc);
  r = hn::NegMulAdd(k, hn::Set(d, C::kLn2Lo), r);
  constexpr int kTerms = static_cast<int>(sizeof(C::kPoly) / sizeof(C::kPoly[0]));
  V p = hn::Set(d, C::kPoly[kTerms - 1]);
  for (int i = kTerms - 2; i >= 0; --i) p = hn::MulAdd(p, r, hn::Set(d, C::kPoly[i]));
  const V one = hn::Set(d, T(1));
  p = hn::MulAdd(p, r, one);  // 1 + r (c0 + ...) : the r and 1 terms
  p = hn::MulAdd(p, r, one);
  // The low bits of t hold k (two's complement, mod 2^kMantissaBits); shifted
  // into the exponent field the higher bits fall off the top.
  const auto exponent = hn::ShiftLeft<C::kMantissaBits>(hn::BitCast(di, t));
  const V result = hn::BitCast(d, hn::Add(hn::BitCast(di, p), exponent));
  return hn::IfThenElse(hn::IsNaN(x), x, hn::IfThenZeroElse(tiny, result));
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// AVX-512: a 16-entry table of 2^(i/16) (vpermt2pd / vpermps pick the entry
// from the low bits of t directly) cuts the polynomial from degree 12 to 6
// (float: 7 to 3), and vscalefpd applies 2^floor(K/16): 14 instructions per
// vector of doubles against 21 for the generic form (measured 1.4x on the
// whole kernel at D = 1). Below x = -708 (float: -87) the weight is masked
// to exactly 0 (the mask rides on the vscalefpd), which also covers -inf
// and huge arguments; results that vscalefpd rounds to subnormals or 0 took
// microcode assists (7.4 s instead of 0.43 s at h = 0.001 x the spread,
// where most weights underflow). The mask keeps unordered lanes, so NaN
// passes through.
// e^r = 1 + r q(r) on |r| <= ln(2)/32: Chebyshev fits (mpmath.chebyfit of
// (e^r - 1)/r), relative error 1.4e-17 (double) and 2.3e-9 (float) before
// rounding; ln 2 split so that k16 * kLn2Hi is exact for |K| < 2^15.
HWY_INLINE hn::Vec512<double> Exp512(hn::Vec512<double> x) {
  alignas(64) static constexpr double kTable[16] = {
      0x1.0000000000000p+0, 0x1.0b5586cf9890fp+0, 0x1.172b83c7d517bp+0, 0x1.2387a6e756238p+0,
      0x1.306fe0a31b715p+0, 0x1.3dea64c123422p+0, 0x1.4bfdad5362a27p+0, 0x1.5ab07dd485429p+0,
      0x1.6a09e667f3bcdp+0, 0x1.7a11473eb0187p+0, 0x1.8ace5422aa0dbp+0, 0x1.9c49182a3f090p+0,
      0x1.ae89f995ad3adp+0, 0x1.c199bdd85529cp+0, 0x1.d5818dcfba487p+0, 0x1.ea4afa2a490dap+0};
  // The shifter 1.5 * 2^48 rounds x / ln2 to a multiple of 1/16: k16 =
  // K / 16, whose low 4 bits (K mod 16, the table index) sit in the low
  // mantissa bits of t, and vscalefpd takes 2^floor(k16) straight from it.
  const __mmask8 keep = _mm512_cmp_pd_mask(x.raw, _mm512_set1_pd(-708.0), _CMP_NLT_UQ);
  const __m512d shifter = _mm512_set1_pd(0x1.8p48);
  const __m512d t = _mm512_fmadd_pd(x.raw, _mm512_set1_pd(1.4426950408889634), shifter);
  const __m512d k16 = _mm512_sub_pd(t, shifter);
  __m512d r = _mm512_fnmadd_pd(k16, _mm512_set1_pd(0x1.62e42fee00000p-1), x.raw);
  r = _mm512_fnmadd_pd(k16, _mm512_set1_pd(1.9082149292705877e-10), r);
  __m512d q = _mm512_fmadd_pd(_mm512_set1_pd(0.0013889063440655327), r,
                              _mm512_set1_pd(0.008333472974951229));
  q = _mm512_fmadd_pd(q, r, _mm512_set1_pd(0.041666666663595475));
  q = _mm512_fmadd_pd(q, r, _mm512_set1_pd(0.16666666664209706));
  q = _mm512_fmadd_pd(q, r, _mm512_set1_pd(0.5000000000000001));
  q = _mm512_fmadd_pd(q, r, _mm512_set1_pd(1.0000000000000007));
  const __m512d rq = _mm512_mul_pd(r, q);
  const __m512d tab = _mm512_permutex2var_pd(_mm512_load_pd(kTable), _mm512_castpd_si512(t),
                                             _mm512_load_pd(kTable + 8));
  const __m512d y = _mm512_fmadd_pd(tab, rq, tab);
  return hn::Vec512<double>{_mm512_maskz_scalef_pd(keep, y, k16)};
}

HWY_INLINE hn::Vec512<float> Exp512(hn::Vec512<float> x) {
  alignas(64) static constexpr float kTable[16] = {
      0x1.000000p+0f, 0x1.0b5586p+0f, 0x1.172b84p+0f, 0x1.2387a6p+0f,
      0x1.306fe0p+0f, 0x1.3dea64p+0f, 0x1.4bfdaep+0f, 0x1.5ab07ep+0f,
      0x1.6a09e6p+0f, 0x1.7a1148p+0f, 0x1.8ace54p+0f, 0x1.9c4918p+0f,
      0x1.ae89fap+0f, 0x1.c199bep+0f, 0x1.d5818ep+0f, 0x1.ea4afap+0f};
  const __mmask16 keep = _mm512_cmp_ps_mask(x.raw, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  const __m512 shifter = _mm512_set1_ps(0x1.8p19f);  // rounds x / ln2 to 1/16ths
  const __m512 t = _mm512_fmadd_ps(x.raw, _mm512_set1_ps(1.4426950216293335f), shifter);
  const __m512 k16 = _mm512_sub_ps(t, shifter);
  __m512 r = _mm512_fnmadd_ps(k16, _mm512_set1_ps(0.693115234375f), x.raw);
  r = _mm512_fnmadd_ps(k16, _mm512_set1_ps(3.194618329871446e-05f), r);
  __m512 q =
      _mm512_fmadd_ps(_mm512_set1_ps(0.1666695922613144f), r, _mm512_set1_ps(0.5000146627426147f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  const __m512 rq = _mm512_mul_ps(r, q);
  const __m512 tab = _mm512_permutexvar_ps(_mm512_castps_si512(t), _mm512_load_ps(kTable));
  const __m512 y = _mm512_fmadd_ps(tab, rq, tab);
  return hn::Vec512<float>{_mm512_maskz_scalef_ps(keep, y, k16)};
}
#endif

template <class D, class V = hn::Vec<D>>
HWY_INLINE V ExpNonPositive(D d, V x) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (hn::MaxLanes(d) * sizeof(hn::TFromD<D>) == 64) return Exp512(x);
#endif
  return ExpNonPositiveGeneric(d, x);
}

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
bool HasNan(D d, const Problem<hn::TFromD<D>>& pr, const hn::TFromD<D>* kt,
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
void RunBlock(const Problem<T>& pr, int64_t b, int64_t i0) {
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
  T qs[kR * kMaxDim];
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
  V raw[kR], vext[kR];
  const T ext_init = kKind == kNegSq ? inf : -inf;
  auto extreme = [&](V a, V b) {
    if constexpr (kKind == kNegSq) return hn::Min(a, b);
    return hn::Max(a, b);
  };
  for (int r = 0; r < kR; ++r) vext[r] = hn::Set(d, ext_init);
  int64_t j = 0;
  for (; j < full_end; j += lanes) {
    RawScores<decltype(d), kKind, kR>(d, kt, nk_pad, dim, qs, bias, j, raw);
    for (int r = 0; r < kR; ++r) vext[r] = extreme(vext[r], raw[r]);
  }
  for (; j < end; j += lanes) {
    RawScores<decltype(d), kKind, kR>(d, kt, nk_pad, dim, qs, bias, j, raw);
    for (int r = 0; r < kR; ++r) {
      vext[r] = hn::IfThenElse(ValidLanes(d, len[r], j), extreme(vext[r], raw[r]), vext[r]);
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
    if (m[r] == inf || std::isnan(m[r])) {
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
      const V e = ExpNonPositive(d, shifted(raw[r], r));
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
      const V e = hn::IfThenElseZero(valid, ExpNonPositive(d, shifted(raw[r], r)));
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
void RunBlocksFor(const Problem<T>& pr, int64_t first, int64_t count) {
  constexpr int kR = static_cast<int>(impl::block_rows_for(kDv));
  const int64_t blocks_per_batch = ceil_div(pr.nq, kR);
  for (int64_t blk = first; blk < first + count; ++blk) {
    const int64_t b = blk / blocks_per_batch, i0 = (blk % blocks_per_batch) * kR;
    RunBlock<T, kKind, kDv, kR>(pr, b, i0);
  }
}

template <class T, int kKind>
void RunBlocksKind(const Problem<T>& pr, int64_t first, int64_t count) {
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
void RunBlocks(const Problem<T>& pr, int64_t first, int64_t count) {
  if (pr.kind == ScoreKind::kNegSquaredDistance) {
    RunBlocksKind<T, kNegSq>(pr, first, count);
  } else if (pr.bias) {
    RunBlocksKind<T, kDotBias>(pr, first, count);
  } else {
    RunBlocksKind<T, kDot>(pr, first, count);
  }
}

// Non-template entry points, one per type, for HWY_EXPORT.
void RunBlocksF32(const Problem<float>& pr, int64_t first, int64_t count) {
  RunBlocks(pr, first, count);
}
void RunBlocksF64(const Problem<double>& pr, int64_t first, int64_t count) {
  RunBlocks(pr, first, count);
}
// The exp above on n elements (tests measure its error against std::exp).
template <class T>
void ExpRow(const T* x, T* out, int64_t n) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += lanes) {
    HWY_ALIGN T buf[hn::MaxLanes(d)];
    for (int64_t l = 0; l < lanes; ++l) buf[l] = i + l < n ? x[i + l] : T(0);
    hn::Store(ExpNonPositive(d, hn::Load(d, buf)), d, buf);
    for (int64_t l = 0; l < lanes && i + l < n; ++l) out[i + l] = buf[l];
  }
}
void ExpRowF32(const float* x, float* out, int64_t n) { ExpRow(x, out, n); }
void ExpRowF64(const double* x, double* out, int64_t n) { ExpRow(x, out, n); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::small_dim
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels::small_dim {

HWY_EXPORT(RunBlocksF32);
HWY_EXPORT(RunBlocksF64);
HWY_EXPORT(ExpRowF32);
HWY_EXPORT(ExpRowF64);

namespace {

// Zero-filled storage aligned to 64 bytes, the widest vector, for the
// kernel's aligned loads.
struct FreeAligned {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
std::unique_ptr<T[], FreeAligned> aligned_zeros(int64_t n) {
  const int64_t align = impl::kPadBytes;
  const size_t bytes = static_cast<size_t>(
      ceil_div(std::max<int64_t>(n, 1) * static_cast<int64_t>(sizeof(T)), align) * align);
  void* p = std::aligned_alloc(static_cast<size_t>(align), bytes);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return std::unique_ptr<T[], FreeAligned>(static_cast<T*>(p));
}

void run_blocks(const impl::Problem<float>& pr, int64_t first, int64_t count) {
  HWY_DYNAMIC_DISPATCH(RunBlocksF32)(pr, first, count);
}
void run_blocks(const impl::Problem<double>& pr, int64_t first, int64_t count) {
  HWY_DYNAMIC_DISPATCH(RunBlocksF64)(pr, first, count);
}

// Query blocks per task: at least ~2^16 score evaluations per task (tens of
// microseconds), so scheduling does not dominate short key sequences.
// Depends on the shapes only (determinism).
int64_t blocks_per_task(int64_t block_rows, int64_t nk) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, block_rows * nk));
}

}  // namespace

void exp_non_positive(const float* x, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ExpRowF32)(x, out, n);
}
void exp_non_positive(const double* x, double* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ExpRowF64)(x, out, n);
}

bool applies(int64_t d, int64_t dv, const AttentionConfig& config) {
  return d >= 1 && d <= kMaxDim && dv >= 1 && dv <= kMaxValueDim && config.dropout == 0.0;
}

template <class T>
void forward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const T* key_bias, ScoreKind kind,
             const AttentionConfig& config, TensorView<T> output, TensorView<T> lse) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), dim = q.size(2);
  const int64_t dv = v.size(2);
  assert(applies(dim, dv, config));
  assert(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && output.is_contiguous());
  assert(k.size(2) == dim && v.size(1) == nk && output.size(2) == dv);
  assert(kind == ScoreKind::kDotProduct || key_bias == nullptr);
  // The Gaussian exponent: scale > 0 (pass 1 looks for the nearest key).
  assert(kind == ScoreKind::kDotProduct || config.scale > 0);
  if (batch == 0 || nq == 0) return;
  constexpr int64_t kPad = impl::kPadBytes / sizeof(T);
  const int64_t nk_pad = std::max<int64_t>(kPad, ceil_div(nk, kPad) * kPad);
  // Feature-major keys and values (zero padded): B (D + Dv + 1) nk_pad
  // elements, the size of the inputs; no (Nq, Nk) buffer.
  const auto kt = aligned_zeros<T>(batch * dim * nk_pad);
  const auto vt = aligned_zeros<T>(batch * dv * nk_pad);
  std::unique_ptr<T[], FreeAligned> bias;
  for (int64_t b = 0; b < batch; ++b) {
    const T* kb = k.data() + b * nk * dim;
    const T* vb = v.data() + b * nk * dv;
    T* ktb = kt.get() + b * dim * nk_pad;
    T* vtb = vt.get() + b * dv * nk_pad;
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t c = 0; c < dim; ++c) ktb[c * nk_pad + j] = kb[j * dim + c];
      for (int64_t c = 0; c < dv; ++c) vtb[c * nk_pad + j] = vb[j * dv + c];
    }
  }
  if (key_bias) {
    bias = aligned_zeros<T>(batch * nk_pad);
    for (int64_t b = 0; b < batch; ++b) {
      std::copy(key_bias + b * nk, key_bias + (b + 1) * nk, bias.get() + b * nk_pad);
    }
  }
  impl::Problem<T> pr;
  pr.batch = batch;
  pr.nq = nq;
  pr.nk = nk;
  pr.nk_pad = nk_pad;
  pr.d = dim;
  pr.dv = dv;
  pr.q = q.data();
  pr.kt = kt.get();
  pr.vt = vt.get();
  pr.bias = bias.get();
  pr.kind = kind;
  pr.scale = static_cast<T>(config.scale);
  pr.lens = config.valid_lens;
  pr.out = output.data();
  pr.lse = lse.data();
  pr.block_rows = impl::block_rows_for(dv);

  const int64_t blocks = batch * ceil_div(nq, pr.block_rows);
  const int64_t per_task = blocks_per_task(pr.block_rows, nk);
  const int64_t tasks = ceil_div(blocks, per_task);
  qkv::detail::parallel_for(tasks, [&](int64_t task) {
    const int64_t first = task * per_task;
    run_blocks(pr, first, std::min(per_task, blocks - first));
  });
}

template void forward<float>(ConstView<float>, ConstView<float>, ConstView<float>, const float*,
                             ScoreKind, const AttentionConfig&, TensorView<float>,
                             TensorView<float>);
template void forward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                              const double*, ScoreKind, const AttentionConfig&, TensorView<double>,
                              TensorView<double>);

}  // namespace qkv::kernels::small_dim
#endif  // HWY_ONCE
