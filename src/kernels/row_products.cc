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

// c + a b as the vector lanes compute it (one fused multiply-add where the
// target has FMA), for the scalar tails: left to the compiler, `c += a * b`
// was contracted in some instantiations and not others, so a row's bits
// depended on how many rows shared its task.
template <class T>
HWY_INLINE T MulAddLane(T a, T b, T c) {
  const hn::CappedTag<T, 1> d1;
  return hn::GetLane(hn::MulAdd(hn::Set(d1, a), hn::Set(d1, b), hn::Set(d1, c)));
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
void ScoresR(int64_t cols, int64_t d_len, T alpha, const T* HWY_RESTRICT q, int64_t ldq,
             const In* HWY_RESTRICT k, int64_t ldk, T* HWY_RESTRICT s, int64_t lds) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t vec_end = d_len - d_len % lanes;
  int64_t j = 0;
  for (; j + 2 <= cols; j += 2) {
    const In* k0 = k + j * ldk;
    const In* k1 = k0 + ldk;
    hn::Vec<decltype(d)> acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = hn::Zero(d);
    for (int64_t e = 0; e < vec_end; e += lanes) {
      const auto kv0 = LoadRow(d, k0 + e);
      const auto kv1 = LoadRow(d, k1 + e);
      for (int r = 0; r < R; ++r) {
        const auto qv = hn::LoadU(d, q + r * ldq + e);
        acc0[r] = hn::MulAdd(qv, kv0, acc0[r]);
        acc1[r] = hn::MulAdd(qv, kv1, acc1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      T sum0 = hn::GetLane(hn::SumOfLanes(d, acc0[r]));
      T sum1 = hn::GetLane(hn::SumOfLanes(d, acc1[r]));
      for (int64_t e = vec_end; e < d_len; ++e) {
        sum0 = MulAddLane(q[r * ldq + e], Widen(k0[e]), sum0);
        sum1 = MulAddLane(q[r * ldq + e], Widen(k1[e]), sum1);
      }
      s[r * lds + j] = alpha * sum0;
      s[r * lds + j + 1] = alpha * sum1;
    }
  }
  if (j < cols) {
    const In* k0 = k + j * ldk;
    hn::Vec<decltype(d)> acc0[R];
    for (int r = 0; r < R; ++r) acc0[r] = hn::Zero(d);
    for (int64_t e = 0; e < vec_end; e += lanes) {
      const auto kv0 = LoadRow(d, k0 + e);
      for (int r = 0; r < R; ++r)
        acc0[r] = hn::MulAdd(hn::LoadU(d, q + r * ldq + e), kv0, acc0[r]);
    }
    for (int r = 0; r < R; ++r) {
      T sum0 = hn::GetLane(hn::SumOfLanes(d, acc0[r]));
      for (int64_t e = vec_end; e < d_len; ++e) sum0 = MulAddLane(q[r * ldq + e], Widen(k0[e]), sum0);
      s[r * lds + j] = alpha * sum0;
    }
  }
}

template <class T, class In>
void Scores(int64_t rows, int64_t cols, int64_t d_len, T alpha, const T* q, int64_t ldq,
            const In* k, int64_t ldk, T* s, int64_t lds) {
  switch (rows) {
    case 1:
      return ScoresR<1>(cols, d_len, alpha, q, ldq, k, ldk, s, lds);
    case 2:
      return ScoresR<2>(cols, d_len, alpha, q, ldq, k, ldk, s, lds);
    case 3:
      return ScoresR<3>(cols, d_len, alpha, q, ldq, k, ldk, s, lds);
    case 4:
      return ScoresR<4>(cols, d_len, alpha, q, ldq, k, ldk, s, lds);
    default:
      HWY_ASSERT(rows == 0);
  }
}

// o_r += sum_j p_rj v_j over NV vectors of columns [c0, c0 + NV Lanes) for
// R rows: R x NV accumulators stay in registers over all keys, each value
// vector is loaded once and feeds R FMAs.
template <int R, int NV, class T, class In>
HWY_INLINE void AccumulateColumns(int64_t cols, int64_t c0, const T* HWY_RESTRICT p, int64_t ldp,
                                  const In* HWY_RESTRICT v, int64_t ldv, T* HWY_RESTRICT o,
                                  int64_t ldo) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<decltype(d)> acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = hn::LoadU(d, o + r * ldo + c0 + c * lanes);
  }
  for (int64_t j = 0; j < cols; ++j) {
    hn::Vec<decltype(d)> vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = LoadRow(d, v + j * ldv + c0 + c * lanes);
    for (int r = 0; r < R; ++r) {
      const auto pr = hn::Set(d, p[r * ldp + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = hn::MulAdd(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) hn::StoreU(acc[r][c], d, o + r * ldo + c0 + c * lanes);
  }
}

// Column blocks of NV vectors with NV R <= 8 accumulators (AVX2 has 16
// registers: 8 accumulators, the value vectors and a broadcast fit; AVX-512's
// 32 take 16), the
// last block as wide as the vectors left (a narrower block would read every
// value row once more: at d = 64 on AVX-512, 4 passes of one vector took
// B=8, Nq=1, Nk=131072 from 17 to 26 ms), then the dv % Lanes last columns in
// scalar code.
template <int R, int NV, class T, class In>
HWY_INLINE void AccumulateUpTo(int64_t nv, int64_t cols, int64_t c0, const T* p, int64_t ldp,
                               const In* v, int64_t ldv, T* o, int64_t ldo) {
  if constexpr (NV > 1) {
    if (nv < NV) return AccumulateUpTo<R, NV - 1>(nv, cols, c0, p, ldp, v, ldv, o, ldo);
  }
  AccumulateColumns<R, NV>(cols, c0, p, ldp, v, ldv, o, ldo);
}

template <int R, class T, class In>
void AccumulateR(int64_t cols, int64_t dv, const T* p, int64_t ldp, const In* v, int64_t ldv, T* o,
                 int64_t ldo) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // 32 registers: up to 16 accumulators. B=1, H=32 query heads on Hkv=8,
  // Nq=1, Nk=65536, d=128 (4 rows a task), 2 threads, medians of 15, three
  // alternating runs: 23.6-27.5 ms against 30.3-38.9 ms with AVX2's limit.
  constexpr int kNV = R == 1 ? 8 : R == 2 ? 8 : 4;
#else
  constexpr int kNV = R == 1 ? 8 : R == 2 ? 4 : 2;
#endif
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t vectors = dv / lanes;
  for (int64_t done = 0; done < vectors;) {
    const int64_t nv = std::min<int64_t>(kNV, vectors - done);
    AccumulateUpTo<R, kNV>(nv, cols, done * lanes, p, ldp, v, ldv, o, ldo);
    done += nv;
  }
  for (int64_t c0 = vectors * lanes; c0 < dv; ++c0) {
    for (int r = 0; r < R; ++r) {
      T sum = o[r * ldo + c0];
      for (int64_t j = 0; j < cols; ++j) sum = MulAddLane(p[r * ldp + j], Widen(v[j * ldv + c0]), sum);
      o[r * ldo + c0] = sum;
    }
  }
}

template <class T, class In>
void Accumulate(int64_t rows, int64_t cols, int64_t dv, const T* p, int64_t ldp, const In* v,
                int64_t ldv, T* o, int64_t ldo) {
  switch (rows) {
    case 1:
      return AccumulateR<1>(cols, dv, p, ldp, v, ldv, o, ldo);
    case 2:
      return AccumulateR<2>(cols, dv, p, ldp, v, ldv, o, ldo);
    case 3:
      return AccumulateR<3>(cols, dv, p, ldp, v, ldv, o, ldo);
    case 4:
      return AccumulateR<4>(cols, dv, p, ldp, v, ldv, o, ldo);
    default:
      HWY_ASSERT(rows == 0);
  }
}

static_assert(kRowProductRows == 4, "Scores and Accumulate instantiate rows 1 to 4");

void RowScoresF(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, int64_t ldq,
                const float* k, int64_t ldk, float* s, int64_t lds) {
  Scores(rows, cols, d, alpha, q, ldq, k, ldk, s, lds);
}
void RowScoresB(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, int64_t ldq,
                const uint16_t* k, int64_t ldk, float* s, int64_t lds) {
  Scores(rows, cols, d, alpha, q, ldq, k, ldk, s, lds);
}
void RowScoresD(int64_t rows, int64_t cols, int64_t d, double alpha, const double* q, int64_t ldq,
                const double* k, int64_t ldk, double* s, int64_t lds) {
  Scores(rows, cols, d, alpha, q, ldq, k, ldk, s, lds);
}
void RowAccumulateF(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const float* v, int64_t ldv, float* o, int64_t ldo) {
  Accumulate(rows, cols, dv, p, ldp, v, ldv, o, ldo);
}
void RowAccumulateB(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const uint16_t* v, int64_t ldv, float* o, int64_t ldo) {
  Accumulate(rows, cols, dv, p, ldp, v, ldv, o, ldo);
}
void RowAccumulateD(int64_t rows, int64_t cols, int64_t dv, const double* p, int64_t ldp,
                    const double* v, int64_t ldv, double* o, int64_t ldo) {
  Accumulate(rows, cols, dv, p, ldp, v, ldv, o, ldo);
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

void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q,
                int64_t ldq, const float* k, int64_t ldk, float* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresF)(rows, cols, d, alpha, q, ldq, k, ldk, s, lds);
}
void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q,
                int64_t ldq, const bfloat16* k, int64_t ldk, float* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresB)
  (rows, cols, d, alpha, q, ldq, reinterpret_cast<const uint16_t*>(k), ldk, s, lds);
}
void row_scores(int64_t rows, int64_t cols, int64_t d, double alpha, const double* q,
                int64_t ldq, const double* k, int64_t ldk, double* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresD)(rows, cols, d, alpha, q, ldq, k, ldk, s, lds);
}
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const float* v, int64_t ldv, float* o, int64_t ldo) {
  HWY_DYNAMIC_DISPATCH(RowAccumulateF)(rows, cols, dv, p, ldp, v, ldv, o, ldo);
}
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const float* p, int64_t ldp,
                    const bfloat16* v, int64_t ldv, float* o, int64_t ldo) {
  HWY_DYNAMIC_DISPATCH(RowAccumulateB)
  (rows, cols, dv, p, ldp, reinterpret_cast<const uint16_t*>(v), ldv, o, ldo);
}
void row_accumulate(int64_t rows, int64_t cols, int64_t dv, const double* p, int64_t ldp,
                    const double* v, int64_t ldv, double* o, int64_t ldo) {
  HWY_DYNAMIC_DISPATCH(RowAccumulateD)(rows, cols, dv, p, ldp, v, ldv, o, ldo);
}
}  // namespace qkv::kernels::fast
#endif
