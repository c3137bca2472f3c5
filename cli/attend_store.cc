// `qkv attend --store` (cli/attend_store.h): queries (Nq, D) over one store
// or shard stores; under mpirun, each rank attends over its part and rank 0
// merges and writes (qkv/mpi.h). With --index, through an index of each
// store (qkv/index.h; shard stores' results merged, in one process or at
// rank 0), and a summary of the certificates on stderr.
#include "attend_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <type_traits>

#include "common.h"
#include "progress.h"
#include "qkv/index.h"
#include "qkv/kernel_regression.h"
#include "qkv/npy.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#ifdef QKV_WITH_MPI
#include "qkv/mpi.h"
#endif

namespace qkv::cli {
namespace {

std::vector<std::pair<std::string, std::string>> output_paths(const StoreAttendArgs& args) {
  std::vector<std::pair<std::string, std::string>> outputs{{"--out", args.out}};
  if (!args.lse.empty()) outputs.emplace_back("--lse", args.lse);
  if (!args.top_ids.empty()) outputs.emplace_back("--top-ids", args.top_ids);
  if (!args.top_weights.empty()) outputs.emplace_back("--top-weights", args.top_weights);
  if (!args.certificate.empty()) outputs.emplace_back("--certificate", args.certificate);
  return outputs;
}

// Checks that no output is one of an input store's files (the manifest, a
// chunk, the lock), or of the index's, however its path is spelled: both are
// compared with `..`, `.` and symbolic links resolved. Writing an output over
// a store's manifest would leave a store that no longer opens.
void check_outputs_outside_stores(const StoreAttendArgs& args) {
  std::vector<InputDirectory> inputs;
  for (const std::string& dir : args.stores) inputs.push_back({"--store", dir, "store"});
  for (const std::string& dir : args.indexes) inputs.push_back({"--index", dir, "index"});
  check_outputs_outside(output_paths(args), inputs);
}

// A store given twice (however spelled: "..", a link) would count its rows
// twice, silently: every weight halved against the rows' own.
void check_stores_distinct(const StoreAttendArgs& args) {
  namespace fs = std::filesystem;
  std::vector<fs::path> seen;
  for (size_t i = 0; i < args.stores.size(); ++i) {
    std::error_code error;
    fs::path store = fs::weakly_canonical(args.stores[i], error);
    if (error) store = args.stores[i];  // opening it names what is wrong
    const auto same = std::find(seen.begin(), seen.end(), store);
    if (same != seen.end()) {
      throw UsageError("--store " + args.stores[i] + " is --store " +
                       args.stores[static_cast<size_t>(same - seen.begin())] +
                       " again; each store's rows count once (give each store once)");
    }
    seen.push_back(store);
  }
}

// The outputs of attention over a store or through an index (whose result
// has the same members, and a certificate).
template <class Result>
std::vector<OutputFile> output_files(const StoreAttendArgs& args, const Result& r) {
  if (args.scoring == Scoring::kDistance) {
    check_distance_overflow(r.output.data(), r.output.numel(), r.output.size(1), args.scale_option);
  }
  std::vector<OutputFile> files;
  files.push_back({"--out", args.out, npy_bytes(r.output.view())});
  if (!args.lse.empty()) files.push_back({"--lse", args.lse, npy_bytes(r.lse.view())});
  if (!args.top_ids.empty())
    files.push_back({"--top-ids", args.top_ids, npy_bytes(r.top_ids.view())});
  if (!args.top_weights.empty()) {
    files.push_back({"--top-weights", args.top_weights, npy_bytes(r.top_weights.view())});
  }
  if constexpr (std::is_same_v<Result, IndexAttentionResult>) {
    if (!args.certificate.empty()) {
      files.push_back({"--certificate", args.certificate, npy_bytes(r.certificate.view())});
    }
  }
  return files;
}

// The queries (Nq, D) as float32, and the valid rows as int64 in the file's
// shape (checked against the queries as the command checks lengths).
struct Inputs {
  Tensor<float> queries;
  Tensor<int64_t> valid_rows;  // empty: every row
};

Inputs read_inputs(const StoreAttendArgs& args) {
  const Input queries_input{"--queries", args.queries};
  const FloatTensor read = load_float(queries_input);
  const Shape q_shape = shape_of(read);
  if (q_shape.rank() != 2) {
    throw UsageError(queries_input.describe() + " has shape " + q_shape.str() +
                     "; with --store, expected 2-D (Nq, D)");
  }
  Inputs in{Tensor<float>(q_shape), {}};
  std::visit(
      [&](const auto& t) {
        for (int64_t i = 0; i < t.numel(); ++i)
          in.queries.data()[i] = static_cast<float>(t.data()[i]);
      },
      read);
  if (!args.valid_lens.empty()) {
    LensTensor lens;
    read_valid_lens(args.valid_lens, queries_input, q_shape, lens);  // the command's shape checks
    std::visit(
        [&](const auto& t) {
          in.valid_rows = Tensor<int64_t>(t.shape());
          for (int64_t i = 0; i < t.numel(); ++i) in.valid_rows.data()[i] = t.data()[i];
        },
        lens);
  }
  return in;
}

ValidLens valid_rows_of(const Inputs& in) {
  return in.valid_rows.empty() ? ValidLens() : ValidLens(in.valid_rows.view());
}

StoreAttentionOptions options_of(const StoreAttendArgs& args) {
  StoreAttentionOptions options;
  options.scoring = args.scoring;
  options.scale = args.scale;
  options.top_k = args.top_k;
  return options;
}

void run_single(const StoreAttendArgs& args) {
  check_output_paths(output_paths(args));
  check_outputs_outside_stores(args);
  apply_threads(args.threads);
  // Manifests and each chunk file's size and header now; the checksums are
  // `qkv store verify`'s (reading every chunk twice would double the work).
  std::vector<KeyValueStore> stores;
  for (const std::string& dir : args.stores) {
    stores.push_back(KeyValueStore::open(dir, StoreCheck::kStructure));
  }
  const Inputs in = read_inputs(args);
  StoreAttentionOptions options = options_of(args);
  Progress progress("qkv attend --store", args.quiet);
  options.progress = report(progress);
  std::vector<const ChunkSource*> pointers;
  for (const KeyValueStore& store : stores) pointers.push_back(&store);
  const StoreAttentionResult result =
      pointers.size() == 1 ? attend(in.queries.view(), stores[0], valid_rows_of(in), options)
                           : attend(in.queries.view(), pointers, valid_rows_of(in), options);
  progress.finish();
  write_outputs(output_files(args, result));
}

// x with a comma between each three digits of its whole part, and
// `decimals` after the point: 12649 -> "12,649", 41.25 -> "41.2" (1).
std::string grouped(double x, int decimals) {
  const std::string text = format_number(x, ("%." + std::to_string(decimals) + "f").c_str());
  const size_t start = text[0] == '-' ? 1 : 0;
  size_t end = text.find('.');
  if (end == std::string::npos) end = text.size();
  std::string out = text.substr(0, start);
  for (size_t i = start; i < end; ++i) {
    if (i > start && (end - i) % 3 == 0) out += ',';
    out += text[i];
  }
  return out + text.substr(end);
}

// A mean count per query: one decimal below 100, whole above ("41.2",
// "31,208").
std::string mean_count(double x) { return grouped(x, x < 100 ? 1 : 0); }

// The line on stderr after attention through an index (or the shards'
// indexes, holding `all_lists` lists and `all_rows` rows together): the
// largest certificate, the mode, and the lists and rows visited per query.
std::string index_summary(int64_t all_lists, int64_t all_rows, const IndexAttentionOptions& options,
                          const IndexAttentionResult& r) {
  const int64_t nq = r.certificate.numel();
  double largest = 0, lists = 0, rows = 0;
  for (int64_t i = 0; i < nq; ++i) {
    largest = std::max(largest, r.certificate.data()[i]);
    lists += static_cast<double>(r.lists_visited.data()[i]);
    rows += static_cast<double>(r.rows_visited.data()[i]);
  }
  const std::string mode = options.probe > 0 ? "probe " + std::to_string(options.probe)
                                             : "epsilon " + format_number(options.epsilon, "%.1e");
  std::string line = options.kernel != Kernel::kGaussian
                         ? "qkv attend --index: " + std::string(kernel_name(options.kernel)) +
                               " kernel of width " + shortest_number(*options.bandwidth) +
                               ", exact; "
                         : "qkv attend --index: certificate: max " +
                               format_number(largest, "%.1e") + " (" + mode + "); ";
  if (nq == 0) return line + "no queries\n";
  const double n = static_cast<double>(nq);
  line += "visited " + mean_count(lists / n) + " of " + grouped(static_cast<double>(all_lists), 0) +
          " lists, " + mean_count(rows / n) + " of " + grouped(static_cast<double>(all_rows), 0) +
          " rows per query on average";
  if (options.top_k > 0) {
    int64_t certain = 0;
    for (const bool c : r.top_certified) certain += c;
    line += "; top " + std::to_string(options.top_k) + " certain for " + std::to_string(certain) +
            " of " + std::to_string(nq) + " queries";
  }
  return line + "\n";
}

IndexAttentionOptions index_options_of(const StoreAttendArgs& args) {
  IndexAttentionOptions options;
  options.scoring = args.scoring;
  options.scale = args.scale;
  options.top_k = args.top_k;
  if (args.epsilon) options.epsilon = *args.epsilon;
  if (args.probe) options.probe = *args.probe;
  if (args.kernel) {
    options.kernel = *args.kernel;
    options.bandwidth = args.bandwidth;
  }
  return options;
}

// The index of `dir`, checked to be built over the store of `store_dir` as
// it is now.
StoreIndex open_index_of(const std::string& store_dir, const std::string& dir) {
  const KeyValueStore store = KeyValueStore::open(store_dir, StoreCheck::kStructure);
  StoreIndex index = StoreIndex::open(dir, StoreCheck::kStructure);
  index.check_built_over(store);
  return index;
}

void print_summary(const std::string& line) {
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

// Attention through the index of each store (attend.cc has refused --index
// with valid rows, or with another count than of --store): one store's, or
// the shards' merged in their order (as mpirun's ranks merge them).
void run_index(const StoreAttendArgs& args) {
  check_output_paths(output_paths(args));
  check_outputs_outside_stores(args);
  apply_threads(args.threads);
  std::vector<StoreIndex> indexes;
  for (size_t s = 0; s < args.stores.size(); ++s) {
    indexes.push_back(open_index_of(args.stores[s], args.indexes.at(s)));
  }
  const Inputs in = read_inputs(args);
  IndexAttentionOptions options = index_options_of(args);
  Progress progress("qkv attend --index", args.quiet, "queries");
  options.progress = report(progress);
  std::vector<const StoreIndex*> pointers;
  int64_t all_lists = 0, all_rows = 0;
  for (const StoreIndex& index : indexes) {
    pointers.push_back(&index);
    all_lists += static_cast<int64_t>(index.lists().size());
    all_rows += index.rows();
  }
  const IndexAttentionResult result = pointers.size() == 1
                                          ? attend(in.queries.view(), indexes[0], options)
                                          : attend(in.queries.view(), pointers, options);
  progress.finish();
  write_outputs(output_files(args, result));
  if (!args.quiet) print_summary(index_summary(all_lists, all_rows, options, result));
}

#ifdef QKV_WITH_MPI
// MPI_Init and MPI_Finalize around one command; only the main thread calls
// MPI (OpenMP threads compute inside each rank).
class MpiSession {
 public:
  MpiSession() {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  ~MpiSession() { MPI_Finalize(); }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

// run_mpi's work up to the last agreement of the ranks: the merged result,
// on every rank.
StoreAttentionResult attend_mpi(const StoreAttendArgs& args, MPI_Comm comm, int rank, int ranks) {
  constexpr const char* kFn = "";  // "qkv attend: error: rank r of R: ..."
  if (args.stores.size() != 1 && args.stores.size() != static_cast<size_t>(ranks)) {
    throw UsageError(std::to_string(args.stores.size()) + " --store shards for " +
                     std::to_string(ranks) +
                     " ranks; give one store (every rank reads its "
                     "share of the chunks) or one shard store per rank");
  }
  mpi::all_or_none(kFn, comm, [&] {
    if (rank == 0) {
      check_output_paths(output_paths(args));
      check_outputs_outside_stores(args);
    }
    apply_threads(args.threads);
  });
  // One store: every rank opens it and takes a share of its chunks. Shards:
  // rank r opens only the r-th.
  std::unique_ptr<KeyValueStore> store;
  mpi::all_or_none(kFn, comm, [&] {
    const std::string& dir =
        args.stores.size() == 1 ? args.stores[0] : args.stores[static_cast<size_t>(rank)];
    store = std::make_unique<KeyValueStore>(KeyValueStore::open(dir, StoreCheck::kStructure));
  });
  const mpi::StorePart part =
      args.stores.size() == 1 ? mpi::share_of_chunks(*store, rank, ranks) : mpi::whole(*store);
  Inputs in;
  mpi::all_or_none(kFn, comm, [&] {
    if (rank == 0) in = read_inputs(args);
  });
  mpi::broadcast(in.queries, comm);
  if (!args.valid_lens.empty()) mpi::broadcast(in.valid_rows, comm);

  StoreAttentionOptions options = options_of(args);
  Progress progress("qkv attend --store (rank 0's part)", args.quiet || rank != 0);
  options.progress = report(progress);
  const StoreAttentionResult result =
      mpi::attend(in.queries.view(), part, comm, valid_rows_of(in), options);
  progress.finish();
  // Every rank is still there: only then does rank 0 write (a rank that died
  // meanwhile ends the job before any output exists).
  mpi::all_or_none(kFn, comm, [] {});
  return result;
}

// attend_mpi's counterpart through an index per rank: rank r opens the r-th
// store and the r-th index, checks that the one was built over the other,
// and attends through it; the summary line's counts are over every rank.
struct IndexRun {
  IndexAttentionResult result;
  int64_t all_lists = 0, all_rows = 0;
};

IndexRun attend_index_mpi(const StoreAttendArgs& args, MPI_Comm comm, int rank, int ranks) {
  constexpr const char* kFn = "";  // "qkv attend: error: rank r of R: ..."
  if (args.stores.size() != static_cast<size_t>(ranks)) {
    throw UsageError(std::to_string(args.stores.size()) + " --store and --index for " +
                     std::to_string(ranks) +
                     " ranks; with --index, mpirun takes one shard store and its index per rank "
                     "(rank r attends through --index I_r over --store S_r)");
  }
  mpi::all_or_none(kFn, comm, [&] {
    if (rank == 0) {
      check_output_paths(output_paths(args));
      check_outputs_outside_stores(args);
    }
    apply_threads(args.threads);
  });
  std::unique_ptr<StoreIndex> index;
  mpi::all_or_none(kFn, comm, [&] {
    const auto r = static_cast<size_t>(rank);
    index = std::make_unique<StoreIndex>(open_index_of(args.stores[r], args.indexes.at(r)));
  });
  Inputs in;
  mpi::all_or_none(kFn, comm, [&] {
    if (rank == 0) in = read_inputs(args);
  });
  mpi::broadcast(in.queries, comm);

  IndexRun run;
  IndexAttentionOptions options = index_options_of(args);
  Progress progress("qkv attend --index (rank 0's part)", args.quiet || rank != 0, "queries");
  options.progress = report(progress);
  run.result = mpi::attend(in.queries.view(), *index, comm, options);
  progress.finish();
  const int64_t mine[2] = {static_cast<int64_t>(index->lists().size()), index->rows()};
  int64_t all[2] = {0, 0};
  MPI_Allreduce(mine, all, 2, MPI_INT64_T, MPI_SUM, comm);
  run.all_lists = all[0];
  run.all_rows = all[1];
  // Every rank is still there: only then does rank 0 write.
  mpi::all_or_none(kFn, comm, [] {});
  return run;
}

void run_mpi(const StoreAttendArgs& args) {
  const MpiSession session;
  MPI_Comm comm = MPI_COMM_WORLD;
  int rank = 0, ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  // Every rank fails alike (all_or_none), and rank 0 tells: the others'
  // stderr would repeat the same message R times.
  if (rank != 0) {
    const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null >= 0) {
      ::dup2(null, STDERR_FILENO);
      ::close(null);
    }
  }
  // Every error up to the last agreement is every rank's (all_or_none, or
  // the same arguments): rank 0 prints it, and only then do the ranks leave.
  // mpirun ends the job when the first rank exits with a failure, and rank
  // 1 leaving first took rank 0 down before its message was written (seen on
  // a loaded machine). A failure of rank 0's write alone is past this point.
  StoreAttentionResult result;
  IndexRun run;
  try {
    if (args.indexes.empty()) {
      result = attend_mpi(args, comm, rank, ranks);
    } else {
      run = attend_index_mpi(args, comm, rank, ranks);
    }
  } catch (...) {
    const int status = report_error("attend");
    MPI_Barrier(comm);
    throw ReportedError{status};
  }
  if (rank != 0) return;
  if (args.indexes.empty()) {
    write_outputs(output_files(args, result));
  } else {
    write_outputs(output_files(args, run.result));
    if (!args.quiet) {
      print_summary(index_summary(run.all_lists, run.all_rows, index_options_of(args), run.result));
    }
  }
}

#endif

}  // namespace

bool started_by_mpirun() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

void run_store_attend(const StoreAttendArgs& args) {
  check_stores_distinct(args);
  // Stores hold float32 or bfloat16, computed in float32.
  if (args.scoring == Scoring::kDistance && args.scale) {
    check_distance_scale(*args.scale, true, args.scale_option);
  }
#ifdef QKV_WITH_MPI
  if (started_by_mpirun()) return run_mpi(args);
#endif
  if (!args.indexes.empty()) return run_index(args);
  run_single(args);
}

}  // namespace qkv::cli
