// qkv::mpi (qkv/mpi.h): attention over a store sharded across MPI ranks.
// Each rank runs the store attention's chunk-range pieces (store_parts.h)
// over its part; the parts' partial results go to rank 0 by MPI_Gather, are
// merged there in rank order (fixed: the same bits for any run with the same
// number of ranks), and go back to every rank by MPI_Bcast. Every step that
// can fail on one rank is followed by all_or_none, so no rank waits in a
// collective for a rank that has given up.
#include "qkv/mpi.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "store/store_parts.h"

namespace qkv::mpi {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

int rank_of(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}
int size_of(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  return size;
}

int64_t rows_of(const StorePart& part) {
  int64_t rows = 0;
  for (size_t c = part.first_chunk; c < part.last_chunk; ++c) rows += part.store->chunks()[c].rows;
  return rows;
}

// What every rank learns about the parts before attending: where each
// rank's rows start in the key set, and how many rows there are in all.
struct Layout {
  std::vector<int64_t> first_row;  // per rank
  int64_t rows = 0;
  int64_t store_first_row = 0;  // this rank's first row in its own store's row ids
  int64_t local_rows = 0;
};

// Checks this rank's part and the queries, and that every rank's store has
// the same D and Dv; then the layout of the rows.
Layout layout_of(const char* function, ConstView<float> queries, const StorePart& part,
                 MPI_Comm comm, const StoreAttentionOptions& options) {
  const int ranks = size_of(comm);
  int64_t mine[3] = {0, 0, 0};  // rows, D, Dv
  all_or_none(function, comm, [&] {
    if (part.store == nullptr) fail(function, "the part has no store");
    if (part.first_chunk > part.last_chunk || part.last_chunk > part.store->chunks().size()) {
      fail(function, "the part's chunks [" + std::to_string(part.first_chunk) + ", " +
                         std::to_string(part.last_chunk) + ") are not within store " +
                         part.store->dir() + "'s " + std::to_string(part.store->chunks().size()));
    }
    qkv::detail::check_store_attention(function, queries, *part.store, options,
                                       std::numeric_limits<int64_t>::max());
    mine[0] = rows_of(part);
    mine[1] = part.store->key_dim();
    mine[2] = part.store->value_dim();
  });
  std::vector<int64_t> all(3 * static_cast<size_t>(ranks));
  MPI_Allgather(mine, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, comm);
  Layout layout;
  for (int r = 0; r < ranks; ++r) {
    layout.first_row.push_back(layout.rows);
    layout.rows += all[3 * r];
  }
  layout.local_rows = mine[0];
  layout.store_first_row =
      part.first_chunk < part.last_chunk ? part.store->chunks()[part.first_chunk].first_row : 0;
  all_or_none(function, comm, [&] {
    for (int r = 1; r < ranks; ++r) {
      if (all[3 * r + 1] != all[1] || all[3 * r + 2] != all[2]) {
        fail(function, "rank " + std::to_string(r) + "'s store has D = " +
                           std::to_string(all[3 * r + 1]) + ", Dv = " + std::to_string(all[3 * r + 2]) +
                           " but rank 0's has D = " + std::to_string(all[1]) + ", Dv = " +
                           std::to_string(all[2]) + "; the parts of one key set agree");
      }
    }
    if (options.top_k > layout.rows) {
      fail(function, "top_k = " + std::to_string(options.top_k) + "; expected 0 to the parts' " +
                         std::to_string(layout.rows) + " rows");
    }
  });
  return layout;
}

// Each query's limit in this rank's store row ids, from its limit in the
// key set's.
std::vector<int64_t> local_limits(const std::vector<int64_t>& global, const Layout& layout,
                                  int rank) {
  std::vector<int64_t> local(global.size());
  for (size_t i = 0; i < global.size(); ++i) {
    local[i] = layout.store_first_row +
               std::clamp<int64_t>(global[i] - layout.first_row[static_cast<size_t>(rank)], 0,
                                   layout.local_rows);
  }
  return local;
}

// A partial as one message: output (Nq, Dv), lse (Nq), and with top_k each
// query's k (log-weight, row id) pairs, padded with (-inf, -1); the
// log-weights among the doubles, the ids apart.
void pack(const qkv::detail::StorePartial& partial, int64_t k, double* doubles, int64_t* ids) {
  const int64_t nq = partial.lse.numel(), dv = partial.output.size(1);
  std::copy_n(partial.output.data(), nq * dv, doubles);
  std::copy_n(partial.lse.data(), nq, doubles + nq * dv);
  for (int64_t i = 0; i < nq && k > 0; ++i) {
    double* weights = doubles + nq * (dv + 1) + i * k;
    std::fill(weights, weights + k, -kInf);
    std::fill(ids + i * k, ids + (i + 1) * k, int64_t{-1});
    const auto& rows = partial.top[static_cast<size_t>(i)];
    for (size_t r = 0; r < rows.size(); ++r) {
      weights[r] = rows[r].first;
      ids[i * k + static_cast<int64_t>(r)] = rows[r].second;
    }
  }
}

qkv::detail::StorePartial unpack(const double* doubles, const int64_t* ids, int64_t nq,
                                 int64_t dv, int64_t k) {
  qkv::detail::StorePartial partial{Tensor<double>(Shape{nq, dv}), Tensor<double>(Shape{nq}),
                                    std::vector<std::vector<qkv::detail::ScoredRow>>(
                                        static_cast<size_t>(k > 0 ? nq : 0))};
  std::copy_n(doubles, nq * dv, partial.output.data());
  std::copy_n(doubles + nq * dv, nq, partial.lse.data());
  for (int64_t i = 0; i < nq && k > 0; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      if (ids[i * k + j] >= 0) {
        partial.top[static_cast<size_t>(i)].push_back({doubles[nq * (dv + 1) + i * k + j], ids[i * k + j]});
      }
    }
  }
  return partial;
}

class Stopwatch {
 public:
  explicit Stopwatch(double* into) : into_(into), start_(MPI_Wtime()) {}
  ~Stopwatch() {
    if (into_) *into_ += MPI_Wtime() - start_;
  }

 private:
  double* into_;
  double start_;
};

}  // namespace

namespace detail {

void agree(const char* function, MPI_Comm comm, const std::string& what, bool io) {
  const int ranks = size_of(comm), rank = rank_of(comm);
  int failed = what.empty() ? ranks : rank, first = ranks;
  MPI_Allreduce(&failed, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == ranks) return;
  // The lowest failing rank's message, to every rank.
  long long header[2] = {static_cast<long long>(what.size()), io ? 1 : 0};
  MPI_Bcast(header, 2, MPI_LONG_LONG, first, comm);
  std::string message = what;
  message.resize(static_cast<size_t>(header[0]));
  MPI_Bcast(message.data(), static_cast<int>(header[0]), MPI_CHAR, first, comm);
  const std::string text = "rank " + std::to_string(first) + " of " + std::to_string(ranks) +
                           ": " + message;
  if (header[1] != 0) fail_io(function, text);
  fail(function, text);
}

}  // namespace detail

StorePart whole(const KeyValueStore& store) { return StorePart{&store, 0, store.chunks().size()}; }

StorePart share_of_chunks(const KeyValueStore& store, int rank, int ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    fail("qkv::mpi::share_of_chunks", "rank " + std::to_string(rank) + " of " +
                                          std::to_string(ranks) + "; expected 0 <= rank < ranks");
  }
  const size_t chunks = store.chunks().size();
  const auto edge = [&](int r) {
    return static_cast<size_t>(static_cast<unsigned long long>(chunks) * static_cast<unsigned>(r) /
                               static_cast<unsigned>(ranks));
  };
  return StorePart{&store, edge(rank), edge(rank + 1)};
}

StoreAttentionResult attend(ConstView<float> queries, const StorePart& part, MPI_Comm comm,
                            const ValidLens& valid_rows, const StoreAttentionOptions& options,
                            Timings* timings) {
  constexpr const char* kFn = "qkv::mpi::attend";
  const int ranks = size_of(comm), rank = rank_of(comm);
  Timings time;
  const Layout layout = layout_of(kFn, queries, part, comm, options);
  std::vector<int64_t> global_rows;
  all_or_none(kFn, comm, [&] { global_rows = qkv::detail::rows_seen(kFn, queries, valid_rows, layout.rows); });
  const int64_t nq = queries.size(0), dv = part.store->value_dim(), k = options.top_k;

  qkv::detail::StorePartial local;
  {
    const Stopwatch watch(&time.local);
    all_or_none(kFn, comm, [&] {
      local = qkv::detail::attend_chunks(queries, *part.store, part.first_chunk, part.last_chunk,
                                         local_limits(global_rows, layout, rank), options);
    });
  }
  qkv::detail::shift_row_ids(local, layout.store_first_row, layout.first_row[static_cast<size_t>(rank)]);

  // One message per rank (pack); rank 0 merges them in rank order into the
  // same layout and sends it back.
  const size_t doubles = static_cast<size_t>(nq * (dv + 1 + k)), ids = static_cast<size_t>(nq * k);
  std::vector<double> send(doubles);
  std::vector<int64_t> send_ids(ids, -1);
  pack(local, k, send.data(), send_ids.data());
  std::vector<double> gathered(rank == 0 ? doubles * static_cast<size_t>(ranks) : 0);
  std::vector<int64_t> gathered_ids(rank == 0 ? ids * static_cast<size_t>(ranks) : 0);
  {
    const Stopwatch watch(&time.communication);
    MPI_Gather(send.data(), static_cast<int>(doubles), MPI_DOUBLE, gathered.data(),
               static_cast<int>(doubles), MPI_DOUBLE, 0, comm);
    if (k > 0) {
      MPI_Gather(send_ids.data(), static_cast<int>(ids), MPI_INT64_T, gathered_ids.data(),
                 static_cast<int>(ids), MPI_INT64_T, 0, comm);
    }
  }
  if (rank == 0) {
    const Stopwatch watch(&time.merge);
    std::vector<qkv::detail::StorePartial> parts;
    for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
      parts.push_back(unpack(gathered.data() + doubles * r, gathered_ids.data() + ids * r, nq, dv, k));
    }
    pack(qkv::detail::merge_partials(parts, k), k, send.data(), send_ids.data());
  }
  {
    const Stopwatch watch(&time.communication);
    MPI_Bcast(send.data(), static_cast<int>(doubles), MPI_DOUBLE, 0, comm);
    if (k > 0) MPI_Bcast(send_ids.data(), static_cast<int>(ids), MPI_INT64_T, 0, comm);
  }
  const qkv::detail::StorePartial merged = unpack(send.data(), send_ids.data(), nq, dv, k);
  if (timings) *timings = time;
  return qkv::detail::finish(merged, k);
}

StoreAttentionGrads attend_backward(ConstView<float> queries, const StorePart& part,
                                    MPI_Comm comm, const ValidLens& valid_rows,
                                    const StoreAttentionOptions& options,
                                    const SavedForward<float>& saved, ConstView<float> d_output,
                                    Timings* timings) {
  constexpr const char* kFn = "qkv::mpi::attend_backward";
  const int ranks = size_of(comm), rank = rank_of(comm);
  Timings time;
  const Layout layout = layout_of(kFn, queries, part, comm, options);
  std::vector<int64_t> global_rows;
  all_or_none(kFn, comm, [&] {
    qkv::detail::check_store_backward(kFn, queries, *part.store, options, saved, d_output);
    global_rows = qkv::detail::rows_seen(kFn, queries, valid_rows, layout.rows);
  });
  qkv::detail::StorePartialGrads local;
  {
    const Stopwatch watch(&time.local);
    all_or_none(kFn, comm, [&] {
      local = qkv::detail::backward_chunks(queries, *part.store, part.first_chunk, part.last_chunk,
                                           local_limits(global_rows, layout, rank), options, saved,
                                           d_output);
    });
  }
  // dQ: the ranks' shares summed at rank 0 in rank order, then to every rank.
  const int64_t count = local.d_queries.numel();
  std::vector<double> gathered(rank == 0 ? static_cast<size_t>(count * ranks) : 0);
  Tensor<double> d_queries(local.d_queries.shape());
  {
    const Stopwatch watch(&time.communication);
    MPI_Gather(local.d_queries.data(), static_cast<int>(count), MPI_DOUBLE, gathered.data(),
               static_cast<int>(count), MPI_DOUBLE, 0, comm);
  }
  if (rank == 0) {
    const Stopwatch watch(&time.merge);
    for (int r = 0; r < ranks; ++r) {
      for (int64_t i = 0; i < count; ++i) d_queries.data()[i] += gathered[static_cast<size_t>(r * count + i)];
    }
  }
  {
    const Stopwatch watch(&time.communication);
    MPI_Bcast(d_queries.data(), static_cast<int>(count), MPI_DOUBLE, 0, comm);
  }
  StoreAttentionGrads grads{Tensor<float>(d_queries.shape()), std::move(local.d_keys),
                            std::move(local.d_values)};
  for (int64_t i = 0; i < count; ++i) grads.d_queries.data()[i] = static_cast<float>(d_queries.data()[i]);
  if (timings) *timings = time;
  return grads;
}

namespace {
template <class T>
void broadcast_tensor(Tensor<T>& tensor, MPI_Comm comm, MPI_Datatype type) {
  int64_t shape[1 + kMaxRank] = {tensor.rank()};
  for (int a = 0; a < tensor.rank(); ++a) shape[1 + a] = tensor.size(a);
  MPI_Bcast(shape, 1 + kMaxRank, MPI_INT64_T, 0, comm);
  if (rank_of(comm) != 0) tensor = Tensor<T>(Shape(shape + 1, shape + 1 + shape[0]));
  // In pieces of at most 2^30 elements: MPI counts are int.
  constexpr int64_t kPiece = int64_t{1} << 30;
  for (int64_t at = 0; at < tensor.numel(); at += kPiece) {
    MPI_Bcast(tensor.data() + at, static_cast<int>(std::min(kPiece, tensor.numel() - at)), type, 0,
              comm);
  }
}
}  // namespace

void broadcast(Tensor<float>& tensor, MPI_Comm comm) { broadcast_tensor(tensor, comm, MPI_FLOAT); }
void broadcast(Tensor<int64_t>& tensor, MPI_Comm comm) {
  broadcast_tensor(tensor, comm, MPI_INT64_T);
}

}  // namespace qkv::mpi
