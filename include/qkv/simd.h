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
#include <vector>

namespace qkv {

// The targets compiled into this build that this CPU supports, best first,
// e.g. {"avx2", "sse4", "scalar"}. The cap does not change it.
std::vector<std::string> simd_targets();

// The target the kernels run on now: the best of simd_targets(), or the cap.
std::string simd_target();

// Caps the kernels at `name` (one of simd_targets()) and the targets below
// it; "" lifts the cap. At a cap below avx512 the hand-written AVX-512 paths
// (the bf16 products and conversions) are off too. Call it while no qkv op
// runs on another thread. Throws Error for a name not in simd_targets(),
// listing them.
void set_simd_target(std::string_view name);

// set_simd_target($QKV_SIMD_TARGET) when that variable is set and not empty;
// a bad value is an Error naming the variable. The qkv command, the
// benchmarks and the tests call it at start-up.
void set_simd_target_from_env();

}  // namespace qkv
