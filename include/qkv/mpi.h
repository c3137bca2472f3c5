// Attention over a key-value store sharded across MPI ranks (target
// qkv::mpi, built when CMake finds MPI; Debian's libopenmpi-dev): each rank
// attends over its own part of the rows, and the parts' outputs and
// log-sum-exps are merged exactly at rank 0 in rank order (qkv/merge.h), so
// the result is attention over every row, to float rounding, and the same
// bits for any run with the same number of ranks. docs/scale.md has the
// layout and the cost model.
//
// The rows, in order, are rank 0's part, then rank 1's, ...: a part is a
// range of one store's chunks (StorePart; any chunk source,
// qkv/chunk_source.h). Two layouts:
// - one store that every rank can read (a shared file system): each rank
//   takes a contiguous share of its chunks (share_of_chunks);
// - a shard store per rank (each machine holds its own): every chunk of it.
// Row ids (valid_rows, top ids) count through the parts in rank order.
// Attention through an index (qkv/index.h) takes the second layout: each
// rank holds an index over its own shard store.
//
// Every function here is collective: every rank of `comm` calls it with the
// same queries, valid_rows and options. A rank that fails (a damaged chunk,
// bad arguments) makes every rank throw, an Error "<function>: rank r of R:
// <what>" when the failure was bad input; a rank that dies takes the job
// down with it (mpirun ends every rank).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "qkv/attention.h"
#include "qkv/chunk_source.h"
#include "qkv/error.h"
#include "qkv/index.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

namespace qkv::mpi {

// A rank's part of the key set: chunks [first_chunk, last_chunk) of `source`.
struct StorePart {
  const ChunkSource* source = nullptr;
  size_t first_chunk = 0, last_chunk = 0;
};

// Every chunk of a shard store.
StorePart whole(const ChunkSource& store);
// Rank `rank`'s share of a store that every rank reads: chunks
// [C rank / R, C (rank + 1) / R) of its C chunks, in rank order (a rank gets
// none when R > C).
StorePart share_of_chunks(const ChunkSource& store, int rank, int ranks);

// Where the time of a call went, on this rank (seconds).
struct Timings {
  double local = 0;          // attention (or backward) over this rank's part
  double communication = 0;  // the gathers and broadcasts
  double merge = 0;          // merging the parts at rank 0
};

// Attention of queries (Nq, D) over the union of the ranks' parts; every rank
// gets the output (Nq, Dv), lse (Nq) and, with top_k, each query's top rows
// over all parts (row ids as above). valid_rows: as attend()'s, in those row
// ids. Each rank runs attend() over its part; on the wire, each rank sends
// that result, Nq (Dv + 1) float32 and with top_k Nq top_k (id, weight)
// pairs, to rank 0, which merges them in rank order by merge_parts (as
// attend() over a list of the same parts does, to the bit) and sends the
// merged result back to every rank.
StoreAttentionResult attend(ConstView<float> queries, const StorePart& part, MPI_Comm comm,
                            const ValidLens& valid_rows = {},
                            const StoreAttentionOptions& options = {}, Timings* timings = nullptr);

// Attention of queries (Nq, D) through an index per rank, each over the
// rank's own shard store (the rows: rank 0's shard, then rank 1's, ...; top
// ids count through them in rank order): every rank gets the merged result.
// Each rank attends through its own index as qkv::attend does (certified by
// options.epsilon, or options.probe lists, on each rank; a compact kernel
// exactly), with top_k = min(top_k, its rows); on the wire, each rank sends
// that result, Nq (Dv + 1 + top_k) float32 (output, lse, top weights), Nq
// float64 (certificates) and Nq (3 + top_k) int64 (lists and rows visited,
// top certain, top ids), to rank 0, which merges them in rank order by
// merge_parts (qkv/index.h: exact, and as attend() through a list of the
// same indexes does, to the bit) and sends the merged result back. The
// merged certificate bounds the weight missed over the weight visited on
// every rank together; lists and rows visited are summed over the ranks.
// options.progress: this rank's queries done. top_k: at most every rank's
// rows together.
IndexAttentionResult attend(ConstView<float> queries, const StoreIndex& index, MPI_Comm comm,
                            const IndexAttentionOptions& options = {}, Timings* timings = nullptr);

// The gradients of attend() given its output and lse (saved, as every rank
// got them) and d_output: d_queries (Nq, D) summed over the ranks in rank
// order (every rank gets it), and d_keys, d_values of this rank's own rows
// (its part's rows, in order), so a model can train against a sharded
// memory without moving it.
StoreAttentionGrads attend_backward(ConstView<float> queries, const StorePart& part, MPI_Comm comm,
                                    const ValidLens& valid_rows,
                                    const StoreAttentionOptions& options,
                                    const SavedForward<float>& saved, ConstView<float> d_output,
                                    Timings* timings = nullptr);

// Rank 0's tensor on every rank (shape, then elements); the other ranks'
// `tensor` is replaced. Collective. For inputs only rank 0 reads (the qkv
// command's queries and valid rows).
void broadcast(Tensor<float>& tensor, MPI_Comm comm);
void broadcast(Tensor<int64_t>& tensor, MPI_Comm comm);

// Runs `work` on every rank and then agrees on how it went: if it threw on
// any rank, every rank throws the lowest failing rank's error, as an Error
// "<function>: rank r of R: <what>" (an IoError when it was one). Collective.
// How the collective functions above keep ranks from waiting on a rank that
// failed, for callers' own steps (the qkv command's reads and writes).
template <class F>
void all_or_none(const char* function, MPI_Comm comm, F&& work);

namespace detail {
// The agreement of all_or_none: `what` is empty where the rank succeeded;
// `io` marks an IoError.
void agree(const char* function, MPI_Comm comm, const std::string& what, bool io);
}  // namespace detail

template <class F>
void all_or_none(const char* function, MPI_Comm comm, F&& work) {
  std::string what;
  bool io = false;
  try {
    work();
  } catch (const IoError& e) {
    what = e.what();
    io = true;
  } catch (const std::exception& e) {
    what = e.what();
    if (what.empty()) what = "failed";
  }
  detail::agree(function, comm, what, io);
}

}  // namespace qkv::mpi
