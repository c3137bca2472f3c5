// GoogleTest suite of distance attention's own behaviour (qkv/attention.h);
// the contract every scoring function meets is in test_attention.cc. Here:
// rows far from the origin (the centred fast path against a float64 loop of
// |q - k|^2, and the uncentred dot form failing on the same inputs), the
// centre taken over the keys some query sees, causal masking, and the
// options' errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention_suite.h"
#include "attention_testing.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Distance : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Distance, ElementTypes, TypeNames);

template <class T>
constexpr Tols kTol = tols<DistanceScoring, T>();

// Queries and keys at offset + uniform noise in [-1, 1) on every coordinate.
template <class T>
Tensor<T> far_tensor(Rng& rng, const Shape& shape, double offset) {
  Tensor<T> x = random_tensor<T>(rng, shape);
  for (T& e : x.values()) e = static_cast<T>(offset + double(e));
  return x;
}

// Keys and queries ~1000 from the origin (|x|^2 ~ 1.6e7 at D = 16): the
// float32 fast path matches a float64 loop that forms |q - k|^2 from the
// differences as closely as rows at the origin do, forward and backward.
TYPED_TEST(Distance, FarFromTheOriginMatchesLoop) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const double offset : {1000.0, -3000.0}) {
    const Case c{.batch = 2,
                 .nq = 33,
                 .nk = 129,
                 .dq = 16,
                 .dv = 5,
                 .lens_form = LensForm::kPerQuery,
                 .scale = 0.7};
    SCOPED_TRACE(DistanceScoring::describe(c) + ", offset " + std::to_string(offset));
    Inputs<DistanceScoring, T> in(rng, c);
    in.q = far_tensor<T>(rng, in.q.shape(), offset);
    in.k = far_tensor<T>(rng, in.k.shape(), offset);
    in.views = in.args();
    const AttentionOptions opt = c.options(rng.next());
    const NaiveForward loop = DistanceScoring::naive_forward(in.views, in.valid_lens(), opt);
    const AttentionResult<T> fast = DistanceScoring::forward(in.views, in.valid_lens(), opt);
    expect_close(fast.output, as_tensor({c.batch, c.nq, c.dv}, loop.out), kTol<T>.out,
                 "output vs loop", "b q d");
    expect_close(fast.weights, as_tensor({c.batch, c.nq, c.nk}, loop.weights), kTol<T>.weights,
                 "weights vs loop");
    expect_close(fast.lse, as_tensor({c.batch, c.nq}, loop.lse), kTol<T>.lse, "lse vs loop", "b q");
    const Tensor<T> g = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
    const Grads<T> grads = DistanceScoring::backward(in.views, in.valid_lens(), opt, fast, g);
    const std::vector<std::vector<double>> want =
        DistanceScoring::naive_backward(in.views, in.valid_lens(), opt, g.view());
    for (size_t n = 0; n < grads.size(); ++n) {
      const GradName& name = DistanceScoring::grad_names()[n];
      expect_close(grads[n], as_tensor(grads[n].shape(), want[n]), kTol<T>.grad, name.name,
                   name.axes);
    }
  }
}

// What centring buys: the same float32 inputs through the uncentred dot form
// scale (q.k - |k|^2/2) (scaled dot-product attention with that bias per key)
// lose the weights entirely, while distance_attention keeps them.
TEST(DistanceFarFromOrigin, UncentredDotFormFails) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t batch = 1, nq = 20, nk = 50, d = 16;
  const Tensor<float> q = far_tensor<float>(rng, {batch, nq, d}, 1000.0);
  const Tensor<float> k = far_tensor<float>(rng, {batch, nk, d}, 1000.0);
  const Tensor<float> v = random_tensor<float>(rng, {batch, nk, 3});
  AttentionOptions opt;
  opt.return_weights = true;
  const NaiveForward loop = naive_distance<float>(q, k, v, {}, 1.0, {});
  const Tensor<double> want = as_tensor({batch, nq, nk}, loop.weights);

  Tensor<float> bias(Shape{batch, 1, nk});
  for (int64_t j = 0; j < nk; ++j) {
    float norm = 0;  // |k|^2 in float, as the naive dot form forms it
    for (int64_t c = 0; c < d; ++c) norm += k(0, j, c) * k(0, j, c);
    bias(0, 0, j) = -0.5f * norm;
  }
  AttentionOptions dot = opt;
  dot.scale = 1.0;
  dot.bias = ConstView<float>(bias);
  const AttentionResult<float> naive = scaled_dot_product_attention(q, k, v, {}, dot);
  const AttentionResult<float> ours = distance_attention(q, k, v, {}, opt);
  const double naive_err = max_abs_diff(naive.weights, want);
  const double our_err = max_abs_diff(ours.weights, want);
  std::cout << "weights 1000 from the origin, max |error| vs float64 loop: centred " << our_err
            << ", uncentred dot form " << naive_err << "\n";
  EXPECT_GT(naive_err, 0.05) << "the uncentred form was expected to fail here";
  EXPECT_LT(our_err, 1e-5);
}

// The centre is the mean of the keys some query of the batch element sees:
// NaN keys past every query's length (per-query lengths) change nothing.
TYPED_TEST(Distance, KeysNoQuerySeesAreNeverRead) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Case c{.batch = 3, .nq = 7, .nk = 40, .dq = 5, .dv = 4, .lens_form = LensForm::kPerQuery};
  Inputs<DistanceScoring, T> in(rng, c);
  for (int64_t& len : in.lens.lens64.values()) len = std::min<int64_t>(len, 30);
  const AttentionOptions opt = c.options(0);
  const AttentionResult<T> clean = DistanceScoring::forward(in.views, in.valid_lens(), opt);
  const Tensor<T> g = random_tensor<T>(rng, {c.batch, c.nq, c.dv});
  const Grads<T> g_clean = DistanceScoring::backward(in.views, in.valid_lens(), opt, clean, g);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 30; j < c.nk; ++j) {
      for (int64_t e = 0; e < c.dq; ++e) in.k(b, j, e) = std::numeric_limits<T>::quiet_NaN();
    }
  }
  in.views = in.args();
  const AttentionResult<T> r = DistanceScoring::forward(in.views, in.valid_lens(), opt);
  expect_close(r.output, cast<double>(clean.output), kExact, "output, NaN keys unseen", "b q d");
  expect_close(r.lse, cast<double>(clean.lse), kExact, "lse, NaN keys unseen", "b q");
  const Grads<T> gr = DistanceScoring::backward(in.views, in.valid_lens(), opt, r, g);
  for (size_t n = 0; n < gr.size(); ++n) {
    expect_close(gr[n], cast<double>(g_clean[n]), kExact, DistanceScoring::grad_names()[n].name);
  }
}

// Causal masking (top-left and bottom-right) is valid lengths capped per
// query: fast and ref against the float64 loop with the capped lengths.
TYPED_TEST(Distance, CausalMatchesLoop) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  check_causal<DistanceScoring, TypeParam>(rng, {.batch = 2,
                                                 .nq = 17,
                                                 .nk = 65,
                                                 .dq = 7,
                                                 .dv = 3,
                                                 .scale = 1.3,
                                                 .dropout = 0.2,
                                                 .training = true});
}

// ---- bad input (the rest is in test_attention.cc's AttentionErrors) ------------

constexpr const char* kFn = DistanceScoring::kFunction;
constexpr const char* kFnBackward = DistanceScoring::kFunctionBackward;

TEST(DistanceErrors, Scale) {
  const ErrorFixture<DistanceScoring> f;
  const Tensors<float>& in = f.in;
  for (const double s : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE("scale " + std::to_string(s));
    AttentionOptions opt;
    opt.scale = s;
    expect_forward_error<DistanceScoring>(in.args(), {}, opt, {kFn, "options.scale", "> 0"});
    expect_error(
        [&] {
          distance_attention_backward(in.q, in.k, in.v, {}, opt, {f.out, f.lse}, f.d_out);
        },
        {kFnBackward, "options.scale"});
  }
}

TEST(DistanceErrors, MasksAndBias) {
  const ErrorFixture<DistanceScoring> f;
  const Tensor<uint8_t> mask(Shape{3, 5}, uint8_t{1});
  AttentionOptions masked;
  masked.mask = mask;
  expect_forward_error<DistanceScoring>(f.in.args(), {}, masked, {kFn, "mask", "distance"});
  const Tensor<float> bias(Shape{2, 1, 5});
  AttentionOptions biased;
  biased.bias = ConstView<float>(bias);
  expect_forward_error<DistanceScoring>(f.in.args(), {}, biased, {kFn, "bias"});
  AttentionOptions grad;
  grad.want_bias_grad = true;
  expect_forward_error<DistanceScoring>(f.in.args(), {}, grad, {kFn, "bias"});
  // Keys of another feature size than the queries.
  const Tensor<float> k3(Shape{2, 5, 3});
  expect_forward_error<DistanceScoring>(f.with(1, k3), {}, {}, {kFn, "keys", "D = 3", "D = 4"});
}

}  // namespace
}  // namespace qkv::test
