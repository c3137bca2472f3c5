// Highway implementations of the row primitives in vecmath.h. This file is
// compiled once per SIMD target through hwy/foreach_target.h; the HWY_ONCE
// part at the bottom holds the dispatching entry points.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/vecmath.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/aligned_allocator.h>
#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/simd/exp-inl.h"
#include "kernels/simd/row_max-inl.h"
#include "kernels/simd/tail-inl.h"
#include "kernels/simd/vecmath.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using ::qkv::kernels::fast::HWY_NAMESPACE::LoadTail;
using ::qkv::kernels::fast::HWY_NAMESPACE::RowMax;
using ::qkv::kernels::fast::HWY_NAMESPACE::StoreTail;

// exp of a shifted score: float rows are a softmax's (x - shift <= ~0), so
// they take the softmax exp of exp-inl.h; double rows also serve the
// regression kernels, whose arguments may be positive, so hn::Exp.
// kNoNaN: the row was checked for NaN and ±inf (kernels/simd/exp-inl.h).
template <bool kNoNaN, class D>
HWY_INLINE hn::Vec<D> ExpShifted(D d, hn::Vec<D> x) {
  if constexpr (sizeof(hn::TFromD<D>) == 4) {
    return ::qkv::kernels::fast::HWY_NAMESPACE::ExpNonPositive<kNoNaN>(d, x);
  } else {
    return hn::Exp(d, x);
  }
}

template <class T, bool kNoNaN = false>
T ExpShiftSum(const T* x, T shift, T* out, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  const auto vshift = hn::Set(d, shift);
  // Two accumulators hide the add latency (4 cycles) behind the exp polynomial.
  auto sum0 = hn::Zero(d), sum1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    const auto e0 = ExpShifted<kNoNaN>(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    const auto e1 = ExpShifted<kNoNaN>(d, hn::Sub(hn::LoadU(d, x + i + lanes), vshift));
    hn::StoreU(e0, d, out + i);
    hn::StoreU(e1, d, out + i + lanes);
    sum0 = hn::Add(sum0, e0);
    sum1 = hn::Add(sum1, e1);
  }
  for (; i + lanes <= n; i += lanes) {
    const auto e = ExpShifted<kNoNaN>(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    hn::StoreU(e, d, out + i);
    sum0 = hn::Add(sum0, e);
  }
  if (i < n) {
    const auto e = hn::IfThenElseZero(
        hn::FirstN(d, n - i),
        ExpShifted<kNoNaN>(d, hn::Sub(LoadTail(d, x + i, n - i, shift), vshift)));
    StoreTail(d, e, out + i, n - i);
    sum1 = hn::Add(sum1, e);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(sum0, sum1)));
}

// Softcap with Highway's tanh (an expm1 and a division; 4 units in the
// last place at most): as float32 torch computes it, cap * tanh(x / cap)
// measured 0.48 units in the last place on average and 3.7 at most (x ~
// N(0, 50), cap 50), against 0.51 and 3.4 for x / cap, glibc's tanhf and
// the product. additive_tile.h's rational fit gave 0.76 and 5.3, and
// FlashAttention's softcap checks saw up to 6.3 times torch's error. Cost
// (docs/semantics.md, "Softcap and ALiBi"): the forward 1.29 times its time
// without a softcap (1.07-1.11 with the fit); in double lanes (0.5 at most)
// about 1.7 times.
template <class T>
void Softcap(T* x, double cap, T* grad, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  const auto inv_cap = hn::Set(d, static_cast<T>(1.0 / cap)),
             vcap = hn::Set(d, static_cast<T>(cap));
  const auto one = hn::Set(d, T(1));
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto t = hn::Tanh(d, hn::Mul(hn::LoadU(d, x + i), inv_cap));
    hn::StoreU(hn::Mul(vcap, t), d, x + i);
    if (grad) hn::StoreU(hn::NegMulAdd(t, t, one), d, grad + i);
  }
  if (i < n) {  // the same vector operations, so an element's bits do not depend on its place
    const auto t = hn::Tanh(d, hn::Mul(LoadTail(d, x + i, n - i), inv_cap));
    StoreTail(d, hn::Mul(vcap, t), x + i, n - i);
    if (grad) StoreTail(d, hn::NegMulAdd(t, t, one), grad + i, n - i);
  }
}

template <class T>
void Scale(T* x, T s, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  const auto vs = hn::Set(d, s);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(hn::Mul(hn::LoadU(d, x + i), vs), d, x + i);
  for (; i < n; ++i) x[i] *= s;
}

template <class T>
void Add(T* x, const T* y, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::Add(hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, x + i);
  }
  for (; i < n; ++i) x[i] += y[i];
}

// Kahan's step per element: the same four IEEE operations in the lanes and
// in the tail, so an element's bits do not depend on its position.
template <class T>
void AddCompensated(T* HWY_RESTRICT sum, T* HWY_RESTRICT lost, const T* HWY_RESTRICT x,
                    int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto s = hn::LoadU(d, sum + i);
    const auto y = hn::Sub(hn::LoadU(d, x + i), hn::LoadU(d, lost + i));
    const auto t = hn::Add(s, y);
    hn::StoreU(hn::Sub(hn::Sub(t, s), y), d, lost + i);
    hn::StoreU(t, d, sum + i);
  }
  for (; i < n; ++i) {
    const T y = x[i] - lost[i];
    const T t = sum[i] + y;
    lost[i] = (t - sum[i]) - y;
    sum[i] = t;
  }
}

template <class T>
T Dot(const T* a, const T* b, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  auto sum0 = hn::Zero(d), sum1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    sum0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), sum0);
    sum1 = hn::MulAdd(hn::LoadU(d, a + i + lanes), hn::LoadU(d, b + i + lanes), sum1);
  }
  for (; i + lanes <= n; i += lanes) {
    sum0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), sum0);
  }
  if (i < n) {
    sum1 = hn::MulAdd(LoadTail(d, a + i, n - i, T(0)), LoadTail(d, b + i, n - i, T(0)), sum1);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(sum0, sum1)));
}

template <class T>
void SoftmaxGrad(const T* w, const T* g, T c, T* out, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  const auto vc = hn::Set(d, c);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::Mul(hn::LoadU(d, w + i), hn::Sub(hn::LoadU(d, g + i), vc)), d, out + i);
  }
  for (; i < n; ++i) out[i] = w[i] * (g[i] - c);
}

// ---- memory-bound masked softmax ---------------------------------------------------

// Writes v to out[0, count) (count <= lanes) with ordinary stores.
template <class D, class T>
HWY_INLINE void store_n(D d, hn::Vec<D> v, T* out, size_t count) {
  if (count == hn::Lanes(d)) {
    hn::StoreU(v, d, out);
  } else {
    StoreTail(d, v, out, count);
  }
}

// out[j] = value(j) for j < n, where value(j) returns the vector for [j, j +
// lanes) (lanes past n are not stored). With `stream`, the aligned middle
// goes out with non-temporal stores.
template <class D, class T, class ValueFn>
HWY_INLINE void write_row(D d, T* out, size_t n, bool stream, ValueFn&& value) {
  const size_t lanes = hn::Lanes(d);
  size_t j = 0;
  if (stream) {
    // Up to the first vector-aligned address with ordinary stores.
    const size_t misaligned = (reinterpret_cast<uintptr_t>(out) / sizeof(T)) % lanes;
    if (misaligned != 0 && reinterpret_cast<uintptr_t>(out) % sizeof(T) == 0) {
      const size_t head = std::min(n, lanes - misaligned);
      store_n(d, value(0), out, head);
      j = head;
    }
    if (reinterpret_cast<uintptr_t>(out + j) % (lanes * sizeof(T)) == 0) {
      for (; j + lanes <= n; j += lanes) hn::Stream(value(j), d, out + j);
    }
  }
  for (; j + lanes <= n; j += lanes) hn::StoreU(value(j), d, out + j);
  if (j < n) StoreTail(d, value(j), out + j, n - j);
}

template <class T>
T SoftmaxRowOnce(const T* x, int64_t len_signed, int64_t n_signed, T* w, T* scratch, bool stream) {
  const hn::ScalableTag<T> d;
  const size_t len = static_cast<size_t>(len_signed), n = static_cast<size_t>(n_signed);
  bool nan_or_plus_inf = false;
  const T max = RowMax(d, x, len, &nan_or_plus_inf);
  // The caller's exact path takes these rows (NaN, +inf, or every score -inf).
  if (nan_or_plus_inf || max == -std::numeric_limits<T>::infinity()) {
    return std::numeric_limits<T>::quiet_NaN();
  }
  // From here on x and scratch are in L1.
  const T sum = ExpShiftSum<T, true>(x, max, scratch, len_signed);
  const auto inv = hn::Set(d, T(1) / sum);
  const size_t lanes = hn::Lanes(d);
  write_row(d, w, n, stream, [&](size_t j) {
    if (j + lanes <= len) return hn::Mul(hn::LoadU(d, scratch + j), inv);
    if (j >= len) return hn::Zero(d);
    // Lanes past len exactly +0, wherever the vector boundaries fall.
    return hn::IfThenElseZero(hn::FirstN(d, len - j),
                              hn::Mul(LoadTail(d, scratch + j, len - j, T(0)), inv));
  });
  return max + std::log(sum);
}

template <class T>
void SoftmaxGradRowOnce(const T* w, const T* g, int64_t len_signed, int64_t n_signed, T* out,
                        bool stream) {
  const hn::ScalableTag<T> d;
  const size_t len = static_cast<size_t>(len_signed), n = static_cast<size_t>(n_signed);
  const auto c = hn::Set(d, Dot(w, g, len_signed));
  const size_t lanes = hn::Lanes(d);
  write_row(d, out, n, stream, [&](size_t j) {
    if (j + lanes <= len) return hn::Mul(hn::LoadU(d, w + j), hn::Sub(hn::LoadU(d, g + j), c));
    if (j >= len) return hn::Zero(d);
    // Lanes past len exactly +0 (0 * (0 - c) would be -0 for c > 0).
    const size_t rest = len - j;
    return hn::IfThenElseZero(
        hn::FirstN(d, rest),
        hn::Mul(LoadTail(d, w + j, rest, T(0)), hn::Sub(LoadTail(d, g + j, rest, T(0)), c)));
  });
}

void FlushStreams() { hwy::FlushStream(); }

// bf16 bits to float: each 16-bit lane zero-extended and shifted into the
// upper half (scalar code before issue 14 below AVX-512: 0.14x float32's speed
// in decoding-like shapes, docs/perf-findings.md).
void ToFloat(const uint16_t* x, float* out, int64_t n_signed) {
  const hn::ScalableTag<float> d;
  const hn::RebindToUnsigned<decltype(d)> du;
  const hn::Rebind<uint16_t, decltype(d)> d16;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto wide = hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, x + i)));
    hn::StoreU(hn::BitCast(d, wide), d, out + i);
  }
  for (; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(out + i, &wide, sizeof(float));
  }
}

// Non-template entry points, one per type, for HWY_EXPORT.
float MaxOfF32(const float* x, int64_t n, bool* f) {
  return RowMax(hn::ScalableTag<float>(), x, static_cast<size_t>(n), f);
}
double MaxOfF64(const double* x, int64_t n, bool* f) {
  return RowMax(hn::ScalableTag<double>(), x, static_cast<size_t>(n), f);
}
float ExpShiftSumF32(const float* x, float s, float* o, int64_t n) {
  return ExpShiftSum(x, s, o, n);
}
double ExpShiftSumF64(const double* x, double s, double* o, int64_t n) {
  return ExpShiftSum(x, s, o, n);
}
// x[r][j] = x[r][j] * factor[r] + y[r][j]: one MulAdd in every lane, the
// tail included (so a column's result does not depend on where it falls).
void ScaleAddRowsF32(float* x, int64_t ldx, const float* factor, const float* y, int64_t ldy,
                     int64_t rows, int64_t n_signed) {
  const hn::ScalableTag<float> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * ldx;
    const float* yr = y + r * ldy;
    const auto f = hn::Set(d, factor[r]);
    size_t i = 0;
    for (; i + lanes <= n; i += lanes) {
      hn::StoreU(hn::MulAdd(hn::LoadU(d, xr + i), f, hn::LoadU(d, yr + i)), d, xr + i);
    }
    if (i < n) {
      const auto v = hn::MulAdd(LoadTail(d, xr + i, n - i), f, LoadTail(d, yr + i, n - i));
      StoreTail(d, v, xr + i, n - i);
    }
  }
}

void SoftcapF32(float* x, double cap, float* g, int64_t n) { Softcap(x, cap, g, n); }
void SoftcapF64(double* x, double cap, double* g, int64_t n) { Softcap(x, cap, g, n); }
void ScaleF32(float* x, float s, int64_t n) { Scale(x, s, n); }
void ScaleF64(double* x, double s, int64_t n) { Scale(x, s, n); }
void AddF32(float* x, const float* y, int64_t n) { Add(x, y, n); }
void AddF64(double* x, const double* y, int64_t n) { Add(x, y, n); }
void AddCompensatedF32(float* sum, float* lost, const float* x, int64_t n) {
  AddCompensated(sum, lost, x, n);
}
void AddCompensatedF64(double* sum, double* lost, const double* x, int64_t n) {
  AddCompensated(sum, lost, x, n);
}
float DotF32(const float* a, const float* b, int64_t n) { return Dot(a, b, n); }
double DotF64(const double* a, const double* b, int64_t n) { return Dot(a, b, n); }
void SoftmaxGradF32(const float* w, const float* g, float c, float* o, int64_t n) {
  SoftmaxGrad(w, g, c, o, n);
}
void SoftmaxGradF64(const double* w, const double* g, double c, double* o, int64_t n) {
  SoftmaxGrad(w, g, c, o, n);
}
float SoftmaxRowOnceF32(const float* x, int64_t len, int64_t n, float* w, float* s, bool st) {
  return SoftmaxRowOnce(x, len, n, w, s, st);
}
double SoftmaxRowOnceF64(const double* x, int64_t len, int64_t n, double* w, double* s, bool st) {
  return SoftmaxRowOnce(x, len, n, w, s, st);
}
void SoftmaxGradRowOnceF32(const float* w, const float* g, int64_t len, int64_t n, float* o,
                           bool st) {
  SoftmaxGradRowOnce(w, g, len, n, o, st);
}
void SoftmaxGradRowOnceF64(const double* w, const double* g, int64_t len, int64_t n, double* o,
                           bool st) {
  SoftmaxGradRowOnce(w, g, len, n, o, st);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels::fast {

HWY_EXPORT(MaxOfF32);
HWY_EXPORT(MaxOfF64);
HWY_EXPORT(ExpShiftSumF32);
HWY_EXPORT(ExpShiftSumF64);
HWY_EXPORT(ScaleAddRowsF32);
HWY_EXPORT(SoftcapF32);
HWY_EXPORT(SoftcapF64);
HWY_EXPORT(ScaleF32);
HWY_EXPORT(ScaleF64);
HWY_EXPORT(AddF32);
HWY_EXPORT(AddF64);
HWY_EXPORT(AddCompensatedF32);
HWY_EXPORT(AddCompensatedF64);
HWY_EXPORT(DotF32);
HWY_EXPORT(DotF64);
HWY_EXPORT(SoftmaxGradF32);
HWY_EXPORT(SoftmaxGradF64);

HWY_EXPORT(SoftmaxRowOnceF32);
HWY_EXPORT(SoftmaxRowOnceF64);
HWY_EXPORT(SoftmaxGradRowOnceF32);
HWY_EXPORT(SoftmaxGradRowOnceF64);
HWY_EXPORT(FlushStreams);
HWY_EXPORT(ToFloat);

float softmax_row_once(const float* x, int64_t len, int64_t n, float* w, float* s, bool st) {
  return HWY_DYNAMIC_DISPATCH(SoftmaxRowOnceF32)(x, len, n, w, s, st);
}
double softmax_row_once(const double* x, int64_t len, int64_t n, double* w, double* s, bool st) {
  return HWY_DYNAMIC_DISPATCH(SoftmaxRowOnceF64)(x, len, n, w, s, st);
}
void softmax_grad_row_once(const float* w, const float* g, int64_t len, int64_t n, float* o,
                           bool st) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradRowOnceF32)(w, g, len, n, o, st);
}
void softmax_grad_row_once(const double* w, const double* g, int64_t len, int64_t n, double* o,
                           bool st) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradRowOnceF64)(w, g, len, n, o, st);
}
void flush_streams() { HWY_DYNAMIC_DISPATCH(FlushStreams)(); }

void to_float(const bfloat16* x, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ToFloat)(reinterpret_cast<const uint16_t*>(x), out, n);
}

float max_of(const float* x, int64_t n, bool* f) { return HWY_DYNAMIC_DISPATCH(MaxOfF32)(x, n, f); }
double max_of(const double* x, int64_t n, bool* f) {
  return HWY_DYNAMIC_DISPATCH(MaxOfF64)(x, n, f);
}
float exp_shift_sum(const float* x, float s, float* o, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(ExpShiftSumF32)(x, s, o, n);
}
double exp_shift_sum(const double* x, double s, double* o, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(ExpShiftSumF64)(x, s, o, n);
}
void scale_add_rows(float* x, int64_t ldx, const float* factor, const float* y, int64_t ldy,
                    int64_t rows, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ScaleAddRowsF32)(x, ldx, factor, y, ldy, rows, n);
}
void softcap(float* x, double cap, float* grad, int64_t n) {
  HWY_DYNAMIC_DISPATCH(SoftcapF32)(x, cap, grad, n);
}
void softcap(double* x, double cap, double* grad, int64_t n) {
  HWY_DYNAMIC_DISPATCH(SoftcapF64)(x, cap, grad, n);
}
void scale(float* x, float s, int64_t n) { HWY_DYNAMIC_DISPATCH(ScaleF32)(x, s, n); }
void scale(double* x, double s, int64_t n) { HWY_DYNAMIC_DISPATCH(ScaleF64)(x, s, n); }
void add(float* x, const float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(AddF32)(x, y, n); }
void add(double* x, const double* y, int64_t n) { HWY_DYNAMIC_DISPATCH(AddF64)(x, y, n); }
void add_compensated(float* sum, float* lost, const float* x, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AddCompensatedF32)(sum, lost, x, n);
}
void add_compensated(double* sum, double* lost, const double* x, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AddCompensatedF64)(sum, lost, x, n);
}
float dot(const float* a, const float* b, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(DotF32)(a, b, n);
}
double dot(const double* a, const double* b, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(DotF64)(a, b, n);
}
void softmax_grad(const float* w, const float* g, float c, float* o, int64_t n) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradF32)(w, g, c, o, n);
}
void softmax_grad(const double* w, const double* g, double c, double* o, int64_t n) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradF64)(w, g, c, o, n);
}

}  // namespace qkv::kernels::fast
#endif  // HWY_ONCE
