// The public SIMD-target switch (qkv/simd.h) over the kernels' dispatch.
#include "qkv/simd.h"

#include <cstdlib>

#include "kernels/dispatch.h"
#include "qkv/error.h"

namespace qkv {
namespace {

std::string joined_targets() {
  std::string list;
  for (const std::string& name : simd_targets()) list += (list.empty() ? "" : ", ") + name;
  return list;
}

void cap(std::string_view function, std::string_view what, std::string_view name) {
  if (name.empty()) {
    kernels::cap_at(0);
    return;
  }
  const int64_t target = kernels::target_by_name(std::string(name));
  if (target == 0) {
    fail(function, std::string(what) + " is \"" + std::string(name) +
                       "\", which is not a SIMD target of this build on this CPU; expected "
                       "one of: " +
                       joined_targets());
  }
  kernels::cap_at(target);
}

}  // namespace

std::vector<std::string> simd_targets() {
  std::vector<std::string> names;
  for (int64_t target : kernels::available_targets()) {
    names.push_back(kernels::target_name(target));
  }
  return names;
}

std::string simd_target() { return kernels::target_name(kernels::current_target()); }

void set_simd_target(std::string_view name) { cap("set_simd_target", "name", name); }

void set_simd_target_from_env() {
  const char* value = std::getenv("QKV_SIMD_TARGET");
  if (value == nullptr) return;
  cap("set_simd_target_from_env", "QKV_SIMD_TARGET", value);
}

}  // namespace qkv
