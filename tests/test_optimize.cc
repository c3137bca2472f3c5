// Tests of the bandwidth search's minimisers (src/regression/optimize.h): BFGS,
// Nelder-Mead and the golden-section search find the minimum of smooth test
// functions from random starts, never end worse than they start, and skip
// +inf points.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "regression/optimize.h"
#include "test_util.h"

namespace qkv::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// sum_c a_c (theta_c - centre_c)^2 + its gradient: an ill-conditioned bowl.
struct Bowl {
  std::vector<double> centre, a;
  double operator()(const std::vector<double>& theta, std::vector<double>* grad) const {
    double f = 0.0;
    if (grad) grad->assign(theta.size(), 0.0);
    for (size_t c = 0; c < theta.size(); ++c) {
      const double d = theta[c] - centre[c];
      f += a[c] * d * d;
      if (grad) (*grad)[c] = 2.0 * a[c] * d;
    }
    return f;
  }
};

TEST(Optimize, BfgsFindsTheMinimumOfABowl) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(-3.0, 3.0);
  for (size_t p : {1, 2, 5}) {
    Bowl bowl;
    BestPoint best;
    for (size_t c = 0; c < p; ++c) {
      bowl.centre.push_back(uniform(rng));
      bowl.a.push_back(std::pow(10.0, static_cast<double>(c) / 2.0));  // condition up to 100
      best.theta.push_back(uniform(rng));
    }
    const double f0 = bowl(best.theta, nullptr);
    best.f = f0;
    const int iterations = minimize_bfgs(bowl, best);
    EXPECT_GT(iterations, 0);
    EXPECT_LE(iterations, 200);
    EXPECT_LE(best.f, f0);
    for (size_t c = 0; c < p; ++c) {
      EXPECT_NEAR(best.theta[c], bowl.centre[c], 1e-6) << "p=" << p << " c=" << c;
    }
  }
}

TEST(Optimize, BfgsStaysAtAStationaryStart) {
  const Bowl bowl{{0.5, -1.0}, {1.0, 4.0}};
  BestPoint best;
  best.theta = bowl.centre;
  EXPECT_EQ(minimize_bfgs(bowl, best), 0);
  EXPECT_EQ(best.theta, bowl.centre);
  EXPECT_EQ(best.f, 0.0);
}

TEST(Optimize, BfgsNeverTakesAnInfinitePoint) {
  // Outside theta < 1 the objective is +inf (a bandwidth out of range); the
  // minimum of the bowl, at 2, lies there: the search ends inside, below 1.
  const Bowl bowl{{2.0}, {1.0}};
  const Objective f = [&](const std::vector<double>& theta, std::vector<double>* grad) {
    if (!(theta[0] < 1.0)) {
      if (grad) grad->assign(1, 0.0);
      return kInf;
    }
    return bowl(theta, grad);
  };
  BestPoint best;
  best.theta = {-1.0};
  best.f = f(best.theta, nullptr);
  minimize_bfgs(f, best);
  EXPECT_LT(best.theta[0], 1.0);
  EXPECT_GT(best.theta[0], 0.5);
  EXPECT_LT(best.f, 9.0);
}

TEST(Optimize, GoldenSectionFindsTheMinimumAlongOneCoordinate) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  const Bowl bowl{{uniform(rng), uniform(rng)}, {1.0, 3.0}};
  BestPoint best;
  best.theta = {0.0, 5.0};
  best.f = bowl(best.theta, nullptr);
  golden_section_search(bowl, best, 0, -1.0, 1.0);
  EXPECT_NEAR(best.theta[0], bowl.centre[0], 1e-7);
  EXPECT_EQ(best.theta[1], 5.0);  // the other coordinate stays
}

TEST(Optimize, GoldenSectionKeepsABetterStart) {
  // The bracket [2, 3] holds nothing better than the start at the minimum.
  const Bowl bowl{{0.0}, {1.0}};
  BestPoint best;
  best.theta = {0.0};
  best.f = 0.0;
  golden_section_search(bowl, best, 0, 2.0, 3.0);
  EXPECT_EQ(best.theta[0], 0.0);
  EXPECT_EQ(best.f, 0.0);
}

TEST(Optimize, NelderMeadFindsTheMinimumOfABowl) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(-2.0, 2.0);
  for (size_t p : {1, 2, 4}) {
    Bowl bowl;
    std::vector<double> start;
    for (size_t c = 0; c < p; ++c) {
      bowl.centre.push_back(uniform(rng));
      bowl.a.push_back(std::pow(10.0, static_cast<double>(c) / 2.0));
      start.push_back(uniform(rng));
    }
    BestPoint best;
    const int evals = minimize_nelder_mead(bowl, start, best, 5000);
    EXPECT_GT(evals, static_cast<int>(p));
    EXPECT_LE(evals, 5000 + static_cast<int>(p) + 1);  // a shrink may finish its vertices
    EXPECT_LE(best.f, bowl(start, nullptr));
    for (size_t c = 0; c < p; ++c) {
      EXPECT_NEAR(best.theta[c], bowl.centre[c], 1e-4) << "p=" << p << " c=" << c;
    }
  }
}

TEST(Optimize, NelderMeadStopsAtItsBudgetAndSkipsInfinitePoints) {
  // +inf for theta_0 > 0.5 (x > e^0.5): the bowl's minimum at 2 lies there.
  const Bowl bowl{{2.0, -1.0}, {1.0, 1.0}};
  int calls = 0;
  const Objective f = [&](const std::vector<double>& theta, std::vector<double>* grad) {
    ++calls;
    if (!(theta[0] <= 0.5)) return kInf;
    return bowl(theta, grad);
  };
  BestPoint best;
  const int evals = minimize_nelder_mead(f, {0.0, 0.0}, best, 200);
  EXPECT_EQ(evals, calls);
  EXPECT_LE(evals, 200 + 3);
  EXPECT_TRUE(std::isfinite(best.f));
  EXPECT_LE(best.theta[0], 0.5);
  EXPECT_NEAR(best.theta[0], 0.5, 1e-3);
  EXPECT_NEAR(best.theta[1], -1.0, 1e-3);
  BestPoint few;
  EXPECT_LE(minimize_nelder_mead(f, {0.0, 0.0}, few, 5), 5 + 3);
  EXPECT_LE(few.f, bowl({0.0, 0.0}, nullptr));
}

}  // namespace
}  // namespace qkv::test
