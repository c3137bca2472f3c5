// What the key-value store's tests share (test_store.cc, attention over a
// store; test_store_files.cc, the store's files): a fixture with a fresh
// directory, the rows read back through the chunk source interface, and a
// float64 plain attention over every row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "qkv/store.h"
#include "test_util.h"

namespace qkv::test {

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/qkv-store-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    root_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  std::string path(const std::string& name) const {
    return (std::filesystem::path(root_) / name).string();
  }
  std::vector<std::string> listing(const std::string& dir) const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  std::string root_;
};

// A chunk's keys or values as float (rows, dim).
template <class T>
void copy_rows(ConstView<T> from, int64_t first_row, Tensor<float>& to) {
  ASSERT_EQ(from.size(1), to.size(1));
  for (int64_t i = 0; i < from.size(0); ++i) {
    for (int64_t j = 0; j < from.size(1); ++j)
      to(first_row + i, j) = static_cast<float>(from(i, j));
  }
}

// The store's rows read back through the chunk source interface, as float;
// each chunk's range as the manifest has it, the views of the store's dtype
// only.
struct ReadBack {
  Tensor<float> keys, values;
};
inline ReadBack read_back(const ChunkSource& store) {
  ReadBack all{Tensor<float>(Shape{store.rows(), store.key_dim()}),
               Tensor<float>(Shape{store.rows(), store.value_dim()})};
  int64_t next_row = 0;
  for (size_t c = 0; c < store.num_chunks(); ++c) {
    const SourceChunk chunk = store.read_chunk(c);
    EXPECT_EQ(chunk.range().first_row, next_row);
    EXPECT_EQ(chunk.range().first_row, store.chunk_range(c).first_row);
    EXPECT_EQ(chunk.range().rows, store.chunk_range(c).rows);
    EXPECT_EQ(chunk.dtype(), store.dtype());
    next_row += chunk.range().rows;
    if (store.dtype() == StoreDtype::kFloat32) {
      copy_rows(chunk.keys<float>(), chunk.range().first_row, all.keys);
      copy_rows(chunk.values<float>(), chunk.range().first_row, all.values);
      expect_error([&] { chunk.keys<bfloat16>(); },
                   {"SourceChunk::keys", "float32", "not bfloat16"});
    } else {
      copy_rows(chunk.keys<bfloat16>(), chunk.range().first_row, all.keys);
      copy_rows(chunk.values<bfloat16>(), chunk.range().first_row, all.values);
      expect_error([&] { chunk.values<float>(); },
                   {"SourceChunk::values", "bfloat16", "not float32"});
    }
  }
  EXPECT_EQ(next_row, store.rows());
  return all;
}

inline Tensor<float> rounded_to_bf16(const Tensor<float>& x) {
  Tensor<float> out(x.shape());
  for (int64_t i = 0; i < x.numel(); ++i) out.data()[i] = static_cast<float>(bfloat16(x.data()[i]));
  return out;
}

inline Tensor<float> rows_of(const Tensor<float>& x, int64_t first, int64_t n) {
  Tensor<float> out(Shape{n, x.size(1)});
  std::copy_n(x.data() + first * x.size(1), n * x.size(1), out.data());
  return out;
}

// softmax(scale Q Kᵀ) V over rows [0, len_i) in double, and the weights:
// attention_testing.h's float64 loop on the rows as one batch element.
struct PlainAttention {
  Tensor<double> output, lse, weights;
};
inline PlainAttention plain_attention(const Tensor<float>& q, const Tensor<float>& k,
                                      const Tensor<float>& v, const std::vector<int64_t>& lens,
                                      double scale) {
  const int64_t nq = q.size(0), n = k.size(0), dv = v.size(1);
  const Tensor<int64_t> lens2(Shape{1, nq}, lens);
  const NaiveForward r = naive_sdpa<float>(q.view().unsqueeze0(), k.view().unsqueeze0(),
                                           v.view().unsqueeze0(), ValidLens(lens2), scale, {});
  return {as_tensor(Shape{nq, dv}, r.out), as_tensor(Shape{nq}, r.lse),
          as_tensor(Shape{nq, n}, r.weights)};
}

}  // namespace qkv::test
