// An index over a key-value store (qkv/store.h) that makes attention read a
// fraction of the rows, with a certificate of what it left out: an inverted
// file. The keys are clustered by k-means into L lists; the index holds the
// store's rows again, grouped by list (keys and values in list order, each
// row's id in the store), and for each list its centroid c, its radius r
// (the largest |k - c| of its keys) and its largest key norm. No key of a
// list scores more than a bound computed from those three numbers, so
// attention visits the lists in the order of their bounds and stops when
// the weight all unvisited rows could hold together is at most epsilon
// (docs/index.md has the rule and its proof).
//
// On disk a directory: manifest.json (the sizes, the store it was built
// over, each file's XXH3-64 and its own), centroids.npy (L, D) float32,
// list_rows.npy (L) int64, radii.npy and norms.npy (L) float64, ids.npy
// (N) int64, keys.npy (N, D) and values.npy (N, Dv) in the store's dtype,
// box_low.npy and box_high.npy (L, D) float32 (each list's bounding box),
// block_low.npy and block_high.npy (B, D) float32 (the bounding box of each
// block: a list's rows in runs of kIndexBlockRows).
// Built in a hidden directory beside its destination and renamed into place
// when complete, so a failed or killed build leaves nothing.
//   queries: (Nq, D)   output: (Nq, Dv)   lse, certificate: (Nq)
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/chunk_source.h"
#include "qkv/kernel_regression_types.h"
#include "qkv/scoring.h"
#include "qkv/store.h"
#include "qkv/tensor.h"

namespace qkv {

struct IndexBuildOptions {
  // The number of lists L, 1 <= L <= the store's rows; 0 picks
  // default_index_lists(rows).
  int64_t lists = 0;
  // k-means rounds on the training sample (each: assign every sample key to
  // its nearest centroid, move each centroid to its keys' mean); 0 to 1000.
  int iterations = 10;
  // Training keys per list: the sample is min(rows, lists * sample_per_list)
  // rows drawn at random (every store row equally likely); 1 to 2^20.
  int64_t sample_per_list = 64;
  // The seed of the sample (the same seed, store and options give the same index).
  uint64_t seed = 0;
  // Called with the bytes done and in all, over the build's passes.
  StoreProgress progress;
};

// 4 sqrt(N) lists (at least 1, at most N; 0 for an empty store): lists of
// about sqrt(N) / 4 rows, so that the bounds (L x D per query) cost less
// than a scan of a few lists.
int64_t default_index_lists(int64_t rows);

// A list's rows are cut into blocks of this many (its last block the rest),
// each with its bounding box: a range query (a compact kernel) reads only
// the blocks whose box meets its own. The box of 64 keys is narrower than
// a list's: a Gaussian's largest of 64 draws is about 2.4 sigma, of 790 (a
// list at 10^7 rows) 3.2; at 10^7 clustered rows and a box holding 0.89 %
// of the keys, whole lists read 6.3 % of the rows, blocks of 64 about 4 %.
// The boxes cost 2 D floats per 64 rows: 3 % of float32 keys.
inline constexpr int64_t kIndexBlockRows = 64;

// One list: rows [first_row, first_row + rows) of the index's row order,
// blocks [first_block, first_block + ceil(rows / kIndexBlockRows)).
struct IndexList {
  int64_t first_row = 0;
  int64_t rows = 0;
  int64_t first_block = 0;
  double radius = 0.0;    // the largest |k - c| of its keys (0 if empty), rounded up
  double max_norm = 0.0;  // the largest |k| of its keys (0 if empty), rounded up
};

class StoreIndex {
 public:
  // Builds the index of `store` at `dir` (which must not exist; its parent
  // must): a sample of the keys is clustered by k-means, every key is
  // assigned to its nearest centroid (ties: the smaller list), and the rows
  // are written in list order (rows of one list in store order). Error for
  // bad options or an existing `dir`, IoError when the system fails; a
  // failed or killed build leaves nothing at `dir`.
  static StoreIndex build(const KeyValueStore& store, const std::string& dir,
                          const IndexBuildOptions& options = {});
  // Opens an index: the manifest, and each file's header and size
  // (kStructure) or also its checksum (kChecksums). Error naming the file
  // and what is wrong.
  static StoreIndex open(const std::string& dir, StoreCheck check = StoreCheck::kStructure,
                         const StoreProgress& progress = {});
  // Reads every file and checks it against the manifest; Error naming the
  // first that disagrees. progress: the bytes read and in all.
  void verify(const StoreProgress& progress = {}) const;
  // Error unless the index was built over `store` as it is now: the same
  // dtype, D, Dv and chunks (a store with rows appended since says so: the
  // index is stale; update() or build it again).
  void check_built_over(const KeyValueStore& store) const;
  // Brings the index at `dir` up to date with `store`, the store it was
  // built over with rows appended since: each new row joins its nearest
  // list (the centroids stay as built; the lists' radii and norms widen to
  // hold it), and the files are written again with every row in list
  // order, in a new directory swapped in for the old one (a reader finds
  // the old index or the new one, whole; a failed or killed update leaves
  // the old one). Costs a copy of the index, not a build: no k-means. An
  // index current with `store` is returned as it is. Holds a lock on `dir`
  // meanwhile: a second update at once gets an IoError. Error if `store` is
  // not the one it was built over, or the index has no lists (built over an
  // empty store). progress: the bytes of rows assigned and written.
  static StoreIndex update(const std::string& dir, const KeyValueStore& store,
                           const StoreProgress& progress = {});

  const std::string& dir() const { return dir_; }
  StoreDtype dtype() const { return dtype_; }
  int64_t rows() const { return rows_; }
  int64_t key_dim() const { return key_dim_; }
  int64_t value_dim() const { return value_dim_; }
  const std::vector<IndexList>& lists() const { return lists_; }
  // (L, D): list j's centroid.
  ConstView<float> centroids() const { return centroids_.view(); }
  // (L, D): list j's bounding box, the least and the greatest value of each
  // coordinate over its keys (as stored; +inf and -inf for an empty list).
  ConstView<float> box_low() const { return box_low_.view(); }
  ConstView<float> box_high() const { return box_high_.view(); }
  // (B, D): block b's bounding box, likewise (every block has rows); list
  // j's blocks are lists()[j].first_block on, block i of a list its rows
  // i kIndexBlockRows to (i + 1) kIndexBlockRows.
  ConstView<float> block_low() const { return block_low_.view(); }
  ConstView<float> block_high() const { return block_high_.view(); }
  // Per list: |c_j| and log(its rows) (-inf for an empty list), in double,
  // formed once at open for the bounds every query computes.
  const std::vector<double>& centroid_norms() const { return centroid_norms_; }
  const std::vector<double>& log_list_rows() const { return log_list_rows_; }
  // The centroids by coordinate, (D, L) in double: entry k L + j is
  // coordinate k of centroid j (the bounds' products, vectorised over lists).
  const std::vector<double>& centroid_columns() const { return centroid_columns_; }
  // The store row of index row r (list order).
  int64_t store_row(int64_t r) const;
  // The keys and values of list j, as views of the index's dtype, valid
  // while the returned chunk lives; its range() is the list's rows in the
  // index's row order.
  SourceChunk read_list(size_t j) const;

 private:
  // Error (from `function`) unless `store` has this index's dtype, D, Dv
  // and, first, the chunks it was built over.
  void check_same_store(std::string_view function, const KeyValueStore& store) const;

  struct Files;
  std::shared_ptr<const Files> files_;
  std::string dir_;
  StoreDtype dtype_ = StoreDtype::kFloat32;
  int64_t rows_ = 0, key_dim_ = 0, value_dim_ = 0;
  std::vector<IndexList> lists_;
  Tensor<float> centroids_, box_low_, box_high_, block_low_, block_high_;
  std::vector<double> centroid_norms_, log_list_rows_, centroid_columns_;
  uint64_t store_fingerprint_ = 0;
  int64_t store_chunks_ = 0;
};

struct IndexAttentionOptions {
  // Scoring::kDotProduct (scale q . k) or Scoring::kDistance (-scale/2 |q - k|^2),
  // with scale as for attention over a store (qkv/store_attention.h).
  Scoring scoring = Scoring::kDotProduct;
  std::optional<double> scale;
  // Kernel::kGaussian: softmax of the scores above, certified by epsilon
  // (or probe). A compact kernel (kBoxcar, kEpanechnikov, kTriangular)
  // instead: row j weighs K((q - k_j) / bandwidth), Nadaraya-Watson's
  // product kernel (qkv/kernel_regression_types.h), 0 outside the box
  // |q_c - k_c| <= bandwidth; the weights are normalised to sum to 1. Only
  // the blocks whose box meets that box, in lists whose box and ball
  // (centroid, radius) meet it, are read, and the result is exact: the same as weighing every row
  // (certificate 0, top_k certain). A query with no row in reach gets output 0 and lse -inf.
  // scoring, scale, epsilon and probe do not apply.
  Kernel kernel = Kernel::kGaussian;
  // The compact kernel's width h > 0 (finite); required with one.
  std::optional<double> bandwidth;
  // Certified mode: visit lists, by bound, until the weight the unvisited
  // rows could hold is at most epsilon of the weight visited (per query).
  // 0 visits every list: exact attention (to float rounding). >= 0.
  double epsilon = 1e-3;
  // Fixed-budget mode instead (probe > 0): visit the `probe` lists whose
  // centroids score highest (FAISS's nprobe), whatever they leave out; the
  // certificate still bounds what was left out.
  int64_t probe = 0;
  // Also each query's top_k rows (store row ids, weights over the visited
  // rows, largest first, ties to the smaller id). In certified mode the
  // visit goes on until they are certain: the k-th score at least every
  // unvisited list's bound.
  int64_t top_k = 0;
  // Called on the calling thread with the queries done and in all, after
  // each block of kIndexProgressQueries queries.
  StoreProgress progress;
};

// Queries attended between progress reports: enough to share among the
// threads, few enough that a report comes every few hundred milliseconds
// when each query reads many lists.
inline constexpr int64_t kIndexProgressQueries = 64;

struct IndexAttentionResult {
  Tensor<float> output;  // (Nq, Dv): attention over the visited rows
  Tensor<float> lse;     // (Nq): log sum exp(score) over the visited rows
  // (Nq): a bound on (weight of the rows not visited) / (weight of the rows
  // visited). The output differs from attention over every row by at most
  // certificate * 2 max |v| (in norm), and the true lse is at most
  // lse + log(1 + certificate). 0 when every list was visited.
  Tensor<double> certificate;
  Tensor<int64_t> lists_visited;  // (Nq)
  Tensor<int64_t> rows_visited;   // (Nq)
  Tensor<int64_t> top_ids;        // (Nq, top_k): store row ids, -1 past the rows
  Tensor<float> top_weights;      // (Nq, top_k)
  // (Nq): whether no unvisited row can be among the query's top_k.
  std::vector<bool> top_certified;
};

// Attention of `queries` (Nq, D) over the index's rows through its lists:
// certified (options.epsilon) or with a fixed budget (options.probe). A
// bfloat16 index takes the queries rounded to bfloat16 for dot scoring, as
// attention over a store does. Error for bad shapes or options.
IndexAttentionResult attend(ConstView<float> queries, const StoreIndex& index,
                            const IndexAttentionOptions& options = {});

// The same over the rows of several stores, in the order given (shard
// stores, each with its own index): each part is attended through its own
// index as above (certified by options.epsilon, or options.probe lists, per
// part; a compact kernel exactly), and the parts' results are merged by
// merge_parts. Row ids count through the parts in order; every index has
// the same D and Dv, and top_k is at most their rows together. progress:
// the queries done over every part (part p's query i is p Nq + i).
// indexes: a std::vector<const StoreIndex*>, or {&a, &b, ...} (the overload
// below). Not a std::vector parameter: a vector can be built from two
// pointers as an iterator pair, which made attention over two stores,
// attend(queries, {&store_a, &store_b}), ambiguous.
IndexAttentionResult attend(ConstView<float> queries, std::span<const StoreIndex* const> indexes,
                            const IndexAttentionOptions& options = {});
inline IndexAttentionResult attend(ConstView<float> queries,
                                   std::initializer_list<const StoreIndex*> indexes,
                                   const IndexAttentionOptions& options = {}) {
  return attend(queries, std::span<const StoreIndex* const>(indexes.begin(), indexes.size()),
                options);
}

// Attention through the indexes of a key set's consecutive parts from each
// part's result, in order (shards, or MPI ranks: qkv::mpi merges its ranks'
// parts with it). Part p holds part_rows[p] rows, its top row ids count
// from the first of them, and its result holds at least min(top_k, its
// rows) top rows per query. Per query, with w_p = exp(lse_p - lse):
//   lse = log sum_p exp(lse_p), output = sum_p w_p output_p  (merge_attention,
//     in double: a part with lse -inf, no row visited or in reach, adds nothing);
//   certificate = sum_p certificate_p w_p (at most the largest of them): a
//     bound on the weight missed over the weight visited in every part
//     together (docs/index.md, "Across machines", has the proof);
//   lists_visited, rows_visited: summed over the parts;
//   the top_k rows by weight over the key set (each part's weights times
//     w_p), top_certified where every part's top rows are certain (and no
//     row that could belong was left out for a weight below float's range
//     in its part, 0 in its top_weights).
// The same parts give the same bits.
IndexAttentionResult merge_parts(const std::vector<IndexAttentionResult>& parts,
                                 const std::vector<int64_t>& part_rows, int64_t top_k);

// The gradient with respect to the queries (Nq, D) of attend()'s softmax
// output, given d_output (Nq, Dv) = dLoss/d(output): the gradient of what
// attend() computed, attention over the rows each query visited (the first
// forward.lists_visited[i] lists in the order of their bounds, as attend()
// took them), not of attention over every row. The lists visited stay the
// same under a small enough change of a query (they change only where two
// bounds, or the certificate and epsilon, cross), so this is the derivative
// of the output attend() returns wherever it has one. Same queries, index
// and options as the forward (top_k does not matter); a bfloat16 index's
// rounding of the queries (dot scores) counts as the identity. Error for a
// compact kernel, bad shapes, or lists_visited not of those queries' forward.
Tensor<float> attend_backward(ConstView<float> queries, const StoreIndex& index,
                              const IndexAttentionOptions& options,
                              const IndexAttentionResult& forward, ConstView<float> d_output);

}  // namespace qkv
