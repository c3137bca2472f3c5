// The index over a store (qkv/index.h): its k-means build, its files
// (written through StagedFile into a StagedDirectory, XXH3-64 of each formed
// as it is written), open and verify. Attention through it is
// index_attention.cc.
#include "qkv/index.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>

#include "io/npy_header.h"
#include "kernels/runtime/parallel.h"
#include "kernels/simd/block_gemm.h"
#include "qkv/bfloat16.h"
#include "qkv/error.h"
#include "qkv/npy.h"
#include "qkv/staged_file.h"
#include "store/index_manifest.h"
#include "store/manifest_json.h"
#include "store/regular_file.h"
#include "store/scored_rows.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace qkv {

struct StoreIndex::Files {
  MappedFile ids, keys, values;
  size_t ids_offset = 0, keys_offset = 0, values_offset = 0;  // where each file's data starts
};

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kBuildFn = "StoreIndex::build";
constexpr std::string_view kOpenFn = "StoreIndex::open";
constexpr std::string_view kVerifyFn = "StoreIndex::verify";
constexpr std::string_view kUpdateFn = "StoreIndex::update";
constexpr const char* kManifest = "manifest.json";
// The index's files, as kIndexFiles (store/index_manifest.h) lists them.
constexpr const char* kCentroids = kIndexFiles[0];
constexpr const char* kListRows = kIndexFiles[1];
constexpr const char* kRadii = kIndexFiles[2];
constexpr const char* kNorms = kIndexFiles[3];
constexpr const char* kIds = kIndexFiles[4];
constexpr const char* kKeys = kIndexFiles[5];
constexpr const char* kValues = kIndexFiles[6];
constexpr const char* kBoxLow = kIndexFiles[7];
constexpr const char* kBoxHigh = kIndexFiles[8];
constexpr const char* kBlockLow = kIndexFiles[9];
constexpr const char* kBlockHigh = kIndexFiles[10];
// Radii and norms are computed in double from the rows as stored and then
// multiplied by this, so that no key's distance or norm computed again
// (in double, any order of the sum) exceeds them: a sum of D <= 10^5
// squares in double is within D * 2^-53 < 1.2e-11 of its value.
constexpr double kRoundUp = 1.0 + 1e-9;
// Rows assigned to centroids per task: 256 rows x L scores of scratch.
constexpr int64_t kAssignRows = 256;
// Rows written at a time.
constexpr int64_t kWriteRows = 4096;

size_t item_size(StoreDtype dtype) { return dtype == StoreDtype::kFloat32 ? 4 : 2; }
const char* npy_descr(StoreDtype dtype) { return dtype == StoreDtype::kFloat32 ? "<f4" : "<u2"; }

// A fingerprint of a store's first `count` chunks: their rows and checksums.
uint64_t fingerprint(const std::vector<StoreChunk>& chunks, size_t count) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (size_t c = 0; c < count; ++c) {
    const uint64_t words[3] = {static_cast<uint64_t>(chunks[c].rows), chunks[c].keys_xxh3,
                               chunks[c].values_xxh3};
    XXH3_64bits_update(&state, words, sizeof words);
  }
  return XXH3_64bits_digest(&state);
}

// splitmix64: the sample's random numbers (the same seed, the same sample).
struct SplitMix {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
};

// `count` distinct rows of [0, n), ascending, each set of rows equally
// likely (Knuth's selection sampling, Algorithm S).
std::vector<int64_t> sample_rows(int64_t n, int64_t count, uint64_t seed) {
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(count));
  SplitMix random{seed};
  for (int64_t r = 0; r < n && static_cast<int64_t>(rows.size()) < count; ++r) {
    const int64_t needed = count - static_cast<int64_t>(rows.size());
    if (static_cast<double>(n - r) * random.uniform() < static_cast<double>(needed)) {
      rows.push_back(r);
    }
  }
  return rows;
}

// Row `r` of a chunk's keys (or values) as float.
void row_as_float(const SourceChunk& chunk, bool keys, int64_t r, float* out) {
  if (chunk.dtype() == StoreDtype::kFloat32) {
    const ConstView<float> v = keys ? chunk.keys<float>() : chunk.values<float>();
    std::copy_n(&v(r, 0), v.size(1), out);
  } else {
    const ConstView<bfloat16> v = keys ? chunk.keys<bfloat16>() : chunk.values<bfloat16>();
    const bfloat16* row = &v(r, 0);
    for (int64_t d = 0; d < v.size(1); ++d) out[d] = widen(row[d]);
  }
}

// The chunk that holds store row `row`.
size_t chunk_of(const KeyValueStore& store, int64_t row) {
  const std::vector<StoreChunk>& chunks = store.chunks();
  const auto it = std::upper_bound(chunks.begin(), chunks.end(), row,
                                   [](int64_t r, const StoreChunk& c) { return r < c.first_row; });
  return static_cast<size_t>(it - chunks.begin()) - 1;
}

// Each row of x (n, D), centred, to its nearest centroid (L, D), centred:
// the largest x . c - |c|^2 / 2 (distance attention at zero temperature),
// ties to the smaller list. Products in float by qkv's own block kernel
// (the fused SDPA's; kernels/simd/block_gemm.h), which is why both sides
// are centred at the sample's mean: keys far from the origin keep their
// differences. An assignment only decides which list a key joins; the
// lists' radii are computed from the keys as they are, so a rounding that
// picks the second-nearest centroid costs a little speed, never
// correctness.
void assign_nearest(const float* x, int64_t n, const Tensor<float>& centroids,
                    const std::vector<float>& half_norms, int32_t* out) {
  const int64_t lists = centroids.size(0), d = centroids.size(1);
  const int64_t tasks = (n + kAssignRows - 1) / kAssignRows;
  const size_t pack_floats = kernels::fast::block_gemm_scratch_floats(d);
  kernels::parallel_for(tasks, [&](int64_t t) {
    const int64_t r0 = t * kAssignRows, rows = std::min(kAssignRows, n - r0);
    std::vector<float> scores(static_cast<size_t>(rows * lists));
    // The kernel's packing scratch, 64-byte aligned.
    std::vector<float> pack_memory(pack_floats + 16);
    float* pack = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(pack_memory.data()) + 63) &
                                           ~uintptr_t{63});
    kernels::fast::block_scores(rows, lists, d, 1.0f, x + r0 * d, d, centroids.data(), d,
                                scores.data(), lists, pack);
    const float* half = half_norms.data();
    for (int64_t r = 0; r < rows; ++r) {
      const float* s = scores.data() + r * lists;
      int32_t best = 0;
      float best_score = s[0] - half[0];
      for (int64_t j = 1; j < lists; ++j) {
        const float score = s[j] - half[j];
        if (score > best_score) {
          best_score = score;
          best = static_cast<int32_t>(j);
        }
      }
      out[r0 + r] = best;
    }
  });
}

std::vector<float> half_norms_of(const Tensor<float>& centroids) {
  const int64_t lists = centroids.size(0), d = centroids.size(1);
  std::vector<float> half(static_cast<size_t>(lists));
  for (int64_t j = 0; j < lists; ++j) {
    double s = 0.0;
    for (int64_t c = 0; c < d; ++c) s += double{centroids(j, c)} * centroids(j, c);
    half[static_cast<size_t>(j)] = static_cast<float>(0.5 * s);
  }
  return half;
}

// The first centroids, by k-means++ seeding (Arthur and Vassilvitskii,
// 2007) on kSeedRowsPerList x L sample rows drawn at random: each next
// centroid a row drawn with probability proportional to its squared distance
// to the nearest centroid so far, so that every cluster of the keys gets a
// centroid of its own. Rows drawn uniformly left about e^(-L/C) of C
// clusters without one (a quarter at 10^7 keys in 10^4 Gaussians and 12,649
// lists); their keys went to a list between two clusters, whose radius of
// the clusters' distance put a bound near the top for every query, so a
// certified query read a large part of the store (52.7 ms at 10^-3). The
// distances in float, blocks of kSeedBlock rows in parallel, their sums in
// double in block order: the same centroids for any thread count.
constexpr int64_t kSeedRowsPerList = 8;
constexpr int64_t kSeedBlock = 2048;

Tensor<float> seed_centroids(const Tensor<float>& sample, int64_t lists, SplitMix& random) {
  const int64_t n = sample.size(0), d = sample.size(1);
  const int64_t m = std::min(n, kSeedRowsPerList * lists);
  // The m rows: a partial Fisher-Yates shuffle of the sample's.
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  Tensor<float> rows(Shape{m, d});
  for (int64_t i = 0; i < m; ++i) {
    const int64_t pick = i + static_cast<int64_t>(random.next() % static_cast<uint64_t>(n - i));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(pick)]);
    std::copy_n(&sample(order[static_cast<size_t>(i)], 0), d, &rows(i, 0));
  }
  Tensor<float> centroids(Shape{lists, d});
  std::vector<float> nearest(static_cast<size_t>(m), std::numeric_limits<float>::infinity());
  const int64_t blocks = (m + kSeedBlock - 1) / kSeedBlock;
  std::vector<double> block_sums(static_cast<size_t>(blocks));
  int64_t pick = static_cast<int64_t>(random.next() % static_cast<uint64_t>(m));
  for (int64_t j = 0; j < lists; ++j) {
    float* c = &centroids(j, 0);
    std::copy_n(&rows(pick, 0), d, c);
    if (j + 1 == lists) break;
    kernels::parallel_for(blocks, [&](int64_t b) {
      const int64_t r0 = b * kSeedBlock, r1 = std::min(m, r0 + kSeedBlock);
      double sum = 0.0;
      for (int64_t r = r0; r < r1; ++r) {
        // |x - c|^2: the distance score's -|x - c|^2 / 2 times -2 (exact).
        const float squared = -2.0f * raw_score<true>(&rows(r, 0), c, d);
        float& near = nearest[static_cast<size_t>(r)];
        near = std::min(near, squared);
        sum += near;
      }
      block_sums[static_cast<size_t>(b)] = sum;
    });
    const double total = std::accumulate(block_sums.begin(), block_sums.end(), 0.0);
    if (!(total > 0)) {  // every row on a centroid (fewer distinct rows than lists)
      pick = static_cast<int64_t>(random.next() % static_cast<uint64_t>(m));
      continue;
    }
    // The drawn row: the block, then the row, whose running sums pass the
    // target. Where rounding leaves the target past the end, the last row of
    // positive weight (a row of weight 0 holds a centroid already).
    double target = random.uniform() * total;
    int64_t b = 0;
    while (b + 1 < blocks && target >= block_sums[static_cast<size_t>(b)]) {
      target -= block_sums[static_cast<size_t>(b)];
      ++b;
    }
    while (!(block_sums[static_cast<size_t>(b)] > 0)) --b;  // total > 0: one block has weight
    pick = -1;
    for (int64_t r = b * kSeedBlock; r < std::min(m, (b + 1) * kSeedBlock); ++r) {
      if (!(nearest[static_cast<size_t>(r)] > 0)) continue;
      pick = r;
      target -= nearest[static_cast<size_t>(r)];
      if (target < 0) break;
    }
  }
  return centroids;
}

// k-means on the centred sample (S, D): `iterations` rounds from centroids
// seeded by k-means++ (seed_centroids). A list left empty takes half of the
// largest list: its centroid, moved apart from it by a relative 1/1024 (as
// FAISS does).
Tensor<float> train_centroids(const Tensor<float>& sample, int64_t lists, int iterations,
                              uint64_t seed, const std::function<void()>& round_done) {
  const int64_t n = sample.size(0), d = sample.size(1);
  SplitMix random{seed ^ 0x5eed5eed5eed5eedULL};
  Tensor<float> centroids = seed_centroids(sample, lists, random);
  std::vector<int32_t> assigned(static_cast<size_t>(n));
  for (int iteration = 0; iteration < iterations; ++iteration) {
    assign_nearest(sample.data(), n, centroids, half_norms_of(centroids), assigned.data());
    Tensor<double> sums(Shape{lists, d});
    std::vector<int64_t> counts(static_cast<size_t>(lists));
    for (int64_t r = 0; r < n; ++r) {
      const int32_t j = assigned[static_cast<size_t>(r)];
      ++counts[static_cast<size_t>(j)];
      double* sum = sums.data() + j * d;
      const float* x = sample.data() + r * d;
      for (int64_t c = 0; c < d; ++c) sum[c] += x[c];
    }
    for (int64_t j = 0; j < lists; ++j) {
      const double count = static_cast<double>(counts[static_cast<size_t>(j)]);
      if (count > 0) {
        for (int64_t c = 0; c < d; ++c) centroids(j, c) = static_cast<float>(sums(j, c) / count);
      }
    }
    for (int64_t j = 0; j < lists; ++j) {
      if (counts[static_cast<size_t>(j)] > 0) continue;
      const int64_t big = std::max_element(counts.begin(), counts.end()) - counts.begin();
      if (counts[static_cast<size_t>(big)] < 2) break;  // nothing left to split
      for (int64_t c = 0; c < d; ++c) {
        const float x = centroids(big, c);
        const float delta = (c % 2 == 0 ? 1.0f : -1.0f) * std::max(std::abs(x), 1e-6f) / 1024.0f;
        centroids(j, c) = x + delta;
        centroids(big, c) = x - delta;
      }
      counts[static_cast<size_t>(j)] = counts[static_cast<size_t>(big)] / 2;
      counts[static_cast<size_t>(big)] -= counts[static_cast<size_t>(j)];
    }
    round_done();
  }
  return centroids;
}

// A file written through a StagedFile with its XXH3-64 formed on the way.
class HashedFile {
 public:
  HashedFile(std::string_view function, const std::string& dir, const char* name)
      : file_(function, "index file", (fs::path(dir) / name).string()) {
    XXH3_64bits_reset(&state_);
  }
  void write(const void* bytes, size_t size) {
    XXH3_64bits_update(&state_, bytes, size);
    file_.write(std::string_view(static_cast<const char*>(bytes), size));
  }
  void write(const std::string& bytes) { write(bytes.data(), bytes.size()); }
  uint64_t commit() {
    file_.commit();
    return XXH3_64bits_digest(&state_);
  }

 private:
  StagedFile file_;
  XXH3_state_t state_;
};

template <class T>
uint64_t write_array(std::string_view function, const std::string& dir, const char* name,
                     ConstView<T> array) {
  HashedFile file(function, dir, name);
  file.write(npy_bytes(array));
  return file.commit();
}

// Maps one of the index's files and checks its header: `descr`, `shape`.
// Returns the mapped file and sets `offset` to where its data starts.
MappedFile map_index_file(std::string_view function, const std::string& dir, const char* name,
                          std::string_view descr, const Shape& shape, size_t& offset) {
  MappedFile file(function, (fs::path(dir) / name).string());
  offset = checked_npy_header(function, file, descr, shape, "index").data_offset;
  return file;
}

template <class T>
const T* data_of(const MappedFile& file, size_t offset) {
  return reinterpret_cast<const T*>(file.data() + offset);
}

// Which list each store row is in, and each list's rows, radius, largest
// norm and bounding box (each coordinate's least and greatest value over
// its keys; +inf and -inf for an empty list).
struct ListAssignment {
  ListAssignment(int64_t rows, int64_t lists, int64_t d)
      : list_of(static_cast<size_t>(rows)),
        list_rows(static_cast<size_t>(lists)),
        radii(static_cast<size_t>(lists)),
        norms(static_cast<size_t>(lists)),
        box_low(Shape{lists, d}, std::numeric_limits<float>::infinity()),
        box_high(Shape{lists, d}, -std::numeric_limits<float>::infinity()) {}
  std::vector<int32_t> list_of;
  std::vector<int64_t> list_rows;
  std::vector<double> radii, norms;
  Tensor<float> box_low, box_high;
};

// Assigns the rows of `store`'s chunks from `first_chunk` on to their nearest
// centroids (centred at `centre` for the products, as the k-means was), and
// widens their lists' radii and norms, computed in double from the rows as
// stored and the centroids as stored. `report` gets the bytes of rows done.
void assign_rows(const KeyValueStore& store, size_t first_chunk, const Tensor<float>& centroids,
                 const std::vector<double>& centre, ListAssignment& out,
                 const std::function<void(int64_t)>& report) {
  const int64_t lists = centroids.size(0), d = store.key_dim();
  const int64_t row_bytes =
      (d + store.value_dim()) * static_cast<int64_t>(item_size(store.dtype()));
  Tensor<float> centred(Shape{lists, d});
  for (int64_t j = 0; j < lists; ++j) {
    for (int64_t c = 0; c < d; ++c) {
      centred(j, c) = static_cast<float>(double{centroids(j, c)} - centre[static_cast<size_t>(c)]);
    }
  }
  const std::vector<float> half = lists > 0 ? half_norms_of(centred) : std::vector<float>();
  for (size_t c = first_chunk; c < store.num_chunks(); ++c) {
    const SourceChunk chunk = store.read_chunk(c);
    if (c + 1 < store.num_chunks()) store.read_ahead(c + 1);
    const ChunkRange range = chunk.range();
    Tensor<float> rows(Shape{range.rows, d});
    for (int64_t r = 0; r < range.rows; ++r) row_as_float(chunk, true, r, &rows(r, 0));
    Tensor<float> rows_centred = rows;
    for (int64_t r = 0; r < range.rows; ++r) {
      float* row = rows_centred.data() + r * d;
      for (int64_t k = 0; k < d; ++k) row[k] -= static_cast<float>(centre[static_cast<size_t>(k)]);
    }
    int32_t* assigned = out.list_of.data() + range.first_row;
    assign_nearest(rows_centred.data(), range.rows, centred, half, assigned);
    chunk.check_intact();
    for (int64_t r = 0; r < range.rows; ++r) {
      const int32_t j = assigned[r];
      const float* row = rows.data() + r * d;
      const float* centroid = centroids.data() + int64_t{j} * d;
      double distance = 0.0, norm = 0.0;
      for (int64_t k = 0; k < d; ++k) {
        const double x = row[k], diff = x - double{centroid[k]};
        distance += diff * diff;
        norm += x * x;
      }
      const auto list = static_cast<size_t>(j);
      out.radii[list] = std::max(out.radii[list], std::sqrt(distance) * kRoundUp);
      out.norms[list] = std::max(out.norms[list], std::sqrt(norm) * kRoundUp);
      ++out.list_rows[list];
      float* low = &out.box_low(j, 0);
      float* high = &out.box_high(j, 0);
      for (int64_t k = 0; k < d; ++k) {
        low[k] = std::min(low[k], row[k]);
        high[k] = std::max(high[k], row[k]);
      }
    }
    report(range.rows * row_bytes);
  }
}

// Writes an index of every row of `store` into the directory `temp`: its
// files, rows in list order (each list's rows in store order, keys and
// values copied as stored: a bfloat16 store's bits stay as they are), and
// the manifest, `manifest`'s build options with the sizes and checksums
// filled in. `report` gets the bytes of rows written.
void write_index(std::string_view function, const std::string& temp, const KeyValueStore& store,
                 const Tensor<float>& centroids, ListAssignment assignment, IndexManifest manifest,
                 const std::function<void(int64_t)>& report) {
  const int64_t n = store.rows(), d = store.key_dim(), dv = store.value_dim();
  const int64_t lists = centroids.size(0);
  const int64_t row_bytes = (d + dv) * static_cast<int64_t>(item_size(store.dtype()));
  const std::vector<int64_t>& list_rows = assignment.list_rows;

  // The rows in list order (a counting sort: each list's rows in store order).
  std::vector<int64_t> ids(static_cast<size_t>(n));
  {
    std::vector<int64_t> next(static_cast<size_t>(lists));
    for (int64_t j = 1; j < lists; ++j) {
      next[static_cast<size_t>(j)] =
          next[static_cast<size_t>(j - 1)] + list_rows[static_cast<size_t>(j - 1)];
    }
    for (int64_t r = 0; r < n; ++r) {
      const auto list = static_cast<size_t>(assignment.list_of[static_cast<size_t>(r)]);
      ids[static_cast<size_t>(next[list]++)] = r;
    }
  }
  assignment.list_of = std::vector<int32_t>();
  // Each index row's block (list order: a list's rows in runs of
  // kIndexBlockRows), and each block's box, formed as the rows are copied.
  std::vector<int64_t> block_of(static_cast<size_t>(n));
  int64_t blocks = 0;
  for (int64_t j = 0, row = 0; j < lists; ++j) {
    const int64_t rows = list_rows[static_cast<size_t>(j)];
    for (int64_t r = 0; r < rows; ++r) {
      block_of[static_cast<size_t>(row + r)] = blocks + r / kIndexBlockRows;
    }
    row += rows;
    blocks += (rows + kIndexBlockRows - 1) / kIndexBlockRows;
  }
  Tensor<float> block_low(Shape{blocks, d}, std::numeric_limits<float>::infinity());
  Tensor<float> block_high(Shape{blocks, d}, -std::numeric_limits<float>::infinity());
  std::vector<float> key_row(static_cast<size_t>(d));

  std::vector<uint64_t> sums(kIndexFileCount);
  sums[0] = write_array<float>(function, temp, kCentroids, centroids.view());
  sums[1] = write_array<int64_t>(function, temp, kListRows,
                                 ConstView<int64_t>(list_rows.data(), Shape{lists}));
  sums[2] = write_array<double>(function, temp, kRadii,
                                ConstView<double>(assignment.radii.data(), Shape{lists}));
  sums[3] = write_array<double>(function, temp, kNorms,
                                ConstView<double>(assignment.norms.data(), Shape{lists}));
  sums[4] = write_array<int64_t>(function, temp, kIds, ConstView<int64_t>(ids.data(), Shape{n}));
  {
    HashedFile keys_out(function, temp, kKeys), values_out(function, temp, kValues);
    keys_out.write(npy_header_bytes(npy_descr(store.dtype()), Shape{n, d}));
    values_out.write(npy_header_bytes(npy_descr(store.dtype()), Shape{n, dv}));
    const size_t item = item_size(store.dtype());
    const size_t key_bytes = static_cast<size_t>(d) * item,
                 value_bytes = static_cast<size_t>(dv) * item;
    std::vector<unsigned char> keys_buffer, values_buffer;
    // A store of at most this many chunks has each read once and kept; a
    // larger one is read chunk by chunk as the rows ask (each read checks
    // the chunk's files again, about a microsecond).
    constexpr size_t kKeptChunks = 256;
    const bool keep_all = store.num_chunks() <= kKeptChunks;
    std::vector<std::optional<SourceChunk>> kept(keep_all ? store.num_chunks() : 1);
    size_t last = std::numeric_limits<size_t>::max();
    for (int64_t r0 = 0; r0 < n; r0 += kWriteRows) {
      const int64_t rows = std::min(kWriteRows, n - r0);
      keys_buffer.resize(static_cast<size_t>(rows) * key_bytes);
      values_buffer.resize(static_cast<size_t>(rows) * value_bytes);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t id = ids[static_cast<size_t>(r0 + r)];
        const size_t c = chunk_of(store, id);
        std::optional<SourceChunk>& slot = kept[keep_all ? c : 0];
        if (!slot || (!keep_all && last != c)) slot = store.read_chunk(c);
        last = c;
        const int64_t at = id - slot->range().first_row;
        const void* k = store.dtype() == StoreDtype::kFloat32
                            ? static_cast<const void*>(&slot->keys<float>()(at, 0))
                            : static_cast<const void*>(&slot->keys<bfloat16>()(at, 0));
        const void* v = store.dtype() == StoreDtype::kFloat32
                            ? static_cast<const void*>(&slot->values<float>()(at, 0))
                            : static_cast<const void*>(&slot->values<bfloat16>()(at, 0));
        std::memcpy(keys_buffer.data() + static_cast<size_t>(r) * key_bytes, k, key_bytes);
        std::memcpy(values_buffer.data() + static_cast<size_t>(r) * value_bytes, v, value_bytes);
        row_as_float(*slot, true, at, key_row.data());
        const int64_t block = block_of[static_cast<size_t>(r0 + r)];
        float* low = &block_low(block, 0);
        float* high = &block_high(block, 0);
        for (int64_t c = 0; c < d; ++c) {
          low[c] = std::min(low[c], key_row[static_cast<size_t>(c)]);
          high[c] = std::max(high[c], key_row[static_cast<size_t>(c)]);
        }
      }
      keys_out.write(keys_buffer.data(), keys_buffer.size());
      values_out.write(values_buffer.data(), values_buffer.size());
      report(rows * row_bytes);
    }
    for (const std::optional<SourceChunk>& chunk : kept) {
      if (chunk) chunk->check_intact();
    }
    sums[5] = keys_out.commit();
    sums[6] = values_out.commit();
  }
  sums[7] = write_array<float>(function, temp, kBoxLow, assignment.box_low.view());
  sums[8] = write_array<float>(function, temp, kBoxHigh, assignment.box_high.view());
  sums[9] = write_array<float>(function, temp, kBlockLow, block_low.view());
  sums[10] = write_array<float>(function, temp, kBlockHigh, block_high.view());

  manifest.dtype = store.dtype();
  manifest.key_dim = d;
  manifest.value_dim = dv;
  manifest.rows = n;
  manifest.lists = lists;
  manifest.store_chunks = static_cast<int64_t>(store.num_chunks());
  manifest.store_fingerprint = fingerprint(store.chunks(), store.num_chunks());
  manifest.file_xxh3 = sums;
  StagedFile out(function, "manifest", (fs::path(temp) / kManifest).string());
  out.write(index_manifest_text(manifest));
  out.commit();
}

}  // namespace

int64_t default_index_lists(int64_t rows) {
  if (rows <= 0) return 0;
  const auto lists = static_cast<int64_t>(std::llround(4.0 * std::sqrt(static_cast<double>(rows))));
  return std::clamp<int64_t>(lists, 1, rows);
}

int64_t StoreIndex::store_row(int64_t r) const {
  if (r < 0 || r >= rows_) {
    fail("StoreIndex::store_row",
         "r = " + std::to_string(r) + " is outside [0, " + std::to_string(rows_) + ")");
  }
  const int64_t id = data_of<int64_t>(files_->ids, files_->ids_offset)[r];
  if (id < 0 || id >= rows_) {
    fail("StoreIndex::store_row", dir_ + "/" + kIds + ": row " + std::to_string(r) + " holds " +
                                      std::to_string(id) + ", not a row of the store (0 to " +
                                      std::to_string(rows_ - 1) + "): the file is damaged");
  }
  return id;
}

SourceChunk StoreIndex::read_list(size_t j) const {
  if (j >= lists_.size()) {
    fail("StoreIndex::read_list", "j = " + std::to_string(j) + " but the index has " +
                                      std::to_string(lists_.size()) + " lists");
  }
  const IndexList& list = lists_[j];
  const ChunkRange range{list.first_row, list.rows};
  std::shared_ptr<const Files> files = files_;
  auto check = [files] {
    files->keys.check_unchanged("StoreIndex::read_list");
    files->values.check_unchanged("StoreIndex::read_list");
  };
  if (dtype_ == StoreDtype::kFloat32) {
    const float* keys = data_of<float>(files->keys, files->keys_offset) + list.first_row * key_dim_;
    const float* values =
        data_of<float>(files->values, files->values_offset) + list.first_row * value_dim_;
    return SourceChunk(range, ConstView<float>(keys, Shape{list.rows, key_dim_}),
                       ConstView<float>(values, Shape{list.rows, value_dim_}), files, check);
  }
  const bfloat16* keys =
      data_of<bfloat16>(files->keys, files->keys_offset) + list.first_row * key_dim_;
  const bfloat16* values =
      data_of<bfloat16>(files->values, files->values_offset) + list.first_row * value_dim_;
  return SourceChunk(range, ConstView<bfloat16>(keys, Shape{list.rows, key_dim_}),
                     ConstView<bfloat16>(values, Shape{list.rows, value_dim_}), files, check);
}

StoreIndex StoreIndex::build(const KeyValueStore& store, const std::string& dir,
                             const IndexBuildOptions& options) {
  const int64_t n = store.rows(), d = store.key_dim(), dv = store.value_dim();
  const int64_t lists = options.lists == 0 ? default_index_lists(n) : options.lists;
  if (options.lists < 0 || (n > 0 && lists > n) || (n == 0 && options.lists > 0)) {
    fail(kBuildFn, "lists = " + std::to_string(options.lists) + "; expected 1 to the store's " +
                       std::to_string(n) + " rows (0 picks " + std::to_string(lists) + ")");
  }
  if (options.iterations < 0 || options.iterations > 1000) {
    fail(kBuildFn, "iterations = " + std::to_string(options.iterations) + "; expected 0 to 1000");
  }
  if (options.sample_per_list < 1 || options.sample_per_list > (int64_t{1} << 20)) {
    fail(kBuildFn,
         "sample_per_list = " + std::to_string(options.sample_per_list) + "; expected 1 to 2^20");
  }
  StagedDirectory staged(kBuildFn, dir);

  // Progress: the sample's read, the rounds, the assignment pass and the
  // writing pass, in bytes of rows (a round counts as a pass over the sample).
  const int64_t row_bytes = (d + dv) * static_cast<int64_t>(item_size(store.dtype()));
  const int64_t sample_count = std::min(n, lists * options.sample_per_list);
  const int64_t total = sample_count * row_bytes * (1 + options.iterations) + 2 * n * row_bytes;
  int64_t done = 0;
  const auto report = [&](int64_t bytes) {
    done += bytes;
    if (options.progress) options.progress(std::min(done, total), total);
  };

  // 1. The sample, centred at its mean.
  const std::vector<int64_t> sampled = sample_rows(n, sample_count, options.seed);
  Tensor<float> sample(Shape{sample_count, d});
  for (size_t s = 0; s < sampled.size();) {
    const size_t c = chunk_of(store, sampled[s]);
    const SourceChunk chunk = store.read_chunk(c);
    const ChunkRange range = chunk.range();
    for (; s < sampled.size() && sampled[s] < range.first_row + range.rows; ++s) {
      row_as_float(chunk, true, sampled[s] - range.first_row, &sample(static_cast<int64_t>(s), 0));
    }
    chunk.check_intact();
  }
  report(sample_count * row_bytes);
  std::vector<double> mean(static_cast<size_t>(d));
  for (int64_t r = 0; r < sample_count; ++r) {
    for (int64_t c = 0; c < d; ++c) mean[static_cast<size_t>(c)] += sample(r, c);
  }
  for (double& m : mean) m /= static_cast<double>(std::max<int64_t>(sample_count, 1));
  for (int64_t r = 0; r < sample_count; ++r) {
    for (int64_t c = 0; c < d; ++c)
      sample(r, c) -= static_cast<float>(mean[static_cast<size_t>(c)]);
  }

  // 2. k-means on the sample; the centroids as stored (float32, not centred).
  Tensor<float> centred(Shape{lists, d});
  if (lists > 0) {
    centred = train_centroids(sample, lists, options.iterations, options.seed,
                              [&] { report(sample_count * row_bytes); });
  }
  sample = Tensor<float>();
  Tensor<float> centroids(Shape{lists, d});
  for (int64_t j = 0; j < lists; ++j) {
    for (int64_t c = 0; c < d; ++c) {
      centroids(j, c) = static_cast<float>(double{centred(j, c)} + mean[static_cast<size_t>(c)]);
    }
  }

  // 3. Every row to its nearest list; each list's radius and largest norm.
  ListAssignment assignment(n, lists, d);
  assign_rows(store, 0, centroids, mean, assignment, report);

  // 4. The files, rows in list order.
  IndexManifest manifest;
  manifest.iterations = options.iterations;
  manifest.sample_per_list = options.sample_per_list;
  manifest.seed = options.seed;
  write_index(kBuildFn, staged.temp(), store, centroids, std::move(assignment), manifest, report);
  staged.commit();
  return open(dir, StoreCheck::kStructure);
}

StoreIndex StoreIndex::open(const std::string& dir, StoreCheck check,
                            const StoreProgress& progress) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    fail(kOpenFn, "no index at " + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) fail(kOpenFn, dir + " is not an index (not a directory)");
  const std::string manifest_path = (fs::path(dir) / kManifest).string();
  // Ours are under a kilobyte.
  const std::string text =
      read_text_file(kOpenFn, manifest_path, size_t{1} << 20, "an index's manifest");
  const IndexManifest manifest = parse_index_manifest(kOpenFn, text, manifest_path);
  StoreIndex index;
  index.dir_ = dir;
  index.dtype_ = manifest.dtype;
  index.key_dim_ = manifest.key_dim;
  index.value_dim_ = manifest.value_dim;
  index.rows_ = manifest.rows;
  index.store_chunks_ = manifest.store_chunks;
  index.store_fingerprint_ = manifest.store_fingerprint;
  const int64_t lists = manifest.lists;
  const std::vector<uint64_t>& sums = manifest.file_xxh3;

  size_t offset = 0;
  // The files' bytes, for progress while their checksums are read.
  int64_t total = 0, done = 0;
  for (const char* name : kIndexFiles) {
    struct stat file_stat {};
    if (::stat((fs::path(dir) / name).c_str(), &file_stat) == 0) total += file_stat.st_size;
  }
  const auto check_sum = [&](const MappedFile& file, size_t which) {
    if (check != StoreCheck::kChecksums) return;
    const uint64_t sum = XXH3_64bits(file.data(), file.size());
    done += static_cast<int64_t>(file.size());
    if (progress) progress(std::min(done, total), total);
    if (sum != sums[which]) {
      fail(kOpenFn, file.path() + ": checksum " + hex64(sum) + " does not match the manifest's " +
                        hex64(sums[which]) + " (the index file was altered)");
    }
  };
  const MappedFile centroids =
      map_index_file(kOpenFn, dir, kCentroids, "<f4", Shape{lists, index.key_dim_}, offset);
  check_sum(centroids, 0);
  index.centroids_ = Tensor<float>(Shape{lists, index.key_dim_});
  std::copy_n(data_of<float>(centroids, offset), lists * index.key_dim_, index.centroids_.data());
  size_t rows_offset = 0, radii_offset = 0, norms_offset = 0;
  const MappedFile list_rows =
      map_index_file(kOpenFn, dir, kListRows, "<i8", Shape{lists}, rows_offset);
  check_sum(list_rows, 1);
  const MappedFile radii = map_index_file(kOpenFn, dir, kRadii, "<f8", Shape{lists}, radii_offset);
  check_sum(radii, 2);
  const MappedFile norms = map_index_file(kOpenFn, dir, kNorms, "<f8", Shape{lists}, norms_offset);
  check_sum(norms, 3);
  int64_t first_row = 0, blocks = 0;
  for (int64_t j = 0; j < lists; ++j) {
    IndexList list;
    list.first_row = first_row;
    list.first_block = blocks;
    list.rows = data_of<int64_t>(list_rows, rows_offset)[j];
    list.radius = data_of<double>(radii, radii_offset)[j];
    list.max_norm = data_of<double>(norms, norms_offset)[j];
    if (list.rows < 0 || list.rows > index.rows_ - first_row || !std::isfinite(list.radius) ||
        list.radius < 0 || !std::isfinite(list.max_norm) || list.max_norm < 0) {
      fail(kOpenFn, dir + ": list " + std::to_string(j) + " has rows " + std::to_string(list.rows) +
                        ", radius " + std::to_string(list.radius) + ", largest norm " +
                        std::to_string(list.max_norm) + ", which do not fit the index (damaged)");
    }
    first_row += list.rows;
    blocks += (list.rows + kIndexBlockRows - 1) / kIndexBlockRows;
    index.lists_.push_back(list);
  }
  if (first_row != index.rows_) {
    fail(kOpenFn, dir + ": the lists hold " + std::to_string(first_row) +
                      " rows but the index has " + std::to_string(index.rows_) + " (damaged)");
  }
  // The boxes: finite, low <= high, for every list with rows and every block.
  for (const auto& [name, which, count, box] :
       {std::tuple{kBoxLow, size_t{7}, lists, &index.box_low_},
        std::tuple{kBoxHigh, size_t{8}, lists, &index.box_high_},
        std::tuple{kBlockLow, size_t{9}, blocks, &index.block_low_},
        std::tuple{kBlockHigh, size_t{10}, blocks, &index.block_high_}}) {
    size_t box_offset = 0;
    const MappedFile file =
        map_index_file(kOpenFn, dir, name, "<f4", Shape{count, index.key_dim_}, box_offset);
    check_sum(file, which);
    *box = Tensor<float>(Shape{count, index.key_dim_});
    std::copy_n(data_of<float>(file, box_offset), count * index.key_dim_, box->data());
  }
  index.centroid_columns_.resize(static_cast<size_t>(lists * index.key_dim_));
  for (int64_t j = 0; j < lists; ++j) {
    double squared = 0.0;
    for (int64_t c = 0; c < index.key_dim_; ++c) {
      const double x = index.centroids_(j, c);
      squared += x * x;
      index.centroid_columns_[static_cast<size_t>(c * lists + j)] = x;
    }
    index.centroid_norms_.push_back(std::sqrt(squared));
    const int64_t rows = index.lists_[static_cast<size_t>(j)].rows;
    index.log_list_rows_.push_back(rows > 0 ? std::log(static_cast<double>(rows))
                                            : -std::numeric_limits<double>::infinity());
  }
  for (int64_t j = 0; j < lists; ++j) {
    if (index.lists_[static_cast<size_t>(j)].rows == 0) continue;
    for (int64_t c = 0; c < index.key_dim_; ++c) {
      const float low = index.box_low_(j, c), high = index.box_high_(j, c);
      if (!(std::isfinite(low) && std::isfinite(high) && low <= high)) {
        fail(kOpenFn, dir + ": list " + std::to_string(j) + "'s box has coordinate " +
                          std::to_string(c) + " from " + std::to_string(low) + " to " +
                          std::to_string(high) + ", which does not fit the index (damaged)");
      }
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t c = 0; c < index.key_dim_; ++c) {
      const float low = index.block_low_(b, c), high = index.block_high_(b, c);
      if (!(std::isfinite(low) && std::isfinite(high) && low <= high)) {
        fail(kOpenFn, dir + ": block " + std::to_string(b) + "'s box has coordinate " +
                          std::to_string(c) + " from " + std::to_string(low) + " to " +
                          std::to_string(high) + ", which does not fit the index (damaged)");
      }
    }
  }
  auto big = std::make_shared<Files>();
  big->ids = map_index_file(kOpenFn, dir, kIds, "<i8", Shape{index.rows_}, big->ids_offset);
  check_sum(big->ids, 4);
  big->keys = map_index_file(kOpenFn, dir, kKeys, npy_descr(index.dtype_),
                             Shape{index.rows_, index.key_dim_}, big->keys_offset);
  check_sum(big->keys, 5);
  big->values = map_index_file(kOpenFn, dir, kValues, npy_descr(index.dtype_),
                               Shape{index.rows_, index.value_dim_}, big->values_offset);
  check_sum(big->values, 6);
  index.files_ = std::move(big);
  return index;
}

void StoreIndex::verify(const StoreProgress& progress) const {
  try {
    (void)open(dir_, StoreCheck::kChecksums, progress);
  } catch (const Error& e) {
    std::string what = e.what();
    const std::string prefix = std::string(kOpenFn) + ": ";
    if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
    fail(kVerifyFn, what);
  }
}

void StoreIndex::check_built_over(const KeyValueStore& store) const {
  constexpr std::string_view kFn = "StoreIndex::check_built_over";
  check_same_store(kFn, store);
  if (store.rows() != rows_) {
    fail(kFn, "index " + dir_ + " was built over " + std::to_string(rows_) + " rows of " +
                  store.name() + ", which now has " + std::to_string(store.rows()) +
                  " (rows were appended since): the index is stale; update it (qkv index update) "
                  "or build it again");
  }
}

void StoreIndex::check_same_store(std::string_view function, const KeyValueStore& store) const {
  const std::string_view kFn = function;
  const std::string what = "index " + dir_ + " was built over ";
  if (store.dtype() != dtype_ || store.key_dim() != key_dim_ || store.value_dim() != value_dim_) {
    fail(kFn, what + std::string(store_dtype_name(dtype_)) + " rows of D = " +
                  std::to_string(key_dim_) + ", Dv = " + std::to_string(value_dim_) + ", not " +
                  store.name() + " (" + std::string(store_dtype_name(store.dtype())) +
                  ", D = " + std::to_string(store.key_dim()) +
                  ", Dv = " + std::to_string(store.value_dim()) + ")");
  }
  const auto chunks = static_cast<size_t>(store_chunks_);
  if (store.num_chunks() < chunks || fingerprint(store.chunks(), chunks) != store_fingerprint_) {
    fail(kFn, what + "another store than " + store.name() +
                  " (its chunks' checksums differ): build it again over this one");
  }
}

namespace {

// An exclusive lock on a directory (flock on it), held while it lives; Error
// at once if another process holds it, or if `dir` was replaced by another
// directory between its opening and the lock.
class DirectoryLock {
 public:
  DirectoryLock(std::string_view function, const std::string& dir) {
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ < 0) fail(function, "cannot open " + dir + ": " + std::strerror(errno));
    struct stat locked {
    }, now{};
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      ::close(fd_);
      if (error == EWOULDBLOCK) {
        fail_io(function, dir +
                              " is being updated by another process; nothing was written, try "
                              "again when it is done");
      }
      fail_io(function, "cannot lock " + dir + ": " + std::strerror(error));
    }
    if (::fstat(fd_, &locked) != 0 || ::stat(dir.c_str(), &now) != 0 ||
        locked.st_ino != now.st_ino || locked.st_dev != now.st_dev) {
      ::close(fd_);
      fail(function, dir + " was replaced while this update started; run it again");
    }
  }
  ~DirectoryLock() { ::close(fd_); }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

StoreIndex StoreIndex::update(const std::string& dir, const KeyValueStore& store,
                              const StoreProgress& progress) {
  const DirectoryLock lock(kUpdateFn, dir);
  const StoreIndex current = open(dir, StoreCheck::kStructure);
  current.check_same_store(kUpdateFn, store);
  if (store.rows() == current.rows_) return current;
  const int64_t lists = static_cast<int64_t>(current.lists_.size());
  if (lists == 0) {
    fail(kUpdateFn, "index " + dir +
                        " has no lists (it was built over an empty store), so the new rows "
                        "have none to join: build it again");
  }
  const std::string manifest_path = (fs::path(dir) / kManifest).string();
  const IndexManifest manifest = parse_index_manifest(
      kUpdateFn, read_text_file(kUpdateFn, manifest_path, size_t{1} << 20, "an index's manifest"),
      manifest_path);

  const int64_t n = store.rows(), old_rows = current.rows_;
  const int64_t row_bytes =
      (current.key_dim_ + current.value_dim_) * static_cast<int64_t>(item_size(current.dtype_));
  const int64_t total = (n - old_rows) * row_bytes + n * row_bytes;
  int64_t done = 0;
  const auto report = [&](int64_t bytes) {
    done += bytes;
    if (progress) progress(std::min(done, total), total);
  };

  // The rows indexed so far stay in their lists, with their radii and norms.
  ListAssignment assignment(n, lists, current.key_dim_);
  assignment.box_low = current.box_low_;
  assignment.box_high = current.box_high_;
  std::fill(assignment.list_of.begin(), assignment.list_of.begin() + old_rows, -1);
  for (int64_t j = 0; j < lists; ++j) {
    const IndexList& list = current.lists_[static_cast<size_t>(j)];
    assignment.list_rows[static_cast<size_t>(j)] = list.rows;
    assignment.radii[static_cast<size_t>(j)] = list.radius;
    assignment.norms[static_cast<size_t>(j)] = list.max_norm;
    for (int64_t r = list.first_row; r < list.first_row + list.rows; ++r) {
      int32_t& slot = assignment.list_of[static_cast<size_t>(current.store_row(r))];
      if (slot >= 0) {
        fail(kUpdateFn, dir + ": store row " + std::to_string(current.store_row(r)) +
                            " is in the index twice (ids.npy is damaged)");
      }
      slot = static_cast<int32_t>(j);
    }
  }
  // The new rows to their nearest centroids, the products centred at the
  // centroids' mean (the build's sample mean is not kept; any centre near
  // the keys serves).
  std::vector<double> centre(static_cast<size_t>(current.key_dim_));
  for (int64_t j = 0; j < lists; ++j) {
    for (int64_t c = 0; c < current.key_dim_; ++c) {
      centre[static_cast<size_t>(c)] += current.centroids_(j, c) / static_cast<double>(lists);
    }
  }
  assign_rows(store, static_cast<size_t>(manifest.store_chunks), current.centroids_, centre,
              assignment, report);

  StagedDirectory staged(kUpdateFn, dir, StagedDirectory::Mode::kReplace);
  write_index(kUpdateFn, staged.temp(), store, current.centroids_, std::move(assignment), manifest,
              report);
  staged.commit();
  return open(dir, StoreCheck::kStructure);
}

}  // namespace qkv
