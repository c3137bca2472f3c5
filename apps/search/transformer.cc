#include "search/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "qkv/attention.h"
#include "qkv/error.h"
#include "qkv/linear.h"
#include "qkv/threads.h"

namespace qkv::search {
namespace {

constexpr std::string_view kFn = "SentenceEncoder";
// Tokens per batch: the feed-forward's (tokens, 1536) floats are 25 MB at
// 4096, and 4096 rows keep the BLAS at its full rate.
constexpr int64_t kBatchTokens = 4096;

nlohmann::json read_json(const std::string& path) {
  // Checked before it is opened: opening a FIFO would block.
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    fail(kFn, path +
                  ": missing or not a regular file (a model directory holds config.json, "
                  "model.safetensors and 1_Pooling/config.json)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(kFn, path + ": cannot be read");
  std::ostringstream s;
  s << in.rdbuf();
  try {
    return nlohmann::json::parse(s.str());
  } catch (const nlohmann::json::exception& e) {
    fail(kFn, path + ": not JSON (" + e.what() + ")");
  }
}

int64_t positive(const nlohmann::json& json, const std::string& key, const std::string& path) {
  if (!json.contains(key) || !json[key].is_number_integer() || json[key].get<int64_t>() < 1 ||
      json[key].get<int64_t>() > (int64_t{1} << 24)) {
    fail(kFn, path + ": \"" + key + "\" is " + (json.contains(key) ? json[key].dump() : "missing") +
                  "; expected a whole number in [1, 2^24]");
  }
  return json[key].get<int64_t>();
}

void expect_text(const nlohmann::json& json, const std::string& key, const std::string& value,
                 const std::string& path, bool required = true) {
  if (!json.contains(key) && !required) return;
  if (!json.contains(key) || json[key] != value) {
    fail(kFn, path + ": \"" + key + "\" is " + (json.contains(key) ? json[key].dump() : "missing") +
                  "; qkv runs \"" + value + "\" only");
  }
}

// y = (x - mean) / sqrt(var + eps) * weight + bias over each row of
// `width`, the moments in double (torch's float32 layer norm agrees to a
// few ulp).
void layer_norm(float* x, int64_t rows, int64_t width, const float* weight, const float* bias,
                double eps) {
#pragma omp parallel for schedule(static, 16) num_threads(num_threads())
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * width;
    double mean = 0.0, var = 0.0;
    for (int64_t c = 0; c < width; ++c) mean += row[c];
    mean /= static_cast<double>(width);
    for (int64_t c = 0; c < width; ++c) var += (row[c] - mean) * (row[c] - mean);
    const double inv = 1.0 / std::sqrt(var / static_cast<double>(width) + eps);
    for (int64_t c = 0; c < width; ++c) {
      row[c] = static_cast<float>((row[c] - mean) * inv) * weight[c] + bias[c];
    }
  }
}

// e^y for y in [-88, 0]: y = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two
// parts, Cody and Waite), e^r by its Taylor series to r^7 (relative error
// below 2^-24 for |r| <= 0.35), times 2^n made in the exponent bits.
// Branch-free, so the loop around it vectorizes (glibc's expf does not
// without -ffast-math).
inline float exp_nonpositive(float y) {
  const float n = std::nearbyint(y * 1.44269504088896341f);
  const float r = (y - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// BERT's "gelu": x Φ(x) = x (1 + erf(x / sqrt 2)) / 2, the exact one, with
// erf by Abramowitz and Stegun's 7.1.26, erf(z) = 1 - t (a1 + t (a2 + ...))
// e^(-z^2), t = 1 / (1 + p z), for z >= 0 (odd symmetry below): absolute
// error below 1.5e-7, the size of float32's rounding of erf near 1, where
// GELU's 1 + erf is used. |z| is capped at 9, past which erf is 1 in float32
// (and e^(-z^2) stays a normal number). glibc's erff called per element was
// 14 % of the encoder's time.
void gelu(float* x, int64_t count) {
#pragma omp parallel for simd schedule(static) num_threads(num_threads())
  for (int64_t i = 0; i < count; ++i) {
    const float v = x[i];
    const float z = std::min(std::fabs(v) * 0.70710678118654752f, 9.0f);
    const float t = 1.0f / (1.0f + 0.3275911f * z);
    const float poly =
        t * (0.254829592f +
             t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float erf_abs = 1.0f - poly * exp_nonpositive(-z * z);
    x[i] = 0.5f * v * (1.0f + std::copysign(erf_abs, v));
  }
}

}  // namespace

SentenceEncoder SentenceEncoder::load(const std::string& dir) {
  SentenceEncoder e;
  e.dir_ = dir;
  const std::string config_path = dir + "/config.json";
  const nlohmann::json config = read_json(config_path);
  if (!config.is_object()) fail(kFn, config_path + ": not a JSON object");
  expect_text(config, "model_type", "bert", config_path);
  expect_text(config, "hidden_act", "gelu", config_path);
  expect_text(config, "position_embedding_type", "absolute", config_path, false);
  TransformerConfig& c = e.config_;
  c.vocab_size = positive(config, "vocab_size", config_path);
  c.hidden_size = positive(config, "hidden_size", config_path);
  c.num_layers = positive(config, "num_hidden_layers", config_path);
  c.num_heads = positive(config, "num_attention_heads", config_path);
  c.intermediate_size = positive(config, "intermediate_size", config_path);
  c.max_positions = positive(config, "max_position_embeddings", config_path);
  c.type_vocab_size = positive(config, "type_vocab_size", config_path);
  if (!config.contains("layer_norm_eps") || !config["layer_norm_eps"].is_number() ||
      !(config["layer_norm_eps"].get<double>() > 0.0 &&
        config["layer_norm_eps"].get<double>() < 1.0)) {
    fail(kFn,
         config_path + ": \"layer_norm_eps\" is " +
             (config.contains("layer_norm_eps") ? config["layer_norm_eps"].dump() : "missing") +
             "; expected a number in (0, 1)");
  }
  c.layer_norm_eps = config["layer_norm_eps"].get<double>();
  if (c.hidden_size % c.num_heads != 0) {
    fail(kFn, config_path + ": hidden_size " + std::to_string(c.hidden_size) +
                  " is not a multiple of num_attention_heads " + std::to_string(c.num_heads));
  }
  const std::string pooling_path = dir + "/1_Pooling/config.json";
  const nlohmann::json pooling = read_json(pooling_path);
  for (const char* mode : {"pooling_mode_cls_token", "pooling_mode_mean_tokens",
                           "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens"}) {
    const bool want = std::string_view(mode) == "pooling_mode_mean_tokens";
    if (!pooling.is_object() || !pooling.contains(mode) || pooling[mode] != want) {
      fail(kFn,
           pooling_path + ": \"" + mode + "\" is " +
               (pooling.is_object() && pooling.contains(mode) ? pooling[mode].dump() : "missing") +
               "; qkv runs mean pooling only (pooling_mode_mean_tokens true, the others false)");
    }
  }

  const std::string sbert_path = dir + "/sentence_bert_config.json";
  const nlohmann::json sbert = read_json(sbert_path);
  if (!sbert.is_object()) fail(kFn, sbert_path + ": not a JSON object");
  e.max_seq_length_ = positive(sbert, "max_seq_length", sbert_path);
  if (e.max_seq_length_ < 2 || e.max_seq_length_ > c.max_positions) {
    fail(kFn, sbert_path + ": \"max_seq_length\" is " + std::to_string(e.max_seq_length_) +
                  "; expected 2 to max_position_embeddings, " + std::to_string(c.max_positions));
  }
  e.tokenizer_ =
      std::make_shared<const WordPieceTokenizer>(WordPieceTokenizer::load(dir + "/vocab.txt"));
  if (e.tokenizer_->vocab_size() != c.vocab_size) {
    fail(kFn, dir + "/vocab.txt: has " + std::to_string(e.tokenizer_->vocab_size()) +
                  " tokens; config.json's vocab_size is " + std::to_string(c.vocab_size));
  }
  e.weights_ = SafeTensors::open(dir + "/model.safetensors");
  const SafeTensors& w = e.weights_;
  const int64_t h = c.hidden_size, f = c.intermediate_size;
  e.word_embeddings_ = w.floats("embeddings.word_embeddings.weight", Shape{c.vocab_size, h});
  e.position_embeddings_ =
      w.floats("embeddings.position_embeddings.weight", Shape{c.max_positions, h});
  e.type_embeddings_ =
      w.floats("embeddings.token_type_embeddings.weight", Shape{c.type_vocab_size, h});
  e.embed_norm_weight_ = w.floats("embeddings.LayerNorm.weight", Shape{h});
  e.embed_norm_bias_ = w.floats("embeddings.LayerNorm.bias", Shape{h});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "encoder.layer." + std::to_string(l) + ".";
    Layer layer;
    layer.qkv_weight = Tensor<float>(Shape{3 * h, h});
    layer.qkv_bias = Tensor<float>(Shape{3 * h});
    int64_t part = 0;
    for (const char* name : {"query", "key", "value"}) {
      const ConstView<float> weight =
          w.floats(p + "attention.self." + name + ".weight", Shape{h, h});
      const ConstView<float> bias = w.floats(p + "attention.self." + name + ".bias", Shape{h});
      std::copy(weight.data(), weight.data() + h * h, layer.qkv_weight.data() + part * h * h);
      std::copy(bias.data(), bias.data() + h, layer.qkv_bias.data() + part * h);
      ++part;
    }
    layer.out_weight = w.floats(p + "attention.output.dense.weight", Shape{h, h});
    layer.out_bias = w.floats(p + "attention.output.dense.bias", Shape{h});
    layer.norm1_weight = w.floats(p + "attention.output.LayerNorm.weight", Shape{h});
    layer.norm1_bias = w.floats(p + "attention.output.LayerNorm.bias", Shape{h});
    layer.up_weight = w.floats(p + "intermediate.dense.weight", Shape{f, h});
    layer.up_bias = w.floats(p + "intermediate.dense.bias", Shape{f});
    layer.down_weight = w.floats(p + "output.dense.weight", Shape{h, f});
    layer.down_bias = w.floats(p + "output.dense.bias", Shape{h});
    layer.norm2_weight = w.floats(p + "output.LayerNorm.weight", Shape{h});
    layer.norm2_bias = w.floats(p + "output.LayerNorm.bias", Shape{h});
    e.layers_.push_back(std::move(layer));
  }
  return e;
}

Tensor<float> SentenceEncoder::encode(const std::vector<std::vector<int32_t>>& ids,
                                      const std::function<void(int64_t)>& progress) const {
  const int64_t n = static_cast<int64_t>(ids.size()), h = config_.hidden_size;
  for (int64_t i = 0; i < n; ++i) {
    const auto& seq = ids[static_cast<size_t>(i)];
    if (seq.empty() || static_cast<int64_t>(seq.size()) > config_.max_positions) {
      fail("SentenceEncoder::encode", "sequence " + std::to_string(i) + " has " +
                                          std::to_string(seq.size()) + " tokens; expected 1 to " +
                                          std::to_string(config_.max_positions));
    }
    for (const int32_t id : seq) {
      if (id < 0 || id >= config_.vocab_size) {
        fail("SentenceEncoder::encode", "sequence " + std::to_string(i) + " has the token id " +
                                            std::to_string(id) + ", outside [0, " +
                                            std::to_string(config_.vocab_size) + ")");
      }
    }
  }
  // Longest first, ties by position: each batch is sequences of nearly one
  // length, padded to its first (longest).
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return ids[static_cast<size_t>(a)].size() > ids[static_cast<size_t>(b)].size();
  });
  Tensor<float> out(Shape{n, h});
  for (int64_t first = 0; first < n;) {
    const int64_t length = static_cast<int64_t>(ids[static_cast<size_t>(order[first])].size());
    const int64_t count = std::min(n - first, std::max<int64_t>(1, kBatchTokens / length));
    encode_batch(ids, order, first, count, length, out.view());
    first += count;
    if (progress) progress(first);
  }
  return out;
}

Tensor<float> SentenceEncoder::encode_texts(const std::vector<std::string>& texts,
                                            int64_t max_length,
                                            const std::function<void(int64_t)>& progress) const {
  if (max_length < 0 || max_length == 1 || max_length > config_.max_positions) {
    fail("SentenceEncoder::encode_texts",
         "max_length is " + std::to_string(max_length) + "; expected 2 to " +
             std::to_string(config_.max_positions) + ", or 0 for max_seq_length (" +
             std::to_string(max_seq_length_) + ")");
  }
  const int64_t cut = max_length == 0 ? max_seq_length_ : max_length;
  std::vector<std::vector<int32_t>> ids(texts.size());
#pragma omp parallel for schedule(dynamic, 256) num_threads(num_threads())
  for (size_t i = 0; i < texts.size(); ++i) ids[i] = tokenizer_->encode(texts[i], cut);
  return encode(ids, progress);
}

void SentenceEncoder::encode_batch(const std::vector<std::vector<int32_t>>& ids,
                                   const std::vector<int64_t>& order, int64_t first, int64_t count,
                                   int64_t length, TensorView<float> out) const {
  const int64_t h = config_.hidden_size, heads = config_.num_heads, d = h / heads;
  const int64_t rows = count * length;
  Tensor<int64_t> lens(Shape{count});
  for (int64_t b = 0; b < count; ++b) {
    lens.data()[b] = static_cast<int64_t>(ids[static_cast<size_t>(order[first + b])].size());
  }
  // The embeddings: word + position + token type 0, then layer norm.
  Tensor<float> x(Shape{count, length, h}, 0.0f);
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t b = 0; b < count; ++b) {
    const auto& seq = ids[static_cast<size_t>(order[first + b])];
    for (int64_t t = 0; t < static_cast<int64_t>(seq.size()); ++t) {
      float* row = x.data() + (b * length + t) * h;
      const float* word = word_embeddings_.data() + static_cast<int64_t>(seq[t]) * h;
      const float* position = position_embeddings_.data() + t * h;
      const float* type = type_embeddings_.data();
      for (int64_t c = 0; c < h; ++c) row[c] = word[c] + type[c] + position[c];
    }
  }
  layer_norm(x.data(), rows, h, embed_norm_weight_.data(), embed_norm_bias_.data(),
             config_.layer_norm_eps);
  Tensor<float> qkv(Shape{count, length, 3 * h}), joined(Shape{count, length, h}),
      projected(Shape{count, length, h}), up(Shape{count, length, config_.intermediate_size});
  // The heads of a (count, length, width) tensor's `part`-th h columns, as (count, heads, length,
  // d).
  const auto heads_of = [&](float* base, int64_t width, int64_t part) {
    return TensorView<float>(base + part * h, Shape{count, heads, length, d},
                             Shape{length * width, d, width, 1});
  };
  const ValidLens valid_lens(lens.view());
  for (const Layer& layer : layers_) {
    linear(x.view(), layer.qkv_weight.view(), layer.qkv_bias.view(), qkv.view());
    AttentionOutputs<float> outputs{heads_of(joined.data(), h, 0), std::nullopt, std::nullopt,
                                    std::nullopt};
    scaled_dot_product_attention(heads_of(qkv.data(), 3 * h, 0), heads_of(qkv.data(), 3 * h, 1),
                                 heads_of(qkv.data(), 3 * h, 2), valid_lens, AttentionOptions{},
                                 outputs);
    linear(joined.view(), layer.out_weight, layer.out_bias, projected.view());
    for (int64_t i = 0; i < rows * h; ++i) x.data()[i] += projected.data()[i];
    layer_norm(x.data(), rows, h, layer.norm1_weight.data(), layer.norm1_bias.data(),
               config_.layer_norm_eps);
    linear(x.view(), layer.up_weight, layer.up_bias, up.view());
    gelu(up.data(), up.numel());
    linear(up.view(), layer.down_weight, layer.down_bias, projected.view());
    for (int64_t i = 0; i < rows * h; ++i) x.data()[i] += projected.data()[i];
    layer_norm(x.data(), rows, h, layer.norm2_weight.data(), layer.norm2_bias.data(),
               config_.layer_norm_eps);
  }
  // Mean over each sequence's tokens, then length 1 (sentence-transformers'
  // Normalize: x / max(|x|, 1e-12)).
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t b = 0; b < count; ++b) {
    const int64_t len = lens.data()[b];
    std::vector<double> sum(static_cast<size_t>(h), 0.0);
    for (int64_t t = 0; t < len; ++t) {
      const float* row = x.data() + (b * length + t) * h;
      for (int64_t c = 0; c < h; ++c) sum[static_cast<size_t>(c)] += row[c];
    }
    double norm = 0.0;
    for (double& s : sum) {
      s = static_cast<double>(static_cast<float>(s / static_cast<double>(len)));
      norm += s * s;
    }
    const double scale = 1.0 / std::max(std::sqrt(norm), 1e-12);
    float* dst = out.data() + order[first + b] * h;
    for (int64_t c = 0; c < h; ++c)
      dst[c] = static_cast<float>(sum[static_cast<size_t>(c)] * scale);
  }
}

}  // namespace qkv::search
