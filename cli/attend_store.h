// `qkv attend --store`: attention over key-value stores (docs/scale.md), in
// one process, or sharded across MPI ranks when started by mpirun (and
// built with MPI); with --index, through an index of each store
// (qkv/index.h), certified or with a fixed budget, in one process or one
// shard store and its index per MPI rank.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qkv/kernel_regression_types.h"
#include "qkv/scoring.h"

namespace qkv::cli {

struct StoreAttendArgs {
  std::vector<std::string> stores;  // one store, or shard stores in row order
  std::string queries, valid_lens;
  Scoring scoring = Scoring::kDotProduct;  // or kDistance (over_store in qkv/scoring.h)
  std::optional<double> scale;
  std::string scale_option;  // the scale as the user gave it, for messages ("--bandwidth 1e-25")
  int64_t top_k = 0;
  std::string out, lse, top_ids, top_weights;
  bool quiet = false;
  std::optional<int> threads;
  // --index: attention through an index of each store, indexes[s] built
  // over stores[s]. Its checks against the other options (as many indexes
  // as stores) are attend.cc's.
  std::vector<std::string> indexes;
  std::optional<double> epsilon;  // certified: absent is the library's default
  std::optional<int64_t> probe;   // or a fixed budget of lists
  std::string certificate;        // --certificate C.npy: float64 (Nq)
  // --kernel: a compact kernel of width --bandwidth instead of softmax.
  std::optional<Kernel> kernel;
  std::optional<double> bandwidth;
};

void run_store_attend(const StoreAttendArgs& args);

// Whether this process was started by mpirun (OpenMPI's or a PMI launcher's
// environment), so `qkv attend --store` runs as one of its ranks.
bool started_by_mpirun();

}  // namespace qkv::cli
