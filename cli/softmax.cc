// `qkv softmax`: masked softmax over the last axis of a .npy file of scores.
//   scores: (B, Nq, Nk) or (Nq, Nk), a batch of one   valid_lens: see batch_valid_lens
//   weights: the scores' shape and float type
#include <CLI/CLI.hpp>
#include <memory>

#include "common.h"
#include "qkv/masked_softmax.h"
#include "qkv/npy.h"
#include "qkv/valid_lens.h"

namespace qkv::cli {
namespace {

struct SoftmaxArgs {
  std::string scores;
  std::string valid_lens;
  std::string out;
  std::optional<int> threads;
};

template <class T>
std::string softmax_bytes(const Tensor<T>& scores, const ValidLens& lens) {
  const bool batched = scores.rank() == 3;
  return npy_bytes(unbatched(masked_softmax(batch_view(scores, batched), lens), batched).view());
}

void run_softmax(const SoftmaxArgs& args) {
  check_output_paths({{"--out", args.out}});
  apply_threads(args.threads);

  const Input scores_input{"--scores", args.scores};
  const FloatTensor scores = load_float(scores_input);
  const Shape& shape = shape_of(scores);
  if (shape.rank() != 2 && shape.rank() != 3) {
    throw UsageError(scores_input.describe() + " has shape " + shape.str() +
                     "; expected 2-D (Nq, Nk) or 3-D (B, Nq, Nk)");
  }
  LensTensor lens;  // the lengths as read, int32 or int64, viewed by valid_lens (no copy)
  const ValidLens valid_lens = read_valid_lens(args.valid_lens, scores_input, shape, lens);

  std::string bytes =
      std::visit([&](const auto& s) { return softmax_bytes(s, valid_lens); }, scores);
  write_outputs({{"--out", args.out, std::move(bytes)}});
}

}  // namespace

Command add_softmax_command(CLI::App& parent) {
  auto args = std::make_shared<SoftmaxArgs>();
  CLI::App* app = parent.add_subcommand(
      "softmax",
      "Masked softmax over the last axis: positions at or past each row's valid length get "
      "weight 0");
  require_path(app->add_option("--scores", args->scores,
                               "Scores X.npy: (B, Nq, Nk), or (Nq, Nk) for one batch"))
      ->type_name("X.npy")
      ->required();
  require_path(
      app->add_option(
          "--valid-lens", args->valid_lens,
          "Valid lengths L.npy, int32 or int64: (B) or (B, Nq) for 3-D scores; for 2-D scores "
          "one length (a scalar or (1)) or one per query ((Nq) or (1, Nq)); default: "
          "every key is valid"))
      ->type_name("L.npy");
  require_path(
      app->add_option("--out", args->out, "Weights W.npy: the scores' shape and float type"))
      ->type_name("W.npy")
      ->required();
  add_threads_option(*app, args->threads);
  set_help_footer(*app, {"qkv softmax --scores scores.npy --valid-lens lens.npy --out weights.npy"},
                  "docs/cli.md#qkv-softmax");
  return {app, [args] { run_softmax(*args); }};
}

}  // namespace qkv::cli
