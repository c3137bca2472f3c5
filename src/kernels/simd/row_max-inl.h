// The max of a row of scores and whether it holds NaN or +inf, one pass,
// shared by every softmax (masked_softmax's rows through vecmath.cc, the
// online softmax tile of the fused attention kernels). Include after
// hwy/foreach_target.h and hwy/highway.h; compiled once per SIMD target like
// Highway's own -inl.h headers.
#if defined(QKV_KERNELS_ROW_MAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_ROW_MAX_INL_H_
#undef QKV_KERNELS_ROW_MAX_INL_H_
#else
#define QKV_KERNELS_ROW_MAX_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <limits>

#include "kernels/simd/tail-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The max of x[0, n) (-inf when n = 0), and in *nan_or_plus_inf whether
// some element is NaN or +inf: not (x < +inf). -inf is an ordinary score
// here (a masked key, a -inf bias): its weight exp(-inf - max) is exactly 0
// on the exp of exp-inl.h, so a row with some -inf needs no exact path, and
// a row of only -inf has max -inf, which the caller handles. Two max chains
// and a mask OR, all 1-2 cycles deep: the earlier probe (x * 0 summed by
// FMA) made a 4-cycle chain per vector, 16 % of the online softmax's
// samples at AVX2.
template <class D, class T = hn::TFromD<D>>
HWY_INLINE T RowMax(D d, const T* x, size_t n, bool* nan_or_plus_inf) {
  constexpr T kInf = std::numeric_limits<T>::infinity();
  const size_t lanes = hn::Lanes(d);
  const auto plus_inf = hn::Set(d, kInf);
  auto vmax0 = hn::Set(d, -kInf), vmax1 = vmax0;
  auto ok0 = hn::FirstN(d, lanes), ok1 = ok0;  // every lane so far below +inf
  size_t j = 0;
  for (; j + 2 * lanes <= n; j += 2 * lanes) {
    const auto v0 = hn::LoadU(d, x + j);
    const auto v1 = hn::LoadU(d, x + j + lanes);
    vmax0 = hn::Max(vmax0, v0);
    vmax1 = hn::Max(vmax1, v1);
    ok0 = hn::And(ok0, hn::Lt(v0, plus_inf));
    ok1 = hn::And(ok1, hn::Lt(v1, plus_inf));
  }
  for (; j + lanes <= n; j += lanes) {
    const auto v = hn::LoadU(d, x + j);
    vmax0 = hn::Max(vmax0, v);
    ok0 = hn::And(ok0, hn::Lt(v, plus_inf));
  }
  if (j < n) {  // the partial vector, padded with -inf
    const auto v = LoadTail(d, x + j, n - j, -kInf);
    vmax1 = hn::Max(vmax1, v);
    ok1 = hn::And(ok1, hn::Lt(v, plus_inf));
  }
  *nan_or_plus_inf = !hn::AllTrue(d, hn::And(ok0, ok1));
  return hn::GetLane(hn::MaxOfLanes(d, hn::Max(vmax0, vmax1)));
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_ROW_MAX_INL_H_
