// Element-wise comparison metrics of two tensors, as the spec defines them (精度指标), computed on
// values converted to float32 (eager = a, compiled = b):
//   max_abs  = max |a - b|                       mean_abs = mean |a - b|
//   max_rel  = max |a - b| / (|a| + 1e-8)        allclose = torch.allclose(a, b, atol, rtol)
//   max_tol_ratio = max |a - b| / (atol + rtol * |b|), the error in units of the tolerance
// plus what a user debugging numerics wants next: cosine similarity, RMSE, the number of elements
// outside tolerance, NaN/Inf counts per side and the worst element.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "dynaprobe/formats/metrics.h"

namespace dynaprobe::analyze {

using formats::Histogram;
using formats::kHistogramBins;
using formats::kHistogramEdges;
using formats::kHistogramFirstPower;
using formats::kHistogramLastPower;
using formats::TensorMetrics;
using formats::Tolerances;

// Edge i of the |a - b| histogram (formats/metrics.h): 4^(kHistogramFirstPower + i), exactly.
float histogram_edge(std::size_t i);

// Which metrics a comparison computes. kAll: every one, for a row a person reads. kVerdict: what
// judging a pair reads (judging.h: allclose, the fp32 screen, the noise rule, the report's
// reference fields): allclose and mismatches, max_abs, rmse, rms_eager and rms_compiled, the
// element, NaN and Inf counts. Its other metrics are not computed: mean_abs, max_rel,
// max_tol_ratio and cosine are NaN, no worst element (-1), an empty histogram. No division, no
// histogram, no search for the worst element: about a third of kAll's time. Each side against the
// reference and the float32 late-reference decision (rows_pass) take it.
enum class MetricSet : std::uint8_t { kAll, kVerdict };

// Partial results over some elements of a tensor pair; merge() combines partials of disjoint
// element ranges of the same MetricSet. Sums are kept in double. NaN follows torch: one NaN
// difference makes max_abs, mean_abs and max_rel NaN; allclose treats NaN as unequal and equal
// infinities as equal.
class MetricsAccumulator {
 public:
  explicit MetricsAccumulator(MetricSet set = MetricSet::kAll) : set_(set) {}
  // Adds elements [first_index, first_index + n) given as float32 arrays.
  void accumulate(const float* a, const float* b, std::size_t n, std::uint64_t first_index,
                  const Tolerances& tolerances);
  // Merges the partial results of another, disjoint element range.
  void merge(const MetricsAccumulator& other);

  TensorMetrics result() const;

 private:
  MetricSet set_;
  std::uint64_t count_ = 0;
  float max_abs_ = 0;
  float max_rel_ = 0;
  float max_ratio_ = 0;
  double sum_abs_ = 0;
  double sum_squares_ = 0;
  double dot_ = 0;
  double norm_a_ = 0;
  double norm_b_ = 0;
  std::uint64_t mismatches_ = 0;
  std::uint64_t nan_diff_ = 0;
  std::uint64_t nan_unequal_ = 0;
  std::uint64_t nan_rel_ = 0;
  std::uint64_t nan_ratio_ = 0;
  std::uint64_t nan_a_ = 0;
  std::uint64_t nan_b_ = 0;
  std::uint64_t inf_a_ = 0;
  std::uint64_t inf_b_ = 0;
  std::uint64_t nonfinite_only_b_ = 0;
  std::int64_t worst_index_ = -1;
  float worst_a_ = 0;
  float worst_b_ = 0;
  float worst_diff_ = 0;  // NaN once a NaN difference is the worst
  Histogram histogram_{};
};

}  // namespace dynaprobe::analyze
