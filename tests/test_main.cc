// main() of every GoogleTest binary: GoogleTest's own, after capping the SIMD
// target at $QKV_SIMD_TARGET (tests/CMakeLists.txt registers the kernel tests
// once per target this CPU supports, each with that variable set).
#include <gtest/gtest.h>

#include <cstdio>

#include "qkv/error.h"
#include "qkv/simd.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  try {
    qkv::set_simd_target_from_env();
  } catch (const qkv::Error& e) {
    // A build configured on another CPU registers targets this one lacks:
    // fail, do not run them on a target nobody asked for.
    std::fprintf(stderr, "%s\n(reconfigure the build on this machine: cmake --fresh)\n", e.what());
    return 1;
  }
  return RUN_ALL_TESTS();
}
