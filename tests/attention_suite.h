// The attention contract suite's pieces (test_attention.cc runs the suite;
// test_sdpa.cc, test_additive.cc, test_bilinear.cc and test_distance.cc
// reuse them for op-specific tests): one attention problem (Case), its random
// inputs (Inputs), the forward and backward checks, and one traits struct per
// scoring function (SdpaScoring, AdditiveScoring, BilinearScoring,
// DistanceScoring). The traits hold every call of the public API, each op's
// tolerances and each op's cases, so the suite body never names an op.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <source_location>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_testing.h"
#include "qkv/attention.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {

// How the inputs are laid out in memory.
enum class Layout {
  kContiguous,
  kStrided,          // queries, keys and values strided, each its own way
  kStridedReversed,  // the same with the axes stored in reverse order
  kBroadcastValues,  // values of batch 0 for every batch element (stride 0)
  kStridedEach,      // queries, keys, values and every parameter strided its own way
};

inline const char* to_string(Layout layout) {
  switch (layout) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kStrided:
      return "strided";
    case Layout::kStridedReversed:
      return "strided, axes reversed";
    case Layout::kBroadcastValues:
      return "values broadcast over the batch (stride 0)";
    case Layout::kStridedEach:
      return "inputs and parameters strided";
  }
  return "?";
}

// One attention problem: queries (B, Nq, Dq), keys (B, Nk, Dk), values
// (B, Nk, Dv). Scaled dot-product attention has one feature size D = Dq (its
// keys take Dq; dk is not read) and takes a scale; additive attention has
// W_q (H, Dq), W_k (H, Dk) and w_v (H) or (1, H) and no scale.
struct Case {
  int64_t batch = 2, nq = 3, nk = 5, dq = 4, dk = 4, dv = 3, hidden = 6;
  bool wv_row = false;  // w_v given as (1, H) instead of (H)
  LensForm lens_form = LensForm::kNone;
  bool lens32 = false;
  std::optional<double> scale;
  double dropout = 0.0;
  bool training = false;
  bool return_weights = true, return_lse = true;
  Layout layout = Layout::kContiguous;

  AttentionOptions options(uint64_t seed) const {
    AttentionOptions o;
    o.scale = scale;
    o.dropout_p = dropout;
    o.training = training;
    o.seed = seed;
    o.return_weights = return_weights;
    o.return_lse = return_lse;
    return o;
  }
  // Everything but the sizes (the traits' describe() adds those).
  std::string options_str() const {
    std::ostringstream os;
    os << to_string(lens_form) << (lens32 ? " int32" : " int64");
    if (scale) os << ", scale " << *scale;
    os << ", dropout " << dropout << (training ? " training" : " eval") << ", return_weights "
       << return_weights << ", return_lse " << return_lse << ", " << to_string(layout);
    return os.str();
  }
};

// The views a call gets: queries, keys, values and the scoring function's
// parameters (none for scaled dot-product; W_q, W_k, w_v for additive). The
// gradients come back in the same order.
template <class T>
struct Args {
  ConstView<T> q, k, v;
  std::vector<ConstView<T>> params;

  int size() const { return 3 + static_cast<int>(params.size()); }
  ConstView<T>& operator[](int n) {
    return n == 0 ? q : n == 1 ? k : n == 2 ? v : params[static_cast<size_t>(n - 3)];
  }
  const ConstView<T>& operator[](int n) const { return const_cast<Args&>(*this)[n]; }
};

// Owned inputs, contiguous.
template <class T>
struct Tensors {
  Tensor<T> q, k, v;
  std::vector<Tensor<T>> params;

  int size() const { return 3 + static_cast<int>(params.size()); }
  Tensor<T>& operator[](int n) {
    return n == 0 ? q : n == 1 ? k : n == 2 ? v : params[static_cast<size_t>(n - 3)];
  }
  const Tensor<T>& operator[](int n) const { return const_cast<Tensors&>(*this)[n]; }
  Args<T> args() const {
    Args<T> a{q, k, v, {}};
    for (const Tensor<T>& p : params) a.params.push_back(p);
    return a;
  }
};

// Contiguous double copies of the views (the reference's double run).
template <class T>
Tensors<double> cast_double(const Args<T>& a) {
  Tensors<double> out;
  out.q = cast<double>(a.q);
  out.k = cast<double>(a.k);
  out.v = cast<double>(a.v);
  for (const ConstView<T>& p : a.params) out.params.push_back(cast<double>(p));
  return out;
}

// The gradients, one per input in the order of Args.
template <class T>
using Grads = std::vector<Tensor<T>>;

// The name and coordinate axes of each gradient, for failure messages.
struct GradName {
  const char* name;
  const char* axes;
};

// What the backward takes of the forward: its output and lse.
template <class T>
struct Saved {
  ConstView<T> output, lse;
  Saved(ConstView<T> output_, ConstView<T> lse_) : output(output_), lse(lse_) {}
  Saved(const AttentionResult<T>& r) : output(r.output), lse(r.lse) {}  // NOLINT: implicit
};

// One op's tolerances for one element type.
struct Tols {
  Tol out, weights, lse, grad;
};

template <class Op, class T>
constexpr Tols tols() {
  return std::is_same_v<T, float> ? Op::kFloat : Op::kDouble;
}

// ---- scoring functions -----------------------------------------------------------
//
// A traits struct per scoring function. What the suite needs of one:
//   kScoring                       its row of the table (qkv/scoring.h)
//   kFunction, kFunctionBackward   the names errors give
//   kFloat, kDouble           tolerances (Tols)
//   describe(case)            the case as text, sizes first
//   key_dim(case)             the keys' feature size
//   add_random_params(rng, case, tensors), add_chapter_params(rng, tensors)
//   grad_names()              one GradName per input of Args
//   forward, ref_forward, forward_into, backward, ref_backward   the public API
//   naive_forward, naive_backward    the plain loops of attention_testing.h
//   kChapterQueryDim, kChapterDropout   the chapter's example
//   the cases of each sweep (shape_sweep, masked_keys_cases, ...)

// Scaled dot-product attention: softmax(Q Kᵀ · scale) V.
struct SdpaScoring {
  static constexpr qkv::Scoring kScoring = qkv::Scoring::kDotProduct;  // its row of qkv/scoring.h
  static constexpr const char* kFunction = "scaled_dot_product_attention";
  static constexpr const char* kFunctionBackward = "scaled_dot_product_attention_backward";
  static constexpr Tols kFloat{kSdpa, kSoftmax, kSdpaLse, kSdpaBackward};
  static constexpr Tols kDouble{kSdpaDouble, kSoftmaxDouble, kSdpaLseDouble, kSdpaBackwardDouble};

  static std::string describe(const Case& c) {
    std::ostringstream os;
    os << "B=" << c.batch << " Nq=" << c.nq << " Nk=" << c.nk << " D=" << c.dq << " Dv=" << c.dv
       << ", " << c.options_str();
    return os.str();
  }
  static int64_t key_dim(const Case& c) { return c.dq; }
  template <class T>
  static void add_random_params(Rng&, const Case&, Tensors<T>&) {}

  static const std::vector<GradName>& grad_names() {
    static const std::vector<GradName> names = {
        {"d_queries", "b q d"}, {"d_keys", "b k d"}, {"d_values", "b k d"}};
    return names;
  }

  template <class T>
  static AttentionResult<T> forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return scaled_dot_product_attention(a.q, a.k, a.v, lens, opt);
  }
  template <class T>
  static AttentionResult<T> ref_forward(const Args<T>& a, const ValidLens& lens,
                                        const AttentionOptions& opt) {
    return ref::scaled_dot_product_attention(a.q, a.k, a.v, lens, opt);
  }
  template <class T>
  static void forward_into(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           const AttentionOutputs<T>& outs) {
    scaled_dot_product_attention(a.q, a.k, a.v, lens, opt, outs);
  }
  template <class T>
  static Grads<T> backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           std::type_identity_t<Saved<T>> fwd,
                           std::type_identity_t<ConstView<T>> d_out) {
    return grads(scaled_dot_product_attention_backward(a.q, a.k, a.v, lens, opt,
                                                       {fwd.output, fwd.lse}, d_out));
  }
  template <class T>
  static Grads<T> ref_backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                               std::type_identity_t<Saved<T>> fwd,
                               std::type_identity_t<ConstView<T>> d_out) {
    return grads(ref::scaled_dot_product_attention_backward(a.q, a.k, a.v, lens, opt,
                                                            {fwd.output, fwd.lse}, d_out));
  }

  template <class T>
  static NaiveForward naive_forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return naive_sdpa<T>(a.q, a.k, a.v, lens, scale_of(a, opt), naive_dropout(opt));
  }
  template <class T>
  static std::vector<std::vector<double>> naive_backward(const Args<T>& a, const ValidLens& lens,
                                                         const AttentionOptions& opt,
                                                         std::type_identity_t<ConstView<T>> d_out) {
    NaiveDotGrads g =
        naive_sdpa_backward<T>(a.q, a.k, a.v, lens, scale_of(a, opt), naive_dropout(opt), d_out);
    return {std::move(g.d_queries), std::move(g.d_keys), std::move(g.d_values)};
  }

  // The chapter's example: queries (2, 1, 2); DotProductAttention(dropout=0.5).
  static constexpr int64_t kChapterQueryDim = 2;
  static constexpr double kChapterDropout = 0.5;
  template <class T>
  static void add_chapter_params(Rng&, Tensors<T>&) {}

  static std::vector<Case> shape_sweep(Rng& rng);
  static std::vector<Case> masked_keys_cases();
  static std::vector<Case> dropout_cases();
  static Case dropout_only_when_training_case();
  static std::vector<Case> strided_cases();
  static std::vector<Case> write_into_cases();
  static std::vector<Case> lse_merge_cases();
  static Case determinism_case();
  static std::vector<Case> backward_cases(Rng& rng);
  static std::vector<Case> finite_difference_cases();

 private:
  template <class T>
  static Grads<T> grads(DotProductGrads<T>&& g) {
    Grads<T> out;
    out.push_back(std::move(g.d_queries));
    out.push_back(std::move(g.d_keys));
    out.push_back(std::move(g.d_values));
    return out;
  }
  template <class T>
  static double scale_of(const Args<T>& a, const AttentionOptions& opt) {
    return opt.scale.value_or(1.0 / std::sqrt(double(a.q.size(2))));
  }
  static NaiveDropout naive_dropout(const AttentionOptions& opt) {
    return {opt.dropout_p, opt.training, opt.seed};
  }
};

// Additive attention: softmax(w_vᵀ tanh(W_q q + W_k k)) V.
struct AdditiveScoring {
  static constexpr qkv::Scoring kScoring = qkv::Scoring::kAdditive;  // its row of qkv/scoring.h
  static constexpr const char* kFunction = "additive_attention";
  static constexpr const char* kFunctionBackward = "additive_attention_backward";
  // lse of additive scores: the score error of kAdditive plus the log-sum-exp.
  static constexpr Tols kFloat{kAdditive, kAdditiveWeights, kAdditive, kAdditiveBackward};
  static constexpr Tols kDouble{kAdditiveDouble, kSoftmaxDouble, kAdditiveDouble,
                                kAdditiveBackwardDouble};

  static Shape wv_shape(const Case& c) { return c.wv_row ? Shape{1, c.hidden} : Shape{c.hidden}; }
  static std::string describe(const Case& c) {
    std::ostringstream os;
    os << "B=" << c.batch << " Nq=" << c.nq << " Nk=" << c.nk << " Dq=" << c.dq << " Dk=" << c.dk
       << " Dv=" << c.dv << " H=" << c.hidden << ", w_v " << wv_shape(c).str() << ", "
       << c.options_str();
    return os.str();
  }
  static int64_t key_dim(const Case& c) { return c.dk; }
  // The parameters as the public API groups them: params holds w_q, w_k, w_v.
  template <class T>
  static AdditiveWeights<T> weights(const Args<T>& a) {
    return {a.params[0], a.params[1], a.params[2]};
  }
  // Features W_q q + W_k k of order 1 so tanh is neither linear nor flat.
  template <class T>
  static void add_random_params(Rng& rng, const Case& c, Tensors<T>& t) {
    const double bq = 2.0 / std::sqrt(double(c.dq)), bk = 2.0 / std::sqrt(double(c.dk));
    t.params.push_back(random_tensor<T>(rng, {c.hidden, c.dq}, -bq, bq));
    t.params.push_back(random_tensor<T>(rng, {c.hidden, c.dk}, -bk, bk));
    t.params.push_back(random_tensor<T>(rng, wv_shape(c), -1.5, 1.5));
  }

  static const std::vector<GradName>& grad_names() {
    static const std::vector<GradName> names = {{"d_queries", "b q d"}, {"d_keys", "b k d"},
                                                {"d_values", "b k d"},  {"d_w_q", "h d"},
                                                {"d_w_k", "h d"},       {"d_w_v", ""}};
    return names;
  }

  template <class T>
  static AttentionResult<T> forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return additive_attention(a.q, a.k, a.v, weights(a), lens, opt);
  }
  template <class T>
  static AttentionResult<T> ref_forward(const Args<T>& a, const ValidLens& lens,
                                        const AttentionOptions& opt) {
    return ref::additive_attention(a.q, a.k, a.v, weights(a), lens, opt);
  }
  template <class T>
  static void forward_into(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           const AttentionOutputs<T>& outs) {
    additive_attention(a.q, a.k, a.v, weights(a), lens, opt, outs);
  }
  template <class T>
  static Grads<T> backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           std::type_identity_t<Saved<T>> fwd,
                           std::type_identity_t<ConstView<T>> d_out) {
    return grads(additive_attention_backward(a.q, a.k, a.v, weights(a), lens, opt,
                                             {fwd.output, fwd.lse}, d_out));
  }
  template <class T>
  static Grads<T> ref_backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                               std::type_identity_t<Saved<T>> fwd,
                               std::type_identity_t<ConstView<T>> d_out) {
    return grads(ref::additive_attention_backward(a.q, a.k, a.v, weights(a), lens, opt,
                                                  {fwd.output, fwd.lse}, d_out));
  }

  template <class T>
  static NaiveForward naive_forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return naive_additive<T>(a.q, a.k, a.v, a.params[0], a.params[1], a.params[2], lens,
                             naive_dropout(opt));
  }
  template <class T>
  static std::vector<std::vector<double>> naive_backward(const Args<T>& a, const ValidLens& lens,
                                                         const AttentionOptions& opt,
                                                         std::type_identity_t<ConstView<T>> d_out) {
    NaiveAdditiveGrads g = naive_additive_backward<T>(a.q, a.k, a.v, a.params[0], a.params[1],
                                                      a.params[2], lens, naive_dropout(opt), d_out);
    return {std::move(g.d_queries), std::move(g.d_keys), std::move(g.d_values),
            std::move(g.d_w_q),     std::move(g.d_w_k),  std::move(g.d_w_v)};
  }

  // The chapter's example: queries (2, 1, 20); AdditiveAttention(num_hiddens=8,
  // dropout=0.1) with parameters uniform in ±1/sqrt(fan_in) like nn.Linear.
  static constexpr int64_t kChapterQueryDim = 20;
  static constexpr double kChapterDropout = 0.1;
  template <class T>
  static void add_chapter_params(Rng& rng, Tensors<T>& t) {
    t.params.push_back(random_tensor<T>(rng, {8, 20}, -1 / std::sqrt(20.0), 1 / std::sqrt(20.0)));
    t.params.push_back(random_tensor<T>(rng, {8, 2}, -1 / std::sqrt(2.0), 1 / std::sqrt(2.0)));
    t.params.push_back(random_tensor<T>(rng, {1, 8}, -1 / std::sqrt(8.0), 1 / std::sqrt(8.0)));
  }

  static std::vector<Case> shape_sweep(Rng& rng);
  static std::vector<Case> masked_keys_cases();
  static std::vector<Case> dropout_cases();
  static Case dropout_only_when_training_case();
  static std::vector<Case> strided_cases();
  static std::vector<Case> write_into_cases();
  static std::vector<Case> lse_merge_cases();
  static Case determinism_case();
  static std::vector<Case> backward_cases(Rng& rng);
  static std::vector<Case> finite_difference_cases();

 private:
  template <class T>
  static Grads<T> grads(AdditiveGrads<T>&& g) {
    Grads<T> out;
    for (Tensor<T>* t : {&g.d_queries, &g.d_keys, &g.d_values, &g.d_w_q, &g.d_w_k, &g.d_w_v}) {
      out.push_back(std::move(*t));
    }
    return out;
  }
  static NaiveDropout naive_dropout(const AttentionOptions& opt) {
    return {opt.dropout_p, opt.training, opt.seed};
  }
};

// Bilinear attention: softmax(q W kᵀ) V with W (Dq, Dk). Its cases are
// additive attention's (Dq != Dk; H is not read).
struct BilinearScoring {
  static constexpr qkv::Scoring kScoring = qkv::Scoring::kBilinear;  // its row of qkv/scoring.h
  static constexpr const char* kFunction = "bilinear_attention";
  static constexpr const char* kFunctionBackward = "bilinear_attention_backward";
  // Scaled dot-product attention's: q W is one more rounded product of
  // Dq <= 20 terms, within them (measured over the contract's seeds).
  static constexpr Tols kFloat = SdpaScoring::kFloat;
  static constexpr Tols kDouble = SdpaScoring::kDouble;

  static std::string describe(const Case& c) {
    std::ostringstream os;
    os << "B=" << c.batch << " Nq=" << c.nq << " Nk=" << c.nk << " Dq=" << c.dq << " Dk=" << c.dk
       << " Dv=" << c.dv << ", " << c.options_str();
    return os.str();
  }
  static int64_t key_dim(const Case& c) { return c.dk; }
  // Scores q W k of order 1: W uniform in ±2/sqrt(Dq).
  template <class T>
  static void add_random_params(Rng& rng, const Case& c, Tensors<T>& t) {
    const double a = 2.0 / std::sqrt(double(std::max<int64_t>(c.dq, 1)));
    t.params.push_back(random_tensor<T>(rng, {c.dq, c.dk}, -a, a));
  }

  static const std::vector<GradName>& grad_names() {
    static const std::vector<GradName> names = {
        {"d_queries", "b q d"}, {"d_keys", "b k d"}, {"d_values", "b k d"}, {"d_w", "c e"}};
    return names;
  }

  template <class T>
  static AttentionResult<T> forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return bilinear_attention(a.q, a.k, a.v, a.params[0], lens, opt);
  }
  template <class T>
  static AttentionResult<T> ref_forward(const Args<T>& a, const ValidLens& lens,
                                        const AttentionOptions& opt) {
    return ref::bilinear_attention(a.q, a.k, a.v, a.params[0], lens, opt);
  }
  template <class T>
  static void forward_into(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           const AttentionOutputs<T>& outs) {
    bilinear_attention(a.q, a.k, a.v, a.params[0], lens, opt, outs);
  }
  template <class T>
  static Grads<T> backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           std::type_identity_t<Saved<T>> fwd,
                           std::type_identity_t<ConstView<T>> d_out) {
    return grads(bilinear_attention_backward(a.q, a.k, a.v, a.params[0], lens, opt,
                                             {fwd.output, fwd.lse}, d_out));
  }
  template <class T>
  static Grads<T> ref_backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                               std::type_identity_t<Saved<T>> fwd,
                               std::type_identity_t<ConstView<T>> d_out) {
    return grads(ref::bilinear_attention_backward(a.q, a.k, a.v, a.params[0], lens, opt,
                                                  {fwd.output, fwd.lse}, d_out));
  }

  template <class T>
  static NaiveForward naive_forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return naive_bilinear<T>(a.q, a.k, a.v, a.params[0], lens, naive_dropout(opt));
  }
  template <class T>
  static std::vector<std::vector<double>> naive_backward(const Args<T>& a, const ValidLens& lens,
                                                         const AttentionOptions& opt,
                                                         std::type_identity_t<ConstView<T>> d_out) {
    NaiveBilinearGrads g =
        naive_bilinear_backward<T>(a.q, a.k, a.v, a.params[0], lens, naive_dropout(opt), d_out);
    return {std::move(g.d_queries), std::move(g.d_keys), std::move(g.d_values), std::move(g.d_w)};
  }

  // The chapter's example with queries (2, 1, 20) and W (20, 2).
  static constexpr int64_t kChapterQueryDim = 20;
  static constexpr double kChapterDropout = 0.1;
  template <class T>
  static void add_chapter_params(Rng& rng, Tensors<T>& t) {
    t.params.push_back(random_tensor<T>(rng, {20, 2}, -1 / std::sqrt(20.0), 1 / std::sqrt(20.0)));
  }

  static std::vector<Case> shape_sweep(Rng& rng) { return AdditiveScoring::shape_sweep(rng); }
  static std::vector<Case> masked_keys_cases() { return AdditiveScoring::masked_keys_cases(); }
  static std::vector<Case> dropout_cases() { return AdditiveScoring::dropout_cases(); }
  static Case dropout_only_when_training_case() {
    return AdditiveScoring::dropout_only_when_training_case();
  }
  static std::vector<Case> strided_cases() { return AdditiveScoring::strided_cases(); }
  static std::vector<Case> write_into_cases() { return AdditiveScoring::write_into_cases(); }
  static std::vector<Case> lse_merge_cases() { return AdditiveScoring::lse_merge_cases(); }
  static Case determinism_case() { return AdditiveScoring::determinism_case(); }
  static std::vector<Case> backward_cases(Rng& rng) { return AdditiveScoring::backward_cases(rng); }
  static std::vector<Case> finite_difference_cases() {
    return AdditiveScoring::finite_difference_cases();
  }

 private:
  template <class T>
  static Grads<T> grads(BilinearGrads<T>&& g) {
    Grads<T> out;
    for (Tensor<T>* t : {&g.d_queries, &g.d_keys, &g.d_values, &g.d_w}) {
      out.push_back(std::move(*t));
    }
    return out;
  }
  static NaiveDropout naive_dropout(const AttentionOptions& opt) {
    return {opt.dropout_p, opt.training, opt.seed};
  }
};

// Distance attention: softmax(-scale/2 |q - k|^2) V, scale > 0 (default 1).
// Its cases are scaled dot-product attention's (their scales are positive).
struct DistanceScoring {
  static constexpr qkv::Scoring kScoring = qkv::Scoring::kDistance;  // its row of qkv/scoring.h
  static constexpr const char* kFunction = "distance_attention";
  static constexpr const char* kFunctionBackward = "distance_attention_backward";
  // Scaled dot-product attention's: on centred rows the scores' rounding is
  // that of a dot product of the same size (measured over the contract's seeds).
  static constexpr Tols kFloat = SdpaScoring::kFloat;
  static constexpr Tols kDouble = SdpaScoring::kDouble;

  static std::string describe(const Case& c) { return SdpaScoring::describe(c); }
  static int64_t key_dim(const Case& c) { return c.dq; }
  template <class T>
  static void add_random_params(Rng&, const Case&, Tensors<T>&) {}
  static const std::vector<GradName>& grad_names() { return SdpaScoring::grad_names(); }

  template <class T>
  static AttentionResult<T> forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return distance_attention(a.q, a.k, a.v, lens, opt);
  }
  template <class T>
  static AttentionResult<T> ref_forward(const Args<T>& a, const ValidLens& lens,
                                        const AttentionOptions& opt) {
    return ref::distance_attention(a.q, a.k, a.v, lens, opt);
  }
  template <class T>
  static void forward_into(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           const AttentionOutputs<T>& outs) {
    distance_attention(a.q, a.k, a.v, lens, opt, outs);
  }
  template <class T>
  static Grads<T> backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                           std::type_identity_t<Saved<T>> fwd,
                           std::type_identity_t<ConstView<T>> d_out) {
    return grads(
        distance_attention_backward(a.q, a.k, a.v, lens, opt, {fwd.output, fwd.lse}, d_out));
  }
  template <class T>
  static Grads<T> ref_backward(const Args<T>& a, const ValidLens& lens, const AttentionOptions& opt,
                               std::type_identity_t<Saved<T>> fwd,
                               std::type_identity_t<ConstView<T>> d_out) {
    return grads(ref::distance_attention_backward(a.q, a.k, a.v, lens, opt, {fwd.output, fwd.lse},
                                                  d_out));
  }

  template <class T>
  static NaiveForward naive_forward(const Args<T>& a, const ValidLens& lens,
                                    const AttentionOptions& opt) {
    return naive_distance<T>(a.q, a.k, a.v, lens, opt.scale.value_or(1.0), naive_dropout(opt));
  }
  template <class T>
  static std::vector<std::vector<double>> naive_backward(const Args<T>& a, const ValidLens& lens,
                                                         const AttentionOptions& opt,
                                                         std::type_identity_t<ConstView<T>> d_out) {
    NaiveDotGrads g = naive_distance_backward<T>(a.q, a.k, a.v, lens, opt.scale.value_or(1.0),
                                                 naive_dropout(opt), d_out);
    return {std::move(g.d_queries), std::move(g.d_keys), std::move(g.d_values)};
  }

  // The chapter's example: queries (2, 1, 2), as the keys (ones).
  static constexpr int64_t kChapterQueryDim = 2;
  static constexpr double kChapterDropout = 0.5;
  template <class T>
  static void add_chapter_params(Rng&, Tensors<T>&) {}

  static std::vector<Case> shape_sweep(Rng& rng) { return SdpaScoring::shape_sweep(rng); }
  static std::vector<Case> masked_keys_cases() { return SdpaScoring::masked_keys_cases(); }
  static std::vector<Case> dropout_cases() { return SdpaScoring::dropout_cases(); }
  static Case dropout_only_when_training_case() {
    return SdpaScoring::dropout_only_when_training_case();
  }
  static std::vector<Case> strided_cases() { return SdpaScoring::strided_cases(); }
  static std::vector<Case> write_into_cases() { return SdpaScoring::write_into_cases(); }
  static std::vector<Case> lse_merge_cases() { return SdpaScoring::lse_merge_cases(); }
  static Case determinism_case() { return SdpaScoring::determinism_case(); }
  static std::vector<Case> backward_cases(Rng& rng) { return SdpaScoring::backward_cases(rng); }
  static std::vector<Case> finite_difference_cases() {
    return SdpaScoring::finite_difference_cases();
  }

 private:
  template <class T>
  static Grads<T> grads(DotProductGrads<T>&& g) {
    Grads<T> out;
    out.push_back(std::move(g.d_queries));
    out.push_back(std::move(g.d_keys));
    out.push_back(std::move(g.d_values));
    return out;
  }
  static NaiveDropout naive_dropout(const AttentionOptions& opt) {
    return {opt.dropout_p, opt.training, opt.seed};
  }
};

// ---- inputs and checks -----------------------------------------------------------

// Random inputs and parameters of a case, owned contiguously, plus the views
// the calls get (laid out as the case says). Queries and keys are uniform in
// [lo, hi), rounded to multiples of `quantum` if it is positive (so that dot
// products can be exact in float); values uniform in [-1, 1).
template <class Op, class T>
struct Inputs : Tensors<T> {
  OwnedLens lens;
  std::vector<std::unique_ptr<Strided<T>>> strided;
  Args<T> views;

  Inputs(Rng& rng, const Case& c, double lo = -1.0, double hi = 1.0, double quantum = 0.0) {
    Tensors<T>& t = *this;
    t.q = random_tensor<T>(rng, {c.batch, c.nq, c.dq}, lo, hi);
    t.k = random_tensor<T>(rng, {c.batch, c.nk, Op::key_dim(c)}, lo, hi);
    if (quantum > 0) {
      for (Tensor<T>* x : {&t.q, &t.k}) {
        for (T& e : x->values()) e = static_cast<T>(quantum * std::round(double(e) / quantum));
      }
    }
    t.v = random_tensor<T>(rng, {c.batch, c.nk, c.dv});
    Op::add_random_params(rng, c, t);
    lens = make_lens(rng, c.lens_form, c.lens32, c.batch, c.nq, c.nk);
    views = t.args();
    lay_out(c);
  }
  ValidLens valid_lens() const { return lens.get(); }

 private:
  void lay_out(const Case& c) {
    Tensors<T>& t = *this;
    auto restride = [&](int n, typename Strided<T>::Layout layout) {
      strided.push_back(std::make_unique<Strided<T>>(t[n].view(), layout));
      views[n] = strided.back()->const_view();
    };
    switch (c.layout) {
      case Layout::kContiguous:
        break;
      case Layout::kStrided:
      case Layout::kStridedReversed: {
        typename Strided<T>::Layout layout;
        layout.reversed = c.layout == Layout::kStridedReversed;
        restride(0, layout);
        layout.step = 3;
        restride(1, layout);
        layout.pad = 1;
        restride(2, layout);
        break;
      }
      case Layout::kBroadcastValues:
        // Every batch element sees the values of batch 0.
        for (int64_t b = 1; b < c.batch; ++b) {
          for (int64_t j = 0; j < c.nk; ++j) {
            for (int64_t d = 0; d < c.dv; ++d) t.v(b, j, d) = t.v(0, j, d);
          }
        }
        views.v = ConstView<T>(t.v.data(), t.v.shape(), Shape{0, c.dv, 1});
        break;
      case Layout::kStridedEach:
        for (int n = 0; n < t.size(); ++n) {
          typename Strided<T>::Layout layout;
          layout.step = 1 + n % 3;
          layout.pad = n % 2;
          layout.offset = n;
          layout.reversed = n % 2 == 1;  // e.g. W_k stored transposed
          restride(n, layout);
        }
        break;
    }
  }
};

// Average pooling over all keys, the result of equal scores: each of
// num_queries queries gets mean_j values[b, j, :].
template <class T>
Tensor<double> mean_over_keys(const Tensor<T>& values, int64_t num_queries) {
  const int64_t batch = values.size(0), nk = values.size(1), dv = values.size(2);
  Tensor<double> mean(Shape{batch, num_queries, dv});
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_queries; ++i) {
      for (int64_t d = 0; d < dv; ++d) {
        for (int64_t j = 0; j < nk; ++j) mean(b, i, d) += double(values(b, j, d)) / double(nk);
      }
    }
  }
  return mean;
}

// Forward: fast (T) vs ref (double), ref (double) vs the plain loop, ref (T)
// vs the plain loop; the want_* flags; exact masking.
template <class Op, class T>
void check_forward(Rng& rng, const Case& c, double lo = -1.0, double hi = 1.0,
                   double quantum = 0.0) {
  SCOPED_TRACE(Op::describe(c));
  const Inputs<Op, T> in(rng, c, lo, hi, quantum);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions opt = c.options(rng.next());
  const Tols tol = tols<Op, T>();
  constexpr Tols tol_double = Op::kDouble;

  const AttentionResult<T> fast = Op::forward(in.views, lens, opt);
  const Tensors<double> in_double = cast_double(in.views);
  const AttentionResult<double> ref = Op::ref_forward(in_double.args(), lens, opt);
  const AttentionResult<T> ref_t = Op::ref_forward(in.views, lens, opt);
  const NaiveForward loop = Op::naive_forward(in.views, lens, opt);
  const Tensor<double> loop_out = as_tensor({c.batch, c.nq, c.dv}, loop.out);
  const Tensor<double> loop_w = as_tensor({c.batch, c.nq, c.nk}, loop.weights);
  const Tensor<double> loop_lse = as_tensor({c.batch, c.nq}, loop.lse);

  ASSERT_EQ(fast.output.shape(), Shape({c.batch, c.nq, c.dv}));
  if (c.return_weights) {
    ASSERT_EQ(fast.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  } else {
    EXPECT_TRUE(fast.weights.empty()) << "weights returned although return_weights is off";
  }
  if (c.return_lse) {
    ASSERT_EQ(fast.lse.shape(), Shape({c.batch, c.nq}));
  } else {
    EXPECT_TRUE(fast.lse.empty()) << "lse returned although return_lse is off";
  }
  // The reference returns weights and lse whatever the flags say.
  ASSERT_EQ(ref.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  ASSERT_EQ(ref.lse.shape(), Shape({c.batch, c.nq}));
  ASSERT_EQ(ref_t.weights.shape(), Shape({c.batch, c.nq, c.nk}));
  ASSERT_EQ(ref_t.lse.shape(), Shape({c.batch, c.nq}));

  expect_close(fast.output, ref.output, tol.out, "fast output vs ref", "b q d");
  if (c.return_weights) expect_close(fast.weights, ref.weights, tol.weights, "fast weights vs ref");
  if (c.return_lse) expect_close(fast.lse, ref.lse, tol.lse, "fast lse vs ref", "b q");

  expect_close(ref.output, loop_out, tol_double.out, "ref output vs loop", "b q d");
  expect_close(ref.weights, loop_w, tol_double.weights, "ref weights vs loop");
  expect_close(ref.lse, loop_lse, tol_double.lse, "ref lse vs loop", "b q");
  expect_close(ref_t.output, loop_out, tol.out, "ref<T> output vs loop", "b q d");
  expect_close(ref_t.weights, loop_w, tol.weights, "ref<T> weights vs loop");
  expect_close(ref_t.lse, loop_lse, tol.lse, "ref<T> lse vs loop", "b q");

  expect_exact_masking(fast.output, fast.weights, fast.lse, in.lens, c.nk, "fast");
  expect_exact_masking(ref.output, ref.weights, ref.lse, in.lens, c.nk, "ref");
}

// Backward: every gradient has its input's shape; fast (T) vs ref (double),
// ref (double) and ref (T) vs the plain loop.
template <class Op, class T>
void check_backward(Rng& rng, const Case& c) {
  SCOPED_TRACE(Op::describe(c));
  const Inputs<Op, T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions opt = c.options(rng.next());
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
  const Tols tol = tols<Op, T>();
  constexpr Tols tol_double = Op::kDouble;

  const AttentionResult<T> fwd = Op::forward(in.views, lens, opt);
  const Grads<T> fast = Op::backward(in.views, lens, opt, fwd, d_out);
  const Tensors<double> in_double = cast_double(in.views);
  const Tensor<double> d_out_double = cast<double>(d_out);
  const AttentionResult<double> rfwd = Op::ref_forward(in_double.args(), lens, opt);
  const Grads<double> ref = Op::ref_backward(in_double.args(), lens, opt, rfwd, d_out_double);
  const AttentionResult<T> rfwd_t = Op::ref_forward(in.views, lens, opt);
  const Grads<T> ref_t = Op::ref_backward(in.views, lens, opt, rfwd_t, d_out);
  const std::vector<std::vector<double>> loop =
      Op::naive_backward(in.views, lens, opt, d_out.view());

  const std::vector<GradName>& names = Op::grad_names();
  const int n_grads = in.views.size();
  ASSERT_EQ(fast.size(), size_t(n_grads));
  ASSERT_EQ(ref.size(), size_t(n_grads));
  ASSERT_EQ(ref_t.size(), size_t(n_grads));
  std::vector<Tensor<double>> loop_grads;
  for (int n = 0; n < n_grads; ++n) {
    const Shape& shape = in.views[n].shape();
    SCOPED_TRACE(names[n].name);
    ASSERT_EQ(fast[n].shape(), shape) << "a gradient has the shape of its input";
    ASSERT_EQ(ref[n].shape(), shape);
    ASSERT_EQ(ref_t[n].shape(), shape);
    loop_grads.push_back(as_tensor(shape, loop[n]));
  }
  for (int n = 0; n < n_grads; ++n) {
    expect_close(fast[n], ref[n], tol.grad, std::string("fast ") + names[n].name + " vs ref",
                 names[n].axes);
  }
  for (int n = 0; n < n_grads; ++n) {
    expect_close(ref[n], loop_grads[n], tol_double.grad,
                 std::string("ref ") + names[n].name + " vs loop", names[n].axes);
  }
  for (int n = 0; n < n_grads; ++n) {
    expect_close(ref_t[n], loop_grads[n], tol.grad,
                 std::string("ref<T> ") + names[n].name + " vs loop", names[n].axes);
  }
}

// Causal masking (top-left and bottom-right) is valid lengths capped per
// query: fast and ref forward, and the fast backward, against the float64
// loop given the capped lengths, for each valid-lengths form.
template <class Op, class T>
void check_causal(Rng& rng, Case c) {
  const Tols tol = tols<Op, T>();
  for (const Causal causal : {Causal::kTopLeft, Causal::kBottomRight}) {
    for (const LensForm form : kAllLensForms) {
      c.lens_form = form;
      SCOPED_TRACE(Op::describe(c) +
                   (causal == Causal::kTopLeft ? ", top-left" : ", bottom-right"));
      const Inputs<Op, T> in(rng, c);
      AttentionOptions opt = c.options(rng.next());
      opt.causal = causal;
      const ValidLens capped = in.valid_lens().causal(causal == Causal::kTopLeft ? 0 : c.nk - c.nq);
      AttentionOptions plain = opt;
      plain.causal = Causal::kNone;
      const NaiveForward loop = Op::naive_forward(in.views, capped, plain);
      const AttentionResult<T> fast = Op::forward(in.views, in.valid_lens(), opt);
      const AttentionResult<T> ref = Op::ref_forward(in.views, in.valid_lens(), opt);
      for (const AttentionResult<T>* r : {&fast, &ref}) {
        expect_close(r->output, as_tensor({c.batch, c.nq, c.dv}, loop.out), tol.out,
                     "output vs loop", "b q d");
        expect_close(r->lse, as_tensor({c.batch, c.nq}, loop.lse), tol.lse, "lse vs loop", "b q");
      }
      const Tensor<T> g = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
      const Grads<T> grads = Op::backward(in.views, in.valid_lens(), opt, fast, g);
      const std::vector<std::vector<double>> want =
          Op::naive_backward(in.views, capped, plain, g.view());
      for (size_t n = 0; n < grads.size(); ++n) {
        const GradName& name = Op::grad_names()[n];
        expect_close(grads[n], as_tensor(grads[n].shape(), want[n]), tol.grad, name.name,
                     name.axes);
      }
    }
  }
}

// ---- bad input -------------------------------------------------------------------

// A valid float problem: queries (2, 3, 4), keys (2, 5, 3) (scaled dot-product:
// (2, 5, 4)), values (2, 5, 6), parameters with H = 7 (additive: W_q (7, 4),
// W_k (7, 3), w_v (7)); a forward's output and lse and a d_output to match.
template <class Op>
struct ErrorFixture {
  static Case problem() {
    Case c;
    c.dk = 3;
    c.dv = 6;
    c.hidden = 7;
    return c;
  }
  Rng rng{0};
  const Inputs<Op, float> in{rng, problem()};
  Tensor<float> out{Shape{2, 3, 6}}, lse{Shape{2, 3}}, d_out{Shape{2, 3, 6}};

  // The problem's arguments with argument n (queries, keys, values, then the
  // parameters) replaced by `t`.
  Args<float> with(int n, const Tensor<float>& t) const {
    Args<float> a = in.args();
    a[n] = t;
    return a;
  }
};

// Expects the fast and the reference forward (and the double overload) to
// reject the arguments.
template <class Op>
void expect_forward_error(const Args<float>& a, const ValidLens& lens, const AttentionOptions& opt,
                          std::initializer_list<std::string_view> fragments,
                          std::source_location loc = std::source_location::current()) {
  expect_error([&] { Op::forward(a, lens, opt); }, fragments, loc);
  expect_error([&] { Op::ref_forward(a, lens, opt); }, fragments, loc);
  const Tensors<double> a_double = cast_double(a);
  expect_error([&] { Op::forward(a_double.args(), lens, opt); }, fragments, loc);
}

}  // namespace qkv::test
