// Run by tests/CMakeLists.txt at configure time: prints the SIMD targets this
// build compiles that this CPU supports, as a CMake list, with the library's
// own code (kernels/runtime/dispatch.cc is compiled into the probe), so the names are
// those QKV_SIMD_TARGET takes.
#include <cstdio>

#include "kernels/runtime/dispatch.cc"  // NOLINT(bugprone-suspicious-include)

int main() {
  const char* separator = "";
  for (int64_t target : qkv::kernels::available_targets()) {
    std::printf("%s%s", separator, qkv::kernels::target_name(target).c_str());
    separator = ";";
  }
  return 0;
}
