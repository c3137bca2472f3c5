// Tests for the SIMD-target switch (qkv/simd.h): the list of targets, the cap
// reaching every kernel (the Highway dispatch and the hand-written AVX-512
// bf16 paths), and its errors. The kernel tests themselves run once per
// target (tests/CMakeLists.txt); this file checks that forcing a target works.
#include <cblas.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/runtime/blas.h"
#include "kernels/runtime/dispatch.h"
#include "kernels/simd/gemm_bf16.h"
#include "qkv/masked_softmax.h"
#include "qkv/simd.h"
#include "test_util.h"

namespace qkv::test {
namespace {

// Lifts the cap when a test ends, whatever it set.
struct LiftCapAtEnd {
  LiftCapAtEnd() { set_simd_target(""); }
  ~LiftCapAtEnd() { set_simd_target(""); }
};

// Vector lanes of float for a target name: sums over a row run in this many
// partial sums, so targets of different widths round differently.
int float_lanes(const std::string& target) {
  if (target.rfind("avx512", 0) == 0) return 16;
  if (target == "avx2") return 8;
  if (target == "scalar") return 1;
  return 4;  // sse4
}

TEST(Simd, TargetsAreDistinctBestFirstAndTheDefault) {
  LiftCapAtEnd lift;
  const std::vector<std::string> targets = simd_targets();
  ASSERT_FALSE(targets.empty());
  for (size_t i = 0; i < targets.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_NE(targets[i], targets[j]);
  }
  EXPECT_EQ(simd_target(), targets.front()) << "without a cap the best target runs";
#if defined(__x86_64__) && QKV_SIMD_TARGETS_NARROWED
  // The sanitizer build compiles the CPU's best target and scalar only
  // (CMakeLists.txt, QKV_SANITIZE_ALL_TARGETS).
  EXPECT_EQ(targets.back(), "scalar");
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const std::vector<std::string> expected = {avx512 ? "avx512" : avx2 ? "avx2" : "sse4", "scalar"};
  EXPECT_EQ(targets, expected);
#elif defined(__x86_64__)
  // x86-64 builds compile sse4 and avx2 (and avx512) besides scalar, and any
  // x86-64 CPU of the last fifteen years has SSE4.
  EXPECT_EQ(targets.back(), "scalar");
  EXPECT_NE(std::find(targets.begin(), targets.end(), "sse4"), targets.end());
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(std::find(targets.begin(), targets.end(), "avx2") != targets.end(), avx2);
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  EXPECT_EQ(std::find(targets.begin(), targets.end(), "avx512") != targets.end(), avx512);
#endif
  std::string list;
  for (const std::string& t : targets) list += t + " ";
  std::printf("SIMD targets here, best first: %s\n", list.c_str());
}

// Each target, once capped at, is the one the kernels dispatch to, and the
// bf16 products use their AVX-512 paths only at an AVX-512 target.
TEST(Simd, CapReachesTheDispatchAndTheBf16Paths) {
  LiftCapAtEnd lift;
  const bool native_uncapped = kernels::fast::bf16_native();
  for (const std::string& target : simd_targets()) {
    SCOPED_TRACE("target " + target);
    set_simd_target(target);
    EXPECT_EQ(simd_target(), target);
    const bool avx512 = target.rfind("avx512", 0) == 0;
    EXPECT_EQ(kernels::fast::bf16_native(), avx512 && native_uncapped);
  }
  set_simd_target("");
  EXPECT_EQ(simd_target(), simd_targets().front());
  EXPECT_EQ(kernels::fast::bf16_native(), native_uncapped);
}

// The cap is settled when set_simd_target returns: Highway's dispatch is
// initialised already, so the first kernel call on several threads does not
// choose the target again (which passes through the uncapped best target:
// kernels/runtime/dispatch.cc), and every thread dispatching at once sees it.
TEST(Simd, CapIsSettledBeforeTheNextKernel) {
  LiftCapAtEnd lift;
  const std::vector<std::string> targets = simd_targets();
  for (int round = 0; round < 50; ++round) {
    const std::string& target = targets[static_cast<size_t>(round) % targets.size()];
    SCOPED_TRACE("target " + target + ", round " + std::to_string(round));
    set_simd_target(target);
    ASSERT_TRUE(hwy::GetChosenTarget().IsInitialized());
    std::vector<int64_t> seen(4);
#pragma omp parallel for num_threads(4)
    for (int t = 0; t < 4; ++t) seen[t] = kernels::current_target();
    for (int64_t s : seen) EXPECT_EQ(kernels::target_name(s), target);
  }
}

// End to end through a public op: the softmax's row sums run in as many
// partial sums as the target has lanes, so targets of different widths give
// different bits somewhere in 64 rows of 999 scores, while every target stays
// within the softmax's tolerance of the others.
TEST(Simd, OpsFollowTheCap) {
  LiftCapAtEnd lift;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<float> scores = random_tensor<float>(rng, Shape{1, 64, 999}, -4, 4);
  std::vector<std::string> names;
  std::vector<Tensor<float>> weights;
  for (const std::string& target : simd_targets()) {
    set_simd_target(target);
    names.push_back(target);
    weights.push_back(masked_softmax(scores.view()));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      SCOPED_TRACE(names[j] + " vs " + names[i]);
      const std::vector<float>& a = weights[i].values();
      const std::vector<float>& b = weights[j].values();
      double worst = 0;
      for (size_t n = 0; n < a.size(); ++n) worst = std::max(worst, double(std::abs(a[n] - b[n])));
      EXPECT_LE(worst, 1e-7);
      if (float_lanes(names[i]) != float_lanes(names[j])) {
        EXPECT_NE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << "the same bits on targets of different widths: did the cap reach the kernel?";
      }
    }
  }
}

TEST(Simd, UnknownOrUnsupportedTargetsAreErrors) {
  LiftCapAtEnd lift;
  const std::vector<std::string> targets = simd_targets();
  const std::string first = targets.front();
  for (const char* name :
       {"avx512", "avx2", "sse4", "ssse3", "scalar", "neon", "AVX2", " avx2", "avx3", "best"}) {
    SCOPED_TRACE(name);
    if (std::find(targets.begin(), targets.end(), name) != targets.end()) {
      set_simd_target(name);
      EXPECT_EQ(simd_target(), name);
    } else {
      expect_error(
          [&] { set_simd_target(name); },
          {"set_simd_target", std::string("\"") + name + "\"", "expected one of: " + first});
    }
    set_simd_target("");
  }
  EXPECT_EQ(simd_target(), first) << "a rejected name must not change the cap";
}

// simd_info: the compiled targets hold the supported ones in order, the
// chosen one and the cap follow set_simd_target, the CPU features agree with
// the compiler's own probe, and bf16 products follow the cap.
TEST(Simd, InfoDescribesTheBuildTheCpuAndTheCap) {
  LiftCapAtEnd lift;
  const SimdInfo info = simd_info();
  EXPECT_EQ(info.supported, simd_targets());
  std::vector<std::string> kept;
  for (const std::string& t : info.compiled) {
    if (std::find(info.supported.begin(), info.supported.end(), t) != info.supported.end()) {
      kept.push_back(t);
    }
  }
  EXPECT_EQ(kept, info.supported) << "supported targets are compiled ones, in the same order";
  EXPECT_EQ(info.chosen, info.supported.front());
  EXPECT_EQ(info.cap, "");
  EXPECT_EQ(info.bf16_products != "widen", kernels::fast::bf16_native());
  EXPECT_EQ(info.blas.rfind("OpenBLAS", 0), 0u) << info.blas;
#if defined(__x86_64__)
  __builtin_cpu_init();
  ASSERT_EQ(info.cpu_features.size(), 10u);
  for (const auto& [name, present] : info.cpu_features) {
    if (name == "avx2") EXPECT_EQ(present, __builtin_cpu_supports("avx2") != 0);
    if (name == "avx512f") EXPECT_EQ(present, __builtin_cpu_supports("avx512f") != 0);
    if (name == "avx512bf16") EXPECT_EQ(present, __builtin_cpu_supports("avx512bf16") != 0);
  }
#endif
  for (const std::string& target : info.supported) {
    set_simd_target(target);
    const SimdInfo capped = simd_info();
    EXPECT_EQ(capped.chosen, target);
    EXPECT_EQ(capped.cap, target);
    EXPECT_EQ(capped.supported, info.supported) << "the cap does not change the CPU's list";
    if (target.rfind("avx512", 0) != 0) EXPECT_EQ(capped.bf16_products, "widen") << target;
  }
  set_simd_target("");
  EXPECT_EQ(simd_info().cap, "");
}

TEST(Simd, EnvironmentVariable) {
  LiftCapAtEnd lift;
  const char* saved = std::getenv("QKV_SIMD_TARGET");
  const std::string restore = saved ? saved : "";
  const std::string last = simd_targets().back();
  ::setenv("QKV_SIMD_TARGET", last.c_str(), 1);
  set_simd_target_from_env();
  EXPECT_EQ(simd_target(), last);
  ::setenv("QKV_SIMD_TARGET", "", 1);  // empty: no cap
  set_simd_target_from_env();
  EXPECT_EQ(simd_target(), simd_targets().front());
  ::setenv("QKV_SIMD_TARGET", "mmx", 1);
  expect_error([] { set_simd_target_from_env(); },
               {"set_simd_target_from_env", "QKV_SIMD_TARGET", "\"mmx\"", "expected one of"});
  ::unsetenv("QKV_SIMD_TARGET");
  set_simd_target_from_env();  // unset: nothing happens
  EXPECT_EQ(simd_target(), simd_targets().front());
  if (saved) ::setenv("QKV_SIMD_TARGET", restore.c_str(), 1);
}

// ---- OpenBLAS's core type (SimdInfo::blas_core, kernels/runtime/blas.h) ----

// The CPU's flags as the kernel reports them (/proc/cpuinfo), not as qkv
// probes them.
std::set<std::string> cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    return {std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
  }
  return {};
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Restores QKV_BLAS_CORE and OpenBLAS's core type when a test ends.
struct RestoreBlasCore {
  const char* saved = std::getenv("QKV_BLAS_CORE");
  std::string value = saved ? saved : "";
  ~RestoreBlasCore() {
    if (saved) {
      ::setenv("QKV_BLAS_CORE", value.c_str(), 1);
    } else {
      ::unsetenv("QKV_BLAS_CORE");
    }
    set_simd_target("");
  }
};

// A product through kernels::gemm (OpenBLAS) against a float64 loop, after
// a switch of core type: the new kernels compute, and compute right.
void expect_gemm_right(const std::string& core) {
  std::mt19937 gen(std::random_device{}());
  std::uniform_real_distribution<float> dist(-1, 1);
  const int64_t m = 37, n = 45, k = 70;
  std::vector<float> a(m * k), b(n * k), c(m * n, 7.0f);
  for (float& x : a) x = dist(gen);
  for (float& x : b) x = dist(gen);
  kernels::gemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
  double worst = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (int64_t p = 0; p < k; ++p) want += double(a[i * k + p]) * b[j * k + p];
      worst = std::max(worst, std::abs(want - c[i * n + j]));
    }
  }
  // 70 products of |x| <= 1 in float: each rounding at most 2^-24 of a sum <= 70.
  EXPECT_LT(worst, 70 * 70 * 6e-8) << core;

  // OpenBLAS's own threads, which a switch stops and starts again (blas.cc's
  // switch_core), on a product big enough to be split between 2 of them;
  // every 7th entry against a float64 loop.
  const int64_t big = 300;
  std::vector<float> x(big * big), y(big * big), z(big * big, 7.0f);
  for (float& e : x) e = dist(gen);
  for (float& e : y) e = dist(gen);
  const int threads_before = openblas_get_num_threads();
  openblas_set_num_threads(2);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, big, big, big, 1.0f, x.data(), big,
              y.data(), big, 0.0f, z.data(), big);
  openblas_set_num_threads(threads_before);
  worst = 0;
  for (int64_t e = 0; e < big * big; e += 7) {
    const int64_t i = e / big, j = e % big;
    double want = 0;
    for (int64_t p = 0; p < big; ++p) want += double(x[i * big + p]) * y[j * big + p];
    worst = std::max(worst, std::abs(want - z[e]));
  }
  EXPECT_LT(worst, 300 * 300 * 6e-8) << core << " with OpenBLAS's threads";
}

TEST(Simd, OpenBlasRunsTheBestCoreTypeThisCpuRuns) {
  LiftCapAtEnd lift;
  RestoreBlasCore restore;
  const std::set<std::string> flags = cpu_flags();
  ASSERT_FALSE(flags.empty()) << "no flags line in /proc/cpuinfo";
  const auto has = [&](const char* f) { return flags.count(f) != 0; };
  const bool avx512 = has("avx512f") && has("avx512bw") && has("avx512dq") && has("avx512vl");
  const bool avx2 = has("avx2") && has("fma");
  // The best core type of Debian's OpenBLAS 0.3.21 for this CPU.
  const std::set<std::string> best = avx512 ? std::set<std::string>{"skylakex", "cooperlake"}
                                     : avx2 ? std::set<std::string>{"haswell", "zen"}
                                            : std::set<std::string>{};

  // What OpenBLAS chose as it loaded, and from what.
  const SimdInfo at_load = simd_info();
  const char* env = std::getenv("OPENBLAS_CORETYPE");
  EXPECT_EQ(at_load.blas_core_from, env && *env ? std::string("OPENBLAS_CORETYPE=") + env
                                                : std::string("OpenBLAS's CPU detection"));

  // Forced to the oldest kernels (a CPU OpenBLAS misreads), then chosen again.
  ::setenv("QKV_BLAS_CORE", "Prescott", 1);
  kernels::choose_blas_core("");
  SimdInfo info = simd_info();
  EXPECT_EQ(info.blas_core, "Prescott");
  EXPECT_NE(info.blas.find("Prescott"), std::string::npos) << info.blas;
  EXPECT_EQ(info.blas_core_action, "switched to Prescott (QKV_BLAS_CORE)");
  expect_gemm_right("Prescott");

  ::unsetenv("QKV_BLAS_CORE");
  kernels::choose_blas_core("");
  info = simd_info();
  if (best.empty()) {
    EXPECT_EQ(info.blas_core, "Prescott") << "nothing better on this CPU";
  } else {
    EXPECT_EQ(best.count(lower(info.blas_core)), 1u) << info.blas_core;
    EXPECT_EQ(info.blas_core_action.rfind("switched from Prescott to " + info.blas_core, 0), 0u)
        << info.blas_core_action;
  }
  EXPECT_EQ(info.blas_core_found, at_load.blas_core_found) << "found is the load-time choice";
  expect_gemm_right(info.blas_core);
  const std::string chosen = info.blas_core;

  // A cap at avx2 caps OpenBLAS at Haswell; lifting it restores the best.
  const std::vector<std::string> targets = simd_targets();
  if (avx2 && std::find(targets.begin(), targets.end(), "avx2") != targets.end()) {
    set_simd_target("avx2");
    info = simd_info();
    EXPECT_EQ(lower(info.blas_core) == "haswell" || lower(info.blas_core) == "zen", true)
        << info.blas_core;
    set_simd_target("");
    EXPECT_EQ(simd_info().blas_core, chosen);
  }

  // keep: no switch, even from the oldest kernels.
  ::setenv("QKV_BLAS_CORE", "Prescott", 1);
  kernels::choose_blas_core("");
  ::setenv("QKV_BLAS_CORE", "keep", 1);
  kernels::choose_blas_core("");
  EXPECT_EQ(simd_info().blas_core, "Prescott");
  EXPECT_EQ(simd_info().blas_core_action, "kept (QKV_BLAS_CORE=keep)");

  // A name this OpenBLAS lacks: nothing changes, and the variable is an error.
  ::setenv("QKV_BLAS_CORE", "Pentium9", 1);
  kernels::choose_blas_core("");
  EXPECT_EQ(simd_info().blas_core, "Prescott");
  expect_error([] { set_simd_target_from_env(); },
               {"set_simd_target_from_env", "QKV_BLAS_CORE", "\"Pentium9\"",
                "not a core type of this OpenBLAS"});
  ::unsetenv("QKV_BLAS_CORE");
  kernels::choose_blas_core("");
  EXPECT_EQ(simd_info().blas_core, chosen);
}

}  // namespace
}  // namespace qkv::test
