// Which SIMD target the Highway kernels dispatch to, and the cap on it
// (kernel level: the public switch is qkv/simd.h). Every kernel file is
// compiled once per target through hwy/foreach_target.h; HWY_DYNAMIC_DISPATCH
// picks the best one the CPU supports, below the cap set here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qkv::kernels {

// A Highway target bit (HWY_AVX2, ...) by qkv's name for it: Highway's name
// in lower case, with AVX3 called avx512 ("avx512", "avx2", "sse4",
// "scalar"); and back (0 for a name no target has).
std::string target_name(int64_t target);
int64_t target_by_name(const std::string& name);

// Targets compiled into this build (for this architecture), best first.
std::vector<int64_t> compiled_targets();

// Targets compiled in and supported by this CPU, best first; the cap does
// not change this list.
std::vector<int64_t> available_targets();

// The cap set by cap_at (0: none).
int64_t cap_target();

// The target the kernels run on now, found by dispatching through the same
// table mechanism they use.
int64_t current_target();

// Dispatch goes to `target` or a lesser one from now on; 0 lifts the cap.
// `target` must be one of available_targets(). Not thread-safe against
// kernels running at the same time.
void cap_at(int64_t target);

// Whether AVX-512 code may run: the CPU has it and the cap allows it. The
// hand-written AVX-512 paths outside Highway (bf16 products, conversions)
// ask this, so a cap at avx2 turns them off too.
bool avx512_allowed();

}  // namespace qkv::kernels
