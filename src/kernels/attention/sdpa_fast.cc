// Scaled dot-product attention, fast version: fused, flash-style.
//
// Forward, one task per (batch element, block of kQueryBlock queries): for
// each block of kKeyBlock keys the scores S = scale Q Kᵀ go into a small
// buffer, an online softmax keeps each row's running max m and sum l
// (rescaling the output accumulator when m grows), dropout is regenerated
// from the counter-based generator, and O += P V. No (B, Nq, Nk) buffer is
// formed unless the caller asks for the weights, which are then written in a
// second sweep over the key blocks from the final m and l. Key blocks past
// the longest valid length of the query block are never touched; inside a
// block, a row's masked columns get weight 0.
//
// Backward, one task per (batch element, group of key blocks): the task owns
// dK and dV of its keys; it sweeps the query blocks, recomputes S and
// P = exp(S - m) / l per tile (the forward's row max and sum when saved, else
// m = lse, l = 1), forms dP = dO Vᵀ, dS = P (dP - D) with
// D_i = dO_i . O_i, and accumulates dV += Pᵀ dO, dK += dSᵀ Q and its own
// partial dQ += dS K. The partial dQs are summed in group order at the end.
// The number of groups depends only on the shapes, so no two threads write
// the same element and results are bitwise the same for any thread count; a
// single batch element still splits into several tasks.
//
// Block products: the float forward's S = scale Q Kᵀ (also in the weights
// sweep) and O += P V use kernels/simd/block_gemm.h, register-blocked Highway
// micro-kernels (K_jᵀ packed per call, SIMD target chosen at run time),
// because they measured faster than single-threaded OpenBLAS sgemm at these
// blocks: ~1.3x per block pair in bench/block_gemm_choice.cc, and the library
// kernels at 128 x 256 x 64 on AVX-512, one thread, median of per-round
// ratios: S 1.31-1.33x, O += P V 1.40-1.43x, the pair 1.32-1.34x (forced to
// AVX2 against OpenBLAS's Haswell kernels: 1.18x, 1.10x, 1.08x); on an AMD
// Zen 4 (AVX-512 on 256-bit units) at the 256 x 256 blocks used now: S 1.09x,
// O += P V 1.15x, the pair 1.11x. Everything
// else goes to the BLAS (single-threaded OpenBLAS inside our tasks): double,
// whose products have no Highway kernel, and the backward's other products,
// whose transposed ones (Pᵀ dO, dSᵀ Q) the two kernels do not cover and which
// were not measured against them; the backward's S is formed on the forward's
// own product (backward_scores), so P gets the forward's bits. bf16 inputs use
// kernels/simd/gemm_bf16.h (AVX-512 BF16 dot products or AMX tiles) with P and dS rounded to bf16
// for their products, everything else in float; the forward packs each key block's K and V for the
// products once per call, not once per query block, and the softmax writes P straight in bf16 when
// there is no dropout. Where the bf16 products run on AMX tiles, a task's whole key loop runs fused
// on the tiles instead (kernels/simd/amx_attention.h: one tile configuration per task, S at scale 1
// with the scale in the softmax, P V added per key block), unless masks, a bias, dropout or the
// weights ask for the loop here. Without the BF16 instructions the bf16 forward widens each tile of
// Q, K and V to float and runs block_gemm on it (P stays float), and the backward runs on float
// copies of the inputs (attention.cc).
//
// Rows whose valid scores are not all finite (NaN, ±inf) take an exact
// single-row path that applies DESIGN.md §3's rules.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>

#include "kernels/attention/additive_tile.h"
#include "kernels/attention/attention_common.h"
#include "kernels/attention/small_dim_attention.h"
#include "kernels/kernels.h"
#include "kernels/runtime/blas.h"
#include "kernels/runtime/philox.h"
#include "kernels/runtime/workspace.h"
#include "kernels/simd/amx_attention.h"
#include "kernels/simd/block_gemm.h"
#include "kernels/simd/gemm_bf16.h"
#include "kernels/simd/row_products.h"
#include "kernels/simd/vecmath.h"
#include "kernels/softmax/softmax_tile.h"

namespace qkv::kernels::fast {
namespace {

// 256 queries per task: each key block's K and V are then read (and, for
// bf16, their products set up) once per 256 queries; at 128 the float
// forward at B=2, Q=K=4096, d=64 took 48.7 ms, at 256 45.8 ms (2 threads).
// The (256 x 256) float score tile is 256 KiB, well inside the 1-2 MiB L2.
constexpr int64_t kQueryBlock = 256;
constexpr int64_t kKeyBlock = 256;
// Heads up to this size (D and Dv), without dropout or weights, go to the
// small-dimension kernel, which forms scores in registers: at B=2, N=4096,
// float, 2 threads, D = Dv = 1, 2, 4, 8 took 6.7, 8.4, 13.2, 18.0 ms there
// against 25.1, 15.1, 14.5, 16.7 ms on the tiles here.
constexpr int64_t kSmallHead = 4;
// Backward tiles: dS and P of kBackQueryBlock x kBackKeyBlock floats each.
constexpr int64_t kBackQueryBlock = 128;
constexpr int64_t kBackKeyBlock = 128;
// The forward cuts each batch element's keys into chunks when there are
// fewer (batch, query block) tasks than this, and merges the chunks' partial
// softmax sums: decoding (B = 1, Nq = 1, Nk = 2^20) otherwise runs on one
// core. The chunks depend only on the shapes (determinism); each costs a
// partial (rows, Dv) output, at most 2 x this many query blocks in all.
constexpr int64_t kMinForwardTasks = 16;
// The backward cuts each batch element's keys into enough groups that all
// (batch, group) tasks number at least this, so one long sequence still
// spreads over the cores; each extra group costs one (Nq, D) partial dQ.
constexpr int64_t kMinBackwardTasks = 16;

// The element type of Q, K, V decides the block products and the type of
// the results (Acc): float and double compute in their own type, bf16 in float.
template <class In>
struct Flash {
  using Acc = In;
  // What the forward prepares once per (batch element, key block): nothing
  // here (flash_forward skips the preparation for an empty KeyBlock).
  struct KeyBlock {};
  static void scores(const KeyBlock*, int64_t m, int64_t n, int64_t k, Acc alpha, const In* a,
                     int64_t lda, const In* b, int64_t ldb, Acc* c, int64_t ldc, double* scratch) {
    scores(m, n, k, alpha, a, lda, b, ldb, c, ldc, scratch);
  }
  static void accumulate(const KeyBlock*, int64_t m, int64_t n, int64_t k, const In* a, int64_t lda,
                         const In* b, int64_t ldb, Acc* c, int64_t ldc, double* scratch) {
    accumulate(m, n, k, a, lda, b, ldb, c, ldc, scratch);
  }
  // The BLAS, single-threaded inside our tasks: no scratch of ours.
  static void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, Acc alpha, const In* a,
                   int64_t lda, const In* b, int64_t ldb, Acc beta, Acc* c, int64_t ldc, double*) {
    kernels::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  // The forward's S = alpha Q Kᵀ (c overwritten) and O += P V: float on
  // block_gemm's Highway kernels, whose packed panels go in `scratch`
  // (forward_gemm_words doubles); double on the BLAS (see the top of the file).
  static size_t forward_gemm_words(int64_t nk, int64_t d, int64_t dv) {
    (void)dv;
    if constexpr (std::is_same_v<In, float>) {
      // Inner sizes D (scores) and up to a key block (O += P V).
      const size_t floats = fast::block_gemm_scratch_floats(std::max(d, std::min(nk, kKeyBlock)));
      return (floats + 1) / 2;
    }
    return 0;
  }
  // The backward's S on the forward's product (backward_scores) and dP =
  // dO Vᵀ on the same: block_gemm's panels of D- or Dv-long rows; the other
  // products go to the BLAS.
  static size_t backward_gemm_words(int64_t d, int64_t dv) {
    if constexpr (std::is_same_v<In, float>) {
      return (fast::block_gemm_scratch_floats(std::max(d, dv)) + 1) / 2;
    }
    return 0;
  }
  static void scores(int64_t m, int64_t n, int64_t k, Acc alpha, const In* a, int64_t lda,
                     const In* b, int64_t ldb, Acc* c, int64_t ldc, double* scratch) {
    if constexpr (std::is_same_v<In, float>) {
      fast::block_scores(m, n, k, alpha, a, lda, b, ldb, c, ldc, reinterpret_cast<float*>(scratch));
    } else {
      gemm(false, true, m, n, k, alpha, a, lda, b, ldb, Acc(0), c, ldc, scratch);
    }
  }
  static void accumulate(int64_t m, int64_t n, int64_t k, const In* a, int64_t lda, const In* b,
                         int64_t ldb, Acc* c, int64_t ldc, double* scratch) {
    if constexpr (std::is_same_v<In, float>) {
      fast::block_accumulate(m, n, k, a, lda, b, ldb, c, ldc, reinterpret_cast<float*>(scratch));
    } else {
      gemm(false, false, m, n, k, Acc(1), a, lda, b, ldb, Acc(1), c, ldc, scratch);
    }
  }
  // An Acc matrix as a product operand: no conversion, no buffer (null).
  static constexpr bool kConverts = false;
  static const In* operand(const Acc* x, int64_t n, In* buf) {
    (void)n;
    (void)buf;
    return x;
  }
  // D_i = dO_i . O_i, with dO_i as the products see it.
  static Acc delta(const Acc* d_out, const Acc* out, int64_t n) { return fast::dot(d_out, out, n); }
};

template <>
struct Flash<bfloat16> {
  using Acc = float;
  // K and V of one key block packed for the products once, not once per
  // query block: packing was ~6 % of the bf16 forward, and with the products
  // at ~2x the float rate every other pass counts double.
  using KeyBlock = fast::PackedKeyBlock;  // Kᵀ (d x cols) and V (cols x dv) as B operands
  // Doubles of storage a block of up to `cols` keys packs into.
  static size_t prepare_words(int64_t cols, int64_t d, int64_t dv) {
    return fast::pack_b_bf16_words(cols, d) + fast::pack_b_bf16_words(dv, cols);
  }
  // k_blk: cols x d keys (rows ldk apart), v_blk: cols x dv values (rows
  // ldv apart), packed into storage.
  static KeyBlock prepare(const bfloat16* k_blk, int64_t ldk, const bfloat16* v_blk, int64_t ldv,
                          int64_t cols, int64_t d, int64_t dv, double* storage) {
    const fast::PackedBf16 packed_k = fast::pack_b_bf16(true, cols, d, k_blk, ldk, storage);
    return {packed_k, fast::pack_b_bf16(false, dv, cols, v_blk, ldv,
                                        storage + fast::pack_b_bf16_words(cols, d))};
  }
  static void scores(const KeyBlock* kb, int64_t m, int64_t n, int64_t k, float alpha,
                     const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float* c,
                     int64_t ldc, double* scratch) {
    if (kb && kb->k.n == n) {
      fast::gemm_bf16(m, alpha, a, lda, kb->k, 0.0f, c, ldc, scratch);
    } else {
      scores(m, n, k, alpha, a, lda, b, ldb, c, ldc, scratch);
    }
  }
  static void accumulate(const KeyBlock* kb, int64_t m, int64_t n, int64_t k, const bfloat16* a,
                         int64_t lda, const bfloat16* b, int64_t ldb, float* c, int64_t ldc,
                         double* scratch) {
    if (kb && kb->v.k == k) {
      fast::gemm_bf16(m, 1.0f, a, lda, kb->v, 1.0f, c, ldc, scratch);
    } else {
      accumulate(m, n, k, a, lda, b, ldb, c, ldc, scratch);
    }
  }
  static void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                   const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta,
                   float* c, int64_t ldc, double* scratch) {
    fast::gemm_bf16(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, scratch);
  }
  // Scratch for the largest product of each kind a task makes (the sizes
  // grow with m, n and k): the forward's tiles and, in exact_row, one query
  // against all Nk keys; the backward's five tile products.
  static size_t forward_gemm_words(int64_t nk, int64_t d, int64_t dv) {
    const int64_t cols = std::min(nk, kKeyBlock);
    const int64_t row = std::max<int64_t>(nk, 1);
    return std::max({fast::gemm_bf16_scratch_words(kQueryBlock, cols, d),
                     fast::gemm_bf16_scratch_words(kQueryBlock, dv, cols),
                     fast::gemm_bf16_packed_scratch_words(kQueryBlock, d),
                     fast::gemm_bf16_packed_scratch_words(kQueryBlock, cols),
                     fast::gemm_bf16_scratch_words(1, row, d),
                     fast::gemm_bf16_scratch_words(1, dv, row)});
  }
  static size_t backward_gemm_words(int64_t d, int64_t dv) {
    constexpr int64_t kRows = kBackQueryBlock, kCols = kBackKeyBlock;
    return std::max({fast::gemm_bf16_scratch_words(kRows, kCols, d),
                     fast::gemm_bf16_scratch_words(kRows, kCols, dv),
                     fast::gemm_bf16_scratch_words(kCols, dv, kRows),
                     fast::gemm_bf16_scratch_words(kCols, d, kRows),
                     fast::gemm_bf16_scratch_words(kRows, d, kCols)});
  }
  static void scores(int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a, int64_t lda,
                     const bfloat16* b, int64_t ldb, float* c, int64_t ldc, double* scratch) {
    gemm(false, true, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc, scratch);
  }
  static void accumulate(int64_t m, int64_t n, int64_t k, const bfloat16* a, int64_t lda,
                         const bfloat16* b, int64_t ldb, float* c, int64_t ldc, double* scratch) {
    gemm(false, false, m, n, k, 1.0f, a, lda, b, ldb, 1.0f, c, ldc, scratch);
  }
  // A float matrix as a product operand: rounded to bf16 in buf (n elements).
  static constexpr bool kConverts = true;
  static const bfloat16* operand(const float* x, int64_t n, bfloat16* buf) {
    fast::to_bf16(x, buf, n);
    return buf;
  }
  // dP = dO Vᵀ uses dO rounded to bf16, so D must too, or the rows of
  // dS = P (dP - D) would not sum to 0.
  static float delta(const float* d_out, const float* out, int64_t n) {
    float sum = 0;
    for (int64_t e = 0; e < n; ++e) sum += static_cast<float>(bfloat16(d_out[e])) * out[e];
    return sum;
  }
};

template <class Acc>
Acc dropout_inverse(const AttentionConfig& config) {
  return config.dropout < 1.0 ? static_cast<Acc>(1.0 / (1.0 - config.dropout)) : Acc(0);
}

// x[c] = keep[c] ? x[c] * inv : 0 for c < n.
template <class Acc>
void apply_dropout(Acc* x, const uint8_t* keep, Acc inv, int64_t n) {
  for (int64_t c = 0; c < n; ++c) x[c] = keep[c] ? x[c] * inv : Acc(0);
}

// Per-thread scratch of the forward, a slot of the workspace: the score
// tile and each row's running state for one task, and one whole row for
// exact_row.
template <class In>
struct ForwardScratch {
  using Acc = typename Flash<In>::Acc;
  Acc *s, *m, *l, *correction;  // s: kQueryBlock x kKeyBlock (+ SIMD tail pad)
  int64_t *len, *valid;
  uint8_t *special, *keep;
  In* p_operand;  // bf16: P rounded for the product (null otherwise)
  // bf16: the task's queries widened to float, for row_scores (at most
  // kRowProductRows rows) or, without the BF16 instructions, for the float
  // block products on widened tiles (null otherwise)
  Acc* q_rows;
  // bf16 without the BF16 instructions: one key block of K and V widened, and
  // block_gemm's panels (null otherwise)
  Acc *k_wide, *v_wide;
  float* block_pack;
  Acc* row;  // exact_row: one row of Nk scores
  uint8_t* row_keep;
  In* row_operand;  // bf16: that row rounded for the product (null otherwise)
  // A task over the query rows of several heads (grouped_rows_per_task):
  // its queries gathered, and its output rows before they go to their heads.
  In* q_gather;
  Acc* out_rows;
  // A task of row products (at most kRowProductRows rows): one key block's
  // P V, summed apart from the output, and what adding it lost (Kahan).
  Acc *block_out, *lost;
  double* gemm;  // the block products' own scratch (forward_gemm_words)
  double* amx;   // bf16 on AMX tiles: the fused key loop's scratch (null otherwise)
};

template <class In>
ForwardScratch<In> forward_scratch(Slicer& slicer, int64_t nk, int64_t d, int64_t dv) {
  using Acc = typename Flash<In>::Acc;
  constexpr bool kConverts = Flash<In>::kConverts;
  const int64_t row = std::max<int64_t>(nk, 1);
  ForwardScratch<In> sc;
  // Padded: SIMD tails on narrower targets may read a vector past the last row.
  sc.s = slicer.take<Acc>(kQueryBlock * kKeyBlock + 64);
  sc.m = slicer.take<Acc>(kQueryBlock);
  sc.l = slicer.take<Acc>(kQueryBlock);
  sc.correction = slicer.take<Acc>(kQueryBlock);
  sc.len = slicer.take<int64_t>(kQueryBlock);
  sc.valid = slicer.take<int64_t>(kQueryBlock);
  sc.special = slicer.take<uint8_t>(kQueryBlock);
  sc.keep = slicer.take<uint8_t>(kKeyBlock);
  sc.p_operand = kConverts ? slicer.take<In>(kQueryBlock * kKeyBlock) : nullptr;
  sc.q_rows = sc.k_wide = sc.v_wide = nullptr;
  sc.block_pack = nullptr;
  if constexpr (kConverts) {
    const bool widen = !fast::bf16_native();
    sc.q_rows = slicer.take<Acc>((widen ? kQueryBlock : kRowProductRows) * d);
    if (widen) {
      sc.k_wide = slicer.take<Acc>(kKeyBlock * d);
      sc.v_wide = slicer.take<Acc>(kKeyBlock * dv);
      sc.block_pack = slicer.take<float>(static_cast<int64_t>(
          fast::block_gemm_scratch_floats(std::max(d, std::min(nk, kKeyBlock)))));
    }
  }
  sc.row = slicer.take<Acc>(row);
  sc.row_keep = slicer.take<uint8_t>(row);
  sc.row_operand = kConverts ? slicer.take<In>(row) : nullptr;
  sc.q_gather = slicer.take<In>(kRowProductRows * d);
  sc.out_rows = slicer.take<Acc>(kRowProductRows * dv);
  sc.block_out = slicer.take<Acc>(kRowProductRows * dv);
  sc.lost = slicer.take<Acc>(kRowProductRows * dv);
  const size_t gemm = Flash<In>::forward_gemm_words(nk, d, dv);
  sc.gemm = gemm > 0 ? slicer.take<double>(static_cast<int64_t>(gemm)) : nullptr;
  sc.amx = nullptr;
  if (kConverts && fast::amx_attention_enabled()) {
    sc.amx = slicer.take<double>(
        static_cast<int64_t>(fast::amx_attention_scratch_words(kQueryBlock, kKeyBlock, d, dv)));
  }
  return sc;
}

// ---- heads ---------------------------------------------------------------------
//
// The kernels' operands are (B, H, N, D) views (kernels.h): head bh = b H + h
// of queries, output and gradients; its keys and values are head
// kv_head(bh) of the (B, Hkv, N, D) keys and values, shared by H / Hkv
// consecutive query heads (grouped-query attention). Rows of a head are
// stride(2) apart, the D elements of a row contiguous.

template <class T>
T* head_rows(TensorView<T> x, int64_t bh) {
  const int64_t heads = x.size(1);
  return x.data() + (bh / heads) * x.stride(0) + (bh % heads) * x.stride(1);
}

// The key and value head that query head bh reads.
inline int64_t kv_head(int64_t bh, int64_t heads, int64_t kv_heads) {
  return (bh / heads) * kv_heads + (bh % heads) / (heads / kv_heads);
}

// x[r * ld + c] = value for the rows x cols block at x.
template <class T>
void fill_rows(T* x, int64_t ld, int64_t rows, int64_t cols, T value) {
  for (int64_t r = 0; r < rows; ++r) std::fill_n(x + r * ld, cols, value);
}

// Every element of a (B, H, N, D) view of the kernels' layout.
template <class T>
void fill_heads(TensorView<T> x, T value) {
  const int64_t heads = x.size(0) * x.size(1);
  for (int64_t bh = 0; bh < heads; ++bh) {
    fill_rows(head_rows(x, bh), x.stride(2), x.size(2), x.size(3), value);
  }
}

// A tile of scores as the softmax takes it: the softcap applied, the bias
// and ALiBi added, then the masked scores set to -inf (the masks last, so a
// masked key is -inf even where its bias is +inf or NaN). Rows and columns
// as in mask_tile. cap_grad (the backward's, rows ldg apart): the softcap's
// derivative 1 - tanh² of each score, when there is a softcap.
template <class T, class Head, class Query>
void adjust_scores(const AttentionConfig& config, T* s, int64_t lds, int64_t rows, int64_t cols,
                   int64_t j0, int64_t nq, int64_t nk, Head&& head, Query&& query,
                   T* cap_grad = nullptr, int64_t ldg = 0) {
  if (config.softcap > 0.0) {
    // Highway's tanh (vecmath.h): tanh_row's float fit (2.7e-7 relative,
    // additive_tile.h) put up to 1.35e-5 on a score at softcap 50, and
    // FlashAttention's softcap checks saw 6.3 times float32 torch's error.
    for (int64_t r = 0; r < rows; ++r) {
      fast::softcap(s + r * lds, config.softcap, cap_grad ? cap_grad + r * ldg : nullptr, cols);
    }
  }
  const ConstView<T> bias = config.bias<T>();
  if (bias.data() != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t bh = head(r), i = query(r);
      const T* row = bias.data() + (bh / config.heads) * bias.stride(0) +
                     (bh % config.heads) * bias.stride(1) + i * bias.stride(2) +
                     j0 * bias.stride(3);
      T* out = s + r * lds;
      const int64_t stride = bias.stride(3);
      if (stride == 1) {
        fast::add(out, row, cols);
      } else {
        for (int64_t c = 0; c < cols; ++c) out[c] += row[c * stride];
      }
    }
  }
  if (config.alibi_slopes.data() != nullptr) {
    // -slope |i + Nk - Nq - j|. The distances are integers below 2^24, exact
    // in float; formed from an int32 column index the loop vectorizes
    // (int64 -> float has no SSE/AVX2 instruction: that way the float
    // forward at B=2, H=8, N=2048, d=64 took 1.40x the plain one, this way
    // 1.04-1.07x, against 1.26-1.32x for the same ALiBi as a (1, H, N, N)
    // bias read from memory; 2 threads, a shared machine).
    for (int64_t r = 0; r < rows; ++r) {
      const T slope = static_cast<T>(config.alibi_slope(head(r)));
      const T diagonal = static_cast<T>(query(r) + nk - nq - j0);  // the column at distance 0
      T* out = s + r * lds;
      for (int32_t c = 0; c < static_cast<int32_t>(cols); ++c) {
        out[c] -= slope * std::abs(diagonal - static_cast<T>(c));
      }
    }
  }
  if (config.masked()) mask_tile(config, s, lds, rows, cols, j0, nq, nk, head, query);
}

// One query row the careful way (its valid scores are not all finite): all
// its scores, the exact masked softmax, dropout, and the weighted sum of the
// values. q_i: the row; k_b, v_b: its head's keys and values (rows ldk, ldv
// apart). Writes out (Dv), the weights row (if wanted) and returns the lse.
template <class In>
typename Flash<In>::Acc exact_row(const In* q_i, const In* k_b, int64_t ldk, const In* v_b,
                                  int64_t ldv, int64_t d, int64_t dv, int64_t len, int64_t nq,
                                  int64_t nk, int64_t bh, int64_t i, const AttentionConfig& config,
                                  typename Flash<In>::Acc* out,
                                  typename Flash<In>::Acc* weights_row,
                                  const ForwardScratch<In>& sc) {
  using Acc = typename Flash<In>::Acc;
  Acc* w = sc.row;
  Flash<In>::gemm(false, true, 1, len, d, static_cast<Acc>(config.scale), q_i, d, k_b, ldk, Acc(0),
                  w, len, sc.gemm);
  if (config.adjusts_scores()) {
    adjust_scores(
        config, w, len, 1, len, 0, nq, nk, [&](int64_t) { return bh; }, [&](int64_t) { return i; });
  }
  const Acc lse = softmax_row(w, len, len, w);
  if (weights_row) {
    std::copy_n(w, len, weights_row);
    std::fill(weights_row + len, weights_row + nk, Acc(0));
  }
  if (config.dropout > 0.0 && len > 0) {
    kernels::dropout_row_mask(config.seed, config.dropout, bh, i, 0, len, sc.row_keep);
    apply_dropout(w, sc.row_keep, dropout_inverse<Acc>(config), len);
  }
  Flash<In>::gemm(false, false, 1, dv, len, Acc(1), Flash<In>::operand(w, len, sc.row_operand), len,
                  v_b, ldv, Acc(0), out, dv, sc.gemm);
  return lse;
}

// Where the forward puts its finished rows' lse and softmax statistics
// (ForwardViews::softmax_stats), either null; `at(r)` is row r on.
template <class Acc>
struct RowResults {
  Acc* lse = nullptr;
  Acc* stats = nullptr;  // (m, l) pairs

  RowResults at(int64_t r) const {
    return {lse ? lse + r : nullptr, stats ? stats + 2 * r : nullptr};
  }
  // Row r summed with running max m and sum l (0: no key, an empty sum).
  void put(int64_t r, Acc m, Acc l) const {
    const bool empty = !(l > Acc(0));
    constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
    if (lse) lse[r] = empty ? -kInf : m + std::log(l);
    if (stats) {
      stats[2 * r] = empty ? -kInf : m;
      stats[2 * r + 1] = empty ? Acc(0) : l;
    }
  }
  // Row r done exactly (exact_row): its weights are exp(score - row_lse).
  void put_exact(int64_t r, Acc row_lse) const {
    if (lse) lse[r] = row_lse;
    if (stats) {
      stats[2 * r] = row_lse;
      stats[2 * r + 1] = row_lse == -std::numeric_limits<Acc>::infinity() ? Acc(0) : Acc(1);
    }
  }
};

// What a task over one chunk of the keys leaves for merge_key_chunks: each
// row's running max m and sum l, whether it met a non-finite score, and (in
// the task's `out`) its output before the division by l.
template <class Acc>
struct ChunkState {
  Acc *m, *l;
  uint8_t* special;
};

// Queries [i0, i0 + rows) of head bh against keys [key_begin, key_end) (a
// multiple of kKeyBlock, and all keys for a whole task); rows past Nq
// continue into the next heads of the group (row r is query (i0 + r) % Nq
// of head bh + (i0 + r) / Nq: see grouped_rows_per_task). `out`: the rows'
// output, ldo apart. With `chunk` null the task sees every key and finishes
// its rows: output divided by l, lse, weights, the exact path for
// non-finite rows. With `chunk` the rows are left for merge_key_chunks.
template <class In>
void forward_task(ConstView<In> q, ConstView<In> k, ConstView<In> v, const AttentionConfig& config,
                  int64_t bh, int64_t i0, int64_t rows, int64_t key_begin, int64_t key_end,
                  typename Flash<In>::Acc* out, int64_t ldo, typename Flash<In>::Acc* weights,
                  const RowResults<typename Flash<In>::Acc>& results,
                  const ChunkState<typename Flash<In>::Acc>* chunk,
                  const typename Flash<In>::KeyBlock* key_blocks, int64_t prepared_keys,
                  const ForwardScratch<In>& sc) {
  using Acc = typename Flash<In>::Acc;
  constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  const int64_t nq = q.size(2), nk = k.size(2), d = q.size(3), dv = v.size(3);
  const int64_t ldk = k.stride(2), ldv = v.stride(2);
  const int64_t bkv = kv_head(bh, q.size(1), k.size(1));
  // Row r's head and query.
  const auto row_head = [&](int64_t r) { return bh + (i0 + r) / nq; };
  const auto row_query = [&](int64_t r) { return (i0 + r) % nq; };
  const In* q_blk = head_rows(q, bh) + i0 * q.stride(2);
  int64_t ldq = q.stride(2);
  if (i0 + rows > nq) {  // rows of several heads: gathered
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(head_rows(q, row_head(r)) + row_query(r) * q.stride(2), d, sc.q_gather + r * d);
    }
    q_blk = sc.q_gather;
    ldq = d;
  }
  const In* k_b = head_rows(k, bkv);
  const In* v_b = head_rows(v, bkv);
  const Acc scale = static_cast<Acc>(config.scale);
  const bool dropout = config.dropout > 0.0;
  const Acc inv_keep = dropout_inverse<Acc>(config);
  // How the block products run: a few rows multiply keys and values in
  // place (row_products.h); more rows use the packed block products
  // (Flash<In>), or for bf16 without the BF16 instructions the float ones on
  // tiles widened here (the packed bf16 products would widen every block for
  // every product, and widening whole inputs first writes and re-reads 4
  // bytes per element: B=4, Nq=16, Nk=65536, d=128 took 250 ms that way
  // against 37 ms for float32 inputs).
  enum class Products { kRows, kPacked, kWidened };
  const Products products = rows <= kRowProductRows ? Products::kRows
                            : sc.k_wide             ? Products::kWidened
                                                    : Products::kPacked;
  // The queries in the accumulation type (kRows, kWidened), ldq_acc apart.
  const Acc* q_acc = nullptr;
  int64_t ldq_acc = d;
  if (products != Products::kPacked) {
    if constexpr (Flash<In>::kConverts) {
      fast::widen_rows(q_blk, ldq, rows, d, sc.q_rows);
      q_acc = sc.q_rows;
    } else {
      q_acc = q_blk;
      ldq_acc = ldq;
    }
  }

  std::fill_n(sc.m, rows, -kInf);
  std::fill_n(sc.l, rows, Acc(0));
  std::fill_n(sc.special, rows, uint8_t{0});
  int64_t n_eff = 0;
  for (int64_t r = 0; r < rows; ++r) {
    sc.len[r] = config.len(row_head(r), row_query(r), nk);
    n_eff = std::max(n_eff, sc.len[r]);
  }
  fill_rows(out, ldo, rows, dv, Acc(0));
  if (products == Products::kRows) fill_rows(sc.lost, dv, rows, dv, Acc(0));

  // bf16 on AMX tiles: the whole key loop fused on the tiles
  // (kernels/simd/amx_attention.h), when the keys are packed and nothing
  // but the lengths (and causal, a cap on them) decides which keys a row
  // sees. Masks, a bias, dropout and the weights take the loop below, one
  // block product at a time (on the tiles too); so does a scale <= 0.
  const bool fused = sc.amx && products == Products::kPacked && key_blocks && !dropout &&
                     !config.adjusts_scores() && !weights && scale > Acc(0) &&
                     scale < std::numeric_limits<Acc>::infinity();
  if constexpr (std::is_same_v<In, bfloat16>) {
    if (fused && key_begin < std::min(key_end, n_eff)) {
      assert(std::min(key_end, n_eff) <= prepared_keys);
      const fast::AmxAttentionRows task{q_blk, ldq,  rows, d,          dv,  sc.len,
                                        scale, sc.m, sc.l, sc.special, out, ldo};
      fast::amx_attention_rows(task, key_blocks, kKeyBlock, key_begin, std::min(key_end, n_eff),
                               sc.amx);
    }
  }

  for (int64_t j0 = fused ? key_end : key_begin; j0 < std::min(key_end, n_eff); j0 += kKeyBlock) {
    const int64_t cols = std::min(kKeyBlock, n_eff - j0);
    const In* k_blk = k_b + j0 * ldk;
    const In* v_blk = v_b + j0 * ldv;
    Acc* s = sc.s;
    // A prepared block serves only when this task needs the same keys (with
    // 2-D lengths the last block can be shorter here than for the batch).
    const auto* prepared = key_blocks && j0 + cols <= prepared_keys &&
                                   (cols == kKeyBlock || j0 + cols == prepared_keys)
                               ? &key_blocks[j0 / kKeyBlock]
                               : nullptr;
    // A tile the window and masks leave no key of: skipped, products and all.
    if (config.masked() && !tile_has_keys(config, rows, cols, j0, nq, nk, row_head, row_query)) {
      continue;
    }
    if (products == Products::kRows) {
      fast::row_scores(rows, cols, d, scale, q_acc, ldq_acc, k_blk, ldk, s, cols);
    } else if (products == Products::kPacked) {
      Flash<In>::scores(prepared, rows, cols, d, scale, q_blk, ldq, k_blk, ldk, s, cols, sc.gemm);
    } else if constexpr (Flash<In>::kConverts) {
      fast::widen_rows(k_blk, ldk, cols, d, sc.k_wide);
      fast::block_scores(rows, cols, d, scale, q_acc, d, sc.k_wide, d, s, cols, sc.block_pack);
    }
    if (config.adjusts_scores()) {
      adjust_scores(config, s, cols, rows, cols, j0, nq, nk, row_head, row_query);
    }
    for (int64_t r = 0; r < rows; ++r) {
      sc.valid[r] = std::clamp<int64_t>(sc.len[r] - j0, 0, cols);
    }
    // bf16 without dropout: the softmax writes P as the bf16 operand itself.
    In* p_fused = nullptr;
    if constexpr (std::is_same_v<In, bfloat16>) {
      if (!dropout && products == Products::kPacked) p_fused = sc.p_operand;
      softmax_tile_update(s, rows, cols, sc.valid, sc.m, sc.l, sc.correction, sc.special, p_fused);
    } else {
      softmax_tile_update(s, rows, cols, sc.valid, sc.m, sc.l, sc.correction, sc.special);
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (sc.correction[r] != Acc(1)) {
        fast::scale(out + r * ldo, sc.correction[r], dv);
        if (products == Products::kRows) fast::scale(sc.lost + r * dv, sc.correction[r], dv);
      }
      if (dropout && sc.valid[r] > 0 && !sc.special[r]) {
        kernels::dropout_row_mask(config.seed, config.dropout, row_head(r), row_query(r), j0,
                                  sc.valid[r], sc.keep);
        apply_dropout(s + r * cols, sc.keep, inv_keep, sc.valid[r]);
      }
    }
    if (products == Products::kRows) {
      // The block's P V summed from 0, then added to the output with Kahan's
      // compensation: a decoding task's output is a sum over up to 32768 keys
      // (Nk = 65536 in 2 chunks), and one float sum carried over every key
      // left its mean error near 1.5e-8 at any Nk, where a float32 reference's
      // falls (issue 33). Now each group of 32 keys is summed from 0
      // (row_accumulate), 8 groups make a block, and the blocks' sums are added
      // without loss. B=8, Nq=1, Nk=131072, d=64, normal inputs, mean error
      // against float64: 1.5e-8 with one sum, 1.2e-9 with the groups and
      // blocks summed apart, 0.85e-9 with the compensation too, where a float32
      // sum done pairwise gets 0.83e-9 (tests: FlashDecoding.*). Instructions
      // per call (valgrind, H=32, Hkv=8, Nk=2048, d=128, AVX2): +1.1 %.
      fill_rows(sc.block_out, dv, rows, dv, Acc(0));
      fast::row_accumulate(rows, cols, dv, s, cols, v_blk, ldv, sc.block_out, dv);
      for (int64_t r = 0; r < rows; ++r) {
        fast::add_compensated(out + r * ldo, sc.lost + r * dv, sc.block_out + r * dv, dv);
      }
    } else if (products == Products::kPacked) {
      const In* p_operand = p_fused ? p_fused : Flash<In>::operand(s, rows * cols, sc.p_operand);
      Flash<In>::accumulate(prepared, rows, dv, cols, p_operand, cols, v_blk, ldv, out, ldo,
                            sc.gemm);
    } else if constexpr (Flash<In>::kConverts) {
      fast::widen_rows(v_blk, ldv, cols, dv, sc.v_wide);
      fast::block_accumulate(rows, dv, cols, s, cols, sc.v_wide, dv, out, ldo, sc.block_pack);
    }
  }

  if (chunk) {
    std::copy_n(sc.m, rows, chunk->m);
    std::copy_n(sc.l, rows, chunk->l);
    std::copy_n(sc.special, rows, chunk->special);
    return;
  }

  for (int64_t r = 0; r < rows; ++r) {
    if (sc.special[r]) continue;
    if (sc.l[r] > Acc(0)) fast::scale(out + r * ldo, Acc(1) / sc.l[r], dv);
    results.put(r, sc.m[r], sc.l[r]);
  }

  if (weights) {
    // The weights before dropout, from the final max and sum of each row.
    for (int64_t r = 0; r < rows; ++r) std::fill(weights + r * nk, weights + (r + 1) * nk, Acc(0));
    for (int64_t j0 = 0; j0 < n_eff; j0 += kKeyBlock) {
      const int64_t cols = std::min(kKeyBlock, n_eff - j0);
      Flash<In>::scores(rows, cols, d, scale, q_blk, ldq, k_b + j0 * ldk, ldk, weights + j0, nk,
                        sc.gemm);
      if (config.adjusts_scores()) {
        adjust_scores(config, weights + j0, nk, rows, cols, j0, nq, nk, row_head, row_query);
      }
      for (int64_t r = 0; r < rows; ++r) {
        Acc* row = weights + r * nk + j0;
        const int64_t valid = std::clamp<int64_t>(sc.len[r] - j0, 0, cols);
        if (valid > 0 && !sc.special[r] && sc.l[r] > Acc(0)) {
          fast::exp_shift_sum(row, sc.m[r], row, valid);
          fast::scale(row, Acc(1) / sc.l[r], valid);
        }
        std::fill(row + (sc.special[r] || !(sc.l[r] > Acc(0)) ? 0 : valid), row + cols, Acc(0));
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    if (!sc.special[r]) continue;
    const Acc row_lse =
        exact_row(q_blk + r * ldq, k_b, ldk, v_b, ldv, d, dv, sc.len[r], nq, nk, row_head(r),
                  row_query(r), config, out + r * ldo, weights ? weights + r * nk : nullptr, sc);
    results.put_exact(r, row_lse);
  }
}

// Whether a bias or mask is read alike by several heads (zero strides over
// B or H): then the forward takes the heads of a query block in a row.
bool shared_by_heads(const AttentionConfig& config) {
  const auto shared = [](const auto& view) {
    return view.data() != nullptr && (view.stride(0) == 0 || view.stride(1) == 0);
  };
  return shared(config.bias_float) || shared(config.bias_double) || shared(config.mask);
}

// Doubles of one thread's forward scratch.
template <class In>
size_t forward_slot_words(int64_t nk, int64_t d, int64_t dv) {
  return counted_words([&](Slicer& count) { forward_scratch<In>(count, nk, d, dv); });
}

// Decoding with grouped heads (H > Hkv, fewer than kRowProductRows queries
// per head): a task takes up to kRowProductRows query rows of the heads that
// share a key head, in head order, so each key and value row is read once for
// all of them rather than once per head. Row products give every row the
// same bits in any grouping (row_products.h), and the key chunks stay those
// of one head per task: results are the bits of the heads run one by one.
// Not with the weights, whose sweep multiplies on the block products (their
// bits may depend on the number of rows). 0: one head per task.
int64_t grouped_rows_per_task(int64_t heads, int64_t kv_heads, int64_t nq, bool weights) {
  const int64_t group = heads / std::max<int64_t>(kv_heads, 1);
  return group > 1 && nq < kRowProductRows && !weights ? kRowProductRows : 0;
}

// Key chunks per head of the forward: enough (head, query block, chunk)
// tasks for the cores, never more chunks than key blocks; one when the
// weights are wanted (their sweep needs every row's final max and sum).
// Shapes only (determinism).
int64_t forward_key_chunks(int64_t heads, int64_t nq, int64_t nk, bool weights) {
  if (weights) return 1;
  const int64_t tasks = std::max<int64_t>(heads * ceil_div(nq, kQueryBlock), 1);
  return std::clamp<int64_t>(ceil_div(kMinForwardTasks, tasks), 1,
                             std::max<int64_t>(ceil_div(nk, kKeyBlock), 1));
}

// The forward's workspace: the key blocks prepared once for all query blocks
// (bf16, more than one query block: K and V packed per key head, in regions
// of packed_words doubles); with more than one key chunk, each chunk's
// partial rows (chunks, B H, Nq, ...); then one slot of forward_slot_words
// per thread.
template <class In>
struct ForwardWorkspace {
  using Acc = typename Flash<In>::Acc;
  using KeyBlock = typename Flash<In>::KeyBlock;
  KeyBlock* prepared = nullptr;      // (B Hkv * key blocks) or null
  int64_t* prepared_keys = nullptr;  // (B Hkv): keys prepared per key head, or null
  double* packed = nullptr;
  size_t packed_words = 0;
  int64_t chunks = 1;
  Acc* chunk_out = nullptr;  // (chunks, B H, Nq, Dv): outputs before the division by l
  Acc *chunk_m = nullptr, *chunk_l = nullptr;  // (chunks, B H, Nq)
  uint8_t* chunk_special = nullptr;            // (chunks, B H, Nq)
  double* slots = nullptr;
  size_t slot_words = 0;
};

// heads = B H, kv_heads = B Hkv.
template <class In>
ForwardWorkspace<In> forward_workspace(Slicer& slicer, int64_t heads, int64_t kv_heads, int64_t nq,
                                       int64_t nk, int64_t d, int64_t dv, bool weights,
                                       int num_threads) {
  using Acc = typename Flash<In>::Acc;
  using KeyBlock = typename Flash<In>::KeyBlock;
  ForwardWorkspace<In> ws;
  // Packed once for all query blocks; not without the BF16 instructions, where
  // each task widens its own tiles (packing would widen K and V whole).
  if constexpr (!std::is_empty_v<KeyBlock>) {
    const int64_t group = heads / std::max<int64_t>(kv_heads, 1);
    // On AMX tiles always: the fused key loop reads packed blocks only.
    const bool shared = ceil_div(nq, kQueryBlock) * group > 1 || fast::amx_attention_enabled();
    if (nq > kRowProductRows && shared && fast::bf16_native()) {
      const int64_t blocks = kv_heads * ceil_div(nk, kKeyBlock);
      ws.prepared = slicer.take<KeyBlock>(blocks);
      ws.prepared_keys = slicer.take<int64_t>(kv_heads);
      ws.packed_words = Flash<In>::prepare_words(std::min(nk, kKeyBlock), d, dv);
      ws.packed = slicer.take<double>(blocks * static_cast<int64_t>(ws.packed_words));
    }
  }
  ws.chunks = forward_key_chunks(heads, nq, nk, weights);
  if (ws.chunks > 1) {
    const int64_t rows = ws.chunks * heads * nq;
    ws.chunk_out = slicer.take<Acc>(rows * dv);
    ws.chunk_m = slicer.take<Acc>(rows);
    ws.chunk_l = slicer.take<Acc>(rows);
    ws.chunk_special = slicer.take<uint8_t>(rows);
  }
  ws.slot_words = forward_slot_words<In>(nk, d, dv);
  ws.slots = slicer.take<double>(num_threads * static_cast<int64_t>(ws.slot_words));
  return ws;
}

template <class In>
size_t forward_workspace_size(ConstView<In> q, ConstView<In> k, ConstView<In> v, bool weights,
                              int num_threads) {
  return counted_words([&](Slicer& count) {
    forward_workspace<In>(count, q.size(0) * q.size(1), k.size(0) * k.size(1), q.size(2), k.size(2),
                          q.size(3), v.size(3), weights, num_threads);
  });
}

// Row i of head bh from its key chunks' partial results: with M the largest
// chunk max, O = sum_c e^(m_c - M) O_c / sum_c e^(m_c - M) l_c, in chunk
// order; a row that met a non-finite score in any chunk takes exact_row
// over all its keys.
template <class In>
void merge_key_chunks(ConstView<In> q, ConstView<In> k, ConstView<In> v,
                      const AttentionConfig& config, const ForwardWorkspace<In>& ws, int64_t bh,
                      int64_t i, typename Flash<In>::Acc* out,
                      const RowResults<typename Flash<In>::Acc>& results,
                      const ForwardScratch<In>& sc) {
  using Acc = typename Flash<In>::Acc;
  constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  const int64_t heads = q.size(0) * q.size(1), nq = q.size(2), nk = k.size(2);
  const int64_t d = q.size(3), dv = v.size(3);
  const auto at = [&](int64_t c) { return (c * heads + bh) * nq + i; };
  bool special = false;
  Acc m_max = -kInf;
  for (int64_t c = 0; c < ws.chunks; ++c) {
    special = special || ws.chunk_special[at(c)];
    if (ws.chunk_l[at(c)] > Acc(0)) m_max = std::max(m_max, ws.chunk_m[at(c)]);
  }
  if (special) {
    const int64_t bkv = kv_head(bh, q.size(1), k.size(1));
    const Acc row_lse = exact_row(head_rows(q, bh) + i * q.stride(2), head_rows(k, bkv),
                                  k.stride(2), head_rows(v, bkv), v.stride(2), d, dv,
                                  config.len(bh, i, nk), nq, nk, bh, i, config, out, nullptr, sc);
    results.put_exact(0, row_lse);
    return;
  }
  std::fill_n(out, dv, Acc(0));
  Acc sum = 0;
  for (int64_t c = 0; c < ws.chunks; ++c) {
    const Acc l = ws.chunk_l[at(c)];
    if (!(l > Acc(0))) continue;  // no valid key in this chunk
    const Acc factor = std::exp(ws.chunk_m[at(c)] - m_max);
    sum += factor * l;
    const Acc* part = ws.chunk_out + at(c) * dv;
    for (int64_t e = 0; e < dv; ++e) out[e] += factor * part[e];
  }
  if (sum > Acc(0)) fast::scale(out, Acc(1) / sum, dv);
  results.put(0, m_max, sum);
}

template <class In>
void flash_forward(ConstView<In> q, ConstView<In> k, ConstView<In> v, const AttentionConfig& config,
                   TensorView<typename Flash<In>::Acc> output,
                   TensorView<typename Flash<In>::Acc> weights,
                   TensorView<typename Flash<In>::Acc> lse,
                   TensorView<typename Flash<In>::Acc> softmax_stats, Workspace workspace) {
  using Acc = typename Flash<In>::Acc;
  using KeyBlock = typename Flash<In>::KeyBlock;
  const RowResults<Acc> results{lse.data(), softmax_stats.data()};
  const int64_t heads = q.size(0) * q.size(1), kv_heads = k.size(0) * k.size(1);
  const int64_t nq = q.size(2), nk = k.size(2), d = q.size(3), dv = v.size(3);
  const int64_t ldo = output.stride(2);
  const int64_t blocks = ceil_div(nq, kQueryBlock);
  const int64_t key_blocks = ceil_div(nk, kKeyBlock);
  Slicer slicer(workspace.data);
  const ForwardWorkspace<In> ws = forward_workspace<In>(
      slicer, heads, kv_heads, nq, nk, d, dv, weights.data() != nullptr, workspace.num_threads);
  // Key blocks prepared once for all query blocks and heads of a group (bf16:
  // packed K and V), up to the longest valid length of the batch element:
  // keys no query may see are never read.
  if constexpr (!std::is_empty_v<KeyBlock>) {
    if (ws.prepared) {
      std::uninitialized_default_construct_n(ws.prepared, kv_heads * key_blocks);
      for (int64_t bkv = 0; bkv < kv_heads; ++bkv) {
        ws.prepared_keys[bkv] = longest_len(config.valid_lens, bkv / k.size(1), 0, nq, nk);
      }
      kernels::parallel_for(kv_heads * key_blocks, [&](int64_t task) {
        const int64_t bkv = task / key_blocks, j0 = (task % key_blocks) * kKeyBlock;
        if (j0 >= ws.prepared_keys[bkv]) return;
        const int64_t cols = std::min(kKeyBlock, ws.prepared_keys[bkv] - j0);
        ws.prepared[task] = Flash<In>::prepare(head_rows(k, bkv) + j0 * k.stride(2), k.stride(2),
                                               head_rows(v, bkv) + j0 * v.stride(2), v.stride(2),
                                               cols, d, dv, ws.packed + task * ws.packed_words);
      });
    }
  }
  const int64_t chunks = ws.chunks;
  const int64_t chunk_keys = ceil_div(key_blocks, chunks) * kKeyBlock;
  // Row tasks: (head, query block), or with grouped heads (key head, up to
  // `grouped` rows of its query heads).
  const int64_t group = q.size(1) / std::max<int64_t>(k.size(1), 1);
  const int64_t grouped =
      grouped_rows_per_task(q.size(1), k.size(1), nq, weights.data() != nullptr);
  const int64_t group_tasks = grouped ? ceil_div(group * nq, grouped) : 0;
  const int64_t row_tasks = grouped ? kv_heads * group_tasks : heads * blocks;
  // A bias or mask shared by the heads: the tasks of one query block, every
  // head, run one after another, so that block's rows of it come from
  // memory once and from cache for the other heads (B=2, H=8, N=4096, 2
  // threads, an (N, N) float bias: 1.16x -> 1.13x the unbiased time; a
  // random (N, N) mask of bytes: 1.10-1.14x either way).
  const bool block_major = shared_by_heads(config);
  kernels::parallel_for_slots(
      row_tasks * chunks, workspace.num_threads, [&](int64_t task, int slot) {
        Slicer slot_slicer(ws.slots + slot * ws.slot_words);
        const ForwardScratch<In> scratch = forward_scratch<In>(slot_slicer, nk, d, dv);
        const int64_t c = task % chunks, rt = task / chunks;
        int64_t bh, i0, rows;
        if (grouped) {
          const int64_t bkv = rt / group_tasks, first = (rt % group_tasks) * grouped;
          const int64_t bh0 = (bkv / k.size(1)) * q.size(1) + (bkv % k.size(1)) * group;
          bh = bh0 + first / nq;
          i0 = first % nq;
          rows = std::min(grouped, group * nq - first);
        } else {
          bh = block_major ? rt % heads : rt / blocks;
          i0 = (block_major ? rt / heads : rt % blocks) * kQueryBlock;
          rows = std::min(kQueryBlock, nq - i0);
        }
        const int64_t bkv = kv_head(bh, q.size(1), k.size(1));
        const KeyBlock* prepared = ws.prepared ? ws.prepared + bkv * key_blocks : nullptr;
        const int64_t prepared_keys = ws.prepared ? ws.prepared_keys[bkv] : 0;
        if (chunks == 1) {
          // Rows of several heads go through out_rows to their heads' rows.
          const bool spans = i0 + rows > nq;
          forward_task(q, k, v, config, bh, i0, rows, 0, nk,
                       spans ? scratch.out_rows : head_rows(output, bh) + i0 * ldo,
                       spans ? dv : ldo,
                       weights.data() ? weights.data() + (bh * nq + i0) * nk : nullptr,
                       results.at(bh * nq + i0), nullptr, prepared, prepared_keys, scratch);
          if (spans) {
            for (int64_t r = 0; r < rows; ++r) {
              std::copy_n(scratch.out_rows + r * dv, dv,
                          head_rows(output, bh + (i0 + r) / nq) + ((i0 + r) % nq) * ldo);
            }
          }
          return;
        }
        const int64_t first = (c * heads + bh) * nq + i0;
        const ChunkState<Acc> state{ws.chunk_m + first, ws.chunk_l + first,
                                    ws.chunk_special + first};
        forward_task(q, k, v, config, bh, i0, rows, c * chunk_keys,
                     std::min(nk, (c + 1) * chunk_keys), ws.chunk_out + first * dv, dv, nullptr,
                     RowResults<Acc>(), &state, prepared, prepared_keys, scratch);
      });
  if (chunks == 1) return;
  // Rows in groups of a query block: the merge reads chunks x Dv per row.
  const int64_t rows = heads * nq;
  kernels::parallel_for_slots(
      ceil_div(rows, kQueryBlock), workspace.num_threads, [&](int64_t task, int slot) {
        Slicer slot_slicer(ws.slots + slot * ws.slot_words);
        const ForwardScratch<In> scratch = forward_scratch<In>(slot_slicer, nk, d, dv);
        for (int64_t row = task * kQueryBlock; row < std::min(rows, (task + 1) * kQueryBlock);
             ++row) {
          const int64_t bh = row / nq, i = row % nq;
          merge_key_chunks(q, k, v, config, ws, bh, i, head_rows(output, bh) + i * ldo,
                           results.at(row), scratch);
        }
      });
}

// ---- backward ------------------------------------------------------------------

// Per-thread scratch of the backward, a slot of the workspace: one key
// block's P and dS tiles against a query block, its dK and dV, and (bf16)
// the operands rounded for the products.
template <class In>
struct BackwardScratch {
  using Acc = typename Flash<In>::Acc;
  Acc *p, *dp, *dk, *dv;
  Acc* cap_grad;  // with a softcap: the P tile's 1 - tanh² (null otherwise)
  uint8_t* keep;
  In *p_operand, *ds_operand, *d_out_operand;  // null unless bf16
  double* gemm;  // the block products' own scratch (backward_gemm_words)
};

template <class In>
BackwardScratch<In> backward_scratch(Slicer& slicer, int64_t d, int64_t dv, bool softcap) {
  using Acc = typename Flash<In>::Acc;
  constexpr bool kConverts = Flash<In>::kConverts;
  constexpr int64_t kTile = kBackQueryBlock * kBackKeyBlock;
  BackwardScratch<In> sc;
  sc.p = slicer.take<Acc>(kTile);
  sc.dp = slicer.take<Acc>(kTile);
  sc.dk = slicer.take<Acc>(kBackKeyBlock * d);
  sc.dv = slicer.take<Acc>(kBackKeyBlock * dv);
  sc.cap_grad = softcap ? slicer.take<Acc>(kTile) : nullptr;
  sc.keep = slicer.take<uint8_t>(kBackKeyBlock);
  sc.p_operand = kConverts ? slicer.take<In>(kTile) : nullptr;
  sc.ds_operand = kConverts ? slicer.take<In>(kTile) : nullptr;
  sc.d_out_operand = kConverts ? slicer.take<In>(kBackQueryBlock * dv) : nullptr;
  const size_t gemm = Flash<In>::backward_gemm_words(d, dv);
  sc.gemm = gemm > 0 ? slicer.take<double>(static_cast<int64_t>(gemm)) : nullptr;
  return sc;
}

// Everything the backward tasks share. Views in the kernels' (B, H, N, D)
// layout; lse, delta and the partial dQs contiguous over heads bh.
template <class In>
struct BackwardProblem {
  using Acc = typename Flash<In>::Acc;
  ConstView<In> q, k, v;
  const AttentionConfig* config;
  const Acc* lse;        // (B H, Nq)
  const Acc* stats;      // (B H, Nq, 2): the forward's (m, l) per row, or null
  ConstView<Acc> d_out;  // (B, H, Nq, Dv)
  const Acc* delta;      // (B H, Nq): dO_i . O_i - d_lse_i
  const Acc* d_lse;      // (B H, Nq), or null
  int64_t groups;        // key groups per key head
  int64_t blocks_per_group;
  Acc* d_queries_parts;       // (groups, B H, Nq, D), or null when groups == 1
  TensorView<Acc> d_queries;  // written straight when groups == 1
  TensorView<Acc> d_keys;     // (B, Hkv, Nk, D)
  TensorView<Acc> d_values;   // (B, Hkv, Nk, Dv)
  TensorView<Acc> d_bias;     // (B, H, Nq, Nk), zero strides where it broadcasts; or null
};

// The backward's tile of scores S = scale Q Kᵀ for queries [i0, i0 + rows)
// (p: rows x cols, ldp), on the product the forward formed them with, so P
// gets the forward's bits: row_scores where the forward's task had at most
// kRowProductRows queries, else Flash<In>::scores (float: block_scores). Each
// element of either is one sum over D in an order fixed by D alone
// (block_gemm.h, row_products.h), so the tiles' sizes do not change it.
// Recomputed on the BLAS, S differed from the forward's in the last bits,
// so P = exp(S - lse) disagreed with the P inside the saved output and D: on
// FlashAttention's grid (bench/fa_grad_rule.py: float32, 2 x 1764 checks
// against plain torch in float32 and float64) the gradients' max error
// reached 4.19x float32 torch's (its rule is 2x; 42 checks above 2x besides
// the one-key rows); on the forward's bits 2.72x (23 checks). What is left is
// the float32 lse: a torch emulation keeping the forward's max and sum stays
// within 1.8x. bf16 keeps gemm_bf16; float64's BLAS bits can still depend on
// the tile's shape (OpenBLAS's small-matrix kernels).
template <class In>
void backward_scores(int64_t nq, int64_t i0, int64_t rows, int64_t cols, int64_t d,
                     typename Flash<In>::Acc scale, const In* q_blk, int64_t ldq, const In* k_blk,
                     int64_t ldk, typename Flash<In>::Acc* p, int64_t ldp,
                     const BackwardScratch<In>& sc) {
  using Acc = typename Flash<In>::Acc;
  if constexpr (!Flash<In>::kConverts) {
    // The forward's query blocks are kQueryBlock long, a multiple of ours.
    static_assert(kQueryBlock % kBackQueryBlock == 0);
    const int64_t forward_rows = std::min(kQueryBlock, nq - i0 / kQueryBlock * kQueryBlock);
    if (forward_rows <= kRowProductRows) {
      fast::row_scores(rows, cols, d, scale, q_blk, ldq, k_blk, ldk, p, ldp);
    } else {
      Flash<In>::scores(rows, cols, d, scale, q_blk, ldq, k_blk, ldk, p, ldp, sc.gemm);
    }
  } else {
    Flash<In>::gemm(false, true, rows, cols, d, scale, q_blk, ldq, k_blk, ldk, Acc(0), p, ldp,
                    sc.gemm);
  }
}

// One key block [j0, j0 + cols) of key head bkv against every query block
// of the query heads that read it (in head order): its dK and dV summed over
// them, and its terms of their (partial) dQ.
template <class In>
void backward_key_block(const BackwardProblem<In>& pb, int64_t bkv, int64_t g, int64_t j0,
                        int64_t cols, const BackwardScratch<In>& sc) {
  using Acc = typename Flash<In>::Acc;
  constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  const AttentionConfig& config = *pb.config;
  const int64_t heads = pb.q.size(1), kv_heads = pb.k.size(1), group = heads / kv_heads;
  const int64_t nq = pb.q.size(2), nk = pb.k.size(2), d = pb.q.size(3), dv = pb.v.size(3);
  const int64_t ldq = pb.q.stride(2), ldk = pb.k.stride(2), ldv = pb.v.stride(2);
  const int64_t ld_dout = pb.d_out.stride(2);
  const Acc scale = static_cast<Acc>(config.scale);
  const bool dropout = config.dropout > 0.0;
  const Acc inv_keep = dropout_inverse<Acc>(config);
  const In* k_blk = head_rows(pb.k, bkv) + j0 * ldk;
  const In* v_blk = head_rows(pb.v, bkv) + j0 * ldv;
  const int64_t b = bkv / kv_heads;

  std::fill_n(sc.dk, cols * d, Acc(0));
  std::fill_n(sc.dv, cols * dv, Acc(0));

  for (int64_t h = (bkv % kv_heads) * group; h < (bkv % kv_heads + 1) * group; ++h) {
    const int64_t bh = b * heads + h;
    Acc* dq_head = pb.d_queries_parts
                       ? pb.d_queries_parts + (g * pb.q.size(0) * heads + bh) * nq * d
                       : head_rows(pb.d_queries, bh);
    const int64_t ld_dq = pb.d_queries_parts ? d : pb.d_queries.stride(2);
    for (int64_t i0 = 0; i0 < nq; i0 += kBackQueryBlock) {
      const int64_t rows = std::min(kBackQueryBlock, nq - i0);
      if (longest_len(config.valid_lens, b, i0, i0 + rows, nk) <= j0) continue;
      const auto row_head = [&](int64_t) { return bh; };
      const auto row_query = [&](int64_t r) { return i0 + r; };
      if (config.masked() && !tile_has_keys(config, rows, cols, j0, nq, nk, row_head, row_query)) {
        continue;  // no key of this tile is seen: no gradient
      }
      const In* q_blk = head_rows(pb.q, bh) + i0 * ldq;
      const Acc* d_out_blk = head_rows(pb.d_out, bh) + i0 * ld_dout;
      // dO as the products see it: bf16 rounded row by row, else in place.
      const In* d_out_op;
      int64_t ld_dop = ld_dout;
      if constexpr (Flash<In>::kConverts) {
        for (int64_t r = 0; r < rows; ++r) {
          Flash<In>::operand(d_out_blk + r * ld_dout, dv, sc.d_out_operand + r * dv);
        }
        d_out_op = sc.d_out_operand;
        ld_dop = dv;
      } else {
        d_out_op = d_out_blk;
      }
      Acc* p = sc.p;
      Acc* dp = sc.dp;
      backward_scores(nq, i0, rows, cols, d, scale, q_blk, ldq, k_blk, ldk, p, cols, sc);
      if (config.adjusts_scores()) {
        adjust_scores(config, p, cols, rows, cols, j0, nq, nk, row_head, row_query, sc.cap_grad,
                      cols);
      }
      // dP = dO Vᵀ summed in groups of 32 like S (block_gemm.h): on the BLAS's
      // one chain per element, dq's error reached 2.2x a float32 torch
      // computation's at Nq = Nk = 512, D = 128 (a numpy emulation of this
      // backward, 20 draws), 1.1x in groups; its mean 1.03x -> 0.75x.
      if constexpr (!Flash<In>::kConverts) {
        Flash<In>::scores(rows, cols, dv, Acc(1), d_out_op, ld_dop, v_blk, ldv, dp, cols, sc.gemm);
      } else {
        Flash<In>::gemm(false, true, rows, cols, dv, Acc(1), d_out_op, ld_dop, v_blk, ldv, Acc(0),
                        dp, cols, sc.gemm);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const int64_t valid = std::clamp<int64_t>(config.len(bh, i, nk) - j0, 0, cols);
        // P as the forward formed it, exp(S - m) / l, from its row max and
        // sum; from the lse alone, exp(S - lse) carries the lse's rounding
        // into every weight of the row alike (float32: 2.4e-7 at lse = 3),
        // which FlashAttention's grid saw in the gradients as up to 2.6x
        // float32 torch's error (bench/fa_grad_rule.py).
        const Acc shift = pb.stats ? pb.stats[2 * (bh * nq + i)] : pb.lse[bh * nq + i];
        const Acc row_sum = pb.stats ? pb.stats[2 * (bh * nq + i) + 1] : Acc(1);
        Acc* p_row = p + r * cols;
        Acc* dp_row = dp + r * cols;
        if (valid == 0 || shift == -kInf) {
          std::fill(p_row, p_row + cols, Acc(0));  // no weight, no gradient
          std::fill(dp_row, dp_row + cols, Acc(0));
          continue;
        }
        fast::exp_shift_sum(p_row, shift, p_row, valid);  // NaN lse gives a NaN row
        if (row_sum != Acc(1)) fast::scale(p_row, Acc(1) / row_sum, valid);
        std::fill(p_row + valid, p_row + cols, Acc(0));
        if (dropout) {
          kernels::dropout_row_mask(config.seed, config.dropout, bh, i, j0, valid, sc.keep);
          apply_dropout(dp_row, sc.keep, inv_keep, valid);
        }
        // dS = P (dP - D) into dp; then P becomes the dropped weights for dV.
        fast::softmax_grad(p_row, dp_row, pb.delta[bh * nq + i], dp_row, valid);
        // A weight of exactly 1 leaves every other weight of its row below
        // 2^-24 (they sum to 1 - P), so sum_k P_k dP_k is dP_j to float
        // rounding and the exact dS_j = P_j sum_{k != j} P_k (dP_j - dP_k)
        // + P_j d_lse is d_lse_i to within 2^-23 max|dP|: exactly so for a
        // query that sees one key (Nk = 1, window (0, 0)), where P (S recomputed
        // with the forward's bits, lse = m + log 1 = m) is exactly 1. dP - D
        // itself is not 0 there: dP comes from the BLAS, D = dO . O from a
        // dot in another order (1e-7 off before, issue 33's item 2).
        // (A select, not a branch, so the loop vectorizes.)
        const Acc one_key_ds = pb.d_lse ? pb.d_lse[bh * nq + i] : Acc(0);
        for (int64_t c = 0; c < valid; ++c) {
          dp_row[c] = p_row[c] == Acc(1) ? one_key_ds : dp_row[c];
        }
        std::fill(dp_row + valid, dp_row + cols, Acc(0));
        if (pb.d_bias.data() != nullptr) {  // dS is the gradient of the biased score
          const TensorView<Acc>& db = pb.d_bias;
          Acc* g = db.data() + b * db.stride(0) + (bh % heads) * db.stride(1) + i * db.stride(2) +
                   j0 * db.stride(3);
          for (int64_t c = 0; c < valid; ++c) g[c * db.stride(3)] += dp_row[c];
        }
        if (config.softcap > 0.0) {  // the gradient of the dot product before the cap
          const Acc* g = sc.cap_grad + r * cols;
          for (int64_t c = 0; c < valid; ++c) dp_row[c] *= g[c];
        }
        if (dropout) apply_dropout(p_row, sc.keep, inv_keep, valid);
      }
      const In* p_op = Flash<In>::operand(p, rows * cols, sc.p_operand);
      const In* ds_op = Flash<In>::operand(dp, rows * cols, sc.ds_operand);
      Flash<In>::gemm(true, false, cols, dv, rows, Acc(1), p_op, cols, d_out_op, ld_dop, Acc(1),
                      sc.dv, dv, sc.gemm);
      Flash<In>::gemm(true, false, cols, d, rows, scale, ds_op, cols, q_blk, ldq, Acc(1), sc.dk, d,
                      sc.gemm);
      Flash<In>::gemm(false, false, rows, d, cols, scale, ds_op, cols, k_blk, ldk, Acc(1),
                      dq_head + i0 * ld_dq, ld_dq, sc.gemm);
    }
  }
  const int64_t ld_dk = pb.d_keys.stride(2), ld_dv = pb.d_values.stride(2);
  Acc* dk_out = head_rows(pb.d_keys, bkv) + j0 * ld_dk;
  Acc* dv_out = head_rows(pb.d_values, bkv) + j0 * ld_dv;
  for (int64_t c = 0; c < cols; ++c) {
    std::copy_n(sc.dk + c * d, d, dk_out + c * ld_dk);
    std::copy_n(sc.dv + c * dv, dv, dv_out + c * ld_dv);
  }
}

// Key groups per key head: enough (key head, group) tasks for the cores,
// never more groups than key blocks; shapes only (determinism). No heads
// (B = 0) have nothing to split (one group).
// A bias gradient shared by key heads (the bias broadcasts over B, or over
// H with several key heads) sums the dS of several tasks into one element;
// then a task takes its key blocks of every key head, in head order
// (task_heads = 1), so each element has one writer and one order of
// summation whatever the threads.
template <class Acc>
bool shared_bias_grad(TensorView<Acc> d_bias, int64_t kv_heads_per_batch) {
  return d_bias.data() != nullptr && ((d_bias.stride(0) == 0 && d_bias.size(0) > 1) ||
                                      (d_bias.stride(1) == 0 && kv_heads_per_batch > 1));
}
int64_t task_heads(int64_t kv_heads, bool shared) { return shared ? 1 : kv_heads; }

int64_t backward_groups(int64_t kv_heads, int64_t nk) {
  const int64_t key_blocks = ceil_div(nk, kBackKeyBlock);
  return std::clamp<int64_t>(ceil_div(kMinBackwardTasks, std::max<int64_t>(kv_heads, 1)), 1,
                             std::max<int64_t>(key_blocks, 1));
}

// The backward's workspace: D (B H, Nq), the partial dQs (groups, B H, Nq,
// D) when there is more than one group, then one slot per thread.
template <class In>
struct BackwardWorkspace {
  using Acc = typename Flash<In>::Acc;
  Acc* delta = nullptr;
  Acc* parts = nullptr;
  double* slots = nullptr;
  size_t slot_words = 0;
};

// heads = B H, kv_heads = B Hkv.
template <class In>
BackwardWorkspace<In> backward_workspace(Slicer& slicer, int64_t heads, int64_t kv_heads,
                                         int64_t nq, int64_t nk, int64_t d, int64_t dv, bool shared,
                                         bool softcap, int num_threads) {
  using Acc = typename Flash<In>::Acc;
  BackwardWorkspace<In> ws;
  const int64_t groups = backward_groups(task_heads(kv_heads, shared), nk);
  ws.delta = slicer.take<Acc>(heads * nq);
  if (groups > 1) ws.parts = slicer.take<Acc>(groups * heads * nq * d);
  ws.slot_words =
      counted_words([&](Slicer& count) { backward_scratch<In>(count, d, dv, softcap); });
  ws.slots = slicer.take<double>(num_threads * static_cast<int64_t>(ws.slot_words));
  return ws;
}

template <class In>
size_t backward_workspace_size(ConstView<In> q, ConstView<In> k, ConstView<In> v,
                               TensorView<typename Flash<In>::Acc> d_bias, bool softcap,
                               int num_threads) {
  return counted_words([&](Slicer& count) {
    backward_workspace<In>(count, q.size(0) * q.size(1), k.size(0) * k.size(1), q.size(2),
                           k.size(2), q.size(3), v.size(3), shared_bias_grad(d_bias, k.size(1)),
                           softcap, num_threads);
  });
}

template <class In>
void flash_backward(ConstView<In> q, ConstView<In> k, ConstView<In> v,
                    const AttentionConfig& config, const SavedViews<typename Flash<In>::Acc>& saved,
                    ConstView<typename Flash<In>::Acc> d_output,
                    const SdpaGradViews<typename Flash<In>::Acc>& grads, Workspace workspace) {
  using Acc = typename Flash<In>::Acc;
  const int64_t heads = q.size(0) * q.size(1), kv_heads = k.size(0) * k.size(1);
  const int64_t nq = q.size(2), nk = k.size(2), d = q.size(3), dv = v.size(3);
  const ConstView<Acc> output = saved.output;
  const bool bias_grad = grads.d_bias.data() != nullptr;
  const bool shared = shared_bias_grad(grads.d_bias, k.size(1));
  Slicer slicer(workspace.data);
  const BackwardWorkspace<In> ws = backward_workspace<In>(
      slicer, heads, kv_heads, nq, nk, d, dv, shared, config.softcap > 0.0, workspace.num_threads);
  // Keys no query sees get no gradient, and dQ is accumulated into.
  fill_heads(grads.d_queries, Acc(0));
  fill_heads(grads.d_keys, Acc(0));
  fill_heads(grads.d_values, Acc(0));
  if (bias_grad) std::fill_n(grads.d_bias.data(), bias_grad_extent(grads.d_bias), Acc(0));
  // A bias the same for every key of a row leaves the weights as they are:
  // its gradient, sum_j P_ij (dP_ij - D_i) = D_i - D_i, is exactly 0, and
  // the tiles do not form it (their key groups would all add into it). With
  // a gradient at the lse, which such a bias shifts, it is d_lse_i (times
  // sum_j P_ij: 1, or 0 for a row with no key), summed here row by row.
  const bool key_constant_bias = bias_grad && grads.d_bias.stride(3) == 0 && nk > 1;
  if (key_constant_bias && saved.d_lse.data() != nullptr) {
    const TensorView<Acc>& db = grads.d_bias;
    for (int64_t bh = 0; bh < heads; ++bh) {
      const int64_t b = bh / q.size(1), h = bh % q.size(1);
      for (int64_t i = 0; i < nq; ++i) {
        const Acc row_lse = saved.lse.data()[bh * nq + i];
        if (row_lse == -std::numeric_limits<Acc>::infinity()) continue;
        db.data()[b * db.stride(0) + h * db.stride(1) + i * db.stride(2)] +=
            std::isnan(row_lse) ? row_lse : saved.d_lse.data()[bh * nq + i];
      }
    }
  }

  // D_i = dO_i . O_i (O includes the dropout): sum_j P_ij dP_ij of the softmax
  // backward, less the gradient arriving at lse_i (d lse_i / d S_ij = P_ij).
  const int64_t rows = heads * nq;
  const Acc* d_lse = saved.d_lse.data();
  kernels::parallel_for(ceil_div(rows, 1024), [&](int64_t task) {
    for (int64_t r = task * 1024; r < std::min(rows, (task + 1) * 1024); ++r) {
      const int64_t bh = r / nq, i = r % nq;
      ws.delta[r] = Flash<In>::delta(head_rows(d_output, bh) + i * d_output.stride(2),
                                     head_rows(output, bh) + i * output.stride(2), dv);
      if (d_lse != nullptr) ws.delta[r] -= d_lse[r];
    }
  });

  const int64_t key_blocks = ceil_div(nk, kBackKeyBlock);
  const int64_t tasks_per_group = task_heads(kv_heads, shared);
  const int64_t groups = backward_groups(tasks_per_group, nk);
  const int64_t blocks_per_group = ceil_div(key_blocks, groups);
  if (groups > 1) std::fill_n(ws.parts, groups * heads * nq * d, Acc(0));
  const BackwardProblem<In> pb{q,
                               k,
                               v,
                               &config,
                               saved.lse.data(),
                               saved.softmax_stats.data(),
                               d_output,
                               ws.delta,
                               d_lse,
                               groups,
                               blocks_per_group,
                               groups > 1 ? ws.parts : nullptr,
                               grads.d_queries,
                               grads.d_keys,
                               grads.d_values,
                               key_constant_bias ? TensorView<Acc>() : grads.d_bias};

  // Task (key head, group), or with a shared bias gradient (group) over every key head.
  const int64_t heads_per_task = shared ? kv_heads : 1;
  kernels::parallel_for_slots(
      tasks_per_group * groups, workspace.num_threads, [&](int64_t task, int slot) {
        Slicer slot_slicer(ws.slots + slot * ws.slot_words);
        const BackwardScratch<In> scratch =
            backward_scratch<In>(slot_slicer, d, dv, config.softcap > 0.0);
        const int64_t g = task % groups;
        for (int64_t bkv = (task / groups) * heads_per_task;
             bkv < (task / groups + 1) * heads_per_task; ++bkv) {
          const int64_t seen = longest_len(config.valid_lens, bkv / k.size(1), 0, nq, nk);
          const int64_t first = g * blocks_per_group;
          const int64_t last = std::min(key_blocks, first + blocks_per_group);
          for (int64_t kb = first; kb < last; ++kb) {
            const int64_t j0 = kb * kBackKeyBlock;
            if (j0 >= seen) break;  // keys no query may see: never read, gradient 0
            backward_key_block(pb, bkv, g, j0, std::min(kBackKeyBlock, seen - j0), scratch);
          }
        }
      });

  if (groups > 1) {
    // dQ = sum over groups, in group order, row by row into d_queries.
    const int64_t n = heads * nq * d;
    kernels::parallel_for(ceil_div(rows, 256), [&](int64_t task) {
      for (int64_t r = task * 256; r < std::min(rows, (task + 1) * 256); ++r) {
        Acc* dq = head_rows(grads.d_queries, r / nq) + (r % nq) * grads.d_queries.stride(2);
        std::copy_n(ws.parts + r * d, d, dq);
        for (int64_t g = 1; g < groups; ++g) {
          const Acc* part = ws.parts + g * n + r * d;
          for (int64_t e = 0; e < d; ++e) dq[e] += part[e];
        }
      }
    });
  }
}

// Heads up to kSmallHead, without weights, go to the small-dimension kernel
// (3-D, contiguous: one head per batch element).
template <class T>
bool small_head(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
                const ForwardViews<T>& out) {
  return out.weights.data() == nullptr && q.size(3) <= kSmallHead && v.size(3) <= kSmallHead &&
         q.size(1) == 1 && k.size(1) == 1 && q.is_contiguous() && k.is_contiguous() &&
         v.is_contiguous() && out.output.is_contiguous() && !config.adjusts_scores() &&
         small_dim_applies(q.size(3), v.size(3), config);
}

// A (B, 1, N, D) view as (B, N, D).
template <class T>
TensorView<T> one_head(TensorView<T> x) {
  return TensorView<T>(x.data(), Shape{x.size(0), x.size(2), x.size(3)},
                       Shape{x.stride(0), x.stride(2), x.stride(3)});
}

}  // namespace

// q: (B, H, Nq, D)   k: (B, Hkv, Nk, D)   v: (B, Hkv, Nk, Dv)   (kernels.h)
// out.output: (B, H, Nq, Dv)   out.weights: (B, H, Nq, Nk) or null   out.lse: (B, H, Nq) or null
template <class T>
size_t sdpa_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                           const AttentionConfig& config, const ForwardViews<T>& out,
                           int num_threads) {
  if (small_head(q, k, v, config, out)) {
    return small_dim_workspace_size<T>(q.size(0), k.size(2), q.size(3), v.size(3), false);
  }
  return forward_workspace_size<T>(q, k, v, out.weights.data() != nullptr, num_threads);
}

template <class T>
void sdpa(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
          const ForwardViews<T>& out, Workspace workspace) {
  if (small_head(q, k, v, config, out)) {
    const TensorView<T> lse = out.lse.data()
                                  ? TensorView<T>(out.lse.data(), Shape{q.size(0), q.size(2)})
                                  : TensorView<T>();
    small_dim_forward(one_head(q), one_head(k), one_head(v), static_cast<const T*>(nullptr),
                      ScoreKind::kDotProduct, config, one_head(out.output), lse, workspace);
    // This kernel keeps no (m, l) pair: its rows' weights are exp(score - lse).
    const RowResults<T> results{nullptr, out.softmax_stats.data()};
    for (int64_t r = 0; results.stats && r < q.size(0) * q.size(2); ++r) {
      results.put_exact(r, out.lse.data()[r]);
    }
    return;
  }
  flash_forward(q, k, v, config, out.output, out.weights, out.lse, out.softmax_stats, workspace);
}

size_t sdpa_workspace_size(ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v,
                           const AttentionConfig& config, const ForwardViews<float>& out,
                           int num_threads) {
  (void)config;
  return forward_workspace_size<bfloat16>(q, k, v, out.weights.data() != nullptr, num_threads);
}

void sdpa(ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v,
          const AttentionConfig& config, const ForwardViews<float>& out, Workspace workspace) {
  flash_forward(q, k, v, config, out.output, out.weights, out.lse, out.softmax_stats, workspace);
}

template <class T>
size_t sdpa_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const AttentionConfig& config, const SavedViews<T>& saved,
                                    ConstView<T> d_output, const SdpaGradViews<T>& grads,
                                    int num_threads) {
  (void)saved;
  (void)d_output;
  return backward_workspace_size<T>(q, k, v, grads.d_bias, config.softcap > 0.0, num_threads);
}

template <class T>
void sdpa_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
                   const SavedViews<T>& saved, ConstView<T> d_output, const SdpaGradViews<T>& grads,
                   Workspace workspace) {
  flash_backward(q, k, v, config, saved, d_output, grads, workspace);
}

size_t sdpa_backward_workspace_size(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                    ConstView<bfloat16> v, const AttentionConfig& config,
                                    const SavedViews<float>& saved, ConstView<float> d_output,
                                    const SdpaGradViews<float>& grads, int num_threads) {
  (void)saved;
  (void)d_output;
  return backward_workspace_size<bfloat16>(q, k, v, grads.d_bias, config.softcap > 0.0,
                                           num_threads);
}

void sdpa_backward(ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v,
                   const AttentionConfig& config, const SavedViews<float>& saved,
                   ConstView<float> d_output, const SdpaGradViews<float>& grads,
                   Workspace workspace) {
  flash_backward(q, k, v, config, saved, d_output, grads, workspace);
}

template size_t sdpa_workspace_size<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                           const AttentionConfig&, const ForwardViews<float>&, int);
template void sdpa<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                          const AttentionConfig&, const ForwardViews<float>&, Workspace);
template size_t sdpa_backward_workspace_size<float>(ConstView<float>, ConstView<float>,
                                                    ConstView<float>, const AttentionConfig&,
                                                    const SavedViews<float>&, ConstView<float>,
                                                    const SdpaGradViews<float>&, int);
template void sdpa_backward<float>(ConstView<float>, ConstView<float>, ConstView<float>,
                                   const AttentionConfig&, const SavedViews<float>&,
                                   ConstView<float>, const SdpaGradViews<float>&, Workspace);
template size_t sdpa_workspace_size<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                            const AttentionConfig&, const ForwardViews<double>&,
                                            int);
template void sdpa<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                           const AttentionConfig&, const ForwardViews<double>&, Workspace);
template size_t sdpa_backward_workspace_size<double>(ConstView<double>, ConstView<double>,
                                                     ConstView<double>, const AttentionConfig&,
                                                     const SavedViews<double>&, ConstView<double>,
                                                     const SdpaGradViews<double>&, int);
template void sdpa_backward<double>(ConstView<double>, ConstView<double>, ConstView<double>,
                                    const AttentionConfig&, const SavedViews<double>&,
                                    ConstView<double>, const SdpaGradViews<double>&, Workspace);

}  // namespace qkv::kernels::fast
