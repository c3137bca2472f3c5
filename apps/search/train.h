// Training the learned engine end to end through qkv's fused attention
// (docs/search.md). A query (a package's short description) attends over
// every document of the corpus: score = q · d, the query's and the
// document's encodings (encoder.h), and the loss is the cross-entropy of the
// softmax over all N documents at the query's own package,
//   L = lse(q · D) - q · d_target,
// the log-sum-exp from the fused forward (return_lse), its gradient from the
// fused backward (d_lse = 1 per query, d_output = 0): the exact softmax over
// every document with memory O(batch · d), no sampled negatives. Adam on
// both maps; batches of shuffled training queries; the same bits for a
// seed and thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkv/tensor.h"
#include "search/corpus.h"
#include "search/features.h"

namespace qkv::search {

struct TrainOptions {
  int64_t dim = 128;              // d: the encodings' size
  int epochs = 2;  // 3 gave validation MRR@10 0.413 against 0.407 for 2, in 322 s against ~215
  int64_t batch = 1024;           // queries per step
  double learning_rate = 2e-3;
  double score_scale = 16.0;      // score = score_scale · q · d
  bool tied = false;              // one map for queries and documents
  uint64_t seed = 0;              // the maps' initial values and the order of the queries
  FeatureHashing hashing;
  // Called after each step: steps done, steps in all, the step's mean loss.
  std::function<void(int64_t, int64_t, double)> progress;
  // If set, called after each epoch with the encoders so far: a score to
  // maximize on queries not trained on (the validation split's MRR@10).
  // train() then returns the encoders of the best epoch (early stopping:
  // the encoders can memorize their 50,000 training queries, and a later
  // epoch may generalize worse).
  std::function<double(const struct Encoders&)> validation_score;
};

struct Encoders {
  FeatureHashing hashing;
  double score_scale = 1.0;
  Tensor<float> query_map;  // (buckets, d)
  Tensor<float> doc_map;    // (buckets, d)
  // With TrainOptions::validation_score: each epoch's score, and the epoch
  // (from 1) these encoders are from.
  std::vector<double> validation_scores;
  int best_epoch = 0;
};

// Which queries a package's short description serves: the test split (one
// in ten: `qkv search eval`'s held-out queries), the validation split (one in
// twenty: never trained on, they choose the hybrid's mix), or training; by a
// hash of the name alone, so the split is the same for any seed and any
// corpus that has the package.
enum class Split { kTrain, kValidation, kTest };
Split split_of(const std::string& name);
inline bool held_out(const std::string& name) { return split_of(name) == Split::kTest; }

// The encoders trained on the queries of the packages at `train_ids`
// (short descriptions; each one's target is its own package), attending
// over every package's document.
Encoders train(const std::vector<Package>& packages, const std::vector<int64_t>& train_ids,
               const TrainOptions& options);

// The training loss (mean over `ids`' queries) and, if the pointers are not
// null, its gradients for the two maps: what train() descends, exposed for
// the finite-difference test.
double training_loss(const Encoders& encoders, const SparseRows& documents,
                     const SparseRows& documents_by_feature, const SparseRows& queries,
                     const std::vector<int64_t>& targets, Tensor<float>* d_query_map,
                     Tensor<float>* d_doc_map);

// Each query's top k documents by its attention weights over every
// document (the fused kernel, 256 queries at a time), best first.
std::vector<std::vector<int64_t>> rank_by_attention(const Tensor<float>& queries,
                                                    const Tensor<float>& documents, double scale,
                                                    int64_t k);

// Encodings (rows, d) of sparse rows through a map.
Tensor<float> encodings(const SparseRows& rows, const Tensor<float>& map);

}  // namespace qkv::search
