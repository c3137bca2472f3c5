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
#include "search/tiny_bert.h"
#include "search/transformer.h"
#include "test_util.h"

namespace qkv::search {
namespace {

using test::expect_error;
using testing::safetensors_bytes;
using testing::TempDir;
using testing::TinyBert;

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
