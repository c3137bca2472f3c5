// `qkv attend`: scaled dot-product, additive, bilinear or distance attention on .npy files.
//   queries: (B, Nq, D)   keys: (B, Nk, Dk)   values: (B, Nk, Dv)   or all 2-D, a batch of one
//   bilinear: --w W.npy (Dq, Dk)
//   out: (B, Nq, Dv)   weights: (B, Nq, Nk)   lse: (B, Nq)   (2-D inputs: without the B axis)
//   dot also takes heads: (B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv) -> (B, H, Nq, ·)
//   --store STORE (keys and values from a key-value store): queries (Nq, D) -> out (Nq, Dv)
//   --store STORE --index INDEX (through an index of it): also certificate (Nq); shard
//   stores each with its index (--store S_0 ... --index I_0 ...), merged, or one per mpirun rank
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "attend_store.h"
#include "common.h"
#include "qkv/attention.h"
#include "qkv/kernel_regression.h"
#include "qkv/npy.h"
#include "qkv/scoring.h"
#include "qkv/valid_lens.h"

namespace qkv::cli {
namespace {

struct AttendArgs {
  std::string scoring;
  std::string queries, keys, values;
  std::string valid_lens;
  std::optional<double> scale;
  std::string causal;  // "", "top-left" or "bottom-right"
  std::string window;  // "", or "L,R"
  std::string mask, key_mask, bias;
  std::string w_q, w_k, w_v;
  std::string w;  // --scoring bilinear: W (Dq, Dk)
  double dropout = 0.0;
  bool train = false;
  uint64_t seed = 0;
  std::string out, weights, lse;
  std::optional<int> threads;
  // --store: attention over key-value stores' rows (cli/attend_store.h).
  std::vector<std::string> stores;
  std::optional<double> bandwidth;  // --scoring distance: scale 1/H^2
  int64_t top_k = 0;
  std::string top_ids, top_weights;
  bool quiet = false;
  // --index: through an index of each --store, in the same order (qkv/index.h).
  std::vector<std::string> indexes;
  std::optional<double> epsilon;
  std::optional<int64_t> probe;
  std::string certificate;
  // --kernel NAME with --index: a compact kernel of width --bandwidth H.
  std::string kernel;
};

// --window L,R: two integers >= -1 (-1 leaves a side open), below 2^40;
// nothing when the text is not that. The option's check and attend() both
// read the text through it.
std::optional<std::pair<int64_t, int64_t>> parse_window(const std::string& text) {
  const size_t comma = text.find(',');
  if (comma == std::string::npos) return std::nullopt;
  const auto side = [](const std::string& part) -> std::optional<int64_t> {
    char* end = nullptr;
    const long long n = std::strtoll(part.c_str(), &end, 10);
    if (part.empty() || end != part.c_str() + part.size() || n < -1 || n >= (1LL << 40)) {
      return std::nullopt;
    }
    return n;
  };
  const auto left = side(text.substr(0, comma)), right = side(text.substr(comma + 1));
  if (!left || !right) return std::nullopt;
  return std::pair{*left, *right};
}

// --scoring's row of the table (qkv/scoring.h): required in memory, dot by
// default over --store; gaussian, the old name of distance over a store,
// still means distance for one release (a warning, cli/common.h).
const ScoringRules& scoring_of(const AttendArgs& args) {
  if (args.scoring.empty()) {
    if (args.stores.empty()) {
      throw UsageError("--scoring is required (" + scoring_names() + ")");
    }
    return rules_of(Scoring::kDotProduct);
  }
  if (args.scoring == "gaussian") return rules_of(Scoring::kDistance);
  return *find_scoring(args.scoring);  // checked by the option
}

// --kernel NAME (with --index): a compact kernel, --bandwidth H its width;
// softmax's own options do not go with it.
void check_kernel(const AttendArgs& args) {
  if (args.kernel.empty()) return;
  if (args.indexes.empty()) {
    throw UsageError("--kernel " + args.kernel +
                     " is for attention through --index INDEX (exact range queries)");
  }
  if (args.kernel == "gaussian") {
    throw UsageError(
        "--kernel gaussian is softmax attention: use --scoring distance --bandwidth H "
        "(certified by --epsilon); --kernel takes boxcar, epanechnikov or triangular");
  }
  for (const auto& [flag, given] : {std::pair{"--scoring", !args.scoring.empty()},
                                    {"--scale", args.scale.has_value()},
                                    {"--epsilon", args.epsilon.has_value()},
                                    {"--probe", args.probe.has_value()}}) {
    if (given) {
      throw UsageError(std::string(flag) + " does not go with --kernel " + args.kernel +
                       ": its weights are K((q - k) / H), exact, with --bandwidth H");
    }
  }
  if (!args.bandwidth) {
    throw UsageError("--kernel " + args.kernel + " needs --bandwidth H, its width");
  }
  const double h = *args.bandwidth;
  if (!(std::isfinite(h) && h > 0)) {
    throw UsageError("--bandwidth " + shortest_number(h) + ": expected a finite number > 0");
  }
}

// --bandwidth H: distance scoring's scale 1/H^2, the Gaussian kernel's width.
void check_bandwidth(const AttendArgs& args, const ScoringRules& rules) {
  if (!args.bandwidth || !args.kernel.empty()) return;
  if (rules.scoring != Scoring::kDistance) {
    throw UsageError("--bandwidth is for --scoring distance (its scale is 1/H^2); --scoring " +
                     std::string(rules.name) + " takes " +
                     (rules.scale == ScaleRule::kNone ? "no scale" : "--scale"));
  }
  if (args.scale) {
    throw UsageError("--bandwidth H and --scale S are one setting (S = 1/H^2); give one");
  }
  const double h = *args.bandwidth;
  if (!(std::isfinite(h) && h > 0)) {
    throw UsageError("--bandwidth " + shortest_number(h) + ": expected a finite number > 0");
  }
  if (!(std::isfinite(1.0 / (h * h)) && 1.0 / (h * h) > 0)) {
    throw UsageError("--bandwidth " + shortest_number(h) +
                     ": 1/H^2 = " + shortest_number(1.0 / (h * h)) +
                     " is beyond float64's range; give a bandwidth between 1e-154 and 1e154");
  }
}

// The scale the library gets: --scale, or 1/H^2 for --bandwidth H.
std::optional<double> scale_of(const AttendArgs& args) {
  if (!args.kernel.empty()) return std::nullopt;  // --bandwidth is the kernel's width
  if (args.bandwidth) return 1.0 / (*args.bandwidth * *args.bandwidth);
  return args.scale;
}

// How messages name the scale as the user gave it: "--bandwidth 1e-25", or
// "--scale 1e+50", or the default.
std::string scale_option(const AttendArgs& args) {
  if (args.bandwidth) return "--bandwidth " + shortest_number(*args.bandwidth);
  if (args.scale) return "--scale " + shortest_number(*args.scale);
  return "the default scale";
}

// --index's option combinations, found before any file is read: its own
// options without it, an index per store, and what attention through an
// index cannot do (valid rows: its lists hold rows from anywhere).
void check_index_options(const AttendArgs& args) {
  if (args.indexes.empty()) {
    for (const auto& [flag, given] : {std::pair{"--epsilon", args.epsilon.has_value()},
                                      {"--probe", args.probe.has_value()},
                                      {"--certificate", !args.certificate.empty()}}) {
      if (given) {
        throw UsageError(std::string(flag) +
                         " is for attention through --index INDEX (an index of the store, qkv "
                         "index build)");
      }
    }
    return;
  }
  if (args.stores.empty()) {
    throw UsageError("--index " + args.indexes[0] +
                     " needs --store STORE, the store it was built over");
  }
  if (args.indexes.size() != args.stores.size()) {
    const auto times = [](size_t n) { return std::to_string(n) + (n == 1 ? " time" : " times"); };
    throw UsageError("--index given " + times(args.indexes.size()) + " and --store " +
                     times(args.stores.size()) +
                     ": give each store's index, in the order of the stores (--store S_0 "
                     "--store S_1 ... --index I_0 --index I_1 ..., I_r built over S_r)");
  }
  if (!args.valid_lens.empty()) {
    throw UsageError(
        "--valid-lens does not go with --index: an index's lists hold rows from "
        "anywhere in the store, not its first rows (attend without --index)");
  }
  if (args.epsilon && args.probe) {
    throw UsageError("--epsilon " + shortest_number(*args.epsilon) + " and --probe " +
                     std::to_string(*args.probe) +
                     " are two ways to stop; give one (--epsilon E: visit lists until the "
                     "certificate is at most E; --probe P: visit P lists)");
  }
  if (args.epsilon && !(std::isfinite(*args.epsilon) && *args.epsilon >= 0)) {
    throw UsageError("--epsilon " + shortest_number(*args.epsilon) +
                     ": expected a finite number >= 0 (0 visits every list: exact attention)");
  }
  if (args.probe && *args.probe < 1) {
    throw UsageError("--probe " + std::to_string(*args.probe) +
                     ": expected a whole number >= 1, the lists to visit per query");
  }
}

// --store's option combinations, found before any file is read.
void check_store_options(const AttendArgs& args, const ScoringRules& rules) {
  if (args.stores.empty()) {
    for (const auto& [flag, given] : {std::pair{"--top-k", args.top_k != 0},
                                      {"--top-ids", !args.top_ids.empty()},
                                      {"--top-weights", !args.top_weights.empty()},
                                      {"--quiet", args.quiet}}) {
      if (given) throw UsageError(std::string(flag) + " is for attention over --store");
    }
    if (args.keys.empty() || args.values.empty()) {
      throw UsageError("--keys and --values are required (or --store)");
    }
    return;
  }
  if (!rules.over_store) {
    throw UsageError("--scoring " + std::string(rules.name) +
                     " does not take --store; attention over a store scores by --scoring " +
                     scoring_names(/*over_store_only=*/true));
  }
  std::vector<std::string> conflicts;
  for (const auto& [flag, given] : {std::pair{"--keys", !args.keys.empty()},
                                    {"--values", !args.values.empty()},
                                    {"--causal", !args.causal.empty()},
                                    {"--window", !args.window.empty()},
                                    {"--mask", !args.mask.empty()},
                                    {"--key-mask", !args.key_mask.empty()},
                                    {"--bias", !args.bias.empty()},
                                    {"--dropout", args.dropout != 0.0},
                                    {"--train", args.train},
                                    {"--weights", !args.weights.empty()}}) {
    if (given) conflicts.push_back(flag);
  }
  if (!conflicts.empty()) {
    throw UsageError(join(conflicts, ", ", " and ") + (conflicts.size() == 1 ? " does" : " do") +
                     " not go with --store: the keys and values are the store's rows, which "
                     "--valid-lens limits per query");
  }
  if (args.top_k > 0 && args.top_ids.empty() && args.top_weights.empty()) {
    throw UsageError("--top-k " + std::to_string(args.top_k) +
                     " needs --top-ids I.npy or --top-weights W.npy (or both)");
  }
  if (args.top_k == 0 && (!args.top_ids.empty() || !args.top_weights.empty())) {
    throw UsageError("--top-ids and --top-weights need --top-k K");
  }
}

// The command's option for a learned parameter: w_q is --wq (qkv/scoring.h).
std::string parameter_flag(std::string_view parameter) {
  std::string flag = "--";
  for (const char c : parameter) {
    if (c != '_') flag += c;
  }
  return flag;
}

// The file a parameter's option names (empty when not given).
const std::string& parameter_path(const AttendArgs& args, std::string_view parameter) {
  if (parameter == "w_q") return args.w_q;
  if (parameter == "w_k") return args.w_k;
  if (parameter == "w_v") return args.w_v;
  return args.w;
}

// The options of a row's parameters: "--wq, --wk and --wv".
std::string parameter_flags(const ScoringRules& rules) {
  std::vector<std::string> flags;
  for (const std::string_view p : rules.parameters) {
    if (!p.empty()) flags.push_back(parameter_flag(p));
  }
  return join(flags, ", ", " and ");
}

// The names of the rows `has` holds for: "dot and distance".
template <class Has>
std::string names_where(Has&& has) {
  std::vector<std::string> names;
  for (const ScoringRules& rules : scoring_table()) {
    if (has(rules)) names.emplace_back(rules.name);
  }
  return join(names, ", ", " and ");
}

// Option combinations that cannot mean anything by the scoring function's
// rules (qkv/scoring.h), found before any file is read.
void check_options(const AttendArgs& args, const ScoringRules& rules) {
  const std::string scoring(rules.name);
  // Each scoring function's parameters: its own required, the others' refused.
  std::vector<std::string> missing;
  for (const std::string_view p : rules.parameters) {
    if (!p.empty() && parameter_path(args, p).empty()) missing.push_back(parameter_flag(p));
  }
  if (!missing.empty()) {
    throw UsageError("--scoring " + scoring + " needs " + parameter_flags(rules) + " (" +
                     std::string(rules.parameter_shapes) + "); missing " +
                     join(missing, ", ", " and "));
  }
  for (const ScoringRules& owner : scoring_table()) {
    if (owner.scoring == rules.scoring) continue;
    std::vector<std::string> given;
    for (const std::string_view p : owner.parameters) {
      if (!p.empty() && !parameter_path(args, p).empty()) given.push_back(parameter_flag(p));
    }
    if (given.empty()) continue;
    const std::string takes = parameter_flags(rules);
    throw UsageError(join(given, ", ", " and ") + (given.size() == 1 ? " is" : " are") +
                     " for --scoring " + std::string(owner.name) + "; --scoring " + scoring +
                     (takes.empty() ? " has no parameters" : " takes " + takes));
  }
  if (rules.scale == ScaleRule::kNone && args.scale) {
    throw UsageError("--scale is for --scoring " + names_where([](const ScoringRules& r) {
                       return r.scale != ScaleRule::kNone;
                     }) +
                     "; " + std::string(rules.title) + " attention has no scale");
  }
  // Dropout applies only in training mode, as in a d2l module after .eval();
  // a --dropout that silently did nothing hid a forgotten --train.
  if (args.dropout != 0.0 && !args.train) {
    throw UsageError("--dropout " + shortest_number(args.dropout) +
                     " has no effect without --train (dropout applies only in training mode); "
                     "add --train or drop --dropout");
  }
  if (!rules.masks) {
    for (const auto& [flag, value] : {std::pair{"--window", &args.window},
                                      {"--mask", &args.mask},
                                      {"--key-mask", &args.key_mask},
                                      {"--bias", &args.bias}}) {
      if (value->empty()) continue;
      throw UsageError(std::string(flag) + " is for --scoring " +
                       names_where([](const ScoringRules& r) { return r.masks; }) + "; " +
                       std::string(rules.title) + " attention takes --valid-lens and --causal");
    }
  }
}

// `inputs` holds queries, keys, values and, for additive, w_q, w_k, w_v, all
// of float type T.
// The masks as read (uint8) and the bias (the inputs' float type), viewed
// by AttentionOptions; a 1-D key mask with 2-D inputs is the batch of one's.
struct Masks {
  Tensor<uint8_t> mask, key_mask;
  std::optional<FloatTensor> bias;
};

template <class T>
std::vector<OutputFile> attend(const AttendArgs& args, const ScoringRules& rules,
                               const std::vector<FloatTensor>& inputs, const ValidLens& valid_lens,
                               const Masks& masks) {
  const auto in = [&](size_t i) -> const Tensor<T>& { return std::get<Tensor<T>>(inputs[i]); };
  const bool batched = in(0).rank() >= 3;  // 3-D, or heads (4-D)
  const auto as_batch = [&](size_t i) { return batch_view(in(i), batched); };
  AttentionOptions options;
  options.scale = scale_of(args);
  options.dropout_p = args.dropout;
  options.training = args.train;
  options.seed = args.seed;
  options.return_weights = !args.weights.empty();
  options.return_lse = !args.lse.empty();
  if (args.causal == "top-left") options.causal = Causal::kTopLeft;
  if (args.causal == "bottom-right") options.causal = Causal::kBottomRight;
  if (!masks.mask.empty()) options.mask = masks.mask.view();
  if (!masks.key_mask.empty()) {
    options.key_mask = with_batch_axis(masks.key_mask.view(), !batched, 1);
  }
  if (masks.bias) options.bias = ConstView<T>(std::get<Tensor<T>>(*masks.bias).view());
  if (!args.window.empty()) {
    const auto [left, right] = *parse_window(args.window);  // checked by the option
    options.window_left = left;
    options.window_right = right;
  }

  AttentionResult<T> result;
  switch (rules.scoring) {
    case Scoring::kDotProduct:
      result =
          scaled_dot_product_attention(as_batch(0), as_batch(1), as_batch(2), valid_lens, options);
      break;
    case Scoring::kAdditive:
      result = additive_attention(as_batch(0), as_batch(1), as_batch(2),
                                  AdditiveWeights<T>{in(3).view(), in(4).view(), in(5).view()},
                                  valid_lens, options);
      break;
    case Scoring::kBilinear:
      result = bilinear_attention(as_batch(0), as_batch(1), as_batch(2), in(3).view(), valid_lens,
                                  options);
      break;
    case Scoring::kDistance:
      if (options.scale) check_distance_scale(*options.scale, sizeof(T) == 4, scale_option(args));
      result = distance_attention(as_batch(0), as_batch(1), as_batch(2), valid_lens, options);
      check_distance_overflow(result.output.data(), result.output.numel(),
                              result.output.size(result.output.rank() - 1), scale_option(args));
      break;
  }
  // 2-D inputs give outputs without the batch axis of one.
  const auto bytes = [&](Tensor<T>& t) {
    return npy_bytes(unbatched(std::move(t), batched).view());
  };
  std::vector<OutputFile> files;
  files.push_back({"--out", args.out, bytes(result.output)});
  if (options.return_weights) files.push_back({"--weights", args.weights, bytes(result.weights)});
  if (options.return_lse) files.push_back({"--lse", args.lse, bytes(result.lse)});
  return files;
}

void run_attend(const AttendArgs& args) {
  check_index_options(args);
  check_kernel(args);
  const ScoringRules& rules = scoring_of(args);
  check_store_options(args, rules);
  check_bandwidth(args, rules);
  if (!args.stores.empty()) {
    return run_store_attend(
        {args.stores, args.queries, args.valid_lens, rules.scoring, scale_of(args),
         scale_option(args), args.top_k, args.out, args.lse, args.top_ids, args.top_weights,
         args.quiet, args.threads, args.indexes, args.epsilon, args.probe, args.certificate,
         args.kernel.empty() ? std::optional<Kernel>() : kernel_from_name(args.kernel),
         args.bandwidth});
  }
  check_options(args, rules);
  std::vector<std::pair<std::string, std::string>> outputs{{"--out", args.out}};
  if (!args.weights.empty()) outputs.emplace_back("--weights", args.weights);
  if (!args.lse.empty()) outputs.emplace_back("--lse", args.lse);
  check_output_paths(outputs);
  apply_threads(args.threads);

  std::vector<Input> inputs{
      {"--queries", args.queries}, {"--keys", args.keys}, {"--values", args.values}};
  for (const std::string_view p : rules.parameters) {
    if (!p.empty()) inputs.push_back({parameter_flag(p), parameter_path(args, p)});
  }
  std::vector<FloatTensor> tensors;
  for (const Input& input : inputs) tensors.push_back(load_float(input));

  for (const FloatTensor& t : tensors) {
    if (t.index() == tensors[0].index()) continue;
    std::string listing;
    for (size_t i = 0; i < inputs.size(); ++i) {
      listing += (i == 0 ? "" : ", ") + inputs[i].describe() + " is " + dtype_name(tensors[i]);
    }
    throw UsageError("mixed float types: " + listing +
                     "; the inputs must be all float32 or all float64");
  }

  const Shape& q_shape = shape_of(tensors[0]);
  const bool dot = rules.heads;  // 4-D inputs with heads
  if (q_shape.rank() != 2 && q_shape.rank() != 3 && !(dot && q_shape.rank() == 4)) {
    throw UsageError(inputs[0].describe() + " has shape " + q_shape.str() +
                     "; expected 2-D (Nq, D)" +
                     (dot ? ", 3-D (B, Nq, D) or 4-D (B, H, Nq, D)" : " or 3-D (B, Nq, D)"));
  }
  for (size_t i = 1; i < 3; ++i) {
    const Shape& s = shape_of(tensors[i]);
    if (s.rank() != q_shape.rank()) {
      throw UsageError(inputs[i].describe() + " has shape " + s.str() + " but " +
                       inputs[0].describe() + " has shape " + q_shape.str() +
                       "; queries, keys and values must be all 2-D, all 3-D" +
                       (dot ? " or all 4-D" : ""));
    }
  }

  LensTensor lens;  // the lengths as read, int32 or int64, viewed by valid_lens (no copy)
  const ValidLens valid_lens = read_valid_lens(args.valid_lens, inputs[0], q_shape, lens);
  Masks masks;
  if (!args.mask.empty()) masks.mask = load_byte_mask({"--mask", args.mask});
  if (!args.key_mask.empty()) masks.key_mask = load_byte_mask({"--key-mask", args.key_mask});
  if (!args.bias.empty()) {
    const Input input{"--bias", args.bias};
    masks.bias = load_float(input);
    if (masks.bias->index() != tensors[0].index()) {
      throw UsageError(input.describe() + " is " + dtype_name(*masks.bias) + " but " +
                       inputs[0].describe() + " is " + dtype_name(tensors[0]) +
                       "; the bias must have the inputs' float type");
    }
  }

  write_outputs(std::holds_alternative<Tensor<float>>(tensors[0])
                    ? attend<float>(args, rules, tensors, valid_lens, masks)
                    : attend<double>(args, rules, tensors, valid_lens, masks));
}

}  // namespace

Command add_attend_command(CLI::App& parent) {
  auto args = std::make_shared<AttendArgs>();
  CLI::App* app = parent.add_subcommand(
      "attend",
      "Attention pooling: softmax of dot-product, additive, bilinear or distance scores, times "
      "the values");
  std::string scoring_help;
  std::vector<std::string> scoring_choices;
  for (const ScoringRules& rules : scoring_table()) {
    scoring_help += std::string(rules.name) + ": " + std::string(rules.formula) +
                    (rules.parameters[0].empty() ? "" : " (" + parameter_flags(rules) + ")") + "; ";
    scoring_choices.emplace_back(rules.name);
  }
  scoring_choices.emplace_back("gaussian");  // distance's old name over a store (deprecated)
  app->add_option("--scoring", args->scoring,
                  scoring_help + "required except with --store (default dot; a store takes " +
                      scoring_names(/*over_store_only=*/true) + ")")
      ->type_name("dot|additive|bilinear|distance")
      ->check(CLI::IsMember(scoring_choices))
      ->each([](const std::string& value) {
        if (value == "gaussian") {
          note_deprecated(
              "qkv attend: warning: --scoring gaussian is deprecated and goes in the "
              "next release; use --scoring distance (--bandwidth H as before)\n");
        }
      });
  require_path(
      app->add_option("--w", args->w, "--scoring bilinear: W.npy (Dq, Dk), the inputs' float type"))
      ->type_name("W.npy");
  require_number(app->add_option("--bandwidth", args->bandwidth,
                                 "--scoring distance: the Gaussian kernel's width h > 0, the same "
                                 "as --scale 1/h^2"))
      ->type_name("H");
  require_path(
      app->add_option("--queries", args->queries,
                      "Queries Q.npy: (B, Nq, D), or (Nq, D); dot also heads (B, H, Nq, D)"))
      ->type_name("Q.npy")
      ->required();
  require_path(app->add_option("--keys", args->keys,
                               "Keys K.npy: (B, Nk, Dk), or (Nk, Dk); heads: (B, Hkv, Nk, D), H a "
                               "multiple of Hkv (grouped-query attention)"))
      ->type_name("K.npy");
  require_path(app->add_option("--values", args->values,
                               "Values V.npy: (B, Nk, Dv), or (Nk, Dv); heads: (B, Hkv, Nk, Dv)"))
      ->type_name("V.npy");
  require_path(app->add_option("--store", args->stores,
                               "Attend over a key-value store's rows (qkv store create) instead "
                               "of --keys and --values: queries (Nq, D), read chunk by chunk; "
                               "--valid-lens then limits each query to the first rows. Given "
                               "several times: shard stores whose rows follow each other; under "
                               "mpirun, one store (each rank reads a share of its chunks) or "
                               "one shard per rank"))
      ->type_name("STORE");
  require_path(app->add_option("--index", args->indexes,
                               "With --store: attend through an index of it (qkv index "
                               "build), visiting its lists by their score bounds; certified "
                               "(--epsilon, the default) or a fixed budget (--probe); a summary "
                               "of the certificates on stderr. Given once per --store, in the "
                               "same order: shard stores each through its index, merged; under "
                               "mpirun, one shard store and its index per rank"))
      ->type_name("INDEX");
  require_number(
      app->add_option("--epsilon", args->epsilon,
                      "With --index: visit lists until the weight the unvisited rows could "
                      "hold is at most E of the weight visited; the output is then within "
                      "2 E max|v| of attention over every row; 0 is exact (default 1e-3)"))
      ->type_name("E");
  require_integer(app->add_option("--probe", args->probe,
                                  "With --index, instead of --epsilon: visit the P lists of "
                                  "largest bound, whatever they leave out"))
      ->type_name("P");
  app->add_option("--kernel", args->kernel,
                  "With --index: weigh rows by a compact kernel of width --bandwidth H "
                  "(Nadaraya-Watson's product kernel, 0 where some |q_c - k_c| > H) instead of "
                  "softmax: exact, reading only the lists in reach")
      ->type_name("boxcar|epanechnikov|triangular")
      ->check(CLI::IsMember({"boxcar", "uniform", "epanechnikov", "triangular", "gaussian"}));
  require_path(app->add_option("--certificate", args->certificate,
                               "With --index: write each query's certificate (Nq) float64, a "
                               "bound on the weight left out over the weight visited"))
      ->type_name("C.npy");
  require_integer(app->add_option("--top-k", args->top_k,
                                  "With --store: also find each query's K rows of largest weight"))
      ->type_name("K")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 36));
  require_path(app->add_option("--top-ids", args->top_ids,
                               "With --top-k: their row ids in the store (Nq, K) int64, largest "
                               "weight first; -1 where a query has fewer than K rows"))
      ->type_name("I.npy");
  require_path(app->add_option("--top-weights", args->top_weights,
                               "With --top-k: their weights (Nq, K) float32; 0 where the id is -1"))
      ->type_name("W.npy");
  app->add_flag("--quiet", args->quiet,
                "With --store: no progress on stderr (with --index: no summary)");
  require_path(
      app->add_option(
          "--valid-lens", args->valid_lens,
          "Valid lengths L.npy, int32 or int64: (B) or (B, Nq) for 3-D and 4-D inputs (shared "
          "by the heads); for 2-D inputs "
          "one length (a scalar or (1)) or one per query ((Nq) or (1, Nq)); default: "
          "every key is valid"))
      ->type_name("L.npy");
  require_number(app->add_option("--scale", args->scale,
                                 "dot: multiplies Q K^T (default 1/sqrt(D)); distance: multiplies "
                                 "-|q - k|^2 / 2 (default 1)"))
      ->type_name("S");
  require_path(
      app->add_option("--wq", args->w_q, "additive only: W_q (H, D), like nn.Linear's weight"))
      ->type_name("Wq.npy");
  require_path(app->add_option("--wk", args->w_k, "additive only: W_k (H, Dk)"))
      ->type_name("Wk.npy");
  require_path(app->add_option("--wv", args->w_v, "additive only: w_v (H) or (1, H)"))
      ->type_name("wv.npy");
  app->add_option("--causal", args->causal,
                  "Causal mask: query i sees keys j <= i (top-left, torch's is_causal) or "
                  "j <= i + Nk - Nq (bottom-right: queries that continue a key cache); with "
                  "--valid-lens the smaller length wins")
      ->expected(0, 1)
      ->default_str("top-left")
      ->option_text("[top-left|bottom-right]")
      ->check(CLI::IsMember({"top-left", "bottom-right"}));
  require_path(app->add_option("--mask", args->mask,
                               "dot only: which keys each query sees, bool or uint8 (nonzero = "
                               "takes part, torch's boolean attn_mask), broadcast against the "
                               "scores (B, Nq, Nk) or (B, H, Nq, Nk) from the right: (Nq, Nk), "
                               "(B, 1, Nq, Nk), ..."))
      ->type_name("M.npy");
  require_path(app->add_option("--key-mask", args->key_mask,
                               "dot only: (B, Nk) bool or uint8, key j of batch element b takes "
                               "part where nonzero (key padding); (Nk) for 2-D inputs"))
      ->type_name("K.npy");
  require_path(app->add_option("--bias", args->bias,
                               "dot only: an additive bias of the scaled scores (torch's float "
                               "attn_mask: ALiBi, relative positions), the inputs' float type, "
                               "broadcast like --mask; -inf leaves a key out"))
      ->type_name("B.npy");
  app->add_option("--window", args->window,
                  "dot only: a sliding window, query i sees keys j with i + Nk - Nq - L <= j <= "
                  "i + Nk - Nq + R (FlashAttention's window_size); -1 leaves a side open; "
                  "combines with --valid-lens and --causal")
      ->type_name("L,R")
      ->check(CLI::Validator(
          [](std::string& text) {
            return parse_window(text)
                       ? std::string()
                       : "must be two integers >= -1 as L,R (e.g. 256,0), got " + text;
          },
          ""));
  app->add_option("--dropout", args->dropout,
                  "Dropout probability on the weights, 0 <= P <= 1; needs --train")
      ->type_name("P")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) {
            char* end = nullptr;
            const double p = std::strtod(text.c_str(), &end);
            return end != text.c_str() && *end == '\0' && p >= 0.0 && p <= 1.0
                       ? std::string()
                       : "must be a probability in [0, 1], got " + text;
          },
          ""));
  app->add_flag("--train", args->train, "Training mode: apply --dropout");
  add_seed_option(*app, args->seed, "Selects the dropout mask");
  require_path(app->add_option("--out", args->out,
                               "Output O.npy: (B, Nq, Dv), or (Nq, Dv); heads: (B, H, Nq, Dv)"))
      ->type_name("O.npy")
      ->required();
  require_path(app->add_option(
                   "--weights", args->weights,
                   "Also write the attention weights (before dropout): (B, Nq, Nk), or (Nq, Nk)"))
      ->type_name("W.npy");
  require_path(
      app->add_option("--lse", args->lse,
                      "Also write the log-sum-exp of each query's valid scores: (B, Nq), or (Nq)"))
      ->type_name("LSE.npy");
  add_threads_option(*app, args->threads);
  set_help_footer(*app,
                  {"qkv attend --scoring dot --queries queries.npy --keys keys.npy --values "
                   "values.npy --valid-lens lens.npy --out out.npy --weights weights.npy",
                   "qkv attend --store kv --queries queries.npy --top-k 3 --top-ids ids.npy "
                   "--out out.npy"},
                  "docs/cli.md#qkv-attend");
  return {app, [args] { run_attend(*args); }};
}

}  // namespace qkv::cli
