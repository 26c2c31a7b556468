// Element-wise comparison metrics of two tensors, as the spec defines them (精度指标), computed on
// values converted to float32 (eager = a, compiled = b):
//   max_abs  = max |a - b|                       mean_abs = mean |a - b|
//   max_rel  = max |a - b| / (|a| + 1e-8)        allclose = torch.allclose(a, b, atol, rtol)
// plus what a user debugging numerics wants next: cosine similarity, RMSE, the number of elements
// outside tolerance, NaN/Inf counts per side and the worst element.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace dynaprobe::analyze {

// The histogram of |a - b| that each comparison keeps while it streams the tensors (no second
// pass): fixed log-spaced bins, one per factor of 4, edges 4^-20 (about 9.1e-13), 4^-19, ...,
// 4^10 (about 1.05e6). Powers of two are exact in float32 and a value's bin is its exponent
// field halved, so binning costs a few integer operations (measured: see metrics.cpp). Bin 0
// counts exact zeros, bin 1 differences below the first edge, bin i + 2 those in
// [edge i, edge i + 1), the last bin those at or above the last edge, infinities included. NaN
// differences are not binned (nan_eager/nan_compiled count them).
inline constexpr int kHistogramFirstPower = -20;  // of 4
inline constexpr int kHistogramLastPower = 10;
inline constexpr std::size_t kHistogramEdges = kHistogramLastPower - kHistogramFirstPower + 1;
inline constexpr std::size_t kHistogramBins = kHistogramEdges + 2;
// Edge i: 4^(kHistogramFirstPower + i), exactly.
float histogram_edge(std::size_t i);
using Histogram = std::array<std::uint64_t, kHistogramBins>;

struct Tolerances {
  double atol = 1e-4;
  double rtol = 1e-3;
};

// The result of comparing two tensors.
struct TensorMetrics {
  double max_abs = 0;
  double mean_abs = 0;
  double max_rel = 0;
  bool allclose = true;
  double cosine = 1;  // 1 for two all-zero tensors
  double rmse = 0;
  std::uint64_t elements = 0;
  std::uint64_t mismatches = 0;  // elements outside tolerance
  std::uint64_t nan_eager = 0;
  std::uint64_t nan_compiled = 0;
  std::uint64_t inf_eager = 0;
  std::uint64_t inf_compiled = 0;
  std::uint64_t nonfinite_only_compiled = 0;  // NaN/Inf in compiled where eager is finite
  // The element with the largest |a - b| (the first NaN difference if any); -1 when empty.
  std::int64_t worst_index = -1;
  double worst_eager = 0;
  double worst_compiled = 0;
  Histogram histogram{};  // |a - b| per bin (kHistogramBins)
};

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
  double sum_abs_ = 0;
  double sum_squares_ = 0;
  double dot_ = 0;
  double norm_a_ = 0;
  double norm_b_ = 0;
  std::uint64_t mismatches_ = 0;
  std::uint64_t nan_diff_ = 0;
  std::uint64_t nan_rel_ = 0;
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
