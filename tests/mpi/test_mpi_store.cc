// Tests of qkv::mpi (qkv/mpi.h), run under `mpirun -np R` for R = 1 to 4
// (tests/CMakeLists.txt): attention over one store shared by the ranks and
// over a shard store per rank, against attention over all rows in one
// process and a float64 loop; chunk counts not divisible by R and ranks with
// no chunks; every valid-rows form; top-k; the same bits on every rank and
// in every run; the distributed backward; a failing rank making every rank
// throw. Every rank runs every test; a failure on any rank fails the run.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "mpi/mpi_testing.h"
#include "qkv/mpi.h"
#include "qkv/simd.h"
#include "qkv/store_attention.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

namespace fs = std::filesystem;

// A directory every rank sees (one machine): made by rank 0, removed at the end.
class MpiStoreTest : public MpiDirectoryTest {
 protected:
  // Rank 0 creates the store; the others wait for it, then all open it.
  KeyValueStore shared_store(const std::string& name, const Tensor<float>& keys,
                             const Tensor<float>& values, int64_t chunk_rows) {
    if (rank_of() == 0)
      KeyValueStore::create(path(name), keys, values, StoreDtype::kFloat32, chunk_rows);
    MPI_Barrier(MPI_COMM_WORLD);
    return KeyValueStore::open(path(name));
  }
};

Tensor<float> rows_of(const Tensor<float>& x, int64_t first, int64_t n) {
  Tensor<float> out(Shape{n, x.size(1)});
  std::copy_n(x.data() + first * x.size(1), n * x.size(1), out.data());
  return out;
}

// Rank 0's tensor, compared bit for bit on every rank.
template <class T>
void expect_same_on_every_rank(const Tensor<T>& t, const char* name) {
  if (t.empty()) return;  // not asked for (top_k = 0)
  std::vector<T> root(t.values());
  MPI_Bcast(root.data(), static_cast<int>(root.size() * sizeof(T)), MPI_BYTE, 0, MPI_COMM_WORLD);
  expect_bitwise_equal(t, Tensor<T>(t.shape(), root), name);
}

void expect_top_close(const StoreAttentionResult& got, const StoreAttentionResult& want) {
  ASSERT_EQ(got.top_ids.shape(), want.top_ids.shape());
  expect_close(got.top_weights, want.top_weights, Tol{.atol = 1e-6, .rtol = 1e-4}, "top_weights");
  // Ids agree except between rows of (nearly) equal weight.
  for (int64_t i = 0; i < got.top_ids.numel(); ++i) {
    if (got.top_ids.data()[i] != want.top_ids.data()[i]) {
      EXPECT_NEAR(got.top_weights.data()[i], want.top_weights.data()[i], 1e-6) << "entry " << i;
    }
  }
}

TEST_F(MpiStoreTest, OneStoreSharedByTheRanksEqualsOneProcess) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE(seed_note(seed) + " ranks=" + std::to_string(ranks()));
  Rng rng(seed);
  int made = 0;
  // Chunk counts 1, 2, 3, 7 and about 13: not divisible by 2, 3 or 4, and
  // fewer chunks than ranks (ranks with nothing to read).
  for (int64_t chunks : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{7}, int64_t{13}}) {
    const int64_t d = rng.uniform_int(1, 32), dv = rng.uniform_int(1, 16),
                  nq = rng.uniform_int(1, 9);
    const int64_t chunk_rows = rng.uniform_int(20, 120);
    const int64_t n = (chunks - 1) * chunk_rows + rng.uniform_int(1, chunk_rows);
    const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, -2, 2);
    const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
    const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d}, -2, 2);
    Tensor<int64_t> per_query(Shape{nq});
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t edge = std::min(n, chunk_rows * rng.uniform_int(0, chunks));
      const int64_t choices[] = {0, n, rng.uniform_int(0, n), edge, std::min(n, edge + 1)};
      per_query(i) = choices[rng.uniform_int(0, 4)];
    }
    const Tensor<int64_t> one(Shape{1}, rng.uniform_int(0, n));
    // The loop's batch-of-one lengths: (1, Nq), one per query.
    const Tensor<int64_t> per_query_2d =
        Tensor<int64_t>::copy_of(per_query.view()).reshaped(Shape{1, nq});
    const KeyValueStore store =
        shared_store("s" + std::to_string(made++), keys, values, chunk_rows);
    const mpi::StorePart part = mpi::share_of_chunks(store, rank_of(), ranks());
    for (int form = 0; form < 3; ++form) {
      SCOPED_TRACE("chunks=" + std::to_string(chunks) + " n=" + std::to_string(n) +
                   " form=" + std::to_string(form));
      const ValidLens valid = form == 0   ? ValidLens()
                              : form == 1 ? ValidLens(one)
                                          : ValidLens(per_query);
      StoreAttentionOptions options;
      options.top_k = std::min<int64_t>(n, rng.uniform_int(0, 6));
      mpi::Timings timings;
      const StoreAttentionResult got =
          mpi::attend(queries, part, MPI_COMM_WORLD, valid, options, &timings);
      const StoreAttentionResult want = attend(queries, store, valid, options);
      expect_close(got.output, want.output, kSdpa, "output");
      expect_close(got.lse, want.lse, kSdpaLse, "lse");
      // And the float64 loop over every row at once.
      const NaiveForward ref = naive_sdpa<float>(
          queries.view().unsqueeze0(), keys.view().unsqueeze0(), values.view().unsqueeze0(),
          form == 0   ? ValidLens()
          : form == 1 ? ValidLens(one)
                      : ValidLens(per_query_2d),
          1.0 / std::sqrt(static_cast<double>(d)), {});
      expect_close(got.output, as_tensor(Shape{nq, dv}, ref.out), kSdpa, "output vs float64 loop");
      expect_close(got.lse, as_tensor(Shape{nq}, ref.lse), kSdpaLse, "lse vs float64 loop");
      if (options.top_k > 0) expect_top_close(got, want);
      expect_same_on_every_rank(got.output, "output");
      expect_same_on_every_rank(got.lse, "lse");
      expect_same_on_every_rank(got.top_ids, "top_ids");
      // The same bits again: the merge's order is fixed.
      const StoreAttentionResult again = mpi::attend(queries, part, MPI_COMM_WORLD, valid, options);
      expect_bitwise_equal(again.output, got.output, "output, second run");
      expect_bitwise_equal(again.lse, got.lse, "lse, second run");
      EXPECT_GE(timings.local, 0.0);
      EXPECT_GE(timings.communication, 0.0);
      EXPECT_GE(timings.merge, 0.0);
    }
  }
}

TEST_F(MpiStoreTest, AShardPerRankEqualsTheirConcatenation) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE(seed_note(seed) + " ranks=" + std::to_string(ranks()));
  Rng rng(seed);
  const int64_t d = 12, dv = 5, nq = 6;
  // Every rank draws every shard's rows (same seed), makes its own shard, and
  // holds the whole key set to compare with. Rank 1's shard is empty when
  // there are 3 or more ranks: a rank with no rows.
  std::vector<int64_t> sizes;
  for (int r = 0; r < ranks(); ++r)
    sizes.push_back(r == 1 && ranks() >= 3 ? 0 : rng.uniform_int(1, 400));
  const int64_t n = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d}, -2, 2);
  const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
  const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d}, -2, 2);
  Tensor<int64_t> per_query(Shape{nq});
  for (int64_t i = 0; i < nq; ++i) per_query(i) = rng.uniform_int(0, n);
  const int64_t first = std::accumulate(sizes.begin(), sizes.begin() + rank_of(), int64_t{0});
  const int64_t mine = sizes[static_cast<size_t>(rank_of())];
  const KeyValueStore shard =
      KeyValueStore::create(path("shard" + std::to_string(rank_of())), rows_of(keys, first, mine),
                            rows_of(values, first, mine), StoreDtype::kFloat32, 64);
  const KeyValueStore all = shared_store("all", keys, values, 100);
  std::vector<KeyValueStore> shards;
  for (int r = 0; r < ranks(); ++r)
    shards.push_back(KeyValueStore::open(path("shard" + std::to_string(r))));
  std::vector<const ChunkSource*> list;
  for (const KeyValueStore& s : shards) list.push_back(&s);
  for (const ValidLens& valid : {ValidLens(), ValidLens(per_query)}) {
    StoreAttentionOptions options;
    options.top_k = std::min<int64_t>(n, 4);
    const StoreAttentionResult got =
        mpi::attend(queries, mpi::whole(shard), MPI_COMM_WORLD, valid, options);
    const StoreAttentionResult want = attend(queries, all, valid, options);
    const StoreAttentionResult listed = attend(queries, list, valid, options);
    expect_close(got.output, want.output, kSdpa, "output");
    expect_close(got.lse, want.lse, kSdpaLse, "lse");
    expect_top_close(got, want);
    // The shards in one process (attend over a list) merge in the same
    // order over the same parts: the same bits.
    expect_bitwise_equal(listed.output, got.output, "output of the shards in one process");
    expect_bitwise_equal(listed.lse, got.lse, "lse of the shards in one process");
    expect_bitwise_equal(listed.top_ids, got.top_ids, "top_ids of the shards in one process");
  }
}

TEST_F(MpiStoreTest, BackwardSumsDQueriesAndKeepsEachRanksRows) {
  const uint64_t seed = shared_seed();
  SCOPED_TRACE(seed_note(seed) + " ranks=" + std::to_string(ranks()));
  Rng rng(seed);
  const int64_t n = rng.uniform_int(50, 700), d = 8, dv = 6, nq = 5;
  const Tensor<float> keys = random_tensor<float>(rng, Shape{n, d});
  const Tensor<float> values = random_tensor<float>(rng, Shape{n, dv});
  const Tensor<float> queries = random_tensor<float>(rng, Shape{nq, d});
  const Tensor<float> d_output = random_tensor<float>(rng, Shape{nq, dv});
  Tensor<int64_t> lens(Shape{nq});
  for (int64_t i = 0; i < nq; ++i) lens(i) = rng.uniform_int(0, n);
  const KeyValueStore store = shared_store("s", keys, values, 37);
  const mpi::StorePart part = mpi::share_of_chunks(store, rank_of(), ranks());
  const StoreAttentionResult forward = mpi::attend(queries, part, MPI_COMM_WORLD, ValidLens(lens));
  const StoreAttentionGrads got =
      mpi::attend_backward(queries, part, MPI_COMM_WORLD, ValidLens(lens), {},
                           {forward.output.view(), forward.lse.view()}, d_output);
  const StoreAttentionGrads want = attend_backward(
      queries, store, ValidLens(lens), {}, {forward.output.view(), forward.lse.view()}, d_output);
  expect_close(got.d_queries, want.d_queries, kSdpaBackward, "d_queries");
  expect_same_on_every_rank(got.d_queries, "d_queries");
  const int64_t first =
      part.first_chunk < part.last_chunk ? store.chunks()[part.first_chunk].first_row : 0;
  const int64_t rows = got.d_keys.size(0);
  int64_t expected_rows = 0;
  for (size_t c = part.first_chunk; c < part.last_chunk; ++c)
    expected_rows += store.chunks()[c].rows;
  ASSERT_EQ(rows, expected_rows);
  ASSERT_EQ(got.d_values.size(0), expected_rows);
  expect_close(got.d_keys, rows_of(want.d_keys, first, rows), kSdpaBackward, "d_keys");
  expect_close(got.d_values, rows_of(want.d_values, first, rows), kSdpaBackward, "d_values");
}

TEST_F(MpiStoreTest, AFailingRankMakesEveryRankThrow) {
  const Tensor<float> keys(Shape{40, 4}, 0.5f), values(Shape{40, 2}, 1.0f);
  const Tensor<float> queries(Shape{2, 4}, 1.0f);
  const int last = ranks() - 1;
  // The last rank's shard is damaged after it was opened: its chunk fails
  // when mapped, and every rank hears of it.
  const KeyValueStore shard = KeyValueStore::create(path("shard" + std::to_string(rank_of())), keys,
                                                    values, StoreDtype::kFloat32, 10);
  const std::string damaged =
      path("shard" + std::to_string(last)) + "/" + shard.chunks()[2].keys_file;
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank_of() == last) fs::resize_file(damaged, 100);
  MPI_Barrier(MPI_COMM_WORLD);
  expect_error(
      [&] { mpi::attend(queries, mpi::whole(shard), MPI_COMM_WORLD); },
      {"qkv::mpi::attend", "rank " + std::to_string(last) + " of " + std::to_string(ranks()),
       damaged, "truncated"});
  // Shards that disagree on D: every rank names the first that differs.
  const KeyValueStore other = KeyValueStore::create(
      path("other" + std::to_string(rank_of())), Tensor<float>(Shape{3, rank_of() == last ? 5 : 4}),
      Tensor<float>(Shape{3, 2}));
  const Tensor<float> q(Shape{2, other.key_dim()});
  if (ranks() > 1) {
    expect_error([&] { mpi::attend(q, mpi::whole(other), MPI_COMM_WORLD); },
                 {"qkv::mpi::attend", "rank " + std::to_string(last) + "'s store has D = 5"});
  }
  // Bad arguments fail alike everywhere.
  StoreAttentionOptions options;
  options.top_k = 40 * ranks() + 1;
  const KeyValueStore good =
      KeyValueStore::create(path("good" + std::to_string(rank_of())), keys, values);
  const std::string message =
      expect_error([&] { mpi::attend(queries, mpi::whole(good), MPI_COMM_WORLD, {}, options); },
                   {"qkv::mpi::attend", "top_k = " + std::to_string(40 * ranks() + 1)});
  // The function is named once ("qkv::mpi::attend: rank 0 of 2: qkv::mpi::attend:
  // top_k = ..." named it twice).
  EXPECT_EQ(message.find("qkv::mpi::attend"), message.rfind("qkv::mpi::attend")) << message;
  expect_error([&] { mpi::share_of_chunks(good, ranks(), ranks()); }, {"share_of_chunks"});
  // And the communicator still works afterwards.
  const StoreAttentionResult fine = mpi::attend(queries, mpi::whole(good), MPI_COMM_WORLD);
  EXPECT_NEAR(fine.output(0, 1), 1.0f, 1e-6);
}

}  // namespace
}  // namespace qkv::test

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  testing::InitGoogleTest(&argc, argv);
  qkv::set_simd_target_from_env();
  const int status = RUN_ALL_TESTS();
  // A failure on any rank fails the run on every rank.
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
