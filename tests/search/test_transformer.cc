// GoogleTest suite of the sentence encoder's own parts, without the venv:
// the safetensors reader on good and bad files, and SentenceEncoder on a
// small random BERT written here, against a float64 plain-loop BERT (the
// real model against sentence-transformers is test_encoder_peer.py).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "search/safetensors.h"
#include "search/search_testing.h"
#include "search/transformer.h"
#include "test_util.h"

namespace qkv::search {
namespace {

using test::expect_error;
using testing::TempDir;

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

std::string with_header(const std::string& json_text, size_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json_text.size() >> (8 * i)) & 0xff);
  return out + json_text + std::string(data_bytes, '\0');
}

TEST(SafeTensors, ReadsTensorsAsViewsOfTheFile) {
  TempDir dir;
  dir.write("m.safetensors",
            safetensors_bytes({{"a", {{2, 3}, {1, 2, 3, 4, 5, 6}}}, {"b", {{3}, {-1, 0.5f, 7}}}}));
  const SafeTensors t = SafeTensors::open(dir.file("m.safetensors"));
  EXPECT_EQ(t.entries().size(), 2u);
  const ConstView<float> a = t.floats("a", Shape{2, 3});
  EXPECT_EQ(a.data()[5], 6.0f);
  const ConstView<float> b = t.floats("b", Shape{3});
  EXPECT_EQ(b.data()[1], 0.5f);
  expect_error([&] { t.floats("c", Shape{3}); }, {"safetensors", "has no tensor \"c\""});
  expect_error(
      [&] {
        t.floats("a", Shape{3, 2});
      },
      {"tensor \"a\" is F32 [2, 3]; expected F32 [3, 2]"});
}

TEST(SafeTensors, BadFilesAreNamed) {
  TempDir dir;
  const auto refused = [&](const std::string& bytes, std::initializer_list<std::string_view> what) {
    dir.write("bad.safetensors", bytes);
    expect_error([&] { SafeTensors::open(dir.file("bad.safetensors")); }, what);
  };
  refused("abc", {"bad.safetensors", "is 3 bytes, shorter than the 8-byte header length"});
  refused(with_header("{}", 0).substr(0, 8) + "{",
          {"the header length is 2 bytes, past the file's 1"});
  std::string huge(16, '\0');
  huge[7] = 1;
  refused(huge, {"past the format's limit of 100 MB"});
  refused(with_header("{\"a\":", 0), {"the header is not JSON"});
  refused(with_header("[1]", 0), {"the header is not a JSON object"});
  refused(with_header(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}})", 4),
          {"tensor \"a\" has the unknown dtype \"Q7\""});
  refused(with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4),
          {"tensor \"a\" of shape [2] and dtype F32 has 4 bytes of data"});
  refused(with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 4),
          {"data_offsets [4,8] are not inside the 4 bytes of data"});
  refused(with_header(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
          {"shape [-1] is not sizes >= 0"});
  refused(with_header(
              R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})", 4),
          {"has 4 bytes of data"});
  refused(with_header(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1],"data_offsets":[0,4]}})", 4),
          {"has rank 5"});
  refused(with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      8),
          {"two tensors share the data bytes from 4"});
  refused(with_header(R"({"a":{"dtype":"F32","shape":[1]}})", 4),
          {"tensor \"a\" is not an object"});
  refused(with_header(R"({"__metadata__":{"x":1}})", 0), {"\"__metadata__\" member \"x\""});
  // A misaligned float tensor (data_offsets 1): named, not read.
  dir.write("odd.safetensors",
            with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}})", 5));
  const SafeTensors odd = SafeTensors::open(dir.file("odd.safetensors"));
  expect_error([&] { odd.floats("a", Shape{1}); }, {"not a multiple of 4"});
  expect_error([&] { SafeTensors::open(dir.file("missing.safetensors")); },
               {"missing.safetensors"});
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  expect_error([&] { SafeTensors::open(dir.file("fifo")); }, {"fifo"});
}

// ---- a small BERT, and the plain loop it is held to ----

struct TinyBert {
  int64_t vocab = 40, hidden = 8, heads = 2, layers = 2, inter = 12, positions = 24;
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> tensors;

  explicit TinyBert(uint64_t seed) {
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
    dir.write("sentence_bert_config.json", R"({"max_seq_length": 16, "do_lower_case": false})");
    // [PAD] [UNK] [CLS] [SEP] and vocab - 4 words "w4" ... (ids = lines).
    std::string vocab_text = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n";
    for (int64_t i = 4; i < vocab; ++i) vocab_text += "w" + std::to_string(i) + "\n";
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

TEST(SentenceEncoder, MatchesAPlainLoopBert) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_note(seed));
  const TinyBert bert(seed);
  TempDir dir;
  bert.write(dir, bert.config());
  const SentenceEncoder encoder = SentenceEncoder::load(dir.path());
  std::mt19937_64 rng(seed ^ 1);
  std::vector<std::vector<int32_t>> ids;
  for (int64_t len : {1, 2, 5, 24, 7, 7, 13, 3}) {
    std::vector<int32_t> seq;
    for (int64_t i = 0; i < len; ++i) seq.push_back(static_cast<int32_t>(rng() % bert.vocab));
    ids.push_back(seq);
  }
  const Tensor<float> got = encoder.encode(ids);
  ASSERT_EQ(got.shape(), (Shape{8, bert.hidden}));
  for (size_t s = 0; s < ids.size(); ++s) {
    const std::vector<double> want = bert.embed(ids[s]);
    for (int64_t c = 0; c < bert.hidden; ++c) {
      EXPECT_NEAR(got.data()[s * bert.hidden + c], want[c], 2e-6) << "sequence " << s << ", " << c;
    }
  }
  // Texts: tokenized by the model's vocabulary ("w7" is id 7; "zz" [UNK]),
  // cut to max_seq_length (16) or max_length, then the same embeddings.
  std::string long_text;
  for (int i = 0; i < 30; ++i) long_text += "w" + std::to_string(4 + i % 36) + " ";
  const std::vector<std::string> texts = {"w7 w8 zz", "W9!", long_text, ""};
  std::vector<std::vector<int32_t>> cut = {{2, 7, 8, 1, 3}, {2, 9, 1, 3}, {2}, {2, 3}};
  for (int i = 0; i < 14; ++i) cut[2].push_back(4 + i % 36);
  cut[2].push_back(3);
  std::vector<std::vector<int32_t>> cut5 = cut;
  cut5[2] = {2, 4, 5, 6, 3};
  EXPECT_EQ(encoder.tokenizer().encode(texts[2], encoder.max_seq_length()), cut[2]);
  test::expect_bitwise_equal(encoder.encode_texts(texts), encoder.encode(cut), "encode_texts");
  test::expect_bitwise_equal(encoder.encode_texts(texts, 5), encoder.encode(cut5),
                             "encode_texts, 5 tokens");
  expect_error([&] { encoder.encode_texts(texts, 1); }, {"max_length is 1; expected 2 to 24"});
  expect_error([&] { encoder.encode_texts(texts, 25); }, {"max_length is 25"});
  int64_t reported = 0;
  encoder.encode(ids, [&](int64_t done) { reported = done; });
  EXPECT_EQ(reported, 8);
  expect_error(
      [&] {
        encoder.encode({{1, 2}, {}});
      },
      {"sequence 1 has 0 tokens; expected 1 to 24"});
  expect_error([&] { encoder.encode({{1, 40}}); }, {"token id 40, outside [0, 40)"});
  expect_error([&] { encoder.encode({std::vector<int32_t>(25, 1)}); },
               {"sequence 0 has 25 tokens"});
}

TEST(SentenceEncoder, ModelsItDoesNotRunAreNamed) {
  const TinyBert bert(7);
  TempDir dir;
  expect_error([&] { SentenceEncoder::load(dir.path()); }, {"config.json: missing"});
  nlohmann::json config = bert.config();
  config["model_type"] = "roberta";
  bert.write(dir, config);
  expect_error([&] { SentenceEncoder::load(dir.path()); },
               {"config.json: \"model_type\" is \"roberta\"; qkv runs \"bert\" only"});
  config = bert.config();
  config["hidden_act"] = "relu";
  bert.write(dir, config);
  expect_error([&] { SentenceEncoder::load(dir.path()); }, {"\"hidden_act\" is \"relu\""});
  config = bert.config();
  config["num_attention_heads"] = 3;
  bert.write(dir, config);
  expect_error([&] { SentenceEncoder::load(dir.path()); },
               {"hidden_size 8 is not a multiple of num_attention_heads 3"});
  config = bert.config();
  config["intermediate_size"] = 13;
  bert.write(dir, config);
  expect_error(
      [&] { SentenceEncoder::load(dir.path()); },
      {"\"encoder.layer.0.intermediate.dense.weight\" is F32 [12, 8]; expected F32 [13, 8]"});
  config = bert.config();
  config["vocab_size"] = -3;
  bert.write(dir, config);
  expect_error([&] { SentenceEncoder::load(dir.path()); }, {"\"vocab_size\" is -3"});
  bert.write(dir, bert.config(), "pooling_mode_cls_token");
  expect_error([&] { SentenceEncoder::load(dir.path()); },
               {"1_Pooling/config.json", "qkv runs mean pooling only"});
  bert.write(dir, bert.config());
  dir.write("sentence_bert_config.json", R"({"max_seq_length": 25})");
  expect_error([&] { SentenceEncoder::load(dir.path()); },
               {"\"max_seq_length\" is 25; expected 2 to max_position_embeddings, 24"});
  bert.write(dir, bert.config());
  dir.write("vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\n");
  expect_error([&] { SentenceEncoder::load(dir.path()); },
               {"vocab.txt: has 4 tokens; config.json's vocab_size is 40"});
  // A FIFO in a JSON file's place is refused, not waited on.
  bert.write(dir, bert.config());
  std::filesystem::remove(dir.file("1_Pooling/config.json"));
  ASSERT_EQ(::mkfifo(dir.file("1_Pooling/config.json").c_str(), 0600), 0);
  expect_error([&] { SentenceEncoder::load(dir.path()); },
               {"1_Pooling/config.json: missing or not a regular file"});
  std::filesystem::remove(dir.file("1_Pooling/config.json"));
  dir.write("config.json", "{not json");
  expect_error([&] { SentenceEncoder::load(dir.path()); }, {"config.json: not JSON"});
}

}  // namespace
}  // namespace qkv::search
