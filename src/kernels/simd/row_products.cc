// Highway implementation of row_products.h; compiled once per SIMD target
// through hwy/foreach_target.h, dispatching entry points at the bottom.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/row_products.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/simd/row_products.h"

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

#if HWY_TARGET != HWY_SCALAR
// The 128-bit blocks of v added together, lower half + upper half each step.
template <class D>
HWY_INLINE hn::Vec<hn::Full128<float>> FoldBlocks(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) * sizeof(float) > 16) {
    const hn::Half<D> dh;
    return FoldBlocks(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    (void)d;
    return v;
  }
}

// The lane sums of a, b, c, e as the 4 lanes of one 128-bit vector: lanes
// paired across the vectors inside each 128-bit block (6 shuffles, 3 adds for
// 4 sums), then the blocks folded in halves. SumOfLanes per vector took 4.5
// ns a key and row at d = 128 on AVX-512 (Zen 4): more than the key's 8 FMAs.
template <class D>
HWY_INLINE hn::Vec<hn::Full128<float>> SumsOf4(D d, hn::Vec<D> a, hn::Vec<D> b, hn::Vec<D> c,
                                               hn::Vec<D> e) {
  const hn::Repartition<double, D> dd;
  // Per block: a0+a2, b0+b2, a1+a3, b1+b3 (and c, e alike).
  const auto ab = hn::Add(hn::InterleaveLower(d, a, b), hn::InterleaveUpper(d, a, b));
  const auto ce = hn::Add(hn::InterleaveLower(d, c, e), hn::InterleaveUpper(d, c, e));
  // Per block: the block's sums of a, b, c, e.
  const auto sums =
      hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, hn::BitCast(dd, ab), hn::BitCast(dd, ce))),
              hn::BitCast(d, hn::InterleaveUpper(dd, hn::BitCast(dd, ab), hn::BitCast(dd, ce))));
  return FoldBlocks(d, sums);
}

#endif  // HWY_TARGET != HWY_SCALAR

// sums[i] = the lane sum of the i-th of a, b, c, e. Float (but on the one-lane
// scalar target) through SumsOf4, the order ScoresGrouped sums in, so a row's
// bits do not depend on the rows beside it whichever kernel its task takes.
// Double lane by lane.
template <class D>
HWY_INLINE void LaneSums(D d, hn::Vec<D> a, hn::Vec<D> b, hn::Vec<D> c, hn::Vec<D> e,
                         hn::TFromD<D>* sums) {
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_same_v<hn::TFromD<D>, float>) {
    hn::StoreU(SumsOf4(d, a, b, c, e), hn::Full128<float>(), sums);
    return;
  }
#endif
  sums[0] = hn::GetLane(hn::SumOfLanes(d, a));
  sums[1] = hn::GetLane(hn::SumOfLanes(d, b));
  sums[2] = hn::GetLane(hn::SumOfLanes(d, c));
  sums[3] = hn::GetLane(hn::SumOfLanes(d, e));
}

// Rows this far ahead of the one being read are asked into the cache
// (PrefetchRows).
constexpr int64_t kPrefetchRows = 16;

// Asks the cache for `rows` rows of `len` elements, `ld` apart, from `p`:
// prefetches past the end of a tensor are harmless (never fault).
template <class In>
HWY_INLINE void PrefetchRows(const In* p, int64_t rows, int64_t ld, int64_t len) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * ld);
    for (int64_t b = 0; b < len * static_cast<int64_t>(sizeof(In)); b += 64) {
      hwy::Prefetch(row + b);
    }
  }
}

// s[r * lds + j] = alpha q_r . k_j for R rows, two keys at a time (2R
// independent FMA chains: one key alone would leave d/Lanes FMAs in a chain).
// The d % Lanes last elements are summed in scalar code after the lanes. Up
// to 4 rows (float above 4 rows goes to ScoresGrouped: see Scores).
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
    PrefetchRows(k0 + kPrefetchRows * ldk, 2, ldk, d_len);
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
    // Rows in pairs (the last one twice when R is odd): 4 sums at once.
    for (int r = 0; r < R; r += 2) {
      const int r1 = r + 1 < R ? r + 1 : r;
      HWY_ALIGN T sum[4];
      LaneSums(d, acc0[r], acc1[r], acc0[r1], acc1[r1], sum);
      for (int64_t e = vec_end; e < d_len; ++e) {
        sum[0] = MulAddLane(q[r * ldq + e], Widen(k0[e]), sum[0]);
        sum[1] = MulAddLane(q[r * ldq + e], Widen(k1[e]), sum[1]);
        sum[2] = MulAddLane(q[r1 * ldq + e], Widen(k0[e]), sum[2]);
        sum[3] = MulAddLane(q[r1 * ldq + e], Widen(k1[e]), sum[3]);
      }
      s[r * lds + j] = alpha * sum[0];
      s[r * lds + j + 1] = alpha * sum[1];
      s[r1 * lds + j] = alpha * sum[2];
      s[r1 * lds + j + 1] = alpha * sum[3];
    }
  }
  if (j < cols) {
    const In* k0 = k + j * ldk;
    hn::Vec<decltype(d)> acc0[R];
    for (int r = 0; r < R; ++r) acc0[r] = hn::Zero(d);
    for (int64_t e = 0; e < vec_end; e += lanes) {
      const auto kv0 = LoadRow(d, k0 + e);
      for (int r = 0; r < R; ++r) acc0[r] = hn::MulAdd(hn::LoadU(d, q + r * ldq + e), kv0, acc0[r]);
    }
    for (int r = 0; r < R; r += 2) {
      const int r1 = r + 1 < R ? r + 1 : r;
      HWY_ALIGN T sum[4];
      LaneSums(d, acc0[r], acc0[r1], acc0[r], acc0[r1], sum);
      for (int64_t e = vec_end; e < d_len; ++e) {
        sum[0] = MulAddLane(q[r * ldq + e], Widen(k0[e]), sum[0]);
        sum[1] = MulAddLane(q[r1 * ldq + e], Widen(k0[e]), sum[1]);
      }
      s[r * lds + j] = alpha * sum[0];
      s[r1 * lds + j] = alpha * sum[1];
    }
  }
}

#if HWY_TARGET != HWY_SCALAR
// The scores of RB rows (q, rows ldq apart; s, rows lds apart) with the 4
// keys kr (the first `keys` of them wanted): RB x 4 accumulators, each row's
// 4 sums formed together (SumsOf4). The d % Lanes last elements are summed
// in scalar code.
template <int RB, class In>
HWY_INLINE void ScoreRowsOf4Keys(int64_t d_len, int64_t keys, float alpha,
                                 const float* HWY_RESTRICT q, int64_t ldq, const In* const* kr,
                                 float* HWY_RESTRICT s, int64_t lds) {
  const hn::ScalableTag<float> d;
  const hn::Full128<float> d4;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const int64_t vec_end = d_len - d_len % lanes;
  hn::Vec<decltype(d)> acc[RB][4];
  for (int r = 0; r < RB; ++r) {
    for (int g = 0; g < 4; ++g) acc[r][g] = hn::Zero(d);
  }
  for (int64_t e = 0; e < vec_end; e += lanes) {
    hn::Vec<decltype(d)> kv[4];
    for (int g = 0; g < 4; ++g) kv[g] = LoadRow(d, kr[g] + e);
    for (int r = 0; r < RB; ++r) {
      const auto qv = hn::LoadU(d, q + r * ldq + e);
      for (int g = 0; g < 4; ++g) acc[r][g] = hn::MulAdd(qv, kv[g], acc[r][g]);
    }
  }
  if (vec_end == d_len && keys == 4) {
    HWY_UNROLL(4)
    for (int r = 0; r < RB; ++r) {
      const auto sums = SumsOf4(d, acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      hn::StoreU(hn::Mul(sums, hn::Set(d4, alpha)), d4, s + r * lds);
    }
    return;
  }
  for (int r = 0; r < RB; ++r) {
    const auto sums = SumsOf4(d, acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    HWY_ALIGN float sum[4];
    hn::Store(sums, d4, sum);
    for (int64_t g = 0; g < keys; ++g) {
      for (int64_t e = vec_end; e < d_len; ++e) {
        sum[g] = MulAddLane(q[r * ldq + e], Widen(kr[g][e]), sum[g]);
      }
      s[r * lds + g] = alpha * sum[g];
    }
  }
}

// The float scores of `rows` rows, four keys at a time: blocks of up to 4
// rows x 4 keys of accumulators on AVX-512's 32 registers (2 rows on AVX2's
// and SSE4's 16), each block of rows in turn on the same four keys (in L1 by
// then). A last group of fewer keys repeats its last key and keeps the sums
// it needs, so a key's bits do not depend on where the block ends, nor a
// row's on the rows beside it.
template <class In>
void ScoresGrouped(int64_t rows, int64_t cols, int64_t d_len, float alpha,
                   const float* HWY_RESTRICT q, int64_t ldq, const In* HWY_RESTRICT k, int64_t ldk,
                   float* HWY_RESTRICT s, int64_t lds) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  constexpr int64_t kRowBlock = 4;
#else
  constexpr int64_t kRowBlock = 2;
#endif
  for (int64_t j = 0; j < cols; j += 4) {
    const In* kr[4];
    for (int g = 0; g < 4; ++g) kr[g] = k + std::min<int64_t>(j + g, cols - 1) * ldk;
    PrefetchRows(k + (j + kPrefetchRows) * ldk, 4, ldk, d_len);
    const int64_t keys = std::min<int64_t>(4, cols - j);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const float* q_blk = q + r0 * ldq;
      float* s_blk = s + r0 * lds + j;
      switch (std::min(kRowBlock, rows - r0)) {
        case 1:
          ScoreRowsOf4Keys<1>(d_len, keys, alpha, q_blk, ldq, kr, s_blk, lds);
          break;
        case 2:
          ScoreRowsOf4Keys<2>(d_len, keys, alpha, q_blk, ldq, kr, s_blk, lds);
          break;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
        case 3:
          ScoreRowsOf4Keys<3>(d_len, keys, alpha, q_blk, ldq, kr, s_blk, lds);
          break;
        case 4:
          ScoreRowsOf4Keys<4>(d_len, keys, alpha, q_blk, ldq, kr, s_blk, lds);
          break;
#endif
      }
    }
  }
}
#endif  // HWY_TARGET != HWY_SCALAR

template <class T, class In>
void Scores(int64_t rows, int64_t cols, int64_t d_len, T alpha, const T* q, int64_t ldq,
            const In* k, int64_t ldk, T* s, int64_t lds) {
  HWY_ASSERT(rows >= 0 && rows <= kRowProductRows);
#if HWY_TARGET != HWY_SCALAR
  // Float above 4 rows: grouped. B=1, H=Hkv=8, Nk=65536, d=128, AVX-512, 2
  // threads, medians of 5 alternating runs: 8 rows 18.4 GB/s of K and V
  // against 15.4 for ScoresR in blocks of 4 rows, 16 rows 12.7 against 10.7.
  // Up to 4 rows ScoresR did better end to end (4 rows 25.0 GB/s against
  // 17.9 grouped; the grouped scores alone, keys in L2, took 14.4 ns a key
  // against 26.8): decoding waits on memory, and reading two keys' rows at a
  // time streams better than four. Both sum a lane in the same order
  // (SumsOf4), so a row gets the same bits from either.
  if constexpr (std::is_same_v<T, float>) {
    if (rows > 4) return ScoresGrouped(rows, cols, d_len, alpha, q, ldq, k, ldk, s, lds);
  }
#endif
  // Blocks of up to 4 rows, each over all the keys.
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const T* q_blk = q + r0 * ldq;
    T* s_blk = s + r0 * lds;
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1:
        ScoresR<1>(cols, d_len, alpha, q_blk, ldq, k, ldk, s_blk, lds);
        break;
      case 2:
        ScoresR<2>(cols, d_len, alpha, q_blk, ldq, k, ldk, s_blk, lds);
        break;
      case 3:
        ScoresR<3>(cols, d_len, alpha, q_blk, ldq, k, ldk, s_blk, lds);
        break;
      case 4:
        ScoresR<4>(cols, d_len, alpha, q_blk, ldq, k, ldk, s_blk, lds);
        break;
    }
  }
}

// o_r += sum_j p_rj v_j over NV vectors of columns [c0, c0 + NV Lanes) for
// R rows: R x NV accumulators stay in registers over all keys, each value
// vector is loaded once and feeds R FMAs. The sum starts from 0 and is added
// to o at the end (AccumulateR says why). The rows kPrefetchRows ahead are
// prefetched from c0 on, prefetch_len elements (0: none).
template <int R, int NV, class T, class In>
HWY_INLINE void AccumulateColumns(int64_t cols, int64_t c0, int64_t prefetch_len,
                                  const T* HWY_RESTRICT p, int64_t ldp, const In* HWY_RESTRICT v,
                                  int64_t ldv, T* HWY_RESTRICT o, int64_t ldo) {
  const hn::ScalableTag<T> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<decltype(d)> acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = hn::Zero(d);
  }
  for (int64_t j = 0; j < cols; ++j) {
    PrefetchRows(v + (j + kPrefetchRows) * ldv + c0, 1, ldv, prefetch_len);
    hn::Vec<decltype(d)> vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = LoadRow(d, v + j * ldv + c0 + c * lanes);
    for (int r = 0; r < R; ++r) {
      const auto pr = hn::Set(d, p[r * ldp + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = hn::MulAdd(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NV; ++c) {
      T* out = o + r * ldo + c0 + c * lanes;
      hn::StoreU(hn::Add(hn::LoadU(d, out), acc[r][c]), d, out);
    }
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
HWY_INLINE void AccumulateUpTo(int64_t nv, int64_t cols, int64_t c0, int64_t prefetch_len,
                               const T* p, int64_t ldp, const In* v, int64_t ldv, T* o,
                               int64_t ldo) {
  if constexpr (NV > 1) {
    if (nv < NV)
      return AccumulateUpTo<R, NV - 1>(nv, cols, c0, prefetch_len, p, ldp, v, ldv, o, ldo);
  }
  AccumulateColumns<R, NV>(cols, c0, prefetch_len, p, ldp, v, ldv, o, ldo);
}

// Keys per group of AccumulateR (see there).
constexpr int64_t kSubKeys = 32;

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
  // Keys in groups of kSubKeys, each group's column blocks in turn, the first
  // block prefetching the whole row: every value row is read from memory once,
  // all of it, the later blocks finding it in L1 (32 rows of 512 bytes). Each
  // block over all the keys of a task read 4 of a float32 row's 8 lines per
  // pass, 2 passes: B=1, H=32, Hkv=8, Nk=65536, d=128, 2 threads, decoding
  // reads K and V at 71-72 % of a plain read of the same bytes (bf16) and
  // 78-80 % (float32) that way, 87 % and 80-84 % this way (3 alternating runs
  // of 9 calls each); 16 and 64 keys did no better.
  //
  // Each group's sum starts from 0 and is added to o: one float accumulator
  // carried over all of a task's keys (32768 per task when decoding over
  // 65536) lost about one rounding of o per key, so the mean error of an
  // output stayed near 1.5e-8 from 1000 to 131072 keys, where a float32
  // reference's falls (FlashAttention's tests, issue 33).
  for (int64_t j0 = 0; j0 < cols; j0 += kSubKeys) {
    const int64_t keys = std::min(kSubKeys, cols - j0);
    for (int64_t done = 0; done < vectors;) {
      const int64_t nv = std::min<int64_t>(kNV, vectors - done);
      AccumulateUpTo<R, kNV>(nv, keys, done * lanes, done == 0 ? dv : 0, p + j0, ldp, v + j0 * ldv,
                             ldv, o, ldo);
      done += nv;
    }
    for (int64_t c0 = vectors * lanes; c0 < dv; ++c0) {
      for (int r = 0; r < R; ++r) {
        T sum = T(0);
        for (int64_t j = j0; j < j0 + keys; ++j) {
          sum = MulAddLane(p[r * ldp + j], Widen(v[j * ldv + c0]), sum);
        }
        o[r * ldo + c0] += sum;
      }
    }
  }
}

// Blocks of up to 4 rows, each over all the values: a row's sums run over j
// in increasing order per column whatever the block, so its bits do not
// depend on the rows beside it.
template <class T, class In>
void Accumulate(int64_t rows, int64_t cols, int64_t dv, const T* p, int64_t ldp, const In* v,
                int64_t ldv, T* o, int64_t ldo) {
  HWY_ASSERT(rows >= 0 && rows <= kRowProductRows);
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const T* p_blk = p + r0 * ldp;
    T* o_blk = o + r0 * ldo;
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1:
        AccumulateR<1>(cols, dv, p_blk, ldp, v, ldv, o_blk, ldo);
        break;
      case 2:
        AccumulateR<2>(cols, dv, p_blk, ldp, v, ldv, o_blk, ldo);
        break;
      case 3:
        AccumulateR<3>(cols, dv, p_blk, ldp, v, ldv, o_blk, ldo);
        break;
      case 4:
        AccumulateR<4>(cols, dv, p_blk, ldp, v, ldv, o_blk, ldo);
        break;
    }
  }
}

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

void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, int64_t ldq,
                const float* k, int64_t ldk, float* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresF)(rows, cols, d, alpha, q, ldq, k, ldk, s, lds);
}
void row_scores(int64_t rows, int64_t cols, int64_t d, float alpha, const float* q, int64_t ldq,
                const bfloat16* k, int64_t ldk, float* s, int64_t lds) {
  HWY_DYNAMIC_DISPATCH(RowScoresB)
  (rows, cols, d, alpha, q, ldq, reinterpret_cast<const uint16_t*>(k), ldk, s, lds);
}
void row_scores(int64_t rows, int64_t cols, int64_t d, double alpha, const double* q, int64_t ldq,
                const double* k, int64_t ldk, double* s, int64_t lds) {
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
