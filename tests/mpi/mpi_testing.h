// What the MPI tests share: this rank, the ranks, and one seed for all of
// them (rank 0's, so every rank draws the same rows).
#pragma once

#include <mpi.h>

#include <cstdint>

#include "test_util.h"

namespace qkv::test {

inline int rank_of() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

inline int ranks() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

inline uint64_t shared_seed() {
  uint64_t seed = test_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

}  // namespace qkv::test
