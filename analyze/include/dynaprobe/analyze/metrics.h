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

// Partial results over some elements of a tensor pair; merge() combines partials of disjoint
// element ranges. Sums are kept in double. NaN follows torch: one NaN difference makes max_abs,
// mean_abs and max_rel NaN; allclose treats NaN as unequal and equal infinities as equal.
class MetricsAccumulator {
 public:
  // Adds elements [first_index, first_index + n) given as float32 arrays.
  void accumulate(const float* a, const float* b, std::size_t n, std::uint64_t first_index,
                  const Tolerances& tolerances);
  // Merges the partial results of another, disjoint element range.
  void merge(const MetricsAccumulator& other);

  TensorMetrics result() const;

 private:
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
