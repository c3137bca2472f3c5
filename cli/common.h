// Shared by the qkv subcommands: loading .npy inputs, writing every output
// file atomically, the options several commands take, and the one place that
// turns an exception into a message and an exit status.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "qkv/tensor.h"

namespace CLI {
class App;
}

namespace qkv::cli {

// Exit statuses (docs/cli.md): bad usage or input is 2, anything else 1.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Bad usage the command itself detects (conflicting options, an input file
// that cannot be opened, an unusable output path). Reported like qkv::Error.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A subcommand as main.cc wires it: its CLI11 app and what it runs once the
// command line has parsed.
struct Command {
  CLI::App* app = nullptr;
  std::function<void()> run;
};

Command add_softmax_command(CLI::App& parent);
Command add_attend_command(CLI::App& parent);
Command add_demo_command(CLI::App& parent);

// x printed with a printf format for one double, e.g. "%.4f"; exact_number
// uses "%.17g", which reads back as the same double.
std::string format_number(double x, const char* format);
inline std::string exact_number(double x) { return format_number(x, "%.17g"); }

// Call from inside a catch block: prints "qkv <command>: error: <message>"
// (or "qkv: error: ..." when `command` is empty) on stderr and returns the
// exit status. CLI11's --help and --version arrive here as exceptions too;
// they print through `app` and return 0.
int report_exception(const CLI::App& app, std::string_view command);

// --threads N (N >= 1) and --seed N (a non-negative decimal integer).
void add_threads_option(CLI::App& command, std::optional<int>& threads);
void add_seed_option(CLI::App& command, uint64_t& seed, const std::string& description);
// qkv::set_num_threads(N) if --threads was given.
void apply_threads(const std::optional<int>& threads);

// A float tensor as read from a .npy file, in the file's type.
using FloatTensor = std::variant<Tensor<float>, Tensor<double>>;

// An input file named on the command line, for messages: "--keys k.npy".
struct Input {
  std::string option;
  std::string path;
  std::string describe() const { return option + " " + path; }
};

// Reads a float32 or float64 .npy file; any other dtype, a missing file or a
// malformed one is an error naming the option and the path.
FloatTensor load_float(const Input& input);
// Reads int32 or int64 valid lengths as int64; float lengths are an error.
Tensor<int64_t> load_valid_lens(const Input& input);

// "float32", "float64"
std::string dtype_name(const FloatTensor& tensor);
const Shape& shape_of(const FloatTensor& tensor);

// The valid lengths as the library takes them, (B) or (B, Nq), for an input
// (`against`, of shape `input_shape`) that is 3-D (B, Nq, .) or 2-D (Nq, .),
// a batch of one. For 2-D inputs `lens` is a scalar or (1): one length, or
// (Nq) or (1, Nq): one per query. Other shapes are an error naming both files.
Tensor<int64_t> batch_valid_lens(const Tensor<int64_t>& lens, const Input& lens_input,
                                 const Input& against, const Shape& input_shape);

// An output file: the option that named it (for messages), where it goes,
// and its complete contents.
struct OutputFile {
  std::string option;
  std::string path;
  std::string bytes;
};

// Fails with UsageError if two output options name the same file or one names
// a directory. Commands call it before computing; write_outputs again.
void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs);

// Writes all the files or none: each is staged to a temporary file in its
// destination's directory, and only when every one is staged are they renamed
// into place. On failure the temporary files are removed and no destination
// is touched. (A rename within a directory fails only if the file system
// does; the files renamed before such a failure stay.)
void write_outputs(const std::vector<OutputFile>& files);

}  // namespace qkv::cli
