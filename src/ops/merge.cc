// merge_attention: partial attention results over disjoint key sets merged
// by their log-sum-exps. One version, plain loops in double: the merge reads
// S (Nq, Dv) outputs once and does S·Dv multiply-adds per row, a pass over
// memory that needs no blocking (no kernel pair, like attention_pooling).
#include "qkv/merge.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/contiguous.h"
#include "kernels/runtime/parallel.h"

namespace qkv {
namespace {

constexpr std::string_view kFn = "merge_attention";

// Rows per task: 1024 rows of Dv = 64 floats is 256 KiB per part read, enough
// work to pay for a task and enough tasks to share at (B·H·Nq) >= 2048 rows.
constexpr int64_t kRowsPerTask = 1024;

std::string part_name(std::string_view what, size_t s) {
  return std::string(what) + "[" + std::to_string(s) + "]";
}

// The outputs' common shape, after checking every part against part 0.
template <class T>
Shape check_parts(const std::vector<ConstView<T>>& outputs, const std::vector<ConstView<T>>& lses) {
  if (outputs.empty()) fail(kFn, "outputs is empty; expected at least one part");
  if (lses.size() != outputs.size()) {
    fail(kFn, "outputs has " + std::to_string(outputs.size()) + " parts but lses has " +
                  std::to_string(lses.size()) + "; expected one lse per output");
  }
  const Shape shape = outputs[0].shape();
  if (shape.rank() < 2) {
    fail(kFn, "outputs[0] has shape " + shape.str() + "; expected rank >= 2 (..., Nq, Dv)");
  }
  Shape lse_shape;
  for (int a = 0; a + 1 < shape.rank(); ++a) lse_shape.push_back(shape[a]);
  for (size_t s = 0; s < outputs.size(); ++s) {
    if (!(outputs[s].shape() == shape)) {
      fail(kFn, part_name("outputs", s) + " has shape " + outputs[s].shape().str() +
                    " but outputs[0] has shape " + shape.str() + "; every part has one shape");
    }
    if (!(lses[s].shape() == lse_shape)) {
      fail(kFn, part_name("lses", s) + " has shape " + lses[s].shape().str() + "; expected " +
                    lse_shape.str() + " (the outputs' shape " + shape.str() + " without Dv)");
    }
  }
  return shape;
}

// out (rows, dv) and lse (rows) from the parts' contiguous rows. Each row's
// inputs are read before its results are written, so out and lse may be one
// part's own memory.
template <class T>
void merge_rows(const std::vector<const T*>& outputs, const std::vector<const T*>& lses,
                int64_t rows, int64_t dv, T* out, T* lse) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto parts = static_cast<int64_t>(outputs.size());
  kernels::parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    std::vector<double> acc(static_cast<size_t>(dv)), weight(static_cast<size_t>(parts));
    const int64_t r1 = std::min(rows, (task + 1) * kRowsPerTask);
    for (int64_t r = task * kRowsPerTask; r < r1; ++r) {
      double max = -kInf;
      bool nan = false;
      for (int64_t s = 0; s < parts; ++s) {
        const double x = lses[s][r];
        if (std::isnan(x) || x == kInf) nan = true;
        max = std::max(max, x);
      }
      T* out_row = out + r * dv;
      if (nan || max == -kInf) {
        const T fill = nan ? std::numeric_limits<T>::quiet_NaN() : T(0);
        std::fill(out_row, out_row + dv, fill);
        lse[r] = nan ? fill : -std::numeric_limits<T>::infinity();
        continue;
      }
      double sum = 0;
      for (int64_t s = 0; s < parts; ++s) sum += weight[s] = std::exp(lses[s][r] - max);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t s = 0; s < parts; ++s) {
        if (weight[s] == 0) continue;  // lse_s = -inf (or far below): never read
        const double c = weight[s] / sum;
        const T* part_row = outputs[s] + r * dv;
        for (int64_t d = 0; d < dv; ++d) acc[d] += c * static_cast<double>(part_row[d]);
      }
      for (int64_t d = 0; d < dv; ++d) out_row[d] = static_cast<T>(acc[d]);
      lse[r] = static_cast<T>(max + std::log(sum));
    }
  });
}

template <class T>
void merge_into(const std::vector<ConstView<T>>& outputs, const std::vector<ConstView<T>>& lses,
                TensorView<T> output, TensorView<T> lse) {
  const Shape shape = check_parts(outputs, lses);
  detail::check_destination(kFn, "output", output, shape);
  detail::check_destination(kFn, "lse", lse, lses[0].shape());
  const int64_t dv = shape[shape.rank() - 1];
  const int64_t rows = lse.numel();
  // Unit-stride parts; a strided part is copied first, so only a contiguous
  // part can share memory with the destinations.
  std::vector<std::unique_ptr<detail::Contiguous<T>>> copies;
  std::vector<const T*> out_rows, lse_rows;
  for (size_t s = 0; s < outputs.size(); ++s) {
    copies.push_back(std::make_unique<detail::Contiguous<T>>(outputs[s]));
    out_rows.push_back(copies.back()->data());
    copies.push_back(std::make_unique<detail::Contiguous<T>>(lses[s]));
    lse_rows.push_back(copies.back()->data());
  }
  merge_rows(out_rows, lse_rows, rows, dv, output.data(), lse.data());
}

template <class T>
MergedAttention<T> merge(const std::vector<ConstView<T>>& outputs,
                         const std::vector<ConstView<T>>& lses) {
  const Shape shape = check_parts(outputs, lses);
  MergedAttention<T> merged{Tensor<T>(shape), Tensor<T>(lses[0].shape())};
  merge_into(outputs, lses, merged.output.view(), merged.lse.view());
  return merged;
}

}  // namespace

MergedAttention<float> merge_attention(const std::vector<ConstView<float>>& outputs,
                                       const std::vector<ConstView<float>>& lses) {
  return merge(outputs, lses);
}
MergedAttention<double> merge_attention(const std::vector<ConstView<double>>& outputs,
                                        const std::vector<ConstView<double>>& lses) {
  return merge(outputs, lses);
}
void merge_attention(const std::vector<ConstView<float>>& outputs,
                     const std::vector<ConstView<float>>& lses, TensorView<float> output,
                     TensorView<float> lse) {
  merge_into(outputs, lses, output, lse);
}
void merge_attention(const std::vector<ConstView<double>>& outputs,
                     const std::vector<ConstView<double>>& lses, TensorView<double> output,
                     TensorView<double> lse) {
  merge_into(outputs, lses, output, lse);
}

}  // namespace qkv
