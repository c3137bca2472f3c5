// The per-target probe behind dispatch.h: one function compiled for every
// SIMD target that reports which target it was compiled for, dispatched like
// every kernel; and the cap, through Highway's DisableTargets.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/runtime/dispatch.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Highway's own headers must follow foreach_target.h.
#include <hwy/highway.h>

#include <cctype>

#include "kernels/runtime/dispatch.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::kernels {
namespace HWY_NAMESPACE {

int64_t CompiledTarget() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::kernels {

HWY_EXPORT(CompiledTarget);

std::string target_name(int64_t target) {
  std::string name = hwy::TargetName(target);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name.rfind("avx3", 0) == 0) name = "avx512" + name.substr(4);
  return name;
}

int64_t target_by_name(const std::string& name) {
  for (int64_t target : available_targets()) {
    if (target_name(target) == name) return target;
  }
  return 0;
}

namespace {

// The targets of `mask`, best (lowest bit) first.
std::vector<int64_t> targets_of(int64_t mask) {
  std::vector<int64_t> list;
  for (int64_t rest = mask; rest != 0; rest &= rest - 1) list.push_back(rest & -rest);
  return list;
}

int64_t cap = 0;  // cap_at's last target

}  // namespace

std::vector<int64_t> compiled_targets() { return targets_of(HWY_TARGETS); }

int64_t cap_target() { return cap; }

std::vector<int64_t> available_targets() {
  // Computed once, before any cap (cap_at asks for this list before it caps):
  // hwy::SupportedTargets() is the CPU's list less the disabled targets.
  static const std::vector<int64_t> targets = [] {
    return targets_of(HWY_TARGETS & hwy::SupportedTargets());
  }();
  return targets;
}

int64_t current_target() { return HWY_DYNAMIC_DISPATCH(CompiledTarget)(); }

void cap_at(int64_t target) {
  available_targets();  // the CPU's list, taken before the first cap
  // Highway's bits: a better target has a lower bit, so the targets above
  // the cap are exactly the bits below it.
  hwy::DisableTargets(target == 0 ? 0 : target - 1);
  // DisableTargets only de-initialises Highway's chosen target; the next
  // dispatch chooses again, and while it does, Highway's SupportedTargets()
  // briefly stores every target the CPU has, cap or no cap. A first kernel
  // call after the cap running on two threads could then run one task on the
  // best target: 1-ulp differences in 22 rows of a double attention capped at
  // avx2 (Heads.AreABatchOfTheirRowsInEveryLayout<double>@avx2, once in CI).
  // Choosing here, on the one thread that caps, settles it before any kernel.
  current_target();
  cap = target;
}

bool avx512_allowed() {
#if HWY_ARCH_X86
  return current_target() <= HWY_AVX3;
#else
  return false;
#endif
}

}  // namespace qkv::kernels
#endif  // HWY_ONCE
