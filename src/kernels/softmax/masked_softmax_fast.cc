// Masked softmax, fast version, at memory speed: each row is read from memory
// once (the max pass; the exp and normalise passes find it in L1) and each
// weight written once, with non-temporal stores when the output is too big to
// stay in cache. Rows are spread over threads in contiguous runs. Rows holding
// NaN or ±inf take a scalar path that applies DESIGN.md §3's rules exactly.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/kernels.h"
#include "kernels/runtime/parallel.h"
#include "kernels/simd/vecmath.h"
#include "kernels/runtime/workspace.h"

namespace qkv::kernels::fast {
namespace {

// The rows the fast path leaves (NaN or +inf among the scores, or only -inf),
// elementwise (w may alias x).
template <class T>
T softmax_row_nonfinite(const T* x, int64_t len, T* w) {
  constexpr T kInf = std::numeric_limits<T>::infinity();
  T max = -kInf;
  for (int64_t j = 0; j < len; ++j) {
    if (std::isnan(x[j]) || x[j] == kInf) {
      for (int64_t jj = 0; jj < len; ++jj) w[jj] = std::numeric_limits<T>::quiet_NaN();
      return std::numeric_limits<T>::quiet_NaN();
    }
    max = std::max(max, x[j]);
  }
  if (max == -kInf) {
    for (int64_t j = 0; j < len; ++j) w[j] = T(0);
    return -kInf;
  }
  double sum = 0.0;
  for (int64_t j = 0; j < len; ++j) sum += w[j] = std::exp(x[j] - max);
  const T inv = static_cast<T>(1.0 / sum);
  for (int64_t j = 0; j < len; ++j) w[j] *= inv;
  return static_cast<T>(max + std::log(sum));
}

template <class T>
T softmax_row_impl(const T* x, int64_t len, int64_t n, T* w) {
  if (len == 0) {
    for (int64_t j = 0; j < n; ++j) w[j] = T(0);
    return -std::numeric_limits<T>::infinity();
  }
  bool nan_or_plus_inf = false;
  const T max = fast::max_of(x, len, &nan_or_plus_inf);
  T lse;
  // -inf scores among finite ones take the fast path (their weights are
  // exactly 0); a row of only -inf, NaN or +inf takes the exact one.
  if (!nan_or_plus_inf && max != -std::numeric_limits<T>::infinity()) {
    const T sum = fast::exp_shift_sum(x, max, w, len);
    fast::scale(w, T(1) / sum, len);
    lse = max + std::log(sum);
  } else {
    lse = softmax_row_nonfinite(x, len, w);
  }
  for (int64_t j = len; j < n; ++j) w[j] = T(0);
  return lse;
}

// Rows per task: 128 KiB of scores at Nk = 512, a contiguous run that the
// hardware prefetcher follows, and enough tasks for 2 threads to balance.
int64_t rows_per_task(int64_t row_length) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(row_length, 1));
}

// Outputs of at least this many bytes are written with non-temporal stores:
// they would not stay in cache anyway (L2 is 2 MiB per core here), and
// bypassing it saves reading every output line before overwriting it (a third
// of the traffic). Measured at (32, 512, 512) float, 2 threads: see
// bench_ops' BM_MaskedSoftmax next to BM_MaskedSoftmaxStreamCopy.
constexpr int64_t kStreamBytes = int64_t{8} << 20;

// Rows ahead whose valid scores are prefetched when the row is cut short by
// its valid length: the reads then jump from row to row, the hardware
// prefetcher loses the stream, and without this the max pass waited on
// memory at every row start (1-D lens at (32, 512, 512), 2 threads, 8 bytes
// per element: 28 GB/s without, 42-44 GB/s with). Whole rows are left to the
// hardware prefetcher, which follows them (prefetching them too measured
// ~10 % slower). Two rows of 512 floats are about one memory latency of work.
constexpr int64_t kPrefetchRows = 2;

// Asks for the cache lines of x[0, n) to be loaded.
template <class T>
void prefetch(const T* x, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t j = 0; j < n; j += kLine) __builtin_prefetch(x + j, 0, 3);
}

}  // namespace

float softmax_row(const float* x, int64_t len, int64_t n, float* w) {
  return softmax_row_impl(x, len, n, w);
}
double softmax_row(const double* x, int64_t len, int64_t n, double* w) {
  return softmax_row_impl(x, len, n, w);
}

// scores: (B, Nq, Nk) with unit stride on the last axis   weights: contiguous (B, Nq, Nk)
template <class T>
size_t masked_softmax_workspace_size(int64_t nk, int num_threads) {
  return slice_words<T>(nk) * static_cast<size_t>(std::max(num_threads, 1));
}

template <class T>
void masked_softmax(ConstView<T> scores, const ValidLens& valid_lens, TensorView<T> weights,
                    Workspace workspace) {
  const int64_t nq = scores.size(1), nk = scores.size(2);
  const int64_t rows = scores.size(0) * nq;
  const int64_t block = rows_per_task(nk);
  const bool stream = rows * nk * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
  const int slots = std::max(workspace.num_threads, 1);
  parallel_for_slots((rows + block - 1) / block, slots, [&](int64_t task, int slot) {
    // exp(x - max) of one row, in L1; the slot's own (written before read)
    double* cursor = workspace.data + static_cast<size_t>(slot) * slice_words<T>(nk);
    T* const scratch = take_slice<T>(&cursor, nk);
    const int64_t end = std::min(rows, (task + 1) * block);
    for (int64_t r = task * block; r < end; ++r) {
      const int64_t b = r / nq, i = r % nq;
      if (const int64_t ahead = r + kPrefetchRows; ahead < end) {
        const int64_t b_ahead = ahead / nq, i_ahead = ahead % nq;
        const int64_t len_ahead = valid_lens(b_ahead, i_ahead, nk);
        if (len_ahead < nk) prefetch(&scores(b_ahead, i_ahead, 0), len_ahead);
      }
      const int64_t len = valid_lens(b, i, nk);
      const T* x = &scores(b, i, 0);
      T* w = &weights(b, i, 0);
      if (len == 0 || std::isnan(fast::softmax_row_once(x, len, nk, w, scratch, stream))) {
        softmax_row_impl(x, len, nk, w);  // empty, or NaN / ±inf among the valid scores
      }
    }
    if (stream) fast::flush_streams();
  });
}

template <class T>
void masked_softmax_backward(ConstView<T> weights, ConstView<T> d_weights,
                             const ValidLens& valid_lens, TensorView<T> d_scores) {
  const int64_t nq = weights.size(1), nk = weights.size(2);
  const int64_t rows = weights.size(0) * nq;
  const int64_t block = rows_per_task(nk);
  const bool stream = rows * nk * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
  kernels::parallel_for((rows + block - 1) / block, [&](int64_t task) {
    const int64_t end = std::min(rows, (task + 1) * block);
    for (int64_t r = task * block; r < end; ++r) {
      const int64_t b = r / nq, i = r % nq;
      fast::softmax_grad_row_once(&weights(b, i, 0), &d_weights(b, i, 0), valid_lens(b, i, nk), nk,
                                  &d_scores(b, i, 0), stream);
    }
    if (stream) fast::flush_streams();
  });
}

template size_t masked_softmax_workspace_size<float>(int64_t, int);
template size_t masked_softmax_workspace_size<double>(int64_t, int);
template void masked_softmax<float>(ConstView<float>, const ValidLens&, TensorView<float>,
                                    Workspace);
template void masked_softmax<double>(ConstView<double>, const ValidLens&, TensorView<double>,
                                     Workspace);
template void masked_softmax_backward<float>(ConstView<float>, ConstView<float>, const ValidLens&,
                                             TensorView<float>);
template void masked_softmax_backward<double>(ConstView<double>, ConstView<double>,
                                              const ValidLens&, TensorView<double>);

}  // namespace qkv::kernels::fast
