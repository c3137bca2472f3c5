// The learned engine's head: two linear maps on the pretrained sentence
// encoder's embeddings (transformer.h), one for queries, one for documents,
// trained through attention over every document: a query q = W_q e(query) attends over all N
// documents d_j = W_d e(document j) with scores s q·d_j, and the loss is the cross-entropy of that
// softmax at the query's own package,
//   L = lse(s q·D) - s q·d_target,
// the lse from the fused forward, its gradient from the fused backward with
// d_lse = 1: every document a negative, nothing sampled. The encoder itself
// stays as pretrained (running it through all its layers backward for
// 60,000 documents a step is far past the 15 minutes training may take);
// the maps start as the identity, so an untrained head is the pretrained
// encoder's own ranking (cosine similarity).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "qkv/tensor.h"

namespace qkv::search {

struct Head {
  Tensor<float> query_weight;  // (d, d): q = W_q e
  Tensor<float> doc_weight;    // (d, d): d = W_d e
  double score_scale = 1.0;
  // With HeadOptions::validation_score: each epoch's score (the untrained
  // head's first), and the epoch these maps are from (0: untrained).
  std::vector<double> validation_scores;
  int best_epoch = 0;
};

// The identity head: the encoder's own cosine ranking, scaled.
Head identity_head(int64_t dim, double score_scale);

struct HeadOptions {
  // Validation MRR@10 on 63,681 packages (documents cut at 64 tokens):
  // 0.581 untrained, 0.638 and 0.653 after epochs 1 and 2, at 73 s each on
  // 2 cores; at 128 tokens epochs 3 and 4 added 0.011 more.
  int epochs = 2;
  int64_t batch = 1024;  // queries per step
  double learning_rate = 1e-3;
  double score_scale = 20.0;
  uint64_t seed = 0;  // the order of the queries
  // Called after each step: steps done, steps in all, the step's mean loss.
  std::function<void(int64_t, int64_t, double)> progress;
  // If set, called before training and after each epoch with the head so
  // far: a score to maximize on queries not trained on (the validation
  // split's MRR@10); train_head returns the best (early stopping).
  std::function<double(const Head&)> validation_score;
};

// The head trained on queries (M, d), the embeddings of the training
// queries, whose targets (M) are rows of documents (N, d); the same bits
// for a seed and thread count.
Head train_head(const Tensor<float>& documents, const Tensor<float>& queries,
                const std::vector<int64_t>& targets, const HeadOptions& options);

// The mean loss over `queries` and, if `grads` is not null, its gradients
// for the two maps (into grads->query_weight, doc_weight): what train_head
// descends, exposed for the finite-difference test.
double head_loss(const Head& head, const Tensor<float>& documents, const Tensor<float>& queries,
                 const std::vector<int64_t>& targets, Head* grads);

// Rows (n, d) through a map: x Wᵀ.
Tensor<float> apply_map(const Tensor<float>& x, const Tensor<float>& weight);

// Each query's top k documents by its attention weights over every
// document (the fused kernel, 256 queries at a time), best first (ties:
// the smaller document).
std::vector<std::vector<int64_t>> rank_by_attention(const Tensor<float>& queries,
                                                    const Tensor<float>& documents, double scale,
                                                    int64_t k);

// Adam (Kingma and Ba, 2015) over one tensor, in place, with the bias
// correction; elementwise, so thread count does not change the bits.
class Adam {
 public:
  Adam(int64_t size, double learning_rate, double beta1 = 0.9, double beta2 = 0.999,
       double epsilon = 1e-8);
  void step(TensorView<float> params, ConstView<float> grads);

 private:
  Tensor<float> m_, v_;
  double lr_, beta1_, beta2_, epsilon_;
  int64_t t_ = 0;
};

}  // namespace qkv::search
