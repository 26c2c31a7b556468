// The metrics of a compared pair of tensors, as the analyzer computes them (analyze/metrics.h
// says how) and as a dump may store them: a capture that judged its rows in memory keeps
// their metrics in /metrics (format 1.3), so that a re-analysis needs no tensor it did not store.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dynaprobe/formats/record.h"

namespace dynaprobe::formats {

// The histogram of |a - b| that each comparison keeps while it streams the tensors (no second
// pass): fixed log-spaced bins, one per factor of 4, edges 4^-20 (about 9.1e-13), 4^-19, ...,
// 4^10 (about 1.05e6). Powers of two are exact in float32 and a value's bin is its exponent
// field halved, so binning costs a few integer operations (measured: see analyze/metrics.cpp).
// Bin 0 counts exact zeros, bin 1 differences below the first edge, bin i + 2 those in
// [edge i, edge i + 1), the last bin those at or above the last edge, infinities included. NaN
// differences are not binned (nan_eager/nan_compiled count them).
inline constexpr int kHistogramFirstPower = -20;  // of 4
inline constexpr int kHistogramLastPower = 10;
inline constexpr std::size_t kHistogramEdges = kHistogramLastPower - kHistogramFirstPower + 1;
inline constexpr std::size_t kHistogramBins = kHistogramEdges + 2;
using Histogram = std::array<std::uint64_t, kHistogramBins>;

struct Tolerances {
  double atol = 1e-4;
  double rtol = 1e-3;
};

// A metric that a pair's stored metrics lack (a dump's /metrics written before that metric
// existed): max_tol_ratio, rms_eager and rms_compiled are never negative.
inline constexpr double kMetricNotStored = -1;

// The result of comparing two tensors.
struct TensorMetrics {
  double max_abs = 0;
  double mean_abs = 0;
  double max_rel = 0;
  // max |a - b| / (atol + rtol * |b|) with the tolerances the row is judged with: the error in
  // units of the tolerance, so an element is outside tolerance exactly when its ratio is above 1
  // (up to float32 rounding); 0 for equal elements (equal infinities too), inf where the allowed
  // error is 0, NaN when a difference is NaN. kMetricNotStored when unknown: a dump's /metrics
  // written before this metric existed.
  double max_tol_ratio = 0;
  bool allclose = true;
  double cosine = 1;  // over the finite elements; 1 for two all-zero tensors
  // Equal elements (equal infinities too) count 0; NaN only where a NaN makes two unequal.
  double rmse = 0;
  // The root mean square of each side's finite elements: the magnitude errors are relative to
  // (the noise rule's floor and the relative screen, analyze/judging.h). kMetricNotStored when
  // unknown.
  double rms_eager = 0;
  double rms_compiled = 0;
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

// TensorMetrics as a dump's /metrics stores it: every field, in order, with its type. Adding a
// metric is a TensorMetrics field and its row here (the file format, its checksum and the reader
// follow), its computation (analyze/metrics.cpp) and its place in the report model
// (analyze/report_model.cpp).
enum class MetricType : std::uint8_t { kFloat64, kUInt64, kInt64, kBool, kHistogram };
struct MetricField {
  std::string_view name;
  std::size_t offset;  // in TensorMetrics
  MetricType type;
};
inline constexpr MetricField kMetricFields[] = {
    {"max_abs", offsetof(TensorMetrics, max_abs), MetricType::kFloat64},
    {"mean_abs", offsetof(TensorMetrics, mean_abs), MetricType::kFloat64},
    {"max_rel", offsetof(TensorMetrics, max_rel), MetricType::kFloat64},
    {"max_tol_ratio", offsetof(TensorMetrics, max_tol_ratio), MetricType::kFloat64},
    {"allclose", offsetof(TensorMetrics, allclose), MetricType::kBool},
    {"cosine", offsetof(TensorMetrics, cosine), MetricType::kFloat64},
    {"rmse", offsetof(TensorMetrics, rmse), MetricType::kFloat64},
    {"rms_eager", offsetof(TensorMetrics, rms_eager), MetricType::kFloat64},
    {"rms_compiled", offsetof(TensorMetrics, rms_compiled), MetricType::kFloat64},
    {"elements", offsetof(TensorMetrics, elements), MetricType::kUInt64},
    {"mismatches", offsetof(TensorMetrics, mismatches), MetricType::kUInt64},
    {"nan_eager", offsetof(TensorMetrics, nan_eager), MetricType::kUInt64},
    {"nan_compiled", offsetof(TensorMetrics, nan_compiled), MetricType::kUInt64},
    {"inf_eager", offsetof(TensorMetrics, inf_eager), MetricType::kUInt64},
    {"inf_compiled", offsetof(TensorMetrics, inf_compiled), MetricType::kUInt64},
    {"nonfinite_only_compiled", offsetof(TensorMetrics, nonfinite_only_compiled),
     MetricType::kUInt64},
    {"worst_index", offsetof(TensorMetrics, worst_index), MetricType::kInt64},
    {"worst_eager", offsetof(TensorMetrics, worst_eager), MetricType::kFloat64},
    {"worst_compiled", offsetof(TensorMetrics, worst_compiled), MetricType::kFloat64},
    {"histogram", offsetof(TensorMetrics, histogram), MetricType::kHistogram},
};

// The metrics of one compared pair, computed at capture from the tensors in memory. `key` is
// the pair's compiled record (the only record of a single-pass fwd_input or grad_output, which
// stands for both sides); `tolerances` are those its allclose and mismatches were judged with.
struct StoredMetrics {
  RecordKey key;
  Tolerances tolerances;
  TensorMetrics metrics;
};

}  // namespace dynaprobe::formats
