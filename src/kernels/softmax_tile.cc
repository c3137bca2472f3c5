// Highway implementation of softmax_tile.h; compiled once per SIMD target
// through hwy/foreach_target.h, dispatching entry points at the bottom.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/softmax_tile.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/highway.h>

#include <cmath>
#include <limits>

#include "kernels/exp-inl.h"
#include "kernels/softmax_tile.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using ::qkv::simd::HWY_NAMESPACE::ExpNonPositive;

template <class T>
void SoftmaxTileUpdate(T* s, int64_t rows, int64_t cols, const int64_t* valid, T* m, T* l,
                       T* correction, uint8_t* special) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  constexpr T kInf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    T* row = s + r * cols;
    const int64_t n = valid[r];
    correction[r] = T(1);
    if (n == 0 || special[r]) {
      std::fill(row, row + cols, T(0));
      continue;
    }
    // Pass 1: max, and x * 0 summed, which is NaN iff some x is NaN or ±inf.
    auto vmax = hn::Set(d, -kInf);
    auto probe = hn::Zero(d);
    const auto zero = hn::Zero(d);
    int64_t j = 0;
    for (; j + lanes <= n; j += lanes) {
      const auto v = hn::LoadU(d, row + j);
      vmax = hn::Max(vmax, v);
      probe = hn::MulAdd(v, zero, probe);
    }
    if (j < n) {
      const auto mask = hn::FirstN(d, static_cast<size_t>(n - j));
      const auto v = hn::MaskedLoad(mask, d, row + j);
      vmax = hn::Max(vmax, hn::IfThenElse(mask, v, hn::Set(d, -kInf)));
      probe = hn::MulAdd(v, zero, probe);
    }
    if (!(hn::GetLane(hn::SumOfLanes(d, probe)) == T(0))) {
      special[r] = 1;
      std::fill(row, row + cols, T(0));
      continue;
    }
    const T m_new = std::max(m[r], hn::GetLane(hn::MaxOfLanes(d, vmax)));
    // Pass 2: exp and sum, masked columns zeroed.
    const auto shift = hn::Set(d, m_new);
    auto sum0 = hn::Zero(d), sum1 = hn::Zero(d);
    j = 0;
    for (; j + 2 * lanes <= n; j += 2 * lanes) {
      const auto e0 = ExpNonPositive(d, hn::Sub(hn::LoadU(d, row + j), shift));
      const auto e1 = ExpNonPositive(d, hn::Sub(hn::LoadU(d, row + j + lanes), shift));
      hn::StoreU(e0, d, row + j);
      hn::StoreU(e1, d, row + j + lanes);
      sum0 = hn::Add(sum0, e0);
      sum1 = hn::Add(sum1, e1);
    }
    for (; j < n; j += lanes) {
      const auto mask = hn::FirstN(d, static_cast<size_t>(n - j));
      const auto e = hn::IfThenElseZero(
          mask, ExpNonPositive(d, hn::Sub(hn::MaskedLoad(mask, d, row + j), shift)));
      hn::BlendedStore(e, mask, d, row + j);
      sum0 = hn::Add(sum0, e);
    }
    std::fill(row + n, row + cols, T(0));
    const T block_sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(sum0, sum1)));
    if (l[r] > T(0) && m_new > m[r]) correction[r] = std::exp(m[r] - m_new);
    l[r] = l[r] * correction[r] + block_sum;
    m[r] = m_new;
  }
}

void SoftmaxTileUpdateF(float* s, int64_t rows, int64_t cols, const int64_t* valid, float* m,
                        float* l, float* correction, uint8_t* special) {
  SoftmaxTileUpdate(s, rows, cols, valid, m, l, correction, special);
}
void SoftmaxTileUpdateD(double* s, int64_t rows, int64_t cols, const int64_t* valid, double* m,
                        double* l, double* correction, uint8_t* special) {
  SoftmaxTileUpdate(s, rows, cols, valid, m, l, correction, special);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels {
HWY_EXPORT(SoftmaxTileUpdateF);
HWY_EXPORT(SoftmaxTileUpdateD);

void softmax_tile_update(float* s, int64_t rows, int64_t cols, const int64_t* valid, float* m,
                         float* l, float* correction, uint8_t* special) {
  HWY_DYNAMIC_DISPATCH(SoftmaxTileUpdateF)(s, rows, cols, valid, m, l, correction, special);
}
void softmax_tile_update(double* s, int64_t rows, int64_t cols, const int64_t* valid, double* m,
                         double* l, double* correction, uint8_t* special) {
  HWY_DYNAMIC_DISPATCH(SoftmaxTileUpdateD)(s, rows, cols, valid, m, l, correction, special);
}
}  // namespace qkv::kernels
#endif
