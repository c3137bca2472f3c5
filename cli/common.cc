// Shared by the qkv subcommands: input loading, atomic multi-file output, the
// common options, and the exception-to-exit-status mapping (DESIGN.md §4).
#include "common.h"

#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "qkv/error.h"
#include "qkv/npy.h"
#include "qkv/threads.h"

namespace qkv::cli {
namespace {

namespace fs = std::filesystem;

std::string errno_text(int error) { return std::strerror(error); }

// read_npy reports malformed files; a file that cannot be opened at all is
// the user's mistake too, so it is caught here and reported as usage.
NpyArray read_input(const Input& input) {
  std::error_code ec;
  if (fs::is_directory(input.path, ec)) {
    throw UsageError(input.describe() + ": is a directory, not a .npy file");
  }
  if (std::FILE* f = std::fopen(input.path.c_str(), "rb")) {
    std::fclose(f);
  } else {
    throw UsageError(input.describe() + ": cannot open: " + errno_text(errno));
  }
  try {
    return read_npy(input.path);
  } catch (const qkv::Error& e) {
    throw qkv::Error(input.option + ": " + e.what());  // say which input is malformed
  }
}

const char* npy_dtype_name(const NpyArray& array) {
  static constexpr const char* kNames[] = {"float32", "float64", "int32", "int64"};
  return kNames[array.index()];
}

// The permission bits a newly created file gets (0666 minus the umask), so
// outputs do not inherit mkstemp's 0600.
mode_t new_file_mode() {
  const mode_t mask = ::umask(0);
  ::umask(mask);
  return 0666 & ~mask;
}

// Writes `file` to a fresh temporary file beside its destination; returns the
// temporary's path. The temporary is removed again if anything fails.
std::string stage(const OutputFile& file) {
  const fs::path dest(file.path);
  const fs::path dir = dest.has_parent_path() ? dest.parent_path() : fs::path(".");
  std::string temp = (dir / ("." + dest.filename().string() + ".qkv-XXXXXX")).string();
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) {
    throw UsageError(file.option + " " + file.path + ": cannot create a file in " + dir.string() +
                     ": " + errno_text(errno));
  }
  const auto fail_with = [&](const std::string& what) {
    const int error = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    throw std::runtime_error(file.option + " " + file.path + ": " + what + ": " +
                             errno_text(error));
  };
  const char* data = file.bytes.data();
  size_t left = file.bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, data, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_with("cannot write");
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
  if (::fchmod(fd, new_file_mode()) != 0) fail_with("cannot set permissions");
  // Flushed before the rename, so a crash cannot leave a renamed but empty file.
  if (::fsync(fd) != 0) fail_with("cannot flush");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    throw std::runtime_error(file.option + " " + file.path +
                             ": cannot close: " + errno_text(error));
  }
  return temp;
}

bool all_decimal_digits(const std::string& text) {
  return !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
}

}  // namespace

std::string format_number(double x, const char* format) {
  char text[64];
  std::snprintf(text, sizeof text, format, x);
  return text;
}

int report_exception(const CLI::App& app, std::string_view command) {
  const std::string prefix =
      command.empty() ? std::string("qkv: error: ") : "qkv " + std::string(command) + ": error: ";
  try {
    throw;
  } catch (const CLI::ParseError& e) {
    // --help and --version are ParseErrors with status 0: CLI11 prints them.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << prefix << e.what() << "\nRun 'qkv" << (command.empty() ? "" : " ") << command
              << " --help' for more information.\n";
    return kExitUsage;
  } catch (const qkv::Error& e) {
    std::cerr << prefix << e.what() << '\n';
    return kExitUsage;
  } catch (const UsageError& e) {
    std::cerr << prefix << e.what() << '\n';
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << prefix << e.what() << '\n';
    return kExitFailure;
  } catch (...) {
    std::cerr << prefix << "unknown failure\n";
    return kExitFailure;
  }
}

void add_threads_option(CLI::App& command, std::optional<int>& threads) {
  command
      .add_option("--threads", threads,
                  "Threads to use, N >= 1 (default: QKV_NUM_THREADS or all cores)")
      ->type_name("N")
      ->check(CLI::Validator(
          [](std::string& text) {
            const long long n = std::strtoll(text.c_str(), nullptr, 10);
            return all_decimal_digits(text) && n >= 1 ? std::string()
                                                      : "must be an integer >= 1, got " + text;
          },
          ""));
}

void add_seed_option(CLI::App& command, uint64_t& seed, const std::string& description) {
  // CLI11 would read "-1" as 2^64 - 1 for an unsigned option; refuse it instead.
  command.add_option("--seed", seed, description)
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) {
            return all_decimal_digits(text) ? std::string()
                                            : "must be a non-negative integer, got " + text;
          },
          ""));
}

void apply_threads(const std::optional<int>& threads) {
  if (threads) set_num_threads(*threads);
}

FloatTensor load_float(const Input& input) {
  NpyArray array = read_input(input);
  if (auto* f = std::get_if<Tensor<float>>(&array)) return std::move(*f);
  if (auto* d = std::get_if<Tensor<double>>(&array)) return std::move(*d);
  throw UsageError(input.describe() + " holds " + npy_dtype_name(array) +
                   "; expected float32 or float64");
}

Tensor<int64_t> load_valid_lens(const Input& input) {
  NpyArray array = read_input(input);
  if (auto* i64 = std::get_if<Tensor<int64_t>>(&array)) return std::move(*i64);
  if (auto* i32 = std::get_if<Tensor<int32_t>>(&array)) {
    const std::vector<int32_t>& v = i32->values();
    return Tensor<int64_t>(i32->shape(), std::vector<int64_t>(v.begin(), v.end()));
  }
  throw UsageError(input.describe() + " holds " + npy_dtype_name(array) +
                   "; valid lengths must be int32 or int64");
}

std::string dtype_name(const FloatTensor& tensor) {
  return tensor.index() == 0 ? "float32" : "float64";
}

const Shape& shape_of(const FloatTensor& tensor) {
  return std::visit([](const auto& t) -> const Shape& { return t.shape(); }, tensor);
}

Tensor<int64_t> batch_valid_lens(const Tensor<int64_t>& lens, const Input& lens_input,
                                 const Input& against, const Shape& input_shape) {
  const Shape& shape = lens.shape();
  const auto mismatch = [&](const std::string& expected) {
    throw UsageError(lens_input.describe() + " has shape " + shape.str() + " but " +
                     against.describe() + " has shape " + input_shape.str() + "; expected " +
                     expected);
  };
  if (input_shape.rank() == 3) {
    // Sizes and values are the library's to check; only the rank is ours.
    if (shape.rank() != 1 && shape.rank() != 2) {
      mismatch(Shape{input_shape[0]}.str() + " or " + Shape{input_shape[0], input_shape[1]}.str());
    }
    return Tensor<int64_t>::copy_of(lens.view());
  }
  const int64_t num_queries = input_shape[0];
  if (shape.rank() == 0 || shape == Shape{1}) return Tensor<int64_t>(Shape{1}, lens.values());
  // (1, Nq) is the batched form of one length per query, for a batch of one.
  if (shape == Shape{num_queries} || shape == Shape{1, num_queries}) {
    return Tensor<int64_t>(Shape{1, num_queries}, lens.values());
  }
  mismatch(std::string("[] or [1] (one length), or ") + Shape{num_queries}.str() + " or " +
           Shape{1, num_queries}.str() + " (one per query)");
  return {};  // unreachable: mismatch throws
}

void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::error_code ec;
    if (fs::is_directory(outputs[i].second, ec)) {
      throw UsageError(outputs[i].first + " " + outputs[i].second + ": is a directory");
    }
    for (size_t j = 0; j < i; ++j) {
      const fs::path a = fs::absolute(outputs[i].second).lexically_normal();
      const fs::path b = fs::absolute(outputs[j].second).lexically_normal();
      if (a == b) {
        throw UsageError(outputs[j].first + " and " + outputs[i].first + " name the same file " +
                         outputs[i].second);
      }
    }
  }
}

void write_outputs(const std::vector<OutputFile>& files) {
  std::vector<std::pair<std::string, std::string>> paths;
  for (const OutputFile& file : files) paths.emplace_back(file.option, file.path);
  check_output_paths(paths);
  std::vector<std::string> temps;
  size_t renamed = 0;
  try {
    for (const OutputFile& file : files) temps.push_back(stage(file));
    // Each rename stays within one directory, so once everything is staged
    // only a failing file system can stop the renames part way.
    for (; renamed < files.size(); ++renamed) {
      if (std::rename(temps[renamed].c_str(), files[renamed].path.c_str()) != 0) {
        throw std::runtime_error(
            files[renamed].option + " " + files[renamed].path +
            ": cannot rename the finished file into place: " + errno_text(errno));
      }
    }
  } catch (...) {
    for (size_t i = renamed; i < temps.size(); ++i) ::unlink(temps[i].c_str());
    throw;
  }
}

}  // namespace qkv::cli
