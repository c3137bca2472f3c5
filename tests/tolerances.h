// Per-op tolerances of the GoogleTest suites. A value passes if
// |got - ref| <= atol + rtol * |ref|, with ref the reference computed in double
// (or the plain double loop of the test). Each constant says where it comes
// from; 2^-24 ~ 6e-8 is float's unit roundoff, 2^-53 ~ 1.1e-16 double's.
#pragma once

namespace qkv::test {

struct Tol {
  double atol = 0.0;
  double rtol = 0.0;
};

// Picks the float or the double constant by element type (for typed tests).
template <class T>
constexpr Tol tol_for(Tol for_float, Tol for_double) {
  return sizeof(T) == sizeof(float) ? for_float : for_double;
}

// Exact: element copies, one-hot gathers, masks, bitwise-identical reruns.
inline constexpr Tol kExact{.atol = 0.0, .rtol = 0.0};

// ---- masked softmax ----------------------------------------------------------
// float fast vs double ref: exp(x - m) is off by ~|x - m| * 2^-24 relative
// (|x - m| <= ~20 in the tests) and the row sum adds ~sqrt(Nk) * 2^-24.
inline constexpr Tol kSoftmax{.atol = 1e-7, .rtol = 1e-5};
// double fast vs double ref: the same error terms at 2^-53, with SIMD exp.
inline constexpr Tol kSoftmaxDouble{.atol = 1e-15, .rtol = 1e-12};
// double ref vs the test's plain double loop: two exactly rounded evaluations
// of the same formula, differing only in summation order over Nk <= 1000.
inline constexpr Tol kSoftmaxRefVsLoop{.atol = 1e-16, .rtol = 1e-13};
// float backward: d_scores = w * (g - sum_k w_k g_k); the float dot product
// errs by ~sqrt(Nk) * 2^-24 * sum |w g| <= 2e-6 for |g| <= 1, times w <= 1.
inline constexpr Tol kSoftmaxBackward{.atol = 2e-6, .rtol = 1e-5};
// double backward: the same terms at 2^-53.
inline constexpr Tol kSoftmaxBackwardDouble{.atol = 1e-14, .rtol = 1e-11};
// double ref backward vs the test's plain loop: one dot product over Nk <= 1000
// in a different order (~sqrt(Nk) * 2^-53), then the same two roundings.
inline constexpr Tol kSoftmaxBackwardRefVsLoop{.atol = 1e-15, .rtol = 1e-12};

// ---- attention pooling ---------------------------------------------------------
// float sum over Nk <= 1000 of w * v with w, v in [-1, 1] (sigma 1/3): each
// add rounds at the size of the partial sum (~sqrt(k) / 3), so a sequential
// sum errs by ~2^-24 * Nk / 3 / sqrt(6) ~ 8e-6 (std); 1e-4 is > 10 sigma.
inline constexpr Tol kPooling{.atol = 1e-4, .rtol = 1e-5};
// double: the same sum at 2^-53.
inline constexpr Tol kPoolingDouble{.atol = 1e-13, .rtol = 1e-12};
// average pooling in float: a mean of <= 1000 values in [-1, 1], rounded once
// per add (sequential worst case Nk * 2^-24 = 6e-5 relative to sum |v|).
inline constexpr Tol kAverage{.atol = 1e-5, .rtol = 1e-5};

// ---- linear (qkv/linear.h) ----------------------------------------------------
// float: a dot product of in <= 300 terms in [-1, 1] (|sum| ~ sqrt(in) / 3 ~
// 6), each add rounding at the partial sum's size: ~2^-24 * 6 * sqrt(300) ~
// 6e-6 worst; the BLAS's blocked order changes which, not how much.
inline constexpr Tol kLinear{.atol = 2e-5, .rtol = 1e-5};
inline constexpr Tol kLinearDouble{.atol = 1e-13, .rtol = 1e-12};

// ---- scaled dot-product attention ---------------------------------------------
// float: scores are D <= 128 term dot products (error ~sqrt(D) * 2^-24 * |q||k|
// * scale ~ 1e-7), softmax as above, then a convex combination of values in
// [-1, 1]; an online-softmax kernel rescales partial sums once per key block.
inline constexpr Tol kSdpa{.atol = 1e-5, .rtol = 1e-4};
// double: the same chain at 2^-53.
inline constexpr Tol kSdpaDouble{.atol = 1e-12, .rtol = 1e-10};
// lse = m + log(sum exp(s - m)): |lse| * 2^-24 from the max plus the sum's error.
inline constexpr Tol kSdpaLse{.atol = 2e-6, .rtol = 2e-6};
inline constexpr Tol kSdpaLseDouble{.atol = 1e-13, .rtol = 1e-13};
// float backward: dS = P * (dP - rowsum(dO * O)) cancels to ~1e-6 absolute,
// then dQ and dK sum Nk or Nq such terms (~sqrt(N) growth) times scale.
inline constexpr Tol kSdpaBackward{.atol = 5e-5, .rtol = 1e-4};
// double backward: the same chain at 2^-53.
inline constexpr Tol kSdpaBackwardDouble{.atol = 1e-11, .rtol = 1e-9};

// ---- additive attention --------------------------------------------------------
// float: features W_q q + W_k k sum Dq + Dk terms, tanh (a SIMD tanh is a few
// ulp), the score sums H terms of w_v * tanh; softmax and pooling as above.
inline constexpr Tol kAdditive{.atol = 2e-5, .rtol = 1e-4};
// double: the same chain at 2^-53.
inline constexpr Tol kAdditiveDouble{.atol = 1e-12, .rtol = 1e-10};
// float weights: w = exp(score - lse), so a weight's relative error is the
// score's absolute error (twice, with lse's): H terms of w_v * tanh, each off
// by the features' rounding and the fused kernels' tanh (3e-7 relative).
// Measured over 300 seeds of the tile-edge test: up to 1.4e-5.
inline constexpr Tol kAdditiveWeights{.atol = 1e-7, .rtol = 1e-4};
// float backward: dW_q, dW_k and dw_v sum B * Nq * Nk terms of (1 - tanh^2)
// times dS, so the error grows like sqrt(B * Nq * Nk) * 2^-24 relative to |dW|.
inline constexpr Tol kAdditiveBackward{.atol = 1e-4, .rtol = 1e-3};
// double backward: the same sums at 2^-53.
inline constexpr Tol kAdditiveBackwardDouble{.atol = 1e-10, .rtol = 1e-8};

// ---- gradient checks -----------------------------------------------------------
// Central differences in double with h = 1e-5: truncation ~h^2 * |f'''| ~ 1e-10
// plus rounding ~2^-53 * |f| / h ~ 1e-10 for |f| <= 10.
inline constexpr Tol kFiniteDiff{.atol = 1e-7, .rtol = 1e-5};

}  // namespace qkv::test
