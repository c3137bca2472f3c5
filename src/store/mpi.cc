// qkv::mpi (qkv/mpi.h): attention over a store sharded across MPI ranks.
// Each rank runs the public attend() over its part (a ChunkSlice of its
// source's chunks), or through its own index; the parts' results go to
// rank 0 by MPI_Gather, are merged there in rank order by merge_parts
// (fixed: the same bits for any run with the same number of ranks), and go
// back to every rank by MPI_Bcast. Every step that can fail on one rank is
// followed by all_or_none, so no rank waits in a collective for a rank that
// has given up.
#include "qkv/mpi.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "qkv/error.h"

namespace qkv::mpi {
namespace {

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

// Chunks [first, last) of a source as a source of their own, its rows
// numbered from the first chunk's first row.
class ChunkSlice final : public ChunkSource {
 public:
  ChunkSlice(const ChunkSource& source, size_t first, size_t last)
      : source_(source),
        first_(first),
        last_(last),
        first_row_(first < last ? source.chunk_range(first).first_row : 0) {
    for (size_t c = first; c < last; ++c) rows_ += source.chunk_range(c).rows;
  }
  std::string name() const override {
    return source_.name() + " (chunks " + std::to_string(first_) + " to " + std::to_string(last_) +
           ")";
  }
  StoreDtype dtype() const override { return source_.dtype(); }
  int64_t rows() const override { return rows_; }
  int64_t key_dim() const override { return source_.key_dim(); }
  int64_t value_dim() const override { return source_.value_dim(); }
  size_t num_chunks() const override { return last_ - first_; }
  ChunkRange chunk_range(size_t index) const override {
    ChunkRange range = source_.chunk_range(first_ + index);
    range.first_row -= first_row_;
    return range;
  }
  SourceChunk read_chunk(size_t index) const override {
    return source_.read_chunk(first_ + index).renumbered(chunk_range(index).first_row);
  }
  void read_ahead(size_t index) const override { source_.read_ahead(first_ + index); }

 private:
  const ChunkSource& source_;
  size_t first_, last_;
  int64_t first_row_ = 0, rows_ = 0;
};

// What every rank learns about the parts before attending: how many rows
// each rank holds, and how many there are in all.
struct Layout {
  std::vector<int64_t> rows;  // per rank
  int64_t all_rows = 0;
  int64_t first_row = 0;  // this rank's first row in the key set
};

// The layout from every rank's rows, D and Dv (this rank's: `mine`),
// checked: the same D and Dv on every rank (`holder`: what holds the rows,
// "store" or "index"), and top_k against every row.
Layout agree_on_layout(const char* function, MPI_Comm comm, const int64_t (&mine)[3],
                       const std::string& holder, int64_t top_k) {
  const int ranks = size_of(comm), rank = rank_of(comm);
  std::vector<int64_t> all(3 * static_cast<size_t>(ranks));
  MPI_Allgather(mine, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, comm);
  Layout layout;
  for (int r = 0; r < ranks; ++r) {
    if (r == rank) layout.first_row = layout.all_rows;
    layout.rows.push_back(all[3 * r]);
    layout.all_rows += all[3 * r];
  }
  all_or_none(function, comm, [&] {
    for (int r = 1; r < ranks; ++r) {
      if (all[3 * r + 1] != all[1] || all[3 * r + 2] != all[2]) {
        fail(function, "rank " + std::to_string(r) + "'s " + holder +
                           " has D = " + std::to_string(all[3 * r + 1]) +
                           ", Dv = " + std::to_string(all[3 * r + 2]) +
                           " but rank 0's has D = " + std::to_string(all[1]) +
                           ", Dv = " + std::to_string(all[2]) + "; the parts of one key set agree");
      }
    }
    if (top_k < 0 || top_k > layout.all_rows) {
      fail(function, "top_k = " + std::to_string(top_k) + "; expected 0 to the parts' " +
                         std::to_string(layout.all_rows) + " rows");
    }
  });
  return layout;
}

// Checks this rank's part, then agrees on the layout.
Layout layout_of(const char* function, const StorePart& part, MPI_Comm comm,
                 const StoreAttentionOptions& options) {
  int64_t mine[3] = {0, 0, 0};  // rows, D, Dv
  all_or_none(function, comm, [&] {
    if (part.source == nullptr) fail(function, "the part has no store");
    if (part.first_chunk > part.last_chunk || part.last_chunk > part.source->num_chunks()) {
      fail(function, "the part's chunks [" + std::to_string(part.first_chunk) + ", " +
                         std::to_string(part.last_chunk) + ") are not within " +
                         part.source->name() + "'s " + std::to_string(part.source->num_chunks()));
    }
    mine[0] = ChunkSlice(*part.source, part.first_chunk, part.last_chunk).rows();
    mine[1] = part.source->key_dim();
    mine[2] = part.source->value_dim();
  });
  return agree_on_layout(function, comm, mine, "store", options.top_k);
}

// valid_rows as attend() takes it, over every rank's rows, as this rank's:
// (Nq) counts of its own rows each query sees.
Tensor<int64_t> local_valid_rows(const char* function, ConstView<float> queries,
                                 const ValidLens& valid_rows, const Layout& layout, int rank) {
  if (queries.rank() != 2) {
    fail(function, "queries has shape " + queries.shape().str() + "; expected (Nq, D)");
  }
  const int64_t nq = queries.size(0), n = layout.all_rows;
  const ValidLens lens =
      valid_rows.for_batch_of_one(function, "valid_rows", "queries", queries.shape());
  lens.check(function, "the parts' rows", Shape{nq, n}, 1, nq, n);
  Tensor<int64_t> local(Shape{nq});
  for (int64_t i = 0; i < nq; ++i) {
    local(i) = std::clamp<int64_t>(lens(0, i, n) - layout.first_row, 0,
                                   layout.rows[static_cast<size_t>(rank)]);
  }
  return local;
}

// A result as two messages: output (Nq, Dv), lse (Nq) and the top weights
// (Nq, k) as floats, the top ids (Nq, k) apart; a part's fewer top rows
// padded with id -1 and weight 0. (A store's result, or an index's.)
template <class Result>
void pack(const Result& result, int64_t k, float* floats, int64_t* ids) {
  const int64_t nq = result.lse.numel(), dv = result.output.numel() / std::max<int64_t>(nq, 1);
  std::copy_n(result.output.data(), nq * dv, floats);
  std::copy_n(result.lse.data(), nq, floats + nq * dv);
  const int64_t have = k > 0 && result.top_ids.rank() == 2 ? result.top_ids.size(1) : 0;
  for (int64_t i = 0; i < nq && k > 0; ++i) {
    float* weights = floats + nq * (dv + 1) + i * k;
    std::fill(weights, weights + k, 0.0f);
    std::fill(ids + i * k, ids + (i + 1) * k, int64_t{-1});
    if (have == 0) continue;
    std::copy_n(&result.top_weights(i, 0), have, weights);
    std::copy_n(&result.top_ids(i, 0), have, ids + i * k);
  }
}

template <class Result = StoreAttentionResult>
Result unpack(const float* floats, const int64_t* ids, int64_t nq, int64_t dv, int64_t k) {
  Result result;
  result.output = Tensor<float>(Shape{nq, dv});
  result.lse = Tensor<float>(Shape{nq});
  std::copy_n(floats, nq * dv, result.output.data());
  std::copy_n(floats + nq * dv, nq, result.lse.data());
  if (k > 0) {
    result.top_weights = Tensor<float>(Shape{nq, k});
    result.top_ids = Tensor<int64_t>(Shape{nq, k});
    std::copy_n(floats + nq * (dv + 1), nq * k, result.top_weights.data());
    std::copy_n(ids, nq * k, result.top_ids.data());
  }
  return result;
}

// An index's result as three messages: pack's two, the ids after Nq lists
// visited, Nq rows visited and Nq top-certain flags (int64), and the
// certificates (Nq) float64.
void pack(const IndexAttentionResult& result, int64_t k, float* floats, int64_t* ints,
          double* certificates) {
  const int64_t nq = result.lse.numel();
  pack(result, k, floats, ints + 3 * nq);
  std::copy_n(result.lists_visited.data(), nq, ints);
  std::copy_n(result.rows_visited.data(), nq, ints + nq);
  std::copy(result.top_certified.begin(), result.top_certified.end(), ints + 2 * nq);
  std::copy_n(result.certificate.data(), nq, certificates);
}

IndexAttentionResult unpack(const float* floats, const int64_t* ints, const double* certificates,
                            int64_t nq, int64_t dv, int64_t k) {
  IndexAttentionResult result = unpack<IndexAttentionResult>(floats, ints + 3 * nq, nq, dv, k);
  result.lists_visited = Tensor<int64_t>(Shape{nq});
  result.rows_visited = Tensor<int64_t>(Shape{nq});
  result.certificate = Tensor<double>(Shape{nq});
  std::copy_n(ints, nq, result.lists_visited.data());
  std::copy_n(ints + nq, nq, result.rows_visited.data());
  result.top_certified.assign(ints + 2 * nq, ints + 3 * nq);
  std::copy_n(certificates, nq, result.certificate.data());
  return result;
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
  // A rank's own error of this function is named once, by this message.
  const std::string own = std::string(function) + ": ";
  if (message.rfind(own, 0) == 0) message.erase(0, own.size());
  const std::string text =
      "rank " + std::to_string(first) + " of " + std::to_string(ranks) + ": " + message;
  if (header[1] != 0) fail_io(function, text);
  fail(function, text);
}

}  // namespace detail

StorePart whole(const ChunkSource& store) { return StorePart{&store, 0, store.num_chunks()}; }

StorePart share_of_chunks(const ChunkSource& store, int rank, int ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    fail("qkv::mpi::share_of_chunks", "rank " + std::to_string(rank) + " of " +
                                          std::to_string(ranks) + "; expected 0 <= rank < ranks");
  }
  const size_t chunks = store.num_chunks();
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
  const Layout layout = layout_of(kFn, part, comm, options);
  const int64_t k = options.top_k, dv = part.source->value_dim();
  StoreAttentionResult local;
  {
    const Stopwatch watch(&time.local);
    all_or_none(kFn, comm, [&] {
      const Tensor<int64_t> lens = local_valid_rows(kFn, queries, valid_rows, layout, rank);
      StoreAttentionOptions mine = options;
      mine.top_k = std::min(k, layout.rows[static_cast<size_t>(rank)]);
      local = qkv::attend(queries, ChunkSlice(*part.source, part.first_chunk, part.last_chunk),
                          ValidLens(lens), mine);
    });
  }
  // One message per rank (pack); rank 0 merges them in rank order and
  // sends the merged result back in the same layout.
  const int64_t nq = queries.size(0);
  const size_t floats = static_cast<size_t>(nq * (dv + 1 + k)), ids = static_cast<size_t>(nq * k);
  std::vector<float> send(floats);
  std::vector<int64_t> send_ids(ids, -1);
  pack(local, k, send.data(), send_ids.data());
  std::vector<float> gathered(rank == 0 ? floats * static_cast<size_t>(ranks) : 0);
  std::vector<int64_t> gathered_ids(rank == 0 ? ids * static_cast<size_t>(ranks) : 0);
  {
    const Stopwatch watch(&time.communication);
    MPI_Gather(send.data(), static_cast<int>(floats), MPI_FLOAT, gathered.data(),
               static_cast<int>(floats), MPI_FLOAT, 0, comm);
    if (k > 0) {
      MPI_Gather(send_ids.data(), static_cast<int>(ids), MPI_INT64_T, gathered_ids.data(),
                 static_cast<int>(ids), MPI_INT64_T, 0, comm);
    }
  }
  if (rank == 0) {
    const Stopwatch watch(&time.merge);
    std::vector<StoreAttentionResult> parts;
    for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
      parts.push_back(
          unpack(gathered.data() + floats * r, gathered_ids.data() + ids * r, nq, dv, k));
    }
    pack(merge_parts(parts, layout.rows, k), k, send.data(), send_ids.data());
  }
  {
    const Stopwatch watch(&time.communication);
    MPI_Bcast(send.data(), static_cast<int>(floats), MPI_FLOAT, 0, comm);
    if (k > 0) MPI_Bcast(send_ids.data(), static_cast<int>(ids), MPI_INT64_T, 0, comm);
  }
  if (timings) *timings = time;
  return unpack(send.data(), send_ids.data(), nq, dv, k);
}

IndexAttentionResult attend(ConstView<float> queries, const StoreIndex& index, MPI_Comm comm,
                            const IndexAttentionOptions& options, Timings* timings) {
  constexpr const char* kFn = "qkv::mpi::attend";
  const int ranks = size_of(comm), rank = rank_of(comm);
  Timings time;
  const int64_t mine[3] = {index.rows(), index.key_dim(), index.value_dim()};
  const Layout layout = agree_on_layout(kFn, comm, mine, "index", options.top_k);
  const int64_t k = options.top_k, dv = index.value_dim();
  IndexAttentionResult local;
  {
    const Stopwatch watch(&time.local);
    all_or_none(kFn, comm, [&] {
      IndexAttentionOptions own = options;
      own.top_k = std::min(k, layout.rows[static_cast<size_t>(rank)]);
      local = qkv::attend(queries, index, own);
    });
  }
  // One result per rank (pack); rank 0 merges them in rank order and sends
  // the merged result back in the same layout.
  const int64_t nq = queries.size(0);
  const size_t floats = static_cast<size_t>(nq * (dv + 1 + k)),
               ints = static_cast<size_t>(nq * (3 + k)), doubles = static_cast<size_t>(nq);
  std::vector<float> send(floats);
  std::vector<int64_t> send_ints(ints, -1);
  std::vector<double> send_doubles(doubles);
  pack(local, k, send.data(), send_ints.data(), send_doubles.data());
  const size_t gathering = rank == 0 ? static_cast<size_t>(ranks) : 0;
  std::vector<float> gathered(floats * gathering);
  std::vector<int64_t> gathered_ints(ints * gathering);
  std::vector<double> gathered_doubles(doubles * gathering);
  {
    const Stopwatch watch(&time.communication);
    MPI_Gather(send.data(), static_cast<int>(floats), MPI_FLOAT, gathered.data(),
               static_cast<int>(floats), MPI_FLOAT, 0, comm);
    MPI_Gather(send_ints.data(), static_cast<int>(ints), MPI_INT64_T, gathered_ints.data(),
               static_cast<int>(ints), MPI_INT64_T, 0, comm);
    MPI_Gather(send_doubles.data(), static_cast<int>(doubles), MPI_DOUBLE, gathered_doubles.data(),
               static_cast<int>(doubles), MPI_DOUBLE, 0, comm);
  }
  if (rank == 0) {
    const Stopwatch watch(&time.merge);
    std::vector<IndexAttentionResult> parts;
    for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
      parts.push_back(unpack(gathered.data() + floats * r, gathered_ints.data() + ints * r,
                             gathered_doubles.data() + doubles * r, nq, dv, k));
    }
    pack(merge_parts(parts, layout.rows, k), k, send.data(), send_ints.data(), send_doubles.data());
  }
  {
    const Stopwatch watch(&time.communication);
    MPI_Bcast(send.data(), static_cast<int>(floats), MPI_FLOAT, 0, comm);
    MPI_Bcast(send_ints.data(), static_cast<int>(ints), MPI_INT64_T, 0, comm);
    MPI_Bcast(send_doubles.data(), static_cast<int>(doubles), MPI_DOUBLE, 0, comm);
  }
  if (timings) *timings = time;
  return unpack(send.data(), send_ints.data(), send_doubles.data(), nq, dv, k);
}

StoreAttentionGrads attend_backward(ConstView<float> queries, const StorePart& part, MPI_Comm comm,
                                    const ValidLens& valid_rows,
                                    const StoreAttentionOptions& options,
                                    const SavedForward<float>& saved, ConstView<float> d_output,
                                    Timings* timings) {
  constexpr const char* kFn = "qkv::mpi::attend_backward";
  const int ranks = size_of(comm), rank = rank_of(comm);
  Timings time;
  const Layout layout = layout_of(kFn, part, comm, options);
  StoreAttentionGrads local;
  {
    const Stopwatch watch(&time.local);
    all_or_none(kFn, comm, [&] {
      const Tensor<int64_t> lens = local_valid_rows(kFn, queries, valid_rows, layout, rank);
      local =
          qkv::attend_backward(queries, ChunkSlice(*part.source, part.first_chunk, part.last_chunk),
                               ValidLens(lens), options, saved, d_output);
    });
  }
  // dQ: the ranks' shares summed at rank 0 in rank order, in double, then to every rank.
  const int64_t count = local.d_queries.numel();
  std::vector<float> gathered(rank == 0 ? static_cast<size_t>(count * ranks) : 0);
  std::vector<double> d_queries(static_cast<size_t>(count));
  {
    const Stopwatch watch(&time.communication);
    MPI_Gather(local.d_queries.data(), static_cast<int>(count), MPI_FLOAT, gathered.data(),
               static_cast<int>(count), MPI_FLOAT, 0, comm);
  }
  if (rank == 0) {
    const Stopwatch watch(&time.merge);
    for (int r = 0; r < ranks; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        d_queries[static_cast<size_t>(i)] += gathered[static_cast<size_t>(r * count + i)];
      }
    }
  }
  {
    const Stopwatch watch(&time.communication);
    MPI_Bcast(d_queries.data(), static_cast<int>(count), MPI_DOUBLE, 0, comm);
  }
  for (int64_t i = 0; i < count; ++i) {
    local.d_queries.data()[i] = static_cast<float>(d_queries[static_cast<size_t>(i)]);
  }
  if (timings) *timings = time;
  return local;
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
