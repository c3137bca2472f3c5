// Tests of attention through an index per MPI rank (qkv::mpi::attend with a
// StoreIndex, qkv/mpi.h), linked into test_mpi_store and run under
// `mpirun -np R` for R = 1 to 4: each rank builds an index over its own shard
// (one rank's shard empty when R >= 3), and the merged result is held to one
// process attending through every shard's index and merging (the same
// bits), to exact attention over the union of the rows in float64 (epsilon
// 0 equal to it; epsilon > 0 and probe within the merged certificate,
// checked against the missed weight from the exact lse; certified top-k
// rows the exact ones), compact kernels to the kernel average over every
// row (with queries in reach of one rank's rows only, and of none); and a
// failing rank making every rank throw.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "index_testing.h"
#include "mpi/mpi_testing.h"
#include "qkv/index.h"
#include "qkv/mpi.h"
#include "qkv/store.h"
#include "store_testing.h"
#include "test_util.h"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

// Rank 0's tensor, compared bit for bit on every rank.
template <class T>
void expect_same_on_every_rank(const Tensor<T>& t, const char* name) {
  std::vector<T> root(t.values());
  MPI_Bcast(root.data(), static_cast<int>(root.size() * sizeof(T)), MPI_BYTE, 0, MPI_COMM_WORLD);
  expect_bitwise_equal(t, Tensor<T>(t.shape(), root), name);
}

// Every member of two results, bit for bit.
void expect_same_bits(const IndexAttentionResult& got, const IndexAttentionResult& want,
                      const std::string& what) {
  SCOPED_TRACE(what);
  expect_bitwise_equal(got.output, want.output, "output");
  expect_bitwise_equal(got.lse, want.lse, "lse");
  expect_bitwise_equal(got.certificate, want.certificate, "certificate");
  expect_bitwise_equal(got.lists_visited, want.lists_visited, "lists_visited");
  expect_bitwise_equal(got.rows_visited, want.rows_visited, "rows_visited");
  expect_bitwise_equal(got.top_ids, want.top_ids, "top_ids");
  expect_bitwise_equal(got.top_weights, want.top_weights, "top_weights");
  EXPECT_EQ(got.top_certified, want.top_certified);
}

// A directory every rank sees (one machine), made by rank 0; each rank's
// shard store and its index in it, and every rank's rows together.
class MpiIndexTest : public MpiDirectoryTest {
 protected:
  struct Shards {
    Tensor<float> keys, values;   // every rank's rows, in rank order, as stored
    std::vector<int64_t> rows;    // per rank
    std::vector<StoreIndex> all;  // every rank's index (for one process)
    const StoreIndex* mine = nullptr;
    std::vector<const StoreIndex*> pointers() const {
      std::vector<const StoreIndex*> out;
      for (const StoreIndex& index : all) out.push_back(&index);
      return out;
    }
  };

  // Rank r's shard holds rows [first_r, first_r + rows[r]) of keys and
  // values; each rank makes its own store and index (`lists` lists, 0 for
  // the default), then opens every rank's index.
  Shards make_shards(const std::string& name, const Tensor<float>& keys,
                     const Tensor<float>& values, const std::vector<int64_t>& rows,
                     StoreDtype dtype, uint64_t seed, int64_t lists = 0) {
    const int rank = rank_of();
    const int64_t first = std::accumulate(rows.begin(), rows.begin() + rank, int64_t{0});
    const int64_t mine = rows[static_cast<size_t>(rank)];
    const std::string me = name + std::to_string(rank);
    const KeyValueStore store =
        KeyValueStore::create(path(me), rows_of(keys, first, mine).view(),
                              rows_of(values, first, mine).view(), dtype, 97);
    IndexBuildOptions build;
    build.seed = seed;
    build.lists = mine == 0 ? 0 : std::min(lists, mine);
    StoreIndex::build(store, path(me + ".index"), build);
    MPI_Barrier(MPI_COMM_WORLD);
    Shards shards;
    shards.rows = rows;
    for (int r = 0; r < ranks(); ++r) {
      shards.all.push_back(StoreIndex::open(path(name + std::to_string(r) + ".index")));
    }
    shards.mine = &shards.all[static_cast<size_t>(rank)];
    // The rows as stored (rounded to bf16 for a bf16 store), in rank order.
    const KeyValueStore all =
        KeyValueStore::create(path(me + ".all"), keys.view(), values.view(), dtype, 1000);
    const ReadBack back = read_back(all);
    shards.keys = back.keys;
    shards.values = back.values;
    return shards;
  }

  static Tensor<float> rows_of(const Tensor<float>& x, int64_t first, int64_t n) {
    Tensor<float> out(Shape{n, x.size(1)});
    std::copy_n(x.data() + first * x.size(1), n * x.size(1), out.data());
    return out;
  }
};

// Shard sizes: 1 to `most` rows per rank, and none on rank 1 when there are
// 3 or more ranks (a rank with no rows, no lists).
std::vector<int64_t> shard_sizes(Rng& rng, int64_t most) {
  std::vector<int64_t> rows;
  for (int r = 0; r < ranks(); ++r)
    rows.push_back(r == 1 && ranks() >= 3 ? 0 : rng.uniform_int(1, most));
  return rows;
}

TEST_F(MpiIndexTest, SoftmaxMergedOverTheRanksHoldsItsCertificate) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE(seed_note(seed) + " ranks=" + std::to_string(ranks()));
  Rng rng(seed);
  int made = 0;
  for (const StoreDtype dtype : {StoreDtype::kFloat32, StoreDtype::kBFloat16}) {
    const std::vector<int64_t> rows = shard_sizes(rng, 900);
    const int64_t n = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    const int64_t d = rng.uniform_int(3, 12), dv = rng.uniform_int(1, 5);
    const Tensor<float> keys = clustered_keys(rng, n, d, 12);
    const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
    const Shards shards = make_shards("s" + std::to_string(made++), keys, values, rows, dtype,
                                      rng.next(), rng.bernoulli(0.5) ? 0 : rng.uniform_int(1, 40));
    // Queries near the keys, and one far from every key.
    Tensor<float> q = clustered_keys(rng, 16, d, 6);
    for (int64_t c = 0; c < d; ++c) q(15, c) *= 50.0f;
    for (const bool distance : {false, true}) {
      for (const double scale : {1.0, 8.0}) {
        for (const double epsilon : {0.0, 1e-3, 0.1}) {
          for (const int64_t probe : {int64_t{0}, int64_t{2}}) {
            if (probe > 0 && epsilon > 0) continue;
            const std::string what = std::string(store_dtype_name(dtype)) +
                                     (distance ? " distance" : " dot") + " scale " +
                                     std::to_string(scale) + " epsilon " + std::to_string(epsilon) +
                                     " probe " + std::to_string(probe);
            SCOPED_TRACE(what);
            IndexAttentionOptions options;
            options.scoring = distance ? Scoring::kDistance : Scoring::kDotProduct;
            options.scale = scale;
            options.epsilon = epsilon;
            options.probe = probe;
            options.top_k = std::min<int64_t>(n, 3);
            mpi::Timings timings;
            const IndexAttentionResult got =
                mpi::attend(q.view(), *shards.mine, MPI_COMM_WORLD, options, &timings);
            // One process through every shard's index, merged in the same
            // order: the same code, the same bits.
            expect_same_bits(got, attend(q.view(), shards.pointers(), options),
                             "against one process");
            const Tensor<float> q_scored =
                !distance && dtype == StoreDtype::kBFloat16 ? rounded_to_bf16(q) : q;
            check_against_exact(
                got, exact_attention(q_scored, shards.keys, shards.values, distance, scale),
                shards.values, options, what);
            expect_same_on_every_rank(got.output, "output");
            expect_same_on_every_rank(got.certificate, "certificate");
            expect_same_on_every_rank(got.top_ids, "top_ids");
            EXPECT_GE(timings.local, 0.0);
            EXPECT_GE(timings.communication, 0.0);
            // The same bits again: the merge's order is fixed.
            const IndexAttentionResult again =
                mpi::attend(q.view(), *shards.mine, MPI_COMM_WORLD, options);
            expect_same_bits(again, got, "second run");
          }
        }
      }
    }
  }
}

TEST_F(MpiIndexTest, LocalCertificatesAddUpAndListsAndRowsSum) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE(seed_note(seed) + " ranks=" + std::to_string(ranks()));
  Rng rng(seed);
  const std::vector<int64_t> rows = shard_sizes(rng, 700);
  const int64_t n = std::accumulate(rows.begin(), rows.end(), int64_t{0}), d = 6, dv = 3;
  const Shards shards =
      make_shards("s", clustered_keys(rng, n, d, 10), random_tensor<float>(rng, Shape{n, dv}), rows,
                  StoreDtype::kFloat32, rng.next());
  const Tensor<float> q = clustered_keys(rng, 12, d, 5);
  IndexAttentionOptions options;
  options.epsilon = 0.05;
  const IndexAttentionResult got = mpi::attend(q.view(), *shards.mine, MPI_COMM_WORLD, options);
  // Each rank's own result, and the merge rule by hand in double.
  std::vector<IndexAttentionResult> parts;
  for (const StoreIndex& index : shards.all) parts.push_back(attend(q.view(), index, options));
  for (int64_t i = 0; i < q.size(0); ++i) {
    double largest = -INFINITY, sum = 0.0, certificate = 0.0, largest_certificate = 0.0;
    int64_t lists = 0, rows_read = 0;
    for (const IndexAttentionResult& part : parts) {
      largest = std::max(largest, double{part.lse(i)});
      lists += part.lists_visited(i);
      rows_read += part.rows_visited(i);
    }
    for (const IndexAttentionResult& part : parts) sum += std::exp(part.lse(i) - largest);
    const double lse = largest + std::log(sum);
    for (const IndexAttentionResult& part : parts) {
      if (part.lse(i) == -INFINITY) continue;  // an empty shard
      certificate += part.certificate(i) * std::exp(part.lse(i) - lse);
      largest_certificate = std::max(largest_certificate, part.certificate(i));
    }
    EXPECT_NEAR(got.certificate(i), certificate, 1e-12 * certificate) << "query " << i;
    EXPECT_LE(got.certificate(i), largest_certificate) << "query " << i;
    EXPECT_LE(got.certificate(i), options.epsilon) << "query " << i;
    EXPECT_EQ(got.lists_visited(i), lists) << "query " << i;
    EXPECT_EQ(got.rows_visited(i), rows_read) << "query " << i;
    EXPECT_NEAR(got.lse(i), lse, 1e-6 * (1 + std::abs(lse))) << "query " << i;
  }
}

TEST_F(MpiIndexTest, CompactKernelsEqualTheKernelAverageOverEveryRow) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE(seed_note(seed) + " ranks=" + std::to_string(ranks()));
  Rng rng(seed);
  const std::vector<int64_t> rows = shard_sizes(rng, 800);
  const int64_t n = std::accumulate(rows.begin(), rows.end(), int64_t{0}), d = 3, dv = 2;
  // Each rank's keys in blobs of its own, 20 apart in the first coordinate
  // (at most 2 from their centres' box): a query at one of rank r's keys,
  // with a width below 1, has rows in reach on rank r only.
  Tensor<float> keys = clustered_keys(rng, n, d, 8);
  int64_t row = 0;
  for (int r = 0; r < ranks(); ++r) {
    for (int64_t j = 0; j < rows[static_cast<size_t>(r)]; ++j, ++row) keys(row, 0) += 20.0f * r;
  }
  const Shards shards = make_shards("s", keys, random_tensor<float>(rng, Shape{n, dv}), rows,
                                    StoreDtype::kFloat32, rng.next());
  const int64_t nq = 9;
  Tensor<float> q(Shape{nq, d});
  for (int64_t i = 0; i < nq - 1; ++i) {
    const int64_t at = rng.uniform_int(0, n - 1);
    for (int64_t c = 0; c < d; ++c)
      q(i, c) = keys(at, c) + static_cast<float>(rng.uniform(-0.05, 0.05));
  }
  for (int64_t c = 0; c < d; ++c) q(nq - 1, c) = -100.0f;  // no row in reach on any rank
  for (const Kernel kernel : {Kernel::kBoxcar, Kernel::kEpanechnikov, Kernel::kTriangular}) {
    for (const double h : {0.1, 0.5}) {
      SCOPED_TRACE(std::string(kernel_name(kernel)) + " h " + std::to_string(h));
      IndexAttentionOptions options;
      options.kernel = kernel;
      options.bandwidth = h;
      options.top_k = 2;
      const IndexAttentionResult got = mpi::attend(q.view(), *shards.mine, MPI_COMM_WORLD, options);
      expect_same_bits(got, attend(q.view(), shards.pointers(), options), "against one process");
      const KernelExact exact = kernel_exact(q, shards.keys, shards.values, kernel, h);
      for (int64_t i = 0; i < nq; ++i) {
        EXPECT_EQ(got.certificate(i), 0.0);
        EXPECT_TRUE(got.top_certified[static_cast<size_t>(i)]);
        if (exact.in_reach[static_cast<size_t>(i)] == 0) {
          EXPECT_EQ(got.lse(i), -INFINITY) << "query " << i;
          for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(got.output(i, c), 0.0f) << "query " << i;
          EXPECT_EQ(got.top_ids(i, 0), -1);
          continue;
        }
        EXPECT_NEAR(got.lse(i), exact.lse(i), 1e-5 * (1 + std::abs(exact.lse(i)))) << "query " << i;
        for (int64_t c = 0; c < dv; ++c) {
          EXPECT_NEAR(got.output(i, c), exact.output(i, c),
                      1e-6 * (1 + std::abs(exact.output(i, c))))
              << "query " << i;
        }
        // The top row is in reach: its weight over the rows in reach.
        const int64_t id = got.top_ids(i, 0);
        ASSERT_GE(id, 0);
        EXPECT_GT(got.top_weights(i, 0), 0.0f);
        double w = 1.0;
        for (int64_t c = 0; c < d; ++c) {
          const double u = (double{q(i, c)} - shards.keys(id, c)) / h;
          w *= std::abs(u) > 1                   ? 0.0
               : kernel == Kernel::kBoxcar       ? 1.0
               : kernel == Kernel::kEpanechnikov ? 1 - u * u
                                                 : 1 - std::abs(u);
        }
        EXPECT_NEAR(got.top_weights(i, 0), w / std::exp(exact.lse(i)), 1e-5) << "query " << i;
      }
      // The query in no rank's reach read nothing; the others only the
      // rows near them (of one rank).
      EXPECT_EQ(got.rows_visited(nq - 1), 0);
    }
  }
}

TEST_F(MpiIndexTest, AFailingRankMakesEveryRankThrow) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE(seed_note(seed) + " ranks=" + std::to_string(ranks()));
  Rng rng(seed);
  const int last = ranks() - 1;
  // 5000 rows of D = 4 a rank: 80 kB of keys, mapped (a file of at most
  // 64 kB is read whole when opened, and then no change to it is seen).
  const std::vector<int64_t> rows(static_cast<size_t>(ranks()), 5000);
  const int64_t n = 5000 * ranks();
  const Shards shards =
      make_shards("s", clustered_keys(rng, n, 4, 4), random_tensor<float>(rng, Shape{n, 2}), rows,
                  StoreDtype::kFloat32, rng.next(), 6);
  const Tensor<float> q = clustered_keys(rng, 3, 4, 2);
  // A bad option on the last rank alone: every rank names it.
  IndexAttentionOptions options;
  if (rank_of() == last) options.epsilon = -1;
  const std::string message = expect_error(
      [&] { mpi::attend(q.view(), *shards.mine, MPI_COMM_WORLD, options); },
      {"qkv::mpi::attend", "rank " + std::to_string(last) + " of " + std::to_string(ranks()),
       "options.epsilon = -1"});
  // The function is named once.
  EXPECT_EQ(message.find("qkv::mpi::attend"), message.rfind("qkv::mpi::attend")) << message;
  options.epsilon = 1e-3;
  // top_k beyond every rank's rows together.
  options.top_k = n + 1;
  expect_error(
      [&] { mpi::attend(q.view(), *shards.mine, MPI_COMM_WORLD, options); },
      {"qkv::mpi::attend", "top_k = " + std::to_string(n + 1), std::to_string(n) + " rows"});
  options.top_k = 0;
  // Indexes that disagree on D.
  if (ranks() > 1) {
    const int64_t d = rank_of() == last ? 5 : 4;
    const KeyValueStore other = KeyValueStore::create(path("other" + std::to_string(rank_of())),
                                                      Tensor<float>(Shape{30, d}, 0.5f).view(),
                                                      Tensor<float>(Shape{30, 2}).view());
    const StoreIndex index =
        StoreIndex::build(other, path("other-index" + std::to_string(rank_of())));
    expect_error(
        [&] {
          mpi::attend(Tensor<float>(Shape{2, d}).view(), index, MPI_COMM_WORLD);
        },
        {"qkv::mpi::attend", "rank " + std::to_string(last) + "'s index has D = 5"});
  }
  // The last rank's index damaged after it was opened: its keys change
  // under the read, and every rank hears of it.
  const std::string keys = path("s" + std::to_string(last) + ".index") + "/keys.npy";
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank_of() == last) fs::resize_file(keys, 100);
  MPI_Barrier(MPI_COMM_WORLD);
  options.epsilon = 0;  // every list: the damaged ones too
  expect_error(
      [&] { mpi::attend(q.view(), *shards.mine, MPI_COMM_WORLD, options); },
      {"qkv::mpi::attend", "rank " + std::to_string(last) + " of " + std::to_string(ranks()), keys,
       "changed while it was read"});
  // And the communicator still works afterwards.
  const KeyValueStore fresh = KeyValueStore::create(path("fresh" + std::to_string(rank_of())),
                                                    Tensor<float>(Shape{30, 4}, 0.5f).view(),
                                                    Tensor<float>(Shape{30, 2}, 1.0f).view());
  const StoreIndex index =
      StoreIndex::build(fresh, path("fresh-index" + std::to_string(rank_of())));
  const IndexAttentionResult fine = mpi::attend(q.view(), index, MPI_COMM_WORLD);
  EXPECT_NEAR(fine.output(0, 1), 1.0f, 1e-6);
  EXPECT_NEAR(fine.lse(0),
              std::log(30.0 * ranks()) + 0.5 * (q(0, 0) + q(0, 1) + q(0, 2) + q(0, 3)) / 2, 1e-4);
}

}  // namespace
}  // namespace qkv::test
