// Highway implementations of the row primitives in vecmath.h. This file is
// compiled once per SIMD target through hwy/foreach_target.h; the HWY_ONCE
// part at the bottom holds the dispatching entry points.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/vecmath.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <limits>

#include "kernels/vecmath.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::vecmath {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Loads the last n < Lanes(d) elements into a full vector, padded with `pad`.
template <class D, class T>
HWY_INLINE hn::Vec<D> load_tail(D d, const T* x, size_t n, T pad) {
  HWY_ALIGN T buf[hn::MaxLanes(d)];
  for (size_t i = 0; i < hn::Lanes(d); ++i) buf[i] = i < n ? x[i] : pad;
  return hn::Load(d, buf);
}

template <class D, class T>
HWY_INLINE void store_tail(D d, hn::Vec<D> v, T* out, size_t n) {
  HWY_ALIGN T buf[hn::MaxLanes(d)];
  hn::Store(v, d, buf);
  for (size_t i = 0; i < n; ++i) out[i] = buf[i];
}

template <class T>
T MaxOf(const T* x, int64_t n_signed, bool* all_finite) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  const T lowest = -std::numeric_limits<T>::infinity();
  auto vmax = hn::Set(d, lowest);
  // x * 0 is 0 for finite x and NaN for NaN or ±inf: one sum catches them all.
  auto probe = hn::Zero(d);
  const auto zero = hn::Zero(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto v = hn::LoadU(d, x + i);
    vmax = hn::Max(vmax, v);
    probe = hn::MulAdd(v, zero, probe);
  }
  if (i < n) {
    const auto v = load_tail(d, x + i, n - i, T(0));
    vmax = hn::Max(vmax, hn::IfThenElse(hn::FirstN(d, n - i), v, hn::Set(d, lowest)));
    probe = hn::MulAdd(v, zero, probe);
  }
  const T probe_sum = hn::GetLane(hn::SumOfLanes(d, probe));
  *all_finite = probe_sum == T(0);
  return hn::GetLane(hn::MaxOfLanes(d, vmax));
}

template <class T>
T ExpShiftSum(const T* x, T shift, T* out, int64_t n_signed) {
  const hn::ScalableTag<T> d;
  const size_t n = static_cast<size_t>(n_signed), lanes = hn::Lanes(d);
  const auto vshift = hn::Set(d, shift);
  // Two accumulators hide the add latency (4 cycles) behind the exp polynomial.
  auto sum0 = hn::Zero(d), sum1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    const auto e0 = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    const auto e1 = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i + lanes), vshift));
    hn::StoreU(e0, d, out + i);
    hn::StoreU(e1, d, out + i + lanes);
    sum0 = hn::Add(sum0, e0);
    sum1 = hn::Add(sum1, e1);
  }
  for (; i + lanes <= n; i += lanes) {
    const auto e = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), vshift));
    hn::StoreU(e, d, out + i);
    sum0 = hn::Add(sum0, e);
  }
  if (i < n) {
    const auto e = hn::IfThenElseZero(
        hn::FirstN(d, n - i), hn::Exp(d, hn::Sub(load_tail(d, x + i, n - i, shift), vshift)));
    store_tail(d, e, out + i, n - i);
    sum1 = hn::Add(sum1, e);
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(sum0, sum1)));
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
    sum1 = hn::MulAdd(load_tail(d, a + i, n - i, T(0)), load_tail(d, b + i, n - i, T(0)), sum1);
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

template <class T>
T AdditiveScore(const T* fq, const T* fk, const T* wv, int64_t h_signed) {
  const hn::ScalableTag<T> d;
  const size_t h = static_cast<size_t>(h_signed), lanes = hn::Lanes(d);
  auto sum = hn::Zero(d);
  size_t i = 0;
  for (; i + lanes <= h; i += lanes) {
    const auto t = hn::Tanh(d, hn::Add(hn::LoadU(d, fq + i), hn::LoadU(d, fk + i)));
    sum = hn::MulAdd(hn::LoadU(d, wv + i), t, sum);
  }
  if (i < h) {
    const auto t =
        hn::Tanh(d, hn::Add(load_tail(d, fq + i, h - i, T(0)), load_tail(d, fk + i, h - i, T(0))));
    sum = hn::MulAdd(load_tail(d, wv + i, h - i, T(0)), t, sum);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

template <class T>
void AdditiveScoreGrad(const T* fq, const T* fk, const T* wv, int64_t h_signed, T ds, T* d_f,
                       T* d_wv) {
  const hn::ScalableTag<T> d;
  const size_t h = static_cast<size_t>(h_signed), lanes = hn::Lanes(d);
  const auto vds = hn::Set(d, ds);
  const auto one = hn::Set(d, T(1));
  auto step = [&](auto t, auto w, size_t i, size_t count) {
    // d_f += ds * wv * (1 - t^2)
    const auto df = hn::Mul(hn::Mul(vds, w), hn::NegMulAdd(t, t, one));
    if (count == lanes) {
      hn::StoreU(hn::Add(hn::LoadU(d, d_f + i), df), d, d_f + i);
      if (d_wv) hn::StoreU(hn::MulAdd(vds, t, hn::LoadU(d, d_wv + i)), d, d_wv + i);
    } else {
      store_tail(d, hn::Add(load_tail(d, d_f + i, count, T(0)), df), d_f + i, count);
      if (d_wv) {
        store_tail(d, hn::MulAdd(vds, t, load_tail(d, d_wv + i, count, T(0))), d_wv + i, count);
      }
    }
  };
  size_t i = 0;
  for (; i + lanes <= h; i += lanes) {
    const auto t = hn::Tanh(d, hn::Add(hn::LoadU(d, fq + i), hn::LoadU(d, fk + i)));
    step(t, hn::LoadU(d, wv + i), i, lanes);
  }
  if (i < h) {
    const size_t rest = h - i;
    const auto t =
        hn::Tanh(d, hn::Add(load_tail(d, fq + i, rest, T(0)), load_tail(d, fk + i, rest, T(0))));
    step(t, load_tail(d, wv + i, rest, T(0)), i, rest);
  }
}

// Non-template entry points, one per type, for HWY_EXPORT.
float MaxOfF32(const float* x, int64_t n, bool* f) { return MaxOf(x, n, f); }
double MaxOfF64(const double* x, int64_t n, bool* f) { return MaxOf(x, n, f); }
float ExpShiftSumF32(const float* x, float s, float* o, int64_t n) {
  return ExpShiftSum(x, s, o, n);
}
double ExpShiftSumF64(const double* x, double s, double* o, int64_t n) {
  return ExpShiftSum(x, s, o, n);
}
void ScaleF32(float* x, float s, int64_t n) { Scale(x, s, n); }
void ScaleF64(double* x, double s, int64_t n) { Scale(x, s, n); }
float DotF32(const float* a, const float* b, int64_t n) { return Dot(a, b, n); }
double DotF64(const double* a, const double* b, int64_t n) { return Dot(a, b, n); }
void SoftmaxGradF32(const float* w, const float* g, float c, float* o, int64_t n) {
  SoftmaxGrad(w, g, c, o, n);
}
void SoftmaxGradF64(const double* w, const double* g, double c, double* o, int64_t n) {
  SoftmaxGrad(w, g, c, o, n);
}
float AdditiveScoreF32(const float* q, const float* k, const float* w, int64_t h) {
  return AdditiveScore(q, k, w, h);
}
double AdditiveScoreF64(const double* q, const double* k, const double* w, int64_t h) {
  return AdditiveScore(q, k, w, h);
}
void AdditiveScoreGradF32(const float* q, const float* k, const float* w, int64_t h, float ds,
                          float* df, float* dw) {
  AdditiveScoreGrad(q, k, w, h, ds, df, dw);
}
void AdditiveScoreGradF64(const double* q, const double* k, const double* w, int64_t h, double ds,
                          double* df, double* dw) {
  AdditiveScoreGrad(q, k, w, h, ds, df, dw);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::vecmath
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::vecmath {

HWY_EXPORT(MaxOfF32);
HWY_EXPORT(MaxOfF64);
HWY_EXPORT(ExpShiftSumF32);
HWY_EXPORT(ExpShiftSumF64);
HWY_EXPORT(ScaleF32);
HWY_EXPORT(ScaleF64);
HWY_EXPORT(DotF32);
HWY_EXPORT(DotF64);
HWY_EXPORT(SoftmaxGradF32);
HWY_EXPORT(SoftmaxGradF64);
HWY_EXPORT(AdditiveScoreF32);
HWY_EXPORT(AdditiveScoreF64);
HWY_EXPORT(AdditiveScoreGradF32);
HWY_EXPORT(AdditiveScoreGradF64);

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
void scale(float* x, float s, int64_t n) { HWY_DYNAMIC_DISPATCH(ScaleF32)(x, s, n); }
void scale(double* x, double s, int64_t n) { HWY_DYNAMIC_DISPATCH(ScaleF64)(x, s, n); }
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
float additive_score(const float* q, const float* k, const float* w, int64_t h) {
  return HWY_DYNAMIC_DISPATCH(AdditiveScoreF32)(q, k, w, h);
}
double additive_score(const double* q, const double* k, const double* w, int64_t h) {
  return HWY_DYNAMIC_DISPATCH(AdditiveScoreF64)(q, k, w, h);
}
void additive_score_grad(const float* q, const float* k, const float* w, int64_t h, float ds,
                         float* df, float* dw) {
  HWY_DYNAMIC_DISPATCH(AdditiveScoreGradF32)(q, k, w, h, ds, df, dw);
}
void additive_score_grad(const double* q, const double* k, const double* w, int64_t h, double ds,
                         double* df, double* dw) {
  HWY_DYNAMIC_DISPATCH(AdditiveScoreGradF64)(q, k, w, h, ds, df, dw);
}

}  // namespace qkv::vecmath
#endif  // HWY_ONCE
