// The online-softmax step of the fused attention forward, for a whole tile
// of scores at once (one dispatched call per tile, not per row). Highway,
// compiled for every x86 target and dispatched at run time.
#pragma once

#include <cstdint>

#include "qkv/bfloat16.h"

namespace qkv::kernels::fast {

// s: rows x cols scores (leading dimension cols); valid[r]: how many leading
// columns of row r are unmasked. For each row that is not yet `special`:
// if its valid scores are all finite, m_new = max(m[r], their max), the valid
// scores become exp(s - m_new) and the rest 0, l[r] = l[r] * c + sum with
// c = exp(m[r] - m_new), and correction[r] = c (1 when nothing was summed
// before); otherwise (NaN or ±inf among them) special[r] is set, the row
// zeroed and correction[r] = 1. Rows already special, or with no valid
// column, are zeroed with correction 1. The exp is kernels/simd/exp-inl.h's:
// a few ulp, with results below 2^-126 (double: e^-708) taken as 0.
// p_bf16 (float only, may be null): writes the tile's new values there
// instead of into s, rounded to bfloat16 (nearest even), rows x cols with
// leading dimension cols: the P operand of bf16 attention without a separate
// conversion pass (s is then only read).
void softmax_tile_update(float* s, int64_t rows, int64_t cols, const int64_t* valid, float* m,
                         float* l, float* correction, uint8_t* special,
                         bfloat16* p_bf16 = nullptr);
// The fused AMX forward's step (kernels/simd/amx_attention.cc): s holds
// the unscaled scores Q Kᵀ, rows lds apart (only read), and the update above
// runs on scale * s, scale > 0 and finite: the products run at scale 1 and
// the scale is folded into the softmax, the exp's argument being scale x - m
// (one fused multiply-subtract where the target has FMA); a row whose scaled
// max overflows to +inf is special. P goes to p_bf16, rows ldp apart, each
// zero from its valid columns up to p_cols (>= cols; the tile operand's
// padding).
void softmax_tile_update_scaled(const float* s, int64_t lds, int64_t rows, int64_t cols,
                                const int64_t* valid, float scale, float* m, float* l,
                                float* correction, uint8_t* special, bfloat16* p_bf16, int64_t ldp,
                                int64_t p_cols);
void softmax_tile_update(double* s, int64_t rows, int64_t cols, const int64_t* valid, double* m,
                         double* l, double* correction, uint8_t* special);

}  // namespace qkv::kernels::fast
