// exp of a softmax's shifted scores (x <= ~0), for Highway kernels: the one
// exp of the fast softmax paths (small_dim_attention.cc, softmax_tile.cc,
// vecmath.cc's float rows). Include it after hwy/foreach_target.h and
// hwy/highway.h; like Highway's own -inl.h headers it is compiled once per
// SIMD target.
//
// Why not hn::Exp: it handles overflow and subnormal results, which a
// softmax never needs (weights relative to the row's best are <= 1, and a
// weight below 2^-126 of it is 0 to the sum), and costs about twice the
// instructions. Measured at n = t = 30000, D = Dv = 1, float64, one thread
// (CPU time, bench/bench_nw_exact.cc): the small-dimension kernel ran in 0.44 s
// with the AVX-512 table form below (2.0 G scores/s), 0.62 s with the generic
// form, 0.90 s with hn::Exp.
#if defined(QKV_KERNELS_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_EXP_INL_H_
#undef QKV_KERNELS_EXP_INL_H_
#else
#define QKV_KERNELS_EXP_INL_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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
  // e^-87 = 1.6e-38 is still normal (FLT_MIN = e^-87.34), as on the AVX-512
  // path. The result stays normal down to it: k = round(x / ln 2) >= -126,
  // and k = -126 only for x / ln 2 < -125.5, where r = x + 126 ln 2 > 0.33
  // makes the polynomial > 1 (exponent field >= 1 after adding k). -86.5
  // (k >= -125) zeroed the weights of e^[-87, -86.5] on every target but
  // AVX-512.
  static constexpr float kMinArg = -87.0f;
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
// through the row's sum), unless kNoNaN: callers that have checked their row
// for NaN and ±inf (softmax_tile.cc, softmax_row_once, the Gaussian scores of
// small_dim_attention.cc) skip that blend, 2 of the ~19 vector instructions
// per call of this form. Range reduction x = k ln2 + r with k = round(x /
// ln2) from the shifter trick (k sits in the low mantissa bits of t), e^r by
// the polynomial, then 2^k enters as k added to the exponent field: one
// integer add instead of Highway's two multiplies by constructed powers of
// two (those cover the subnormal range, which we do not need).
template <bool kNoNaN, class D, class V = hn::Vec<D>>
HWY_INLINE V ExpNonPositiveGeneric(D d, V x) {
  using T = hn::TFromD<D>;
  using C = ExpConstants<T>;
  const hn::RebindToSigned<D> di;
  const auto tiny = hn::Lt(x, hn::Set(d, C::kMinArg));
  // One max instead of a compare and a blend (NaN becomes kMinArg here and is
  // restored at the end).
  const V xc = hn::Max(x, hn::Set(d, C::kMinArg));
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
  if constexpr (kNoNaN) return hn::IfThenZeroElse(tiny, result);
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

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
// AVX2 (256-bit vectors): the table idea of Exp512 with an 8-entry table of
// 2^(i/8), which a permute of 32-bit lanes can read from registers (vpermps:
// one for 8 floats, two and a blend for 8 doubles; AVX2 has no two-table or
// 64-bit variable permute, and gathers are slow on many cores). |r| <=
// ln(2)/16 cuts the double polynomial from degree 12 to 7 and the float one
// from 7 to 3, and 2^floor(K/8) enters as an integer add to the exponent
// field as in the generic form (AVX2 has no vscalefpd). The double
// polynomial is evaluated by Estrin's scheme (pairs, then r^2 and r^4): its
// chain is 3 FMAs deep instead of 6, and the out-of-order window then holds
// more exps at once. On this project's AVX-512 machine capped at avx2, the
// exp alone in a loop went from 4.0 to 3.2 ns per 4 doubles and 2.5 to 1.9
// ns per 8 floats; the small-dimension kernel at D = 1, n = t = 30000
// (bench_nw_exact, one thread) from 1.27 to 1.13 s (float64) and 0.45 to
// 0.38 s (float32).
// e^r = 1 + r q(r): Chebyshev fits (mpmath.chebyfit of (e^r - 1)/r on
// |r| <= ln(2)/16), relative error 4.9e-18 (double) and 3.8e-8 (float)
// before rounding; measured through the kernel (ExpErrorIsAboutOneUlp):
// 1.6e-16 and 1.2e-7. Same range handling as the generic form: x below
// kMinArg (incl. -inf) gives 0, NaN gives NaN unless kNoNaN.
template <bool kNoNaN>
HWY_INLINE hn::Vec256<double> Exp256(hn::Vec256<double> x) {
  alignas(32) static constexpr double kTable[8] = {
      0x1.0000000000000p+0, 0x1.172b83c7d517bp+0, 0x1.306fe0a31b715p+0, 0x1.4bfdad5362a27p+0,
      0x1.6a09e667f3bcdp+0, 0x1.8ace5422aa0dbp+0, 0x1.ae89f995ad3adp+0, 0x1.d5818dcfba487p+0};
  const __m256d min_arg = _mm256_set1_pd(ExpConstants<double>::kMinArg);
  const __m256d tiny = _mm256_cmp_pd(x.raw, min_arg, _CMP_LT_OQ);
  const __m256d xc = _mm256_max_pd(x.raw, min_arg);  // NaN -> kMinArg, restored below
  // The shifter 1.5 * 2^49 rounds x / ln2 to a multiple of 1/8: k8 = K / 8,
  // K's low 3 bits (the table index) in the low mantissa bits of t.
  const __m256d shifter = _mm256_set1_pd(0x1.8p49);
  const __m256d t = _mm256_fmadd_pd(xc, _mm256_set1_pd(1.4426950408889634), shifter);
  const __m256d k8 = _mm256_sub_pd(t, shifter);
  // ln 2 split so that k8 * hi is exact for |K| < 2^15 (Exp512's split).
  __m256d r = _mm256_fnmadd_pd(k8, _mm256_set1_pd(0x1.62e42fee00000p-1), xc);
  r = _mm256_fnmadd_pd(k8, _mm256_set1_pd(1.9082149292705877e-10), r);
  const __m256d r2 = _mm256_mul_pd(r, r);
  const __m256d p01 = _mm256_fmadd_pd(_mm256_set1_pd(0.500000000000018), r, _mm256_set1_pd(1.0));
  const __m256d p23 =
      _mm256_fmadd_pd(_mm256_set1_pd(0.041666666590226054), r, _mm256_set1_pd(0.16666666666666866));
  const __m256d p45 = _mm256_fmadd_pd(_mm256_set1_pd(0.0013889703480254652), r,
                                      _mm256_set1_pd(0.008333333324839985));
  const __m256d p03 = _mm256_fmadd_pd(p23, r2, p01);
  const __m256d p46 = _mm256_fmadd_pd(_mm256_set1_pd(0.0001984217493849779), r2, p45);
  const __m256d q = _mm256_fmadd_pd(p46, _mm256_mul_pd(r2, r2), p03);
  // Entry K mod 8: vpermps picks 32-bit lanes, so each double's lane pair
  // gets indices (2i, 2i + 1), i = K mod 4, from K doubled; bit 2 of K
  // chooses the table's half.
  const __m256i bits = _mm256_castpd_si256(t);
  const __m256i twice = _mm256_slli_epi64(bits, 1);
  const __m256i pair = _mm256_or_si256(_mm256_shuffle_epi32(twice, _MM_SHUFFLE(2, 2, 0, 0)),
                                       _mm256_set1_epi64x(int64_t{1} << 32));
  const __m256 low =
      _mm256_permutevar8x32_ps(_mm256_load_ps(reinterpret_cast<const float*>(kTable)), pair);
  const __m256 high =
      _mm256_permutevar8x32_ps(_mm256_load_ps(reinterpret_cast<const float*>(kTable + 4)), pair);
  const __m256d tab = _mm256_blendv_pd(_mm256_castps_pd(low), _mm256_castps_pd(high),
                                       _mm256_castsi256_pd(_mm256_slli_epi64(bits, 61)));
  const __m256d y = _mm256_fmadd_pd(_mm256_mul_pd(tab, r), q, tab);
  // 2^floor(K / 8) into the exponent field: K's bits from 3 up, shifted to
  // bit 52 (the higher ones fall off the top, as in the generic form).
  const __m256i exponent = _mm256_slli_epi64(_mm256_srli_epi64(bits, 3), 52);
  const __m256d result = _mm256_andnot_pd(
      tiny, _mm256_castsi256_pd(_mm256_add_epi64(_mm256_castpd_si256(y), exponent)));
  if constexpr (kNoNaN) return hn::Vec256<double>{result};
  return hn::Vec256<double>{
      _mm256_blendv_pd(result, x.raw, _mm256_cmp_pd(x.raw, x.raw, _CMP_UNORD_Q))};
}

template <bool kNoNaN>
HWY_INLINE hn::Vec256<float> Exp256(hn::Vec256<float> x) {
  alignas(32) static constexpr float kTable[8] = {0x1.000000p+0f, 0x1.172b84p+0f, 0x1.306fe0p+0f,
                                                  0x1.4bfdaep+0f, 0x1.6a09e6p+0f, 0x1.8ace54p+0f,
                                                  0x1.ae89fap+0f, 0x1.d5818ep+0f};
  const __m256 min_arg = _mm256_set1_ps(ExpConstants<float>::kMinArg);
  const __m256 tiny = _mm256_cmp_ps(x.raw, min_arg, _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(x.raw, min_arg);
  const __m256 shifter = _mm256_set1_ps(0x1.8p20f);  // rounds x / ln2 to 1/8ths
  const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.4426950216293335f), shifter);
  const __m256 k8 = _mm256_sub_ps(t, shifter);
  __m256 r = _mm256_fnmadd_ps(k8, _mm256_set1_ps(0.693115234375f), xc);
  r = _mm256_fnmadd_ps(k8, _mm256_set1_ps(3.194618329871446e-05f), r);
  __m256 q =
      _mm256_fmadd_ps(_mm256_set1_ps(0.1666783968696943f), r, _mm256_set1_ps(0.5000586518013885f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
  const __m256 rq = _mm256_mul_ps(r, q);
  const __m256i bits = _mm256_castps_si256(t);
  const __m256 tab = _mm256_permutevar8x32_ps(_mm256_load_ps(kTable), bits);
  const __m256 y = _mm256_fmadd_ps(tab, rq, tab);
  const __m256i exponent = _mm256_slli_epi32(_mm256_srli_epi32(bits, 3), 23);
  const __m256 result = _mm256_andnot_ps(
      tiny, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), exponent)));
  if constexpr (kNoNaN) return hn::Vec256<float>{result};
  return hn::Vec256<float>{
      _mm256_blendv_ps(result, x.raw, _mm256_cmp_ps(x.raw, x.raw, _CMP_UNORD_Q))};
}
#endif

// True when ExpNonPositive spends instructions on NaN arguments (a compare
// and a blend) that ExpNonPositive<true> saves; Exp512 passes NaN through
// vscalefpd for free.
template <class D>
constexpr bool ExpNaNCostsABlend(D d) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  return hn::MaxLanes(d) * sizeof(hn::TFromD<D>) != 64;
#else
  (void)d;
  return true;
#endif
}

template <bool kNoNaN = false, class D, class V = hn::Vec<D>>
HWY_INLINE V ExpNonPositive(D d, V x) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (hn::MaxLanes(d) * sizeof(hn::TFromD<D>) == 64) return Exp512(x);
#endif
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  if constexpr (hn::MaxLanes(d) * sizeof(hn::TFromD<D>) == 32) return Exp256<kNoNaN>(x);
#endif
  return ExpNonPositiveGeneric<kNoNaN>(d, x);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_EXP_INL_H_
