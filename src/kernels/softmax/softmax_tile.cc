// Highway implementation of softmax_tile.h; compiled once per SIMD target
// through hwy/foreach_target.h, dispatching entry points at the bottom.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/softmax/softmax_tile.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/simd/exp-inl.h"
#include "kernels/simd/row_max-inl.h"
#include "kernels/simd/tail-inl.h"
#include "kernels/softmax/softmax_tile.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using ::qkv::kernels::fast::HWY_NAMESPACE::ExpNonPositive;
using ::qkv::kernels::fast::HWY_NAMESPACE::LoadTail;
using ::qkv::kernels::fast::HWY_NAMESPACE::RowMax;
using ::qkv::kernels::fast::HWY_NAMESPACE::StoreTail;

// bf16 bits of n <= Lanes(d) finite floats v, rounded to nearest even, to out.
template <class D>
HWY_INLINE void StoreBf16(D d, hn::Vec<D> v, uint16_t* out, size_t n) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint16_t, D> du16;
  const auto bits = hn::BitCast(di, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(di, 1));
  // Finite non-negative inputs: the rounded upper half fits in 0..0x7f80.
  const auto upper = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(di, 0x7fff), lsb)));
  const auto half = hn::DemoteTo(du16, upper);
  if (n == hn::Lanes(d)) {
    hn::StoreU(half, du16, out);
  } else {
    hn::BlendedStore(half, hn::FirstN(du16, n), du16, out);
  }
}

// Zeroes out[0, n).
HWY_INLINE void ZeroBf16(uint16_t* out, int64_t n) { std::fill(out, out + n, uint16_t{0}); }

// kScaled (the fused AMX forward): s holds unscaled scores and the softmax
// runs on scale * s; P goes to p16 with its own leading dimension and
// zero-padded width (softmax_tile.h).
template <class T, bool kScaled = false>
void SoftmaxTileUpdate(T* s, int64_t lds, int64_t rows, int64_t cols, const int64_t* valid, T* m,
                       T* l, T* correction, uint8_t* special, uint16_t* p16, T scale, int64_t ldp,
                       int64_t p_cols) {
  static_assert(!kScaled || sizeof(T) == 4, "the scaled form writes bf16 P");
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  constexpr T kInf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    T* row = s + r * lds;
    uint16_t* row16 = p16 ? p16 + r * ldp : nullptr;
    const int64_t n = valid[r];
    correction[r] = T(1);
    if (n == 0 || special[r]) {
      if (row16) {
        ZeroBf16(row16, p_cols);
      } else {
        std::fill(row, row + cols, T(0));
      }
      continue;
    }
    // Pass 1: max, and whether some x is NaN or +inf (row_max-inl.h).
    bool bad = false;
    T row_max = RowMax(d, row, static_cast<size_t>(n), &bad);
    // scale > 0: the max of scale * x is scale * (max of x), bit for bit (x ->
    // scale * x rounded is monotone); it overflows only when the scores are
    // enormous, and such a row takes the exact path like a +inf score.
    if constexpr (kScaled) {
      row_max *= scale;
      bad = bad || row_max == kInf;
    }
    if (bad) {
      special[r] = 1;
      if (row16) {
        ZeroBf16(row16, p_cols);
      } else {
        std::fill(row, row + cols, T(0));
      }
      continue;
    }
    const T m_new = std::max(m[r], row_max);
    if (m_new == -kInf) {  // every score so far is -inf: nothing to add yet
      if (row16) {
        ZeroBf16(row16, p_cols);
      } else {
        std::fill(row, row + cols, T(0));
      }
      continue;
    }
    // Pass 2: exp and sum, masked columns zeroed. With 32 registers
    // (AVX-512) two vectors a step with a sum each; with 16 (AVX2 and below)
    // the second vector's temporaries and sum beside the exp's constants went
    // to the stack (a chain through memory at every step, 10 % of this
    // function's samples), so one vector a step: SDPA forward at (2, 4096,
    // 4096), d = 64, one thread, capped at avx2, 102-106 -> 98-103 ms; at
    // AVX-512 one vector a step was 2 % slower.
    const auto shift = hn::Set(d, m_new);
    const auto scale_v = hn::Set(d, scale);
    // The exp's argument: x - m, or with the scale folded in, scale x - m
    // (one fused multiply-subtract where the target has FMA).
    const auto arg = [&](auto x) {
      if constexpr (kScaled) {
        return hn::MulSub(x, scale_v, shift);
      } else {
        (void)scale_v;
        return hn::Sub(x, shift);
      }
    };
    auto sum0 = hn::Zero(d), sum1 = hn::Zero(d);
    int64_t j = 0;
    if constexpr (hn::MaxLanes(d) * sizeof(T) >= 64) {
      for (; j + 2 * lanes <= n; j += 2 * lanes) {
        const auto e0 = ExpNonPositive<true>(d, arg(hn::LoadU(d, row + j)));
        const auto e1 = ExpNonPositive<true>(d, arg(hn::LoadU(d, row + j + lanes)));
        if constexpr (sizeof(T) == 4) {
          if (row16) {
            StoreBf16(d, e0, row16 + j, static_cast<size_t>(lanes));
            StoreBf16(d, e1, row16 + j + lanes, static_cast<size_t>(lanes));
          }
        }
        if (!row16) {
          hn::StoreU(e0, d, row + j);
          hn::StoreU(e1, d, row + j + lanes);
        }
        sum0 = hn::Add(sum0, e0);
        sum1 = hn::Add(sum1, e1);
      }
    }
    for (; j + lanes <= n; j += lanes) {
      const auto e = ExpNonPositive<true>(d, arg(hn::LoadU(d, row + j)));
      if constexpr (sizeof(T) == 4) {
        if (row16) StoreBf16(d, e, row16 + j, static_cast<size_t>(lanes));
      }
      if (!row16) hn::StoreU(e, d, row + j);
      sum0 = hn::Add(sum0, e);
    }
    if (j < n) {
      const auto count = static_cast<size_t>(n - j);
      const auto e = hn::IfThenElseZero(hn::FirstN(d, count),
                                        ExpNonPositive<true>(d, arg(LoadTail(d, row + j, count))));
      if constexpr (sizeof(T) == 4) {
        if (row16) StoreBf16(d, e, row16 + j, count);
      }
      if (!row16) StoreTail(d, e, row + j, count);
      sum1 = hn::Add(sum1, e);
    }
    if (row16) {
      ZeroBf16(row16 + n, p_cols - n);
    } else {
      std::fill(row + n, row + cols, T(0));
    }
    const T block_sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(sum0, sum1)));
    if (l[r] > T(0) && m_new > m[r]) correction[r] = std::exp(m[r] - m_new);
    l[r] = l[r] * correction[r] + block_sum;
    m[r] = m_new;
  }
}

void SoftmaxTileUpdateF(float* s, int64_t rows, int64_t cols, const int64_t* valid, float* m,
                        float* l, float* correction, uint8_t* special, uint16_t* p16) {
  SoftmaxTileUpdate(s, cols, rows, cols, valid, m, l, correction, special, p16, 1.0f, cols, cols);
}
void SoftmaxTileUpdateScaledF(const float* s, int64_t lds, int64_t rows, int64_t cols,
                              const int64_t* valid, float scale, float* m, float* l,
                              float* correction, uint8_t* special, uint16_t* p16, int64_t ldp,
                              int64_t p_cols) {
  // s is only read: P goes to p16.
  SoftmaxTileUpdate<float, true>(const_cast<float*>(s), lds, rows, cols, valid, m, l, correction,
                                 special, p16, scale, ldp, p_cols);
}
void SoftmaxTileUpdateD(double* s, int64_t rows, int64_t cols, const int64_t* valid, double* m,
                        double* l, double* correction, uint8_t* special) {
  SoftmaxTileUpdate(s, cols, rows, cols, valid, m, l, correction, special,
                    static_cast<uint16_t*>(nullptr), 1.0, cols, cols);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels::fast {
HWY_EXPORT(SoftmaxTileUpdateF);
HWY_EXPORT(SoftmaxTileUpdateD);
HWY_EXPORT(SoftmaxTileUpdateScaledF);

void softmax_tile_update(float* s, int64_t rows, int64_t cols, const int64_t* valid, float* m,
                         float* l, float* correction, uint8_t* special, bfloat16* p_bf16) {
  HWY_DYNAMIC_DISPATCH(SoftmaxTileUpdateF)
  (s, rows, cols, valid, m, l, correction, special, reinterpret_cast<uint16_t*>(p_bf16));
}
void softmax_tile_update_scaled(const float* s, int64_t lds, int64_t rows, int64_t cols,
                                const int64_t* valid, float scale, float* m, float* l,
                                float* correction, uint8_t* special, bfloat16* p_bf16, int64_t ldp,
                                int64_t p_cols) {
  HWY_DYNAMIC_DISPATCH(SoftmaxTileUpdateScaledF)
  (s, lds, rows, cols, valid, scale, m, l, correction, special, reinterpret_cast<uint16_t*>(p_bf16),
   ldp, p_cols);
}
void softmax_tile_update(double* s, int64_t rows, int64_t cols, const int64_t* valid, double* m,
                         double* l, double* correction, uint8_t* special) {
  HWY_DYNAMIC_DISPATCH(SoftmaxTileUpdateD)(s, rows, cols, valid, m, l, correction, special);
}
}  // namespace qkv::kernels::fast
#endif
