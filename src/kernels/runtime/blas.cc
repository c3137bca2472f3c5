// BLAS calls (see blas.h); the thread setting is in parallel.cc.
#include "kernels/runtime/blas.h"

#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace qkv::kernels {

const char* blas_config() { return openblas_get_config(); }

namespace {

// OpenBLAS's core types by the widest vectors their float kernels use:
// 3 AVX-512, 2 AVX2 + FMA, 1 AVX, 0 older (SSE). Names as
// openblas_get_corename() spells them, compared without case.
int core_rank(std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* n : {"skylakex", "cooperlake", "sapphirerapids"}) {
    if (name == n) return 3;
  }
  for (const char* n : {"haswell", "zen", "excavator"}) {
    if (name == n) return 2;
  }
  for (const char* n : {"sandybridge", "bulldozer", "piledriver", "steamroller"}) {
    if (name == n) return 1;
  }
  return 0;
}

std::string upper(std::string name) {
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

// The OpenBLAS this library is linked with, for its DYNAMIC_ARCH entry
// points. Found through the file cblas_sgemm came from, not the global
// scope: a Python extension is loaded with RTLD_LOCAL, and so is its BLAS.
void* openblas_handle() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&cblas_sgemm), &info) == 0 || info.dli_fname == nullptr) {
    return nullptr;
  }
  return dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
}

// Whether this OpenBLAS has kernels for core type `name` (its tables are
// named gotoblas_<NAME>).
bool has_core(void* handle, const std::string& name) {
  return handle != nullptr && dlsym(handle, ("gotoblas_" + upper(name)).c_str()) != nullptr;
}

// The best core type for this CPU at a cap of `cap_rank` (core_rank's scale).
std::string best_core(void* handle, int cap_rank) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // libgcc's checks include the OS's: AVX-512 state enabled in XCR0.
  if (cap_rank >= 3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    if (__builtin_cpu_supports("avx512bf16") && has_core(handle, "Cooperlake")) return "Cooperlake";
    return "SkylakeX";
  }
  if (cap_rank >= 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return "Haswell";
  }
#else
  (void)handle;
  (void)cap_rank;
#endif
  return "";
}

// A SIMD cap on core_rank's scale.
int cap_rank_of(std::string_view cap) {
  if (cap.empty() || cap == "avx512") return 3;
  if (cap == "avx2") return 2;
  return 0;
}

// Runs OpenBLAS's core-type selection again with OPENBLAS_CORETYPE=name,
// then puts the variable back as it was.
//
// OpenBLAS's server threads are stopped meanwhile. Each one, as it starts,
// allocates its buffer, and the first allocation runs gotoblas_dynamic_init;
// between our quit and init that call finds no table, runs the CPU
// detection, and stores null for a CPU it does not know before falling back
// to Prescott. A CI run died on that null (SIGSEGV in gotoblas_dynamic_init,
// about 2 starts in 6,000); a start that survives it may keep Prescott.
// blas_thread_shutdown_ joins the threads (OpenBLAS's own fork handler), and
// blas_thread_init starts them again once the table is in place.
bool switch_core(void* handle, const std::string& name) {
  if (handle == nullptr) return false;
  using Entry = void (*)();
  using Status = int (*)();
  auto quit = reinterpret_cast<Entry>(dlsym(handle, "gotoblas_dynamic_quit"));
  auto init = reinterpret_cast<Entry>(dlsym(handle, "gotoblas_dynamic_init"));
  auto stop_threads = reinterpret_cast<Status>(dlsym(handle, "blas_thread_shutdown_"));
  auto start_threads = reinterpret_cast<Status>(dlsym(handle, "blas_thread_init"));
  // An unknown name would make OpenBLAS fall back to Prescott: only names
  // it has tables for. Without the thread entry points (an OpenMP or a
  // single-threaded build, which start no server threads) there is nothing
  // to stop.
  if (quit == nullptr || init == nullptr || !has_core(handle, name)) return false;
  if ((stop_threads == nullptr) != (start_threads == nullptr)) return false;
  const char* was = std::getenv("OPENBLAS_CORETYPE");
  const std::string saved = was ? was : "";
  setenv("OPENBLAS_CORETYPE", name.c_str(), 1);
  if (stop_threads != nullptr) stop_threads();
  quit();
  init();
  if (start_threads != nullptr) start_threads();
  if (was != nullptr) {
    setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
  } else {
    unsetenv("OPENBLAS_CORETYPE");
  }
  return true;
}

std::mutex choice_mutex;
BlasCoreChoice choice;  // guarded by choice_mutex
bool found_recorded = false;

void choose_locked(std::string_view cap) {
  void* handle = openblas_handle();
  if (!found_recorded) {
    choice.found = openblas_get_corename();
    const char* env = std::getenv("OPENBLAS_CORETYPE");
    choice.found_from = env != nullptr && *env != 0 ? std::string("OPENBLAS_CORETYPE=") + env
                                                    : "OpenBLAS's CPU detection";
    found_recorded = true;
  }
  const std::string running = openblas_get_corename();
  const char* setting = std::getenv("QKV_BLAS_CORE");
  const std::string wanted = setting ? setting : "";
  const int cap_rank = cap_rank_of(cap);
  // Under a cap of sse4 or scalar, what OpenBLAS chose as it loaded.
  choice.best = cap_rank == 0 ? choice.found : best_core(handle, cap_rank);
  const std::string at_cap = cap.empty() ? "" : " at the SIMD cap " + std::string(cap);
  const int from = core_rank(running), to = core_rank(choice.best);
  choice.unknown.clear();
  if (wanted == "keep") {
    choice.action = "kept (QKV_BLAS_CORE=keep)";
  } else if (!wanted.empty()) {
    const bool switched = switch_core(handle, wanted);
    choice.action = switched ? "switched to " + wanted + " (QKV_BLAS_CORE)"
                             : "kept " + running + ": QKV_BLAS_CORE=" + wanted +
                                   " is not a core type of this OpenBLAS";
    choice.unknown = switched ? "" : wanted;
  } else if (choice.best.empty() || from == to || (from > to && cap.empty())) {
    // A core type qkv switched to earlier stays explained by that switch.
    if (running == choice.found) {
      choice.action = "kept (this CPU runs nothing better" + at_cap + ")";
    }
  } else if (!switch_core(handle, choice.best)) {
    choice.action = "kept: this OpenBLAS cannot switch core types (not a DYNAMIC_ARCH build)";
  } else {
    choice.action = "switched from " + running + " to " + choice.best + at_cap +
                    " (QKV_BLAS_CORE=keep keeps OpenBLAS's choice)";
  }
  choice.running = openblas_get_corename();
  if (handle != nullptr) dlclose(handle);  // RTLD_NOLOAD: only the reference dlopen added
}

// When the library loads: before the caller's threads can be in the BLAS.
const bool chosen_at_load = [] {
  const char* cap = std::getenv("QKV_SIMD_TARGET");
  choose_blas_core(cap ? cap : "");
  return true;
}();

}  // namespace

BlasCoreChoice blas_core_choice() {
  const std::lock_guard<std::mutex> lock(choice_mutex);
  return choice;
}

void choose_blas_core(std::string_view cap) {
  const std::lock_guard<std::mutex> lock(choice_mutex);
  choose_locked(cap);
}

namespace {

template <class T>
bool trivial_gemm(int64_t m, int64_t n, int64_t k, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return true;
  if (k != 0) return false;
  // An empty inner product: C = beta * C (BLAS would reject lda = 0).
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
  }
  return true;
}

// BLAS requires leading dimensions >= the row length even when a stride of a
// size-1 axis is smaller; such strides are never used for addressing.
int64_t ld(int64_t given, int64_t row_length) { return std::max<int64_t>({given, row_length, 1}); }

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (trivial_gemm(m, n, k, beta, c, ldc)) return;
  const BlasSingleThreaded blas;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, ld(lda, trans_a ? m : k), b,
              ld(ldb, trans_b ? k : n), beta, c, ld(ldc, n));
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  if (trivial_gemm(m, n, k, beta, c, ldc)) return;
  const BlasSingleThreaded blas;
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, ld(lda, trans_a ? m : k), b,
              ld(ldb, trans_b ? k : n), beta, c, ld(ldc, n));
}

}  // namespace qkv::kernels
