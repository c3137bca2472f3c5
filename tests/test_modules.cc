// GoogleTest suite of the modules (qkv/modules.h): DotProductAttention and
// AdditiveAttention against the function calls they wrap (forward, stored
// weights, backward, the dropout seed sequence), parameter initialisation,
// gradient accumulation, sgd_step, a small training run, and bad use;
// MultiHeadAttention against the book's computation with transposes (the
// heads folded into the batch, key heads repeated for grouped queries) in
// float64 plain loops around the reference attention.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention_testing.h"
#include "test_util.h"
#include "tolerances.h"

namespace qkv::test {
namespace {

template <class T>
class Modules : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Modules, ElementTypes, TypeNames);

template <class T>
constexpr Tol kDotOut = tol_for<T>(kSdpa, kSdpaDouble);
template <class T>
constexpr Tol kAddOut = tol_for<T>(kAdditive, kAdditiveDouble);
template <class T>
constexpr Tol kWeights = tol_for<T>(kSoftmax, kSoftmaxDouble);
template <class T>
constexpr Tol kDotGrad = tol_for<T>(kSdpaBackward, kSdpaBackwardDouble);
template <class T>
constexpr Tol kAddGrad = tol_for<T>(kAdditiveBackward, kAdditiveBackwardDouble);

// The chapter's keys, values and valid lengths: keys ones (2, 10, 2), values
// arange(40) as (1, 10, 4) repeated for 2 batches, valid_lens [2, 6].
template <class T>
struct ChapterData {
  Tensor<T> keys{Shape{2, 10, 2}, T(1)};
  Tensor<T> values{Shape{2, 10, 4}};
  Tensor<int64_t> lens{Shape{2}, std::vector<int64_t>{2, 6}};
  // Means of rows 0-1 and 0-5 of arange(40).reshape(10, 4).
  Tensor<double> expected = as_tensor({2, 1, 4}, {2, 3, 4, 5, 10, 11, 12, 13});
  Tensor<double> expected_w{Shape{2, 1, 10}};
  ChapterData() {
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t j = 0; j < 10; ++j) {
        for (int64_t d = 0; d < 4; ++d) values(b, j, d) = static_cast<T>(4 * j + d);
      }
    }
    for (int64_t j = 0; j < 2; ++j) expected_w(0, 0, j) = 0.5;
    for (int64_t j = 0; j < 6; ++j) expected_w(1, 0, j) = 1.0 / 6.0;
  }
};

TYPED_TEST(Modules, ChapterExampleAdditive) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const ChapterData<T> data;
  const Tensor<T> queries = normal_tensor<T>(rng, {2, 1, 20});
  AdditiveAttention<T> attention(2, 20, 8, 0.1, rng.next());
  attention.eval();
  const Tensor<T> out = attention.forward(queries, data.keys, data.values, data.lens);
  expect_close(out, data.expected, tol_for<T>(kAverage, kPoolingDouble), "output", "b q d");
  expect_close(attention.attention_weights(), data.expected_w, kWeights<T>, "attention_weights");
}

TYPED_TEST(Modules, ChapterExampleDotProduct) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const ChapterData<T> data;
  const Tensor<T> queries = normal_tensor<T>(rng, {2, 1, 2});
  DotProductAttention<T> attention(0.5, rng.next());
  attention.eval();
  const Tensor<T> out = attention.forward(queries, data.keys, data.values, data.lens);
  expect_close(out, data.expected, tol_for<T>(kAverage, kPoolingDouble), "output", "b q d");
  expect_close(attention.attention_weights(), data.expected_w, kWeights<T>, "attention_weights");
}

TYPED_TEST(Modules, StartInTrainingMode) {
  using T = TypeParam;
  DotProductAttention<T> dot(0.1);
  AdditiveAttention<T> add(3, 4, 5, 0.1);
  EXPECT_TRUE(dot.training());
  EXPECT_TRUE(add.training());
  dot.eval();
  add.eval();
  EXPECT_FALSE(dot.training());
  EXPECT_FALSE(add.training());
  dot.train();
  add.train(true);
  EXPECT_TRUE(dot.training());
  EXPECT_TRUE(add.training());
  dot.train(false);
  add.train(false);
  EXPECT_FALSE(dot.training());
  EXPECT_FALSE(add.training());
}

// A random problem: queries (B, Nq, Dq), keys (B, Nk, Dk), values (B, Nk, Dv)
// and per-query valid lengths (with zeros).
template <class T>
struct Problem {
  int64_t batch = 2, nq = 5, nk = 33, dq = 6, dk = 6, dv = 4;
  Tensor<T> q, k, v;
  OwnedLens lens;
  Problem(Rng& rng, int64_t dq_, int64_t dk_, LensForm form = LensForm::kPerQuery)
      : dq(dq_), dk(dk_) {
    q = random_tensor<T>(rng, {batch, nq, dq});
    k = random_tensor<T>(rng, {batch, nk, dk});
    v = random_tensor<T>(rng, {batch, nk, dv});
    lens = make_lens(rng, form, false, batch, nq, nk);
  }
  ValidLens valid_lens() const { return lens.get(); }
};

AttentionOptions options(double dropout, bool training, uint64_t seed) {
  AttentionOptions o;
  o.dropout_p = dropout;
  o.training = training;
  o.seed = seed;
  o.return_weights = true;
  o.return_lse = true;
  return o;
}

// Forward equals the function; the n-th training forward (counting from 0)
// uses seed + n, eval forwards use no dropout and do not count.
TYPED_TEST(Modules, DotProductForwardMatchesFunction) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Problem<T> pb(rng, 6, 6);
  const ValidLens lens = pb.valid_lens();
  const double p = 0.4;
  const uint64_t module_seed = rng.next() >> 1;
  DotProductAttention<T> attention(p, module_seed);
  struct Step {
    bool training;
    uint64_t seed;
  };
  const Step steps[] = {{true, module_seed},
                        {false, 0},
                        {true, module_seed + 1},
                        {false, 0},
                        {true, module_seed + 2}};
  int n = 0;
  for (const Step& step : steps) {
    SCOPED_TRACE("forward " + std::to_string(n++) + (step.training ? " (training)" : " (eval)"));
    attention.train(step.training);
    const Tensor<T> out = attention.forward(pb.q, pb.k, pb.v, lens);
    const AttentionResult<T> want =
        scaled_dot_product_attention(pb.q, pb.k, pb.v, lens, options(p, step.training, step.seed));
    const AttentionResult<double> ref = ref::scaled_dot_product_attention(
        cast<double>(pb.q), cast<double>(pb.k), cast<double>(pb.v), lens,
        options(p, step.training, step.seed));
    expect_close(out, want.output, kDotOut<T>, "module output vs function", "b q d");
    expect_close(out, ref.output, kDotOut<T>, "module output vs ref", "b q d");
    expect_close(attention.attention_weights(), ref.weights, kWeights<T>,
                 "attention_weights vs ref weights");
  }
}

TYPED_TEST(Modules, AdditiveForwardMatchesFunction) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Problem<T> pb(rng, 7, 3);
  const ValidLens lens = pb.valid_lens();
  const double p = 0.3;
  const uint64_t module_seed = rng.next() >> 1;
  AdditiveAttention<T> attention(pb.dk, pb.dq, 9, p, module_seed);
  struct Step {
    bool training;
    uint64_t seed;
  };
  const Step steps[] = {{true, module_seed}, {false, 0}, {true, module_seed + 1}};
  int n = 0;
  for (const Step& step : steps) {
    SCOPED_TRACE("forward " + std::to_string(n++) + (step.training ? " (training)" : " (eval)"));
    attention.train(step.training);
    const Tensor<T> out = attention.forward(pb.q, pb.k, pb.v, lens);
    const AttentionOptions opt = options(p, step.training, step.seed);
    const AttentionResult<T> want = additive_attention(
        pb.q, pb.k, pb.v, {attention.w_q(), attention.w_k(), attention.w_v()}, lens, opt);
    const AttentionResult<double> ref =
        ref::additive_attention(cast<double>(pb.q), cast<double>(pb.k), cast<double>(pb.v),
                                {cast<double>(attention.w_q()), cast<double>(attention.w_k()),
                                 cast<double>(attention.w_v())},
                                lens, opt);
    expect_close(out, want.output, kAddOut<T>, "module output vs function", "b q d");
    expect_close(out, ref.output, kAddOut<T>, "module output vs ref", "b q d");
    expect_close(attention.attention_weights(), ref.weights, kWeights<T>,
                 "attention_weights vs ref weights");
  }
}

// eval() turns dropout off; in training mode each forward draws a new mask.
TYPED_TEST(Modules, DropoutFollowsMode) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Problem<T> pb(rng, 5, 5, LensForm::kNone);
  DotProductAttention<T> dot(0.5, rng.next() >> 1);
  AdditiveAttention<T> add(pb.dk, pb.dq, 6, 0.5, rng.next() >> 1);
  const Tensor<T> dot_a = dot.forward(pb.q, pb.k, pb.v);
  const Tensor<T> dot_b = dot.forward(pb.q, pb.k, pb.v);
  EXPECT_GT(max_abs_diff(dot_a, dot_b), 1e-3) << "two training forwards used the same mask";
  const Tensor<T> add_a = add.forward(pb.q, pb.k, pb.v);
  const Tensor<T> add_b = add.forward(pb.q, pb.k, pb.v);
  EXPECT_GT(max_abs_diff(add_a, add_b), 1e-3) << "two training forwards used the same mask";

  dot.eval();
  add.eval();
  const AttentionOptions none;
  expect_close(dot.forward(pb.q, pb.k, pb.v),
               scaled_dot_product_attention(pb.q, pb.k, pb.v, {}, none).output, kDotOut<T>,
               "dot eval vs no dropout", "b q d");
  expect_close(
      add.forward(pb.q, pb.k, pb.v),
      additive_attention(pb.q, pb.k, pb.v, {add.w_q(), add.w_k(), add.w_v()}, {}, none).output,
      kAddOut<T>, "additive eval vs no dropout", "b q d");
}

// Backward equals the function backward, also after the caller overwrote the
// inputs and lengths it passed to forward (the module keeps copies).
TYPED_TEST(Modules, DotProductBackwardMatchesFunction) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  for (const bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "eval");
    Problem<T> pb(rng, 8, 8);
    pb.lens = make_lens(rng, LensForm::kPerQuery, training, pb.batch, pb.nq, pb.nk);  // int32 too
    const Problem<T> saved = pb;
    const uint64_t module_seed = rng.next() >> 1;
    DotProductAttention<T> attention(0.25, module_seed);
    attention.train(training);
    const Tensor<T> out = attention.forward(pb.q, pb.k, pb.v, pb.valid_lens());
    const Tensor<T> d_out = random_tensor<T>(rng, out.shape());
    for (T& x : pb.q.values()) x = std::numeric_limits<T>::quiet_NaN();
    for (T& x : pb.k.values()) x = std::numeric_limits<T>::quiet_NaN();
    for (T& x : pb.v.values()) x = std::numeric_limits<T>::quiet_NaN();
    for (int64_t& len : pb.lens.lens64.values()) len = pb.nk + 1000;
    for (int32_t& len : pb.lens.lens32.values()) len = -1;
    const DotProductGrads<T> got = attention.backward(d_out);

    const ValidLens lens = saved.valid_lens();
    const AttentionOptions opt = options(0.25, training, module_seed);
    const AttentionResult<T> fwd =
        scaled_dot_product_attention(saved.q, saved.k, saved.v, lens, opt);
    const DotProductGrads<T> want = scaled_dot_product_attention_backward(
        saved.q, saved.k, saved.v, lens, opt, {fwd.output, fwd.lse}, d_out);
    expect_close(got.d_queries, want.d_queries, kDotGrad<T>, "d_queries", "b q d");
    expect_close(got.d_keys, want.d_keys, kDotGrad<T>, "d_keys", "b k d");
    expect_close(got.d_values, want.d_values, kDotGrad<T>, "d_values", "b k d");
  }
}

TYPED_TEST(Modules, AdditiveBackwardMatchesFunctionAndAccumulates) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  Problem<T> pb(rng, 7, 4);
  const Problem<T> saved = pb;
  const uint64_t module_seed = rng.next() >> 1;
  const int64_t hidden = 10;
  AdditiveAttention<T> attention(pb.dk, pb.dq, hidden, 0.2, module_seed);
  const ValidLens lens = saved.valid_lens();

  // Forward 0 (training, seed + 0), backward with d_out1; the caller's inputs
  // are overwritten in between.
  const Tensor<T> out = attention.forward(pb.q, pb.k, pb.v, pb.valid_lens());
  for (T& x : pb.q.values()) x = std::numeric_limits<T>::quiet_NaN();
  for (T& x : pb.v.values()) x = std::numeric_limits<T>::quiet_NaN();
  for (int64_t& len : pb.lens.lens64.values()) len = -1;
  const Tensor<T> d_out1 = random_tensor<T>(rng, out.shape());
  const Tensor<T> d_out2 = random_tensor<T>(rng, out.shape());
  const AdditiveGrads<T> g1 = attention.backward(d_out1);

  const AttentionOptions opt = options(0.2, true, module_seed);
  const AttentionResult<T> fwd = additive_attention(
      saved.q, saved.k, saved.v, {attention.w_q(), attention.w_k(), attention.w_v()}, lens, opt);
  const AdditiveGrads<T> want1 = additive_attention_backward(
      saved.q, saved.k, saved.v, {attention.w_q(), attention.w_k(), attention.w_v()}, lens, opt,
      {fwd.output, fwd.lse}, d_out1);
  const AdditiveGrads<T> want2 = additive_attention_backward(
      saved.q, saved.k, saved.v, {attention.w_q(), attention.w_k(), attention.w_v()}, lens, opt,
      {fwd.output, fwd.lse}, d_out2);
  ASSERT_EQ(g1.d_w_v.shape(), Shape({1, hidden})) << "d_w_v takes the module's w_v shape";
  expect_close(g1.d_queries, want1.d_queries, kAddGrad<T>, "d_queries", "b q d");
  expect_close(g1.d_keys, want1.d_keys, kAddGrad<T>, "d_keys", "b k d");
  expect_close(g1.d_values, want1.d_values, kAddGrad<T>, "d_values", "b k d");
  expect_close(g1.d_w_q, want1.d_w_q, kAddGrad<T>, "d_w_q of the call", "h d");
  expect_close(g1.d_w_k, want1.d_w_k, kAddGrad<T>, "d_w_k of the call", "h d");
  expect_close(g1.d_w_v, want1.d_w_v, kAddGrad<T>, "d_w_v of the call");
  // A fresh module's accumulated gradients are this call's.
  expect_close(attention.d_w_q(), want1.d_w_q, kAddGrad<T>, "accumulated d_w_q", "h d");
  expect_close(attention.d_w_k(), want1.d_w_k, kAddGrad<T>, "accumulated d_w_k", "h d");
  expect_close(attention.d_w_v(), want1.d_w_v, kAddGrad<T>, "accumulated d_w_v");

  // A second backward of the same forward adds its gradients.
  const AdditiveGrads<T> g2 = attention.backward(d_out2);
  expect_close(g2.d_w_q, want2.d_w_q, kAddGrad<T>, "d_w_q of the second call", "h d");
  Tensor<double> sum_q(want1.d_w_q.shape()), sum_k(want1.d_w_k.shape()), sum_v(want1.d_w_v.shape());
  for (size_t e = 0; e < sum_q.values().size(); ++e) {
    sum_q.values()[e] = double(want1.d_w_q.values()[e]) + double(want2.d_w_q.values()[e]);
  }
  for (size_t e = 0; e < sum_k.values().size(); ++e) {
    sum_k.values()[e] = double(want1.d_w_k.values()[e]) + double(want2.d_w_k.values()[e]);
  }
  for (size_t e = 0; e < sum_v.values().size(); ++e) {
    sum_v.values()[e] = double(want1.d_w_v.values()[e]) + double(want2.d_w_v.values()[e]);
  }
  expect_close(attention.d_w_q(), sum_q, kAddGrad<T>, "d_w_q after two backwards", "h d");
  expect_close(attention.d_w_k(), sum_k, kAddGrad<T>, "d_w_k after two backwards", "h d");
  expect_close(attention.d_w_v(), sum_v, kAddGrad<T>, "d_w_v after two backwards");

  attention.zero_grad();
  const Tensor<T>* grads[] = {&attention.d_w_q(), &attention.d_w_k(), &attention.d_w_v()};
  const Tensor<T>* params[] = {&attention.w_q(), &attention.w_k(), &attention.w_v()};
  for (int n = 0; n < 3; ++n) {
    ASSERT_EQ(grads[n]->shape(), params[n]->shape()) << "gradient " << n << " after zero_grad";
    expect_close(*grads[n], Tensor<double>(params[n]->shape()), kExact, "zeroed gradient");
  }
  // After zero_grad, a backward gives this call's gradients again.
  attention.backward(d_out2);
  expect_close(attention.d_w_q(), want2.d_w_q, kAddGrad<T>, "d_w_q after zero_grad", "h d");
}

TYPED_TEST(Modules, AdditiveInitialisation) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const int64_t key_size = 12, query_size = 20, hidden = 64;
  const uint64_t s = rng.next() >> 1;
  const AdditiveAttention<T> a(key_size, query_size, hidden, 0.0, s);
  const AdditiveAttention<T> same(key_size, query_size, hidden, 0.0, s);
  const AdditiveAttention<T> other(key_size, query_size, hidden, 0.0, s + 1);
  ASSERT_EQ(a.w_q().shape(), Shape({hidden, query_size}));
  ASSERT_EQ(a.w_k().shape(), Shape({hidden, key_size}));
  ASSERT_EQ(a.w_v().shape(), Shape({1, hidden}));

  const Tensor<T>* mine[] = {&a.w_q(), &a.w_k(), &a.w_v()};
  const Tensor<T>* twin[] = {&same.w_q(), &same.w_k(), &same.w_v()};
  const Tensor<T>* different[] = {&other.w_q(), &other.w_k(), &other.w_v()};
  const int64_t fan_in[] = {query_size, key_size, hidden};
  const char* names[] = {"w_q", "w_k", "w_v"};
  for (int n = 0; n < 3; ++n) {
    SCOPED_TRACE(names[n]);
    const double bound = 1.0 / std::sqrt(double(fan_in[n]));
    double lo = 0.0, hi = 0.0, sum = 0.0, sum_sq = 0.0;
    for (const T x : mine[n]->values()) {
      ASSERT_LE(std::abs(double(x)), bound) << "outside ±1/sqrt(fan_in)";
      lo = std::min(lo, double(x));
      hi = std::max(hi, double(x));
      sum += double(x);
      sum_sq += double(x) * double(x);
    }
    // Uniform on [-bound, bound]: mean 0, variance bound^2 / 3. For the 64
    // draws of w_v (the fewest) a false alarm has probability < 1e-7: no draw
    // below -bound/2 is 0.75^64, the mean's margin is 6 and the mean
    // square's 5 standard errors.
    const double count = double(mine[n]->numel());
    EXPECT_LT(lo, -0.5 * bound);
    EXPECT_GT(hi, 0.5 * bound);
    EXPECT_LT(std::abs(sum / count), 0.45 * bound);
    EXPECT_NEAR(sum_sq / count, bound * bound / 3.0, 0.2 * bound * bound);
    expect_bitwise_equal(*mine[n], *twin[n], "same seed, same parameters");
    EXPECT_GT(max_abs_diff(*mine[n], *different[n]), 0.0) << "different seeds, same parameters";
  }
}

template <class T>
void expect_sgd_update(const Tensor<T>& before, const Tensor<T>& grad, double lr,
                       const Tensor<T>& after, const char* what) {
  ASSERT_EQ(after.shape(), before.shape()) << what;
  const double eps = std::numeric_limits<T>::epsilon();
  for (size_t e = 0; e < before.values().size(); ++e) {
    const double p = before.values()[e], g = grad.values()[e];
    const double want = p - lr * g;
    // One rounding of the update (plus one of lr * g in T).
    const double allowed = 2 * eps * (std::abs(p) + std::abs(lr * g));
    ASSERT_LE(std::abs(double(after.values()[e]) - want), allowed)
        << what << " element " << e << ": got " << format_value(after.values()[e]) << ", want "
        << want << " (param " << p << ", grad " << g << ", lr " << lr << ")";
  }
}

TYPED_TEST(Modules, SgdStep) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  // The free function.
  const Tensor<T> param = random_tensor<T>(rng, {3, 7});
  const Tensor<T> grad = random_tensor<T>(rng, {3, 7}, -5.0, 5.0);
  const double lr = rng.uniform(0.01, 0.5);
  Tensor<T> updated = param;
  sgd_step(updated, grad, lr);
  expect_sgd_update(param, grad, lr, updated, "sgd_step");
  Tensor<T> wrong(Shape{7, 3});
  expect_error([&] { sgd_step(wrong, grad, lr); }, {"sgd_step", "[7, 3]", "[3, 7]"});

  // The module: every parameter moves by -lr * its accumulated gradient.
  const Problem<T> pb(rng, 5, 3);
  AdditiveAttention<T> attention(pb.dk, pb.dq, 6, 0.0, rng.next() >> 1);
  const Tensor<T> out = attention.forward(pb.q, pb.k, pb.v, pb.valid_lens());
  attention.backward(random_tensor<T>(rng, out.shape()));
  attention.backward(random_tensor<T>(rng, out.shape()));
  const Tensor<T> wq = attention.w_q(), wk = attention.w_k(), wv = attention.w_v();
  const Tensor<T> gq = attention.d_w_q(), gk = attention.d_w_k(), gv = attention.d_w_v();
  attention.sgd_step(lr);
  expect_sgd_update(wq, gq, lr, attention.w_q(), "w_q");
  expect_sgd_update(wk, gk, lr, attention.w_k(), "w_k");
  expect_sgd_update(wv, gv, lr, attention.w_v(), "w_v");
  // The step leaves the gradients alone.
  expect_bitwise_equal(attention.d_w_q(), gq, "d_w_q after sgd_step", "h d");
}

// Fitting a student's output to a teacher's (same architecture, other seed)
// by SGD (lr 0.5) on 0.5 * |out - target|^2 lowers the loss.
TYPED_TEST(Modules, TrainingReducesLoss) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Problem<T> pb(rng, 4, 3, LensForm::kNone);
  const ValidLens lens = pb.valid_lens();
  const uint64_t s = rng.next() >> 1;
  AdditiveAttention<T> teacher(pb.dk, pb.dq, 8, 0.0, s);
  AdditiveAttention<T> student(pb.dk, pb.dq, 8, 0.0, s + 1);
  // A sharper teacher so the target differs clearly from a uniform average.
  for (T& x : teacher.w_v().values()) x *= T(8);
  teacher.eval();
  const Tensor<T> target = teacher.forward(pb.q, pb.k, pb.v, lens);
  auto loss_of = [&](const Tensor<T>& out, Tensor<T>& d_out) {
    double loss = 0.0;
    for (size_t e = 0; e < out.values().size(); ++e) {
      const double diff = double(out.values()[e]) - double(target.values()[e]);
      loss += 0.5 * diff * diff;
      d_out.values()[e] = static_cast<T>(diff);
    }
    return loss;
  };
  Tensor<T> d_out(target.shape());
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 50; ++step) {
    student.zero_grad();
    const Tensor<T> out = student.forward(pb.q, pb.k, pb.v, lens);
    last = loss_of(out, d_out);
    if (step == 0) first = last;
    student.backward(d_out);
    student.sgd_step(0.5);
  }
  SCOPED_TRACE("loss " + std::to_string(first) + " -> " + std::to_string(last));
  EXPECT_GT(first, 0.0);
  // Over 3000 random runs the final/first ratio had median 0.04 and maximum
  // 0.94 (a few problems sit on a plateau); a wrong-signed gradient or a step
  // that does not move the parameters leaves it >= 1.
  EXPECT_LT(last, first) << "50 SGD steps did not lower the loss";
}

TYPED_TEST(Modules, BadUse) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const Problem<T> pb(rng, 4, 4, LensForm::kNone);
  const Tensor<T> d_out(Shape{pb.batch, pb.nq, pb.dv});
  const Tensor<T> bad_d_out(Shape{pb.batch, pb.nq, pb.dv + 3});

  DotProductAttention<T> dot;
  expect_error([&] { dot.backward(d_out); }, {"backward"});
  dot.forward(pb.q, pb.k, pb.v);
  expect_error([&] { dot.backward(bad_d_out); }, {"d_output", "[2, 5, 7]"});

  AdditiveAttention<T> add(pb.dk, pb.dq, 5);
  expect_error([&] { add.backward(d_out); }, {"backward"});
  add.forward(pb.q, pb.k, pb.v);
  expect_error([&] { add.backward(bad_d_out); }, {"d_output", "[2, 5, 7]"});
  // The forward checks shapes like the function: a feature size of 13 where
  // the module's W_q and the queries say 4.
  const Tensor<T> q_wrong = random_tensor<T>(rng, {pb.batch, pb.nq, 13});
  expect_error([&] { add.forward(q_wrong, pb.k, pb.v); }, {"13", "4"});
  const Tensor<T> k_wrong = random_tensor<T>(rng, {pb.batch, pb.nk, 13});
  expect_error([&] { dot.forward(pb.q, k_wrong, pb.v); }, {"13", "4"});

  // A dropout probability outside [0, 1] is rejected at construction or at
  // the first training forward.
  for (const double p : {-0.2, 1.5}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    expect_error(
        [&] {
          DotProductAttention<T> m(p);
          m.forward(pb.q, pb.k, pb.v);
        },
        {"dropout"});
    expect_error(
        [&] {
          AdditiveAttention<T> m(pb.dk, pb.dq, 5, p);
          m.forward(pb.q, pb.k, pb.v);
        },
        {"dropout"});
  }
}

// ---- MultiHeadAttention --------------------------------------------------------------

// y (rows, out) = x (rows, in) wᵀ + b in double.
std::vector<double> linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<double>& w, const std::vector<double>& b,
                           int64_t out) {
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double sum = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * w[o * in + i];
      y[r * out + o] = sum;
    }
  return y;
}

template <class T>
std::vector<double> doubles(const Tensor<T>& t) {
  return std::vector<double>(t.values().begin(), t.values().end());
}

// The book's transpose_qkv: (B, N, count d) -> (B H, N, d) with head h of
// batch b at b H + h, reading head h / (H / count) (count = H: each its own).
Tensor<double> fold(const std::vector<double>& x, int64_t batch, int64_t n, int64_t count,
                    int64_t heads, int64_t d) {
  Tensor<double> out(Shape{batch * heads, n, d});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < d; ++c)
          out(b * heads + h, i, c) = x[(b * n + i) * count * d + (h / (heads / count)) * d + c];
  return out;
}

// The book's transpose_output: (B H, N, d) -> (B, N, H d); with `count` <
// H, head h is added into head h / (H / count) (the gradient of fold).
std::vector<double> unfold(const Tensor<double>& x, int64_t batch, int64_t count, int64_t heads) {
  const int64_t n = x.size(1), d = x.size(2);
  std::vector<double> out(batch * n * count * d, 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < d; ++c)
          out[(b * n + i) * count * d + (h / (heads / count)) * d + c] += x(b * heads + h, i, c);
  return out;
}

struct MhaCase {
  int64_t batch, nq, nk, query_size, key_size, value_size, hiddens, heads, kv_heads;
  bool bias;
  double dropout;
  LensForm lens;
  Causal causal;
};

// forward and backward of the module against the book's computation with
// transposes in double around ref::scaled_dot_product_attention, the same
// parameters and dropout seed.
template <class T>
void check_mha(Rng& rng, const MhaCase& c) {
  SCOPED_TRACE("B=" + std::to_string(c.batch) + " Nq=" + std::to_string(c.nq) +
               " Nk=" + std::to_string(c.nk) + " hiddens=" + std::to_string(c.hiddens) +
               " heads=" + std::to_string(c.heads) + " kv_heads=" + std::to_string(c.kv_heads) +
               " bias=" + std::to_string(c.bias) + " dropout=" + std::to_string(c.dropout));
  const uint64_t module_seed = rng.next();
  MultiHeadAttention<T> mha(c.query_size, c.key_size, c.value_size, c.hiddens, c.heads, c.dropout,
                            c.bias, c.kv_heads, module_seed);
  const Tensor<T> queries = random_tensor<T>(rng, {c.batch, c.nq, c.query_size});
  const Tensor<T> keys = random_tensor<T>(rng, {c.batch, c.nk, c.key_size});
  const Tensor<T> values = random_tensor<T>(rng, {c.batch, c.nk, c.value_size});
  const OwnedLens lens = make_lens(rng, c.lens, false, c.batch, c.nq, c.nk, 0.0);
  const Tensor<T> out = mha.forward(queries, keys, values, lens.get(), c.causal);
  ASSERT_EQ(out.shape(), (Shape{c.batch, c.nq, c.hiddens}));

  const int64_t d = c.hiddens / c.heads, kv = c.kv_heads == 0 ? c.heads : c.kv_heads;
  const MultiHeadParams<T>& p = mha.params();
  const auto q_proj = linear(doubles(queries), c.batch * c.nq, c.query_size, doubles(p.w_q),
                             doubles(p.b_q), c.hiddens);
  const auto k_proj = linear(doubles(keys), c.batch * c.nk, c.key_size, doubles(p.w_k),
                             doubles(p.b_k), kv * d);
  const auto v_proj = linear(doubles(values), c.batch * c.nk, c.value_size, doubles(p.w_v),
                             doubles(p.b_v), kv * d);
  const Tensor<double> q3 = fold(q_proj, c.batch, c.nq, c.heads, c.heads, d);
  const Tensor<double> k3 = fold(k_proj, c.batch, c.nk, kv, c.heads, d);
  const Tensor<double> v3 = fold(v_proj, c.batch, c.nk, kv, c.heads, d);
  // d2l's repeat_interleave of the lengths.
  Tensor<int64_t> lens3;
  if (c.lens != LensForm::kNone) {
    const bool per_query = c.lens == LensForm::kPerQuery;
    lens3 = Tensor<int64_t>(per_query ? Shape{c.batch * c.heads, c.nq} : Shape{c.batch * c.heads});
    for (int64_t bh = 0; bh < c.batch * c.heads; ++bh)
      for (int64_t i = 0; i < (per_query ? c.nq : 1); ++i)
        lens3.data()[bh * (per_query ? c.nq : 1) + i] = lens.at(bh / c.heads, i, c.nk);
  }
  AttentionOptions o;
  o.dropout_p = c.dropout;
  o.training = true;
  o.seed = module_seed;  // the first training forward's mask
  o.causal = c.causal;
  const AttentionResult<double> att = ref::scaled_dot_product_attention(q3, k3, v3,
                                                                        as_valid_lens(lens3), o);
  const auto joined = unfold(att.output, c.batch, c.heads, c.heads);
  const auto want = linear(joined, c.batch * c.nq, c.hiddens, doubles(p.w_o), doubles(p.b_o),
                           c.hiddens);
  const Tol tol = tol_for<T>(Tol{.atol = 2e-5, .rtol = 1e-4}, Tol{.atol = 1e-12, .rtol = 1e-10});
  ASSERT_TRUE(expect_close(out, Tensor<double>(out.shape(), want), tol, "output"));
  // attention_weights: (B, H, Nq, Nk), the folded weights.
  ASSERT_EQ(mha.attention_weights().shape(), (Shape{c.batch, c.heads, c.nq, c.nk}));
  expect_close(Tensor<T>::copy_of(ConstView<T>(mha.attention_weights().data(),
                                               Shape{c.batch * c.heads, c.nq, c.nk})),
               att.weights, tol_for<T>(kSoftmax, kSoftmaxDouble), "attention_weights");

  // Backward: d_joined = g W_o, the reference attention's backward on the
  // folded heads, then each projection's.
  const Tensor<T> g = random_tensor<T>(rng, {c.batch, c.nq, c.hiddens});
  const MultiHeadGrads<T> got = mha.backward(g);
  const int64_t rows_q = c.batch * c.nq, rows_k = c.batch * c.nk;
  std::vector<double> d_joined(rows_q * c.hiddens, 0.0), d_w_o(c.hiddens * c.hiddens, 0.0),
      d_b_o(c.hiddens, 0.0);
  const auto gd = doubles(g), w_o = doubles(p.w_o);
  for (int64_t r = 0; r < rows_q; ++r)
    for (int64_t o2 = 0; o2 < c.hiddens; ++o2) {
      d_b_o[o2] += gd[r * c.hiddens + o2];
      for (int64_t i = 0; i < c.hiddens; ++i) {
        d_joined[r * c.hiddens + i] += gd[r * c.hiddens + o2] * w_o[o2 * c.hiddens + i];
        d_w_o[o2 * c.hiddens + i] += gd[r * c.hiddens + o2] * joined[r * c.hiddens + i];
      }
    }
  const Tensor<double> d_out3 = fold(d_joined, c.batch, c.nq, c.heads, c.heads, d);
  const DotProductGrads<double> g3 = ref::scaled_dot_product_attention_backward(
      q3, k3, v3, as_valid_lens(lens3), o, {att.output, att.lse}, d_out3);
  struct Projection {
    const char* name;
    std::vector<double> d_proj, x;
    int64_t rows, in, out;
    const Tensor<T>*w, *got_dx, *got_dw, *got_db;
  };
  const Projection projections[] = {
      {"queries", unfold(g3.d_queries, c.batch, c.heads, c.heads), doubles(queries), rows_q,
       c.query_size, c.hiddens, &p.w_q, &got.d_queries, &mha.grads().w_q, &mha.grads().b_q},
      {"keys", unfold(g3.d_keys, c.batch, kv, c.heads), doubles(keys), rows_k, c.key_size, kv * d,
       &p.w_k, &got.d_keys, &mha.grads().w_k, &mha.grads().b_k},
      {"values", unfold(g3.d_values, c.batch, kv, c.heads), doubles(values), rows_k,
       c.value_size, kv * d, &p.w_v, &got.d_values, &mha.grads().w_v, &mha.grads().b_v}};
  const Tol grad_tol =
      tol_for<T>(Tol{.atol = 1e-4, .rtol = 1e-4}, Tol{.atol = 1e-11, .rtol = 1e-9});
  for (const Projection& pr : projections) {
    SCOPED_TRACE(pr.name);
    std::vector<double> dx(pr.rows * pr.in, 0.0), dw(pr.out * pr.in, 0.0), db(pr.out, 0.0);
    const auto w = doubles(*pr.w);
    for (int64_t r = 0; r < pr.rows; ++r)
      for (int64_t o2 = 0; o2 < pr.out; ++o2) {
        const double gr = pr.d_proj[r * pr.out + o2];
        db[o2] += gr;
        for (int64_t i = 0; i < pr.in; ++i) {
          dx[r * pr.in + i] += gr * w[o2 * pr.in + i];
          dw[o2 * pr.in + i] += gr * pr.x[r * pr.in + i];
        }
      }
    expect_close(*pr.got_dx, Tensor<double>(pr.got_dx->shape(), dx), grad_tol, "d_input");
    expect_close(*pr.got_dw, Tensor<double>(pr.got_dw->shape(), dw), grad_tol, "d_w");
    if (c.bias) expect_close(*pr.got_db, Tensor<double>(Shape{pr.out}, db), grad_tol, "d_b");
  }
  expect_close(mha.grads().w_o, Tensor<double>(Shape{c.hiddens, c.hiddens}, d_w_o), grad_tol,
               "d_w_o");
  if (c.bias) expect_close(mha.grads().b_o, Tensor<double>(Shape{c.hiddens}, d_b_o), grad_tol, "d_b_o");
}

TYPED_TEST(Modules, MultiHeadAttentionIsTheBooksWithoutTransposes) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  const MhaCase cases[] = {
      {2, 4, 6, 100, 100, 100, 100, 5, 0, false, 0.0, LensForm::kPerBatch, Causal::kNone},
      {2, 7, 9, 6, 5, 4, 12, 4, 2, true, 0.0, LensForm::kPerQuery, Causal::kNone},
      {3, 5, 5, 8, 8, 8, 16, 8, 1, false, 0.3, LensForm::kNone, Causal::kTopLeft},
      {1, 300, 520, 16, 24, 8, 64, 4, 4, true, 0.1, LensForm::kPerBatch, Causal::kBottomRight},
      {2, 1, 700, 32, 32, 32, 64, 8, 2, false, 0.0, LensForm::kPerBatch, Causal::kNone},
  };
  for (const MhaCase& c : cases) {
    check_mha<TypeParam>(rng, c);
    if (::testing::Test::HasFailure()) return;
  }
}

TYPED_TEST(Modules, MultiHeadAttentionAccumulatesAndSteps) {
  using T = TypeParam;
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  Rng rng(seed);
  MultiHeadAttention<T> mha(6, 5, 4, 12, 4, 0.0, true, 2, rng.next());
  const Tensor<T> q = random_tensor<T>(rng, {2, 3, 6}), k = random_tensor<T>(rng, {2, 7, 5}),
                  v = random_tensor<T>(rng, {2, 7, 4}), g = random_tensor<T>(rng, {2, 3, 12});
  mha.forward(q, k, v);
  mha.backward(g);
  const MultiHeadParams<T> once = mha.grads();
  mha.forward(q, k, v);
  mha.backward(g);
  for (const auto& [a, b] : {std::pair{&mha.grads().w_q, &once.w_q}, {&mha.grads().w_o, &once.w_o},
                             {&mha.grads().b_k, &once.b_k}}) {
    Tensor<T> twice(b->shape());
    for (int64_t e = 0; e < b->numel(); ++e) twice.data()[e] = 2 * b->data()[e];
    expect_close(*a, twice, tol_for<T>(Tol{.atol = 1e-6, .rtol = 1e-6},
                                       Tol{.atol = 1e-14, .rtol = 1e-14}), "twice the gradient");
  }
  const Tensor<T> before = mha.params().w_v;
  mha.sgd_step(0.5);
  for (int64_t e = 0; e < before.numel(); ++e) {
    ASSERT_EQ(mha.params().w_v.data()[e],
              static_cast<T>(before.data()[e] - static_cast<T>(0.5) * mha.grads().w_v.data()[e]));
  }
  mha.zero_grad();
  for (const T x : mha.grads().w_q.values()) ASSERT_EQ(x, T(0));
}

TYPED_TEST(Modules, MultiHeadAttentionBadUse) {
  using T = TypeParam;
  expect_error([] { MultiHeadAttention<T>(4, 4, 4, 10, 4); },
               {"MultiHeadAttention", "num_hiddens = 10 is not a multiple of num_heads = 4"});
  expect_error([] { MultiHeadAttention<T>(4, 4, 4, 12, 4, 0.0, false, 3); },
               {"num_heads = 4 is not a multiple of num_kv_heads = 3"});
  expect_error([] { MultiHeadAttention<T>(4, 4, 4, 12, 0); }, {"num_heads = 0"});
  expect_error([] { MultiHeadAttention<T>(-1, 4, 4, 12, 4); }, {"sizes must be >= 0"});
  expect_error([] { MultiHeadAttention<T>(4, 4, 4, 12, 4, 1.5); }, {"dropout"});
  MultiHeadAttention<T> mha(4, 3, 2, 8, 2);
  const Tensor<T> q(Shape{2, 5, 4}), k(Shape{2, 6, 3}), v(Shape{2, 6, 2});
  expect_error([&] { mha.backward(Tensor<T>(Shape{2, 5, 8})); },
               {"MultiHeadAttention::backward", "call forward first"});
  expect_error([&] { mha.forward(Tensor<T>(Shape{2, 5, 3}), k, v); },
               {"MultiHeadAttention::forward", "queries has shape [2, 5, 3]",
                "(B, Nq, query_size) with the last size 4"});
  expect_error([&] { mha.forward(q, k, Tensor<T>(Shape{2, 7, 2})); },
               {"must share B, and keys and values Nk"});
  mha.forward(q, k, v);
  expect_error([&] { mha.backward(Tensor<T>(Shape{2, 5, 9})); },
               {"d_output has shape [2, 5, 9]; expected [2, 5, 8]"});
}

}  // namespace
}  // namespace qkv::test
