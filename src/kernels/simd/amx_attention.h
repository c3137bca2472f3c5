// The key loop of bf16 scaled dot-product attention's forward fused on AMX
// tiles (issue 31, item 4): for each block of keys, S = Q Kᵀ on the tiles at
// scale 1, the online softmax in float with the scale folded in, P rounded to
// bf16 into a small tile operand, and P V on the tiles added into the
// output. One task's rows against key blocks packed once per call; the caller
// (kernels/attention/sdpa_fast.cc) owns the tasks, lengths, key chunks, the
// exact path for rows with non-finite scores and the final division by l.
// Written once against amx_tiles.h's Tiles policy: it runs on the
// instructions on a CPU with AMX, and on the tile emulator when a test forces
// the bf16 products onto it (force_bf16_path_for_testing("amx_emulated")).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/simd/gemm_bf16.h"
#include "qkv/bfloat16.h"

namespace qkv::kernels::fast {

// One block of keys packed once for every query block: Kᵀ (d x cols) and V
// (cols x dv) as pack_b_bf16's B operands.
struct PackedKeyBlock {
  PackedBf16 k, v;
};

// Whether bf16 attention's forward runs its key loop here: the bf16 products
// run on AMX tiles (bf16_amx_tiles(): the instructions on a CPU with AMX; the
// emulator only when a test forces it) and no test switched the fused loop
// off.
bool amx_attention_enabled();

// Doubles of scratch amx_attention_rows takes, for tasks of up to max_rows
// queries and key blocks of up to block_keys keys.
size_t amx_attention_scratch_words(int64_t max_rows, int64_t block_keys, int64_t d, int64_t dv);

// One task: `rows` queries of one head and their online-softmax state.
struct AmxAttentionRows {
  const bfloat16* q;  // rows x d, rows ldq apart
  int64_t ldq, rows, d, dv;
  const int64_t* len;  // per row: it sees keys [0, len[r])
  float scale;         // > 0 and finite
  float *m, *l;        // per row: running max of scale q.k and sum of e^(s - m) (in/out)
  uint8_t* special;    // per row: met a NaN or +inf score; its results are the caller's
  float* out;          // rows x dv, ldo apart: sum_j e^(s_j - m) v_j (in/out)
  int64_t ldo;
};

// Runs keys [key_begin, key_end) through the rows' online softmax, in blocks
// of block_keys: block b (blocks[b], made by pack_b_bf16 for the AMX tiles
// bf16_amx_tiles() names) holds keys [b block_keys, b block_keys + k.n), at
// least as many as the rows see below key_end. key_begin is a multiple of
// block_keys. `scratch`: amx_attention_scratch_words(>= rows, block_keys, d,
// dv) doubles.
void amx_attention_rows(const AmxAttentionRows& task, const PackedKeyBlock* blocks,
                        int64_t block_keys, int64_t key_begin, int64_t key_end, double* scratch);

// Test hooks: switch the fused loop off (the forward then runs its block
// products one by one through gemm_bf16) or back on; and how many tasks ran
// here since the process started (a test's proof that a case took, or
// declined, the fused path).
void set_amx_attention_for_testing(bool enabled);
int64_t amx_attention_tasks_for_testing();

}  // namespace qkv::kernels::fast
