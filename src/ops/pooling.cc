// Attention pooling with given weights and its named special cases.
#include "qkv/pooling.h"

#include <string>

#include "core/check.h"
#include "core/contiguous.h"
#include "kernels/runtime/blas.h"

namespace qkv {
namespace {

// weights: (B, Nq, Nk)   values: (B, Nk, Dv)   ->   (B, Nq, Dv)
template <class T>
Tensor<T> pool(ConstView<T> weights, ConstView<T> values) {
  constexpr std::string_view kFn = "attention_pooling";
  detail::check_rank(kFn, "weights", weights, 3, "(B, Nq, Nk)");
  detail::check_rank(kFn, "values", values, 3, "(B, Nk, Dv)");
  if (values.size(0) != weights.size(0) || values.size(1) != weights.size(2)) {
    fail(kFn, "values has shape " + values.shape().str() + " but weights has shape " +
                  weights.shape().str() + "; expected [" + std::to_string(weights.size(0)) + ", " +
                  std::to_string(weights.size(2)) + ", value_dim]");
  }
  const int64_t batch = weights.size(0), nq = weights.size(1), nk = weights.size(2);
  const int64_t dv = values.size(2);
  const detail::Contiguous<T> w(weights), v(values);
  Tensor<T> out(Shape{batch, nq, dv});
  kernels::parallel_for(batch, [&](int64_t b) {
    kernels::gemm(false, false, nq, dv, nk, T(1), w.data() + b * nq * nk, nk,
                  v.data() + b * nk * dv, dv, T(0), out.data() + b * nq * dv, dv);
  });
  return out;
}

template <class T>
Tensor<T> uniform(std::string_view fn, int64_t batch, int64_t nq, int64_t nk,
                  const ValidLens& valid_lens) {
  if (batch < 0 || nq < 0 || nk < 0) {
    fail(fn, "sizes must be >= 0; got batch " + std::to_string(batch) + ", num_queries " +
                 std::to_string(nq) + ", num_keys " + std::to_string(nk));
  }
  valid_lens.check(fn, "weights", Shape{batch, nq, nk}, batch, nq, nk);
  Tensor<T> w(Shape{batch, nq, nk});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = valid_lens(b, i, nk);
      for (int64_t j = 0; j < len; ++j) w(b, i, j) = T(1) / static_cast<T>(len);
    }
  }
  return w;
}

template <class T>
Tensor<T> average(ConstView<T> values, int64_t nq, const ValidLens& valid_lens) {
  constexpr std::string_view kFn = "average_pooling";
  detail::check_rank(kFn, "values", values, 3, "(B, Nk, Dv)");
  const int64_t batch = values.size(0), nk = values.size(1), dv = values.size(2);
  if (nq < 0) fail(kFn, "num_queries = " + std::to_string(nq) + " must be >= 0");
  valid_lens.check(kFn, "weights", Shape{batch, nq, nk}, batch, nq, nk);
  Tensor<T> out(Shape{batch, nq, dv});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = valid_lens(b, i, nk);
      for (int64_t c = 0; c < dv; ++c) {
        double sum = 0.0;
        for (int64_t j = 0; j < len; ++j) sum += static_cast<double>(values(b, j, c));
        out(b, i, c) = len ? static_cast<T>(sum / static_cast<double>(len)) : T(0);
      }
    }
  }
  return out;
}

void check_index(std::string_view fn, ConstView<int64_t> index, int64_t nk) {
  detail::check_rank(fn, "index", index, 2, "(B, Nq)");
  for (int64_t b = 0; b < index.size(0); ++b) {
    for (int64_t i = 0; i < index.size(1); ++i) {
      if (index(b, i) < 0 || index(b, i) >= nk) {
        fail(fn, "index[" + std::to_string(b) + ", " + std::to_string(i) + "] = " +
                     std::to_string(index(b, i)) + " is outside [0, " + std::to_string(nk) + ")");
      }
    }
  }
}

template <class T>
Tensor<T> lookup(ConstView<int64_t> index, ConstView<T> values) {
  constexpr std::string_view kFn = "one_hot_lookup";
  detail::check_rank(kFn, "values", values, 3, "(B, Nk, Dv)");
  check_index(kFn, index, values.size(1));
  if (index.size(0) != values.size(0)) {
    fail(kFn, "index has shape " + index.shape().str() + " but values has shape " +
                  values.shape().str() + "; batch sizes differ");
  }
  const int64_t batch = index.size(0), nq = index.size(1), dv = values.size(2);
  Tensor<T> out(Shape{batch, nq, dv});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t c = 0; c < dv; ++c) out(b, i, c) = values(b, index(b, i), c);
    }
  }
  return out;
}

}  // namespace

Tensor<float> attention_pooling(ConstView<float> weights, ConstView<float> values) {
  return pool(weights, values);
}
Tensor<double> attention_pooling(ConstView<double> weights, ConstView<double> values) {
  return pool(weights, values);
}
Tensor<float> uniform_weights(int64_t batch, int64_t num_queries, int64_t num_keys,
                              const ValidLens& valid_lens) {
  return uniform<float>("uniform_weights", batch, num_queries, num_keys, valid_lens);
}
Tensor<float> average_pooling(ConstView<float> values, int64_t num_queries,
                              const ValidLens& valid_lens) {
  return average(values, num_queries, valid_lens);
}
Tensor<double> average_pooling(ConstView<double> values, int64_t num_queries,
                               const ValidLens& valid_lens) {
  return average(values, num_queries, valid_lens);
}
Tensor<float> one_hot_weights(ConstView<int64_t> index, int64_t num_keys) {
  constexpr std::string_view kFn = "one_hot_weights";
  if (num_keys < 0) fail(kFn, "num_keys = " + std::to_string(num_keys) + " must be >= 0");
  check_index(kFn, index, num_keys);
  Tensor<float> w(Shape{index.size(0), index.size(1), num_keys});
  for (int64_t b = 0; b < index.size(0); ++b) {
    for (int64_t i = 0; i < index.size(1); ++i) w(b, i, index(b, i)) = 1.0f;
  }
  return w;
}
Tensor<float> one_hot_lookup(ConstView<int64_t> index, ConstView<float> values) {
  return lookup(index, values);
}
Tensor<double> one_hot_lookup(ConstView<int64_t> index, ConstView<double> values) {
  return lookup(index, values);
}

}  // namespace qkv
