// The attention pipeline every scoring function's front end runs
// (src/attention/<scoring>.cc): check the inputs' shapes (check_inputs), the
// options by the scoring function's row of the table (attention_config,
// qkv/scoring.h), allocate or check the destinations (destinations), then
// run the fast kernel with its scratch (with_workspace) or the reference
// kernel (Version::kRef, the qkv::ref API). Private to src/attention/.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/check.h"
#include "core/contiguous.h"
#include "kernels/kernels.h"
#include "qkv/attention.h"
#include "qkv/scoring.h"
#include "qkv/threads.h"

namespace qkv::detail {

enum class Version { kFast, kRef };

// Runs a fast kernel with the scratch its size query asks for (size(threads)
// doubles), allocated here once per call: kernels allocate nothing. Left
// uninitialised (kernels write before they read): zeroing would cost a pass
// over up to (groups, B, Nq, D) partial dQs, 16 MiB at B = 2, Nq = 4096.
// `flops` estimates the call's arithmetic: below kParallelMinFlops (~5 us of
// one core's work) the kernel runs on the calling thread alone
// (kernels::SerialScope), since waking a second thread would cost more.
template <class Size, class Run>
void with_workspace(double flops, Size&& size, Run&& run) {
  constexpr double kParallelMinFlops = 1 << 18;
  std::optional<kernels::SerialScope> serial;
  if (flops < kParallelMinFlops) serial.emplace();
  const int threads = serial ? 1 : num_threads();
  const auto words = std::make_unique_for_overwrite<double[]>(size(threads));
  run(kernels::Workspace{.data = words.get(), .num_threads = threads});
}

// The arithmetic of an attention call: `per_pair` flops for each (query,
// key) pair, e.g. 2 (D + Dv) for SDPA's two products.
// q and k 3-D, or the SDPA kernels' (B, H, N, D).
template <class T>
double pair_flops(ConstView<T> q, ConstView<T> k, double per_pair) {
  const int n = q.rank() - 2;  // the N axis
  double rows = static_cast<double>(q.size(0)) * static_cast<double>(q.size(n));
  if (q.rank() == 4) rows *= static_cast<double>(q.size(1));
  return rows * static_cast<double>(k.size(n)) * per_pair;
}

struct Dims {
  int64_t batch, nq, nk, dq, dk, dv;
  // Scaled dot-product attention with 4-D inputs: query and key heads.
  int rank = 3;
  int64_t heads = 1, kv_heads = 1;
};

inline std::string shapes_of(std::string_view a, const Shape& sa, std::string_view b,
                             const Shape& sb) {
  return " (" + std::string(a) + " " + sa.str() + ", " + std::string(b) + " " + sb.str() + ")";
}

// "keys has D = 3 but queries has D = 2 (keys [2, 5, 3], queries [2, 3, 2])"
template <class T>
void check_same(std::string_view fn, std::string_view dim, std::string_view a, ConstView<T> va,
                int axis_a, std::string_view b, ConstView<T> vb, int axis_b) {
  if (va.size(axis_a) == vb.size(axis_b)) return;
  fail(fn, std::string(a) + " has " + std::string(dim) + " = " + std::to_string(va.size(axis_a)) +
               " but " + std::string(b) + " has " + std::string(dim) + " = " +
               std::to_string(vb.size(axis_b)) + shapes_of(a, va.shape(), b, vb.shape()));
}

// Scaled dot-product attention's heads: queries (B, H, Nq, D), keys
// (B, Hkv, Nk, D), values (B, Hkv, Nk, Dv) with H a multiple of Hkv.
template <class T>
Dims check_heads_inputs(std::string_view fn, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                        const ValidLens& valid_lens) {
  detail::check_rank(fn, "keys", k, 4, "(B, Hkv, Nk, D), as queries is (B, H, Nq, D)");
  detail::check_rank(fn, "values", v, 4, "(B, Hkv, Nk, Dv), as queries is (B, H, Nq, D)");
  check_same(fn, "B", "keys", k, 0, "queries", q, 0);
  check_same(fn, "B", "values", v, 0, "keys", k, 0);
  check_same(fn, "Hkv", "values", v, 1, "keys", k, 1);
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  if (kv_heads == 0 ? heads != 0 : heads % kv_heads != 0) {
    fail(fn, "queries has H = " + std::to_string(heads) +
                 " heads, not a multiple of the Hkv = " + std::to_string(kv_heads) +
                 " heads of keys and values" + shapes_of("queries", q.shape(), "keys", k.shape()));
  }
  check_same(fn, "D", "keys", k, 3, "queries", q, 3);
  check_same(fn, "Nk", "values", v, 2, "keys", k, 2);
  Dims dims{q.size(0), q.size(2), k.size(2), q.size(3), k.size(3), v.size(3)};
  dims.rank = 4;
  dims.heads = heads;
  dims.kv_heads = kv_heads;
  valid_lens.check(fn, "scores", Shape{dims.batch, heads, dims.nq, dims.nk}, dims.batch, dims.nq,
                   dims.nk);
  return dims;
}

// queries (B, Nq, D), keys (B, Nk, D), values (B, Nk, Dv); keys of their
// own size (additive, bilinear): queries (B, Nq, Dq), keys (B, Nk, Dk); 4-D
// heads where the scoring function takes them (check_heads_inputs).
template <class T>
Dims check_inputs(std::string_view fn, const ScoringRules& rules, ConstView<T> q, ConstView<T> k,
                  ConstView<T> v, const ValidLens& valid_lens) {
  if (rules.heads && q.rank() == 4) return check_heads_inputs(fn, q, k, v, valid_lens);
  const bool own = rules.keys_own_dim;
  detail::check_rank(fn, "queries", q, 3, own ? "(B, Nq, Dq)" : "(B, Nq, D)");
  detail::check_rank(fn, "keys", k, 3, own ? "(B, Nk, Dk)" : "(B, Nk, D)");
  detail::check_rank(fn, "values", v, 3, "(B, Nk, Dv)");
  check_same(fn, "B", "keys", k, 0, "queries", q, 0);
  check_same(fn, "B", "values", v, 0, "keys", k, 0);
  if (!own) check_same(fn, "D", "keys", k, 2, "queries", q, 2);
  check_same(fn, "Nk", "values", v, 1, "keys", k, 1);
  const Dims dims{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), v.size(2)};
  valid_lens.check(fn, "scores", Shape{dims.batch, dims.nq, dims.nk}, dims.batch, dims.nq, dims.nk);
  return dims;
}

// Shapes of SDPA's results for these inputs: 3-D inputs give 3-D results.
inline Shape heads_shape(const Dims& dims, int64_t heads, int64_t n, int64_t last) {
  return dims.rank == 4 ? Shape{dims.batch, heads, n, last} : Shape{dims.batch, n, last};
}
inline Shape lse_shape(const Dims& dims) {
  return dims.rank == 4 ? Shape{dims.batch, dims.heads, dims.nq} : Shape{dims.batch, dims.nq};
}
inline Shape softmax_stats_shape(const Dims& dims) {
  return dims.rank == 4 ? Shape{dims.batch, dims.heads, dims.nq, 2} : Shape{dims.batch, dims.nq, 2};
}

// An SDPA operand in the fast kernels' layout (kernels::rows_in_place): the
// caller's view when its rows already are (any strides along B, H and N, so
// (B, N, H, D) memory is read as (B, H, N, D) in place), else a contiguous
// copy owned here.
template <class T>
class KernelOperand {
 public:
  explicit KernelOperand(ConstView<T> view) {
    const ConstView<T> heads = kernels::as_heads(view);
    if (kernels::rows_in_place(heads)) {
      view_ = heads;
    } else {
      copy_ = Tensor<T>::copy_of(view);
      view_ = kernels::as_heads(ConstView<T>(copy_.view()));
    }
  }
  KernelOperand(const KernelOperand&) = delete;
  KernelOperand& operator=(const KernelOperand&) = delete;
  const ConstView<T>& view() const { return view_; }

 private:
  Tensor<T> copy_;
  ConstView<T> view_;
};

// Whether no two elements of a view share memory: with the axes sorted by
// |stride|, each stride clears the extent of the axes before it.
template <class T>
bool no_overlap(TensorView<T> x) {
  std::vector<std::pair<int64_t, int64_t>> axes;  // (|stride|, size) of axes longer than 1
  for (int a = 0; a < x.rank(); ++a) {
    if (x.size(a) == 0) return true;
    if (x.size(a) > 1) axes.emplace_back(std::abs(x.stride(a)), x.size(a));
  }
  std::sort(axes.begin(), axes.end());
  int64_t extent = 0;  // the largest offset the axes so far reach
  for (const auto& [stride, size] : axes) {
    if (stride <= extent) return false;
    extent += stride * (size - 1);
  }
  return true;
}

// The lengths the kernels see: the given ones, capped by the causal mask
// when options.causal asks for one, and by a window's right side: query i
// sees no key past i + Nk - Nq + window_right, a causal cap with that offset
// (check_masks leaves the window's left side to the masks). So window
// (-1, 0) is Causal::kBottomRight on the same path, bit for bit, and a
// window's keys past the cap are never read.
inline ValidLens kernel_lens(std::string_view fn, const Dims& dims, const ValidLens& valid_lens,
                             const AttentionOptions& options) {
  const ValidLens lens = options.window_right >= 0
                             ? valid_lens.causal(dims.nk - dims.nq + options.window_right)
                             : valid_lens;
  switch (options.causal) {
    case Causal::kNone:
      return lens;
    case Causal::kTopLeft:
      return lens.causal(0);
    case Causal::kBottomRight:
      return lens.causal(dims.nk - dims.nq);
  }
  fail(fn, "options.causal = " + std::to_string(static_cast<int>(options.causal)) +
               " is not a qkv::Causal value");
}

// A view that broadcasts against the scores (B, Nq, Nk), or (B, H, Nq, Nk)
// for heads (aligned from the right, each axis 1 or the scores' size), as
// the kernels read it: (B, H, Nq, Nk) with stride 0 along the axes it
// broadcasts over (3-D scores have no H axis: full axes 0, 2, 3).
template <class T>
TensorView<T> broadcast_to_scores(std::string_view fn, std::string_view name, TensorView<T> m,
                                  const Dims& dims) {
  const Shape scores = heads_shape(dims, dims.heads, dims.nq, dims.nk);
  bool fits = m.rank() >= 1 && m.rank() <= scores.rank();
  for (int a = 0; fits && a < m.rank(); ++a) {
    const int64_t size = m.size(m.rank() - 1 - a), want = scores[scores.rank() - 1 - a];
    fits = size == want || size == 1;
  }
  if (!fits) {
    fail(fn, std::string(name) + " has shape " + m.shape().str() +
                 ", which does not broadcast to the scores " + scores.str() +
                 " (aligned from the right, each axis 1 or the scores' size)");
  }
  const Shape full{dims.batch, dims.heads, dims.nq, dims.nk};
  Shape strides{0, 0, 0, 0};
  const int to_full_3d[] = {0, 2, 3};
  for (int a = 0; a < m.rank(); ++a) {
    const int scores_axis = scores.rank() - m.rank() + a;
    const int axis = scores.rank() == 4 ? scores_axis : to_full_3d[scores_axis];
    if (m.size(a) != 1) strides[axis] = m.stride(a);
  }
  return TensorView<T>(m.data(), full, strides);
}

// The masks of options as the kernels read them: mask as a (B, H, Nq, Nk)
// view with zero strides where it broadcasts; key_mask (B, Nk); the window.
inline void check_masks(std::string_view fn, const Dims& dims, const AttentionOptions& options,
                        kernels::AttentionConfig& config) {
  if (options.mask.rank() > 0) {
    config.mask = broadcast_to_scores(fn, "options.mask", options.mask, dims);
  }
  if (options.key_mask.rank() > 0) {
    detail::check_shape(fn, "options.key_mask", options.key_mask, Shape{dims.batch, dims.nk});
    config.key_mask = options.key_mask;
  }
  for (const auto& [name, value] : {std::pair{"options.window_left", options.window_left},
                                    {"options.window_right", options.window_right}}) {
    if (value < -1) fail(fn, std::string(name) + " = " + std::to_string(value) + " is below -1");
  }
  config.window_left = options.window_left;
  // The right side is a cap on the lengths (kernel_lens).
  config.window_right = -1;
}

// options.softcap and options.alibi_slopes as the kernels read them: the
// slopes as a (B, H) view, stride 0 along B for per-head slopes (H).
inline void check_softcap_alibi(std::string_view fn, const Dims& dims,
                                const AttentionOptions& options, kernels::AttentionConfig& config) {
  if (!(std::isfinite(options.softcap) && options.softcap >= 0.0)) {
    fail(fn, "options.softcap = " + std::to_string(options.softcap) +
                 "; expected a finite number >= 0 (0: no capping)");
  }
  config.softcap = options.softcap;
  const ConstView<double>& slopes = options.alibi_slopes;
  if (slopes.rank() == 0 && slopes.data() == nullptr) return;  // absent (a scalar is an error)
  const bool per_head = slopes.rank() == 1 && slopes.size(0) == dims.heads;
  const bool per_batch =
      slopes.rank() == 2 && slopes.size(0) == dims.batch && slopes.size(1) == dims.heads;
  if (!per_head && !per_batch) {
    fail(fn, "options.alibi_slopes has shape " + slopes.shape().str() + "; expected " +
                 Shape{dims.heads}.str() + " (one slope per head) or " +
                 Shape{dims.batch, dims.heads}.str() + " (per batch element and head)");
  }
  const ConstView<double> full(slopes.data(), Shape{dims.batch, dims.heads},
                               per_head ? Shape{0, slopes.stride(0)} : slopes.strides());
  for (int64_t b = 0; b < (per_head ? std::min<int64_t>(dims.batch, 1) : dims.batch); ++b) {
    for (int64_t h = 0; h < dims.heads; ++h) {
      if (!std::isfinite(full(b, h))) {
        fail(fn, "options.alibi_slopes" +
                     (per_head ? "[" + std::to_string(h) + "]"
                               : "[" + std::to_string(b) + ", " + std::to_string(h) + "]") +
                     " = " + std::to_string(full(b, h)) + " is not finite");
      }
    }
  }
  config.alibi_slopes = full;
}

inline const char* type_name(float) { return "float32"; }
inline const char* type_name(double) { return "float64"; }

inline bool has_bias(const AttentionOptions& options) {
  return !std::holds_alternative<std::monostate>(options.bias);
}

// options.bias as the kernels read it, in the accumulation type Acc (float
// for float and bf16 inputs, double for double), broadcast like the mask.
template <class Acc>
void check_bias(std::string_view fn, const Dims& dims, const AttentionOptions& options,
                kernels::AttentionConfig& config) {
  if (!has_bias(options)) {
    if (options.want_bias_grad) {
      fail(fn, "options.want_bias_grad is set but options.bias is empty");
    }
    return;
  }
  const ConstView<Acc>* bias = std::get_if<ConstView<Acc>>(&options.bias);
  if (bias == nullptr) {
    fail(fn, std::string("options.bias is ") +
                 (std::is_same_v<Acc, float> ? "float64" : "float32") +
                 " but the inputs compute in " + type_name(Acc()) + "; give a " + type_name(Acc()) +
                 " bias (float32 for float32 and bfloat16 inputs, float64 "
                 "for float64 ones)");
  }
  const ConstView<Acc> full = broadcast_to_scores(fn, "options.bias", *bias, dims);
  if constexpr (std::is_same_v<Acc, float>) {
    config.bias_float = full;
  } else {
    config.bias_double = full;
  }
}

inline bool has_masks(const AttentionOptions& options) {
  return options.mask.rank() > 0 || options.key_mask.rank() > 0 || options.window_left != -1 ||
         options.window_right != -1 || has_bias(options) || options.want_bias_grad ||
         options.softcap != 0.0 || options.alibi_slopes.rank() > 0 ||
         options.alibi_slopes.data() != nullptr;
}

// options.scale by the scoring function's rule (qkv/scoring.h), or its default.
inline double checked_scale(std::string_view fn, const ScoringRules& rules, const Dims& dims,
                            const AttentionOptions& options) {
  const std::optional<double>& scale = options.scale;
  switch (rules.scale) {
    case ScaleRule::kNone:
      if (scale) {
        fail(fn, "options.scale is set, but " + std::string(rules.title) +
                     " attention has no scale; leave it unset");
      }
      return 1.0;
    case ScaleRule::kInverseSqrtDim:
      if (scale && !std::isfinite(*scale)) {
        fail(fn, "options.scale = " + std::to_string(*scale) + " is not finite");
      }
      if (!scale && dims.dq == 0) {
        fail(fn,
             "queries has D = 0, so the default scale 1/sqrt(D) is undefined; set "
             "options.scale");
      }
      return scale.value_or(1.0 / std::sqrt(static_cast<double>(dims.dq)));
    case ScaleRule::kPositiveOne:
      if (scale && !(std::isfinite(*scale) && *scale > 0)) {
        fail(fn, "options.scale = " + std::to_string(*scale) + "; expected a finite number > 0");
      }
      return scale.value_or(1.0);
  }
  fail(fn, "scoring function " + std::string(rules.name) + " has no scale rule");
}

// The titles of the scoring functions that take masks: "scaled dot-product".
inline std::string titles_with_masks() {
  std::string titles;
  for (const ScoringRules& rules : scoring_table()) {
    if (rules.masks) titles += (titles.empty() ? "" : " and ") + std::string(rules.title);
  }
  return titles;
}

// The options as the kernels take them, checked by the scoring function's
// rules: dropout, the scale, causal, and the masks and bias where it takes
// them. Acc: the type the kernels compute in (the bias's type).
template <class Acc>
kernels::AttentionConfig attention_config(std::string_view fn, const ScoringRules& rules,
                                          const Dims& dims, const ValidLens& valid_lens,
                                          const AttentionOptions& options) {
  detail::check_dropout(fn, "options.dropout_p", options.dropout_p);
  const double scale = checked_scale(fn, rules, dims, options);
  if (!rules.causal && options.causal != Causal::kNone) {
    fail(fn, "options.causal is set, but " + std::string(rules.title) +
                 " attention takes no causal mask; leave it kNone");
  }
  kernels::AttentionConfig config{kernel_lens(fn, dims, valid_lens, options), scale,
                                  options.training ? options.dropout_p : 0.0, options.seed,
                                  dims.heads};
  if (rules.masks) {
    check_masks(fn, dims, options, config);
    check_bias<Acc>(fn, dims, options, config);
    check_softcap_alibi(fn, dims, options, config);
  } else if (has_masks(options)) {
    fail(fn, "options.mask, key_mask, window_left/right, bias, softcap and alibi_slopes are for " +
                 titles_with_masks() + " attention; " + std::string(rules.title) +
                 " attention takes valid_lens and causal");
  }
  return config;
}

// Caller-given destinations: weights and lse contiguous; the output too for
// additive attention, while SDPA writes any output whose rows are contiguous
// and do not overlap (e.g. (B, Nq, H, Dv) memory viewed as (B, H, Nq, Dv)).
template <class T>
void check_outputs(std::string_view fn, const Dims& dims, const AttentionOutputs<T>& outputs,
                   bool strided_output) {
  const Shape output_shape = heads_shape(dims, dims.heads, dims.nq, dims.dv);
  if (strided_output) {
    detail::check_shape(fn, "outputs.output", outputs.output, output_shape);
    const bool placed =
        kernels::rows_in_place(kernels::as_heads(outputs.output)) && no_overlap(outputs.output);
    if (outputs.output.numel() > 0 && !placed) {
      fail(fn, "outputs.output of shape " + output_shape.str() + " has strides " +
                   outputs.output.strides().str() +
                   "; it needs contiguous rows (stride 1 along Dv) that do not overlap");
    }
  } else {
    detail::check_destination(fn, "outputs.output", outputs.output, output_shape);
  }
  if (outputs.weights) {
    detail::check_destination(fn, "outputs.weights", *outputs.weights,
                              heads_shape(dims, dims.heads, dims.nq, dims.nk));
  }
  if (outputs.lse) detail::check_destination(fn, "outputs.lse", *outputs.lse, lse_shape(dims));
  if (outputs.softmax_stats) {
    if (!outputs.lse) {
      fail(fn,
           "outputs.softmax_stats is given but outputs.lse is not; the statistics come "
           "with the lse (the backward reads both)");
    }
    detail::check_destination(fn, "outputs.softmax_stats", *outputs.softmax_stats,
                              softmax_stats_shape(dims));
  }
}

template <class T>
void check_saved(std::string_view fn, const Dims& dims, const SavedForward<T>& saved,
                 ConstView<T> d_output) {
  const Shape output_shape = heads_shape(dims, dims.heads, dims.nq, dims.dv);
  detail::check_shape(fn, "output", saved.output, output_shape);
  detail::check_shape(fn, "lse", saved.lse, lse_shape(dims));
  if (saved.softmax_stats.data() != nullptr) {
    detail::check_shape(fn, "softmax_stats", saved.softmax_stats, softmax_stats_shape(dims));
  }
  detail::check_shape(fn, "d_output", d_output, output_shape);
}

// The destinations of a forward: the caller's (write-into form), or tensors
// of `result` allocated here (weights and lse as asked for; the reference
// always returns both). The softmax's statistics only where `stats` says
// the scoring function forms them (scaled dot-product).
template <class T>
kernels::ForwardViews<T> destinations(std::string_view fn, Version version, const Dims& dims,
                                      const AttentionOptions& options,
                                      const AttentionOutputs<T>* given, AttentionResult<T>& result,
                                      bool strided_output = false, bool stats = false) {
  const bool stats_asked = given ? given->softmax_stats.has_value() : options.return_softmax_stats;
  if (stats_asked && !stats) {
    fail(fn, std::string(given ? "outputs.softmax_stats is given"
                               : "options.return_softmax_stats "
                                 "is set") +
                 ", but only scaled_dot_product_attention returns the softmax's statistics");
  }
  if (given != nullptr) {
    check_outputs(fn, dims, *given, strided_output);
    return {given->output, given->weights.value_or(TensorView<T>()),
            given->lse.value_or(TensorView<T>()), given->softmax_stats.value_or(TensorView<T>())};
  }
  if (options.return_softmax_stats && !options.return_lse) {
    fail(fn,
         "options.return_softmax_stats is set but options.return_lse is not; the statistics "
         "come with the lse (the backward reads both)");
  }
  const bool weights = version == Version::kRef || options.return_weights;
  const bool lse = version == Version::kRef || options.return_lse;
  result.output = Tensor<T>(heads_shape(dims, dims.heads, dims.nq, dims.dv));
  if (weights) result.weights = Tensor<T>(heads_shape(dims, dims.heads, dims.nq, dims.nk));
  if (lse) result.lse = Tensor<T>(lse_shape(dims));
  if (stats_asked) result.softmax_stats = Tensor<T>(softmax_stats_shape(dims));
  return {result.output.view(), weights ? result.weights.view() : TensorView<T>(),
          lse ? result.lse.view() : TensorView<T>(),
          stats_asked ? result.softmax_stats.view() : TensorView<T>()};
}

}  // namespace qkv::detail
