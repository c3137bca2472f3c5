// `qkv info`: what this build and this machine offer and what the kernels
// run on: the CPU and the features qkv looks for, the SIMD targets compiled
// in, those this CPU supports and the one chosen (after QKV_SIMD_TARGET's
// cap), how bf16 products run, the thread count and the BLAS. --json for
// scripts (bench/performance.py records the same facts).
#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

#include "common.h"
#include "qkv/simd.h"
#include "qkv/threads.h"
#include "qkv/version.h"

namespace qkv::cli {
namespace {

struct InfoArgs {
  bool json = false;
};

// /proc/cpuinfo's "model name", or "" where there is none.
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t start = line.find_first_not_of(' ', colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "";
}

std::string json_list(const std::vector<std::string>& items) {
  std::vector<std::string> quoted;
  for (const std::string& item : items) quoted.push_back(json_string(item));
  return "[" + join(quoted) + "]";
}

void run_info(const InfoArgs& args) {
  const SimdInfo info = simd_info();
  const std::string model = cpu_model();
  const unsigned cores = std::thread::hardware_concurrency();
  std::vector<std::string> has, lacks;
  for (const auto& [feature, present] : info.cpu_features)
    (present ? has : lacks).push_back(feature);
  const std::string chosen_why =
      info.cap.empty() ? "the best this CPU supports"
                       : "capped at " + info.cap + " (QKV_SIMD_TARGET or set_simd_target)";
  std::ostringstream out;
  if (args.json) {
    out << "{\"version\": " << json_string(kVersion) << ", \"cpu\": " << json_string(model)
        << ", \"hardware_threads\": " << cores << ", \"cpu_features\": " << json_list(has)
        << ", \"cpu_features_missing\": " << json_list(lacks)
        << ", \"simd_targets_compiled\": " << json_list(info.compiled)
        << ", \"simd_targets_supported\": " << json_list(info.supported)
        << ", \"simd_target\": " << json_string(info.chosen)
        << ", \"simd_cap\": " << (info.cap.empty() ? "null" : json_string(info.cap))
        << ", \"bf16_products\": " << json_string(info.bf16_products)
        << ", \"bf16_products_why\": " << json_string(info.bf16_products_why)
        << ", \"threads\": " << num_threads() << ", \"blas\": " << json_string(info.blas)
        << ", \"blas_core\": " << json_string(info.blas_core)
        << ", \"blas_core_found\": " << json_string(info.blas_core_found)
        << ", \"blas_core_from\": " << json_string(info.blas_core_from)
        << ", \"blas_core_action\": " << json_string(info.blas_core_action) << "}\n";
  } else {
    out << "qkv " << kVersion << "\n"
        << "CPU:                    " << (model.empty() ? "(unknown)" : model) << ", " << cores
        << " hardware threads\n"
        << "CPU features qkv uses:  " << (has.empty() ? "none" : join(has, " ")) << "\n"
        << "  missing:              " << (lacks.empty() ? "none" : join(lacks, " ")) << "\n"
        << "SIMD targets compiled:  " << join(info.compiled) << "\n"
        << "  this CPU runs:        " << join(info.supported) << "\n"
        << "  chosen:               " << info.chosen << " (" << chosen_why << ")\n"
        << "bf16 products:          " << info.bf16_products
        << (info.bf16_products == "widen" ? " (bf16 widened to float32 for the float32 kernels: "
                                          : " (")
        << info.bf16_products_why << ")\n"
        << "threads:                " << num_threads() << "\n"
        << "BLAS:                   " << info.blas << "\n"
        << "BLAS kernels:           " << info.blas_core << " (OpenBLAS chose "
        << info.blas_core_found << ", from " << info.blas_core_from << "; qkv "
        << info.blas_core_action << ")\n";
  }
  std::cout << out.str();
}

}  // namespace

Command add_info_command(CLI::App& parent) {
  auto args = std::make_shared<InfoArgs>();
  CLI::App* app = parent.add_subcommand(
      "info",
      "Print the CPU features, the SIMD targets compiled in and supported, the one the kernels "
      "run on (QKV_SIMD_TARGET caps it), how bf16 products run, threads and the BLAS");
  app->add_flag("--json", args->json, "Print the same as JSON");
  set_help_footer(*app, {"qkv info", "qkv info --json"}, "docs/cli.md#qkv-info");
  return {app, [args] { run_info(*args); }};
}

}  // namespace qkv::cli
