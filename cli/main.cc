// The qkv command: parses the command line with CLI11 and runs one
// subcommand (softmax, attend, demo); each lives in its own file. Errors and
// exit statuses follow DESIGN.md §4 (common.cc maps exceptions to them).
#include <CLI/CLI.hpp>
#include <iostream>
#include <string>

#include "common.h"
#include "qkv/simd.h"
#include "qkv/version.h"

namespace qkv::cli {
Command add_regress_command(CLI::App& parent);  // regress.cc
Command add_lookup_command(CLI::App& parent);   // lookup.cc
Command add_heatmap_command(CLI::App& parent);  // heatmap.cc
}  // namespace qkv::cli

int main(int argc, char** argv) {
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
      qkv::cli::add_lookup_command(app),  qkv::cli::add_heatmap_command(app)};
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
    return qkv::cli::report_exception(app, command ? command->app->get_name() : "");
  }
  const Command* command = selected();
  if (command == nullptr) {
    std::cerr << "qkv: error: no command given\n\n" << app.help();
    return qkv::cli::kExitUsage;
  }
  try {
    qkv::set_simd_target_from_env();  // QKV_SIMD_TARGET=avx2 etc.: docs/cli.md
    command->run();
    return qkv::cli::kExitOk;
  } catch (...) {
    return qkv::cli::report_exception(app, command->app->get_name());
  }
}
