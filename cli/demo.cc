// `qkv demo`: the worked examples of d2l §11.3 "Attention Scoring Functions"
// (masked softmax, additive and scaled dot-product attention), run through the
// library and printed as a short report. Inputs are drawn from <random>.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "qkv/masked_softmax.h"
#include "qkv/modules.h"
#include "qkv/version.h"

namespace qkv::cli {
namespace {

struct DemoArgs {
  uint64_t seed = 0;
  std::optional<int> threads;
};

std::string fixed4(double x) {
  char text[64];
  std::snprintf(text, sizeof text, "%.4f", x);
  return text;
}

// Prints a (B, Nq, N) tensor one row per (b, i), labelled "b=0 q=1", with the
// numbers right-aligned in columns of one width.
void print_rows(std::ostream& os, ConstView<float> t) {
  size_t width = 0;
  for (int64_t b = 0; b < t.size(0); ++b) {
    for (int64_t i = 0; i < t.size(1); ++i) {
      for (int64_t j = 0; j < t.size(2); ++j) width = std::max(width, fixed4(t(b, i, j)).size());
    }
  }
  for (int64_t b = 0; b < t.size(0); ++b) {
    for (int64_t i = 0; i < t.size(1); ++i) {
      os << "     b=" << b << " q=" << i << ' ';
      for (int64_t j = 0; j < t.size(2); ++j) {
        const std::string x = fixed4(t(b, i, j));
        os << std::string(width + 2 - x.size(), ' ') << x;
      }
      os << '\n';
    }
  }
}

Tensor<float> random_tensor(Shape shape, std::mt19937_64& rng, bool normal) {
  Tensor<float> t(shape);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  for (float& x : t.values()) x = normal ? gaussian(rng) : uniform(rng);
  return t;
}

void run_demo(const DemoArgs& args) {
  apply_threads(args.threads);
  std::mt19937_64 rng(args.seed);
  std::ostream& os = std::cout;
  os << "qkv " << kVersion << " demo: the worked examples of d2l 11.3, Attention Scoring Functions"
     << " (seed " << args.seed << ")\n\n";

  // (1) Masked softmax: a fresh (2, 2, 4) batch for each kind of valid_lens.
  os << "1. Masked softmax of uniform [0, 1) scores of shape (2, 2, 4); positions at or past\n"
        "   a row's valid length get weight 0.\n";
  const Tensor<int64_t> per_batch(Shape{2}, {2, 3});
  const Tensor<int64_t> per_query(Shape{2, 2}, {1, 3, 2, 4});
  const Tensor<float> scores_a = random_tensor(Shape{2, 2, 4}, rng, false);
  os << "   valid_lens [2, 3], one length per batch element:\n";
  print_rows(os, masked_softmax(scores_a.view(), per_batch).view());
  const Tensor<float> scores_b = random_tensor(Shape{2, 2, 4}, rng, false);
  os << "   valid_lens [[1, 3], [2, 4]], one length per query:\n";
  print_rows(os, masked_softmax(scores_b.view(), per_query).view());

  // The keys, values and lengths both attention examples share.
  const Tensor<float> keys(Shape{2, 10, 2}, 1.0f);
  Tensor<float> values(Shape{2, 10, 4});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t k = 0; k < 40; ++k) values.data()[b * 40 + k] = static_cast<float>(k);
  }
  const Tensor<int64_t> valid_lens(Shape{2}, {2, 6});

  // (2) Additive attention, d2l's module in eval mode (dropout inactive).
  os << "\n2. Additive attention: AdditiveAttention(key_size 2, query_size 20, num_hiddens 8,\n"
        "   dropout 0.1) in eval mode, its parameters initialised from the seed.\n"
        "   queries (2, 1, 20) ~ N(0, 1); keys (2, 10, 2) all ones; values (2, 10, 4) =\n"
        "   arange(40) as (10, 4) in both batch elements; valid_lens [2, 6].\n";
  const Tensor<float> queries_a = random_tensor(Shape{2, 1, 20}, rng, true);
  AdditiveAttention<float> additive(2, 20, 8, 0.1, args.seed);
  additive.eval();
  const Tensor<float> additive_out =
      additive.forward(queries_a.view(), keys.view(), values.view(), valid_lens);
  os << "   output (2, 1, 4):\n";
  print_rows(os, additive_out.view());
  os << "   attention weights (2, 1, 10):\n";
  print_rows(os, additive.attention_weights().view());
  os << "   Every key is the same, so every score in a row is the same and the weights are\n"
        "   uniform over the valid keys: each output is the mean of the first 2 (b=0) or 6\n"
        "   (b=1) value rows, [[2, 3, 4, 5]] and [[10, 11, 12, 13]], as in d2l.\n";

  // (3) Scaled dot-product attention on the same keys, values and lengths.
  os << "\n3. Scaled dot-product attention: DotProductAttention(dropout 0.5) in eval mode.\n"
        "   queries (2, 1, 2) ~ N(0, 1); keys, values and valid_lens as in 2.\n";
  const Tensor<float> queries_b = random_tensor(Shape{2, 1, 2}, rng, true);
  DotProductAttention<float> dot(0.5, args.seed);
  dot.eval();
  const Tensor<float> dot_out =
      dot.forward(queries_b.view(), keys.view(), values.view(), valid_lens);
  os << "   output (2, 1, 4):\n";
  print_rows(os, dot_out.view());
  os << "   attention weights (2, 1, 10):\n";
  print_rows(os, dot.attention_weights().view());
  os << "   Equal keys cannot be told apart by any query: uniform weights again, and the\n"
        "   same output as additive attention.\n";
  // A report that did not reach its reader (a full disk, a closed pipe) is a failure.
  os.flush();
  if (!os) throw std::runtime_error("cannot write the report to stdout");
}

}  // namespace

Command add_demo_command(CLI::App& parent) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* app = parent.add_subcommand(
      "demo",
      "Print the worked examples of d2l 11.3: masked softmax, additive and scaled "
      "dot-product attention");
  add_seed_option(*app, args->seed, "Seeds the random inputs and the additive parameters");
  add_threads_option(*app, args->threads);
  return {app, [args] { run_demo(*args); }};
}

}  // namespace qkv::cli
