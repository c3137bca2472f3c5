// Partial vectors for Highway kernels: the first n < Lanes(d) elements of a
// row in and out, touching nothing past them. Include after
// hwy/foreach_target.h and hwy/highway.h; compiled once per SIMD target like
// Highway's own -inl.h headers.
//
// Why not hn::MaskedLoad: in Highway 1.0.3 it is an *aligned full-vector*
// load below AVX2 (SSE4, scalar), so on a row's unaligned tail it
// faults (movaps) or reads past the row; only AVX2's vmaskmov and AVX-512's
// masked moves are safe there. A copy through an aligned buffer is safe on
// every target and costs a few cycles once per row.
#if defined(QKV_KERNELS_TAIL_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_TAIL_INL_H_
#undef QKV_KERNELS_TAIL_INL_H_
#else
#define QKV_KERNELS_TAIL_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// x[0, n) in the first n lanes, `pad` in the others; never reads x[n].
template <class D, class T = hn::TFromD<D>>
HWY_INLINE hn::Vec<D> LoadTail(D d, const T* x, size_t n, T pad = T(0)) {
  HWY_ALIGN T buf[hn::MaxLanes(d)];
  for (size_t i = 0; i < hn::Lanes(d); ++i) buf[i] = i < n ? x[i] : pad;
  return hn::Load(d, buf);
}

// The first n lanes of v to out[0, n); never touches out[n].
template <class D, class T = hn::TFromD<D>>
HWY_INLINE void StoreTail(D d, hn::Vec<D> v, T* out, size_t n) {
  HWY_ALIGN T buf[hn::MaxLanes(d)];
  hn::Store(v, d, buf);
  for (size_t i = 0; i < n; ++i) out[i] = buf[i];
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_TAIL_INL_H_
