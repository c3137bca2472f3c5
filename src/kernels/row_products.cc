// Highway implementation of row_products.h; compiled once per SIMD target
// through hwy/foreach_target.h, dispatching entry points at the bottom.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/row_products.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/row_products.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// One element of a key or value row in the accumulation type T: bf16 rows
// arrive as their uint16_t bits, widened exactly (the bits become the upper
// half of a float).
template <class T>
HWY_INLINE T Widen(T x) {
  return x;
}
HWY_INLINE float Widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}

// Lanes(d) consecutive elements of a row as a vector of T.
template <class D>
HWY_INLINE hn::Vec<D> LoadRow(D d, const hn::TFromD<D>* p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE hn::Vec<D> LoadRow(D d, const uint16_t* p) {
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint16_t, D> d16;
  return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, p))));
}

// s[r * lds + j] = alpha q_r . k_j for R rows, two keys at a time (2R
// independent FMA chains: one key alone would leave d/Lanes FMAs in a chain).
// The d % Lanes last elements are summed in scalar code after the lanes.
template <int R, class T, class In>
void ScoresR(int64_t cols, int64_t d_len, T alpha, const T* HWY_RESTRICT q,
             const In* HWY_RESTRICT k, T* HWY_RESTRICT s, int64_t lds) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t vec_end = d_len - d_len % lanes;
  int64_t j = 0;
  for (; j + 2 <= cols; j += 2) {
    const In* k0 = k + j * d_len;
    const In* k1 = k0 + d_len;
    hn::Vec<decltype(d)> acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = hn::Zero(d);
    for (int64_t e = 0; e < vec_end; e += lanes) {
      const auto kv0 = LoadRow(d, k0 + e);
      const auto kv1 = LoadRow(d, k1 + e);
      for (int r = 0; r < R; ++r) {
        const auto qv = hn::LoadU(d, q + r * d_len + e);
        acc0[r] = hn::MulAdd(qv, kv0, acc0[r]);
        acc1[r] = hn::MulAdd(qv, kv1, acc1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      T sum0 = hn::GetLane(hn::SumOfLanes(d, acc0[r]));
      T sum1 = hn::GetLane(hn::SumOfLanes(d, acc1[r]));
      for (int64_t e = vec_end; e < d_len; ++e) {
        sum0 += q[r * d_len + e] * Widen(k0[e]);
        sum1 += q[r * d_len + e] * Widen(k1[e]);
      }
      s[r * lds + j] = alpha * sum0;
      s[r * lds + j + 1] = alpha * sum1;
    }
  }
  if (j < cols) {
    const In* k0 = k + j * d_len;
    hn::Vec<decltype(d)> acc0[R];
    for (int r = 0; r < R; ++r) acc0[r] = hn::Zero(d);
    for (int64_t e = 0; e < vec_end; e += lanes) {
      const auto kv0 = LoadRow(d, k0 + e);
      for (int r = 0; r < R; ++r)
        acc0[r] = hn::MulAdd(hn::LoadU(d, q + r * d_len + e), kv0, acc0[r]);
    }
    for (int r = 0; r < R; ++r) {
      T sum0 = hn::GetLane(hn::SumOfLanes(d, acc0[r]));
      for (int64_t e = vec_end; e < d_len; ++e) sum0 += q[r * d_len + e] * Widen(k0[e]);
      s[r * lds + j] = alpha * sum0;
    }
  }
}

template <class T, class In>
void Scores(int64_t rows, int64_t cols, int64_t d_len, T alpha, const T* q, const In* k, T* s,
            int64_t lds) {
  switch (rows) {
    case 1:
      return ScoresR<1>(cols, d_len, alpha, q, k, s, lds);
    case 2:
      return ScoresR<2>(cols, d_len, alpha, q, k, s, lds);
    case 3:
      return ScoresR<3>(cols, d_len, alpha, q, k, s, lds);
    case 4:
      return ScoresR<4>(cols, d_len, alpha, q, k, s, lds);
    default:
      HWY_ASSERT(rows == 0);
  }
}

// o_r += sum_j p_rj v_j over NV vectors of columns [c0, c0 + NV Lanes) for
// R rows: R x NV accumulators stay in registers over all keys, each value
// vector is loaded once and feeds R FMAs.
template <int R, int NV, class T, class In>
HWY_INLINE void AccumulateColumns(int64_t cols, int64_t dv, int64_t c0, const T* HWY_RESTRICT p,
                                  int64_t ldp, const In* HWY_RESTRICT v, T* HWY_RESTRICT o) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<decltype(d)> acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = hn::LoadU(d, o + r * dv + c0 + c * lanes);
  }
  for (int64_t j = 0; j < cols; ++j) {
    hn::Vec<decltype(d)> vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = LoadRow(d, v + j * dv + c0 + c * lanes);
    for (int r = 0; r < R; ++r) {
      const auto pr = hn::Set(d, p[r * ldp + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = hn::MulAdd(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) hn::StoreU(acc[r][c], d, o + r * dv + c0 + c * lanes);
  }
}

// Column blocks of NV vectors with NV R <= 8 accumulators (AVX2 has 16
// registers: 8 accumulators, the value vectors and a broadcast fit), the
// last block as wide as the vectors left (a narrower block would read every
// value row once more: at d = 64 on AVX-512, 4 passes of one vector took
// B=8, Nq=1, Nk=131072 from 17 to 26 ms), then the dv % Lanes last columns in
// scalar code.
template <int R, int NV, class T, class In>
HWY_INLINE void AccumulateUpTo(int64_t nv, int64_t cols, int64_t dv, int64_t c0, const T* p,
                               int64_t ldp, const In* v, T* o) {
  if constexpr (NV > 1) {
    if (nv < NV) return AccumulateUpTo<R, NV - 1>(nv, cols, dv, c0, p, ldp, v, o);
  }
  AccumulateColumns<R, NV>(cols, dv, c0, p, ldp, v, o);
}

template <int R, class T, class In>
void AccumulateR(int64_t cols, int64_t dv, const T* p, int64_t ldp, const In* v, T* o) {
  constexpr int kNV = R == 1 ? 8 : R == 2 ? 4 : 2;
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t vectors = dv / lanes;
  for (int64_t done = 0; done < vectors;) {
    const int64_t nv = std::min<int64_t>(kNV, vectors - done);
    AccumulateUpTo<R, kNV>(nv, cols, dv, done * lanes, p, ldp, v, o);
    done += nv;
  }
  for (int64_t c0 = vectors * lanes; c0 < dv; ++c0) {
    for (int r = 0; r < R; ++r) {
      T sum = o[r * dv + c0];
      for (int64_t j = 0; j < cols; ++j) sum += p[r * ldp + j] * Widen(v[j * dv + c0]);
      o[r * dv + c0] = sum;
    }
  }
}

template <class T, class In>
void Accumulate(int64_t rows, int64_t cols, int64_t dv, const T* p, int64_t ldp, const In* v,
                T* o) {
  switch (rows) {
    case 1:
      return AccumulateR<1>(cols, dv, p, ldp, v, o);
    case 2:
      return AccumulateR<2>(cols, dv, p, ldp, v, o);
    case 3:
      return AccumulateR<3>(cols, dv, p, ldp, v, o);
    case 4:
      return AccumulateR<4>(cols, dv, p, ldp, v, o);
    default:
      HWY_ASSERT(rows == 0);
  }
}

static_assert(kRowProductRows == 4, "Scores and Accumulate instantiate rows 1 to 4");

void RowScoresF(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, const float* k,
                float* s, int64_t lds) {
  Scores(rows, cols, d, alpha, q, k, s, lds);
}
void RowScoresB(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q,
                const uint16_t* k, float* s, int64_t lds) {
  Scores(rows, cols, d, alpha, q, k, s, lds);
}
void RowScoresD(int64_t rows, int64_t cols, int64_t d, double alpha, const double* q,
                const double* k, double* s, int64_t lds) {
  Scores(rows, cols, d, alpha, q, k, s, lds);
}
void RowAccumulateF(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const float* v, float* o) {
  Accumulate(rows, cols, dv, p, ldp, v, o);
}
void RowAccumulateB(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const uint16_t* v, float* o) {
  Accumulate(rows, cols, dv, p, ldp, v, o);
}
void RowAccumulateD(int64_t rows, int64_t cols, int64_t dv, const double* p, int64_t ldp,
                    const double* v, double* o) {
  Accumulate(rows, cols, dv, p, ldp, v, o);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels::fast {
HWY_EXPORT(RowScoresF);
HWY_EXPORT(RowScoresB);
HWY_EXPORT(RowScoresD);
HWY_EXPORT(RowAccumulateF);
HWY_EXPORT(RowAccumulateB);
HWY_EXPORT(RowAccumulateD);

void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, const float* k,
                float* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresF)(rows, cols, d, alpha, q, k, s, lds);
}
void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q,
                const bfloat16* k, float* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresB)
  (rows, cols, d, alpha, q, reinterpret_cast<const uint16_t*>(k), s, lds);
}
void row_scores(int64_t rows, int64_t cols, int64_t d, double alpha, const double* q,
                const double* k, double* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresD)(rows, cols, d, alpha, q, k, s, lds);
}
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const float* v, float* o) {
  HWY_DYNAMIC_DISPATCH(RowAccumulateF)(rows, cols, dv, p, ldp, v, o);
}
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const bfloat16* v, float* o) {
  HWY_DYNAMIC_DISPATCH(RowAccumulateB)
  (rows, cols, dv, p, ldp, reinterpret_cast<const uint16_t*>(v), o);
}
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const double* p, int64_t ldp,
                    const double* v, double* o) {
  HWY_DYNAMIC_DISPATCH(RowAccumulateD)(rows, cols, dv, p, ldp, v, o);
}
}  // namespace qkv::kernels::fast
#endif
