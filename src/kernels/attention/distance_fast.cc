// Distance attention, fast version: the distance scores as dot products.
// With c the mean of the keys some query of batch element b sees,
// q' = q - c, k' = k - c,
//   -scale/2 |q - k|^2 = scale q'.k' - scale/2 |k'|^2 - scale/2 |q'|^2,
// a scaled dot product, a bias per key and a term per query (which only
// shifts the lse), so the fused dot-product kernel computes it with no
// (B, Nq, Nk) buffer. Centring first keeps the products accurate when the
// rows sit far from the origin (docs/regression.md: the uncentred form
// cancels |q|^2 + |k|^2 against 2 q.k, losing |q|^2 * 2^-24 in float). The
// centred operands and the terms live in the workspace ahead of the
// dot-product kernel's own scratch. Tested against distance_ref.cc
// (tests/test_distance.cc).
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/runtime/parallel.h"

namespace qkv::kernels::fast {
namespace {

// Rows [0, n) of at(j, c) centred at `centre`: out[j * d + c] = x[j, c] -
// centre[c] (rounded to T) and term[j] = -scale/2 |x_j - centre|^2 (in
// double, then rounded to Term). Rows in tasks of 4096 (whole rows per
// task, so the bits do not depend on the thread count).
template <class T, class Term, class At>
void centre_rows(int64_t n, int64_t d, At&& at, const std::vector<double>& centre, double scale,
                 T* out, Term* term) {
  constexpr int64_t kRowsPerTask = 4096;
  parallel_for((n + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kRowsPerTask);
    for (int64_t j = task * kRowsPerTask; j < end; ++j) {
      double norm = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double x = at(j, c) - centre[static_cast<size_t>(c)];
        out[j * d + c] = static_cast<T>(x);
        norm += x * x;
      }
      term[j] = static_cast<Term>(-0.5 * scale * norm);
    }
  });
}

// The workspace's layout: the centred queries and keys, the key terms (as
// the kernel reads a bias), the query terms, and for the backward the lse
// the dot-product kernel saw and the key terms' gradient; then the
// dot-product kernel's scratch.
template <class T>
struct Layout {
  T* q = nullptr;
  T* k = nullptr;
  T* key_terms = nullptr;
  double* query_terms = nullptr;
  T* lse = nullptr;
  T* d_key_terms = nullptr;
  Layout(Slicer& slicer, int64_t batch, int64_t nq, int64_t nk, int64_t d, bool backward) {
    q = slicer.take<T>(batch * nq * d);
    k = slicer.take<T>(batch * nk * d);
    key_terms = slicer.take<T>(batch * nk);
    query_terms = slicer.take<double>(batch * nq);
    if (backward) {
      lse = slicer.take<T>(batch * nq);
      d_key_terms = slicer.take<T>(batch * nk);
    }
  }
};

template <class T>
size_t layout_words(ConstView<T> q, ConstView<T> k, bool backward) {
  return counted_words(
      [&](Slicer& s) { Layout<T>(s, q.size(0), q.size(1), k.size(1), q.size(2), backward); });
}

// Per-key terms (B, Nk) as the kernels read a bias: (B, 1, Nq, Nk), one row per b.
template <class T>
TensorView<T> per_key(T* terms, int64_t batch, int64_t nq, int64_t nk) {
  return TensorView<T>(terms, Shape{batch, 1, nq, nk}, Shape{nk, 0, 0, 1});
}

template <class T>
AttentionConfig with_bias(AttentionConfig config, T* key_terms, int64_t batch, int64_t nq,
                          int64_t nk) {
  const ConstView<T> bias = per_key(key_terms, batch, nq, nk);
  if constexpr (std::is_same_v<T, float>) {
    config.bias_float = bias;
  } else {
    config.bias_double = bias;
  }
  return config;
}

// Where the size queries point the key terms and their gradient: the
// dot-product kernel's scratch depends on which views are present (a bias
// rules out the small-dimension kernel), never on their elements, so a view
// over this stand-in element stands for the workspace's slice, which does not
// exist yet when the size is asked.
template <class T>
T* bias_stand_in() {
  alignas(kWorkspaceAlign) static T element{};
  return &element;
}

// Fills the layout's centred operands and terms. Keys past the longest
// length among b's queries, which no query sees, are zeros: the kernel may
// read them inside a block it masks, and 0 * a stale NaN would reach dK.
template <class T>
void centre(ConstView<T> q, ConstView<T> k, const AttentionConfig& config, const Layout<T>& at) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t seen = 0;  // the keys some query of b sees
    for (int64_t i = 0; i < nq; ++i) seen = std::max(seen, config.len(b, i, nk));
    const T* keys = k.data() + b * nk * d;
    const T* queries = q.data() + b * nq * d;
    const auto key = [&](int64_t j, int64_t c) -> double { return keys[j * d + c]; };
    std::vector<double> mean(static_cast<size_t>(d), 0.0);
    for (int64_t j = 0; j < seen; ++j) {
      for (int64_t c = 0; c < d; ++c) mean[static_cast<size_t>(c)] += key(j, c);
    }
    if (seen > 0) {
      for (double& m : mean) m /= static_cast<double>(seen);
    }
    T* k_out = at.k + b * nk * d;
    T* terms = at.key_terms + b * nk;
    centre_rows(seen, d, key, mean, config.scale, k_out, terms);
    std::fill(k_out + seen * d, k_out + nk * d, T(0));
    std::fill(terms + seen, terms + nk, T(0));
    centre_rows(
        nq, d, [&](int64_t i, int64_t c) -> double { return queries[i * d + c]; }, mean,
        config.scale, at.q + b * nq * d, at.query_terms + b * nq);
  }
}

}  // namespace

template <class T>
size_t distance_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                               const AttentionConfig& config, const ForwardViews<T>& out,
                               int num_threads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1);
  return layout_words(q, k, false) +
         sdpa_workspace_size(as_heads(ConstView<T>(nullptr, q.shape())),
                             as_heads(ConstView<T>(nullptr, k.shape())), as_heads(v),
                             with_bias(config, bias_stand_in<T>(), batch, nq, nk),
                             {as_heads(out.output), out.weights, out.lse}, num_threads);
}

template <class T>
void distance(ConstView<T> q, ConstView<T> k, ConstView<T> v, const AttentionConfig& config,
              const ForwardViews<T>& out, Workspace workspace) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1);
  Slicer slicer(workspace.data);
  const Layout<T> at(slicer, batch, nq, nk, q.size(2), false);
  centre(q, k, config, at);
  sdpa(as_heads(ConstView<T>(at.q, q.shape())), as_heads(ConstView<T>(at.k, k.shape())),
       as_heads(v), with_bias(config, at.key_terms, batch, nq, nk),
       {as_heads(out.output), out.weights, out.lse},
       Workspace{workspace.data + slicer.words(), workspace.num_threads});
  // The kernel's lse leaves out each query's own term.
  if (out.lse.data() != nullptr) {
    for (int64_t r = 0; r < batch * nq; ++r) {
      out.lse.data()[r] =
          static_cast<T>(static_cast<double>(out.lse.data()[r]) + at.query_terms[r]);
    }
  }
}

template <class T>
size_t distance_backward_workspace_size(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                                        const AttentionConfig& config, const SavedViews<T>& saved,
                                        ConstView<T> d_output, const SdpaGradViews<T>& grads,
                                        int num_threads) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1);
  const SdpaGradViews<T> sdpa_grads{as_heads(grads.d_queries), as_heads(grads.d_keys),
                                    as_heads(grads.d_values),
                                    per_key(bias_stand_in<T>(), batch, nq, nk)};
  return layout_words(q, k, true) +
         sdpa_backward_workspace_size(
             as_heads(ConstView<T>(nullptr, q.shape())), as_heads(ConstView<T>(nullptr, k.shape())),
             as_heads(v), with_bias(config, bias_stand_in<T>(), batch, nq, nk),
             {as_heads(saved.output), saved.lse}, as_heads(d_output), sdpa_grads, num_threads);
}

template <class T>
void distance_backward(ConstView<T> q, ConstView<T> k, ConstView<T> v,
                       const AttentionConfig& config, const SavedViews<T>& saved,
                       ConstView<T> d_output, const SdpaGradViews<T>& grads, Workspace workspace) {
  const int64_t batch = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2);
  Slicer slicer(workspace.data);
  const Layout<T> at(slicer, batch, nq, nk, d, true);
  centre(q, k, config, at);
  // The lse the dot-product kernel saw: the saved one less each query's term.
  for (int64_t r = 0; r < batch * nq; ++r) {
    at.lse[r] = static_cast<T>(static_cast<double>(saved.lse.data()[r]) - at.query_terms[r]);
  }
  // The bias's gradient: sum_i dS[b, i, j] for each key.
  const SdpaGradViews<T> sdpa_grads{as_heads(grads.d_queries), as_heads(grads.d_keys),
                                    as_heads(grads.d_values),
                                    per_key(at.d_key_terms, batch, nq, nk)};
  sdpa_backward(as_heads(ConstView<T>(at.q, q.shape())), as_heads(ConstView<T>(at.k, k.shape())),
                as_heads(v), with_bias(config, at.key_terms, batch, nq, nk),
                {as_heads(saved.output), ConstView<T>(at.lse, saved.lse.shape())},
                as_heads(d_output), sdpa_grads,
                Workspace{workspace.data + slicer.words(), workspace.num_threads});
  // The bias -scale/2 |k'|^2 adds -scale k' d_bias to dK (the query terms
  // add nothing: each row of dS sums to 0).
  parallel_for(batch, [&](int64_t b) {
    for (int64_t j = 0; j < nk; ++j) {
      const double g = -config.scale * static_cast<double>(at.d_key_terms[b * nk + j]);
      T* dk = grads.d_keys.data() + (b * nk + j) * d;
      const T* kc = at.k + (b * nk + j) * d;
      for (int64_t c = 0; c < d; ++c) {
        dk[c] = static_cast<T>(static_cast<double>(dk[c]) + g * static_cast<double>(kc[c]));
      }
    }
  });
}

#define QKV_INSTANTIATE_DISTANCE(T)                                                              \
  template size_t distance_workspace_size(ConstView<T>, ConstView<T>, ConstView<T>,              \
                                          const AttentionConfig&, const ForwardViews<T>&, int);  \
  template void distance(ConstView<T>, ConstView<T>, ConstView<T>, const AttentionConfig&,       \
                         const ForwardViews<T>&, Workspace);                                     \
  template size_t distance_backward_workspace_size(ConstView<T>, ConstView<T>, ConstView<T>,     \
                                                   const AttentionConfig&, const SavedViews<T>&, \
                                                   ConstView<T>, const SdpaGradViews<T>&, int);  \
  template void distance_backward(ConstView<T>, ConstView<T>, ConstView<T>,                      \
                                  const AttentionConfig&, const SavedViews<T>&, ConstView<T>,    \
                                  const SdpaGradViews<T>&, Workspace);
QKV_INSTANTIATE_DISTANCE(float)
QKV_INSTANTIATE_DISTANCE(double)
#undef QKV_INSTANTIATE_DISTANCE

}  // namespace qkv::kernels::fast
