// linear (qkv/linear.h): checks, then the BLAS on row blocks (kernels/runtime/blas.h).
#include "qkv/linear.h"

#include <algorithm>
#include <string>
#include <string_view>

#include "core/contiguous.h"
#include "kernels/runtime/blas.h"
#include "kernels/runtime/parallel.h"
#include "qkv/error.h"

namespace qkv {
namespace {

constexpr std::string_view kLinear = "linear";

template <class T>
Shape output_shape(ConstView<T> x, ConstView<T> weight, ConstView<T> bias) {
  if (x.rank() < 1) fail(kLinear, "x has shape " + x.shape().str() + "; expected (..., in)");
  const int64_t in = x.size(x.rank() - 1);
  if (weight.rank() != 2 || weight.size(1) != in) {
    fail(kLinear, "weight has shape " + weight.shape().str() + "; expected (out, in) with in = " +
                      std::to_string(in) + ", x's last size (x has shape " + x.shape().str() + ")");
  }
  if (bias.rank() != 0 && (bias.rank() != 1 || bias.size(0) != weight.size(0))) {
    fail(kLinear, "bias has shape " + bias.shape().str() + "; expected (" +
                      std::to_string(weight.size(0)) + "), weight's out, or none");
  }
  Shape shape = x.shape();
  shape[shape.rank() - 1] = weight.size(0);
  return shape;
}

template <class T>
void linear_into(ConstView<T> x, ConstView<T> weight, ConstView<T> bias, TensorView<T> out) {
  const Shape shape = output_shape(x, weight, bias);
  if (!(out.shape() == shape) || !out.is_contiguous()) {
    fail(kLinear, "out has shape " + out.shape().str() + (out.is_contiguous() ? "" : " (strided)") +
                      "; expected " + shape.str() + ", contiguous");
  }
  const detail::Contiguous<T> xc(x), wc(weight);
  const int64_t in = weight.size(1), features = weight.size(0);
  int64_t rows = 1;
  for (int a = 0; a + 1 < x.rank(); ++a) rows *= x.size(a);
  kernels::parallel_gemm<T>(false, true, rows, features, in, T(1), xc.data(), in, wc.data(), in,
                            T(0), out.data(), features);
  if (bias.rank() == 0) return;
  const detail::Contiguous<T> bc(bias);
  const T* b = bc.data();
  T* y = out.data();
  kernels::parallel_for((rows + kernels::kGemmRowBlock - 1) / kernels::kGemmRowBlock,
                        [&](int64_t block) {
                          const int64_t end = std::min(rows, (block + 1) * kernels::kGemmRowBlock);
                          for (int64_t r = block * kernels::kGemmRowBlock; r < end; ++r) {
                            for (int64_t c = 0; c < features; ++c) y[r * features + c] += b[c];
                          }
                        });
}

template <class T>
Tensor<T> linear_new(ConstView<T> x, ConstView<T> weight, ConstView<T> bias) {
  Tensor<T> out(output_shape(x, weight, bias));
  linear_into(x, weight, bias, out.view());
  return out;
}

}  // namespace

Tensor<float> linear(ConstView<float> x, ConstView<float> weight, ConstView<float> bias) {
  return linear_new(x, weight, bias);
}
Tensor<double> linear(ConstView<double> x, ConstView<double> weight, ConstView<double> bias) {
  return linear_new(x, weight, bias);
}
void linear(ConstView<float> x, ConstView<float> weight, ConstView<float> bias,
            TensorView<float> out) {
  linear_into(x, weight, bias, out);
}
void linear(ConstView<double> x, ConstView<double> weight, ConstView<double> bias,
            TensorView<double> out) {
  linear_into(x, weight, bias, out);
}

}  // namespace qkv
