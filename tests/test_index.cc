// The index over a store (qkv/index.h): attention through it against a
// float64 loop over every row. Epsilon 0 is exact attention; for epsilon > 0
// the certificate bounds what was left out (checked directly: the weight
// missed over the weight visited, from the exact lse), and the output is
// within 2 certificate max|v| of exact; certified top-k rows are the exact
// ones. On clustered, isotropic and adversarial keys (one list, equal keys,
// empty lists, queries far from every key, sharp and negative scales), both
// dtypes and both scorings; then the index's files, damage and staleness,
// updates with appended rows, and the backward of certified attention.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "index_testing.h"
#include "qkv/index.h"
#include "qkv/kernel_regression.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#include "store_testing.h"
#include "test_util.h"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

class IndexTest : public StoreTest {
 protected:
  struct Data {
    Tensor<float> keys, values;  // as stored (rounded to bf16 for a bf16 store)
    KeyValueStore store;
  };
  Data make_store(const std::string& name, const Tensor<float>& keys, const Tensor<float>& values,
                  StoreDtype dtype, int64_t chunk_rows) {
    KeyValueStore store =
        KeyValueStore::create(path(name), keys.view(), values.view(), dtype, chunk_rows);
    const ReadBack rows = read_back(store);
    return {rows.keys, rows.values, std::move(store)};
  }
};

TEST_F(IndexTest, CertifiedAttentionHoldsItsCertificate) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int case_number = 0;
  for (const StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    for (const int64_t clusters : {int64_t{12}, int64_t{0}}) {
      const int64_t n = rng.uniform_int(1500, 3000), d = rng.uniform_int(3, 16),
                    dv = rng.uniform_int(1, 6);
      const Tensor<float> keys = clustered_keys(rng, n, d, clusters);
      const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
      const std::string name = "s" + std::to_string(case_number++);
      const Data data = make_store(name, keys, values, dtype, rng.uniform_int(300, 1000));
      IndexBuildOptions build;
      build.seed = rng.next();
      build.lists = rng.bernoulli(0.5) ? 0 : rng.uniform_int(1, 80);
      const StoreIndex index = StoreIndex::build(data.store, path(name + ".index"), build);
      index.check_built_over(data.store);
      // Queries near the keys, and far from every one.
      Tensor<float> q = clustered_keys(rng, 24, d, clusters == 0 ? 0 : 6);
      for (int64_t c = 0; c < d; ++c) q(23, c) *= 50.0f;
      for (const bool distance : {false, true}) {
        for (const double scale : {1.0, 8.0, -3.0}) {
          if (distance && scale < 0) continue;
          for (const double epsilon : {0.0, 1e-3, 0.1}) {
            IndexAttentionOptions options;
            options.scoring = distance ? Scoring::kDistance : Scoring::kDotProduct;
            options.scale = scale;
            options.epsilon = epsilon;
            options.top_k = 3;
            const Tensor<float> q_scored =
                !distance && dtype == StoreDtype::kBFloat16 ? rounded_to_bf16(q) : q;
            const IndexAttentionResult got = attend(q.view(), index, options);
            check_against_exact(
                got, exact_attention(q_scored, data.keys, data.values, distance, scale),
                data.values, options,
                std::string(store_dtype_name(dtype)) + " clusters " + std::to_string(clusters) +
                    (distance ? " distance" : " dot") + " scale " + std::to_string(scale) +
                    " epsilon " + std::to_string(epsilon));
          }
        }
      }
    }
  }
}

TEST_F(IndexTest, EpsilonZeroIsExactAndVisitsEveryList) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t n = 2000, d = 6, dv = 3;
  const Data data = make_store("s", clustered_keys(rng, n, d, 10),
                               random_tensor<float>(rng, Shape{n, dv}), StoreDtype::kFloat32, 700);
  IndexBuildOptions build;
  build.lists = 30;
  const StoreIndex index = StoreIndex::build(data.store, path("i"), build);
  int64_t nonempty = 0;
  for (const IndexList& list : index.lists()) nonempty += list.rows > 0;
  const Tensor<float> q = random_tensor<float>(rng, Shape{5, d}, -2, 2);
  IndexAttentionOptions options;
  options.epsilon = 0;
  const IndexAttentionResult got = attend(q.view(), index, options);
  const Exact exact = exact_attention(q, data.keys, data.values, false, 1 / std::sqrt(6.0));
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(got.lists_visited(i), nonempty);
    EXPECT_EQ(got.rows_visited(i), n);
    EXPECT_EQ(got.certificate(i), 0.0);
    EXPECT_NEAR(got.lse(i), exact.lse(i), 1e-5 * (1 + std::abs(exact.lse(i))));
    for (int64_t c = 0; c < dv; ++c) EXPECT_NEAR(got.output(i, c), exact.output(i, c), 2e-6);
  }
  // And the same as attention over the store (the streaming path).
  StoreAttentionOptions streaming;
  const StoreAttentionResult stream = attend(q.view(), data.store, {}, streaming);
  for (int64_t i = 0; i < 5; ++i) {
    for (int64_t c = 0; c < dv; ++c) EXPECT_NEAR(got.output(i, c), stream.output(i, c), 2e-6);
  }
}

TEST_F(IndexTest, AdversarialKeysAndQueries) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t d = 4, dv = 2;
  struct Case {
    std::string name;
    Tensor<float> keys;
    int64_t lists;
  };
  std::vector<Case> cases;
  cases.push_back({"one list", clustered_keys(rng, 500, d, 5), 1});
  // Every key the same: radius 0, and all but one list empty.
  Tensor<float> equal(Shape{400, d});
  for (int64_t i = 0; i < 400; ++i) {
    for (int64_t c = 0; c < d; ++c) equal(i, c) = 0.25f * static_cast<float>(c + 1);
  }
  cases.push_back({"equal keys", equal, 20});
  // Three distinct keys and 40 lists: most lists empty.
  Tensor<float> three(Shape{300, d});
  for (int64_t i = 0; i < 300; ++i) {
    for (int64_t c = 0; c < d; ++c) three(i, c) = static_cast<float>((i % 3) * 2 - 2 + c);
  }
  cases.push_back({"three keys", three, 40});
  // One row per list.
  cases.push_back({"a list per row", clustered_keys(rng, 64, d, 0), 64});
  int number = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t n = c.keys.size(0);
    const Data data =
        make_store("s" + std::to_string(number), c.keys, random_tensor<float>(rng, Shape{n, dv}),
                   StoreDtype::kFloat32, 128);
    IndexBuildOptions build;
    build.lists = c.lists;
    build.seed = rng.next();
    const StoreIndex index =
        StoreIndex::build(data.store, path("i" + std::to_string(number++)), build);
    EXPECT_EQ(static_cast<int64_t>(index.lists().size()), c.lists);
    Tensor<float> q = random_tensor<float>(rng, Shape{6, d}, -1, 1);
    for (int64_t k = 0; k < d; ++k) {
      q(4, k) = 1000.0f * (k % 2 ? 1.0f : -1.0f);  // far from every key
      q(5, k) = 0.0f;                              // the zero query: every score 0 (dot)
    }
    for (const bool distance : {false, true}) {
      for (const double epsilon : {0.0, 1e-3}) {
        IndexAttentionOptions options;
        options.scoring = distance ? Scoring::kDistance : Scoring::kDotProduct;
        options.scale = distance ? 0.5 : 1.0;
        options.epsilon = epsilon;
        options.top_k = 2;
        check_against_exact(
            attend(q.view(), index, options),
            exact_attention(q, data.keys, data.values, distance, *options.scale), data.values,
            options,
            std::string(distance ? "distance" : "dot") + " epsilon " + std::to_string(epsilon));
      }
    }
  }
}

TEST_F(IndexTest, CompactKernelsAreExactAndReadOnlyTheBlocksInReach) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int number = 0;
  for (const StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    const int64_t n = rng.uniform_int(2000, 4000), d = rng.uniform_int(2, 6), dv = 3;
    const Data data = make_store("s" + std::to_string(number), clustered_keys(rng, n, d, 16),
                                 random_tensor<float>(rng, Shape{n, dv}), dtype, 900);
    const StoreIndex index = StoreIndex::build(data.store, path("i" + std::to_string(number++)));
    Tensor<float> q = clustered_keys(rng, 16, d, 8);
    for (int64_t c = 0; c < d; ++c) q(15, c) = 100.0f;  // no key in reach
    for (const Kernel kernel : {Kernel::kBoxcar, Kernel::kEpanechnikov, Kernel::kTriangular}) {
      for (const double h : {0.05, 0.2, 1.0}) {
        SCOPED_TRACE(std::string(kernel_name(kernel)) + " h " + std::to_string(h));
        IndexAttentionOptions options;
        options.kernel = kernel;
        options.bandwidth = h;
        options.top_k = 2;
        const IndexAttentionResult got = attend(q.view(), index, options);
        const KernelExact exact = kernel_exact(q, data.keys, data.values, kernel, h);
        int64_t read = 0;
        for (int64_t i = 0; i < q.size(0); ++i) {
          EXPECT_EQ(got.certificate(i), 0.0);
          EXPECT_TRUE(got.top_certified[static_cast<size_t>(i)]);
          read += got.rows_visited(i);
          if (exact.in_reach[static_cast<size_t>(i)] == 0) {
            EXPECT_EQ(got.lse(i), -INFINITY) << "query " << i;
            for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(got.output(i, c), 0.0f);
            EXPECT_EQ(got.top_ids(i, 0), -1);
            continue;
          }
          EXPECT_NEAR(got.lse(i), exact.lse(i), 1e-5 * (1 + std::abs(exact.lse(i))));
          for (int64_t c = 0; c < dv; ++c) {
            EXPECT_NEAR(got.output(i, c), exact.output(i, c),
                        1e-6 * (1 + std::abs(exact.output(i, c))))
                << "query " << i;
          }
          EXPECT_EQ(got.top_ids(i, 1) >= 0, exact.in_reach[static_cast<size_t>(i)] >= 2);
        }
        // Each query reads every block that holds a row in its box, and
        // only blocks whose box meets its box.
        for (int64_t i = 0; i < q.size(0); ++i) {
          int64_t needed = 0, allowed = 0;
          for (const IndexList& list : index.lists()) {
            for (int64_t begin = 0, b = list.first_block; begin < list.rows;
                 begin += kIndexBlockRows, ++b) {
              const int64_t end = std::min(list.rows, begin + kIndexBlockRows);
              bool meets = true, holds = false;
              for (int64_t c = 0; c < d; ++c) {
                meets = meets && double{q(i, c)} - index.block_high()(b, c) <= h &&
                        index.block_low()(b, c) - double{q(i, c)} <= h;
              }
              for (int64_t r = begin; r < end && !holds; ++r) {
                const int64_t id = index.store_row(list.first_row + r);
                bool inside = true;
                for (int64_t c = 0; c < d; ++c) {
                  inside = inside && std::abs(double{q(i, c)} - data.keys(id, c)) <= h;
                }
                holds = inside;
              }
              needed += holds ? end - begin : 0;
              allowed += meets ? end - begin : 0;
            }
          }
          EXPECT_GE(got.rows_visited(i), needed) << "query " << i;
          EXPECT_LE(got.rows_visited(i), allowed) << "query " << i;
        }
        // The far query reads nothing; with the smallest width, the others a
        // few of the 16 blobs' lists.
        EXPECT_EQ(got.rows_visited(15), 0);
        if (h == 0.05) EXPECT_LT(read, 15 * n / 2) << "rows read over 15 queries";
      }
    }
  }
}

TEST_F(IndexTest, ProbeVisitsThatManyListsAndStillBoundsWhatItMissed) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t n = 1500, d = 5, dv = 2;
  const Data data = make_store("s", clustered_keys(rng, n, d, 8),
                               random_tensor<float>(rng, Shape{n, dv}), StoreDtype::kFloat32, 500);
  IndexBuildOptions build;
  build.lists = 16;
  const StoreIndex index = StoreIndex::build(data.store, path("i"), build);
  const Tensor<float> q = clustered_keys(rng, 8, d, 8);
  for (const int64_t probe : {int64_t{1}, int64_t{3}, int64_t{100}}) {
    IndexAttentionOptions options;
    options.probe = probe;
    const IndexAttentionResult got = attend(q.view(), index, options);
    int64_t nonempty = 0;
    for (const IndexList& list : index.lists()) nonempty += list.rows > 0;
    for (int64_t i = 0; i < q.size(0); ++i) {
      EXPECT_EQ(got.lists_visited(i), std::min(probe, nonempty));
    }
    check_against_exact(got, exact_attention(q, data.keys, data.values, false, 1 / std::sqrt(5.0)),
                        data.values, options, "probe " + std::to_string(probe));
  }
  // A probe visits the lists of highest centroid score first (as FAISS's
  // nprobe), not of highest bound: probe 1 reads the nearest centroid's list.
  for (const bool distance : {false, true}) {
    IndexAttentionOptions options;
    options.probe = 1;
    options.scoring = distance ? Scoring::kDistance : Scoring::kDotProduct;
    const IndexAttentionResult got = attend(q.view(), index, options);
    for (int64_t i = 0; i < q.size(0); ++i) {
      double best = -INFINITY;
      int64_t rows = 0;
      for (size_t j = 0; j < index.lists().size(); ++j) {
        if (index.lists()[j].rows == 0) continue;
        double s = 0.0;
        for (int64_t c = 0; c < d; ++c) {
          const double x = index.centroids()(static_cast<int64_t>(j), c);
          s += distance ? -0.5 * (q(i, c) - x) * (q(i, c) - x) : q(i, c) * x;
        }
        if (s > best) {
          best = s;
          rows = index.lists()[j].rows;
        }
      }
      EXPECT_EQ(got.rows_visited(i), rows) << (distance ? "distance" : "dot") << ", query " << i;
    }
  }
}

TEST_F(IndexTest, TheBuildIsRepeatableAndItsListsCoverTheStore) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t n = 1200, d = 3;
  const Data data = make_store("s", clustered_keys(rng, n, d, 6),
                               random_tensor<float>(rng, Shape{n, 2}), StoreDtype::kBFloat16, 250);
  IndexBuildOptions build;
  build.seed = rng.next();
  const StoreIndex a = StoreIndex::build(data.store, path("a"), build);
  const StoreIndex b = StoreIndex::build(data.store, path("b"), build);
  EXPECT_EQ(static_cast<int64_t>(a.lists().size()), default_index_lists(n));
  ASSERT_EQ(a.centroids().numel(), b.centroids().numel());
  for (int64_t i = 0; i < a.centroids().numel(); ++i) {
    ASSERT_EQ(a.centroids().data()[i], b.centroids().data()[i]);
  }
  // Every store row once; each list's rows in store order, within its radius.
  std::vector<int> seen(static_cast<size_t>(n));
  for (size_t j = 0; j < a.lists().size(); ++j) {
    const IndexList& list = a.lists()[j];
    const SourceChunk chunk = a.read_list(j);
    ASSERT_EQ(chunk.range().rows, list.rows);
    int64_t previous = -1;
    for (int64_t r = 0; r < list.rows; ++r) {
      const int64_t id = a.store_row(list.first_row + r);
      ASSERT_GT(id, previous);
      previous = id;
      ++seen[static_cast<size_t>(id)];
      double distance = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        const float k = static_cast<float>(chunk.keys<bfloat16>()(r, c));
        ASSERT_EQ(k, data.keys(id, c));
        const double diff = double{k} - a.centroids()(static_cast<int64_t>(j), c);
        distance += diff * diff;
      }
      ASSERT_LE(std::sqrt(distance), list.radius);
    }
  }
  for (int64_t r = 0; r < n; ++r) ASSERT_EQ(seen[static_cast<size_t>(r)], 1) << "row " << r;
  // Each list's box is its keys' least and greatest value per coordinate.
  for (size_t j = 0; j < a.lists().size(); ++j) {
    const IndexList& list = a.lists()[j];
    for (int64_t c = 0; c < d; ++c) {
      float low = INFINITY, high = -INFINITY;
      for (int64_t r = 0; r < list.rows; ++r) {
        const float k = data.keys(a.store_row(list.first_row + r), c);
        low = std::min(low, k);
        high = std::max(high, k);
      }
      ASSERT_EQ(a.box_low()(static_cast<int64_t>(j), c), low) << "list " << j;
      ASSERT_EQ(a.box_high()(static_cast<int64_t>(j), c), high) << "list " << j;
    }
  }
  // Each block's box is its keys': a list's rows in runs of kIndexBlockRows,
  // the blocks numbered through the lists in order.
  int64_t blocks = 0;
  for (size_t j = 0; j < a.lists().size(); ++j) {
    const IndexList& list = a.lists()[j];
    ASSERT_EQ(list.first_block, blocks) << "list " << j;
    for (int64_t begin = 0; begin < list.rows; begin += kIndexBlockRows, ++blocks) {
      for (int64_t c = 0; c < d; ++c) {
        float low = INFINITY, high = -INFINITY;
        for (int64_t r = begin; r < std::min(list.rows, begin + kIndexBlockRows); ++r) {
          const float k = data.keys(a.store_row(list.first_row + r), c);
          low = std::min(low, k);
          high = std::max(high, k);
        }
        ASSERT_EQ(a.block_low()(blocks, c), low) << "list " << j << " row " << begin;
        ASSERT_EQ(a.block_high()(blocks, c), high) << "list " << j << " row " << begin;
      }
    }
  }
  ASSERT_EQ(a.block_low().size(0), blocks);
  ASSERT_EQ(a.block_high().size(0), blocks);
}

// k-means++ seeding gives every cluster a list of its own: C well-separated
// clusters (centres about 26 apart, keys within about 0.6 of theirs) and
// 1.5 C lists, so no list may hold keys of two clusters. Seeded by sample
// rows drawn uniformly, about e^-1.5 = 22 % of the clusters got no
// centroid and shared a list with a neighbour (a radius of the clusters'
// distance, a certified query's bound near the top everywhere).
TEST_F(IndexTest, EveryClusterGetsAListOfItsOwn) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t clusters = 40, per_cluster = 60, d = 16, n = clusters * per_cluster;
  const Tensor<float> centres = random_tensor<float>(rng, Shape{clusters, d}, -8.0, 8.0);
  std::normal_distribution<double> noise(0.0, 0.1);
  Tensor<float> keys(Shape{n, d});
  std::vector<int64_t> cluster_of(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = rng.uniform_int(0, clusters - 1);
    cluster_of[static_cast<size_t>(i)] = c;
    for (int64_t j = 0; j < d; ++j)
      keys(i, j) = static_cast<float>(centres(c, j) + noise(rng.engine()));
  }
  const Data data =
      make_store("s", keys, random_tensor<float>(rng, Shape{n, 2}), StoreDtype::kFloat32, 500);
  IndexBuildOptions build;
  build.lists = clusters * 3 / 2;
  build.seed = rng.next();
  const StoreIndex index = StoreIndex::build(data.store, path("i"), build);
  int64_t mixed = 0;
  for (const IndexList& list : index.lists()) {
    if (list.rows == 0) continue;
    const int64_t first = cluster_of[static_cast<size_t>(index.store_row(list.first_row))];
    for (int64_t r = 1; r < list.rows; ++r) {
      if (cluster_of[static_cast<size_t>(index.store_row(list.first_row + r))] != first) {
        ++mixed;
        break;
      }
    }
  }
  EXPECT_EQ(mixed, 0) << "lists holding keys of more than one cluster";
}

// Shard stores, each with its own index, attended through the list of
// indexes: each part through its index, merged (what qkv::mpi does across
// ranks; tests/mpi/test_mpi_index.cc holds the two to the same bits).
TEST_F(IndexTest, ShardsThroughTheirIndexesMergeToAttentionOverEveryRow) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  int number = 0;
  for (const StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    // Three shards, the middle one empty half the time.
    const std::vector<int64_t> rows{rng.uniform_int(1, 900),
                                    rng.bernoulli(0.5) ? 0 : rng.uniform_int(1, 900),
                                    rng.uniform_int(1, 900)};
    const int64_t n = rows[0] + rows[1] + rows[2], d = rng.uniform_int(3, 12),
                  dv = rng.uniform_int(1, 5);
    const Tensor<float> keys = clustered_keys(rng, n, d, 12);
    const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
    const Data all = make_store("all" + std::to_string(number), keys, values, dtype, 500);
    std::vector<StoreIndex> indexes;
    int64_t first = 0;
    for (size_t p = 0; p < rows.size(); ++p) {
      const std::string name = "shard" + std::to_string(number) + "-" + std::to_string(p);
      Tensor<float> shard_keys(Shape{rows[p], d}), shard_values(Shape{rows[p], dv});
      std::copy_n(&keys.data()[first * d], rows[p] * d, shard_keys.data());
      std::copy_n(&values.data()[first * dv], rows[p] * dv, shard_values.data());
      const Data shard = make_store(name, shard_keys, shard_values, dtype, 300);
      IndexBuildOptions build;
      build.seed = rng.next();
      indexes.push_back(StoreIndex::build(shard.store, path(name + ".index"), build));
      first += rows[p];
    }
    ++number;
    std::vector<const StoreIndex*> pointers;
    for (const StoreIndex& index : indexes) pointers.push_back(&index);
    Tensor<float> q = clustered_keys(rng, 16, d, 6);
    for (int64_t c = 0; c < d; ++c) q(15, c) *= 50.0f;
    for (const bool distance : {false, true}) {
      for (const double epsilon : {0.0, 1e-3, 0.1}) {
        for (const int64_t probe : {int64_t{0}, int64_t{2}}) {
          if (probe > 0 && epsilon > 0) continue;
          IndexAttentionOptions options;
          options.scoring = distance ? Scoring::kDistance : Scoring::kDotProduct;
          options.scale = distance ? 1.0 : 4.0;
          options.epsilon = epsilon;
          options.probe = probe;
          options.top_k = 3;
          const std::string what = std::string(store_dtype_name(dtype)) +
                                   (distance ? " distance" : " dot") + " epsilon " +
                                   std::to_string(epsilon) + " probe " + std::to_string(probe);
          const IndexAttentionResult got = attend(q.view(), pointers, options);
          const Tensor<float> q_scored =
              !distance && dtype == StoreDtype::kBFloat16 ? rounded_to_bf16(q) : q;
          check_against_exact(
              got, exact_attention(q_scored, all.keys, all.values, distance, *options.scale),
              all.values, options, what);
          // Lists and rows visited: the parts' own, summed.
          Tensor<int64_t> lists(Shape{q.size(0)}), rows_read(Shape{q.size(0)});
          for (const StoreIndex& index : indexes) {
            IndexAttentionOptions part = options;
            part.top_k = std::min<int64_t>(3, index.rows());
            const IndexAttentionResult alone = attend(q.view(), index, part);
            for (int64_t i = 0; i < q.size(0); ++i) {
              lists(i) += alone.lists_visited(i);
              rows_read(i) += alone.rows_visited(i);
            }
          }
          expect_bitwise_equal(got.lists_visited, lists, "lists_visited");
          expect_bitwise_equal(got.rows_visited, rows_read, "rows_visited");
        }
      }
    }
    // Compact kernels: the kernel average over every row.
    IndexAttentionOptions kernel;
    kernel.kernel = Kernel::kEpanechnikov;
    kernel.bandwidth = 0.3;
    kernel.top_k = 2;
    const IndexAttentionResult got = attend(q.view(), pointers, kernel);
    const KernelExact exact = kernel_exact(q, all.keys, all.values, Kernel::kEpanechnikov, 0.3);
    for (int64_t i = 0; i < q.size(0); ++i) {
      EXPECT_EQ(got.certificate(i), 0.0);
      if (exact.in_reach[static_cast<size_t>(i)] == 0) {
        EXPECT_EQ(got.lse(i), -INFINITY) << "query " << i;
        for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(got.output(i, c), 0.0f);
        continue;
      }
      EXPECT_NEAR(got.lse(i), exact.lse(i), 1e-5 * (1 + std::abs(exact.lse(i))));
      for (int64_t c = 0; c < dv; ++c) {
        EXPECT_NEAR(got.output(i, c), exact.output(i, c), 1e-6 * (1 + std::abs(exact.output(i, c))))
            << "query " << i;
      }
    }
  }
}

TEST_F(IndexTest, OneIndexInAListIsThatIndexAndProgressCountsEveryPart) {
  Rng rng(test_seed());
  const Data data = make_store("s", clustered_keys(rng, 600, 4, 5),
                               random_tensor<float>(rng, Shape{600, 3}), StoreDtype::kFloat32, 200);
  const StoreIndex index = StoreIndex::build(data.store, path("i"));
  const Tensor<float> q = clustered_keys(rng, 70, 4, 5);
  IndexAttentionOptions options;
  options.epsilon = 0.01;
  // One part: its lse less log(1), its output and certificate times exp(0).
  const IndexAttentionResult alone = attend(q.view(), index, options);
  const IndexAttentionResult listed =
      attend(q.view(), std::vector<const StoreIndex*>{&index}, options);
  expect_bitwise_equal(listed.output, alone.output, "output");
  expect_bitwise_equal(listed.lse, alone.lse, "lse");
  expect_bitwise_equal(listed.certificate, alone.certificate, "certificate");
  expect_bitwise_equal(listed.rows_visited, alone.rows_visited, "rows_visited");
  // Two parts (the same index twice: every row counted twice, every weight
  // halved, the output and certificate as one): the queries of each part.
  std::vector<std::pair<int64_t, int64_t>> reports;
  options.progress = [&](int64_t done, int64_t total) { reports.emplace_back(done, total); };
  const IndexAttentionResult twice = attend(q.view(), {&index, &index}, options);
  const std::vector<std::pair<int64_t, int64_t>> want{{64, 140}, {70, 140}, {134, 140}, {140, 140}};
  EXPECT_EQ(reports, want);
  for (int64_t i = 0; i < q.size(0); ++i) {
    EXPECT_NEAR(twice.lse(i), alone.lse(i) + std::log(2.0), 1e-5 * (1 + std::abs(alone.lse(i))));
    EXPECT_NEAR(twice.certificate(i), alone.certificate(i), 1e-12);
    EXPECT_EQ(twice.rows_visited(i), 2 * alone.rows_visited(i));
    for (int64_t c = 0; c < 3; ++c) EXPECT_NEAR(twice.output(i, c), alone.output(i, c), 1e-6);
  }
}

TEST_F(IndexTest, ShardsThroughTheirIndexesRefuseBadArguments) {
  Rng rng(test_seed());
  const Data a = make_store("a", clustered_keys(rng, 100, 3, 3),
                            random_tensor<float>(rng, Shape{100, 2}), StoreDtype::kFloat32, 40);
  const Data b = make_store("b", clustered_keys(rng, 50, 4, 3),
                            random_tensor<float>(rng, Shape{50, 2}), StoreDtype::kFloat32, 40);
  const StoreIndex ia = StoreIndex::build(a.store, path("ia"));
  const StoreIndex ib = StoreIndex::build(b.store, path("ib"));
  const Tensor<float> q(Shape{2, 3}, 0.5f);
  expect_error([&] { attend(q.view(), std::vector<const StoreIndex*>{}); },
               {"attend", "indexes is empty"});
  expect_error([&] { attend(q.view(), {&ia, nullptr}); }, {"attend", "indexes[1] is null"});
  expect_error(
      [&] {
        attend(q.view(), {&ia, &ib});
      },
      {"attend", "index " + path("ib") + " has D = 4", "D = 3"});
  IndexAttentionOptions options;
  options.top_k = 201;
  expect_error(
      [&] {
        attend(q.view(), std::vector<const StoreIndex*>{&ia, &ia}, options);
      },
      {"attend", "options.top_k = 201", "200 rows"});
  // Two stores in braces are still attention over stores (a std::vector of
  // indexes as the parameter made this call ambiguous).
  const StoreAttentionResult over_stores = attend(q.view(), {&a.store, &a.store});
  EXPECT_EQ(over_stores.output.shape(), (Shape{2, 2}));
  options.top_k = 150;  // more than either part's rows: each gives its own
  const IndexAttentionResult got =
      attend(q.view(), std::vector<const StoreIndex*>{&ia, &ia}, options);
  EXPECT_EQ(got.top_ids.shape(), (Shape{2, 150}));
  // merge_parts: the parts' shapes.
  const IndexAttentionResult part = attend(q.view(), ia);
  expect_error([&] { merge_parts({part, part}, {100}, 0); }, {"merge_parts", "part_rows"});
  IndexAttentionResult short_part = part;
  short_part.certificate = Tensor<double>(Shape{1});
  expect_error(
      [&] {
        merge_parts({part, short_part}, {100, 100}, 0);
      },
      {"merge_parts", "parts[1].certificate", "[1]"});
  short_part = part;
  short_part.top_certified.pop_back();
  expect_error(
      [&] {
        merge_parts({part, short_part}, {100, 100}, 0);
      },
      {"merge_parts", "parts[1].top_certified has 1 entries"});
}

TEST_F(IndexTest, ProgressCountsTheQueriesInBlocks) {
  Rng rng(test_seed());
  const Data data = make_store("s", clustered_keys(rng, 500, 3, 4),
                               random_tensor<float>(rng, Shape{500, 2}), StoreDtype::kFloat32, 200);
  const StoreIndex index = StoreIndex::build(data.store, path("i"));
  const int64_t nq = 2 * kIndexProgressQueries + 5;
  const Tensor<float> q = random_tensor<float>(rng, Shape{nq, 3});
  std::vector<std::pair<int64_t, int64_t>> reports;
  IndexAttentionOptions options;
  options.progress = [&](int64_t done, int64_t total) { reports.emplace_back(done, total); };
  attend(q.view(), index, options);
  const std::vector<std::pair<int64_t, int64_t>> want{
      {kIndexProgressQueries, nq}, {2 * kIndexProgressQueries, nq}, {nq, nq}};
  EXPECT_EQ(reports, want);
}

TEST_F(IndexTest, AnEmptyStoreHasAnEmptyIndex) {
  const Data data = make_store("s", Tensor<float>(Shape{0, 3}), Tensor<float>(Shape{0, 2}),
                               StoreDtype::kFloat32, 10);
  const StoreIndex index = StoreIndex::build(data.store, path("i"));
  EXPECT_EQ(index.lists().size(), 0u);
  const Tensor<float> q(Shape{2, 3}, 1.0f);
  const IndexAttentionResult got = attend(q.view(), index);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got.lse(i), -INFINITY);
    EXPECT_EQ(got.certificate(i), 0.0);
    EXPECT_EQ(got.output(i, 0), 0.0f);
  }
}

TEST_F(IndexTest, BadArgumentsAreNamed) {
  Rng rng(test_seed());
  const Data data = make_store("s", clustered_keys(rng, 100, 3, 3),
                               random_tensor<float>(rng, Shape{100, 2}), StoreDtype::kFloat32, 40);
  IndexBuildOptions build;
  build.lists = 101;
  expect_error([&] { StoreIndex::build(data.store, path("i"), build); },
               {"StoreIndex::build", "lists = 101", "100 rows"});
  build.lists = -1;
  expect_error([&] { StoreIndex::build(data.store, path("i"), build); }, {"lists = -1"});
  build.lists = 0;
  build.iterations = -1;
  expect_error([&] { StoreIndex::build(data.store, path("i"), build); }, {"iterations = -1"});
  build.iterations = 2;
  build.sample_per_list = 0;
  expect_error([&] { StoreIndex::build(data.store, path("i"), build); }, {"sample_per_list = 0"});
  EXPECT_FALSE(fs::exists(path("i")));
  const StoreIndex index = StoreIndex::build(data.store, path("i"));
  expect_error([&] { StoreIndex::build(data.store, path("i")); }, {"StoreIndex::build", "exists"});

  const Tensor<float> q(Shape{2, 3}, 0.5f);
  IndexAttentionOptions options;
  expect_error(
      [&] {
        attend(Tensor<float>(Shape{2, 4}).view(), index, options);
      },
      {"attend", "queries has shape [2, 4]", "D = 3"});
  options.epsilon = -1;
  expect_error([&] { attend(q.view(), index, options); }, {"attend", "options.epsilon = -1"});
  options.epsilon = NAN;
  expect_error([&] { attend(q.view(), index, options); }, {"options.epsilon = nan"});
  options.epsilon = 0;
  options.probe = -2;
  expect_error([&] { attend(q.view(), index, options); }, {"options.probe = -2"});
  options.probe = 0;
  options.top_k = 101;
  expect_error([&] { attend(q.view(), index, options); }, {"options.top_k = 101", "100 rows"});
  options.top_k = 0;
  options.scoring = Scoring::kAdditive;
  expect_error([&] { attend(q.view(), index, options); }, {"attend", "options.scoring"});
  options.scoring = Scoring::kDistance;
  options.scale = -1.0;
  expect_error([&] { attend(q.view(), index, options); }, {"options.scale = -1", "> 0"});
  options.scale.reset();
  Tensor<float> nan_q = q;
  nan_q(1, 2) = NAN;
  expect_error([&] { attend(nan_q.view(), index, options); }, {"queries[1, 2] is nan"});
  IndexAttentionOptions kernel;
  kernel.kernel = Kernel::kBoxcar;
  expect_error([&] { attend(q.view(), index, kernel); },
               {"options.kernel is boxcar", "options.bandwidth = none", "width > 0"});
  kernel.bandwidth = 0.0;
  expect_error([&] { attend(q.view(), index, kernel); }, {"options.bandwidth = 0"});
  kernel.bandwidth = 0.5;
  kernel.scale = 2.0;
  expect_error([&] { attend(q.view(), index, kernel); },
               {"options.kernel is boxcar", "options.scale", "softmax attention"});
  IndexAttentionOptions softmax;
  softmax.bandwidth = 0.5;
  expect_error([&] { attend(q.view(), index, softmax); },
               {"options.bandwidth = 0.5", "compact kernel"});
}

TEST_F(IndexTest, DamageAndStalenessAreNamed) {
  Rng rng(test_seed());
  Data data = make_store("s", clustered_keys(rng, 300, 3, 3),
                         random_tensor<float>(rng, Shape{300, 2}), StoreDtype::kFloat32, 100);
  const Data other =
      make_store("o", clustered_keys(rng, 300, 3, 3), random_tensor<float>(rng, Shape{300, 2}),
                 StoreDtype::kFloat32, 100);
  const StoreIndex index = StoreIndex::build(data.store, path("i"));
  index.verify();
  expect_error([&] { index.check_built_over(other.store); },
               {"StoreIndex::check_built_over", "another store than store " + path("o")});
  data.store.append(Tensor<float>(Shape{5, 3}, 0.1f).view(), Tensor<float>(Shape{5, 2}).view());
  expect_error([&] { index.check_built_over(data.store); }, {"300 rows", "now has 305", "stale"});
  expect_error([&] { StoreIndex::open(path("nothing")); }, {"StoreIndex::open", "no index at"});
  expect_error([&] { StoreIndex::open(path("s") + "/manifest.json"); }, {"not an index"});

  // One byte of keys.npy flipped: verify names the file; open (structure) does not read it.
  const std::string keys = path("i") + "/keys.npy";
  {
    std::fstream f(keys, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  StoreIndex::open(path("i"));
  expect_error([&] { index.verify(); }, {"StoreIndex::verify", "keys.npy", "checksum"});
  // Truncated: open names it.
  fs::resize_file(keys, fs::file_size(keys) - 4);
  expect_error([&] { StoreIndex::open(path("i")); }, {"StoreIndex::open", "keys.npy"});
  // The manifest edited: its checksum says so.
  const std::string manifest = path("i") + "/manifest.json";
  std::string text;
  {
    std::ifstream f(manifest);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  const size_t at = text.find("\"rows\": 300");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 11, "\"rows\": 299");
  {
    std::ofstream f(manifest);
    f << text;
  }
  expect_error([&] { StoreIndex::open(path("i")); }, {"StoreIndex::open", "checksum", "edited"});

  // A block's box made NaN (its checksum not read): open refuses the box;
  // the file cut short: open names it.
  StoreIndex::build(data.store, path("j"));
  const std::string block_low = path("j") + "/block_low.npy";
  {
    std::fstream f(block_low, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
  }
  expect_error([&] { StoreIndex::open(path("j")); },
               {"StoreIndex::open", "block ", "'s box has coordinate 2 from nan", "damaged"});
  fs::resize_file(block_low, fs::file_size(block_low) - 4);
  expect_error([&] { StoreIndex::open(path("j")); }, {"StoreIndex::open", "block_low.npy"});
}

TEST_F(IndexTest, UpdateAddsAppendedRowsToTheirNearestLists) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    const std::string tag = dtype == StoreDtype::kFloat32 ? "f32" : "bf16";
    SCOPED_TRACE(tag);
    const int64_t n0 = 900, n1 = 700, n2 = 3, d = 4, dv = 3;
    const Tensor<float> keys = clustered_keys(rng, n0 + n1 + n2, d, 5);
    const Tensor<float> values = random_tensor<float>(rng, Shape{n0 + n1 + n2, dv});
    const auto rows_of = [](const Tensor<float>& t, int64_t first, int64_t count) {
      Tensor<float> part(Shape{count, t.size(1)});
      std::copy_n(t.data() + first * t.size(1), count * t.size(1), part.data());
      return part;
    };
    KeyValueStore store = KeyValueStore::create(path("s" + tag), rows_of(keys, 0, n0).view(),
                                                rows_of(values, 0, n0).view(), dtype, 256);
    const StoreIndex built = StoreIndex::build(store, path("i" + tag));
    // Current already: returned as it is, nothing written.
    struct stat before {};
    ASSERT_EQ(::stat(path("i" + tag).c_str(), &before), 0);
    StoreIndex::update(path("i" + tag), store);
    struct stat after {};
    ASSERT_EQ(::stat(path("i" + tag).c_str(), &after), 0);
    EXPECT_EQ(before.st_ino, after.st_ino) << "an index current with its store was written again";

    // Two appends (the second of a few rows far from every key), one update.
    store.append(rows_of(keys, n0, n1).view(), rows_of(values, n0, n1).view());
    Tensor<float> far = rows_of(keys, n0 + n1, n2);
    for (int64_t i = 0; i < far.numel(); ++i) far.data()[i] += 40.0f;
    store.append(far.view(), rows_of(values, n0 + n1, n2).view());
    expect_error([&] { built.check_built_over(store); }, {"stale", "qkv index update"});
    const StoreIndex index = StoreIndex::update(path("i" + tag), store);
    index.check_built_over(store);
    index.verify();
    ASSERT_EQ(index.rows(), n0 + n1 + n2);
    ASSERT_EQ(index.lists().size(), built.lists().size());
    // The centroids as built; every row once, in store order within its
    // list, within its list's radius and norm; the old rows in their lists.
    const ReadBack stored = read_back(store);
    std::vector<int> seen(static_cast<size_t>(index.rows()));
    for (size_t j = 0; j < index.lists().size(); ++j) {
      for (int64_t c = 0; c < d; ++c) {
        ASSERT_EQ(index.centroids()(static_cast<int64_t>(j), c),
                  built.centroids()(static_cast<int64_t>(j), c));
      }
      const IndexList& list = index.lists()[j];
      const IndexList& old = built.lists()[j];
      ASSERT_GE(list.rows, old.rows);
      ASSERT_GE(list.radius, old.radius);
      int64_t previous = -1;
      for (int64_t r = 0; r < list.rows; ++r) {
        const int64_t id = index.store_row(list.first_row + r);
        ASSERT_GT(id, previous);
        previous = id;
        ++seen[static_cast<size_t>(id)];
        if (r < old.rows) ASSERT_EQ(id, built.store_row(old.first_row + r)) << "list " << j;
        double distance = 0.0, norm = 0.0, nearest = INFINITY, own = 0.0;
        for (int64_t c = 0; c < d; ++c) {
          const double diff = double{stored.keys(id, c)} - index.centroids()(int64_t(j), c);
          distance += diff * diff;
          norm += double{stored.keys(id, c)} * stored.keys(id, c);
        }
        ASSERT_LE(std::sqrt(distance), list.radius);
        ASSERT_LE(std::sqrt(norm), list.max_norm);
        if (id >= n0) {  // a new row: in its nearest list, up to float rounding
          own = distance;
          for (size_t m = 0; m < index.lists().size(); ++m) {
            double dm = 0.0;
            for (int64_t c = 0; c < d; ++c) {
              const double diff = double{stored.keys(id, c)} - index.centroids()(int64_t(m), c);
              dm += diff * diff;
            }
            nearest = std::min(nearest, dm);
          }
          ASSERT_LE(own, nearest * (1 + 1e-4) + 1e-5) << "row " << id;
        }
      }
    }
    for (int64_t r = 0; r < index.rows(); ++r) ASSERT_EQ(seen[static_cast<size_t>(r)], 1);

    // Attention through it against exact attention over every row.
    const Tensor<float> q = random_tensor<float>(rng, Shape{12, d}, -2.0, 2.0);
    Tensor<float> queries = q;
    if (dtype == StoreDtype::kBFloat16) {
      for (int64_t i = 0; i < queries.numel(); ++i)
        queries.data()[i] = static_cast<float>(bfloat16(queries.data()[i]));
    }
    const Exact exact = exact_attention(queries, stored.keys, stored.values, false, 1.0);
    for (const double epsilon : {0.0, 1e-3}) {
      IndexAttentionOptions options;
      options.scale = 1.0;
      options.epsilon = epsilon;
      options.top_k = 3;
      check_against_exact(attend(q.view(), index, options), exact, stored.values, options,
                          "epsilon " + std::to_string(epsilon));
    }
  }
}

TEST_F(IndexTest, UpdateRefusesAnotherStoreAnIndexWithoutListsAndASecondUpdater) {
  Rng rng(test_seed());
  Data data = make_store("s", clustered_keys(rng, 300, 3, 3),
                         random_tensor<float>(rng, Shape{300, 2}), StoreDtype::kFloat32, 100);
  const Data other =
      make_store("o", clustered_keys(rng, 300, 3, 3), random_tensor<float>(rng, Shape{300, 2}),
                 StoreDtype::kFloat32, 100);
  const Data wide = make_store("w", Tensor<float>(Shape{10, 4}), Tensor<float>(Shape{10, 2}),
                               StoreDtype::kFloat32, 100);
  StoreIndex::build(data.store, path("i"));
  expect_error([&] { StoreIndex::update(path("i"), other.store); },
               {"StoreIndex::update", "another store than store " + path("o")});
  expect_error([&] { StoreIndex::update(path("i"), wide.store); },
               {"StoreIndex::update", "D = 3", "D = 4"});
  expect_error([&] { StoreIndex::update(path("nothing"), data.store); },
               {"StoreIndex::update", "nothing"});
  // An index of an empty store has no lists for new rows to join.
  Data empty = make_store("e", Tensor<float>(Shape{0, 3}), Tensor<float>(Shape{0, 2}),
                          StoreDtype::kFloat32, 10);
  StoreIndex::build(empty.store, path("ei"));
  StoreIndex::update(path("ei"), empty.store);  // current: fine
  empty.store.append(Tensor<float>(Shape{2, 3}).view(), Tensor<float>(Shape{2, 2}).view());
  expect_error([&] { StoreIndex::update(path("ei"), empty.store); },
               {"StoreIndex::update", "no lists", "build it again"});
  // A second updater while one holds the lock: an Error at once, the index untouched.
  data.store.append(Tensor<float>(Shape{5, 3}, 0.5f).view(), Tensor<float>(Shape{5, 2}).view());
  {
    const int fd = ::open(path("i").c_str(), O_RDONLY | O_DIRECTORY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX), 0);
    expect_io_error([&] { StoreIndex::update(path("i"), data.store); },
                    {"StoreIndex::update", "being updated by another process"});
    ::close(fd);
  }
  EXPECT_EQ(StoreIndex::open(path("i")).rows(), 300);
  EXPECT_EQ(StoreIndex::update(path("i"), data.store).rows(), 305);
  // Nothing left beside it.
  for (const auto& entry : fs::directory_iterator(root_)) {
    EXPECT_NE(entry.path().filename().string()[0], '.') << entry.path();
  }
}

// The backward of certified attention against central differences of the
// index's own forward (the lists visited kept fixed: a direction that moves
// a query across a change of its lists is drawn again), and, for epsilon 0,
// against the gradient of attention over every row in double (and the
// store's backward for dot scores).
TEST_F(IndexTest, BackwardIsTheGradientOfTheVisitedRows) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t n = 1500, d = 5, dv = 3, nq = 6;
  for (const StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    for (const bool distance : {false, true}) {
      const std::string tag = std::string(dtype == StoreDtype::kFloat32 ? "f32" : "bf16") +
                              (distance ? "-distance" : "-dot");
      SCOPED_TRACE(tag);
      const Data data = make_store("s" + tag, clustered_keys(rng, n, d, 8),
                                   random_tensor<float>(rng, Shape{n, dv}), dtype, 400);
      const StoreIndex index = StoreIndex::build(data.store, path("i" + tag));
      // Queries near keys, so a few lists hold most of the weight.
      Tensor<float> q(Shape{nq, d});
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t r = rng.uniform_int(0, n - 1);
        for (int64_t c = 0; c < d; ++c)
          q(i, c) = data.keys(r, c) + static_cast<float>(rng.uniform(-0.05, 0.05));
      }
      const Tensor<float> d_o = random_tensor<float>(rng, Shape{nq, dv});
      IndexAttentionOptions options;
      options.scoring = distance ? Scoring::kDistance : Scoring::kDotProduct;
      options.scale = distance ? 4.0 : 2.0;

      // epsilon 0: attention over every row, its gradient in double (and,
      // for dot scores, the store's backward).
      options.epsilon = 0;
      const IndexAttentionResult all = attend(q.view(), index, options);
      const Tensor<float> dq_all = attend_backward(q.view(), index, options, all, d_o.view());
      Tensor<float> qs = q;  // as the scores take them
      if (dtype == StoreDtype::kBFloat16 && !distance) {
        for (int64_t i = 0; i < qs.numel(); ++i)
          qs.data()[i] = static_cast<float>(bfloat16(qs.data()[i]));
      }
      const Exact exact = exact_attention(qs, data.keys, data.values, distance, *options.scale);
      for (int64_t i = 0; i < nq; ++i) {
        // dq = sum_j p_j (dO . v_j - dO . o) ds_j/dq.
        double d_o_dot_o = 0.0;
        for (int64_t c = 0; c < dv; ++c) d_o_dot_o += double{d_o(i, c)} * exact.output(i, c);
        std::vector<double> want(static_cast<size_t>(d));
        for (int64_t r = 0; r < n; ++r) {
          const double p =
              std::exp(exact.scores[static_cast<size_t>(i)][static_cast<size_t>(r)] - exact.lse(i));
          double g = 0.0;
          for (int64_t c = 0; c < dv; ++c) g += double{d_o(i, c)} * data.values(r, c);
          for (int64_t c = 0; c < d; ++c) {
            const double ds = distance ? double{data.keys(r, c)} - qs(i, c) : data.keys(r, c);
            want[static_cast<size_t>(c)] += p * (g - d_o_dot_o) * *options.scale * ds;
          }
        }
        for (int64_t c = 0; c < d; ++c) {
          ASSERT_NEAR(dq_all(i, c), want[static_cast<size_t>(c)],
                      1e-4 * (1 + std::abs(want[static_cast<size_t>(c)])))
              << "query " << i;
        }
      }
      if (!distance) {
        StoreAttentionOptions store_options;
        store_options.scale = options.scale;
        const StoreAttentionResult over_store = attend(q.view(), data.store, {}, store_options);
        const StoreAttentionGrads grads =
            attend_backward(q.view(), data.store, {}, store_options,
                            {over_store.output.view(), over_store.lse.view()}, d_o.view());
        for (int64_t i = 0; i < nq; ++i) {
          for (int64_t c = 0; c < d; ++c) {
            // The store's bfloat16 backward works in bfloat16 steps (2^-8);
            // this one is within 1e-4 of the double reference above.
            ASSERT_NEAR(dq_all(i, c), grads.d_queries(i, c),
                        (dtype == StoreDtype::kBFloat16 ? 4e-3 : 1e-4) *
                            (1 + std::abs(grads.d_queries(i, c))))
                << "query " << i;
          }
        }
      }
      // The queries a bfloat16 index rounds (dot scores) have steps, not
      // differences to take.
      if (dtype == StoreDtype::kBFloat16 && !distance) continue;
      for (const int64_t probe : {int64_t{0}, int64_t{2}}) {
        SCOPED_TRACE("probe " + std::to_string(probe));
        options.epsilon = 1e-3;
        options.probe = probe;
        const IndexAttentionResult forward = attend(q.view(), index, options);
        const Tensor<float> dq = attend_backward(q.view(), index, options, forward, d_o.view());
        int64_t checked_queries = 0;
        for (int64_t i = 0; i < nq; ++i) {
          const double h = 2.5e-4;  // 1e-3 left a curvature error of 2e-5
          bool checked = false;
          for (int attempt = 0; attempt < 20 && !checked; ++attempt) {
            Tensor<float> plus(Shape{1, d}), minus(Shape{1, d});
            std::vector<double> u(static_cast<size_t>(d));
            for (int64_t c = 0; c < d; ++c) {
              u[static_cast<size_t>(c)] = rng.uniform(-1.0, 1.0);
              plus(0, c) = static_cast<float>(q(i, c) + h * u[static_cast<size_t>(c)]);
              minus(0, c) = static_cast<float>(q(i, c) - h * u[static_cast<size_t>(c)]);
            }
            const IndexAttentionResult a = attend(plus.view(), index, options);
            const IndexAttentionResult b = attend(minus.view(), index, options);
            // The same lists visited, as far as their count and rows tell
            // (with a probe the count stays; which lists may not).
            if (a.lists_visited(0) != forward.lists_visited(i) ||
                b.lists_visited(0) != forward.lists_visited(i) ||
                a.rows_visited(0) != forward.rows_visited(i) ||
                b.rows_visited(0) != forward.rows_visited(i)) {
              continue;  // the step crossed a change of the lists visited
            }
            double numeric = 0.0, analytic = 0.0, scale = 0.0;
            for (int64_t c = 0; c < dv; ++c) {
              numeric += double{d_o(i, c)} * (double{a.output(0, c)} - b.output(0, c));
            }
            // The steps as the floats took them.
            for (int64_t c = 0; c < d; ++c) {
              const double step = double{plus(0, c)} - double{minus(0, c)};
              analytic += double{dq(i, c)} * step;
              scale += std::abs(double{dq(i, c)} * step);
            }
            ASSERT_NEAR(numeric, analytic, 2e-3 * scale + 1e-5) << "query " << i;
            checked = true;
          }
          // A query whose visit stops right at epsilon changes its lists
          // whichever way it moves: it has no derivative to check.
          checked_queries += checked;
        }
        ASSERT_GE(checked_queries, nq / 2) << "most steps changed the lists visited";
      }
    }
  }
}

TEST_F(IndexTest, BackwardRefusesACompactKernelAndForeignShapes) {
  Rng rng(test_seed());
  const Data data = make_store("s", clustered_keys(rng, 300, 3, 3),
                               random_tensor<float>(rng, Shape{300, 2}), StoreDtype::kFloat32, 100);
  const StoreIndex index = StoreIndex::build(data.store, path("i"));
  const Tensor<float> q = random_tensor<float>(rng, Shape{4, 3});
  const IndexAttentionResult forward = attend(q.view(), index);
  const Tensor<float> d_o(Shape{4, 2}, 1.0f);
  IndexAttentionOptions boxcar;
  boxcar.kernel = Kernel::kBoxcar;
  boxcar.bandwidth = 0.5;
  expect_error([&] { attend_backward(q.view(), index, boxcar, forward, d_o.view()); },
               {"attend_backward", "boxcar", "softmax"});
  expect_error(
      [&] {
        attend_backward(q.view(), index, {}, forward, Tensor<float>(Shape{4, 3}).view());
      },
      {"attend_backward", "d_output", "[4, 3]", "[4, 2]"});
  const Tensor<float> q3 = random_tensor<float>(rng, Shape{3, 3});
  expect_error(
      [&] {
        attend_backward(q3.view(), index, {}, forward, Tensor<float>(Shape{3, 2}).view());
      },
      {"attend_backward", "forward.lists_visited", "[4]", "[3]"});
  IndexAttentionResult tampered = attend(q.view(), index);
  tampered.lists_visited(1) = static_cast<int64_t>(index.lists().size()) + 1;
  expect_error([&] { attend_backward(q.view(), index, {}, tampered, d_o.view()); },
               {"attend_backward", "forward.lists_visited[1]"});
  IndexAttentionOptions negative;
  negative.epsilon = -1;
  expect_error([&] { attend_backward(q.view(), index, negative, forward, d_o.view()); },
               {"attend_backward", "options.epsilon"});
}

}  // namespace
}  // namespace qkv::test
