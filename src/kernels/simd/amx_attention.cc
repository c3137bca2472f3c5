// bf16 attention's forward key loop fused on AMX tiles (amx_attention.h).
//
// The design (issue 31's, measured there on an Emerald Rapids Xeon: the
// per-product path reached 10 % (d = 64) and 16 % (d = 128) of the AMX peak;
// this one is not yet measured on an AMX machine):
// - K and V of each key block are packed once per call (sdpa_fast.cc's
//   prepared key blocks) and shared by every query block and head of a group;
//   inside a task a key block (256 keys: 32 KiB of K and of V at d = 64)
//   stays in L2 while the task's strips of 32 queries go past it.
// - The tile configuration is loaded once per task and released at its end
//   (a configure/release pair measured ~75 ns; the per-product path paid it
//   for every product).
// - S = Q Kᵀ runs at scale 1 and the scale is folded into the softmax's exp
//   (scale x - m, one multiply-subtract): the issue measured passing scale 1
//   to the product alone 3-25 % faster (no alpha pass over S).
// - P is rounded to bf16 by the softmax straight into a 32 x 256 bf16 tile
//   operand (16 KiB, L1), reused by every strip and key block. Tile loads of
//   lines just written by vector stores run at half rate (issue 31), and P
//   cannot avoid it (it goes from vector registers to tiles only through
//   memory); keeping the buffer small and always the same lines bounds what
//   that costs, and each line of P is loaded dv / 32 times.
// - O is not kept in tiles across key blocks: a strip's O needs rows / 16 x
//   dv / 16 accumulator tiles, 16 at 32 rows and dv = 128, and even 16 rows
//   at dv = 128 take all 8 of palette 1 with none left for P and V. So each
//   key block's P V starts from zeroed tiles, sums its 256 keys (8
//   TDPBF16PS per accumulator tile, 16 cycles each) and is stored once, and
//   the output takes it with the online softmax's rescale in one
//   multiply-add per element (out = out e^(m_old - m_new) + P V): dv floats
//   per row against 256 dv multiply-adds on the tiles. Reloading O into the
//   tiles instead would tile-load lines just written by vector stores (the
//   rescale), the slow case above; a lazy rescale (only when the max grows
//   past a threshold) saves only that multiply-add, which this layout does not
//   need to avoid.
// - The exp is kernels/simd/exp-inl.h's (a degree-5 polynomial, already
//   cheaper than hn::Exp); whether it bounds the kernel at d = 64 is for the
//   first AMX machine's profile to say.
//
// Tiles: 0-3 accumulate a 32 x 32 block (2 x 2 tiles of 16 x 16 floats), 4-5
// two 16-row A tiles (Q, or P), 6-7 two 16-column B tiles (Kᵀ, or V), as
// gemm_bf16.cc's blocks.
//
// Numerics: the products sum exact bf16 products in float32 (TDPBF16PS), the
// softmax is softmax_tile.h's, P is rounded to bf16 (2^-8 relative) as on
// every BF16 path, and a key block's P V is added to the output in one
// rounding: docs/semantics.md's bf16 bounds hold unchanged.
#include "kernels/simd/amx_attention.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstring>

#include "kernels/runtime/workspace.h"
#include "kernels/simd/amx_tiles.h"
#include "kernels/simd/vecmath.h"
#include "kernels/softmax/softmax_tile.h"

namespace qkv::kernels::fast {
namespace {

constexpr int64_t kTile = 16;
// Query rows per pass over a key block: two row tiles, so each loaded Kᵀ or
// V tile serves two TDPBF16PS.
constexpr int64_t kStrip = 32;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// Pairs of k per packed row, padded to whole 16-word tile rows (gemm_bf16.cc's
// packed_kp).
int64_t packed_kp(int64_t k) { return round_up(k, 2 * kTile) / 2; }

std::atomic<bool> enabled{true};
std::atomic<int64_t> tasks_run{0};

// A task's scratch, cut by one layout function for both the size query and
// the task.
struct Scratch {
  uint32_t* q_words;  // the queries as A tiles: round_up(rows, 16) x kp words
  float* s;           // kStrip x ld_s: one strip's scores
  bfloat16* p;        // kStrip x round_up(block_keys, 32): its P, rows ldp apart
  float* o;           // kStrip x ld_o: one key block's P V
  float* correction;  // kStrip
  int64_t* valid;     // kStrip
  int64_t ld_s, ld_o;
};

Scratch layout(Slicer& slicer, int64_t max_rows, int64_t block_keys, int64_t d, int64_t dv) {
  Scratch sc;
  sc.ld_s = round_up(block_keys, 2 * kTile);
  sc.ld_o = round_up(dv, 2 * kTile);
  sc.q_words = slicer.take<uint32_t>(round_up(max_rows, kTile) * packed_kp(d));
  sc.s = slicer.take<float>(kStrip * sc.ld_s);
  sc.p = slicer.take<bfloat16>(kStrip * sc.ld_s);
  sc.o = slicer.take<float>(kStrip * sc.ld_o);
  sc.correction = slicer.take<float>(kStrip);
  sc.valid = slicer.take<int64_t>(kStrip);
  return sc;
}

// The queries in the A-tile layout: row r holds q[r][0 .. d) and zeros up to
// 2 kp bf16 (64-byte tile rows), and rows up to a multiple of 16 are zero.
// Plain copies: the pairs (q[2p], q[2p + 1]) are adjacent bf16 already.
void pack_queries(const bfloat16* q, int64_t ldq, int64_t rows, int64_t d, int64_t kp,
                  uint32_t* words) {
  for (int64_t r = 0; r < round_up(rows, kTile); ++r) {
    auto* row = reinterpret_cast<uint16_t*>(words + r * kp);
    const int64_t n = r < rows ? d : 0;
    if (n > 0) std::memcpy(row, q + r * ldq, static_cast<size_t>(n) * sizeof(uint16_t));
    std::fill(row + n, row + 2 * kp, uint16_t{0});
  }
}

// C (16 RowTiles x 16 ColTiles floats, rows c_stride bytes apart) = A B over
// kp pairs of k: A's tile row r at a + r a_stride bytes (pair p 4p bytes in),
// B in panels of kp x 16 words, b_panel words apart.
template <class Tiles, int RowTiles, int ColTiles>
void block_product(const char* a, int64_t a_stride, const uint32_t* b, int64_t b_panel, int64_t kp,
                   float* c, int64_t c_stride) {
  Tiles::template zero<0>();
  if constexpr (ColTiles == 2) Tiles::template zero<1>();
  if constexpr (RowTiles == 2) Tiles::template zero<2>();
  if constexpr (RowTiles == 2 && ColTiles == 2) Tiles::template zero<3>();
  for (int64_t p = 0; p < kp; p += kTile) {
    Tiles::template load<4>(a + p * 4, a_stride);
    Tiles::template load<6>(b + p * kTile, 64);
    if constexpr (ColTiles == 2) Tiles::template load<7>(b + b_panel + p * kTile, 64);
    Tiles::template dpbf16ps<0, 4, 6>();
    if constexpr (ColTiles == 2) Tiles::template dpbf16ps<1, 4, 7>();
    if constexpr (RowTiles == 2) {
      Tiles::template load<5>(a + kTile * a_stride + p * 4, a_stride);
      Tiles::template dpbf16ps<2, 5, 6>();
      if constexpr (ColTiles == 2) Tiles::template dpbf16ps<3, 5, 7>();
    }
  }
  char* out = reinterpret_cast<char*>(c);
  Tiles::template store<0>(out, c_stride);
  if constexpr (ColTiles == 2) Tiles::template store<1>(out + 64, c_stride);
  if constexpr (RowTiles == 2) Tiles::template store<2>(out + kTile * c_stride, c_stride);
  if constexpr (RowTiles == 2 && ColTiles == 2)
    Tiles::template store<3>(out + kTile * c_stride + 64, c_stride);
}

// C (row_tiles x n_pad / 16 tiles, n_pad a multiple of 16) = A B, 32
// columns at a time.
template <class Tiles>
void product(int64_t row_tiles, int64_t n_pad, const char* a, int64_t a_stride, const uint32_t* b,
             int64_t kp, float* c, int64_t c_stride) {
  const int64_t b_panel = kp * kTile;
  for (int64_t c0 = 0; c0 < n_pad; c0 += 2 * kTile) {
    const uint32_t* b0 = b + (c0 / kTile) * b_panel;
    float* c_blk = c + c0;
    const bool two_cols = n_pad - c0 > kTile;
    if (row_tiles == 2 && two_cols) {
      block_product<Tiles, 2, 2>(a, a_stride, b0, b_panel, kp, c_blk, c_stride);
    } else if (row_tiles == 2) {
      block_product<Tiles, 2, 1>(a, a_stride, b0, b_panel, kp, c_blk, c_stride);
    } else if (two_cols) {
      block_product<Tiles, 1, 2>(a, a_stride, b0, b_panel, kp, c_blk, c_stride);
    } else {
      block_product<Tiles, 1, 1>(a, a_stride, b0, b_panel, kp, c_blk, c_stride);
    }
  }
}

template <class Tiles>
void rows_on_tiles(const AmxAttentionRows& t, const PackedKeyBlock* blocks, int64_t block_keys,
                   int64_t key_begin, int64_t key_end, const Scratch& sc) {
  const int64_t kp_q = packed_kp(t.d);
  pack_queries(t.q, t.ldq, t.rows, t.d, kp_q, sc.q_words);
  const int64_t dv_pad = round_up(t.dv, kTile);
  amx::compiler_barrier();  // the packed queries before the tile loads
  Tiles::configure(&amx::kAllTiles16x64);
  for (int64_t j0 = key_begin; j0 < key_end; j0 += block_keys) {
    const PackedKeyBlock& kb = blocks[j0 / block_keys];
    const int64_t cols = kb.k.n;
    assert(kb.k.kp == kp_q && kb.k.k == t.d && kb.v.k == cols && kb.v.n == t.dv);
    assert(cols <= block_keys);
    // P's rows: whole 32-key tile rows, as V's packed pairs (2 kp = cols
    // rounded up to 32).
    const int64_t ldp = 2 * kb.v.kp;
    for (int64_t r0 = 0; r0 < t.rows; r0 += kStrip) {
      const int64_t strip = std::min(kStrip, t.rows - r0);
      bool any = false;
      for (int64_t r = 0; r < strip; ++r) {
        sc.valid[r] = std::clamp<int64_t>(std::min(t.len[r0 + r], key_end) - j0, 0, cols);
        any = any || sc.valid[r] > 0;
      }
      if (!any) continue;  // keys past every row's length (causal): nothing to add
      const int64_t row_tiles = strip > kTile ? 2 : 1;
      // S = Q Kᵀ, scale 1.
      product<Tiles>(row_tiles, round_up(cols, kTile),
                     reinterpret_cast<const char*>(sc.q_words + r0 * kp_q), kp_q * 4, kb.k.words,
                     kp_q, sc.s, sc.ld_s * 4);
      amx::compiler_barrier();  // the tile stores of S before the softmax reads it
      softmax_tile_update_scaled(sc.s, sc.ld_s, strip, cols, sc.valid, t.scale, t.m + r0, t.l + r0,
                                 sc.correction, t.special + r0, sc.p, ldp, ldp);
      // Rows of the last row tile past the strip: zero, not last strip's P.
      for (int64_t r = strip; r < row_tiles * kTile; ++r) {
        std::fill_n(sc.p + r * ldp, ldp, bfloat16());
      }
      amx::compiler_barrier();  // P's stores before the tile loads
      // This key block's P V, then out = out correction + P V.
      product<Tiles>(row_tiles, dv_pad, reinterpret_cast<const char*>(sc.p), ldp * 2, kb.v.words,
                     kb.v.kp, sc.o, sc.ld_o * 4);
      amx::compiler_barrier();  // the tile stores of P V before the vector reads
      scale_add_rows(t.out + r0 * t.ldo, t.ldo, sc.correction, sc.o, sc.ld_o, strip, t.dv);
    }
  }
  // Frees the tile state so context switches stop saving 8 KiB for us.
  Tiles::release();
}

}  // namespace

bool amx_attention_enabled() {
  return enabled.load(std::memory_order_relaxed) && bf16_amx_tiles() != AmxTiles::kNone;
}

size_t amx_attention_scratch_words(int64_t max_rows, int64_t block_keys, int64_t d, int64_t dv) {
  return counted_words([&](Slicer& count) { layout(count, max_rows, block_keys, d, dv); });
}

void amx_attention_rows(const AmxAttentionRows& task, const PackedKeyBlock* blocks,
                        int64_t block_keys, int64_t key_begin, int64_t key_end, double* scratch) {
  assert(key_begin % block_keys == 0 && task.scale > 0.0f);
  if (task.rows <= 0 || key_begin >= key_end) return;
  tasks_run.fetch_add(1, std::memory_order_relaxed);
  Slicer slicer(scratch);
  const Scratch sc = layout(slicer, task.rows, block_keys, task.d, task.dv);
  switch (amx_tiles_of(blocks[key_begin / block_keys].k)) {
#if defined(__x86_64__)
    case AmxTiles::kNative:
      return rows_on_tiles<amx::NativeTiles>(task, blocks, block_keys, key_begin, key_end, sc);
#endif
    case AmxTiles::kEmulated:
      return rows_on_tiles<amx::EmulatedTiles>(task, blocks, block_keys, key_begin, key_end, sc);
    default:
      assert(false && "amx_attention_rows: key blocks not packed for AMX tiles");
  }
}

void set_amx_attention_for_testing(bool on) { enabled.store(on); }

int64_t amx_attention_tasks_for_testing() { return tasks_run.load(); }

}  // namespace qkv::kernels::fast
