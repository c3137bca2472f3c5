// The qkv command: parses the command line with CLI11 and runs one
// subcommand (softmax, attend, demo, regress, lookup, heatmap, info, store,
// index, search); each lives in its own file. Errors and exit statuses
// follow DESIGN.md §4 (common.cc maps exceptions to them).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "common.h"
#include "qkv/simd.h"
#include "qkv/version.h"

namespace qkv::cli {
Command add_regress_command(CLI::App& parent);  // regress.cc
Command add_lookup_command(CLI::App& parent);   // lookup.cc
Command add_heatmap_command(CLI::App& parent);  // heatmap.cc
Command add_info_command(CLI::App& parent);     // info.cc
Command add_store_command(CLI::App& parent);    // store.cc
Command add_index_command(CLI::App& parent);    // index.cc
Command add_search_command(CLI::App& parent);   // search.cc
}  // namespace qkv::cli

namespace {

// Debian's OpenBLAS (the pthread build) starts a pool of nproc - 1 threads
// when it is loaded, before main, and each reserves a 128 MiB buffer. qkv
// never uses them (every BLAS call runs single-threaded inside qkv's own
// OpenMP tasks, src/kernels/runtime/parallel.h), and under an address-space limit below that
// buffer (ulimit -v) a pool thread retries its allocation forever: it burns a
// core for the whole run and exit() then waits for it forever. OpenBLAS sizes
// the pool from OPENBLAS_NUM_THREADS when it loads, so the command sets it to 1
// and runs itself again, once, before anything else. Without /proc (no
// /proc/self/exe) it goes on with the pool.
void restart_without_blas_pool(char** argv) {
  const char* set = std::getenv("OPENBLAS_NUM_THREADS");
  if (set != nullptr && std::strcmp(set, "1") == 0) return;
  if (::setenv("OPENBLAS_NUM_THREADS", "1", 1) != 0) return;
  ::execv("/proc/self/exe", argv);
}

}  // namespace

int main(int argc, char** argv) {
  restart_without_blas_pool(argv);
  qkv::cli::remove_temporaries_on_signals();
  using qkv::cli::Command;
  CLI::App app(std::string("qkv ") + qkv::kVersion +
                   ": attention pooling (masked softmax, scaled dot-product and additive "
                   "attention) on .npy files",
               "qkv");
  app.set_version_flag("--version", std::string("qkv ") + qkv::kVersion);
  app.require_subcommand(0, 1);
  const Command commands[] = {
      qkv::cli::add_softmax_command(app), qkv::cli::add_attend_command(app),
      qkv::cli::add_demo_command(app),    qkv::cli::add_regress_command(app),
      qkv::cli::add_lookup_command(app),  qkv::cli::add_heatmap_command(app),
      qkv::cli::add_info_command(app),    qkv::cli::add_store_command(app),
      qkv::cli::add_index_command(app),   qkv::cli::add_search_command(app)};
  const auto selected = [&]() -> const Command* {
    for (const Command& command : commands) {
      if (command.app->parsed()) return &command;
    }
    return nullptr;
  };

  try {
    app.parse(argc, argv);
  } catch (...) {
    const Command* command = selected();
    return qkv::cli::report_parse_error(app, command ? command->app->get_name() : "", argc, argv);
  }
  const Command* command = selected();
  if (command == nullptr) {
    std::cerr << "qkv: error: no command given\n\n" << app.help();
    return qkv::cli::kExitUsage;
  }
  qkv::cli::print_deprecation_warnings();
  try {
    qkv::set_simd_target_from_env();  // QKV_SIMD_TARGET=avx2 etc.: docs/cli.md
    command->run();
    return qkv::cli::kExitOk;
  } catch (...) {
    return qkv::cli::report_exception(app, command->app->get_name());
  }
}
