// The metrics of a compared pair of tensors, as the analyzer computes them (analyze/metrics.h
// defines them) and as a dump may store them: a capture that judged its rows in memory keeps
// their metrics in /metrics (format 1.3), so that a re-analysis needs no tensor it did not store.
#pragma once

#include <cstdint>

#include "dynaprobe/formats/record.h"

namespace dynaprobe::formats {

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
