// The qkv command: parses the command line with CLI11 and runs one
// subcommand (softmax, attend, demo, regress, lookup, heatmap, info, store,
// index, search); each lives in its own file. Errors and exit statuses
// follow DESIGN.md §4 (common.cc maps exceptions to them).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdint>
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
//
// It runs from .preinit_array: once the libraries are mapped and relocated,
// before any of their initializers (OpenBLAS's, with its pool; Highway's,
// which calibrates a timer for 2.3 ms) and qkv's own, so the first run does
// only the loading. Restarting from main, where the first run had also
// initialized everything, `qkv --version` took 16.4 ms, against 9.1 ms for
// a run that needs no restart; from here it takes 12.8 ms. libc is not
// initialized yet either (environ is still null, and what setenv changes
// would be lost), so the new environment is made from envp the way setenv
// would change it: the first OPENBLAS_NUM_THREADS entry replaced, else one
// appended.
void restart_without_blas_pool(int, char** argv, char** envp) {
  static const char kName[] = "OPENBLAS_NUM_THREADS=";
  static char kSetting[] = "OPENBLAS_NUM_THREADS=1";
  if (envp == nullptr) return;
  size_t count = 0, found = SIZE_MAX;
  for (; envp[count] != nullptr; ++count) {
    if (found == SIZE_MAX && std::strncmp(envp[count], kName, sizeof kName - 1) == 0) {
      found = count;
    }
  }
  if (found != SIZE_MAX && std::strcmp(envp[found], kSetting) == 0) return;
  // The entries, one more if appended, and the null that ends them.
  char** env = static_cast<char**>(std::malloc((count + 2) * sizeof(char*)));
  if (env == nullptr) return;
  std::memcpy(env, envp, count * sizeof(char*));
  if (found != SIZE_MAX) {
    env[found] = kSetting;
  } else {
    env[count++] = kSetting;
  }
  env[count] = nullptr;
  ::execve("/proc/self/exe", argv, env);
  std::free(env);
}

// .preinit_array: called by the dynamic loader before every library
// initializer (ELF gABI; executables only).
using PreinitFunction = void (*)(int, char**, char**);
[[gnu::section(".preinit_array"), gnu::used]] const PreinitFunction restart_entry =
    restart_without_blas_pool;

}  // namespace

int main(int argc, char** argv) {
  qkv::cli::remove_temporaries_on_signals();
  using qkv::cli::Command;
  // The summary names every command (tests/cli/test_help.py checks it).
  CLI::App app(std::string("qkv ") + qkv::kVersion +
                   ": attention pooling on the CPU, on .npy files: masked softmax (softmax), "
                   "attention by dot-product, additive, bilinear or distance scores (attend), "
                   "Nadaraya-Watson kernel regression (regress), a key-value store on disk "
                   "(store) with an index for attention over more rows than memory (index), a "
                   "search engine over Debian's packages (search), the name lookup (lookup), "
                   "heatmaps (heatmap), d2l 11.1-11.3 worked through with figures (demo) and "
                   "the CPU's SIMD support (info)",
               "qkv");
  app.set_version_flag("--version",
                       std::string("qkv ") + qkv::kVersion + " (" + qkv::kLicense + " license)");
  app.require_subcommand(0, 1);
  const Command commands[] = {
      qkv::cli::add_softmax_command(app), qkv::cli::add_attend_command(app),
      qkv::cli::add_demo_command(app),    qkv::cli::add_regress_command(app),
      qkv::cli::add_lookup_command(app),  qkv::cli::add_heatmap_command(app),
      qkv::cli::add_info_command(app),    qkv::cli::add_store_command(app),
      qkv::cli::add_index_command(app),   qkv::cli::add_search_command(app)};
  qkv::cli::set_help_footer(
      app,
      {"qkv demo --out qkv-demo",
       "qkv attend --scoring dot --queries queries.npy --keys keys.npy --values values.npy "
       "--valid-lens lens.npy --out out.npy --weights weights.npy"},
      "docs/cli.md, or qkv COMMAND --help");
  qkv::cli::tidy_help(app);
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
