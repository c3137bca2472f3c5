// Attention over one store shared by MPI ranks, timed (docs/scale.md's MPI
// rows; bench/scale.sh runs it as `mpirun -np R bench_scale_mpi STORE Q REPS`).
// Rank 0 prints one JSON object: the medians over REPS calls of the call's
// wall time and of its parts (qkv::mpi::Timings), each part taken as its
// largest over the ranks (the slowest rank sets the pace).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "qkv/mpi.h"
#include "qkv/threads.h"

namespace {

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.size() % 2 ? x[x.size() / 2] : (x[x.size() / 2 - 1] + x[x.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (argc != 4) {
    if (rank == 0) std::fprintf(stderr, "usage: bench_scale_mpi STORE Q REPS\n");
    MPI_Finalize();
    return 2;
  }
  const qkv::KeyValueStore store = qkv::KeyValueStore::open(argv[1], qkv::StoreCheck::kStructure);
  const int64_t nq = std::atoll(argv[2]);
  const int reps = std::max(1, std::atoi(argv[3]));
  qkv::Tensor<float> queries(qkv::Shape{nq, store.key_dim()});
  for (int64_t i = 0; i < queries.numel(); ++i) queries.data()[i] = static_cast<float>((i * 7919) % 1000) / 500 - 1;
  const qkv::mpi::StorePart part = qkv::mpi::share_of_chunks(store, rank, ranks);
  qkv::mpi::attend(queries, part, MPI_COMM_WORLD);  // warm
  std::vector<double> total, local, communication, merge;
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    qkv::mpi::Timings t;
    qkv::mpi::attend(queries, part, MPI_COMM_WORLD, {}, {}, &t);
    const double mine[4] = {MPI_Wtime() - start, t.local, t.communication, t.merge};
    double most[4];
    MPI_Reduce(mine, most, 4, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    total.push_back(most[0]);
    local.push_back(most[1]);
    communication.push_back(most[2]);
    merge.push_back(most[3]);
  }
  if (rank == 0) {
    std::printf(
        "{\"kind\": \"mpi\", \"ranks\": %d, \"threads_per_rank\": %d, \"rows\": %lld, "
        "\"queries\": %lld, \"dim\": %lld, \"chunks\": %zu, \"seconds\": %.6f, \"local\": %.6f, "
        "\"communication\": %.6f, \"merge\": %.6f}\n",
        ranks, qkv::num_threads(), static_cast<long long>(store.rows()), static_cast<long long>(nq),
        static_cast<long long>(store.key_dim()), store.chunks().size(), median(total), median(local),
        median(communication), median(merge));
  }
  MPI_Finalize();
  return 0;
}
