// ValidLens: shape checks and the owning copy.
#include "qkv/valid_lens.h"

#include <string>

#include "qkv/error.h"

namespace qkv {

Shape ValidLens::shape() const {
  if (const auto* v32 = std::get_if<ConstView<int32_t>>(&lens_)) return v32->shape();
  if (const auto* v64 = std::get_if<ConstView<int64_t>>(&lens_)) return v64->shape();
  return Shape{};
}

void ValidLens::check(std::string_view function, std::string_view scores_name,
                      const Shape& scores_shape, int64_t batch, int64_t num_queries,
                      int64_t num_keys) const {
  if (!has_lengths()) return;
  const Shape lens_shape = shape();
  const bool per_batch = lens_shape == Shape{batch};
  const bool per_query = lens_shape == Shape{batch, num_queries};
  if (!per_batch && !per_query) {
    fail(function, "valid_lens has shape " + lens_shape.str() + " but " + std::string(scores_name) +
                       " has shape " + scores_shape.str() + "; expected " + Shape{batch}.str() +
                       " or " + Shape{batch, num_queries}.str());
  }
  const int64_t rows = per_batch ? 1 : num_queries;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t len = given(b, i, num_keys);
      if (len < 0 || len > num_keys) {
        const std::string where = per_batch
                                      ? "[" + std::to_string(b) + "]"
                                      : "[" + std::to_string(b) + ", " + std::to_string(i) + "]";
        fail(function, "valid_lens" + where + " = " + std::to_string(len) + " is outside [0, " +
                           std::to_string(num_keys) + "] (" + std::string(scores_name) +
                           " has shape " + scores_shape.str() + ")");
      }
    }
  }
}

Tensor<int64_t> ValidLens::to_tensor() const {
  if (!has_lengths()) return {};
  const Shape lens_shape = shape();
  Tensor<int64_t> out(lens_shape);
  const int64_t batch = lens_shape[0];
  const int64_t rows = lens_shape.rank() == 2 ? lens_shape[1] : 1;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) out.data()[b * rows + i] = given(b, i, 0);
  }
  return out;
}

namespace {

template <class I>
ValidLens batch_of_one(ConstView<I> lens, std::string_view function, std::string_view lens_name,
                       std::string_view input_name, const Shape& input_shape) {
  const Shape& shape = lens.shape();
  const int64_t num_queries = input_shape[0];
  // One length: a scalar, or (1) (which is also (Nq) when Nq = 1: the same meaning).
  if (shape.rank() == 0 || shape == Shape{1}) {
    return ConstView<I>(lens.data(), Shape{1}, Shape{0});
  }
  // (1, Nq) is the batched form of one length per query.
  if (shape == Shape{num_queries} || shape == Shape{1, num_queries}) {
    const int64_t stride = lens.stride(lens.rank() - 1);
    return ConstView<I>(lens.data(), Shape{1, num_queries}, Shape{0, stride});
  }
  fail(function, std::string(lens_name) + " has shape " + shape.str() + " but " +
                     std::string(input_name) + " has shape " + input_shape.str() +
                     "; expected [] or [1] (one length), or " + Shape{num_queries}.str() + " or " +
                     Shape{1, num_queries}.str() + " (one per query)");
}

}  // namespace

ValidLens ValidLens::for_batch_of_one(std::string_view function, std::string_view lens_name,
                                      std::string_view input_name,
                                      const Shape& input_shape) const {
  if (const auto* v32 = std::get_if<ConstView<int32_t>>(&lens_)) {
    return batch_of_one(*v32, function, lens_name, input_name, input_shape);
  }
  if (const auto* v64 = std::get_if<ConstView<int64_t>>(&lens_)) {
    return batch_of_one(*v64, function, lens_name, input_name, input_shape);
  }
  return {};
}

}  // namespace qkv
