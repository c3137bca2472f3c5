// Attention front ends: validate shapes and options once, allocate every
// destination, then run the fast kernel (public API) or the reference kernel
// (qkv::ref). One helper per op; the public overloads only pick the version.
#include "qkv/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/check.h"
#include "core/contiguous.h"
#include "kernels/runtime/blas.h"
#include "kernels/attention/centred.h"
#include "kernels/simd/gemm_bf16.h"
#include "kernels/kernels.h"
#include "kernels/simd/vecmath.h"
#include "qkv/threads.h"

namespace qkv {
namespace {

constexpr std::string_view kSdpa = "scaled_dot_product_attention";
constexpr std::string_view kSdpaBackward = "scaled_dot_product_attention_backward";
constexpr std::string_view kAdditive = "additive_attention";
constexpr std::string_view kAdditiveBackward = "additive_attention_backward";
constexpr std::string_view kBilinear = "bilinear_attention";
constexpr std::string_view kBilinearBackward = "bilinear_attention_backward";
constexpr std::string_view kDistance = "distance_attention";
constexpr std::string_view kDistanceBackward = "distance_attention_backward";

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

// The fast SDPA kernels with their scratch; In is float, double or bfloat16
// (then Acc is float).
template <class In, class Acc>
void fast_sdpa(ConstView<In> q, ConstView<In> k, ConstView<In> v,
               const kernels::AttentionConfig& config, const kernels::ForwardViews<Acc>& out) {
  with_workspace(
      pair_flops(q, k, 2.0 * static_cast<double>(q.size(3) + v.size(3))),
      [&](int threads) {
        return kernels::fast::sdpa_workspace_size(q, k, v, config, out, threads);
      },
      [&](kernels::Workspace ws) { kernels::fast::sdpa(q, k, v, config, out, ws); });
}

template <class In, class Acc>
void fast_sdpa_backward(ConstView<In> q, ConstView<In> k, ConstView<In> v,
                        const kernels::AttentionConfig& config,
                        const kernels::SavedViews<Acc>& saved, ConstView<Acc> d_output,
                        const kernels::SdpaGradViews<Acc>& grads) {
  with_workspace(
      pair_flops(q, k, 5.0 * static_cast<double>(q.size(3) + v.size(3))),
      [&](int threads) {
        return kernels::fast::sdpa_backward_workspace_size(q, k, v, config, saved, d_output, grads,
                                                           threads);
      },
      [&](kernels::Workspace ws) {
        kernels::fast::sdpa_backward(q, k, v, config, saved, d_output, grads, ws);
      });
}

struct Dims {
  int64_t batch, nq, nk, dq, dk, dv;
  // Scaled dot-product attention with 4-D inputs: query and key heads.
  int rank = 3;
  int64_t heads = 1, kv_heads = 1;
};

std::string shapes_of(std::string_view a, const Shape& sa, std::string_view b, const Shape& sb) {
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

// queries (B, Nq, D), keys (B, Nk, D), values (B, Nk, Dv); additive: queries
// (B, Nq, Dq), keys (B, Nk, Dk).
template <class T>
Dims check_inputs(std::string_view fn, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                  bool additive, const ValidLens& valid_lens) {
  detail::check_rank(fn, "queries", q, 3, additive ? "(B, Nq, Dq)" : "(B, Nq, D)");
  detail::check_rank(fn, "keys", k, 3, additive ? "(B, Nk, Dk)" : "(B, Nk, D)");
  detail::check_rank(fn, "values", v, 3, "(B, Nk, Dv)");
  check_same(fn, "B", "keys", k, 0, "queries", q, 0);
  check_same(fn, "B", "values", v, 0, "keys", k, 0);
  if (!additive) check_same(fn, "D", "keys", k, 2, "queries", q, 2);
  check_same(fn, "Nk", "values", v, 1, "keys", k, 1);
  const Dims dims{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), v.size(2)};
  valid_lens.check(fn, "scores", Shape{dims.batch, dims.nq, dims.nk}, dims.batch, dims.nq, dims.nk);
  return dims;
}

// Scaled dot-product attention: 3-D inputs as above, or heads: queries
// (B, H, Nq, D), keys (B, Hkv, Nk, D), values (B, Hkv, Nk, Dv) with H a
// multiple of Hkv.
template <class T>
Dims check_sdpa_inputs(std::string_view fn, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const ValidLens& valid_lens) {
  if (q.rank() != 4) return check_inputs(fn, q, k, v, false, valid_lens);
  detail::check_rank(fn, "keys", k, 4, "(B, Hkv, Nk, D), as queries is (B, H, Nq, D)");
  detail::check_rank(fn, "values", v, 4, "(B, Hkv, Nk, Dv), as queries is (B, H, Nq, D)");
  check_same(fn, "B", "keys", k, 0, "queries", q, 0);
  check_same(fn, "B", "values", v, 0, "keys", k, 0);
  check_same(fn, "Hkv", "values", v, 1, "keys", k, 1);
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  if (kv_heads == 0 ? heads != 0 : heads % kv_heads != 0) {
    fail(fn, "queries has H = " + std::to_string(heads) + " heads, not a multiple of the Hkv = " +
                 std::to_string(kv_heads) + " heads of keys and values" +
                 shapes_of("queries", q.shape(), "keys", k.shape()));
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

// Shapes of SDPA's results for these inputs: 3-D inputs give 3-D results.
Shape heads_shape(const Dims& dims, int64_t heads, int64_t n, int64_t last) {
  return dims.rank == 4 ? Shape{dims.batch, heads, n, last} : Shape{dims.batch, n, last};
}
Shape lse_shape(const Dims& dims) {
  return dims.rank == 4 ? Shape{dims.batch, dims.heads, dims.nq} : Shape{dims.batch, dims.nq};
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
// when options.causal asks for one.
ValidLens kernel_lens(std::string_view fn, const Dims& dims, const ValidLens& valid_lens,
                      const AttentionOptions& options) {
  switch (options.causal) {
    case Causal::kNone:
      return valid_lens;
    case Causal::kTopLeft:
      return valid_lens.causal(0);
    case Causal::kBottomRight:
      return valid_lens.causal(dims.nk - dims.nq);
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
void check_masks(std::string_view fn, const Dims& dims, const AttentionOptions& options,
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
  config.window_right = options.window_right;
}

const char* type_name(float) { return "float32"; }
const char* type_name(double) { return "float64"; }

bool has_bias(const AttentionOptions& options) {
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
    fail(fn, std::string("options.bias is ") + (std::is_same_v<Acc, float> ? "float64" : "float32") +
                 " but the inputs compute in " + type_name(Acc()) + "; give a " +
                 type_name(Acc()) + " bias (float32 for float32 and bfloat16 inputs, float64 "
                 "for float64 ones)");
  }
  const ConstView<Acc> full = broadcast_to_scores(fn, "options.bias", *bias, dims);
  if constexpr (std::is_same_v<Acc, float>) {
    config.bias_float = full;
  } else {
    config.bias_double = full;
  }
}

bool has_masks(const AttentionOptions& options) {
  return options.mask.rank() > 0 || options.key_mask.rank() > 0 || options.window_left != -1 ||
         options.window_right != -1 || has_bias(options) || options.want_bias_grad;
}

// Acc: the type the kernels compute in (the bias's type).
template <class Acc>
kernels::AttentionConfig sdpa_config(std::string_view fn, const Dims& dims,
                                     const ValidLens& valid_lens, const AttentionOptions& options) {
  detail::check_dropout(fn, "options.dropout", options.dropout);
  if (options.scale && !std::isfinite(*options.scale)) {
    fail(fn, "options.scale = " + std::to_string(*options.scale) + " is not finite");
  }
  if (!options.scale && dims.dq == 0) {
    fail(fn, "queries has D = 0, so the default scale 1/sqrt(D) is undefined; set options.scale");
  }
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(dims.dq)));
  kernels::AttentionConfig config{kernel_lens(fn, dims, valid_lens, options), scale,
                                  options.training ? options.dropout : 0.0, options.seed,
                                  dims.heads};
  check_masks(fn, dims, options, config);
  check_bias<Acc>(fn, dims, options, config);
  return config;
}

// The options of the scoring functions that take valid_lens, causal and
// dropout but none of scaled dot-product attention's masks or bias:
// additive and bilinear attention (no scale) and distance attention (scale
// > 0, default 1). `scoring` names the function in messages.
kernels::AttentionConfig lens_only_config(std::string_view fn, std::string_view scoring,
                                          const Dims& dims, const ValidLens& valid_lens,
                                          const AttentionOptions& options) {
  detail::check_dropout(fn, "options.dropout", options.dropout);
  const bool takes_scale = scoring == "distance";
  if (options.scale && !takes_scale) {
    fail(fn, "options.scale is set, but " + std::string(scoring) +
                 " attention has no scale; leave it unset");
  }
  if (options.scale && !(std::isfinite(*options.scale) && *options.scale > 0)) {
    fail(fn,
         "options.scale = " + std::to_string(*options.scale) + "; expected a finite number > 0");
  }
  if (has_masks(options)) {
    fail(fn,
         "options.mask, key_mask, window_left/right and bias are for scaled dot-product "
         "attention; " +
             std::string(scoring) + " attention takes valid_lens and causal");
  }
  return {kernel_lens(fn, dims, valid_lens, options), options.scale.value_or(1.0),
          options.training ? options.dropout : 0.0, options.seed};
}

// w_q (H, Dq), w_k (H, Dk), w_v (H) or (1, H); the kernels get w_v as (H).
template <class T>
kernels::AdditiveParams<T> check_weights(std::string_view fn, const Dims& dims,
                                         const AdditiveWeights<T>& weights) {
  const ConstView<T>& w_q = weights.w_q;
  const ConstView<T>& w_k = weights.w_k;
  const ConstView<T>& w_v = weights.w_v;
  detail::check_rank(fn, "w_q", w_q, 2, "(H, Dq)");
  detail::check_rank(fn, "w_k", w_k, 2, "(H, Dk)");
  const int64_t hidden = w_q.size(0);
  if (w_q.size(1) != dims.dq) {
    fail(fn, "w_q has shape " + w_q.shape().str() + " but queries has Dq = " +
                 std::to_string(dims.dq) + "; expected " + Shape{hidden, dims.dq}.str());
  }
  if (w_k.size(0) != hidden || w_k.size(1) != dims.dk) {
    fail(fn, "w_k has shape " + w_k.shape().str() + " but w_q has shape " + w_q.shape().str() +
                 " and keys has Dk = " + std::to_string(dims.dk) + "; expected " +
                 Shape{hidden, dims.dk}.str());
  }
  const bool flat = w_v.shape() == Shape{hidden};
  const bool row = w_v.shape() == Shape{1, hidden};
  if (!flat && !row) {
    fail(fn, "w_v has shape " + w_v.shape().str() + " but w_q has shape " + w_q.shape().str() +
                 "; expected " + Shape{hidden}.str() + " or " + Shape{1, hidden}.str());
  }
  const ConstView<T> w_v_flat =
      flat ? w_v : ConstView<T>(w_v.data(), Shape{hidden}, Shape{w_v.stride(1)});
  return {w_q, w_k, w_v_flat};
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
}

template <class T>
void check_saved(std::string_view fn, const Dims& dims, const SavedForward<T>& saved,
                 ConstView<T> d_output) {
  const Shape output_shape = heads_shape(dims, dims.heads, dims.nq, dims.dv);
  detail::check_shape(fn, "output", saved.output, output_shape);
  detail::check_shape(fn, "lse", saved.lse, lse_shape(dims));
  detail::check_shape(fn, "d_output", d_output, output_shape);
}

// The destinations of a forward: the caller's (write-into form), or tensors
// of `result` allocated here (weights and lse as asked for; the reference
// always returns both).
template <class T>
kernels::ForwardViews<T> destinations(std::string_view fn, Version version, const Dims& dims,
                                      const AttentionOptions& options,
                                      const AttentionOutputs<T>* given,
                                      AttentionResult<T>& result) {
  if (given != nullptr) {
    check_outputs(fn, dims, *given, /*strided_output=*/fn == kSdpa);
    return {given->output, given->weights.value_or(TensorView<T>()),
            given->lse.value_or(TensorView<T>())};
  }
  const bool weights = version == Version::kRef || options.want_weights;
  const bool lse = version == Version::kRef || options.want_lse;
  result.output = Tensor<T>(heads_shape(dims, dims.heads, dims.nq, dims.dv));
  if (weights) result.weights = Tensor<T>(heads_shape(dims, dims.heads, dims.nq, dims.nk));
  if (lse) result.lse = Tensor<T>(lse_shape(dims));
  return {result.output.view(), weights ? result.weights.view() : TensorView<T>(),
          lse ? result.lse.view() : TensorView<T>()};
}

// ---- scaled dot-product ------------------------------------------------------

// The gradients of a backward, allocated in the inputs' shapes (and the
// bias's when asked for), and the views the kernels write them through.
template <class In, class Acc>
kernels::SdpaGradViews<Acc> gradient_views(ConstView<In> q, ConstView<In> k, ConstView<In> v,
                                           const Dims& dims, const AttentionOptions& options,
                                           DotProductGrads<Acc>& grads) {
  grads.d_queries = Tensor<Acc>(q.shape());
  grads.d_keys = Tensor<Acc>(k.shape());
  grads.d_values = Tensor<Acc>(v.shape());
  kernels::SdpaGradViews<Acc> out{kernels::as_heads(grads.d_queries.view()),
                                  kernels::as_heads(grads.d_keys.view()),
                                  kernels::as_heads(grads.d_values.view())};
  if (options.want_bias_grad) {
    grads.d_bias = Tensor<Acc>(std::get<ConstView<Acc>>(options.bias).shape());
    out.d_bias = broadcast_to_scores(kSdpaBackward, "options.bias", grads.d_bias.view(), dims);
  }
  return out;
}

// The forward into the caller's outputs (given) or into a new result.
template <class T>
AttentionResult<T> sdpa_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                const ValidLens& valid_lens, const AttentionOptions& options,
                                const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_sdpa_inputs(kSdpa, q, k, v, valid_lens);
  const kernels::AttentionConfig config = sdpa_config<T>(kSdpa, dims, valid_lens, options);
  AttentionResult<T> result;
  kernels::ForwardViews<T> out = destinations(kSdpa, version, dims, options, given, result);
  out.output = kernels::as_heads(out.output);
  if (version == Version::kFast) {
    const KernelOperand<T> qk(q), kk(k), vk(v);
    fast_sdpa(qk.view(), kk.view(), vk.view(), config, out);
    return result;
  }
  kernels::ref::sdpa(kernels::as_heads(q), kernels::as_heads(k), kernels::as_heads(v), config, out);
  return result;
}

template <class T>
DotProductGrads<T> sdpa_backward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                 const ValidLens& valid_lens, const AttentionOptions& options,
                                 const SavedForward<T>& saved, ConstView<T> d_output,
                                 ConstView<T> d_lse = {}) {
  const Dims dims = check_sdpa_inputs(kSdpaBackward, q, k, v, valid_lens);
  const kernels::AttentionConfig config = sdpa_config<T>(kSdpaBackward, dims, valid_lens, options);
  check_saved(kSdpaBackward, dims, saved, d_output);
  if (d_lse.data() != nullptr) detail::check_shape(kSdpaBackward, "d_lse", d_lse, lse_shape(dims));
  DotProductGrads<T> grads;
  const kernels::SdpaGradViews<T> out = gradient_views(q, k, v, dims, options, grads);
  if (version == Version::kFast) {
    const KernelOperand<T> qk(q), kk(k), vk(v), ok(saved.output), gk(d_output);
    const detail::Contiguous<T> lc(saved.lse), dlc(d_lse);
    fast_sdpa_backward(qk.view(), kk.view(), vk.view(), config,
                       {ok.view(), lc.view(), d_lse.data() != nullptr ? dlc.view() : ConstView<T>()},
                       gk.view(), out);
    return grads;
  }
  kernels::ref::sdpa_backward(kernels::as_heads(q), kernels::as_heads(k), kernels::as_heads(v), config,
                              {kernels::as_heads(saved.output), saved.lse, d_lse},
                              kernels::as_heads(d_output), out);
  return grads;
}

// bf16 inputs: the same checks, float results. The forward reads bf16 in
// every case: with the BF16 instructions in their products, without them
// widened in registers (few queries) or tile by tile (kernels/attention/sdpa_fast.cc).
// The backward without the BF16 instructions (or at a SIMD cap below
// avx512) runs the float kernel on float copies of the inputs (widening is
// exact: results within the bf16 path's bounds, docs/semantics.md): its
// packed bf16 products would widen every block for every product.
bool bf16_backward_through_float() { return !kernels::fast::bf16_native(); }

Tensor<float> widened(ConstView<bfloat16> x) {
  const detail::Contiguous<bfloat16> xc(x);
  Tensor<float> out(x.shape());
  kernels::fast::to_float(xc.data(), out.data(), out.numel());
  return out;
}

AttentionResult<float> sdpa_forward_bf16(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                         ConstView<bfloat16> v, const ValidLens& valid_lens,
                                         const AttentionOptions& options) {
  const Dims dims = check_sdpa_inputs(kSdpa, q, k, v, valid_lens);
  const kernels::AttentionConfig config = sdpa_config<float>(kSdpa, dims, valid_lens, options);
  AttentionResult<float> result;
  kernels::ForwardViews<float> out =
      destinations<float>(kSdpa, Version::kFast, dims, options, nullptr, result);
  out.output = kernels::as_heads(out.output);
  const KernelOperand<bfloat16> qk(q), kk(k), vk(v);
  fast_sdpa(qk.view(), kk.view(), vk.view(), config, out);
  return result;
}

DotProductGrads<float> sdpa_backward_bf16(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                          ConstView<bfloat16> v, const ValidLens& valid_lens,
                                          const AttentionOptions& options,
                                          const SavedForward<float>& saved,
                                          ConstView<float> d_output) {
  const Dims dims = check_sdpa_inputs(kSdpaBackward, q, k, v, valid_lens);
  const kernels::AttentionConfig config =
      sdpa_config<float>(kSdpaBackward, dims, valid_lens, options);
  check_saved(kSdpaBackward, dims, saved, d_output);
  if (bf16_backward_through_float()) {
    const Tensor<float> qf = widened(q), kf = widened(k), vf = widened(v);
    return sdpa_backward<float>(Version::kFast, qf, kf, vf, valid_lens, options, saved, d_output);
  }
  DotProductGrads<float> grads;
  const kernels::SdpaGradViews<float> out = gradient_views(q, k, v, dims, options, grads);
  const KernelOperand<bfloat16> qk(q), kk(k), vk(v);
  const KernelOperand<float> ok(saved.output), gk(d_output);
  const detail::Contiguous<float> lc(saved.lse);
  fast_sdpa_backward<bfloat16, float>(qk.view(), kk.view(), vk.view(), config,
                                      {ok.view(), lc.view()}, gk.view(), out);
  return grads;
}

// ---- additive ---------------------------------------------------------------

template <class T>
AttentionResult<T> additive_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const AdditiveWeights<T>& weights, const ValidLens& valid_lens,
                                    const AttentionOptions& options,
                                    const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_inputs(kAdditive, q, k, v, true, valid_lens);
  const kernels::AdditiveParams<T> params = check_weights(kAdditive, dims, weights);
  const kernels::AttentionConfig config =
      lens_only_config(kAdditive, "additive", dims, valid_lens, options);
  AttentionResult<T> result;
  const kernels::ForwardViews<T> out =
      destinations(kAdditive, version, dims, options, given, result);
  if (version == Version::kFast) {
    const detail::Contiguous<T> qc(q), kc(k), vc(v);
    if (kernels::fast::supports(qc.view(), kc.view(), vc.view())) {
      const detail::Contiguous<T> wqc(params.w_q), wkc(params.w_k), wvc(params.w_v);
      const kernels::AdditiveParams<T> fast_params{wqc.view(), wkc.view(), wvc.view()};
      with_workspace(
          pair_flops(qc.view(), kc.view(),
                     4.0 * static_cast<double>(params.w_q.size(0) + dims.dv)),
          [&](int threads) {
            return kernels::fast::additive_workspace_size(qc.view(), kc.view(), vc.view(),
                                                          fast_params, config, out, threads);
          },
          [&](kernels::Workspace ws) {
            kernels::fast::additive(qc.view(), kc.view(), vc.view(), fast_params, config, out, ws);
          });
      return result;
    }
  }
  kernels::ref::additive(q, k, v, params, config, out);
  return result;
}

template <class T>
AdditiveGrads<T> additive_backward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                   const AdditiveWeights<T>& weights, const ValidLens& valid_lens,
                                   const AttentionOptions& options, const SavedForward<T>& saved,
                                   ConstView<T> d_output) {
  const Dims dims = check_inputs(kAdditiveBackward, q, k, v, true, valid_lens);
  const kernels::AdditiveParams<T> params = check_weights(kAdditiveBackward, dims, weights);
  const kernels::AttentionConfig config =
      lens_only_config(kAdditiveBackward, "additive", dims, valid_lens, options);
  check_saved(kAdditiveBackward, dims, saved, d_output);
  const int64_t hidden = params.w_q.size(0);
  AdditiveGrads<T> grads{Tensor<T>(q.shape()),           Tensor<T>(k.shape()),
                         Tensor<T>(v.shape()),           Tensor<T>(weights.w_q.shape()),
                         Tensor<T>(weights.w_k.shape()), Tensor<T>(Shape{hidden})};
  const kernels::AdditiveGradViews<T> out{grads.d_queries.view(), grads.d_keys.view(),
                                          grads.d_values.view(),  grads.d_w_q.view(),
                                          grads.d_w_k.view(),     grads.d_w_v.view()};
  bool done = false;
  if (version == Version::kFast) {
    const detail::Contiguous<T> qc(q), kc(k), vc(v);
    if (kernels::fast::supports(qc.view(), kc.view(), vc.view())) {
      const detail::Contiguous<T> wqc(params.w_q), wkc(params.w_k), wvc(params.w_v);
      const detail::Contiguous<T> oc(saved.output), lc(saved.lse), gc(d_output);
      const kernels::AdditiveParams<T> fast_params{wqc.view(), wkc.view(), wvc.view()};
      const kernels::SavedViews<T> fast_saved{oc.view(), lc.view()};
      with_workspace(
          pair_flops(qc.view(), kc.view(), 8.0 * static_cast<double>(hidden + dims.dv)),
          [&](int threads) {
            return kernels::fast::additive_backward_workspace_size(qc.view(), kc.view(), vc.view(),
                                                                   fast_params, config, fast_saved,
                                                                   gc.view(), out, threads);
          },
          [&](kernels::Workspace ws) {
            kernels::fast::additive_backward(qc.view(), kc.view(), vc.view(), fast_params, config,
                                             fast_saved, gc.view(), out, ws);
          });
      done = true;
    }
  }
  if (!done) {
    kernels::ref::additive_backward(q, k, v, params, config, {saved.output, saved.lse}, d_output,
                                    out);
  }
  grads.d_w_v = std::move(grads.d_w_v).reshaped(weights.w_v.shape());
  return grads;
}

// ---- bilinear ---------------------------------------------------------------

// w (Dq, Dk).
template <class T>
void check_bilinear_w(std::string_view fn, const Dims& dims, ConstView<T> w) {
  detail::check_rank(fn, "w", w, 2, "(Dq, Dk)");
  if (w.size(0) != dims.dq || w.size(1) != dims.dk) {
    fail(fn, "w has shape " + w.shape().str() + " but queries has Dq = " + std::to_string(dims.dq) +
                 " and keys has Dk = " + std::to_string(dims.dk) + "; expected " +
                 Shape{dims.dq, dims.dk}.str());
  }
}

// q W (B, Nq, Dk): the bilinear scores q W k are its dot products with the
// keys. One product over all B * Nq rows in fixed row blocks (bits
// independent of the thread count).
template <class T>
Tensor<T> queries_times_w(ConstView<T> q, ConstView<T> w) {
  const detail::Contiguous<T> qc(q), wc(w);
  const int64_t dq = w.size(0), dk = w.size(1);
  Tensor<T> qw(Shape{q.size(0), q.size(1), dk});
  kernels::parallel_gemm(false, false, q.size(0) * q.size(1), dk, dq, T(1), qc.data(), dq,
                         wc.data(), dk, T(0), qw.data(), dk);
  return qw;
}

template <class T>
AttentionResult<T> bilinear_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    ConstView<T> w, const ValidLens& valid_lens,
                                    const AttentionOptions& options,
                                    const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_inputs(kBilinear, q, k, v, true, valid_lens);
  check_bilinear_w(kBilinear, dims, w);
  const kernels::AttentionConfig config =
      lens_only_config(kBilinear, "bilinear", dims, valid_lens, options);
  AttentionResult<T> result;
  kernels::ForwardViews<T> out = destinations(kBilinear, version, dims, options, given, result);
  if (version == Version::kRef) {
    kernels::ref::bilinear(q, k, v, w, config, out);
    return result;
  }
  // Scaled dot-product attention (scale 1) of q W and the keys.
  const Tensor<T> qw = queries_times_w(q, w);
  out.output = kernels::as_heads(out.output);
  const KernelOperand<T> kk(k), vk(v);
  fast_sdpa(kernels::as_heads(ConstView<T>(qw.view())), kk.view(), vk.view(), config, out);
  return result;
}

template <class T>
BilinearGrads<T> bilinear_backward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                   ConstView<T> w, const ValidLens& valid_lens,
                                   const AttentionOptions& options, const SavedForward<T>& saved,
                                   ConstView<T> d_output) {
  const Dims dims = check_inputs(kBilinearBackward, q, k, v, true, valid_lens);
  check_bilinear_w(kBilinearBackward, dims, w);
  const kernels::AttentionConfig config =
      lens_only_config(kBilinearBackward, "bilinear", dims, valid_lens, options);
  check_saved(kBilinearBackward, dims, saved, d_output);
  BilinearGrads<T> grads{Tensor<T>(q.shape()), Tensor<T>(k.shape()), Tensor<T>(v.shape()),
                         Tensor<T>(w.shape())};
  if (version == Version::kRef) {
    kernels::ref::bilinear_backward(
        q, k, v, w, config, {saved.output, saved.lse}, d_output,
        {grads.d_queries.view(), grads.d_keys.view(), grads.d_values.view(), grads.d_w.view()});
    return grads;
  }
  // The dot-product backward on q W gives d(q W), dK and dV; then
  // dQ = d(q W) Wᵀ and dW = sum_b Q_bᵀ d(q W)_b, each one product.
  const Tensor<T> qw = queries_times_w(q, w);
  Tensor<T> d_qw(qw.shape());
  const kernels::SdpaGradViews<T> out{kernels::as_heads(d_qw.view()),
                                      kernels::as_heads(grads.d_keys.view()),
                                      kernels::as_heads(grads.d_values.view())};
  {
    const KernelOperand<T> kk(k), vk(v), ok(saved.output), gk(d_output);
    const detail::Contiguous<T> lc(saved.lse);
    fast_sdpa_backward(kernels::as_heads(ConstView<T>(qw.view())), kk.view(), vk.view(), config,
                       {ok.view(), lc.view()}, gk.view(), out);
  }
  const detail::Contiguous<T> qc(q), wc(w);
  const int64_t rows = dims.batch * dims.nq;
  kernels::parallel_gemm(false, true, rows, dims.dq, dims.dk, T(1), d_qw.data(), dims.dk, wc.data(),
                         dims.dk, T(0), grads.d_queries.data(), dims.dq);
  kernels::gemm(true, false, dims.dq, dims.dk, rows, T(1), qc.data(), dims.dq, d_qw.data(), dims.dk,
                T(0), grads.d_w.data(), dims.dk);
  return grads;
}

// ---- distance -----------------------------------------------------------------

// Distance attention's operands for the dot-product kernel (kernels/attention/centred.h):
// queries and keys of batch element b centred at the mean of its valid keys
// (keys j < the longest length among its queries; keys past it, which no
// query sees and which are never read, stay zeros), the bias per key
// -scale/2 |k'|^2 (B, Nk), and the term per query -scale/2 |q'|^2 (B, Nq)
// that the softmax ignores and the lse adds.
template <class T>
struct CentredOperands {
  Tensor<T> q, k, key_terms;
  std::vector<double> query_terms;

  CentredOperands(ConstView<T> queries, ConstView<T> keys, const kernels::AttentionConfig& config)
      : q(queries.shape()),
        k(keys.shape()),
        key_terms(Shape{keys.size(0), keys.size(1)}),
        query_terms(static_cast<size_t>(queries.size(0) * queries.size(1))) {
    const int64_t batch = queries.size(0), nq = queries.size(1), nk = keys.size(1),
                  d = queries.size(2);
    for (int64_t b = 0; b < batch; ++b) {
      int64_t seen = 0;  // the keys some query of b sees
      for (int64_t i = 0; i < nq; ++i) seen = std::max(seen, config.len(b, i, nk));
      const auto key = [&](int64_t j, int64_t c) -> double { return keys(b, j, c); };
      const std::vector<double> centre = kernels::row_mean(seen, d, key);
      kernels::centre_rows(seen, d, key, centre, config.scale, k.data() + b * nk * d,
                           key_terms.data() + b * nk);
      kernels::centre_rows(
          nq, d, [&](int64_t i, int64_t c) -> double { return queries(b, i, c); }, centre,
          config.scale, q.data() + b * nq * d, query_terms.data() + b * nq);
    }
  }
  // The key terms as the kernels read a bias: (B, 1, Nq, Nk), one row per b.
  template <class Acc>
  TensorView<Acc> per_key(Tensor<Acc>& t) const {
    return TensorView<Acc>(t.data(), Shape{t.size(0), 1, q.size(1), t.size(1)},
                           Shape{t.size(1), 0, 0, 1});
  }
  kernels::AttentionConfig with_bias(kernels::AttentionConfig config) {
    if constexpr (std::is_same_v<T, float>) {
      config.bias_float = per_key(key_terms);
    } else {
      config.bias_double = per_key(key_terms);
    }
    return config;
  }
};

template <class T>
AttentionResult<T> distance_forward(Version version, ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                    const ValidLens& valid_lens, const AttentionOptions& options,
                                    const AttentionOutputs<T>* given = nullptr) {
  const Dims dims = check_inputs(kDistance, q, k, v, false, valid_lens);
  const kernels::AttentionConfig config =
      lens_only_config(kDistance, "distance", dims, valid_lens, options);
  AttentionResult<T> result;
  kernels::ForwardViews<T> out = destinations(kDistance, version, dims, options, given, result);
  if (version == Version::kRef) {
    kernels::ref::distance(q, k, v, config, out);
    return result;
  }
  CentredOperands<T> centred(q, k, config);
  const kernels::ForwardViews<T> lse_out = out;
  out.output = kernels::as_heads(out.output);
  const KernelOperand<T> vk(v);
  fast_sdpa(kernels::as_heads(ConstView<T>(centred.q.view())),
            kernels::as_heads(ConstView<T>(centred.k.view())), vk.view(), centred.with_bias(config),
            out);
  // The kernel's lse leaves out each query's own term.
  if (lse_out.lse.data() != nullptr) {
    for (int64_t b = 0; b < dims.batch; ++b) {
      for (int64_t i = 0; i < dims.nq; ++i) {
        const double term = centred.query_terms[static_cast<size_t>(b * dims.nq + i)];
        lse_out.lse(b, i) = static_cast<T>(static_cast<double>(lse_out.lse(b, i)) + term);
      }
    }
  }
  return result;
}

template <class T>
DotProductGrads<T> distance_backward(Version version, ConstView<T> q, ConstView<T> k,
                                     ConstView<T> v, const ValidLens& valid_lens,
                                     const AttentionOptions& options, const SavedForward<T>& saved,
                                     ConstView<T> d_output) {
  const Dims dims = check_inputs(kDistanceBackward, q, k, v, false, valid_lens);
  const kernels::AttentionConfig config =
      lens_only_config(kDistanceBackward, "distance", dims, valid_lens, options);
  check_saved(kDistanceBackward, dims, saved, d_output);
  DotProductGrads<T> grads{Tensor<T>(q.shape()), Tensor<T>(k.shape()), Tensor<T>(v.shape()), {}};
  if (version == Version::kRef) {
    kernels::ref::distance_backward(
        q, k, v, config, {saved.output, saved.lse}, d_output,
        {grads.d_queries.view(), grads.d_keys.view(), grads.d_values.view()});
    return grads;
  }
  CentredOperands<T> centred(q, k, config);
  // The lse the dot-product kernel saw: the saved one less each query's term.
  Tensor<T> lse(Shape{dims.batch, dims.nq});
  for (int64_t b = 0; b < dims.batch; ++b) {
    for (int64_t i = 0; i < dims.nq; ++i) {
      const double term = centred.query_terms[static_cast<size_t>(b * dims.nq + i)];
      lse(b, i) = static_cast<T>(static_cast<double>(saved.lse(b, i)) - term);
    }
  }
  // The bias's gradient: sum_i dS[b, i, j] for each key.
  Tensor<T> d_key_terms(Shape{dims.batch, dims.nk});
  const kernels::SdpaGradViews<T> out{
      kernels::as_heads(grads.d_queries.view()), kernels::as_heads(grads.d_keys.view()),
      kernels::as_heads(grads.d_values.view()), centred.per_key(d_key_terms)};
  const KernelOperand<T> vk(v), ok(saved.output), gk(d_output);
  fast_sdpa_backward(kernels::as_heads(ConstView<T>(centred.q.view())),
                     kernels::as_heads(ConstView<T>(centred.k.view())), vk.view(),
                     centred.with_bias(config), {ok.view(), ConstView<T>(lse.view())}, gk.view(),
                     out);
  // The bias -scale/2 |k'|^2 adds -scale k' d_bias to dK (the query terms
  // add nothing: each row of dS sums to 0).
  const int64_t d = dims.dq;
  kernels::parallel_for(dims.batch, [&](int64_t b) {
    for (int64_t j = 0; j < dims.nk; ++j) {
      const double g = -config.scale * static_cast<double>(d_key_terms(b, j));
      T* dk = grads.d_keys.data() + (b * dims.nk + j) * d;
      const T* kc = centred.k.data() + (b * dims.nk + j) * d;
      for (int64_t c = 0; c < d; ++c) {
        dk[c] = static_cast<T>(static_cast<double>(dk[c]) + g * static_cast<double>(kc[c]));
      }
    }
  });
  return grads;
}

}  // namespace

// ---- the public overloads: each picks a version and an element type ----------

AttentionResult<float> scaled_dot_product_attention(ConstView<float> q, ConstView<float> k,
                                                    ConstView<float> v, const ValidLens& lens,
                                                    const AttentionOptions& options) {
  return sdpa_forward(Version::kFast, q, k, v, lens, options);
}
AttentionResult<double> scaled_dot_product_attention(ConstView<double> q, ConstView<double> k,
                                                     ConstView<double> v, const ValidLens& lens,
                                                     const AttentionOptions& options) {
  return sdpa_forward(Version::kFast, q, k, v, lens, options);
}
AttentionResult<float> scaled_dot_product_attention(ConstView<bfloat16> q, ConstView<bfloat16> k,
                                                    ConstView<bfloat16> v, const ValidLens& lens,
                                                    const AttentionOptions& options) {
  return sdpa_forward_bf16(q, k, v, lens, options);
}
void scaled_dot_product_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                                  const ValidLens& lens, const AttentionOptions& options,
                                  const AttentionOutputs<float>& outputs) {
  sdpa_forward(Version::kFast, q, k, v, lens, options, &outputs);
}
void scaled_dot_product_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                                  const ValidLens& lens, const AttentionOptions& options,
                                  const AttentionOutputs<double>& outputs) {
  sdpa_forward(Version::kFast, q, k, v, lens, options, &outputs);
}

DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output,
    ConstView<float> d_lse) {
  return sdpa_backward(Version::kFast, q, k, v, lens, options, saved, d_output, d_lse);
}
DotProductGrads<double> scaled_dot_product_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output,
    ConstView<double> d_lse) {
  return sdpa_backward(Version::kFast, q, k, v, lens, options, saved, d_output, d_lse);
}
DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<bfloat16> q, ConstView<bfloat16> k, ConstView<bfloat16> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output) {
  return sdpa_backward_bf16(q, k, v, lens, options, saved, d_output);
}

AttentionResult<float> additive_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const AdditiveWeights<float>& w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kFast, q, k, v, w, lens, options);
}
AttentionResult<double> additive_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const AdditiveWeights<double>& w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kFast, q, k, v, w, lens, options);
}
void additive_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                        const AdditiveWeights<float>& w, const ValidLens& lens,
                        const AttentionOptions& options, const AttentionOutputs<float>& outputs) {
  additive_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}
void additive_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                        const AdditiveWeights<double>& w, const ValidLens& lens,
                        const AttentionOptions& options, const AttentionOutputs<double>& outputs) {
  additive_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}

AdditiveGrads<float> additive_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const AdditiveWeights<float>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output) {
  return additive_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}
AdditiveGrads<double> additive_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const AdditiveWeights<double>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output) {
  return additive_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}

AttentionResult<float> bilinear_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, ConstView<float> w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kFast, q, k, v, w, lens, options);
}
AttentionResult<double> bilinear_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, ConstView<double> w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kFast, q, k, v, w, lens, options);
}
void bilinear_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                        ConstView<float> w, const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<float>& outputs) {
  bilinear_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}
void bilinear_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                        ConstView<double> w, const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<double>& outputs) {
  bilinear_forward(Version::kFast, q, k, v, w, lens, options, &outputs);
}
BilinearGrads<float> bilinear_attention_backward(ConstView<float> q, ConstView<float> k,
                                                 ConstView<float> v, ConstView<float> w,
                                                 const ValidLens& lens,
                                                 const AttentionOptions& options,
                                                 const SavedForward<float>& saved,
                                                 ConstView<float> d_output) {
  return bilinear_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}
BilinearGrads<double> bilinear_attention_backward(ConstView<double> q, ConstView<double> k,
                                                  ConstView<double> v, ConstView<double> w,
                                                  const ValidLens& lens,
                                                  const AttentionOptions& options,
                                                  const SavedForward<double>& saved,
                                                  ConstView<double> d_output) {
  return bilinear_backward(Version::kFast, q, k, v, w, lens, options, saved, d_output);
}
AttentionResult<float> distance_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const ValidLens& lens,
                                          const AttentionOptions& options) {
  return distance_forward(Version::kFast, q, k, v, lens, options);
}
AttentionResult<double> distance_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const ValidLens& lens,
                                           const AttentionOptions& options) {
  return distance_forward(Version::kFast, q, k, v, lens, options);
}
void distance_attention(ConstView<float> q, ConstView<float> k, ConstView<float> v,
                        const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<float>& outputs) {
  distance_forward(Version::kFast, q, k, v, lens, options, &outputs);
}
void distance_attention(ConstView<double> q, ConstView<double> k, ConstView<double> v,
                        const ValidLens& lens, const AttentionOptions& options,
                        const AttentionOutputs<double>& outputs) {
  distance_forward(Version::kFast, q, k, v, lens, options, &outputs);
}
DotProductGrads<float> distance_attention_backward(ConstView<float> q, ConstView<float> k,
                                                   ConstView<float> v, const ValidLens& lens,
                                                   const AttentionOptions& options,
                                                   const SavedForward<float>& saved,
                                                   ConstView<float> d_output) {
  return distance_backward(Version::kFast, q, k, v, lens, options, saved, d_output);
}
DotProductGrads<double> distance_attention_backward(ConstView<double> q, ConstView<double> k,
                                                    ConstView<double> v, const ValidLens& lens,
                                                    const AttentionOptions& options,
                                                    const SavedForward<double>& saved,
                                                    ConstView<double> d_output) {
  return distance_backward(Version::kFast, q, k, v, lens, options, saved, d_output);
}

namespace ref {

AttentionResult<float> scaled_dot_product_attention(ConstView<float> q, ConstView<float> k,
                                                    ConstView<float> v, const ValidLens& lens,
                                                    const AttentionOptions& options) {
  return sdpa_forward(Version::kRef, q, k, v, lens, options);
}
AttentionResult<double> scaled_dot_product_attention(ConstView<double> q, ConstView<double> k,
                                                     ConstView<double> v, const ValidLens& lens,
                                                     const AttentionOptions& options) {
  return sdpa_forward(Version::kRef, q, k, v, lens, options);
}
DotProductGrads<float> scaled_dot_product_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<float>& saved, ConstView<float> d_output,
    ConstView<float> d_lse) {
  return sdpa_backward(Version::kRef, q, k, v, lens, options, saved, d_output, d_lse);
}
DotProductGrads<double> scaled_dot_product_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const ValidLens& lens,
    const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output,
    ConstView<double> d_lse) {
  return sdpa_backward(Version::kRef, q, k, v, lens, options, saved, d_output, d_lse);
}
AttentionResult<float> additive_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const AdditiveWeights<float>& w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kRef, q, k, v, w, lens, options);
}
AttentionResult<double> additive_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const AdditiveWeights<double>& w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return additive_forward(Version::kRef, q, k, v, w, lens, options);
}
AdditiveGrads<float> additive_attention_backward(
    ConstView<float> q, ConstView<float> k, ConstView<float> v, const AdditiveWeights<float>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<float>& saved,
    ConstView<float> d_output) {
  return additive_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}
AdditiveGrads<double> additive_attention_backward(
    ConstView<double> q, ConstView<double> k, ConstView<double> v, const AdditiveWeights<double>& w,
    const ValidLens& lens, const AttentionOptions& options, const SavedForward<double>& saved,
    ConstView<double> d_output) {
  return additive_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}

AttentionResult<float> bilinear_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, ConstView<float> w,
                                          const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kRef, q, k, v, w, lens, options);
}
AttentionResult<double> bilinear_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, ConstView<double> w,
                                           const ValidLens& lens, const AttentionOptions& options) {
  return bilinear_forward(Version::kRef, q, k, v, w, lens, options);
}
BilinearGrads<float> bilinear_attention_backward(ConstView<float> q, ConstView<float> k,
                                                 ConstView<float> v, ConstView<float> w,
                                                 const ValidLens& lens,
                                                 const AttentionOptions& options,
                                                 const SavedForward<float>& saved,
                                                 ConstView<float> d_output) {
  return bilinear_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}
BilinearGrads<double> bilinear_attention_backward(ConstView<double> q, ConstView<double> k,
                                                  ConstView<double> v, ConstView<double> w,
                                                  const ValidLens& lens,
                                                  const AttentionOptions& options,
                                                  const SavedForward<double>& saved,
                                                  ConstView<double> d_output) {
  return bilinear_backward(Version::kRef, q, k, v, w, lens, options, saved, d_output);
}
AttentionResult<float> distance_attention(ConstView<float> q, ConstView<float> k,
                                          ConstView<float> v, const ValidLens& lens,
                                          const AttentionOptions& options) {
  return distance_forward(Version::kRef, q, k, v, lens, options);
}
AttentionResult<double> distance_attention(ConstView<double> q, ConstView<double> k,
                                           ConstView<double> v, const ValidLens& lens,
                                           const AttentionOptions& options) {
  return distance_forward(Version::kRef, q, k, v, lens, options);
}
DotProductGrads<float> distance_attention_backward(ConstView<float> q, ConstView<float> k,
                                                   ConstView<float> v, const ValidLens& lens,
                                                   const AttentionOptions& options,
                                                   const SavedForward<float>& saved,
                                                   ConstView<float> d_output) {
  return distance_backward(Version::kRef, q, k, v, lens, options, saved, d_output);
}
DotProductGrads<double> distance_attention_backward(ConstView<double> q, ConstView<double> k,
                                                    ConstView<double> v, const ValidLens& lens,
                                                    const AttentionOptions& options,
                                                    const SavedForward<double>& saved,
                                                    ConstView<double> d_output) {
  return distance_backward(Version::kRef, q, k, v, lens, options, saved, d_output);
}

}  // namespace ref
}  // namespace qkv
