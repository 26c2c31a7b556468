// Streams two stored tensors of the same element count chunk by chunk and computes their metrics.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "dynaprobe/analyze/metrics.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::analyze {

// `eager` and `compiled` must hold the same number of elements (any dtypes, any chunking).
// Fetches serially (HDF5), decodes and compares chunks in parallel and merges partial metrics in
// element order, so the result is the same on any number of threads. Adds the uncompressed bytes
// it has compared to `progress_bytes`.
TensorMetrics compare_tensors(const formats::TensorStream& eager,
                              const formats::TensorStream& compiled, const Tolerances& tolerances,
                              MetricSet set, std::atomic<std::uint64_t>& progress_bytes);

// Pairs whose two tensors together hold at most this many uncompressed bytes go through
// compare_small_pairs(). Each of its 2 x threads pipeline tokens holds a pair whole (stored bytes
// plus decoding buffers), so this bounds its memory; above it, opening a dataset costs little next
// to decoding it, and compare_tensors() also spreads one pair over threads.
inline constexpr std::uint64_t kSmallPairBytes = 1 << 20;

// One pair for compare_small_pairs(): same requirements as compare_tensors().
struct PairStreams {
  formats::TensorStream eager;
  formats::TensorStream compiled;
  Tolerances tolerances;
  MetricSet set = MetricSet::kAll;
};

// Compares `count` small pairs, with the same results as compare_tensors() on each. Opening a
// dataset and reading its chunks costs more than decoding and comparing a small tensor, and HDF5
// runs behind one lock, so: one pipeline stage opens and fetches pair after pair while holding the
// HDF5 lock (and closes the streams of finished pairs, which needs the lock too), and the other
// decodes and compares the fetched pairs in parallel, each pair on one thread. Per-pair pipelines
// and threads competing for the lock cost twice as much. open(i) returns pair i's streams and is
// called under the HDF5 lock, in order; done(i, metrics) is called once per pair, on any thread.
void compare_small_pairs(std::size_t count, const std::function<PairStreams(std::size_t)>& open,
                         const std::function<void(std::size_t, const TensorMetrics&)>& done,
                         std::atomic<std::uint64_t>& progress_bytes);

}  // namespace dynaprobe::analyze
