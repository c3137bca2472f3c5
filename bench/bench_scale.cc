// The stores and timings behind docs/scale.md's benchmark (bench/scale.sh
// runs it; not a test). Prints one JSON object per measurement on stdout,
// progress on stderr.
//   bench_scale make DIR              creates the stores that are missing in DIR:
//                                     resident-float32, resident-bfloat16 (N = 10^7,
//                                     d = dv = 64) and large-float32 (2^26 rows,
//                                     32 GiB of keys and values: more than this
//                                     machine's 24 GiB of memory)
//   bench_scale resident DIR REPS     attention over the resident stores, Q = 64 and
//                                     Q = 1, float32 and bfloat16, warm page cache
//   bench_scale cold DIR              attention over large-float32, Q = 1, after
//                                     posix_fadvise(DONTNEED) on every chunk file
// Each timing is the median of REPS calls; "anon_peak_bytes" is the largest
// anonymous memory (RssAnon) seen during a call beyond what the process held
// before it: the store's mapped pages are the page cache's, not the process's.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "qkv/attention.h"
#include "qkv/store.h"
#include "qkv/store_attention.h"
#include "qkv/threads.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int64_t kDim = 64;
constexpr int64_t kResidentRows = 10000000;
// 2^26 rows of 64 + 64 floats: 32 GiB of keys and values.
constexpr int64_t kLargeRows = int64_t{1} << 26;
constexpr int64_t kLargeBatch = int64_t{1} << 22;  // rows per append: 2 GiB

// Uniform in [-1.73, 1.73) (variance 1), from a counter: any thread, any order.
float draw(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + i;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 40) * 0x1p-24 * 3.46 - 1.73);
}

qkv::Tensor<float> random_rows(uint64_t seed, int64_t first, int64_t rows) {
  qkv::Tensor<float> t(qkv::Shape{rows, kDim});
  float* p = t.data();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows * kDim; ++i) p[i] = draw(seed, static_cast<uint64_t>(first * kDim + i));
  return t;
}

std::string path_of(const std::string& dir, const char* name) { return (fs::path(dir) / name).string(); }

void make(const std::string& dir) {
  fs::create_directories(dir);
  for (const auto& [name, dtype] : {std::pair{"resident-float32", qkv::StoreDtype::kFloat32},
                                    {"resident-bfloat16", qkv::StoreDtype::kBFloat16}}) {
    const std::string path = path_of(dir, name);
    if (fs::exists(path)) continue;
    std::fprintf(stderr, "bench_scale: creating %s (10^7 rows)\n", path.c_str());
    const qkv::Tensor<float> keys = random_rows(1, 0, kResidentRows);
    const qkv::Tensor<float> values = random_rows(2, 0, kResidentRows);
    qkv::KeyValueStore::create(path, keys, values, dtype);
  }
  const std::string large = path_of(dir, "large-float32");
  if (fs::exists(large) && qkv::KeyValueStore::open(large, qkv::StoreCheck::kStructure).rows() ==
                               kLargeRows) {
    return;
  }
  fs::remove_all(large);
  std::fprintf(stderr, "bench_scale: creating %s (2^26 rows, 32 GiB)\n", large.c_str());
  qkv::KeyValueStore store = qkv::KeyValueStore::create(
      large, random_rows(3, 0, kLargeBatch), random_rows(4, 0, kLargeBatch));
  for (int64_t first = kLargeBatch; first < kLargeRows; first += kLargeBatch) {
    std::fprintf(stderr, "bench_scale:   %lld of %lld rows\n", static_cast<long long>(first),
                 static_cast<long long>(kLargeRows));
    store.append(random_rows(3, first, kLargeBatch), random_rows(4, first, kLargeBatch));
  }
}

// RssAnon from /proc/self/status, in bytes.
int64_t rss_anon() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  }
  return 0;
}

// Calls `work` and samples RssAnon every millisecond meanwhile; returns the
// seconds it took and the largest RssAnon seen beyond the one before.
template <class F>
std::pair<double, int64_t> timed(F&& work) {
  const int64_t before = rss_anon();
  std::atomic<bool> done{false};
  std::atomic<int64_t> peak{before};
  std::thread sampler([&] {
    while (!done.load()) {
      peak.store(std::max(peak.load(), rss_anon()));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  const Clock::time_point start = Clock::now();
  work();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  done.store(true);
  sampler.join();
  return {seconds, std::max<int64_t>(0, std::max(peak.load(), rss_anon()) - before)};
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.size() % 2 ? x[x.size() / 2] : (x[x.size() / 2 - 1] + x[x.size() / 2]) / 2;
}

int64_t data_bytes(const qkv::KeyValueStore& store) {
  return store.rows() * (store.key_dim() + store.value_dim()) *
         (store.dtype() == qkv::StoreDtype::kFloat32 ? 4 : 2);
}

// The median time of scaled dot-product attention of `queries` over
// chunk_rows keys and values held in memory (float32 or bfloat16 as the
// store), with the lse attend asks for.
double in_memory_seconds(const qkv::KeyValueStore& store, const qkv::Tensor<float>& queries, int reps) {
  const int64_t n = store.chunk_rows(), nq = queries.size(0);
  const qkv::Tensor<float> keys = random_rows(6, 0, n), values = random_rows(7, 0, n);
  const qkv::ConstView<float> q3 = queries.view().unsqueeze0();
  qkv::AttentionOptions options;
  options.return_lse = true;
  std::vector<double> seconds;
  if (store.dtype() == qkv::StoreDtype::kFloat32) {
    qkv::Tensor<float> out(qkv::Shape{1, nq, kDim}), lse(qkv::Shape{1, nq});
    const auto call = [&] {
      qkv::scaled_dot_product_attention(q3, keys.view().unsqueeze0(), values.view().unsqueeze0(), {},
                                        options, {out.view(), std::nullopt, lse.view()});
    };
    call();
    for (int r = 0; r < reps; ++r) seconds.push_back(timed(call).first);
  } else {
    const auto bf16 = [](const qkv::Tensor<float>& x) {
      qkv::Tensor<qkv::bfloat16> y(x.shape());
      for (int64_t i = 0; i < x.numel(); ++i) y.data()[i] = qkv::bfloat16(x.data()[i]);
      return y;
    };
    const qkv::Tensor<qkv::bfloat16> qb = bf16(queries), kb = bf16(keys), vb = bf16(values);
    const auto call = [&] {
      qkv::scaled_dot_product_attention(qb.view().unsqueeze0(), kb.view().unsqueeze0(),
                                        vb.view().unsqueeze0(), {}, options);
    };
    call();
    for (int r = 0; r < reps; ++r) seconds.push_back(timed(call).first);
  }
  return median(seconds);
}

void resident(const std::string& dir, int reps) {
  for (const char* name : {"resident-float32", "resident-bfloat16"}) {
    const qkv::KeyValueStore store = qkv::KeyValueStore::open(path_of(dir, name), qkv::StoreCheck::kStructure);
    for (int64_t nq : {int64_t{64}, int64_t{1}}) {
      const qkv::Tensor<float> queries = random_rows(5, 0, nq);
      qkv::attend(queries, store);  // the page cache warm, the threads started
      std::vector<double> seconds;
      int64_t anon = 0;
      for (int r = 0; r < reps; ++r) {
        const auto [s, a] = timed([&] { qkv::attend(queries, store); });
        seconds.push_back(s);
        anon = std::max(anon, a);
      }
      // The fused kernel alone on one chunk's shape, its keys and values in
      // memory (the same call attend makes per chunk): what the store costs
      // beyond it.
      const double kernel = in_memory_seconds(store, queries, reps) *
                            static_cast<double>(store.rows()) / static_cast<double>(store.chunk_rows());
      std::printf(
          "{\"kind\": \"resident\", \"store\": \"%s\", \"dtype\": \"%s\", \"rows\": %lld, "
          "\"queries\": %lld, \"dim\": %lld, \"seconds\": %.6f, \"min_seconds\": %.6f, "
          "\"in_memory_seconds\": %.6f, "
          "\"data_bytes\": %lld, \"flops\": %.6e, \"anon_peak_bytes\": %lld, \"threads\": %d}\n",
          name, std::string(qkv::store_dtype_name(store.dtype())).c_str(),
          static_cast<long long>(store.rows()), static_cast<long long>(nq),
          static_cast<long long>(kDim), median(seconds), *std::min_element(seconds.begin(), seconds.end()),
          kernel, static_cast<long long>(data_bytes(store)),
          4.0 * static_cast<double>(nq) * static_cast<double>(store.rows()) * kDim,
          static_cast<long long>(anon), qkv::num_threads());
      std::fflush(stdout);
    }
  }
}

// The fraction of a file's pages in the page cache (mincore).
double resident_fraction(const std::string& path) {
  const qkv::MappedFile file("bench_scale", path);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((file.size() + page - 1) / page);
  if (file.size() == 0 || ::mincore(const_cast<unsigned char*>(file.data()), file.size(), in.data()) != 0) {
    return 0;
  }
  return static_cast<double>(std::count_if(in.begin(), in.end(), [](unsigned char c) { return c & 1; })) /
         static_cast<double>(in.size());
}

void drop_from_page_cache(const qkv::KeyValueStore& store) {
  for (const qkv::StoreChunk& chunk : store.chunks()) {
    for (const std::string* file : {&chunk.keys_file, &chunk.values_file}) {
      const int fd = ::open((fs::path(store.dir()) / *file).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        ::close(fd);
      }
    }
  }
}

void cold(const std::string& dir) {
  const qkv::KeyValueStore store =
      qkv::KeyValueStore::open(path_of(dir, "large-float32"), qkv::StoreCheck::kStructure);
  const qkv::Tensor<float> queries = random_rows(5, 0, 1);
  drop_from_page_cache(store);
  const std::string probe = (fs::path(store.dir()) / store.chunks()[store.chunks().size() / 2].keys_file).string();
  const double cached_before = resident_fraction(probe);
  const auto [seconds, anon] = timed([&] { qkv::attend(queries, store); });
  std::printf(
      "{\"kind\": \"cold\", \"store\": \"large-float32\", \"rows\": %lld, \"queries\": 1, "
      "\"seconds\": %.6f, \"data_bytes\": %lld, \"file_bytes\": %lld, \"chunks\": %zu, "
      "\"cached_before\": %.4f, \"anon_peak_bytes\": %lld, \"threads\": %d, \"probe\": \"%s\"}\n",
      static_cast<long long>(store.rows()), seconds, static_cast<long long>(data_bytes(store)),
      static_cast<long long>(store.file_bytes()), store.chunks().size(), cached_before,
      static_cast<long long>(anon), qkv::num_threads(), probe.c_str());
  drop_from_page_cache(store);  // leave the memory to whatever runs next
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 2 ? argv[1] : "";
  try {
    if (mode == "make") {
      make(argv[2]);
    } else if (mode == "resident" && argc > 3) {
      resident(argv[2], std::max(1, std::atoi(argv[3])));
    } else if (mode == "cold") {
      cold(argv[2]);
    } else {
      std::fprintf(stderr, "usage: bench_scale make DIR | resident DIR REPS | cold DIR\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_scale: %s\n", e.what());
    return 1;
  }
  return 0;
}
