// `qkv attend --store`: attention over key-value stores (docs/scale.md), in
// one process, or sharded across MPI ranks when started by mpirun (and
// built with MPI).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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
};

void run_store_attend(const StoreAttendArgs& args);

// Whether this process was started by mpirun (OpenMPI's or a PMI launcher's
// environment), so `qkv attend --store` runs as one of its ranks.
bool started_by_mpirun();

}  // namespace qkv::cli
