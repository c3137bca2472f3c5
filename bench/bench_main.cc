// main() of the Google Benchmark binaries without one of their own: Google
// Benchmark's, after capping the SIMD target at $QKV_SIMD_TARGET (the target
// is recorded in the output's context).
#include <benchmark/benchmark.h>

#include <cstdio>

#include "qkv/error.h"
#include "qkv/simd.h"

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    qkv::set_simd_target_from_env();
  } catch (const qkv::Error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 2;
  }
  benchmark::AddCustomContext("simd_target", qkv::simd_target());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
