// Streams two stored tensors of the same element count chunk by chunk and computes their metrics.
#pragma once

#include <atomic>
#include <cstdint>

#include "dynaprobe/analyze/metrics.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::analyze {

// `eager` and `compiled` must hold the same number of elements (any dtypes, any chunking).
// Fetches serially (HDF5), decodes and compares chunks in parallel and merges partial metrics in
// element order, so the result is the same on any number of threads. Adds the uncompressed bytes
// it has compared to `progress_bytes`.
TensorMetrics compare_tensors(const formats::TensorStream& eager, const formats::TensorStream& compiled,
                        const Tolerances& tolerances, std::atomic<std::uint64_t>& progress_bytes);

}  // namespace dynaprobe::analyze
