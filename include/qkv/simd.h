// The SIMD instruction sets qkv's kernels run on. Each kernel is compiled for
// several targets (Google Highway's: avx512, avx2, sse4, scalar on x86-64)
// and runs the best one the CPU supports; set_simd_target caps that choice,
// to measure or test on one machine the code another machine runs.
// Results stay within each op's documented tolerance on every target; their
// bits can differ between targets of different vector widths (sums taken in
// another order), and are the same for any thread count on each.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace qkv {

// The targets compiled into this build that this CPU supports, best first,
// e.g. {"avx2", "sse4", "scalar"}. The cap does not change it.
std::vector<std::string> simd_targets();

// The target the kernels run on now: the best of simd_targets(), or the cap.
std::string simd_target();

// Caps the kernels at `name` (one of simd_targets()) and the targets below
// it; "" lifts the cap. At a cap below avx512 the hand-written AVX-512 paths
// (the bf16 products and conversions) are off too, and OpenBLAS's kernels
// are capped alike (SimdInfo::blas_core). Call it while no qkv op
// runs on another thread. Throws Error for a name not in simd_targets(),
// listing them, and saying so when the build has the target but this CPU
// cannot run it.
void set_simd_target(std::string_view name);

// What this build and this CPU offer, and what runs: `qkv info` prints it.
struct SimdInfo {
  std::vector<std::string> compiled;   // the targets this build has, best first
  std::vector<std::string> supported;  // those this CPU runs (simd_targets())
  std::string chosen;                  // simd_target()
  std::string cap;                     // the cap in force ("" for none)
  // The CPU features the kernels look for (x86-64: "sse4.2", "avx2", "fma",
  // "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16", "amx-tile",
  // "amx-bf16"), each with whether this CPU has it.
  std::vector<std::pair<std::string, bool>> cpu_features;
  // How bf16 products run now: "amx", "avx512_bf16", or "widen" (bf16
  // widened to float32 for the float32 kernels: no BF16 instructions, or a
  // cap below avx512).
  std::string bf16_products;
  std::string bf16_products_why;  // why that path, e.g. "no BF16 instructions"
  std::string blas;               // the BLAS's own description (OpenBLAS's build configuration)
  // OpenBLAS's kernels ("core type"). OpenBLAS picks them as it loads and
  // does not know CPUs newer than itself (Debian 12's runs its SSE3 kernels,
  // 3-4x slow, on recent Xeons); qkv switches it to the best core type this
  // CPU runs when OpenBLAS's is older (QKV_BLAS_CORE=keep: never; =NAME: that
  // one), and a SIMD cap caps it (avx2: Haswell). docs/performance.md.
  std::string blas_core_found;   // what OpenBLAS chose as it loaded
  std::string blas_core_from;    // why: "OPENBLAS_CORETYPE=..." or "OpenBLAS's CPU detection"
  std::string blas_core;         // what runs now
  std::string blas_core_action;  // what qkv did, one sentence
};
SimdInfo simd_info();

// set_simd_target($QKV_SIMD_TARGET) when that variable is set and not empty;
// a bad value is an Error naming the variable, and so is a QKV_BLAS_CORE
// that names no core type of the OpenBLAS loaded (SimdInfo::blas_core). The qkv command, the
// benchmarks and the tests call it at start-up.
void set_simd_target_from_env();

}  // namespace qkv
