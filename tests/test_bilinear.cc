// GoogleTest suite of bilinear attention's own behaviour (qkv/attention.h);
// the contract every scoring function meets is in test_attention.cc. Here:
// W = I is scaled dot-product attention with scale 1, causal masking against
// the float64 loop (forward and backward), the W gradient by finite
// differences on larger shapes, and the parameter's and options' errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_suite.h"
#include "attention_testing.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Bilinear : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Bilinear, ElementTypes, TypeNames);

template <class T>
constexpr Tols kTol = tols<BilinearScoring, T>();

// With W = I (Dq = Dk) the scores are q.k: scaled dot-product attention with
// scale 1, forward and backward.
TYPED_TEST(Bilinear, IdentityIsDotProductAttention) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Tensor<T> q = random_tensor<T>(rng, {2, 9, 6}), k = random_tensor<T>(rng, {2, 70, 6}),
                  v = random_tensor<T>(rng, {2, 70, 5}), g = random_tensor<T>(rng, {2, 9, 5});
  Tensor<T> eye(Shape{6, 6});
  for (int64_t c = 0; c < 6; ++c) eye(c, c) = T(1);
  const Tensor<int64_t> lens(Shape{2, 9}, std::vector<int64_t>{0, 1, 5, 17, 64, 65, 70, 3, 2, 70,
                                                               69, 33, 1, 0, 8, 9, 10, 11});
  AttentionOptions opt;
  opt.return_weights = opt.return_lse = true;
  opt.dropout_p = 0.3;
  opt.training = true;
  opt.seed = rng.next();
  const AttentionResult<T> got = bilinear_attention(q, k, v, eye, lens, opt);
  AttentionOptions dot = opt;
  dot.scale = 1.0;
  const AttentionResult<T> want = scaled_dot_product_attention(q, k, v, lens, dot);
  expect_close(got.output, cast<double>(want.output), kTol<T>.out, "output", "b q d");
  expect_close(got.weights, cast<double>(want.weights), kTol<T>.weights, "weights");
  expect_close(got.lse, cast<double>(want.lse), kTol<T>.lse, "lse", "b q");
  const BilinearGrads<T> gb =
      bilinear_attention_backward(q, k, v, eye, lens, opt, {got.output, got.lse}, g);
  const DotProductGrads<T> gd =
      scaled_dot_product_attention_backward(q, k, v, lens, dot, {want.output, want.lse}, g);
  expect_close(gb.d_queries, cast<double>(gd.d_queries), kTol<T>.grad, "d_queries", "b q d");
  expect_close(gb.d_keys, cast<double>(gd.d_keys), kTol<T>.grad, "d_keys", "b k d");
  expect_close(gb.d_values, cast<double>(gd.d_values), kTol<T>.grad, "d_values", "b k d");
  // dW = sum_b Q_bᵀ d(q W)_b with d(q W) = dQ when W = I.
  Tensor<double> dw(Shape{6, 6});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 9; ++i) {
      for (int64_t c = 0; c < 6; ++c) {
        for (int64_t e = 0; e < 6; ++e)
          dw(c, e) += double(q(b, i, c)) * double(gd.d_queries(b, i, e));
      }
    }
  }
  expect_close(gb.d_w, dw, kTol<T>.grad, "d_w", "c e");
}

// Causal masking (top-left and bottom-right) is valid lengths capped per
// query: fast and ref against the float64 loop with the capped lengths.
TYPED_TEST(Bilinear, CausalMatchesLoop) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  check_causal<BilinearScoring, TypeParam>(rng, {.batch = 2,
                                                 .nq = 17,
                                                 .nk = 65,
                                                 .dq = 7,
                                                 .dk = 5,
                                                 .dv = 3,
                                                 .dropout = 0.2,
                                                 .training = true});
}

// dW against central differences in double on shapes past the kernels' block
// sizes, per-query lengths, causal, dropout.
TEST(BilinearGradient, WByFiniteDifferences) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Case c{.batch = 2,
               .nq = 19,
               .nk = 70,
               .dq = 5,
               .dk = 3,
               .dv = 4,
               .lens_form = LensForm::kPerQuery,
               .dropout = 0.25,
               .training = true};
  const Inputs<BilinearScoring, double> in(rng, c);
  AttentionOptions opt = c.options(rng.next());
  opt.causal = Causal::kBottomRight;
  const Tensor<double> g = random_tensor<double>(rng, {c.batch, c.nq, c.dv});
  const Args<double> a = in.args();
  const AttentionResult<double> fwd = BilinearScoring::forward(a, in.valid_lens(), opt);
  const Grads<double> grads = BilinearScoring::backward(a, in.valid_lens(), opt, fwd, g);
  const Tensor<double> fd = numerical_gradient(
      [&](const Tensor<double>& w) {
        Args<double> aw = a;
        aw.params[0] = w;
        return sum_product(BilinearScoring::forward(aw, in.valid_lens(), opt).output, g);
      },
      in.params[0]);
  expect_close(grads[3], fd, kFiniteDiff, "d_w vs finite differences", "c e");
  EXPECT_GT(max_abs_diff(fd, Tensor<double>(fd.shape())), 1e-3) << "a trivial dW proves nothing";
}

// ---- bad input (the rest is in test_attention.cc's AttentionErrors) ------------

constexpr const char* kFn = BilinearScoring::kFunction;
constexpr const char* kFnBackward = BilinearScoring::kFunctionBackward;

TEST(BilinearErrors, WShape) {
  const ErrorFixture<BilinearScoring> f;  // queries (2, 3, 4), keys (2, 5, 3): W (4, 3)
  const AttentionOptions opt;
  const Tensor<float> w_t(Shape{3, 4}), w_dq(Shape{5, 3}), w_rank(Shape{12}),
      w_rank3(Shape{1, 4, 3});
  expect_forward_error<BilinearScoring>(f.with(3, w_t), {}, opt, {kFn, "w", "[3, 4]", "[4, 3]"});
  expect_forward_error<BilinearScoring>(f.with(3, w_dq), {}, opt, {kFn, "w", "[5, 3]", "Dq = 4"});
  expect_forward_error<BilinearScoring>(f.with(3, w_rank), {}, opt, {kFn, "w", "[12]", "(Dq, Dk)"});
  expect_forward_error<BilinearScoring>(f.with(3, w_rank3), {}, opt, {kFn, "w", "[1, 4, 3]"});
  expect_error(
      [&] {
        const Args<float> a = f.with(3, w_t);
        bilinear_attention_backward(a.q, a.k, a.v, a.params[0], {}, opt, {f.out, f.lse}, f.d_out);
      },
      {kFnBackward, "w", "[3, 4]"});
}

// No scale (W carries it), and none of scaled dot-product attention's masks.
TEST(BilinearErrors, Options) {
  const ErrorFixture<BilinearScoring> f;
  const Tensors<float>& in = f.in;
  AttentionOptions scaled;
  scaled.scale = 0.5;
  expect_forward_error<BilinearScoring>(in.args(), {}, scaled, {kFn, "scale"});
  expect_error(
      [&] {
        bilinear_attention_backward(in.q, in.k, in.v, in.params[0], {}, scaled, {f.out, f.lse},
                                    f.d_out);
      },
      {kFnBackward, "scale"});
  const Tensor<uint8_t> key_mask(Shape{2, 5}, uint8_t{1});
  AttentionOptions masked;
  masked.key_mask = key_mask;
  expect_forward_error<BilinearScoring>(in.args(), {}, masked, {kFn, "key_mask", "bilinear"});
  AttentionOptions windowed;
  windowed.window_left = 2;
  expect_forward_error<BilinearScoring>(in.args(), {}, windowed, {kFn, "window"});
  const Tensor<float> bias(Shape{3, 5});
  AttentionOptions biased;
  biased.bias = ConstView<float>(bias);
  expect_forward_error<BilinearScoring>(in.args(), {}, biased, {kFn, "bias"});
}

}  // namespace
}  // namespace qkv::test
