// The public SIMD-target switch (qkv/simd.h) over the kernels' dispatch.
#include "qkv/simd.h"

#include <algorithm>
#include <cstdlib>

#include "kernels/runtime/blas.h"
#include "kernels/runtime/dispatch.h"
#include "kernels/simd/gemm_bf16.h"
#include "qkv/error.h"

namespace qkv {
namespace {

std::vector<std::string> names_of(const std::vector<int64_t>& targets) {
  std::vector<std::string> names;
  for (int64_t target : targets) names.push_back(kernels::target_name(target));
  return names;
}

std::string joined_targets() {
  std::string list;
  for (const std::string& name : simd_targets()) list += (list.empty() ? "" : ", ") + name;
  return list;
}

void cap(std::string_view function, std::string_view what, std::string_view name) {
  if (name.empty()) {
    kernels::cap_at(0);
    kernels::choose_blas_core("");
    return;
  }
  const int64_t target = kernels::target_by_name(std::string(name));
  if (target == 0) {
    const std::vector<std::string> compiled = names_of(kernels::compiled_targets());
    const bool built = std::find(compiled.begin(), compiled.end(), name) != compiled.end();
    fail(function, std::string(what) + " is \"" + std::string(name) + "\", which " +
                       (built ? "this build has but this CPU does not support"
                              : "is not a SIMD target of this build") +
                       "; expected one of: " + joined_targets() + " (the targets this CPU runs)");
  }
  kernels::cap_at(target);
  kernels::choose_blas_core(name);
}

}  // namespace

std::vector<std::string> simd_targets() { return names_of(kernels::available_targets()); }

SimdInfo simd_info() {
  SimdInfo info;
  info.compiled = names_of(kernels::compiled_targets());
  info.supported = simd_targets();
  info.chosen = simd_target();
  const int64_t capped = kernels::cap_target();
  info.cap = capped == 0 ? "" : kernels::target_name(capped);
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // Literal names: __builtin_cpu_supports takes only string constants.
  info.cpu_features = {
      {"sse4.2", __builtin_cpu_supports("sse4.2") != 0},
      {"avx2", __builtin_cpu_supports("avx2") != 0},
      {"fma", __builtin_cpu_supports("fma") != 0},
      {"avx512f", __builtin_cpu_supports("avx512f") != 0},
      {"avx512bw", __builtin_cpu_supports("avx512bw") != 0},
      {"avx512vl", __builtin_cpu_supports("avx512vl") != 0},
      {"avx512dq", __builtin_cpu_supports("avx512dq") != 0},
      {"avx512bf16", __builtin_cpu_supports("avx512bf16") != 0},
      {"amx-tile", __builtin_cpu_supports("amx-tile") != 0},
      {"amx-bf16", __builtin_cpu_supports("amx-bf16") != 0},
  };
#endif
  info.bf16_products = kernels::fast::bf16_path();
  info.bf16_products_why = kernels::fast::bf16_path_reason();
  info.blas = kernels::blas_config();
  const kernels::BlasCoreChoice blas = kernels::blas_core_choice();
  info.blas_core_found = blas.found;
  info.blas_core_from = blas.found_from;
  info.blas_core = blas.running;
  info.blas_core_action = blas.action;
  return info;
}

std::string simd_target() { return kernels::target_name(kernels::current_target()); }

void set_simd_target(std::string_view name) { cap("set_simd_target", "name", name); }

void set_simd_target_from_env() {
  const char* value = std::getenv("QKV_SIMD_TARGET");
  if (value != nullptr) cap("set_simd_target_from_env", "QKV_SIMD_TARGET", value);
  // QKV_BLAS_CORE was read when the library loaded, where nothing can throw.
  const std::string unknown = kernels::blas_core_choice().unknown;
  if (!unknown.empty()) {
    fail("set_simd_target_from_env",
         "QKV_BLAS_CORE is \"" + unknown +
             "\", which is not a core type of this OpenBLAS; expected keep or one of its core "
             "types, e.g. SkylakeX, Haswell, Prescott");
  }
}

}  // namespace qkv
