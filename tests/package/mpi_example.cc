// A consumer of the installed qkv::mpi: rank 0 makes a store of 10 rows (all
// keys equal, so the weights are uniform; values 0..9), every rank attends
// over its share of the chunks, and rank 0 prints the merged output, the
// mean of the values: 4.5.
#include <qkv/mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const std::string dir = std::string(argc > 1 ? argv[1] : ".") + "/example.qkv";
  if (rank == 0) {
    qkv::Tensor<float> keys({10, 2}, 1.0f), values({10, 1});
    for (int i = 0; i < 10; ++i) values(i, 0) = static_cast<float>(i);
    qkv::KeyValueStore::create(dir, keys, values, qkv::StoreDtype::kFloat32, 3);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const qkv::KeyValueStore store = qkv::KeyValueStore::open(dir);
  const qkv::Tensor<float> queries({1, 2}, 0.5f);
  const qkv::StoreAttentionResult result =
      qkv::mpi::attend(queries, qkv::mpi::share_of_chunks(store, rank, ranks), MPI_COMM_WORLD);
  if (rank == 0) std::printf("%g\n", result.output(0, 0));
  MPI_Finalize();
  return 0;
}
