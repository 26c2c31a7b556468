#include "tensor_pair.h"

#include <tbb/blocked_range.h>
#include <tbb/concurrent_queue.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "dynaprobe/analyze/judging.h"

namespace dynaprobe::analyze {
namespace {

using formats::ChunkExtent;
using formats::RawChunk;
using formats::TensorStream;

// A unit of work: one chunk of the driving stream and the chunks of the other stream that
// overlap its elements.
struct Unit {
  std::size_t driver_chunk = 0;
  std::size_t follower_first = 0;
  std::size_t follower_count = 0;
};

// Decoding buffers, reused from unit to unit.
struct DecodeBuffers {
  std::vector<std::byte> driver_out, follower_out, scratch;
  std::vector<std::byte> follower_bytes;       // the follower's elements of a unit spanning chunks
  std::vector<float> eager_f32, compiled_f32;  // a sub-block of each side as float32
  std::vector<float> reference_f32;            // and of a reference compared with both
};

// `count` elements as float32 values (a complex element as two: real, imaginary): a pointer into
// `bytes` when they already are.
const float* as_float32(formats::DType dtype, const std::byte* bytes, std::uint64_t count,
                        std::vector<float>& buffer) {
  if (dtype == formats::DType::kFloat32) return reinterpret_cast<const float*>(bytes);
  buffer.resize(count * formats::value_count(dtype));
  formats::convert_to_float32(dtype, bytes, count, buffer.data());
  return buffer.data();
}

// Values per sub-block of a unit: 64 KiB of float32 a side, and two whole blocks of the
// histogram's counting (32 x 255 values, metrics.cpp), so that no sub-block leaves it a short one.
constexpr std::uint64_t kSubBlockValues = 2 * 32 * 255;

// Asks the core to load `bytes` bytes at `data` into its cache, a request per 64-byte line: the
// next sub-block of a side, requested before the current one is compared, arrives while it is.
// The hardware prefetcher stops at each 4 KiB page and leaves the comparison waiting on memory:
// without this, every metric of float32 tensors in memory took 1.3 times as long; the verdict's,
// which wait on memory either way, take as long (docs/performance.md).
void prefetch(const std::byte* data, std::uint64_t bytes) {
  for (std::uint64_t at = 0; at < bytes; at += 64) __builtin_prefetch(data + at, 0, 3);
}

// The metrics of a unit's `count` elements, starting at element `first_element`, each side in its
// own dtype. They are converted to float32 and compared a sub-block at a time, so that the
// comparison's passes over the values (the metrics, the worst element, the histogram) find them
// in the core's cache: a unit whole is 2 MiB and more of float32 a side, read from memory by
// every pass. The sub-blocks merge in element order, so the dump's reader and the recorder in
// memory, which both compare units here, get the same bits.
MetricsAccumulator compare_values(formats::DType eager_dtype, const std::byte* eager,
                                  formats::DType compiled_dtype, const std::byte* compiled,
                                  std::uint64_t count, std::uint64_t first_element,
                                  const Tolerances& tolerances, MetricSet set,
                                  std::vector<float>& eager_f32, std::vector<float>& compiled_f32) {
  // Complex tensors are compared as their real and imaginary parts (comparison.h:
  // shape_mismatch pairs complex with complex only).
  const std::uint64_t values = formats::value_count(eager_dtype);
  const std::uint64_t step = std::max<std::uint64_t>(1, kSubBlockValues / values);
  const std::size_t eager_size = formats::dtype_size(eager_dtype);
  const std::size_t compiled_size = formats::dtype_size(compiled_dtype);
  MetricsAccumulator metrics(set);
  for (std::uint64_t start = 0; start < count; start += step) {
    const std::uint64_t n = std::min(step, count - start);
    if (start + n < count) {
      const std::uint64_t next = std::min(step, count - start - n);
      prefetch(eager + (start + n) * eager_size, next * eager_size);
      prefetch(compiled + (start + n) * compiled_size, next * compiled_size);
    }
    const float* a = as_float32(eager_dtype, eager + start * eager_size, n, eager_f32);
    const float* b = as_float32(compiled_dtype, compiled + start * compiled_size, n, compiled_f32);
    metrics.accumulate(a, b, n * values, (first_element + start) * values, tolerances);
  }
  return metrics;
}

// How the chunks of two streams pair up. The stream with fewer (larger) chunks drives; each of its
// chunks pairs with the overlapping chunks of the other, which are fetched once, or twice where
// chunk boundaries do not align. Refers to the streams: must not outlive them.
class PairPlan {
 public:
  PairPlan(const TensorStream& eager, const TensorStream& compiled)
      : eager_drives_(eager.chunk_count() <= compiled.chunk_count()),
        driver_(eager_drives_ ? eager : compiled),
        follower_(eager_drives_ ? compiled : eager),
        driver_size_(formats::dtype_size(driver_.dtype())),
        follower_size_(formats::dtype_size(follower_.dtype())),
        follower_starts_(follower_.chunk_count()) {
    for (std::size_t i = 0; i < follower_starts_.size(); ++i) {
      follower_starts_[i] = follower_.extent(i).first_element;
    }
  }

  bool eager_drives() const { return eager_drives_; }
  const TensorStream& driver() const { return driver_; }
  const TensorStream& follower() const { return follower_; }
  std::size_t unit_count() const { return driver_.chunk_count(); }

  Unit unit(std::size_t driver_chunk) const {
    Unit unit;
    unit.driver_chunk = driver_chunk;
    const ChunkExtent extent = driver_.extent(driver_chunk);
    const auto first =
        std::upper_bound(follower_starts_.begin(), follower_starts_.end(), extent.first_element) -
        follower_starts_.begin() - 1;
    std::size_t last = static_cast<std::size_t>(first);
    while (last + 1 < follower_starts_.size() &&
           follower_starts_[last + 1] < extent.first_element + extent.element_count) {
      ++last;
    }
    unit.follower_first = static_cast<std::size_t>(first);
    unit.follower_count = last - static_cast<std::size_t>(first) + 1;
    return unit;
  }

  // Uncompressed bytes of both sides in the unit, for progress.
  std::uint64_t bytes(const Unit& unit) const {
    return driver_.extent(unit.driver_chunk).element_count * (driver_size_ + follower_size_);
  }

  // Decodes the unit's chunks (`follower_raw` holds its follower chunks, in order) and returns the
  // metrics of its elements. Needs no HDF5 lock.
  MetricsAccumulator compare(const Unit& unit, RawChunk& driver_raw, RawChunk* follower_raw,
                             DecodeBuffers& buffers, const Tolerances& tolerances,
                             MetricSet set) const {
    const ChunkExtent extent = driver_.extent(unit.driver_chunk);
    const std::byte* driver_bytes =
        driver_.decode(unit.driver_chunk, driver_raw, buffers.driver_out, buffers.scratch);
    // Gather the follower's elements of this unit (usually one whole chunk: no copy).
    const std::byte* follower_bytes = nullptr;
    for (std::size_t i = 0; i < unit.follower_count; ++i) {
      const std::size_t chunk = unit.follower_first + i;
      const ChunkExtent part = follower_.extent(chunk);
      const std::byte* data =
          follower_.decode(chunk, follower_raw[i], buffers.follower_out, buffers.scratch);
      const std::uint64_t begin = std::max(part.first_element, extent.first_element);
      const std::uint64_t end = std::min(part.first_element + part.element_count,
                                         extent.first_element + extent.element_count);
      const std::byte* source = data + (begin - part.first_element) * follower_size_;
      if (unit.follower_count == 1) {  // the usual case: aligned chunks, no copy
        follower_bytes = source;
        break;
      }
      buffers.follower_bytes.resize(extent.element_count * follower_size_);
      std::memcpy(buffers.follower_bytes.data() + (begin - extent.first_element) * follower_size_,
                  source, (end - begin) * follower_size_);
      follower_bytes = buffers.follower_bytes.data();
    }
    const TensorStream& eager = eager_drives_ ? driver_ : follower_;
    const TensorStream& compiled = eager_drives_ ? follower_ : driver_;
    return compare_values(eager.dtype(), eager_drives_ ? driver_bytes : follower_bytes,
                          compiled.dtype(), eager_drives_ ? follower_bytes : driver_bytes,
                          extent.element_count, extent.first_element, tolerances, set,
                          buffers.eager_f32, buffers.compiled_f32);
  }

 private:
  bool eager_drives_;
  const TensorStream& driver_;
  const TensorStream& follower_;
  std::size_t driver_size_;
  std::size_t follower_size_;
  std::vector<std::uint64_t> follower_starts_;  // where each follower chunk starts
};

// Pipeline tokens: enough to keep every thread busy while the serial stage fetches.
std::size_t token_count(std::size_t items) {
  return std::max<std::size_t>(
      1, std::min<std::size_t>(
             items, 2 * static_cast<std::size_t>(tbb::this_task_arena::max_concurrency())));
}

// Work buffers of pipeline tokens, taken by the first stage and given back by the last one, also
// when a stage throws: the first stage waits for a free one, and must not wait forever.
template <typename Slot>
class SlotQueue {
 public:
  explicit SlotQueue(std::vector<Slot>& slots) {
    for (auto& slot : slots) free_.push(&slot);
  }
  Slot* take() {
    Slot* slot = nullptr;
    free_.pop(slot);
    return slot;
  }
  void give_back(Slot* slot) { free_.push(slot); }

  // Gives the slot back when it goes out of scope.
  struct Return {
    SlotQueue& queue;
    Slot* slot;
    ~Return() {
      if (slot) queue.give_back(slot);
    }
  };

 private:
  tbb::concurrent_bounded_queue<Slot*> free_;
};

}  // namespace

TensorMetrics compare_tensors(const TensorStream& eager, const TensorStream& compiled,
                              const Tolerances& tolerances, MetricSet set,
                              std::atomic<std::uint64_t>& progress_bytes) {
  const PairPlan plan(eager, compiled);
  const std::size_t count = plan.unit_count();
  // Work buffers of one pipeline token, reused from unit to unit.
  struct Slot {
    RawChunk driver_raw;
    std::vector<RawChunk> follower_raw;
    DecodeBuffers buffers;
    MetricsAccumulator metrics;
  };
  std::vector<Slot> slots(token_count(count));
  SlotQueue<Slot> free_slots(slots);
  MetricsAccumulator total(set);

  struct Item {
    Unit unit;
    Slot* slot = nullptr;
  };
  std::size_t next = 0;
  const auto fetch = [&](tbb::flow_control& control) -> Item {
    if (next == count) {
      control.stop();
      return {};
    }
    Item item;
    item.unit = plan.unit(next++);
    item.slot = free_slots.take();
    typename SlotQueue<Slot>::Return on_error{free_slots, item.slot};
    Slot& slot = *item.slot;
    plan.driver().fetch(item.unit.driver_chunk, slot.driver_raw);
    slot.follower_raw.resize(std::max(slot.follower_raw.size(), item.unit.follower_count));
    for (std::size_t i = 0; i < item.unit.follower_count; ++i) {
      plan.follower().fetch(item.unit.follower_first + i, slot.follower_raw[i]);
    }
    on_error.slot = nullptr;  // fetched: the slot travels on with the item
    return item;
  };
  const auto compare = [&](Item item) -> Item {
    Slot& slot = *item.slot;
    try {
      slot.metrics = plan.compare(item.unit, slot.driver_raw, slot.follower_raw.data(),
                                  slot.buffers, tolerances, set);
    } catch (...) {
      free_slots.give_back(item.slot);
      throw;
    }
    progress_bytes += plan.bytes(item.unit);
    return item;
  };
  const auto merge = [&](Item item) {
    total.merge(item.slot->metrics);
    free_slots.give_back(item.slot);
  };
  tbb::parallel_pipeline(
      slots.size(), tbb::make_filter<void, Item>(tbb::filter_mode::serial_in_order, fetch) &
                        tbb::make_filter<Item, Item>(tbb::filter_mode::parallel, compare) &
                        tbb::make_filter<Item, void>(tbb::filter_mode::serial_in_order, merge));
  return total.result();
}

void compare_small_pairs(std::size_t count, const std::function<PairStreams(std::size_t)>& open,
                         const std::function<void(std::size_t, const TensorMetrics&)>& done,
                         std::atomic<std::uint64_t>& progress_bytes) {
  if (count == 0) return;
  // One pair, held whole: its streams (open datasets, or single-chunk records read by their file
  // offset), every stored chunk of both tensors, and decoding buffers. Kept from pair to pair, so
  // buffers are reused and the datasets of a pair are closed by the fetch stage (which holds the
  // HDF5 lock) when the slot is taken again.
  struct Slot {
    std::optional<TensorStream> eager, compiled;
    Tolerances tolerances;
    MetricSet set = MetricSet::kAll;
    std::vector<RawChunk> eager_raw, compiled_raw;
    DecodeBuffers buffers;
  };
  std::vector<Slot> slots(token_count(count));
  SlotQueue<Slot> free_slots(slots);
  const auto fetch_all = [](const TensorStream& stream, std::vector<RawChunk>& raw) {
    if (raw.size() < stream.chunk_count()) raw.resize(stream.chunk_count());
    for (std::size_t i = 0; i < stream.chunk_count(); ++i) stream.fetch(i, raw[i]);
  };

  struct Item {
    std::size_t index = 0;
    Slot* slot = nullptr;
  };
  std::size_t next = 0;
  const auto fetch = [&](tbb::flow_control& control) -> Item {
    if (next == count) {
      control.stop();
      return {};
    }
    Item item{next++, free_slots.take()};
    typename SlotQueue<Slot>::Return on_error{free_slots, item.slot};
    Slot& slot = *item.slot;
    // One batch (formats' lock taken once) for all the reads of a pair.
    formats::ReadBatch batch;
    slot.eager.reset();
    slot.compiled.reset();
    PairStreams pair = open(item.index);
    slot.eager.emplace(std::move(pair.eager));
    slot.compiled.emplace(std::move(pair.compiled));
    slot.tolerances = pair.tolerances;
    slot.set = pair.set;
    fetch_all(*slot.eager, slot.eager_raw);
    fetch_all(*slot.compiled, slot.compiled_raw);
    on_error.slot = nullptr;  // fetched: the slot travels on with the item
    return item;
  };
  const auto compare = [&](Item item) {
    typename SlotQueue<Slot>::Return give_back{free_slots, item.slot};
    Slot& slot = *item.slot;
    const PairPlan plan(*slot.eager, *slot.compiled);
    std::vector<RawChunk>& driver_raw = plan.eager_drives() ? slot.eager_raw : slot.compiled_raw;
    std::vector<RawChunk>& follower_raw = plan.eager_drives() ? slot.compiled_raw : slot.eager_raw;
    // Units in element order, merged like compare_tensors() merges them: the same bits.
    MetricsAccumulator total(slot.set);
    for (std::size_t chunk = 0; chunk < plan.unit_count(); ++chunk) {
      const Unit unit = plan.unit(chunk);
      total.merge(plan.compare(unit, driver_raw[chunk], follower_raw.data() + unit.follower_first,
                               slot.buffers, slot.tolerances, slot.set));
      progress_bytes += plan.bytes(unit);
    }
    done(item.index, total.result());
  };
  tbb::parallel_pipeline(slots.size(),
                         tbb::make_filter<void, Item>(tbb::filter_mode::serial_in_order, fetch) &
                             tbb::make_filter<Item, void>(tbb::filter_mode::parallel, compare));
}

namespace {

// The units compare_in_memory() compares a pair in: PairPlan's, over the chunks the writer would
// store; the side with fewer chunks drives, each of its chunks is one accumulation.
std::vector<ChunkExtent> units_in_memory(const formats::TensorView& eager,
                                         const formats::TensorView& compiled,
                                         std::size_t chunk_bytes) {
  auto eager_chunks = formats::chunk_extents(eager.dtype, eager.shape, chunk_bytes);
  auto compiled_chunks = formats::chunk_extents(compiled.dtype, compiled.shape, chunk_bytes);
  return eager_chunks.size() <= compiled_chunks.size() ? std::move(eager_chunks)
                                                       : std::move(compiled_chunks);
}

bool same_units(const std::vector<ChunkExtent>& x, const std::vector<ChunkExtent>& y) {
  return std::equal(
      x.begin(), x.end(), y.begin(), y.end(), [](const ChunkExtent& a, const ChunkExtent& b) {
        return a.first_element == b.first_element && a.element_count == b.element_count;
      });
}

const std::byte* element_bytes(const formats::TensorView& view, std::uint64_t element) {
  return static_cast<const std::byte*>(view.data) + element * formats::dtype_size(view.dtype);
}

// `units` compared on every thread of the caller's arena, `compare_unit(unit, part, buffers)`
// filling the partial results of a unit, merged in element order: the same bits as one unit
// after the other.
template <typename Parts, typename CompareUnit>
void compare_units(const std::vector<ChunkExtent>& units, Parts& parts,
                   const CompareUnit& compare_unit) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, units.size(), 1),
                    [&](const tbb::blocked_range<std::size_t>& range) {
                      DecodeBuffers buffers;
                      for (std::size_t i = range.begin(); i != range.end(); ++i) {
                        compare_unit(units[i], parts[i], buffers);
                      }
                    });
}

}  // namespace

TensorMetrics compare_in_memory(const formats::TensorView& eager,
                                const formats::TensorView& compiled, const Tolerances& tolerances,
                                std::size_t chunk_bytes, MetricSet set) {
  const std::vector<ChunkExtent> units = units_in_memory(eager, compiled, chunk_bytes);
  std::vector<MetricsAccumulator> parts(units.size(), MetricsAccumulator(set));
  compare_units(units, parts,
                [&](const ChunkExtent& unit, MetricsAccumulator& part, DecodeBuffers& buffers) {
                  part = compare_values(eager.dtype, element_bytes(eager, unit.first_element),
                                        compiled.dtype, element_bytes(compiled, unit.first_element),
                                        unit.element_count, unit.first_element, tolerances, set,
                                        buffers.eager_f32, buffers.compiled_f32);
                });
  MetricsAccumulator total(set);
  for (const MetricsAccumulator& part : parts) total.merge(part);
  return total.result();
}

ReferenceComparisons compare_with_reference_in_memory(const formats::TensorView& eager,
                                                      const formats::TensorView& compiled,
                                                      const formats::TensorView& reference,
                                                      const Tolerances& tolerances,
                                                      std::size_t chunk_bytes, bool with_pair) {
  const std::vector<ChunkExtent> units = units_in_memory(eager, compiled, chunk_bytes);
  const std::uint64_t values = formats::value_count(eager.dtype);
  if (!same_units(units, units_in_memory(reference, eager, chunk_bytes)) ||
      !same_units(units, units_in_memory(reference, compiled, chunk_bytes)) ||
      formats::value_count(compiled.dtype) != values ||
      formats::value_count(reference.dtype) != values) {
    // Chunks that do not line up: three comparisons, each in its own units.
    ReferenceComparisons apart;
    if (with_pair) apart.pair = compare_in_memory(eager, compiled, tolerances, chunk_bytes);
    apart.reference_eager =
        compare_in_memory(reference, eager, tolerances, chunk_bytes, MetricSet::kVerdict);
    apart.reference_compiled =
        compare_in_memory(reference, compiled, tolerances, chunk_bytes, MetricSet::kVerdict);
    return apart;
  }
  // compare_values() for the three at once: each sub-block of each side converted once, and
  // compared three times while it is in the core's cache.
  struct Three {
    MetricsAccumulator pair{MetricSet::kAll};
    MetricsAccumulator reference_eager{MetricSet::kVerdict};
    MetricsAccumulator reference_compiled{MetricSet::kVerdict};
  };
  std::vector<Three> parts(units.size());
  const std::uint64_t step = std::max<std::uint64_t>(1, kSubBlockValues / values);
  compare_units(units, parts, [&](const ChunkExtent& unit, Three& part, DecodeBuffers& buffers) {
    for (std::uint64_t start = 0; start < unit.element_count; start += step) {
      const std::uint64_t n = std::min(step, unit.element_count - start);
      const std::uint64_t first = unit.first_element + start;
      if (start + n < unit.element_count) {  // as compare_values() does
        const std::uint64_t next = std::min(step, unit.element_count - start - n);
        for (const formats::TensorView* side : {&eager, &compiled, &reference}) {
          const std::size_t size = formats::dtype_size(side->dtype);
          prefetch(element_bytes(*side, first + n), next * size);
        }
      }
      const float* e = as_float32(eager.dtype, element_bytes(eager, first), n, buffers.eager_f32);
      const float* c =
          as_float32(compiled.dtype, element_bytes(compiled, first), n, buffers.compiled_f32);
      const float* r =
          as_float32(reference.dtype, element_bytes(reference, first), n, buffers.reference_f32);
      if (with_pair) part.pair.accumulate(e, c, n * values, first * values, tolerances);
      part.reference_eager.accumulate(r, e, n * values, first * values, tolerances);
      part.reference_compiled.accumulate(r, c, n * values, first * values, tolerances);
    }
  });
  Three total;
  for (const Three& part : parts) {
    total.pair.merge(part.pair);
    total.reference_eager.merge(part.reference_eager);
    total.reference_compiled.merge(part.reference_compiled);
  }
  ReferenceComparisons together;
  if (with_pair) together.pair = total.pair.result();
  together.reference_eager = total.reference_eager.result();
  together.reference_compiled = total.reference_compiled.result();
  return together;
}

}  // namespace dynaprobe::analyze
