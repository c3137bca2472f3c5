// A target this build has but the CPU lacks: the switch must refuse it with
// a message that says so. No CPU lacks what the machine running the tests
// has, so this binary tells Highway (hwy::SetSupportedTargetsForTest, before
// qkv asks for the first time) that the best target the CPU supports is
// missing: on an AVX-512 machine it then behaves as an AVX2 one, on an AVX2
// machine as an SSE4 one. Its own main(), as the override must come first.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/runtime/dispatch.h"
#include "qkv/simd.h"
#include "test_util.h"

namespace qkv::test {
namespace {

int64_t hidden_target = 0;  // the real best target, hidden from qkv

TEST(SimdUnsupported, ATargetTheCpuLacksIsRefusedAndSaysSo) {
  ASSERT_NE(hidden_target, 0);
  const std::string name = kernels::target_name(hidden_target);
  const SimdInfo info = simd_info();
  EXPECT_NE(std::find(info.compiled.begin(), info.compiled.end(), name), info.compiled.end());
  EXPECT_EQ(std::find(info.supported.begin(), info.supported.end(), name), info.supported.end())
      << name << " was hidden";
  EXPECT_NE(info.chosen, name);
  expect_error([&] { set_simd_target(name); },
               {"set_simd_target", "\"" + name + "\"",
                "this build has but this CPU does not support", "expected one of: " +
                                                                   info.supported.front()});
  EXPECT_EQ(simd_target(), info.supported.front()) << "a refused cap changes nothing";
}

}  // namespace
}  // namespace qkv::test

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  // The best target this build has that the CPU supports (lowest bit first).
  const int64_t real = HWY_TARGETS & hwy::SupportedTargets();
  qkv::test::hidden_target = real & -real;
  if ((real & ~qkv::test::hidden_target) == 0) {
    std::fprintf(stderr, "only one SIMD target here: nothing to hide\n");
    return 1;
  }
  hwy::SetSupportedTargetsForTest(real & ~qkv::test::hidden_target);
  return RUN_ALL_TESTS();
}
