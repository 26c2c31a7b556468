// Metric semantics that a user relies on: torch's NaN/Inf rules, tolerance edges, determinism.
#include "dynaprobe/analyze/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

namespace dynaprobe::analyze {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TensorMetrics metrics_of(const std::vector<float>& a, const std::vector<float>& b,
                         Tolerances tolerances = {}, MetricSet set = MetricSet::kAll) {
  MetricsAccumulator accumulator(set);
  accumulator.accumulate(a.data(), b.data(), a.size(), 0, tolerances);
  return accumulator.result();
}

TEST(Metrics, SpecDefinitions) {
  const auto m = metrics_of({1.0f, -2.0f, 0.0f, 4.0f}, {1.0f, -2.5f, 0.25f, 4.0f});
  EXPECT_EQ(m.max_abs, 0.5);
  EXPECT_EQ(m.mean_abs, 0.1875);
  EXPECT_EQ(m.max_rel, static_cast<double>(0.25f / 1e-8f));  // |a| = 0: divided by 1e-8
  EXPECT_FALSE(m.allclose);
  EXPECT_EQ(m.mismatches, 2u);
  EXPECT_EQ(m.worst_index, 1);
  EXPECT_EQ(m.worst_eager, -2.0);
  EXPECT_EQ(m.worst_compiled, -2.5);
}

TEST(Metrics, AllcloseEdgeIsInclusiveAndRelativeToCompiled) {
  // |a - b| <= atol + rtol * |b|, as torch.allclose(a, b).
  EXPECT_TRUE(metrics_of({0.0f}, {0.0f}, {0.5, 0.0}).allclose);
  EXPECT_TRUE(metrics_of({0.0f}, {0.5f}, {0.5, 0.0}).allclose);
  EXPECT_FALSE(metrics_of({0.0f}, {0.5f}, {0.25, 0.0}).allclose);
  EXPECT_TRUE(metrics_of({100.0f}, {101.0f}, {0.0, 0.01}).allclose);  // 1 <= 0.01 * 101
  EXPECT_FALSE(metrics_of({101.0f}, {100.0f}, {0.0, 0.0099}).allclose);
}

// max_tol_ratio: |a - b| / (atol + rtol * |b|), so 1 is allclose's threshold, inclusive.
TEST(Metrics, TolRatioIsAboveOneExactlyWhenAnElementIsNotClose) {
  EXPECT_EQ(metrics_of({0.0f}, {0.5f}, {0.5, 0.0}).max_tol_ratio, 1.0);
  EXPECT_EQ(metrics_of({0.0f}, {0.5f}, {0.25, 0.0}).max_tol_ratio, 2.0);
  const auto m = metrics_of({100.0f, 3.0f}, {101.0f, 3.0f}, {0.0, 0.01});
  EXPECT_EQ(m.max_tol_ratio, static_cast<double>(1.0f / (0.01f * 101.0f)));
  EXPECT_TRUE(m.allclose);
  // No tolerance at all: equal elements are 0, any difference is infinitely outside it.
  EXPECT_EQ(metrics_of({1.0f, -0.0f}, {1.0f, 0.0f}, {0.0, 0.0}).max_tol_ratio, 0.0);
  EXPECT_EQ(metrics_of({1.0f}, {1.5f}, {0.0, 0.0}).max_tol_ratio, kInf);
  // Non-finite values follow allclose: equal infinities are close (0), an infinity against a
  // number is infinitely far (not inf / inf), a NaN is NaN.
  const auto infinities = metrics_of({kInf, 1.0f}, {kInf, 1.0f + 1e-4f});
  EXPECT_GT(infinities.max_tol_ratio, 0.0);
  EXPECT_LT(infinities.max_tol_ratio, 1.0);
  EXPECT_EQ(metrics_of({1.0f, 2.0f}, {kInf, 2.0f}).max_tol_ratio, kInf);
  EXPECT_TRUE(std::isnan(metrics_of({1.0f, kNaN}, {1.0f, 1.0f}).max_tol_ratio));
}

// Blocks of finite values take a faster loop than blocks with a NaN or an infinity: both give
// the same ratio.
TEST(Metrics, TolRatioIsTheSameWithAndWithoutNonFiniteValuesInTheBlock) {
  std::vector<float> a = {1.0f, -2.0f, 3e-9f, 4.0f}, b = {1.001f, -2.0f, 6e-9f, 3.99f};
  const auto finite = metrics_of(a, b);
  a.push_back(kInf);
  b.push_back(kInf);
  const auto with_infinity = metrics_of(a, b);
  EXPECT_EQ(finite.max_tol_ratio, with_infinity.max_tol_ratio);
  EXPECT_FLOAT_EQ(static_cast<float>(finite.max_tol_ratio),
                  (4.0f - 3.99f) / (1e-4f + 1e-3f * 3.99f));
}

TEST(Metrics, NanFollowsTorch) {
  const auto m = metrics_of({1.0f, kNaN, 3.0f}, {1.5f, kNaN, 3.0f});
  EXPECT_TRUE(std::isnan(m.max_abs));
  EXPECT_TRUE(std::isnan(m.mean_abs));
  EXPECT_TRUE(std::isnan(m.max_rel));
  EXPECT_FALSE(m.allclose);     // NaN is never close, even to NaN
  EXPECT_EQ(m.worst_index, 1);  // the first NaN difference is the worst element
  EXPECT_EQ(m.nan_eager, 1u);
  EXPECT_EQ(m.nan_compiled, 1u);
  EXPECT_EQ(m.nonfinite_only_compiled, 0u);
}

TEST(Metrics, EqualInfinitiesAreCloseButTheirDifferenceIsNan) {
  const auto m = metrics_of({kInf, 1.0f}, {kInf, 1.0f});
  EXPECT_TRUE(m.allclose);
  EXPECT_TRUE(std::isnan(m.max_abs));  // torch: inf - inf = nan
  const auto n = metrics_of({1.0f}, {kInf});
  EXPECT_FALSE(n.allclose);
  EXPECT_EQ(n.nonfinite_only_compiled, 1u);
  EXPECT_EQ(n.max_abs, kInf);
}

// Equal infinities differ by 0 in the rmse and leave the norms (over finite elements) finite:
// T5's position buckets take log(0) = -inf on every side, and the rest must still be judged.
TEST(Metrics, EqualInfinitiesLeaveTheRmseAndTheNormsOfTheFiniteElements) {
  const auto m = metrics_of({-kInf, 3.0f, 4.0f}, {-kInf, 3.0f, 4.5f});
  EXPECT_DOUBLE_EQ(m.rmse, std::sqrt(0.25 / 3));
  EXPECT_DOUBLE_EQ(m.rms_eager, std::sqrt(25.0 / 3));
  EXPECT_DOUBLE_EQ(m.rms_compiled, std::sqrt((9.0 + 20.25) / 3));
  EXPECT_TRUE(std::isfinite(m.cosine));
  EXPECT_TRUE(std::isnan(m.max_abs));  // the spec's abs(a - b).max() stays torch's
  EXPECT_TRUE(std::isnan(metrics_of({kNaN, 1.0f}, {kNaN, 1.0f}).rmse));  // NaN is never equal
  EXPECT_EQ(metrics_of({-kInf}, {kInf}).rmse, kInf);
}

TEST(Metrics, EmptyTensorsPass) {
  const auto m = metrics_of({}, {});
  EXPECT_EQ(m.elements, 0u);
  EXPECT_EQ(m.max_abs, 0.0);
  EXPECT_EQ(m.mean_abs, 0.0);
  EXPECT_TRUE(m.allclose);
  EXPECT_EQ(m.worst_index, -1);
}

TEST(Metrics, CosineAndRmse) {
  const auto m = metrics_of({3.0f, 4.0f}, {3.0f, 4.0f});
  EXPECT_DOUBLE_EQ(m.cosine, 1.0);
  EXPECT_DOUBLE_EQ(m.rmse, 0.0);
  const auto n = metrics_of({1.0f, 0.0f}, {0.0f, 1.0f});
  EXPECT_DOUBLE_EQ(n.cosine, 0.0);
  EXPECT_DOUBLE_EQ(n.rmse, 1.0);
}

TEST(Metrics, MergingPartsInAnyOrderGivesTheSameResult) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> a(10000), b(10000);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = normal(rng);
    b[i] = a[i] + (i % 97 == 0 ? 1e-3f * normal(rng) : 0.0f);
  }
  // A tie in |a - b| = 0.5 exactly: the smaller index wins whatever the merge order.
  a[5000] = 1.0f;
  b[5000] = 1.5f;
  a[7000] = 1.0f;
  b[7000] = 0.5f;
  const auto whole = metrics_of(a, b);
  MetricsAccumulator forward, backward;
  for (std::size_t start = 0; start < a.size(); start += 1000) {
    MetricsAccumulator part;
    part.accumulate(a.data() + start, b.data() + start, 1000, start, {});
    forward.merge(part);
  }
  for (std::size_t start = a.size(); start > 0; start -= 1000) {
    MetricsAccumulator part;
    part.accumulate(a.data() + start - 1000, b.data() + start - 1000, 1000, start - 1000, {});
    backward.merge(part);
  }
  for (const auto& merged : {forward.result(), backward.result()}) {
    EXPECT_EQ(merged.max_abs, whole.max_abs);
    EXPECT_EQ(merged.max_rel, whole.max_rel);
    EXPECT_EQ(merged.max_tol_ratio, whole.max_tol_ratio);
    EXPECT_NEAR(merged.mean_abs, whole.mean_abs, 1e-12);
    EXPECT_EQ(merged.mismatches, whole.mismatches);
    EXPECT_EQ(merged.worst_index, 5000);
  }
}

// The |diff| histogram: exact zeros, one log-spaced bin per factor of 4, infinities in the last
// bin, NaN differences left out; edges are inclusive below, as the HTML report labels them.
TEST(Metrics, HistogramBinsEveryFiniteDifferenceOnce) {
  EXPECT_EQ(histogram_edge(0), std::ldexp(1.0f, -40));
  EXPECT_EQ(histogram_edge(20), 1.0f);
  EXPECT_EQ(histogram_edge(kHistogramEdges - 1), 1048576.0f);
  EXPECT_THROW(histogram_edge(kHistogramEdges), std::out_of_range);
  // |a - b|: zero, below 2^-40, 2^-40, just below 1, 1, just below 4, 4, 2^20, 1e30, inf, NaN.
  const float below_four = std::nextafter(4.0f, 0.0f);
  const std::vector<float> b = {
      1, 1e-30f, std::ldexp(1.0f, -40), 0.999f, 1, below_four, 4.0f, 1048576.0f, 1e30f, kInf, kNaN};
  const std::vector<float> a = {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const TensorMetrics m = metrics_of(a, b);
  Histogram expected{};
  expected[0] = 1;                   // exact zero
  expected[1] = 1;                   // below the first edge
  expected[2] = 1;                   // [2^-40, 2^-38)
  expected[2 + 19] = 1;              // [1/4, 1)
  expected[2 + 20] = 2;              // [1, 4): 1 and just below 4
  expected[2 + 21] = 1;              // [4, 16)
  expected[kHistogramBins - 1] = 3;  // 2^20, 1e30 and inf: at or above the last edge
  EXPECT_EQ(m.histogram, expected);
  std::uint64_t total = 0;
  for (auto count : m.histogram) total += count;
  EXPECT_EQ(total, a.size() - 1);  // all but the NaN difference
}

TEST(Metrics, HistogramOfAnySplitMergesToTheWhole) {
  std::mt19937 rng(7);
  std::lognormal_distribution<float> magnitude(-6.0f, 4.0f);
  std::vector<float> a(10000), b(10000);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = magnitude(rng);
    b[i] = a[i] + ((i % 3) ? magnitude(rng) : 0.0f);
  }
  const TensorMetrics whole = metrics_of(a, b);
  MetricsAccumulator first, second;
  first.accumulate(a.data(), b.data(), 3333, 0, {});
  second.accumulate(a.data() + 3333, b.data() + 3333, a.size() - 3333, 3333, {});
  second.merge(first);
  EXPECT_EQ(second.result().histogram, whole.histogram);
  // Checked against a plain search over the edges.
  Histogram reference{};
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float diff = std::fabs(a[i] - b[i]);
    std::size_t bin = 1;
    while (bin - 1 < kHistogramEdges && diff >= histogram_edge(bin - 1)) ++bin;
    ++reference[diff == 0 ? 0 : bin];
  }
  EXPECT_EQ(whole.histogram, reference);
}

// Most differences of a compiled run are exact zeros: several blocks of the histogram's own
// splitting (one all zeros, one with no zero, one with NaNs), against a plain search.
TEST(Metrics, HistogramOfMostlyEqualTensorsCountsZerosOnceAndLeavesNaNOut) {
  constexpr std::size_t kBlock = 32 * 255;  // add_histogram's block
  const std::size_t n = 4 * kBlock + 77;
  std::mt19937 rng(11);
  std::normal_distribution<float> gaussian;
  std::vector<float> a(n), b(n);
  for (std::size_t i = 0; i < n; ++i) {
    a[i] = b[i] = gaussian(rng);
    const bool zero_block = i / kBlock == 1, no_zero_block = i / kBlock == 2;
    if (no_zero_block || (!zero_block && i % 64 == 5)) b[i] = std::nextafter(a[i], 10.0f);
    if (!zero_block && !no_zero_block && i % 1000 == 7) b[i] = kNaN;
  }
  Histogram reference{};
  std::uint64_t nan = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float diff = std::fabs(a[i] - b[i]);
    if (diff != diff) {
      ++nan;
      continue;
    }
    std::size_t bin = 1;
    while (bin - 1 < kHistogramEdges && diff >= histogram_edge(bin - 1)) ++bin;
    ++reference[diff == 0 ? 0 : bin];
  }
  ASSERT_GT(nan, 0u);
  EXPECT_EQ(metrics_of(a, b).histogram, reference);
}

// Judging reads the verdict set (each side against the reference, the float32 late-reference
// decision): the same numbers as the full set's up to the order of the double sums, with torch's
// NaN/Inf rules and allclose's edges; what it does not compute reads as such.
TEST(Metrics, TheVerdictSetHasWhatJudgingReads) {
  std::mt19937 rng(5);
  std::normal_distribution<float> gaussian;
  std::vector<float> a(50000), b(50000);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = 1e4f * gaussian(rng);  // gradients of a real loss scale, not values near 1
    b[i] = a[i] * (1 + 1e-3f * gaussian(rng));
  }
  b[3] = a[3] + (1e-4f + std::fabs(1e-3f * b[3]));  // near allclose's inclusive edge
  const Tolerances tolerances;
  const TensorMetrics all = metrics_of(a, b, tolerances);
  const TensorMetrics verdict = metrics_of(a, b, tolerances, MetricSet::kVerdict);
  EXPECT_EQ(verdict.max_abs, all.max_abs);
  EXPECT_DOUBLE_EQ(verdict.rmse, all.rmse);
  EXPECT_DOUBLE_EQ(verdict.rms_eager, all.rms_eager);
  EXPECT_DOUBLE_EQ(verdict.rms_compiled, all.rms_compiled);
  EXPECT_EQ(verdict.elements, a.size());
  ASSERT_GT(all.mismatches, 0u);
  EXPECT_EQ(verdict.mismatches, all.mismatches);
  EXPECT_EQ(verdict.allclose, all.allclose);
  for (double skipped :
       {verdict.mean_abs, verdict.max_rel, verdict.max_tol_ratio, verdict.cosine}) {
    EXPECT_TRUE(std::isnan(skipped));
  }
  EXPECT_EQ(verdict.worst_index, -1);
  EXPECT_EQ(verdict.histogram, Histogram{});
  const std::vector<float> close(b.begin(), b.end());
  EXPECT_TRUE(metrics_of(close, close, tolerances, MetricSet::kVerdict).allclose);

  a[7] = kNaN;  // a NaN or an infinity sends the block through the full kernel
  b[9] = kInf;
  const TensorMetrics nonfinite = metrics_of(a, b, tolerances, MetricSet::kVerdict);
  EXPECT_TRUE(std::isnan(nonfinite.max_abs));
  EXPECT_TRUE(std::isnan(nonfinite.rmse));
  EXPECT_EQ(nonfinite.nan_eager, 1u);
  EXPECT_EQ(nonfinite.inf_compiled, 1u);
  EXPECT_EQ(nonfinite.nonfinite_only_compiled, 1u);
  EXPECT_EQ(nonfinite.mismatches, metrics_of(a, b, tolerances).mismatches);
  EXPECT_TRUE(std::isfinite(nonfinite.rms_eager));
  EXPECT_TRUE(std::isnan(nonfinite.max_tol_ratio));
}

}  // namespace
}  // namespace dynaprobe::analyze
