// Shared by the qkv subcommands: opening inputs (each once), loading .npy
// inputs, writing every output file atomically (qkv::write_files), the
// options several commands take, JSON strings, and the one place that turns an
// exception into a message and an exit status.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "qkv/npy.h"
#include "qkv/tensor.h"
#include "qkv/valid_lens.h"

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

// The end of a command's --help (docs/cli.md, "Conventions"): one or two
// examples that run as written on the files of the examples before them
// (tests/cli/test_help.py runs them in that order) and the page of docs/ to
// read, e.g.
//   Examples:
//     qkv softmax --scores scores.npy --valid-lens lens.npy --out weights.npy
//   More: docs/cli.md#qkv-softmax
void set_help_footer(CLI::App& command, const std::vector<std::string>& examples,
                     const std::string& doc);

// Called once every command is added: CLI11 appends each check's description
// to an option's value name in --help ("--top-k K:INT in [0 - 68719476736]",
// "--scoring TEXT:{dot,additive,...}"); each option's own description says
// its range and choices in words, so those are dropped (the checks stay).
void tidy_help(CLI::App& root);

// x printed with a printf format for one double, e.g. "%.4f"; exact_number
// uses "%.17g", which reads back as the same double.
std::string format_number(double x, const char* format);
inline std::string exact_number(double x) { return format_number(x, "%.17g"); }
// A number in JSON, which has no NaN or infinity: those are null, so every
// --json output parses.
inline std::string json_number(double x) { return std::isfinite(x) ? exact_number(x) : "null"; }
// The shortest text that reads back as x ("1e-200", "0.1", "-1e-09"): a
// number in a message as the user typed it, not exact_number's 17 digits.
std::string shortest_number(double x);

// Distance scores are -scale |q - k|^2 / 2: a scale so large (a bandwidth so
// small) that they overflow the float type makes a query's weights
// inf - inf, NaN, silently. The inputs are finite (refused otherwise when
// read), so a NaN in `output` (rows of `row_size`) is that overflow: a
// UsageError naming the option as the user gave it (`scale_option`, e.g.
// "--bandwidth 1e-25") and the first query it reached.
// " is too small" for a bandwidth, " is too large" for a scale.
inline std::string too_small_or_large(const std::string& scale_option) {
  return scale_option.rfind("--scale", 0) == 0 ? " is too large" : " is too small";
}

// Before computing: a scale beyond the compute type's range (float32 for
// float32 and bfloat16 inputs) makes every score of every query overflow, so
// it is refused at once, naming the smallest bandwidth that fits.
inline void check_distance_scale(double scale, bool float32, const std::string& scale_option) {
  const double largest = float32 ? 3.4028234663852886e38 : 1.7976931348623157e308;
  if (scale <= largest) return;
  throw UsageError(scale_option + too_small_or_large(scale_option) + " for " +
                   (float32 ? "float32" : "float64") +
                   " inputs: the scale 1/H^2 = " + format_number(scale, "%.3g") + " is beyond " +
                   (float32 ? "float32" : "float64") + "'s range (" +
                   format_number(largest, "%.3g") + "); give a bandwidth of at least " +
                   format_number(1.0 / std::sqrt(largest) * (1 + 1e-3), "%.3g"));
}

template <class T>
void check_distance_overflow(const T* output, int64_t count, int64_t row_size,
                             const std::string& scale_option) {
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isnan(output[i])) continue;
    throw UsageError(
        scale_option + too_small_or_large(scale_option) +
        " for these inputs: the scores |q - k|^2 / (2 H^2) overflow " +
        (sizeof(T) == 4 ? "float32 (largest 3.4e+38)" : "float64 (largest 1.8e+308)") +
        ", so the weights of query " + std::to_string(i / row_size) +
        " (counted over the batch) are NaN; give a larger bandwidth (as it shrinks, each "
        "query's output tends to its nearest key's value)");
  }
}

// report_exception for a failed parse of the command line: a word the
// command does not know (an option of the subcommand it follows, or a
// subcommand) is named first, with the nearest known one ("unknown option
// --querys; did you mean --queries?"), not CLI11's message, which names
// what the typo hid ("--queries is required").
int report_parse_error(CLI::App& root, std::string_view command, int argc, char** argv);

// Call from inside a catch block: prints "qkv <command>: error: <message>"
// (or "qkv: error: ..." when `command` is empty) on stderr and returns the
// exit status. CLI11's --help and --version arrive here as exceptions too;
// they print through `app` and return 0.
int report_exception(const CLI::App& app, std::string_view command);
// The same for any error but CLI11's (from inside a catch block): prints it
// and returns the exit status; a ReportedError was printed already.
int report_error(std::string_view command);

// An error report_error has already printed, with the exit status it gave.
struct ReportedError {
  int status;
};

// --threads N (1 <= N <= qkv::kMaxThreads) and --seed N (a non-negative
// decimal integer).
void add_threads_option(CLI::App& command, std::optional<int>& threads);
void add_seed_option(CLI::App& command, uint64_t& seed, const std::string& description);
// qkv::set_num_threads(N) if --threads was given; otherwise a QKV_NUM_THREADS
// that is set must hold a thread count as --threads would (the library would
// ignore it silently), else UsageError.
void apply_threads(const std::optional<int>& threads);

// Numeric options are checked as text before CLI11 converts them: it takes
// an empty string for "not given" (so `--scale ""` would silently mean the
// default) and would read "1.5" as 1 for an integer. require_number accepts a
// decimal or exponent number (std::from_chars syntax, optionally with '+',
// also nan and inf for the command to judge); require_integer a whole number,
// optionally signed. Each returns its option for chaining.
CLI::Option* require_number(CLI::Option* option);
CLI::Option* require_integer(CLI::Option* option);
// File options refuse an empty path while the command line is parsed, before
// any work: commands take an empty value for "not given", which would
// otherwise make `--weights ""` silently write nothing.
CLI::Option* require_path(CLI::Option* option);

// A warning for stderr, printed by print_deprecation_warnings once the
// whole command line has parsed (one that fails to parse prints its error
// alone); the same warning twice is printed once.
void note_deprecated(const std::string& warning);
void print_deprecation_warnings();

// The old spelling of an option, kept for one release (docs/architecture.md,
// "Names"): listed under "Deprecated" in --help, it sets the same variable
// as `current`, warns "qkv <command>: warning: <old> is deprecated ...; use
// <use>" on stderr, and cannot be given together with `current` (a usage
// error). The caller gives it the same checks as `current`.
template <class T>
CLI::Option* add_deprecated_option(CLI::App& app, const std::string& command,
                                   const std::string& old_name, const std::string& use,
                                   CLI::Option* current, T& variable) {
  CLI::Option* alias = app.add_option(old_name, variable, "Deprecated: " + use)
                           ->group("Deprecated (goes in the next release)")
                           ->excludes(current);
  current->excludes(alias);
  const std::string note = "qkv " + command + ": warning: " + old_name +
                           " is deprecated and goes in the next release; use " + use + "\n";
  alias->each([note](const std::string&) { note_deprecated(note); });
  return alias;
}

// `text` as a JSON string: quotes, backslashes and control characters
// escaped (\n, \u001b, ...), and bytes that are not UTF-8 replaced by
// U+FFFD, so the output is always valid JSON whatever the input bytes were.
std::string json_string(std::string_view text);

// The items with `separator` between them, and `last_separator` (if not
// empty) before the last: join({"a", "b", "c"}, ", ", " and ") is
// "a, b and c".
std::string join(const std::vector<std::string>& items, std::string_view separator = ", ",
                 std::string_view last_separator = {});

// 2-D inputs stand for a batch of one (docs/cli.md; the library's rule,
// qkv::with_batch_axis): the library gets them with a leading axis of 1, and
// the outputs are handed back without it.
template <class T>
ConstView<T> batch_view(const Tensor<T>& input, bool batched) {
  return with_batch_axis(input.view(), !batched, input.rank());
}
template <class T>
Tensor<T> unbatched(Tensor<T> output, bool batched) {
  const Shape shape = without_batch_axis(output.shape(), !batched);
  return std::move(output).reshaped(shape);
}

// A float tensor as read from a .npy file, in the file's type.
using FloatTensor = std::variant<Tensor<float>, Tensor<double>>;

// An input file named on the command line, for messages: "--keys k.npy".
struct Input {
  std::string option;
  std::string path;
  std::string describe() const { return option + " " + path; }
};

// An input file opened once for reading (pipes and FIFOs can only be read
// once); closed when it goes out of scope. An empty path, a file that cannot
// be opened and a directory are UsageErrors naming the option and the path.
class OpenInput {
 public:
  explicit OpenInput(const Input& input);
  ~OpenInput();
  OpenInput(const OpenInput&) = delete;
  OpenInput& operator=(const OpenInput&) = delete;
  int fd() const { return fd_; }
  // Reads up to n bytes from the start (fewer at the end of the file), to
  // tell formats apart; the readers are handed them as already consumed.
  std::string read_prefix(size_t n);

 private:
  Input input_;
  int fd_ = -1;
};

// Whether `prefix` starts like a .npy file (the magic string "\x93NUMPY").
bool is_npy_prefix(std::string_view prefix);
inline constexpr size_t kNpyMagicLength = 6;

// Reads a .npy input through `file` (whose first bytes, `consumed`, may have
// been read already); a malformed file is an Error naming the option.
NpyArray read_npy_input(const Input& input, OpenInput& file, std::string_view consumed = {});

// Reads a float32 or float64 .npy file; any other dtype, a missing file or a
// malformed one is an error naming the option and the path.
FloatTensor load_float(const Input& input);
// The same for an input already open (and perhaps sniffed, see read_prefix).
FloatTensor load_float(const Input& input, OpenInput& file, std::string_view consumed);
// Valid lengths as read from a .npy file, in the file's integer type: the
// library takes int32 and int64 views as they are.
using LensTensor = std::variant<Tensor<int32_t>, Tensor<int64_t>>;

// Reads int32 or int64 valid lengths; float lengths are an error.
LensTensor load_valid_lens(const Input& input);
// A bool or uint8 .npy file (a mask: nonzero = takes part); anything else
// is a UsageError naming the file and its dtype.
Tensor<uint8_t> load_byte_mask(const Input& input);

// "float32", "float64"
std::string dtype_name(const FloatTensor& tensor);
const Shape& shape_of(const FloatTensor& tensor);

// The valid lengths as the library takes them, (B) or (B, Nq), for an input
// (`against`, of shape `input_shape`) that is 3-D (B, Nq, .) or 2-D (Nq, .),
// a batch of one. For 2-D inputs ValidLens::for_batch_of_one's rule (a
// scalar or (1): one length; (Nq) or (1, Nq): one per query). Other shapes are
// an error naming both files.
// A view of `lens` (reshaped, not copied), which must outlive it.
ValidLens batch_valid_lens(const LensTensor& lens, const Input& lens_input, const Input& against,
                           const Shape& input_shape);

// --valid-lens PATH read into `storage` (the lengths as in the file) and
// returned as batch_valid_lens views them; absent (every key valid) when
// `path` is empty, the option not given.
ValidLens read_valid_lens(const std::string& path, const Input& against, const Shape& input_shape,
                          LensTensor& storage);

// An output file: the option that named it (for messages), where it goes,
// and its complete contents.
struct OutputFile {
  std::string option;
  std::string path;
  std::string bytes;
};

// Checks every output path before any work (qkv::check_output_paths): an
// empty path, a directory, a missing or unwritable directory, or two options
// naming the same file is a qkv::Error (status 2). Commands call it before
// computing; write_outputs again.
void check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs);

// An input that is a directory (a store, an index): the option that named
// it, its path, and what it is ("store").
struct InputDirectory {
  std::string option, dir, kind;
};

// UsageError if an output (option, path) is inside one of the input
// directories, however spelled ("..", symlinks): a command never writes into
// what it reads (DESIGN.md §9), e.g. --out over a store's manifest.
void check_outputs_outside(const std::vector<std::pair<std::string, std::string>>& outputs,
                           const std::vector<InputDirectory>& inputs);

// Writes all the files or none (qkv::write_files): each is staged to a
// temporary file beside its destination and flushed, and only when every one
// is are they renamed into place; devices and FIFOs are written through,
// symlinks' targets replaced. On failure the temporary files are removed and
// no destination is touched. (A rename within a directory fails only if the
// file system does; the files renamed before such a failure stay.)
void write_outputs(const std::vector<OutputFile>& files);

// Installs handlers for SIGHUP, SIGINT, SIGTERM and SIGPIPE (those not
// ignored) that remove the temporary files of outputs being written
// (qkv::remove_staged_files) and then die of the signal as before.
void remove_temporaries_on_signals();

}  // namespace qkv::cli
