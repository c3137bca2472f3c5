// What the MPI tests share: this rank, the ranks, one seed for all of them
// (rank 0's, so every rank draws the same rows), and a directory every rank
// sees.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

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

// A directory every rank sees (one machine): made by rank 0, removed at
// the end.
class MpiDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char path[4096] = {};
    if (rank_of() == 0) {
      std::string pattern = "/tmp/qkv-mpi-test-XXXXXX";
      ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
      std::snprintf(path, sizeof path, "%s", pattern.c_str());
    }
    MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD);
    root_ = path;
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_of() == 0) std::filesystem::remove_all(root_);
  }
  std::string path(const std::string& name) const {
    return (std::filesystem::path(root_) / name).string();
  }
  std::string root_;
};

}  // namespace qkv::test
