#include "tensor_pair.h"

#include <tbb/concurrent_queue.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace dynaprobe::analyze {
namespace {

using formats::ChunkExtent;
using formats::RawChunk;
using formats::TensorStream;

// Where each chunk of a stream starts, for finding the chunks that overlap an element range.
std::vector<std::uint64_t> chunk_starts(const TensorStream& stream) {
  std::vector<std::uint64_t> starts(stream.chunk_count());
  for (std::size_t i = 0; i < starts.size(); ++i) starts[i] = stream.extent(i).first_element;
  return starts;
}

// A unit of work: one chunk of the driving stream and the chunks of the other stream that
// overlap its elements.
struct Unit {
  std::size_t driver_chunk = 0;
  std::size_t follower_first = 0;
  std::size_t follower_count = 0;
};

// Work buffers of one pipeline token, reused from unit to unit.
struct Slot {
  RawChunk driver_raw;
  std::vector<RawChunk> follower_raw;
  std::vector<std::byte> driver_out, follower_out, scratch;  // decoding
  std::vector<std::byte> follower_bytes;  // the follower's elements of a unit spanning chunks
  std::vector<float> driver_f32, follower_f32;
  MetricsAccumulator metrics;
};

// The unit's elements of `stream` as float32: a pointer into `bytes` when they already are.
const float* as_float32(formats::DType dtype, const std::byte* bytes, std::uint64_t count,
                        std::vector<float>& buffer) {
  if (dtype == formats::DType::kFloat32) return reinterpret_cast<const float*>(bytes);
  buffer.resize(count);
  formats::convert_to_float32(dtype, bytes, count, buffer.data());
  return buffer.data();
}

}  // namespace

TensorMetrics compare_tensors(const TensorStream& eager, const TensorStream& compiled,
                        const Tolerances& tolerances, std::atomic<std::uint64_t>& progress_bytes) {
  // The stream with fewer (larger) chunks drives; each of its chunks pairs with the overlapping
  // chunks of the other, which are fetched once, or twice where chunk boundaries do not align.
  const bool eager_drives = eager.chunk_count() <= compiled.chunk_count();
  const TensorStream& driver = eager_drives ? eager : compiled;
  const TensorStream& follower = eager_drives ? compiled : eager;
  const std::size_t driver_size = formats::dtype_size(driver.dtype());
  const std::size_t follower_size = formats::dtype_size(follower.dtype());
  const auto follower_starts = chunk_starts(follower);

  const std::size_t count = driver.chunk_count();
  const std::size_t tokens = std::max<std::size_t>(
      1, std::min<std::size_t>(count, 2 * static_cast<std::size_t>(
                                              tbb::this_task_arena::max_concurrency())));
  std::vector<Slot> slots(tokens);
  tbb::concurrent_bounded_queue<Slot*> free_slots;
  for (auto& slot : slots) free_slots.push(&slot);
  MetricsAccumulator total;

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
    item.unit.driver_chunk = next++;
    const ChunkExtent extent = driver.extent(item.unit.driver_chunk);
    const auto first = std::upper_bound(follower_starts.begin(), follower_starts.end(),
                                        extent.first_element) - follower_starts.begin() - 1;
    std::size_t last = static_cast<std::size_t>(first);
    while (last + 1 < follower_starts.size() &&
           follower_starts[last + 1] < extent.first_element + extent.element_count) {
      ++last;
    }
    item.unit.follower_first = static_cast<std::size_t>(first);
    item.unit.follower_count = last - static_cast<std::size_t>(first) + 1;
    free_slots.pop(item.slot);
    Slot& slot = *item.slot;
    driver.fetch(item.unit.driver_chunk, slot.driver_raw);
    slot.follower_raw.resize(std::max(slot.follower_raw.size(), item.unit.follower_count));
    for (std::size_t i = 0; i < item.unit.follower_count; ++i) {
      follower.fetch(item.unit.follower_first + i, slot.follower_raw[i]);
    }
    return item;
  };
  const auto compare = [&](Item item) -> Item {
    Slot& slot = *item.slot;
    const ChunkExtent extent = driver.extent(item.unit.driver_chunk);
    const std::byte* driver_bytes =
        driver.decode(item.unit.driver_chunk, slot.driver_raw, slot.driver_out, slot.scratch);
    const float* driver_values =
        as_float32(driver.dtype(), driver_bytes, extent.element_count, slot.driver_f32);
    // Gather the follower's elements of this unit (usually one whole chunk: no copy).
    const std::byte* follower_bytes = nullptr;
    for (std::size_t i = 0; i < item.unit.follower_count; ++i) {
      const std::size_t chunk = item.unit.follower_first + i;
      const ChunkExtent part = follower.extent(chunk);
      const std::byte* data =
          follower.decode(chunk, slot.follower_raw[i], slot.follower_out, slot.scratch);
      const std::uint64_t begin = std::max(part.first_element, extent.first_element);
      const std::uint64_t end = std::min(part.first_element + part.element_count,
                                         extent.first_element + extent.element_count);
      const std::byte* source = data + (begin - part.first_element) * follower_size;
      if (item.unit.follower_count == 1) {  // the usual case: aligned chunks, no copy
        follower_bytes = source;
        break;
      }
      slot.follower_bytes.resize(extent.element_count * follower_size);
      std::memcpy(slot.follower_bytes.data() + (begin - extent.first_element) * follower_size,
                  source, (end - begin) * follower_size);
      follower_bytes = slot.follower_bytes.data();
    }
    const float* follower_values =
        as_float32(follower.dtype(), follower_bytes, extent.element_count, slot.follower_f32);
    slot.metrics = MetricsAccumulator();
    const float* eager_values = eager_drives ? driver_values : follower_values;
    const float* compiled_values = eager_drives ? follower_values : driver_values;
    slot.metrics.accumulate(eager_values, compiled_values, extent.element_count,
                            extent.first_element, tolerances);
    progress_bytes += extent.element_count * (driver_size + follower_size);
    return item;
  };
  const auto merge = [&](Item item) {
    total.merge(item.slot->metrics);
    free_slots.push(item.slot);
  };
  tbb::parallel_pipeline(tokens,
                         tbb::make_filter<void, Item>(tbb::filter_mode::serial_in_order, fetch) &
                             tbb::make_filter<Item, Item>(tbb::filter_mode::parallel, compare) &
                             tbb::make_filter<Item, void>(tbb::filter_mode::serial_in_order, merge));
  return total.result();
}

}  // namespace dynaprobe::analyze
