// The attention contract: what every scoring function (scaled dot-product,
// additive, and the ones to come) must do, written once and instantiated per
// scoring function and element type. The chapter's worked example, fast vs
// qkv::ref vs plain float64 loops over many shapes, masked keys never read,
// zero sizes, dropout and its replay, strided inputs and valid lengths, the
// write-into form, the lse merge of disjoint key sets, thread-count
// determinism, the backward against the reference, the loops and finite
// differences. The traits structs of attention_suite.h hold every call of
// the public API; each op's cases are at the end of this file.
//
// A new scoring function: a traits struct in attention_suite.h, its cases
// below, and one QKV_ATTENTION_CONTRACT line at the end. Op-specific tests
// stay in the op's own file (test_sdpa.cc, test_additive.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_suite.h"
#include "attention_testing.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

// The contract suite's type: a scoring function (its traits) and an element type.
template <class OpT, class ElementT>
struct Scoring {
  using Op = OpT;
  using T = ElementT;
};
template <class Op>
using ScoringTypes = ::testing::Types<Scoring<Op, float>, Scoring<Op, double>>;

// Names the instances "float" and "double".
struct ElementNames {
  template <class S>
  static std::string GetName(int) {
    return std::is_same_v<typename S::T, float> ? "float" : "double";
  }
};

template <class S>
class AttentionContract : public ::testing::Test {};
TYPED_TEST_SUITE_P(AttentionContract);

// Every test starts with these: the scoring function, the element type, its
// tolerances, and a random stream seeded from the test's name (replayable).
#define QKV_CONTRACT_PROLOGUE()                  \
  using Op = typename TypeParam::Op;             \
  using T = typename TypeParam::T;               \
  [[maybe_unused]] const Tols tol = tols<Op, T>(); \
  const uint64_t seed = test_seed();             \
  SCOPED_TRACE(seed_note(seed));                 \
  Rng rng(seed)

TYPED_TEST_P(AttentionContract, ChapterExample) {
  QKV_CONTRACT_PROLOGUE();
  // keys: ones (2, 10, 2); values: arange(40) as (1, 10, 4) repeated for 2
  // batches; valid_lens [2, 6]; queries ~ N(0, 1) (2, 1, Dq); the op's
  // parameters as the chapter draws them.
  Tensors<T> in;
  in.k = Tensor<T>(Shape{2, 10, 2}, T(1));
  in.v = Tensor<T>(Shape{2, 10, 4});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < 10; ++j) {
      for (int64_t d = 0; d < 4; ++d) in.v(b, j, d) = static_cast<T>(4 * j + d);
    }
  }
  in.q = normal_tensor<T>(rng, {2, 1, Op::kChapterQueryDim});
  Op::add_chapter_params(rng, in);
  // Every key is the same, so each valid weight is 1/L and the output the
  // mean of rows 0-1 and of rows 0-5 of arange(40).reshape(10, 4).
  const Tensor<double> expected = as_tensor({2, 1, 4}, {2, 3, 4, 5, 10, 11, 12, 13});
  Tensor<double> expected_w(Shape{2, 1, 10});
  for (int64_t j = 0; j < 2; ++j) expected_w(0, 0, j) = 0.5;
  for (int64_t j = 0; j < 6; ++j) expected_w(1, 0, j) = 1.0 / 6.0;
  const Tol out_tol = tol_for<T>(kAverage, kPoolingDouble);

  for (const bool use32 : {false, true}) {
    SCOPED_TRACE(use32 ? "int32 valid_lens" : "int64 valid_lens");
    const Tensor<int32_t> lens32(Shape{2}, std::vector<int32_t>{2, 6});
    const Tensor<int64_t> lens64(Shape{2}, std::vector<int64_t>{2, 6});
    const ValidLens lens = use32 ? ValidLens(lens32) : ValidLens(lens64);
    AttentionOptions opt;
    opt.return_weights = true;
    opt.return_lse = true;
    opt.dropout_p = Op::kChapterDropout;  // as the chapter's module, in eval mode
    opt.training = false;
    // All valid scores of a row equal its score s, so lse = s + log L: the
    // plain loop's lse.
    const NaiveForward loop = Op::naive_forward(in.args(), lens, opt);
    const Tensor<double> expected_lse = as_tensor({2, 1}, loop.lse);
    const AttentionResult<T> fast = Op::forward(in.args(), lens, opt);
    const AttentionResult<T> ref = Op::ref_forward(in.args(), lens, opt);
    expect_close(fast.output, expected, out_tol, "fast output", "b q d");
    expect_close(fast.weights, expected_w, tol.weights, "fast weights");
    expect_close(fast.lse, expected_lse, tol.lse, "fast lse", "b q");
    expect_close(ref.output, expected, out_tol, "ref output", "b q d");
    expect_close(ref.weights, expected_w, tol.weights, "ref weights");
    expect_close(ref.lse, expected_lse, tol.lse, "ref lse", "b q");
  }
}

TYPED_TEST_P(AttentionContract, FastMatchesRefAndLoopOverShapes) {
  QKV_CONTRACT_PROLOGUE();
  for (const Case& c : Op::shape_sweep(rng)) {
    check_forward<Op, T>(rng, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TYPED_TEST_P(AttentionContract, ZeroLengthsAndFullLengths) {
  QKV_CONTRACT_PROLOGUE();
  for (const LensForm form : {LensForm::kPerBatch, LensForm::kPerQuery}) {
    for (const int64_t nk : {1, 4, 65}) {
      Case c;
      c.batch = 3;
      c.nq = 5;
      c.nk = nk;
      c.dq = c.dk = 7;
      c.dv = 6;
      c.lens_form = form;
      SCOPED_TRACE(Op::describe(c));
      Inputs<Op, T> in(rng, c);
      // Half the lengths zero (the rest random), then compare to the loop.
      for (int64_t& len : in.lens.lens64.values()) {
        len = rng.bernoulli(0.5) ? 0 : rng.uniform_int(0, nk);
      }
      in.lens.lens64.values()[0] = 0;
      const ValidLens lens = in.valid_lens();
      const AttentionOptions opt = c.options(0);
      const AttentionResult<T> fast = Op::forward(in.views, lens, opt);
      const AttentionResult<T> ref = Op::ref_forward(in.views, lens, opt);
      expect_exact_masking(fast.output, fast.weights, fast.lse, in.lens, c.nk, "fast");
      expect_exact_masking(ref.output, ref.weights, ref.lse, in.lens, c.nk, "ref");
      const NaiveForward loop = Op::naive_forward(in.views, lens, opt);
      expect_close(fast.output, as_tensor({c.batch, c.nq, c.dv}, loop.out), tol.out,
                   "fast output vs loop", "b q d");
      expect_close(fast.lse, as_tensor({c.batch, c.nq}, loop.lse), tol.lse, "fast lse vs loop",
                   "b q");
    }
  }
}

// Key positions at or past every query's valid length are never read (DESIGN
// §3: masked positions are never read): NaN keys and values there change
// nothing, forward or backward, and their gradients are exactly 0.
TYPED_TEST_P(AttentionContract, MaskedKeysAreNeverRead) {
  QKV_CONTRACT_PROLOGUE();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (const Case& c : Op::masked_keys_cases()) {
    SCOPED_TRACE(Op::describe(c));
    const Inputs<Op, T> in(rng, c);
    const ValidLens lens = in.valid_lens();
    Tensor<T> k_nan = in.k, v_nan = in.v;
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t j = in.lens.at(b, 0, c.nk); j < c.nk; ++j) {
        for (int64_t d = 0; d < k_nan.size(2); ++d) k_nan(b, j, d) = nan;
        for (int64_t d = 0; d < c.dv; ++d) v_nan(b, j, d) = nan;
      }
    }
    const Args<T> clean_args = in.args();
    Args<T> nan_args = clean_args;
    nan_args.k = k_nan;
    nan_args.v = v_nan;
    const AttentionOptions opt = c.options(rng.next());
    const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
    const AttentionResult<T> clean = Op::forward(clean_args, lens, opt);
    const AttentionResult<T> fast = Op::forward(nan_args, lens, opt);
    const AttentionResult<T> ref = Op::ref_forward(nan_args, lens, opt);
    expect_close(fast.output, clean.output, tol.out, "fast output, NaN past L", "b q d");
    expect_close(fast.lse, clean.lse, tol.lse, "fast lse, NaN past L", "b q");
    expect_close(ref.output, clean.output, tol.out, "ref output, NaN past L", "b q d");
    const Grads<T> g_clean = Op::backward(clean_args, lens, opt, clean, d_out);
    const Grads<T> g_fast = Op::backward(nan_args, lens, opt, fast, d_out);
    const Grads<T> g_ref = Op::ref_backward(nan_args, lens, opt, ref, d_out);
    for (const Grads<T>* g : {&g_fast, &g_ref}) {
      SCOPED_TRACE(g == &g_fast ? "fast" : "ref");
      // g_clean already has exact zeros past L if the contract holds.
      for (size_t n = 0; n < g->size(); ++n) {
        const GradName& name = Op::grad_names()[n];
        expect_close((*g)[n], g_clean[n], tol.grad, std::string(name.name) + ", NaN past L",
                     name.axes);
      }
      const Tensor<T>& d_keys = (*g)[1];
      const Tensor<T>& d_values = (*g)[2];
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t j = in.lens.at(b, 0, c.nk); j < c.nk; ++j) {
          for (int64_t d = 0; d < d_keys.size(2); ++d) {
            ASSERT_EQ(d_keys(b, j, d), T(0)) << "d_keys past L, b=" << b << " k=" << j;
          }
          for (int64_t d = 0; d < c.dv; ++d) {
            ASSERT_EQ(d_values(b, j, d), T(0)) << "d_values past L, b=" << b << " k=" << j;
          }
        }
      }
    }
  }
}

// Sizes of zero (docs/semantics.md): Nk = 0 makes every row empty (output 0,
// lse -inf, zero gradients); Nq = 0 or B = 0 give empty results; Dv = 0
// still gives the weights. (Zero feature sizes are op-specific.)
TYPED_TEST_P(AttentionContract, ZeroSizes) {
  QKV_CONTRACT_PROLOGUE();
  AttentionOptions opt;
  opt.return_weights = true;
  opt.return_lse = true;
  for (const bool use_ref : {false, true}) {
    SCOPED_TRACE(use_ref ? "ref" : "fast");
    auto attend = [&](const Args<T>& a) {
      return use_ref ? Op::ref_forward(a, {}, opt) : Op::forward(a, {}, opt);
    };
    {
      SCOPED_TRACE("Nk = 0");
      Case c;
      c.nq = 3;
      c.nk = 0;
      c.dq = 4;
      c.dk = 2;
      c.dv = 5;
      c.wv_row = true;
      const Inputs<Op, T> in(rng, c);
      const AttentionResult<T> r = attend(in.views);
      expect_close(r.output, Tensor<double>(Shape{2, 3, 5}), kExact, "output", "b q d");
      EXPECT_EQ(r.weights.shape(), Shape({2, 3, 0}));
      expect_close(r.lse, Tensor<double>(Shape{2, 3}, -std::numeric_limits<double>::infinity()),
                   kExact, "lse", "b q");
      const Tensor<T> d_out = random_tensor<T>(rng, {2, 3, 5});
      const Grads<T> g = use_ref ? Op::ref_backward(in.views, {}, opt, r, d_out)
                                 : Op::backward(in.views, {}, opt, r, d_out);
      expect_close(g[0], Tensor<double>(in.q.shape()), kExact, "d_queries", "b q d");
      EXPECT_EQ(g[1].shape(), in.k.shape());
      EXPECT_EQ(g[2].shape(), in.v.shape());
      for (int n = 3; n < in.views.size(); ++n) {
        const GradName& name = Op::grad_names()[static_cast<size_t>(n)];
        expect_close(g[static_cast<size_t>(n)], Tensor<double>(in.views[n].shape()), kExact,
                     name.name, name.axes);
      }
    }
    {
      SCOPED_TRACE("Nq = 0 and B = 0");
      Case c;
      c.nq = 0;
      c.nk = 3;
      c.dv = 5;
      const AttentionResult<T> r = attend(Inputs<Op, T>(rng, c).views);
      EXPECT_EQ(r.output.shape(), Shape({2, 0, 5}));
      EXPECT_EQ(r.weights.shape(), Shape({2, 0, 3}));
      EXPECT_EQ(r.lse.shape(), Shape({2, 0}));
      c.batch = 0;
      c.nq = 2;
      const Inputs<Op, T> empty(rng, c);
      const AttentionResult<T> e = attend(empty.views);
      EXPECT_EQ(e.output.shape(), Shape({0, 2, 5}));
      // The backward of an empty batch: empty gradients (B = 0 once divided
      // the backward's task count by zero).
      const Tensor<T> d_out(Shape{0, 2, 5});
      const Grads<T> g = use_ref ? Op::ref_backward(empty.views, {}, opt, e, d_out)
                                 : Op::backward(empty.views, {}, opt, e, d_out);
      for (int n = 0; n < empty.views.size(); ++n) {
        EXPECT_EQ(g[static_cast<size_t>(n)].numel(), empty.views[n].numel()) << "gradient " << n;
      }
    }
    {
      SCOPED_TRACE("Dv = 0");
      Case c;
      c.batch = 1;
      c.nq = 2;
      c.nk = 5;
      c.dq = c.dk = 3;
      c.dv = 0;
      const Inputs<Op, T> in(rng, c);
      const AttentionResult<T> r = attend(in.views);
      EXPECT_EQ(r.output.shape(), Shape({1, 2, 0}));
      Tensors<double> want_in = cast_double(in.views);
      want_in.v = Tensor<double>(Shape{1, 5, 1});
      const AttentionResult<double> want = Op::ref_forward(want_in.args(), {}, opt);
      expect_close(r.weights, want.weights, tol.weights, "weights");
    }
  }
}

TYPED_TEST_P(AttentionContract, Dropout) {
  QKV_CONTRACT_PROLOGUE();
  for (const Case& c : Op::dropout_cases()) check_forward<Op, T>(rng, c);
}

// In eval mode dropout does nothing; p = 0 in training does nothing; p = 1 in
// training drops every weight; a different seed draws a different mask.
TYPED_TEST_P(AttentionContract, DropoutOnlyWhenTraining) {
  QKV_CONTRACT_PROLOGUE();
  const Case c = Op::dropout_only_when_training_case();
  SCOPED_TRACE(Op::describe(c));
  const Inputs<Op, T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions plain = c.options(rng.next());
  auto run = [&](double p, bool training, uint64_t s) {
    AttentionOptions o = plain;
    o.dropout_p = p;
    o.training = training;
    o.seed = s;
    return Op::forward(in.views, lens, o);
  };
  const AttentionResult<T> base = Op::forward(in.views, lens, plain);

  const AttentionResult<T> r_eval = run(0.5, false, plain.seed);
  expect_close(r_eval.output, base.output, tol.out, "eval with dropout vs no dropout", "b q d");
  expect_close(r_eval.weights, base.weights, tol.weights, "eval weights vs no dropout");

  const AttentionResult<T> r_zero = run(0.0, true, plain.seed);
  expect_close(r_zero.output, base.output, tol.out, "training with p = 0 vs no dropout", "b q d");

  const AttentionResult<T> r_all = run(1.0, true, plain.seed);
  expect_close(r_all.output, Tensor<double>(r_all.output.shape()), kExact, "p = 1 output", "b q d");
  // The weights are reported before dropout.
  expect_close(r_all.weights, base.weights, tol.weights, "p = 1 weights (before dropout)");

  const AttentionResult<T> r_half = run(0.5, true, plain.seed);
  EXPECT_GT(max_abs_diff(r_half.output, base.output), 1e-3)
      << "training with p = 0.5 gave the output without dropout";
  const AttentionResult<T> r_other = run(0.5, true, plain.seed + 1);
  EXPECT_GT(max_abs_diff(r_half.output, r_other.output), 1e-3)
      << "two dropout seeds gave the same output";
}

TYPED_TEST_P(AttentionContract, StridedInputs) {
  QKV_CONTRACT_PROLOGUE();
  for (const Case& c : Op::strided_cases()) check_forward<Op, T>(rng, c);
}

// Valid lengths given as a strided view (a column of a bigger int tensor).
TYPED_TEST_P(AttentionContract, StridedValidLens) {
  QKV_CONTRACT_PROLOGUE();
  Case c;
  c.batch = 3;
  c.nq = 4;
  c.nk = 9;
  c.lens_form = LensForm::kPerQuery;
  const Inputs<Op, T> in(rng, c);
  const Tensor<int64_t>& dense = in.lens.lens64;
  Tensor<int64_t> wide(Shape{c.batch, c.nq, 2}, int64_t{-1});
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.nq; ++i) wide(b, i, 1) = dense(b, i);
  }
  const ConstView<int64_t> column(wide.data() + 1, Shape{c.batch, c.nq}, Shape{2 * c.nq, 2});
  const AttentionOptions opt = c.options(0);
  const AttentionResult<T> got = Op::forward(in.views, column, opt);
  const AttentionResult<T> want = Op::forward(in.views, dense, opt);
  expect_close(got.output, want.output, tol.out, "strided lens output", "b q d");
  expect_close(got.weights, want.weights, tol.weights, "strided lens weights");
}

// Case n of the op's list gets weights and lse buffers as n's bits 0 and 1 say.
TYPED_TEST_P(AttentionContract, WriteIntoCallerBuffers) {
  QKV_CONTRACT_PROLOGUE();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  int n = 0;
  for (const Case& c : Op::write_into_cases()) {
    const int which = n++ % 4;
    const bool give_w = which & 1, give_lse = which & 2;
    SCOPED_TRACE(Op::describe(c) + (give_w ? ", weights given" : ", no weights") +
                 (give_lse ? ", lse given" : ", no lse"));
    const Inputs<Op, T> in(rng, c);
    const ValidLens lens = in.valid_lens();
    AttentionOptions opt = c.options(rng.next());
    // The flags are ignored in favour of the buffers given.
    opt.return_weights = !give_w;
    opt.return_lse = !give_lse;
    // Each destination sits inside a bigger buffer whose guard elements must
    // stay untouched.
    const int64_t guard = 5;
    const int64_t n_out = c.batch * c.nq * c.dv, n_w = c.batch * c.nq * c.nk,
                  n_lse = c.batch * c.nq;
    std::vector<T> buf_out(static_cast<size_t>(n_out + 2 * guard), nan);
    std::vector<T> buf_w(static_cast<size_t>(n_w + 2 * guard), nan);
    std::vector<T> buf_lse(static_cast<size_t>(n_lse + 2 * guard), nan);
    AttentionOutputs<T> outs;
    outs.output = TensorView<T>(buf_out.data() + guard, Shape{c.batch, c.nq, c.dv});
    if (give_w) outs.weights = TensorView<T>(buf_w.data() + guard, Shape{c.batch, c.nq, c.nk});
    if (give_lse) outs.lse = TensorView<T>(buf_lse.data() + guard, Shape{c.batch, c.nq});
    Op::forward_into(in.views, lens, opt, outs);

    const AttentionResult<double> ref = Op::ref_forward(cast_double(in.views).args(), lens, opt);
    expect_close(outs.output, ref.output, tol.out, "written output vs ref", "b q d");
    if (give_w) expect_close(*outs.weights, ref.weights, tol.weights, "written weights vs ref");
    if (give_lse) expect_close(*outs.lse, ref.lse, tol.lse, "written lse vs ref", "b q");
    for (int64_t g = 0; g < guard; ++g) {
      EXPECT_TRUE(std::isnan(buf_out[static_cast<size_t>(g)]) &&
                  std::isnan(buf_out[static_cast<size_t>(guard + n_out + g)]))
          << "wrote outside the output buffer";
      EXPECT_TRUE(std::isnan(buf_w[static_cast<size_t>(g)]) &&
                  std::isnan(buf_w[static_cast<size_t>(guard + n_w + g)]))
          << "wrote outside the weights buffer";
      EXPECT_TRUE(std::isnan(buf_lse[static_cast<size_t>(g)]) &&
                  std::isnan(buf_lse[static_cast<size_t>(guard + n_lse + g)]))
          << "wrote outside the lse buffer";
    }
    if (!give_w) {
      for (const T x : buf_w) ASSERT_TRUE(std::isnan(x)) << "wrote weights that were not given";
    }
    if (!give_lse) {
      for (const T x : buf_lse) ASSERT_TRUE(std::isnan(x)) << "wrote an lse that was not given";
    }
  }
}

// Attention over disjoint key sets merges exactly into attention over all:
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
TYPED_TEST_P(AttentionContract, LseMergesDisjointKeySets) {
  QKV_CONTRACT_PROLOGUE();
  for (const Case& c : Op::lse_merge_cases()) {
    SCOPED_TRACE(Op::describe(c));
    const Inputs<Op, T> in(rng, c);
    // A random split: the first n1 keys of a random permutation, and the rest.
    std::vector<int64_t> perm(static_cast<size_t>(c.nk));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.engine());
    const int64_t n1 = rng.uniform_int(1, c.nk - 1);
    const int64_t sizes[2] = {n1, c.nk - n1};
    const int64_t key_dim = in.k.size(2);
    AttentionOptions opt;
    opt.return_lse = true;
    AttentionResult<T> part[2];
    for (int s = 0; s < 2; ++s) {
      Tensor<T> ks(Shape{c.batch, sizes[s], key_dim}), vs(Shape{c.batch, sizes[s], c.dv});
      for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t t = 0; t < sizes[s]; ++t) {
          const int64_t j = perm[static_cast<size_t>(s == 0 ? t : n1 + t)];
          for (int64_t d = 0; d < key_dim; ++d) ks(b, t, d) = in.k(b, j, d);
          for (int64_t d = 0; d < c.dv; ++d) vs(b, t, d) = in.v(b, j, d);
        }
      }
      Args<T> a = in.args();
      a.k = ks;
      a.v = vs;
      part[s] = Op::forward(a, {}, opt);
    }
    Tensor<double> merged(Shape{c.batch, c.nq, c.dv}), merged_lse(Shape{c.batch, c.nq});
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t i = 0; i < c.nq; ++i) {
        const double l0 = part[0].lse(b, i), l1 = part[1].lse(b, i);
        const double m = std::max(l0, l1);
        const double lse = m + std::log(std::exp(l0 - m) + std::exp(l1 - m));
        merged_lse(b, i) = lse;
        for (int64_t d = 0; d < c.dv; ++d) {
          merged(b, i, d) = std::exp(l0 - lse) * double(part[0].output(b, i, d)) +
                            std::exp(l1 - lse) * double(part[1].output(b, i, d));
        }
      }
    }
    const AttentionResult<T> full = Op::forward(in.args(), {}, opt);
    const AttentionResult<double> ref = Op::ref_forward(cast_double(in.args()).args(), {}, opt);
    expect_close(merged, full.output, tol.out, "merged output vs attention over all keys", "b q d");
    expect_close(merged_lse, full.lse, tol.lse, "merged lse vs attention over all keys", "b q");
    expect_close(merged, ref.output, tol.out, "merged output vs ref", "b q d");
    expect_close(merged_lse, ref.lse, tol.lse, "merged lse vs ref", "b q");
  }
}

// The same inputs and seed give bitwise-identical results with 1, 2 or 3
// threads, forward and backward.
TYPED_TEST_P(AttentionContract, DeterministicAcrossThreadCounts) {
  QKV_CONTRACT_PROLOGUE();
  const Case c = Op::determinism_case();
  SCOPED_TRACE(Op::describe(c));
  const Inputs<Op, T> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions opt = c.options(rng.next());
  const Tensor<T> d_out = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
  AttentionResult<T> r[3];
  Grads<T> g[3];
  for (int t = 0; t < 3; ++t) {
    const ThreadCount threads(t + 1);
    r[t] = Op::forward(in.views, lens, opt);
    g[t] = Op::backward(in.views, lens, opt, r[t], d_out);
  }
  for (int t = 1; t < 3; ++t) {
    SCOPED_TRACE("1 vs " + std::to_string(t + 1) + " threads");
    expect_bitwise_equal(r[0].output, r[t].output, "output", "b q d");
    expect_bitwise_equal(r[0].weights, r[t].weights, "weights");
    expect_bitwise_equal(r[0].lse, r[t].lse, "lse", "b q");
    for (size_t n = 0; n < g[0].size(); ++n) {
      const GradName& name = Op::grad_names()[n];
      expect_bitwise_equal(g[0][n], g[t][n], name.name, name.axes);
    }
  }
}

TYPED_TEST_P(AttentionContract, BackwardMatchesRefAndLoop) {
  QKV_CONTRACT_PROLOGUE();
  for (const Case& c : Op::backward_cases(rng)) {
    check_backward<Op, T>(rng, c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

REGISTER_TYPED_TEST_SUITE_P(AttentionContract, ChapterExample, FastMatchesRefAndLoopOverShapes,
                            ZeroLengthsAndFullLengths, MaskedKeysAreNeverRead, ZeroSizes, Dropout,
                            DropoutOnlyWhenTraining, StridedInputs, StridedValidLens,
                            WriteIntoCallerBuffers, LseMergesDisjointKeySets,
                            DeterministicAcrossThreadCounts, BackwardMatchesRefAndLoop);

// ---- gradients against finite differences (double only) -------------------------

template <class Op>
class AttentionGradient : public ::testing::Test {};
TYPED_TEST_SUITE_P(AttentionGradient);

// Every gradient against central differences of loss = sum(G * output), in
// double, through the fast and the reference backward.
template <class Op>
void check_finite_differences(Rng& rng, const Case& c) {
  SCOPED_TRACE(Op::describe(c));
  const Inputs<Op, double> in(rng, c);
  const ValidLens lens = in.valid_lens();
  const AttentionOptions opt = c.options(rng.next());
  const Tensor<double> g = random_tensor<double>(rng, {c.batch, c.nq, c.dv});
  const Args<double> args = in.args();
  const AttentionResult<double> fwd = Op::forward(args, lens, opt);
  const Grads<double> fast = Op::backward(args, lens, opt, fwd, g);
  const AttentionResult<double> rfwd = Op::ref_forward(args, lens, opt);
  const Grads<double> ref = Op::ref_backward(args, lens, opt, rfwd, g);

  // Hundreds of tiny calls: one thread spares the fork-join cost (the results
  // do not depend on the thread count; DeterministicAcrossThreadCounts).
  const ThreadCount one_thread(1);
  for (int n = 0; n < args.size(); ++n) {
    // The loss with input n replaced by x.
    auto loss = [&](const Tensor<double>& x) {
      Args<double> a = args;
      a[n] = x;
      return sum_product(Op::forward(a, lens, opt).output, g);
    };
    const Tensor<double> fd = numerical_gradient(loss, in[n]);
    const GradName& name = Op::grad_names()[static_cast<size_t>(n)];
    expect_close(fast[static_cast<size_t>(n)], fd, kFiniteDiff,
                 std::string("fast ") + name.name + " vs finite differences", name.axes);
    expect_close(ref[static_cast<size_t>(n)], fd, kFiniteDiff,
                 std::string("ref ") + name.name + " vs finite differences", name.axes);
  }
}

TYPED_TEST_P(AttentionGradient, FiniteDifferences) {
  using Op = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const Case& c : Op::finite_difference_cases()) check_finite_differences<Op>(rng, c);
}

REGISTER_TYPED_TEST_SUITE_P(AttentionGradient, FiniteDifferences);

struct FloatName {
  template <class Op>
  static std::string GetName(int) {
    return "float";
  }
};
struct DoubleName {
  template <class Op>
  static std::string GetName(int) {
    return "double";
  }
};

// ---- bad input (float arguments; the double forward too) --------------------------

template <class Op>
class AttentionErrors : public ::testing::Test {};
TYPED_TEST_SUITE_P(AttentionErrors);

TYPED_TEST_P(AttentionErrors, InputShapes) {
  using Op = TypeParam;
  const ErrorFixture<Op> f;
  const AttentionOptions opt;
  const char* fn = Op::kFunction;
  const int64_t dk = f.in.k.size(2);
  const Tensor<float> q2(Shape{3, 4}), k4(Shape{2, 5, dk, 1}), v2(Shape{5, 6});
  expect_forward_error<Op>(f.with(0, q2), {}, opt, {fn, "queries", "[3, 4]"});
  expect_forward_error<Op>(f.with(1, k4), {}, opt, {fn, "keys", k4.shape().str()});
  expect_forward_error<Op>(f.with(2, v2), {}, opt, {fn, "values", "[5, 6]"});
  // Batch mismatches: keys alone, keys and values together, values alone.
  const Tensor<float> k_batch8(Shape{8, 5, dk}), k_batch7(Shape{7, 5, dk}),
      v_batch7(Shape{7, 5, 6}), v_batch9(Shape{9, 5, 6});
  expect_forward_error<Op>(f.with(1, k_batch8), {}, opt, {fn, "keys", "8"});
  Args<float> both = f.with(1, k_batch7);
  both.v = v_batch7;
  expect_forward_error<Op>(both, {}, opt, {fn, "keys", "7"});
  expect_forward_error<Op>(f.with(2, v_batch9), {}, opt, {fn, "values", "9"});
  // Keys and values disagree on Nk.
  for (const int64_t nk : {8, 11}) {
    const Tensor<float> v_nk(Shape{2, nk, 6});
    expect_forward_error<Op>(f.with(2, v_nk), {}, opt, {fn, "values", std::to_string(nk), "5"});
  }
}

TYPED_TEST_P(AttentionErrors, ValidLens) {
  using Op = TypeParam;
  const ErrorFixture<Op> f;
  const AttentionOptions opt;
  const char* fn = Op::kFunction;
  const Args<float> a = f.in.args();
  // Wrong batch, wrong number of queries, wrong rank.
  const Tensor<int64_t> batch3(Shape{3}, std::vector<int64_t>{1, 1, 1}), batch4(Shape{4}, int64_t{1});
  expect_forward_error<Op>(a, batch3, opt, {fn, "valid_lens", "[3]"});
  expect_forward_error<Op>(a, batch4, opt, {fn, "valid_lens", "[4]"});
  const Tensor<int64_t> queries4(Shape{2, 4}, int64_t{1});
  const Tensor<int32_t> queries5(Shape{2, 5}, int32_t{1});
  expect_forward_error<Op>(a, queries4, opt, {fn, "valid_lens", "[2, 4]"});
  expect_forward_error<Op>(a, queries5, opt, {fn, "valid_lens", "[2, 5]"});
  const Tensor<int32_t> rank3(Shape{2, 3, 1}, int32_t{1});
  expect_forward_error<Op>(a, rank3, opt, {fn, "valid_lens", "[2, 3, 1]"});
  // Longer than Nk = 5, or negative; per batch and per query.
  const Tensor<int64_t> too_long(Shape{2}, std::vector<int64_t>{2, 6});
  const Tensor<int64_t> too_long_query(Shape{2, 3}, std::vector<int64_t>{0, 1, 2, 3, 4, 6});
  expect_forward_error<Op>(a, too_long, opt, {fn, "valid_lens", "6"});
  expect_forward_error<Op>(a, too_long_query, opt, {fn, "valid_lens", "6"});
  const Tensor<int32_t> negative(Shape{2}, std::vector<int32_t>{-3, 2});
  const Tensor<int32_t> negative_query(Shape{2, 3}, std::vector<int32_t>{1, 2, 3, 0, -1, 5});
  expect_forward_error<Op>(a, negative, opt, {fn, "valid_lens", "-3"});
  expect_forward_error<Op>(a, negative_query, opt, {fn, "valid_lens", "-1"});
}

TYPED_TEST_P(AttentionErrors, DropoutProbability) {
  using Op = TypeParam;
  const ErrorFixture<Op> f;
  for (const double p : {-0.1, -0.5, 1.01, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    AttentionOptions opt;
    opt.dropout_p = p;
    opt.training = true;
    expect_forward_error<Op>(f.in.args(), {}, opt, {Op::kFunction, "dropout"});
    expect_error([&] { Op::backward(f.in.args(), {}, opt, {f.out, f.lse}, f.d_out); },
                 {Op::kFunctionBackward, "dropout"});
  }
}

TYPED_TEST_P(AttentionErrors, WriteIntoBuffers) {
  using Op = TypeParam;
  const ErrorFixture<Op> f;
  const AttentionOptions opt;
  const char* fn = Op::kFunction;
  Tensor<float> out(Shape{2, 3, 6}), w(Shape{2, 3, 5});
  auto call = [&](const AttentionOutputs<float>& outs) {
    Op::forward_into(f.in.args(), {}, opt, outs);
  };
  for (const Shape& shape : {Shape{2, 3, 7}, Shape{3, 3, 6}}) {
    Tensor<float> bad(shape);
    expect_error([&] { call({bad.view(), std::nullopt, std::nullopt}); },
                 {fn, "output", shape.str()});
  }
  for (const Shape& shape : {Shape{2, 3, 4}, Shape{2, 3, 6}}) {
    Tensor<float> bad(shape);
    expect_error([&] { call({out.view(), bad.view(), std::nullopt}); },
                 {fn, "weights", shape.str()});
  }
  for (const Shape& shape : {Shape{2, 4}, Shape{3}}) {
    Tensor<float> bad(shape);
    expect_error([&] { call({out.view(), w.view(), bad.view()}); }, {fn, "lse", shape.str()});
    expect_error([&] { call({out.view(), std::nullopt, bad.view()}); }, {fn, "lse", shape.str()});
  }
  // A non-contiguous destination (every other element of a bigger buffer).
  std::vector<float> spread(2 * 3 * 6 * 2);
  const TensorView<float> strided_out(spread.data(), Shape{2, 3, 6}, Shape{36, 12, 2});
  expect_error([&] { call({strided_out, std::nullopt, std::nullopt}); }, {fn, "output"});
}

TYPED_TEST_P(AttentionErrors, Backward) {
  using Op = TypeParam;
  const ErrorFixture<Op> f;
  const AttentionOptions opt;
  const char* fn = Op::kFunctionBackward;
  const Args<float> a = f.in.args();
  const Tensor<float> bad_out(Shape{2, 3, 5});
  const Tensor<float> bad_lse[] = {Tensor<float>(Shape{2, 4}), Tensor<float>(Shape{3, 2})};
  const Tensor<float> bad_d_out[] = {Tensor<float>(Shape{2, 3, 7}), Tensor<float>(Shape{2, 4, 6})};
  for (const bool use_ref : {false, true}) {
    SCOPED_TRACE(use_ref ? "ref" : "fast");
    auto call = [&](ConstView<float> out, ConstView<float> lse, ConstView<float> d_out) {
      if (use_ref) {
        Op::ref_backward(a, {}, opt, {out, lse}, d_out);
      } else {
        Op::backward(a, {}, opt, {out, lse}, d_out);
      }
    };
    expect_error([&] { call(bad_out, f.lse, f.d_out); }, {fn, "output", "[2, 3, 5]"});
    for (const Tensor<float>& lse : bad_lse) {
      expect_error([&] { call(f.out, lse, f.d_out); }, {fn, "lse", lse.shape().str()});
    }
    expect_error([&] { call(f.out, ConstView<float>(), f.d_out); }, {fn, "lse"});
    for (const Tensor<float>& d_out : bad_d_out) {
      expect_error([&] { call(f.out, f.lse, d_out); }, {fn, "d_output", d_out.shape().str()});
    }
  }
  // The backward validates the inputs like the forward.
  const Tensor<int64_t> too_long(Shape{2}, std::vector<int64_t>{2, 6});
  expect_error([&] { Op::backward(a, too_long, opt, {f.out, f.lse}, f.d_out); },
               {fn, "valid_lens", "6"});
}

// The options each scoring function takes are its row of the table
// (qkv/scoring.h): the scale by its rule, masks and bias only where the row
// says, and the names its errors give are the row's.
TYPED_TEST_P(AttentionErrors, OptionsByTheTable) {
  using Op = TypeParam;
  const ErrorFixture<Op> f;
  const ScoringRules& rules = rules_of(Op::kScoring);
  EXPECT_EQ(rules.function, Op::kFunction);
  EXPECT_EQ(std::string(rules.function) + "_backward", Op::kFunctionBackward);
  // The forward (fast, ref, double) and the backward give the same error.
  const auto both = [&](const AttentionOptions& opt, std::string_view what,
                        std::string_view detail) {
    expect_forward_error<Op>(f.in.args(), {}, opt, {Op::kFunction, what, detail});
    expect_error([&] { Op::backward(f.in.args(), {}, opt, {f.out, f.lse}, f.d_out); },
                 {Op::kFunctionBackward, what, detail});
  };
  const double inf = std::numeric_limits<double>::infinity();
  AttentionOptions opt;
  switch (rules.scale) {
    case ScaleRule::kNone:
      opt.scale = 1.0;
      both(opt, "options.scale is set", "has no scale");
      break;
    case ScaleRule::kInverseSqrtDim:
      for (const double scale : {inf, -inf, std::numeric_limits<double>::quiet_NaN()}) {
        opt.scale = scale;
        both(opt, "options.scale", "is not finite");
      }
      break;
    case ScaleRule::kPositiveOne:
      for (const double scale : {0.0, -1.0, inf}) {
        opt.scale = scale;
        both(opt, "options.scale", "expected a finite number > 0");
      }
      break;
  }
  if (!rules.masks) {
    const Tensor<uint8_t> key_mask(Shape{2, 5}, uint8_t{1});
    const Tensor<float> bias(Shape{3, 5});
    AttentionOptions masked;
    masked.key_mask = key_mask.view();
    both(masked, "are for scaled dot-product attention", "takes valid_lens and causal");
    AttentionOptions biased;
    biased.bias = ConstView<float>(bias.view());
    both(biased, "are for scaled dot-product attention", "takes valid_lens and causal");
    AttentionOptions windowed;
    windowed.window_left = 2;
    both(windowed, "are for scaled dot-product attention", "takes valid_lens and causal");
  }
}

REGISTER_TYPED_TEST_SUITE_P(AttentionErrors, InputShapes, ValidLens, DropoutProbability,
                            WriteIntoBuffers, Backward, OptionsByTheTable);

// The table itself: one row per Scoring in the enum's order, found by its
// name, and the names messages list.
TEST(ScoringTable, RowsAreTheEnumInOrderAndFoundByName) {
  const std::span<const ScoringRules> table = scoring_table();
  for (size_t i = 0; i < table.size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(table[i].scoring), i);
    EXPECT_EQ(&rules_of(table[i].scoring), &table[i]);
    EXPECT_EQ(find_scoring(table[i].name), &table[i]);
  }
  EXPECT_EQ(find_scoring("gaussian"), nullptr);
  EXPECT_EQ(find_scoring(""), nullptr);
  EXPECT_EQ(find_scoring("Dot"), nullptr);
  EXPECT_EQ(scoring_names(), "dot, additive, bilinear or distance");
  EXPECT_EQ(scoring_names(/*over_store_only=*/true), "dot or distance");
  expect_error([&] { rules_of(static_cast<qkv::Scoring>(table.size())); },
               {"rules_of", "Scoring value " + std::to_string(table.size()) +
                                " is not a scoring function"});
}

// The whole contract for a scoring function given by its traits struct:
// Name/AttentionContract/{float,double}.*, Name/AttentionGradient/double.*
// and Name/AttentionErrors/float.*.
#define QKV_ATTENTION_CONTRACT(Name, Traits)                                                  \
  INSTANTIATE_TYPED_TEST_SUITE_P(Name, AttentionContract, ScoringTypes<Traits>, ElementNames); \
  INSTANTIATE_TYPED_TEST_SUITE_P(Name, AttentionGradient, ::testing::Types<Traits>, DoubleName); \
  INSTANTIATE_TYPED_TEST_SUITE_P(Name, AttentionErrors, ::testing::Types<Traits>, FloatName)

}  // namespace

// ---- each scoring function's cases ------------------------------------------------
//
// Lengths around the SIMD widths and block sizes; in a sweep the sizes of a
// case are varied together by the case's index n, so the sweep covers them all.

namespace {
const int64_t kSizes[] = {1, 3, 17, 64, 65, 129, 300};

// Scaled dot-product attention: D and Dv.
const int64_t kSdpaDims[] = {1, 2, 7, 16, 64};
const int64_t kSdpaValueDims[] = {3, 1, 16, 5, 33};

// Additive attention: Dq, Dk, H and Dv (Dq != Dk, H != Dq).
const int64_t kQueryDims[] = {1, 2, 7, 16, 20};
const int64_t kKeyDims[] = {2, 1, 5, 9, 3};
const int64_t kHidden[] = {8, 5, 1, 33, 16};
const int64_t kAdditiveValueDims[] = {3, 1, 16, 5, 4};

// `base` once per key count.
std::vector<Case> for_each_nk(const Case& base, std::initializer_list<int64_t> key_counts) {
  std::vector<Case> cases;
  for (const int64_t nk : key_counts) {
    cases.push_back(base);
    cases.back().nk = nk;
  }
  return cases;
}

// The cases with dropout p, in training.
std::vector<Case> with_dropout(std::vector<Case> cases, double p) {
  for (Case& c : cases) {
    c.dropout = p;
    c.training = true;
  }
  return cases;
}
}  // namespace

std::vector<Case> SdpaScoring::shape_sweep(Rng& rng) {
  std::vector<Case> cases;
  int n = 0;
  for (int ia = 0; ia < 7; ++ia) {
    for (int ib = 0; ib < 7; ++ib, ++n) {
      cases.push_back({.batch = n % 3 == 0 ? 1 : 2, .nq = kSizes[ia], .nk = kSizes[ib],
                       .dq = kSdpaDims[(ia + ib) % 5], .dv = kSdpaValueDims[(2 * ia + ib) % 5],
                       .lens_form = kAllLensForms[(ia + 2 * ib) % 3], .lens32 = n % 2 == 1,
                       .return_weights = n % 4 < 2, .return_lse = n % 2 == 0});
      if (n % 5 == 2) cases.back().scale = rng.uniform(0.05, 2.0);
    }
  }
  return cases;
}

std::vector<Case> SdpaScoring::masked_keys_cases() {
  return with_dropout(
      for_each_nk({.batch = 3, .nq = 6, .dq = 16, .dv = 5, .lens_form = LensForm::kPerBatch},
                  {5, 70, 300}),
      0.2);
}

std::vector<Case> SdpaScoring::dropout_cases() {
  std::vector<Case> cases;
  int n = 0;
  for (const double p : {0.1, 0.5, 0.9}) {
    for (const int64_t nk : {1, 17, 65, 129}) {
      cases.push_back({.nq = kSizes[n % 7], .nk = nk, .dq = kSdpaDims[n % 5],
                       .dv = kSdpaValueDims[n % 5], .lens_form = kAllLensForms[n % 3],
                       .dropout = p, .training = true, .return_weights = n % 2 == 0});
      if (n % 3 == 1) cases.back().scale = 0.8;
      ++n;
    }
  }
  return cases;
}

Case SdpaScoring::dropout_only_when_training_case() {
  return {.nq = 13, .nk = 70, .dq = 16, .dv = 8, .lens_form = LensForm::kPerQuery};
}

std::vector<Case> SdpaScoring::strided_cases() {
  std::vector<Case> cases;
  int n = 0;
  for (const Layout layout :
       {Layout::kStrided, Layout::kStridedReversed, Layout::kBroadcastValues}) {
    for (const int64_t nk : {1, 17, 65}) {
      cases.push_back({.batch = 3, .nq = kSizes[(n + 2) % 6], .nk = nk, .dq = kSdpaDims[n % 5],
                       .dv = kSdpaValueDims[n % 5], .lens_form = kAllLensForms[n % 3],
                       .lens32 = true, .dropout = n % 2 == 1 ? 0.3 : 0.0, .training = n % 2 == 1,
                       .layout = layout});
      ++n;
    }
  }
  return cases;
}

std::vector<Case> SdpaScoring::write_into_cases() {
  std::vector<Case> cases;
  int n = 0;
  for (const int64_t nk : {1, 17, 129}) {
    for (int which = 0; which < 4; ++which, ++n) {
      cases.push_back({.nq = kSizes[n % 5], .nk = nk, .dq = kSdpaDims[n % 5],
                       .dv = kSdpaValueDims[n % 5], .lens_form = kAllLensForms[n % 3],
                       .dropout = n % 2 ? 0.25 : 0.0, .training = true});
    }
  }
  return cases;
}

std::vector<Case> SdpaScoring::lse_merge_cases() {
  return for_each_nk({.batch = 2, .nq = 7, .dq = 16, .dv = 5}, {2, 5, 66, 200});
}

Case SdpaScoring::determinism_case() {
  return {.batch = 3, .nq = 129, .nk = 300, .dq = 64, .dv = 33,
          .lens_form = LensForm::kPerQuery, .dropout = 0.2, .training = true};
}

std::vector<Case> SdpaScoring::backward_cases(Rng& rng) {
  std::vector<Case> cases;
  const int64_t shapes[][2] = {{1, 1}, {3, 17}, {17, 3}, {64, 65}, {65, 129}, {129, 64}, {1, 300}};
  int n = 0;
  for (const auto& s : shapes) {
    for (int variant = 0; variant < 3; ++variant, ++n) {
      cases.push_back({.nq = s[0], .nk = s[1], .dq = kSdpaDims[n % 5],
                       .dv = kSdpaValueDims[(n + 1) % 5], .lens_form = kAllLensForms[variant],
                       .lens32 = n % 2 == 0, .dropout = n % 3 == 2 ? 0.3 : 0.0,
                       .training = n % 3 == 2,
                       .layout = n % 5 == 3 ? Layout::kStrided : Layout::kContiguous});
      if (n % 4 == 1) cases.back().scale = rng.uniform(0.1, 2.0);
    }
  }
  return cases;
}

std::vector<Case> SdpaScoring::finite_difference_cases() {
  using enum LensForm;
  return {
      {.nq = 3, .nk = 5, .dq = 4, .dv = 3},
      {.nq = 3, .nk = 5, .dq = 4, .dv = 3, .lens_form = kPerBatch},
      {.nq = 3, .nk = 5, .dq = 4, .dv = 3, .lens_form = kPerQuery},  // includes zeros
      {.nq = 3, .nk = 5, .dq = 4, .dv = 3, .dropout = 0.4, .training = true},
      {.nq = 1, .nk = 5, .dq = 7, .dv = 3, .scale = 0.9},
      {.nq = 3, .nk = 9, .dq = 4, .dv = 3, .lens_form = kPerQuery, .lens32 = true, .scale = 1.7,
       .dropout = 0.3, .training = true},
  };
}

std::vector<Case> AdditiveScoring::shape_sweep(Rng&) {
  std::vector<Case> cases;
  int n = 0;
  for (int ia = 0; ia < 7; ++ia) {
    for (int ib = 0; ib < 7; ++ib, ++n) {
      cases.push_back({.batch = n % 3 == 0 ? 1 : 2, .nq = kSizes[ia], .nk = kSizes[ib],
                       .dq = kQueryDims[(ia + ib) % 5], .dk = kKeyDims[(2 * ia + ib) % 5],
                       .dv = kAdditiveValueDims[(ia + 2 * ib) % 5],
                       .hidden = kHidden[(ia + 3 * ib) % 5], .wv_row = n % 2 == 0,
                       .lens_form = kAllLensForms[(ia + 2 * ib) % 3], .lens32 = n % 4 == 1,
                       .return_weights = n % 4 < 2, .return_lse = n % 2 == 1});
    }
  }
  return cases;
}

std::vector<Case> AdditiveScoring::masked_keys_cases() {
  return with_dropout(for_each_nk({.batch = 3, .nq = 6, .dq = 7, .dk = 4, .dv = 5, .hidden = 9,
                                   .lens_form = LensForm::kPerBatch},
                                  {5, 70, 200}),
                      0.2);
}

std::vector<Case> AdditiveScoring::dropout_cases() {
  std::vector<Case> cases;
  int n = 0;
  for (const double p : {0.1, 0.5, 0.9}) {
    for (const int64_t nk : {1, 17, 65}) {
      cases.push_back({.nq = kSizes[n % 6], .nk = nk, .dq = kQueryDims[n % 5],
                       .dk = kKeyDims[n % 5], .dv = kAdditiveValueDims[n % 5],
                       .hidden = kHidden[n % 5], .wv_row = n % 2 == 1,
                       .lens_form = kAllLensForms[n % 3], .dropout = p, .training = true});
      ++n;
    }
  }
  return cases;
}

Case AdditiveScoring::dropout_only_when_training_case() {
  // 20 lengths: some rows are not empty.
  return {.nq = 10, .nk = 40, .dq = 7, .dk = 5, .dv = 6, .hidden = 9,
          .lens_form = LensForm::kPerQuery};
}

std::vector<Case> AdditiveScoring::strided_cases() {
  std::vector<Case> cases;
  for (int n = 0; n < 6; ++n) {
    cases.push_back({.batch = 3, .nq = kSizes[n % 6], .nk = kSizes[(n + 3) % 6],
                     .dq = kQueryDims[n % 5], .dk = kKeyDims[n % 5],
                     .dv = kAdditiveValueDims[n % 5], .hidden = kHidden[n % 5],
                     .wv_row = n % 2 == 0, .lens_form = kAllLensForms[n % 3],
                     .dropout = n % 3 == 2 ? 0.3 : 0.0, .training = n % 3 == 2,
                     .layout = Layout::kStridedEach});
  }
  return cases;
}

std::vector<Case> AdditiveScoring::write_into_cases() {
  std::vector<Case> cases;
  for (int which = 0; which < 4; ++which) {
    cases.push_back({.nq = 5 + which, .nk = 17 + 16 * which, .dq = 6, .dk = 3, .dv = 4,
                     .hidden = 7, .lens_form = kAllLensForms[which % 3],
                     .dropout = which % 2 ? 0.25 : 0.0, .training = true});
  }
  return cases;
}

std::vector<Case> AdditiveScoring::lse_merge_cases() {
  return for_each_nk({.nq = 6, .dq = 5, .dk = 3, .dv = 4, .hidden = 7}, {2, 9, 70});
}

Case AdditiveScoring::determinism_case() {
  return {.batch = 3, .nq = 65, .nk = 129, .dq = 20, .dk = 9, .dv = 17, .hidden = 33,
          .lens_form = LensForm::kPerQuery, .dropout = 0.2, .training = true};
}

std::vector<Case> AdditiveScoring::backward_cases(Rng&) {
  std::vector<Case> cases;
  const int64_t shapes[][2] = {{1, 1}, {3, 17}, {17, 3}, {64, 65}, {65, 129}, {1, 300}};
  int n = 0;
  for (const auto& s : shapes) {
    for (int variant = 0; variant < 3; ++variant, ++n) {
      cases.push_back({.nq = s[0], .nk = s[1], .dq = kQueryDims[n % 5],
                       .dk = kKeyDims[(n + 2) % 5], .dv = kAdditiveValueDims[(n + 3) % 5],
                       .hidden = kHidden[(n + 1) % 5], .wv_row = n % 2 == 1,
                       .lens_form = kAllLensForms[variant], .lens32 = n % 3 == 0,
                       .dropout = n % 3 == 2 ? 0.3 : 0.0, .training = n % 3 == 2,
                       .layout = n % 4 == 3 ? Layout::kStridedEach : Layout::kContiguous});
    }
  }
  return cases;
}

std::vector<Case> AdditiveScoring::finite_difference_cases() {
  using enum LensForm;
  return {
      {.nq = 3, .nk = 4, .dq = 5, .dk = 3, .dv = 2, .hidden = 6},
      {.nq = 3, .nk = 4, .dq = 5, .dk = 3, .dv = 2, .hidden = 6, .wv_row = true,
       .lens_form = kPerBatch},
      {.nq = 3, .nk = 4, .dq = 5, .dk = 3, .dv = 2, .hidden = 1,
       .lens_form = kPerQuery},  // includes zeros
      {.nq = 3, .nk = 4, .dq = 5, .dk = 3, .dv = 2, .hidden = 6, .wv_row = true, .dropout = 0.4,
       .training = true},
      {.nq = 1, .nk = 1, .dq = 1, .dk = 1, .dv = 1, .hidden = 2},
      {.nq = 3, .nk = 7, .dq = 5, .dk = 3, .dv = 2, .hidden = 4, .lens_form = kPerQuery,
       .lens32 = true, .dropout = 0.3, .training = true},
  };
}
// ---- the instantiations: one line per scoring function ------------------------------

namespace {

QKV_ATTENTION_CONTRACT(Sdpa, SdpaScoring);
QKV_ATTENTION_CONTRACT(Additive, AdditiveScoring);
QKV_ATTENTION_CONTRACT(Bilinear, BilinearScoring);
QKV_ATTENTION_CONTRACT(Distance, DistanceScoring);

}  // namespace
}  // namespace qkv::test
