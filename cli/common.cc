// Shared by the qkv subcommands: input opening and loading, atomic multi-file
// output, the common options, JSON strings, signal cleanup of temporary
// files, and the exception-to-exit-status mapping (DESIGN.md §4).
#include "common.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "qkv/npy.h"
#include "qkv/staged_file.h"
#include "qkv/threads.h"

namespace qkv::cli {
namespace {

std::string errno_text(int error) { return std::strerror(error); }

const char* npy_dtype_name(const NpyArray& array) {
  static constexpr const char* kNames[] = {"float32", "float64", "int32", "int64", "bool or uint8"};
  return kNames[array.index()];
}

bool all_decimal_digits(const std::string& text) {
  return !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
}

// "" for a thread count in [1, kMaxThreads], else what is wrong with it.
std::string thread_count_problem(const std::string& text) {
  const std::string range = "an integer from 1 to " + std::to_string(kMaxThreads) +
                            " (qkv's thread limit), got \"" + text + "\"";
  if (!all_decimal_digits(text)) return "must be " + range;
  const long long n = std::strtoll(text.c_str(), nullptr, 10);  // saturates: still > the cap
  return n >= 1 && n <= kMaxThreads ? std::string() : "must be " + range;
}

// The number syntax of require_number: what std::from_chars reads as a whole,
// with an optional leading '+'.
bool is_number(std::string_view text) {
  if (!text.empty() && text[0] == '+') text.remove_prefix(1);
  if (text.empty()) return false;
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  // Out of range still is a number (1e999); the command judges its value.
  return ptr == end && (ec == std::errc() || ec == std::errc::result_out_of_range);
}

bool is_integer(std::string_view text) {
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) text.remove_prefix(1);
  return !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos;
}

}  // namespace

OpenInput::OpenInput(const Input& input) : input_(input) {
  if (input.path.empty())
    throw UsageError(input.option + " \"\": the path is empty; expected a file");
  fd_ = ::open(input.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw UsageError(input.describe() + ": cannot open: " + errno_text(errno));
  struct stat st;
  if (::fstat(fd_, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw UsageError(input.describe() + ": is a directory, not a file");
  }
}

OpenInput::~OpenInput() {
  if (fd_ >= 0) ::close(fd_);
}

std::string OpenInput::read_prefix(size_t n) {
  std::string bytes(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::read(fd_, bytes.data() + done, n - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw UsageError(input_.describe() + ": cannot read: " + errno_text(errno));
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  bytes.resize(done);
  return bytes;
}

bool is_npy_prefix(std::string_view prefix) {
  return prefix.size() >= kNpyMagicLength && prefix.substr(0, kNpyMagicLength) == "\x93NUMPY";
}

NpyArray read_npy_input(const Input& input, OpenInput& file, std::string_view consumed) {
  try {
    return read_npy(file.fd(), input.path, consumed);
  } catch (const qkv::Error& e) {
    throw qkv::Error(input.option + ": " + e.what());  // say which input is malformed
  }
}

std::string shortest_number(double x) {
  char buffer[32];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, x);
  return error == std::errc() ? std::string(buffer, end) : exact_number(x);
}

std::string format_number(double x, const char* format) {
  char text[64];
  std::snprintf(text, sizeof text, format, x);
  return text;
}

// Writes a whole message to stderr at once: std::cerr writes each << piece
// by itself, and under mpirun another process's lines came in between
// ("qkv attend: error: " and "rank 2 of 3: ..." split by mpirun's banner).
namespace {
void tell(const std::string& message) {
  std::fwrite(message.data(), 1, message.size(), stderr);
  std::fflush(stderr);
}

std::string error_prefix(std::string_view command) {
  if (command.empty()) return "qkv: error: ";
  return "qkv " + std::string(command) + ": error: ";
}
}  // namespace

namespace {

// Edits (insert, delete, substitute, swap two neighbours) from a to b.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min(
          {d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// "; did you mean X?" for the nearest of `known` to `word` (within a third
// of its length, at least 1 edit and at most 3), or "".
std::string nearest(std::string_view word, const std::vector<std::string>& known) {
  const size_t reach = std::clamp<size_t>(word.size() / 3, 1, 3);
  std::string best;
  size_t best_distance = reach + 1;
  for (const std::string& k : known) {
    const size_t distance = edit_distance(word, k);
    if (distance < best_distance) {
      best = k;
      best_distance = distance;
    }
  }
  return best.empty() ? "" : "; did you mean " + best + "?";
}

// The first word of `argv` that `root` does not know, and the top-level
// command it was given to; an empty message if every word was known.
struct UnknownWord {
  std::string command, message;
};

UnknownWord find_unknown_word(CLI::App& root, int argc, char** argv) {
  CLI::App* app = &root;
  std::string command;
  bool value_next = false;  // the word after an option that takes a value is that value
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word == "--") break;
    if (value_next) {
      value_next = false;
      continue;
    }
    if (word.size() > 2 && word.rfind("--", 0) == 0) {
      const std::string name = word.substr(0, word.find('='));
      const CLI::Option* option = app->get_option_no_throw(name);
      if (option == nullptr) {
        std::vector<std::string> known;
        for (const CLI::Option* o : app->get_options()) {
          for (const std::string& long_name : o->get_lnames()) known.push_back("--" + long_name);
        }
        return {command, "unknown option " + name + nearest(name, known)};
      }
      value_next = word.find('=') == std::string::npos && option->get_items_expected_max() > 0;
      continue;
    }
    if (word[0] == '-') continue;  // a short option, or a negative number
    // A bare word: a subcommand where the app has some and takes no
    // positional argument of its own, else an argument.
    std::vector<CLI::App*> subcommands = app->get_subcommands([](CLI::App*) { return true; });
    if (subcommands.empty()) continue;
    CLI::App* next = nullptr;
    std::vector<std::string> names;
    for (CLI::App* sub : subcommands) {
      names.push_back(sub->get_name());
      if (sub->check_name(word)) next = sub;
    }
    if (next == nullptr) {
      bool positional = false;
      for (const CLI::Option* o : app->get_options()) positional |= o->get_positional();
      if (positional) continue;
      return {command, "unknown command " + word + nearest(word, names)};
    }
    app = next;
    if (command.empty()) command = next->get_name();
  }
  return {};
}

}  // namespace

int report_exception(const CLI::App& app, std::string_view command) {
  try {
    throw;
  } catch (const CLI::ParseError& e) {
    // --help and --version are ParseErrors with status 0: CLI11 prints them.
    if (e.get_exit_code() == 0) return app.exit(e);
    tell(error_prefix(command) + e.what() + "\nRun 'qkv" + (command.empty() ? "" : " ") +
         std::string(command) + " --help' for more information.\n");
    return kExitUsage;
  } catch (...) {
    return report_error(command);
  }
}

int report_parse_error(CLI::App& root, std::string_view command, int argc, char** argv) {
  try {
    throw;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() != 0) {  // not --help or --version
      const UnknownWord unknown = find_unknown_word(root, argc, argv);
      if (!unknown.message.empty()) {
        tell(error_prefix(unknown.command) + unknown.message + "\nRun 'qkv" +
             (unknown.command.empty() ? "" : " ") + unknown.command +
             " --help' for more information.\n");
        return kExitUsage;
      }
    }
  } catch (...) {
  }
  return report_exception(root, command);
}

namespace {
std::vector<std::string>& deprecation_warnings() {
  static std::vector<std::string> warnings;
  return warnings;
}
}  // namespace

void note_deprecated(const std::string& warning) {
  std::vector<std::string>& warnings = deprecation_warnings();
  if (std::find(warnings.begin(), warnings.end(), warning) == warnings.end()) {
    warnings.push_back(warning);
  }
}

void print_deprecation_warnings() {
  for (const std::string& warning : deprecation_warnings()) tell(warning);
  deprecation_warnings().clear();
}

int report_error(std::string_view command) {
  const std::string prefix = error_prefix(command);
  try {
    throw;
  } catch (const ReportedError& e) {
    return e.status;
  } catch (const qkv::Error& e) {
    tell(prefix + e.what() + "\n");
    return kExitUsage;
  } catch (const UsageError& e) {
    tell(prefix + e.what() + "\n");
    return kExitUsage;
  } catch (const std::bad_alloc&) {
    tell(prefix +
         "out of memory: an allocation failed (std::bad_alloc); the inputs and results "
         "need more memory than this process may use (see ulimit -v)\n");
    return kExitFailure;
  } catch (const std::exception& e) {
    tell(prefix + e.what() + "\n");
    return kExitFailure;
  } catch (...) {
    tell(prefix + "unknown failure\n");
    return kExitFailure;
  }
}

void set_help_footer(CLI::App& command, const std::vector<std::string>& examples,
                     const std::string& doc) {
  std::string footer = "Examples:\n";
  for (const std::string& example : examples) footer += "  " + example + "\n";
  command.footer(footer + "More: " + doc);
}

void tidy_help(CLI::App& root) {
  for (CLI::Option* option : root.get_options()) {
    // Option has no count of its checks; get_validator(i) throws past the last.
    for (int i = 0;; ++i) {
      CLI::Validator* check = nullptr;
      try {
        check = option->get_validator(i);
      } catch (const CLI::OptionNotFound&) {
        break;
      }
      check->description("");
    }
  }
  for (CLI::App* command : root.get_subcommands({})) tidy_help(*command);
}

void add_threads_option(CLI::App& command, std::optional<int>& threads) {
  command
      .add_option("--threads", threads,
                  "Threads to use, 1 <= N <= " + std::to_string(kMaxThreads) +
                      " (default: QKV_NUM_THREADS or all cores)")
      ->type_name("N")
      ->check(CLI::Validator([](std::string& text) { return thread_count_problem(text); }, ""));
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
  if (threads) {
    set_num_threads(*threads);
    return;
  }
  if (const char* env = std::getenv("QKV_NUM_THREADS")) {
    const std::string problem = thread_count_problem(env);
    if (!problem.empty()) throw UsageError("QKV_NUM_THREADS " + problem);
  }
}

CLI::Option* require_number(CLI::Option* option) {
  return option->check(CLI::Validator(
      [](std::string& text) {
        return is_number(text) ? std::string() : "must be a number, got \"" + text + "\"";
      },
      ""));
}

CLI::Option* require_integer(CLI::Option* option) {
  return option->check(CLI::Validator(
      [](std::string& text) {
        return is_integer(text) ? std::string() : "must be a whole number, got \"" + text + "\"";
      },
      ""));
}

CLI::Option* require_path(CLI::Option* option) {
  return option->check(CLI::Validator(
      [](std::string& text) {
        return text.empty() ? std::string("the path is empty; expected a file name")
                            : std::string();
      },
      ""));
}

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size();) {
    const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
    const unsigned char b = byte(i);
    if (b == '"' || b == '\\') {
      out += '\\';
      out += static_cast<char>(b);
      ++i;
      continue;
    }
    if (b < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", b);
      out += escape;
      ++i;
      continue;
    }
    // A UTF-8 sequence is copied whole; anything else (a stray continuation
    // byte, a cut-off sequence, an overlong form, a surrogate, a code point
    // past U+10FFFF) becomes U+FFFD, one per byte.
    size_t n = b < 0x80                 ? 1
               : b >= 0xc2 && b <= 0xdf ? 2
               : b >= 0xe0 && b <= 0xef ? 3
               : b >= 0xf0 && b <= 0xf4 ? 4
                                        : 0;
    if (n > 1) {
      if (i + n > text.size()) n = 0;
      for (size_t k = 1; n != 0 && k < n; ++k) {
        if ((byte(i + k) & 0xc0) != 0x80) n = 0;
      }
      if (n != 0) {
        const unsigned char b1 = byte(i + 1);
        if ((b == 0xe0 && b1 < 0xa0) || (b == 0xed && b1 >= 0xa0) || (b == 0xf0 && b1 < 0x90) ||
            (b == 0xf4 && b1 >= 0x90)) {
          n = 0;
        }
      }
    }
    if (n == 0) {
      out += "\xef\xbf\xbd";  // U+FFFD REPLACEMENT CHARACTER
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out + "\"";
}

std::string join(const std::vector<std::string>& items, std::string_view separator,
                 std::string_view last_separator) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0)
      text += i + 1 == items.size() && !last_separator.empty() ? last_separator : separator;
    text += items[i];
  }
  return text;
}

FloatTensor load_float(const Input& input, OpenInput& file, std::string_view consumed) {
  NpyArray array = read_npy_input(input, file, consumed);
  if (auto* f = std::get_if<Tensor<float>>(&array)) return std::move(*f);
  if (auto* d = std::get_if<Tensor<double>>(&array)) return std::move(*d);
  throw UsageError(input.describe() + " holds " + npy_dtype_name(array) +
                   "; expected float32 or float64");
}

FloatTensor load_float(const Input& input) {
  OpenInput file(input);
  return load_float(input, file, {});
}

LensTensor load_valid_lens(const Input& input) {
  OpenInput file(input);
  NpyArray array = read_npy_input(input, file);
  if (auto* i64 = std::get_if<Tensor<int64_t>>(&array)) return std::move(*i64);
  if (auto* i32 = std::get_if<Tensor<int32_t>>(&array)) return std::move(*i32);
  throw UsageError(input.describe() + " holds " + npy_dtype_name(array) +
                   "; valid lengths must be int32 or int64");
}

Tensor<uint8_t> load_byte_mask(const Input& input) {
  OpenInput file(input);
  NpyArray array = read_npy_input(input, file);
  if (auto* bytes = std::get_if<Tensor<uint8_t>>(&array)) return std::move(*bytes);
  throw UsageError(input.describe() + " holds " + npy_dtype_name(array) +
                   "; a mask must be bool or uint8 (nonzero = takes part)");
}

std::string dtype_name(const FloatTensor& tensor) {
  return tensor.index() == 0 ? "float32" : "float64";
}

const Shape& shape_of(const FloatTensor& tensor) {
  return std::visit([](const auto& t) -> const Shape& { return t.shape(); }, tensor);
}

ValidLens batch_valid_lens(const LensTensor& lens, const Input& lens_input, const Input& against,
                           const Shape& input_shape) {
  const ValidLens given =
      std::visit([](const auto& tensor) -> ValidLens { return tensor.view(); }, lens);
  if (input_shape.rank() == 2) {
    return given.for_batch_of_one("", lens_input.describe(), against.describe(), input_shape);
  }
  // Sizes and values are the library's to check; only the rank is ours.
  // 3-D (B, Nq, ·) or heads (B, H, Nq, ·): lengths (B) or (B, Nq).
  const Shape shape = given.shape();
  if (shape.rank() != 1 && shape.rank() != 2) {
    const int64_t nq = input_shape[input_shape.rank() - 2];
    throw UsageError(lens_input.describe() + " has shape " + shape.str() + " but " +
                     against.describe() + " has shape " + input_shape.str() + "; expected " +
                     Shape{input_shape[0]}.str() + " or " + Shape{input_shape[0], nq}.str());
  }
  return given;
}

ValidLens read_valid_lens(const std::string& path, const Input& against, const Shape& input_shape,
                          LensTensor& storage) {
  if (path.empty()) return {};
  const Input lens_input{"--valid-lens", path};
  storage = load_valid_lens(lens_input);
  return batch_valid_lens(storage, lens_input, against, input_shape);
}

void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs) {
  qkv::check_output_paths("", outputs);
}

void check_outputs_outside(const std::vector<std::pair<std::string, std::string>>& outputs,
                           const std::vector<InputDirectory>& inputs) {
  namespace fs = std::filesystem;
  for (const auto& [option, path] : outputs) {
    std::error_code error;
    const fs::path out = fs::weakly_canonical(path, error);
    if (error) continue;  // the output's own checks name what is wrong with it
    for (const InputDirectory& input : inputs) {
      const fs::path dir = fs::weakly_canonical(input.dir, error);
      if (error) continue;
      const auto [dir_end, out_at] = std::mismatch(dir.begin(), dir.end(), out.begin(), out.end());
      if (dir_end == dir.end()) {
        throw UsageError(option + " " + path + " is inside " + input.option + " " + input.dir +
                         "; an output must not be one of an input " + input.kind + "'s files");
      }
    }
  }
}

void write_outputs(const std::vector<OutputFile>& files) {
  std::vector<OutputBytes> outputs;
  for (const OutputFile& file : files) outputs.push_back({file.option, file.path, file.bytes});
  write_files("", outputs);
}

namespace {

// Runs in whatever thread the signal hits, so only async-signal-safe calls:
// unlink (inside remove_staged_files), signal, raise, atomics. The re-raised signal
// is blocked until the handler returns, then kills the process as it would
// have without the handler, so the parent sees the same status.
void remove_temporaries_and_die(int signal_number) {
  if (defer_signal(signal_number)) return;  // raised again once a commit is whole
  remove_staged_files();
  ::signal(signal_number, SIG_DFL);
  ::raise(signal_number);
}

}  // namespace

void remove_temporaries_on_signals() {
  for (const int signal_number : {SIGHUP, SIGINT, SIGTERM, SIGPIPE}) {
    struct sigaction old {};
    // A signal the caller ignores (nohup, a background job's SIGINT) stays ignored.
    if (::sigaction(signal_number, nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction action {};
    action.sa_handler = remove_temporaries_and_die;
    sigemptyset(&action.sa_mask);
    ::sigaction(signal_number, &action, nullptr);
  }
}

}  // namespace qkv::cli
