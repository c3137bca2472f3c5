// Masked softmax front ends: validate, then run the fast or reference kernel.
#include "qkv/masked_softmax.h"

#include <vector>

#include "core/check.h"
#include "core/contiguous.h"
#include "kernels/kernels.h"
#include "qkv/threads.h"

namespace qkv {
namespace {

constexpr const char* kAxes = "(B, Nq, Nk)";

template <class T>
void check_scores(std::string_view function, const char* name, ConstView<T> scores,
                  const ValidLens& valid_lens) {
  detail::check_rank(function, name, scores, 3, kAxes);
  valid_lens.check(function, name, scores.shape(), scores.size(0), scores.size(1), scores.size(2));
}

// Runs kernel(out) into `out` when its rows have unit stride, else into a
// dense buffer copied over afterwards (the kernels walk rows with unit stride).
template <class T, class Kernel>
void into_rows(TensorView<T> out, Kernel&& kernel) {
  if (out.stride(2) == 1) {
    kernel(out);
    return;
  }
  Tensor<T> dense(out.shape());
  kernel(dense.view());
  for (int64_t b = 0; b < out.size(0); ++b) {
    for (int64_t i = 0; i < out.size(1); ++i) {
      for (int64_t j = 0; j < out.size(2); ++j) out(b, i, j) = dense(b, i, j);
    }
  }
}

template <class T>
void forward_into(ConstView<T> scores, const ValidLens& valid_lens, TensorView<T> weights) {
  constexpr std::string_view kFn = "masked_softmax";
  check_scores(kFn, "scores", scores, valid_lens);
  detail::check_shape(kFn, "weights", weights, scores.shape());
  if (scores.numel() == 0) return;
  // The kernel walks rows with unit stride; other layouts go through copies.
  Tensor<T> packed;
  ConstView<T> rows = scores;
  if (scores.stride(2) != 1) {
    packed = Tensor<T>::copy_of(scores);
    rows = packed.view();
  }
  // The kernel's scratch, allocated once per call (64-byte slices cut inside).
  const int threads = num_threads();
  std::vector<double> workspace(
      kernels::fast::masked_softmax_workspace_size<T>(scores.size(2), threads));
  into_rows(weights, [&](TensorView<T> out) {
    kernels::fast::masked_softmax(rows, valid_lens, out,
                                  {.data = workspace.data(), .num_threads = threads});
  });
}

template <class T>
Tensor<T> forward(ConstView<T> scores, const ValidLens& valid_lens) {
  Tensor<T> weights(scores.shape());
  forward_into(scores, valid_lens, weights.view());
  return weights;
}

template <class T>
void check_backward(std::string_view function, ConstView<T> weights, ConstView<T> d_weights,
                    const ValidLens& valid_lens) {
  check_scores(function, "weights", weights, valid_lens);
  detail::check_shape(function, "d_weights", d_weights, weights.shape());
}

template <class T>
void backward_into(ConstView<T> weights, ConstView<T> d_weights, const ValidLens& valid_lens,
                   TensorView<T> d_scores) {
  constexpr std::string_view kFn = "masked_softmax_backward";
  check_backward(kFn, weights, d_weights, valid_lens);
  detail::check_shape(kFn, "d_scores", d_scores, weights.shape());
  if (weights.numel() == 0) return;
  const detail::Contiguous<T> w(weights), g(d_weights);
  into_rows(d_scores, [&](TensorView<T> out) {
    kernels::fast::masked_softmax_backward(w.view(), g.view(), valid_lens, out);
  });
}

template <class T>
Tensor<T> backward(ConstView<T> weights, ConstView<T> d_weights, const ValidLens& valid_lens) {
  Tensor<T> d_scores(weights.shape());
  backward_into(weights, d_weights, valid_lens, d_scores.view());
  return d_scores;
}

template <class T>
Tensor<T> ref_forward(ConstView<T> scores, const ValidLens& valid_lens) {
  check_scores("masked_softmax", "scores", scores, valid_lens);
  Tensor<T> weights(scores.shape());
  kernels::ref::masked_softmax(scores, valid_lens, weights.view());
  return weights;
}

template <class T>
Tensor<T> ref_backward(ConstView<T> weights, ConstView<T> d_weights, const ValidLens& valid_lens) {
  check_backward("masked_softmax_backward", weights, d_weights, valid_lens);
  Tensor<T> d_scores(weights.shape());
  kernels::ref::masked_softmax_backward(weights, d_weights, valid_lens, d_scores.view());
  return d_scores;
}

}  // namespace

Tensor<float> masked_softmax(ConstView<float> scores, const ValidLens& valid_lens) {
  return forward(scores, valid_lens);
}
Tensor<double> masked_softmax(ConstView<double> scores, const ValidLens& valid_lens) {
  return forward(scores, valid_lens);
}
void masked_softmax(ConstView<float> scores, const ValidLens& valid_lens,
                    TensorView<float> weights) {
  forward_into(scores, valid_lens, weights);
}
void masked_softmax(ConstView<double> scores, const ValidLens& valid_lens,
                    TensorView<double> weights) {
  forward_into(scores, valid_lens, weights);
}
Tensor<float> masked_softmax_backward(ConstView<float> weights, ConstView<float> d_weights,
                                      const ValidLens& valid_lens) {
  return backward(weights, d_weights, valid_lens);
}
Tensor<double> masked_softmax_backward(ConstView<double> weights, ConstView<double> d_weights,
                                       const ValidLens& valid_lens) {
  return backward(weights, d_weights, valid_lens);
}
void masked_softmax_backward(ConstView<float> weights, ConstView<float> d_weights,
                             const ValidLens& valid_lens, TensorView<float> d_scores) {
  backward_into(weights, d_weights, valid_lens, d_scores);
}
void masked_softmax_backward(ConstView<double> weights, ConstView<double> d_weights,
                             const ValidLens& valid_lens, TensorView<double> d_scores) {
  backward_into(weights, d_weights, valid_lens, d_scores);
}

namespace ref {
Tensor<float> masked_softmax(ConstView<float> scores, const ValidLens& valid_lens) {
  return ref_forward(scores, valid_lens);
}
Tensor<double> masked_softmax(ConstView<double> scores, const ValidLens& valid_lens) {
  return ref_forward(scores, valid_lens);
}
Tensor<float> masked_softmax_backward(ConstView<float> weights, ConstView<float> d_weights,
                                      const ValidLens& valid_lens) {
  return ref_backward(weights, d_weights, valid_lens);
}
Tensor<double> masked_softmax_backward(ConstView<double> weights, ConstView<double> d_weights,
                                       const ValidLens& valid_lens) {
  return ref_backward(weights, d_weights, valid_lens);
}
}  // namespace ref

}  // namespace qkv
