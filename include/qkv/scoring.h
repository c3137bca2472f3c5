// The scoring functions of attention (d2l 11.3) and each one's rules, in one
// table: the attention front ends check options by it, `qkv attend --scoring`
// takes its names and checks its options by it, the Python binding reads its
// shapes and messages from it, and attention over a store takes the rows
// marked over_store. Adding a scoring function adds one value to the enum
// and one row to the table here
// (docs/architecture.md, "Adding a scoring function").
#pragma once

#include <array>
#include <cstddef>
#include <iterator>
#include <span>
#include <string>
#include <string_view>

#include "qkv/error.h"

namespace qkv {

enum class Scoring {
  kDotProduct,  // scale q . k                (scaled_dot_product_attention)
  kAdditive,    // w_v . tanh(W_q q + W_k k)  (additive_attention)
  kBilinear,    // q W k                      (bilinear_attention)
  kDistance,    // -scale/2 |q - k|^2          (distance_attention)
};

// What AttentionOptions::scale means for a scoring function.
enum class ScaleRule {
  kNone,            // no scale: options.scale must be unset
  kInverseSqrtDim,  // any finite number, default 1/sqrt(D)
  kPositiveOne,     // a finite number > 0, default 1
};

// Every scoring function takes queries, keys, values, valid_lens and dropout;
// the rest differs by row.
struct ScoringRules {
  Scoring scoring;
  // The command's --scoring value ("dot", ...).
  std::string_view name;
  // Its name in prose and messages: "<title> attention".
  std::string_view title;
  // The C++ and Python function: "scaled_dot_product_attention", ...
  std::string_view function;
  // The score of query q and key k, as --help and the docs write it.
  std::string_view formula;
  // Its learned parameters after queries, keys and values, by their C++ and
  // Python names (the command's options drop the underscore: w_q is --wq),
  // and their shapes; empty when it has none.
  std::array<std::string_view, 3> parameters;
  std::string_view parameter_shapes;
  ScaleRule scale;
  // Keys may have their own size Dk (else D, the queries' size).
  bool keys_own_dim;
  // mask, key_mask, the sliding window and an additive bias (and its gradient).
  bool masks;
  // 4-D inputs with heads, (B, H, Nq, D) and grouped (B, Hkv, Nk, D) keys.
  bool heads;
  // causal (top-left or bottom-right).
  bool causal;
  // Attention over a key-value store's rows (qkv/store_attention.h).
  bool over_store;
};

// Every scoring function, one row each, in the order of the enum.
inline constexpr ScoringRules kScoringTable[] = {
    {.scoring = Scoring::kDotProduct,
     .name = "dot",
     .title = "scaled dot-product",
     .function = "scaled_dot_product_attention",
     .formula = "q . k * scale (scale default 1/sqrt(D))",
     .parameters = {},
     .parameter_shapes = "",
     .scale = ScaleRule::kInverseSqrtDim,
     .keys_own_dim = false,
     .masks = true,
     .heads = true,
     .causal = true,
     .over_store = true},
    {.scoring = Scoring::kAdditive,
     .name = "additive",
     .title = "additive",
     .function = "additive_attention",
     .formula = "w_v . tanh(W_q q + W_k k)",
     .parameters = {"w_q", "w_k", "w_v"},
     .parameter_shapes = "w_q (H, Dq), w_k (H, Dk), w_v (H) or (1, H)",
     .scale = ScaleRule::kNone,
     .keys_own_dim = true,
     .masks = false,
     .heads = false,
     .causal = true,
     .over_store = false},
    {.scoring = Scoring::kBilinear,
     .name = "bilinear",
     .title = "bilinear",
     .function = "bilinear_attention",
     .formula = "q W k",
     .parameters = {"w"},
     .parameter_shapes = "w (Dq, Dk)",
     .scale = ScaleRule::kNone,
     .keys_own_dim = true,
     .masks = false,
     .heads = false,
     .causal = true,
     .over_store = false},
    {.scoring = Scoring::kDistance,
     .name = "distance",
     .title = "distance",
     .function = "distance_attention",
     .formula = "-|q - k|^2 * scale / 2 (scale default 1; the Gaussian kernel of bandwidth "
                "1/sqrt(scale))",
     .parameters = {},
     .parameter_shapes = "",
     .scale = ScaleRule::kPositiveOne,
     .keys_own_dim = false,
     .masks = false,
     .heads = false,
     .causal = true,
     .over_store = true},
};

namespace detail {
constexpr bool table_is_in_enum_order() {
  for (size_t i = 0; i < std::size(kScoringTable); ++i) {
    if (static_cast<size_t>(kScoringTable[i].scoring) != i) return false;
  }
  return true;
}
}  // namespace detail
static_assert(detail::table_is_in_enum_order(), "kScoringTable's rows follow enum Scoring");

inline std::span<const ScoringRules> scoring_table() { return kScoringTable; }

// The row of `scoring`; throws Error for a value outside the enum.
inline const ScoringRules& rules_of(Scoring scoring) {
  const auto row = static_cast<size_t>(scoring);
  if (row >= std::size(kScoringTable)) {
    fail("rules_of", "Scoring value " + std::to_string(row) + " is not a scoring function");
  }
  return kScoringTable[row];
}

// The row named `name` ("dot", "additive", "bilinear", "distance"), or null.
inline const ScoringRules* find_scoring(std::string_view name) {
  for (const ScoringRules& rules : kScoringTable) {
    if (rules.name == name) return &rules;
  }
  return nullptr;
}

// The rows' names for messages: "dot, additive, bilinear or distance"; with
// over_store_only, those attention over a store takes: "dot or distance".
inline std::string scoring_names(bool over_store_only = false) {
  std::string text;
  size_t count = 0, total = 0;
  for (const ScoringRules& rules : kScoringTable) total += !over_store_only || rules.over_store;
  for (const ScoringRules& rules : kScoringTable) {
    if (over_store_only && !rules.over_store) continue;
    text += count == 0 ? "" : (count + 1 == total ? " or " : ", ");
    text += rules.name;
    ++count;
  }
  return text;
}

}  // namespace qkv
