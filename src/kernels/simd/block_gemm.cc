// Highway implementations of block_gemm.h, the float block products of the
// fused SDPA forward. Compiled once per SIMD target through
// hwy/foreach_target.h; the HWY_ONCE part at the bottom dispatches.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/block_gemm.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/highway.h>

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/simd/block_gemm.h"
#include "kernels/simd/tail-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels::fast {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;

// Micro-tiles of MR rows x NV vectors of C, all MR * NV accumulators in
// registers for the whole k loop (for scores, for each group of
// kBlockScoreGroup terms); each A element is one broadcast feeding NV FMAs.
// Shapes from bench/block_gemm_choice.cc's sweep on AVX-512 (32 registers):
// O in 6 x 4 (24 accumulators + 4 B vectors + 1 broadcast); S was 8 x 2
// (16 + 2 + 1) while it summed one chain over k, and is 4 x 3 since it sums
// groups: 12 accumulators + 12 totals of the groups + 3 + 1 fit, where 8 x 2
// had to add each group into C in memory, 16 stores per 32 terms, which made
// block_scores 8 % (d = 64) and 11 % (d = 128) slower at 256 x 256 x d; 4 x 3
// with the totals in registers takes the old 8 x 2's time (one thread, min
// of 300 x 10 calls, 3 alternating runs: 39.4-41.0 us against 39.4-39.7 at
// d = 64, 76.5-77.2 against 76.0-77.1 at d = 128). Targets with 16 vector
// registers (AVX2, SSE4) fill at most 16: S in 4 x 3 (12 + 3 + 1, the
// groups added into C in memory: 0-2 % slower than one chain, same
// measurement), O in 6 x 2 (12 + 2 + 1). Forced to AVX2 here, against
// OpenBLAS's Haswell kernels at 128 x 256 x 64: S 4 x 3 1.16x, 6 x 2 0.83x;
// O 6 x 2 and 4 x 3 1.11x, 3 x 4 1.03x.
constexpr int kScoreMR = 4, kScoreNV = 3;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kRegisters = 32;
constexpr int kOutMR = 6, kOutNV = 4;
#else
constexpr int kRegisters = 16;
constexpr int kOutMR = 6, kOutNV = 2;
#endif
// Keys (rows of B) per pass over C in accumulate: 128 x 64 floats of V are
// 32 KiB, the L1; without this cut the bench fell to OpenBLAS's rate at 256
// keys, V being re-read from L2 for every row tile.
constexpr int64_t kOutKc = 128;

// Panels are at most kBlockGemmMaxPanel floats wide (block_gemm.h), which
// sizes the caller's `pack` scratch for every target.
static_assert(kScoreNV * (HWY_MAX_BYTES / sizeof(float)) <= kBlockGemmMaxPanel &&
                  kOutNV * (HWY_MAX_BYTES / sizeof(float)) <= kBlockGemmMaxPanel,
              "a panel wider than block_gemm_scratch_floats allows");

using ::qkv::kernels::fast::HWY_NAMESPACE::LoadTail;
using ::qkv::kernels::fast::HWY_NAMESPACE::StoreTail;

// C (MR x NV vectors) = alpha A B (kAccumulate: C += A B). A is MR rows of
// k, lda apart; B is k rows of NV vectors, ldb apart (a packed panel, or V
// itself). Only the first `last` lanes of the last vector are C's. The sum
// over k runs in groups of `group` terms from the first: each group is one
// FMA chain from 0, then added to the total: in registers when the tile
// leaves room for it (kTotalsInRegisters), else into C in memory (the tile's
// rows stay in L1). Either way C's element is ((g0 + g1) + g2) + ..., times
// alpha last: the same bits. Scores take kBlockScoreGroup (block_gemm.h);
// accumulate passes its whole k (at most kOutKc keys), one group.
template <int MR, int NV, bool kAccumulate>
HWY_INLINE void micro_tile(const float* HWY_RESTRICT a, int64_t lda, const float* HWY_RESTRICT b,
                           int64_t ldb, int64_t k, int64_t group, float alpha,
                           float* HWY_RESTRICT c, int64_t ldc, size_t last) {
  const D d;
  const size_t lanes = hn::Lanes(d);
  constexpr bool kTotalsInRegisters = !kAccumulate && 2 * MR * NV + NV + 1 <= kRegisters;
  hn::Vec<D> total[MR][NV];
  for (int64_t k0 = 0; k0 < k; k0 += group) {
    const int64_t k1 = std::min(k, k0 + group);
    hn::Vec<D> acc[MR][NV];
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::Zero(d);
    }
    for (int64_t kk = k0; kk < k1; ++kk) {
      hn::Vec<D> bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = hn::LoadU(d, b + kk * ldb + v * lanes);
      for (int r = 0; r < MR; ++r) {
        const auto ar = hn::Set(d, a[r * lda + kk]);
        for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(ar, bv[v], acc[r][v]);
      }
    }
    if constexpr (kTotalsInRegisters) {
      for (int r = 0; r < MR; ++r) {
        for (int v = 0; v < NV; ++v)
          total[r][v] = k0 == 0 ? acc[r][v] : hn::Add(total[r][v], acc[r][v]);
      }
      continue;
    }
    // Scores overwrite C with their first group and scale the total after
    // their last; accumulate adds every group to C.
    const bool add_to_c = kAccumulate || k0 > 0;
    const bool scale = !kAccumulate && k1 == k;
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < NV; ++v) {
        float* out = c + r * ldc + v * lanes;
        const bool whole = v + 1 < NV || last == lanes;
        auto x = acc[r][v];
        if (add_to_c) x = hn::Add(whole ? hn::LoadU(d, out) : LoadTail(d, out, last), x);
        if (scale) x = hn::Mul(x, hn::Set(d, alpha));
        if (whole) {
          hn::StoreU(x, d, out);
        } else {
          StoreTail(d, x, out, last);
        }
      }
    }
  }
  if constexpr (kTotalsInRegisters) {
    for (int r = 0; r < MR; ++r) {
      for (int v = 0; v < NV; ++v) {
        float* out = c + r * ldc + v * lanes;
        const auto x = hn::Mul(total[r][v], hn::Set(d, alpha));
        if (v + 1 < NV || last == lanes) {
          hn::StoreU(x, d, out);
        } else {
          StoreTail(d, x, out, last);
        }
      }
    }
  }
}

// All m rows against one B panel: MR-row tiles, then the leftover rows
// through tiles of MR / 2, MR / 4, ... rows.
template <int MR, int NV, bool kAccumulate>
HWY_NOINLINE void panel_rows(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t m,
                             int64_t k, float alpha, float* c, int64_t ldc, size_t last) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) {
    micro_tile<MR, NV, kAccumulate>(a + r * lda, lda, b, ldb, k, kAccumulate ? k : kBlockScoreGroup,
                                    alpha, c + r * ldc, ldc, last);
  }
  if constexpr (MR > 1) {
    if (r < m) {
      panel_rows<MR / 2, NV, kAccumulate>(a + r * lda, lda, b, ldb, m - r, k, alpha, c + r * ldc,
                                          ldc, last);
    }
  }
}

// panel_rows for a panel of nv <= NV vectors (the last, narrower one).
template <int MR, int NV, bool kAccumulate>
HWY_INLINE void panel_rows_nv(int64_t nv, const float* a, int64_t lda, const float* b, int64_t ldb,
                              int64_t m, int64_t k, float alpha, float* c, int64_t ldc,
                              size_t last) {
  if (nv == NV) {
    panel_rows<MR, NV, kAccumulate>(a, lda, b, ldb, m, k, alpha, c, ldc, last);
  } else if constexpr (NV > 1) {
    panel_rows_nv<MR, NV - 1, kAccumulate>(nv, a, lda, b, ldb, m, k, alpha, c, ldc, last);
  }
}

#if HWY_TARGET == HWY_AVX2
// Columns [0, 8) of 8 rows (ld_in apart) stored as 8 rows of 8 (ld_out
// apart): three rounds of 8 shuffles in registers (pairs of floats, then of
// doubles within 128-bit blocks, then the blocks).
template <class D8>
HWY_INLINE void transpose_8x8(D8 d, const float* HWY_RESTRICT in, int64_t ld_in,
                              float* HWY_RESTRICT out, int64_t ld_out) {
  const hn::Repartition<double, D8> dd;
  using V = hn::Vec<D8>;
  V t[8];
  for (int i = 0; i < 8; i += 2) {
    const V r0 = hn::LoadU(d, in + i * ld_in), r1 = hn::LoadU(d, in + (i + 1) * ld_in);
    t[i] = hn::InterleaveLower(d, r0, r1);      // r0_0 r1_0 r0_1 r1_1 | r0_4 r1_4 r0_5 r1_5
    t[i + 1] = hn::InterleaveUpper(d, r0, r1);  // columns 2, 3 | 6, 7
  }
  V u[8];  // u[c] rows 0-3 of columns c | c + 4, u[4 + c] rows 4-7
  for (int h = 0; h < 8; h += 4) {
    const auto a0 = hn::BitCast(dd, t[h]), a1 = hn::BitCast(dd, t[h + 1]);
    const auto b0 = hn::BitCast(dd, t[h + 2]), b1 = hn::BitCast(dd, t[h + 3]);
    u[h] = hn::BitCast(d, hn::InterleaveLower(dd, a0, b0));
    u[h + 1] = hn::BitCast(d, hn::InterleaveUpper(dd, a0, b0));
    u[h + 2] = hn::BitCast(d, hn::InterleaveLower(dd, a1, b1));
    u[h + 3] = hn::BitCast(d, hn::InterleaveUpper(dd, a1, b1));
  }
  for (int c = 0; c < 4; ++c) {
    hn::StoreU(hn::ConcatLowerLower(d, u[4 + c], u[c]), d, out + c * ld_out);
    hn::StoreU(hn::ConcatUpperUpper(d, u[4 + c], u[c]), d, out + (c + 4) * ld_out);
  }
}
#endif

// Rows [0, cols) of B (each k long, ldb apart) as a k x width panel of Bᵀ,
// columns [cols, width) zero. A full panel takes one gather per vector and
// row of the panel: the transpose is ~k n loads against 2 k n m flops of the
// product (~10 % of the S time in the bench at 128 x 256 x 64). With 8
// lanes (AVX2) whole 8 x 8 blocks are transposed in registers instead: the
// gathers were 6.5 % of the SDPA forward's time there (one thread, B=2,
// N=4096, d=64, perf record).
HWY_INLINE void pack_bt(const float* b, int64_t ldb, int64_t cols, int64_t k, int64_t width,
                        float* HWY_RESTRICT panel) {
  const D d;
  const hn::RebindToSigned<D> di;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  if (cols == width && ldb <= std::numeric_limits<int32_t>::max() / lanes) {
    int64_t k_done = 0;
#if HWY_TARGET == HWY_AVX2
    {
      k_done = k / 8 * 8;
      for (int64_t kk = 0; kk < k_done; kk += 8) {
        for (int64_t v = 0; v < width; v += 8) {
          transpose_8x8(d, b + v * ldb + kk, ldb, panel + kk * width + v, width);
        }
      }
    }
#endif
    HWY_ALIGN int32_t offsets[hn::MaxLanes(hn::RebindToSigned<D>())];
    for (int64_t i = 0; i < lanes; ++i) offsets[i] = static_cast<int32_t>(i * ldb);
    const auto idx = hn::Load(di, offsets);
    for (int64_t kk = k_done; kk < k; ++kk) {
      for (int64_t v = 0; v < width; v += lanes) {
        hn::Store(hn::GatherIndex(d, b + v * ldb + kk, idx), d, panel + kk * width + v);
      }
    }
    return;
  }
  for (int64_t j = 0; j < cols; ++j) {
    const float* row = b + j * ldb;
    for (int64_t kk = 0; kk < k; ++kk) panel[kk * width + j] = row[kk];
  }
  for (int64_t kk = 0; kk < k; ++kk)
    std::fill(panel + kk * width + cols, panel + (kk + 1) * width, 0.0f);
}

// C (m x n) = alpha A Bᵀ.
void Scores(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float* c, int64_t ldc, float* pack) {
  assert(m >= 0 && n >= 0 && k >= 0);
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // an empty sum, as sgemm with beta = 0
    for (int64_t r = 0; r < m; ++r) std::fill(c + r * ldc, c + r * ldc + n, 0.0f);
    return;
  }
  const D d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d)), nr = kScoreNV * lanes;
  float* panel = pack;  // k x nr
  // Panel outer: its k x NR floats (8 KiB at k = 64) stay in L1 while A's rows stream.
  for (int64_t c0 = 0; c0 < n; c0 += nr) {
    const int64_t cols = std::min(nr, n - c0);
    const int64_t nv = (cols + lanes - 1) / lanes;
    const size_t last = static_cast<size_t>(cols - (nv - 1) * lanes);
    pack_bt(b + c0 * ldb, ldb, cols, k, nv * lanes, panel);
    panel_rows_nv<kScoreMR, kScoreNV, false>(nv, a, lda, panel, nv * lanes, m, k, alpha, c + c0,
                                             ldc, last);
  }
}

// C (m x n) += A B. Whole panels of B are read in place (B is row-major,
// each panel row NR contiguous floats); the last, narrower one is copied
// into a zero-padded panel so no vector load reaches past B.
void Accumulate(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                int64_t ldb, float* c, int64_t ldc, float* pack) {
  assert(m >= 0 && n >= 0 && k >= 0);
  if (m <= 0 || n <= 0 || k <= 0) return;
  const D d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d)), nr = kOutNV * lanes;
  const int64_t whole = n - n % nr;  // columns in whole panels
  const int64_t tail = n - whole;
  const int64_t tail_nv = (tail + lanes - 1) / lanes;
  const size_t tail_last = static_cast<size_t>(tail - (tail_nv - 1) * lanes);
  float* panel = pack;  // min(k, kOutKc) x tail_nv * lanes, when there is a tail
  for (int64_t k0 = 0; k0 < k; k0 += kOutKc) {
    const int64_t kc = std::min(kOutKc, k - k0);
    const float* a_k = a + k0;
    const float* b_k = b + k0 * ldb;
    for (int64_t c0 = 0; c0 < whole; c0 += nr) {
      panel_rows<kOutMR, kOutNV, true>(a_k, lda, b_k + c0, ldb, m, kc, 1.0f, c + c0, ldc,
                                       static_cast<size_t>(lanes));
    }
    if (tail > 0) {
      const int64_t width = tail_nv * lanes;
      for (int64_t kk = 0; kk < kc; ++kk) {
        float* row = panel + kk * width;
        std::copy_n(b_k + kk * ldb + whole, tail, row);
        std::fill(row + tail, row + width, 0.0f);
      }
      panel_rows_nv<kOutMR, kOutNV, true>(tail_nv, a_k, lda, panel, width, m, kc, 1.0f, c + whole,
                                          ldc, tail_last);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels::fast
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels::fast {

HWY_EXPORT(Scores);
HWY_EXPORT(Accumulate);

size_t block_gemm_scratch_floats(int64_t k) {
  return static_cast<size_t>(std::max<int64_t>(k, 1) * kBlockGemmMaxPanel);
}

void block_scores(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float* c, int64_t ldc, float* pack) {
  HWY_DYNAMIC_DISPATCH(Scores)(m, n, k, alpha, a, lda, b, ldb, c, ldc, pack);
}

void block_accumulate(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                      int64_t ldb, float* c, int64_t ldc, float* pack) {
  HWY_DYNAMIC_DISPATCH(Accumulate)(m, n, k, a, lda, b, ldb, c, ldc, pack);
}

}  // namespace qkv::kernels::fast
#endif  // HWY_ONCE
