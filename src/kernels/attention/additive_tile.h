// The fused tiles of fast additive attention (additive_fast.cc): scores and
// their backward with the keys across the SIMD lanes, never forming the
// (B, Nq, Nk, H) feature tensor. Highway, compiled for every x86 target and
// dispatched at run time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/runtime/workspace.h"

namespace qkv::kernels::fast {

// out[j] = tanh(x[j]); out may alias x. float: a rational approximation
// within 3e-7 relative of the true tanh (tests/test_additive.cc sweeps it),
// about 2x cheaper than hn::Tanh; ±inf give ±1, ±0 keep their sign, NaN
// stays NaN.
// double: Highway's accurate hn::Tanh.
void tanh_row(const float* x, float* out, int64_t n);
void tanh_row(const double* x, double* out, int64_t n);

// ---- fused additive attention ----------------------------------------------
// Scores score(r, j) = sum_h wv[h] * tanh(fq[r, h] + fk[j, h]) computed with
// the keys across the SIMD lanes: fk is stored transposed, (H, keys), so each
// h step is one vector load of keys, a broadcast of fq[r, h] and of wv[h], and
// no horizontal sum. Sums over h run in a fixed order.

// Key columns of the transposed features are padded to a multiple of this,
// so whole vectors can always be loaded; tiles of keys start at multiples of
// it, so no vector of one tile reaches into the next.
inline constexpr int64_t kAdditivePad = 16;

// Queries per group inside a tile: 4 independent chains per h step hide the
// reciprocal's latency, and one load of the key features serves all four.
inline constexpr int64_t kAdditiveRows = 4;

// The float fast path carries exp(2 fk) for every key, computed once per call
// by additive_key_exps (it was once per 64-query tile, 8 times over at
// Nq = 512: 3.8 % of the forward's samples at (4, 512, 512), h = 64), and
// which blocks of kAdditivePad keys have every feature within the range where
// exp(2 fq) exp(2 fk) stays finite; a tile takes the tanh path for the other
// blocks. For one batch element's fkt (H, ldk), ldk a multiple of
// kAdditivePad: ekt (H, ldk) and block_ok (ldk / kAdditivePad). double always takes the tanh
// path and needs none of it.
void additive_key_exps(const float* fkt, int64_t hidden, int64_t ldk, float* ekt,
                       uint8_t* block_ok);

// The tiles allocate nothing: their scratch is `scratch`, that many doubles
// (workspace.h), cut into 64-byte slices inside. Float keeps exp(2 fq) of one
// query group; double (always the tanh path) needs none of it. The "+ 1" are
// the padding the tiles' own allocations had.
template <class T>
size_t additive_scores_scratch_words(int64_t hidden) {
  if constexpr (sizeof(T) != 4) return 0;
  return slice_words<T>(kAdditiveRows * hidden + 1);
}
// The backward tile's: the above plus r, d_fq's and d_wv's partial sums by
// lane, (2 kAdditiveRows + 1) H vectors of at most kAdditivePad lanes.
template <class T>
size_t additive_grad_tile_scratch_words(int64_t hidden) {
  return slice_words<T>((2 * kAdditiveRows + 1) * hidden * kAdditivePad + 1) +
         additive_scores_scratch_words<T>(hidden);
}

// One batch element's projected features, offset to a tile's first query and
// key (a multiple of kAdditivePad), and for float their exponentials
// (additive_key_exps, offset alike).
template <class T>
struct AdditiveFeatures {
  const T* fq;  // (rows, H), row stride ldq: W_q q
  int64_t ldq;
  const T* fkt;  // (H, keys), row stride ldk (a multiple of kAdditivePad): (W_k k)^T
  int64_t ldk;
  const T* wv;                        // (H)
  int64_t hidden;                     // H
  const T* ekt = nullptr;             // float: (H, keys), row stride ldk: exp(2 fkt)
  const uint8_t* block_ok = nullptr;  // float: per kAdditivePad keys
};

// s[r * lds + j] = score(r, j) for r < rows, j < lens[r]; nothing else is
// written. fkt (and ekt) are read up to lens rounded up to kAdditivePad.
// scratch holds additive_scores_scratch_words<T>(f.hidden) doubles.
void additive_scores(const AdditiveFeatures<float>& f, int64_t rows, const int64_t* lens, float* s,
                     int64_t lds, double* scratch);
void additive_scores(const AdditiveFeatures<double>& f, int64_t rows, const int64_t* lens,
                     double* s, int64_t lds, double* scratch);

// The backward of one (queries x keys) tile, scores recomputed and tanh
// evaluated once per (query, key, h). With P = exp(score - lse[r]) the
// weight, dP = dp * drop the gradient of the weight before dropout and
// dS = P (dP - d_row[r]) the gradient of the score, for j < lens[r]:
//   p_dropped[r, j] = P * drop (0 for lens[r] <= j < cols),
//   d_fq[r, h] += sum_j dS wv[h] (1 - t^2),   d_fkt[h, j] += sum_r dS wv[h] (1 - t^2),
//   d_wv[h] += sum_{r,j} dS t,   t = tanh(fq[r, h] + fkt[h, j]).
// Lanes j >= lens[r] contribute exactly nothing, whatever the keys hold there.
template <class T>
struct AdditiveGradTile {
  int64_t rows;         // queries in the tile
  int64_t cols;         // keys in the tile
  const int64_t* lens;  // per row: keys [0, lens[r]) of the tile are valid (0 for empty rows)
  const T* lse;         // per row: finite or NaN where lens[r] > 0
  const T* d_row;       // per row: D_r = sum_j P dP = dO_r . O_r
  const T* dp;          // (rows, ld): dLoss/d(dropped weight)
  const T* drop;        // (rows, ld): dropout scale, 0 or 1/(1-p); null without dropout
  int64_t ld;           // a multiple of kAdditivePad, >= cols
  T* p_dropped;         // (rows, ld), written for j < cols
  T* d_fq;              // (rows, H), row stride ld_dfq, accumulated
  int64_t ld_dfq;
  T* d_fkt;  // (H, keys), row stride f.ldk, accumulated
  T* d_wv;   // (H), accumulated
};
// scratch holds additive_grad_tile_scratch_words<T>(f.hidden) doubles.
void additive_grad_tile(const AdditiveFeatures<float>& f, const AdditiveGradTile<float>& tile,
                        double* scratch);
void additive_grad_tile(const AdditiveFeatures<double>& f, const AdditiveGradTile<double>& tile,
                        double* scratch);

}  // namespace qkv::kernels::fast
