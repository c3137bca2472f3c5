// The library-wide thread count. OpenBLAS is kept single-threaded inside our
// parallel regions (see kernels/runtime/parallel.h): qkv owns the threading, so the blocking — and
// with it every result bit — does not depend on how many threads run.
#include "qkv/threads.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "qkv/error.h"

namespace qkv {
namespace {

std::atomic<int> requested_threads{0};  // 0: use the default

int default_threads() {
  if (const char* env = std::getenv("QKV_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= kMaxThreads) return static_cast<int>(n);
  }
  return std::min(omp_get_num_procs(), kMaxThreads);
}

}  // namespace

void set_num_threads(int n) {
  if (n < 0 || n > kMaxThreads) {
    fail("set_num_threads", "n = " + std::to_string(n) + " is outside [0, " +
                                std::to_string(kMaxThreads) + "] (" + std::to_string(kMaxThreads) +
                                " is qkv's thread limit)");
  }
  requested_threads.store(n);
}

int num_threads() {
  const int n = requested_threads.load();
  return n > 0 ? n : default_threads();
}

}  // namespace qkv
