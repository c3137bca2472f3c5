// A small random BERT for the search tests (test_transformer.cc,
// test_learned.cc): its files as all-MiniLM-L6-v2's directory has them
// (config.json, 1_Pooling/config.json, sentence_bert_config.json,
// vocab.txt, model.safetensors), and the embedding of a token sequence in
// float64 plain loops, which SentenceEncoder is held to.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "search/search_testing.h"

namespace qkv::search::testing {

// A safetensors file's bytes: the header (padded with spaces to 8 bytes,
// as Hugging Face's writer does) and the float32 tensors one after another.
std::string safetensors_bytes(
    const std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, tensor] : tensors) {
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(tensor.second.data()), tensor.second.size() * 4);
    header[name] = {
        {"dtype", "F32"}, {"shape", tensor.first}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text + data;
}

struct TinyBert {
  // The vocabulary after [PAD] [UNK] [CLS] [SEP]: "w4" ... "w39" unless given.
  std::vector<std::string> words;
  int64_t vocab = 40, hidden = 8, heads = 2, layers = 2, inter = 12, positions = 24;
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> tensors;

  explicit TinyBert(uint64_t seed, std::vector<std::string> vocabulary = {},
                    int64_t max_positions = 24)
      : words(std::move(vocabulary)), positions(max_positions) {
    if (words.empty()) {
      for (int64_t i = 4; i < 40; ++i) words.push_back("w" + std::to_string(i));
    }
    vocab = 4 + static_cast<int64_t>(words.size());
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    const auto add = [&](const std::string& name, std::vector<int64_t> shape, float offset = 0.0f) {
      int64_t n = 1;
      for (int64_t s : shape) n *= s;
      std::vector<float> values(static_cast<size_t>(n));
      for (float& v : values) v = offset + u(rng);
      tensors[name] = {shape, values};
    };
    add("embeddings.word_embeddings.weight", {vocab, hidden});
    add("embeddings.position_embeddings.weight", {positions, hidden});
    add("embeddings.token_type_embeddings.weight", {2, hidden});
    add("embeddings.LayerNorm.weight", {hidden}, 1.0f);
    add("embeddings.LayerNorm.bias", {hidden});
    for (int64_t l = 0; l < layers; ++l) {
      const std::string p = "encoder.layer." + std::to_string(l) + ".";
      for (const char* m : {"query", "key", "value"}) {
        add(p + "attention.self." + m + ".weight", {hidden, hidden});
        add(p + "attention.self." + m + ".bias", {hidden});
      }
      add(p + "attention.output.dense.weight", {hidden, hidden});
      add(p + "attention.output.dense.bias", {hidden});
      add(p + "attention.output.LayerNorm.weight", {hidden}, 1.0f);
      add(p + "attention.output.LayerNorm.bias", {hidden});
      add(p + "intermediate.dense.weight", {inter, hidden});
      add(p + "intermediate.dense.bias", {inter});
      add(p + "output.dense.weight", {hidden, inter});
      add(p + "output.dense.bias", {hidden});
      add(p + "output.LayerNorm.weight", {hidden}, 1.0f);
      add(p + "output.LayerNorm.bias", {hidden});
    }
  }

  nlohmann::json config() const {
    return {{"model_type", "bert"},
            {"hidden_act", "gelu"},
            {"vocab_size", vocab},
            {"hidden_size", hidden},
            {"num_hidden_layers", layers},
            {"num_attention_heads", heads},
            {"intermediate_size", inter},
            {"max_position_embeddings", positions},
            {"type_vocab_size", 2},
            {"layer_norm_eps", 1e-12},
            {"position_embedding_type", "absolute"}};
  }

  void write(const TempDir& dir, const nlohmann::json& config,
             const std::string& pooling_mode = "pooling_mode_mean_tokens") const {
    std::filesystem::create_directories(dir.file("1_Pooling"));
    dir.write("config.json", config.dump());
    nlohmann::json pooling = {{"pooling_mode_cls_token", false},
                              {"pooling_mode_mean_tokens", false},
                              {"pooling_mode_max_tokens", false},
                              {"pooling_mode_mean_sqrt_len_tokens", false}};
    pooling[pooling_mode] = true;
    dir.write("1_Pooling/config.json", pooling.dump());
    dir.write("model.safetensors", safetensors_bytes(tensors));
    dir.write(
        "sentence_bert_config.json",
        nlohmann::json{{"max_seq_length", positions - positions / 3}, {"do_lower_case", false}}
            .dump());
    // [PAD] [UNK] [CLS] [SEP] and the words (ids = lines).
    std::string vocab_text = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n";
    for (const std::string& w : words) vocab_text += w + "\n";
    dir.write("vocab.txt", vocab_text);
  }

  const std::vector<float>& t(const std::string& name) const { return tensors.at(name).second; }

  // y (n, out) = x (n, in) Wᵀ + b, in double.
  std::vector<double> affine(const std::vector<double>& x, int64_t n, int64_t in, int64_t out,
                             const std::string& name) const {
    const std::vector<float>& w = t(name + ".weight");
    const std::vector<float>& b = t(name + ".bias");
    std::vector<double> y(static_cast<size_t>(n * out));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t o = 0; o < out; ++o) {
        double s = b[o];
        for (int64_t k = 0; k < in; ++k) s += x[i * in + k] * w[o * in + k];
        y[i * out + o] = s;
      }
    }
    return y;
  }

  void norm(std::vector<double>& x, int64_t n, const std::string& name) const {
    const std::vector<float>& g = t(name + ".weight");
    const std::vector<float>& b = t(name + ".bias");
    for (int64_t i = 0; i < n; ++i) {
      double mean = 0, var = 0;
      for (int64_t c = 0; c < hidden; ++c) mean += x[i * hidden + c] / hidden;
      for (int64_t c = 0; c < hidden; ++c) var += std::pow(x[i * hidden + c] - mean, 2) / hidden;
      for (int64_t c = 0; c < hidden; ++c) {
        x[i * hidden + c] = (x[i * hidden + c] - mean) / std::sqrt(var + 1e-12) * g[c] + b[c];
      }
    }
  }

  // The embedding of one sequence, every step in double.
  std::vector<double> embed(const std::vector<int32_t>& ids) const {
    const int64_t n = static_cast<int64_t>(ids.size()), d = hidden / heads;
    std::vector<double> x(static_cast<size_t>(n * hidden));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < hidden; ++c) {
        x[i * hidden + c] = double(t("embeddings.word_embeddings.weight")[ids[i] * hidden + c]) +
                            t("embeddings.position_embeddings.weight")[i * hidden + c] +
                            t("embeddings.token_type_embeddings.weight")[c];
      }
    }
    norm(x, n, "embeddings.LayerNorm");
    for (int64_t l = 0; l < layers; ++l) {
      const std::string p = "encoder.layer." + std::to_string(l) + ".";
      const auto q = affine(x, n, hidden, hidden, p + "attention.self.query");
      const auto k = affine(x, n, hidden, hidden, p + "attention.self.key");
      const auto v = affine(x, n, hidden, hidden, p + "attention.self.value");
      std::vector<double> joined(static_cast<size_t>(n * hidden), 0.0);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < n; ++i) {
          std::vector<double> s(static_cast<size_t>(n));
          double m = -INFINITY, z = 0;
          for (int64_t j = 0; j < n; ++j) {
            double dot = 0;
            for (int64_t c = 0; c < d; ++c)
              dot += q[i * hidden + h * d + c] * k[j * hidden + h * d + c];
            s[j] = dot / std::sqrt(double(d));
            m = std::max(m, s[j]);
          }
          for (int64_t j = 0; j < n; ++j) z += std::exp(s[j] - m);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t c = 0; c < d; ++c) {
              joined[i * hidden + h * d + c] += std::exp(s[j] - m) / z * v[j * hidden + h * d + c];
            }
          }
        }
      }
      const auto o = affine(joined, n, hidden, hidden, p + "attention.output.dense");
      for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
      norm(x, n, p + "attention.output.LayerNorm");
      auto up = affine(x, n, hidden, inter, p + "intermediate.dense");
      for (double& u : up) u = 0.5 * u * (1 + std::erf(u / std::sqrt(2.0)));
      const auto down = affine(up, n, inter, hidden, p + "output.dense");
      for (size_t i = 0; i < x.size(); ++i) x[i] += down[i];
      norm(x, n, p + "output.LayerNorm");
    }
    std::vector<double> pooled(static_cast<size_t>(hidden), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < hidden; ++c) pooled[c] += x[i * hidden + c] / n;
    }
    double len = 0;
    for (double p : pooled) len += p * p;
    for (double& p : pooled) p /= std::sqrt(len);
    return pooled;
  }
};

}  // namespace qkv::search::testing
