// The write pipeline's stages that need no HDF5 (chunk_pipeline.h): which chunk comes next, and
// compressing one chunk.
#include "chunk_pipeline.h"

#include <cstring>

#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/schema.h"

namespace dynaprobe::formats {
namespace {

// Whether zstd can be expected to shrink a chunk, once shuffled, by `min_ratio`, judged from a
// sample: four windows of 1,024 elements spread over the chunk, their bytes taken plane by plane
// as the shuffle would order them, compressed together. That costs about 2% of compressing a
// 1 MiB chunk, and a chunk stored as it is is never shuffled; chunks under 16 times the sample
// are judged by compressing them.
bool shrinks_enough(int level, const std::byte* raw, std::size_t size, std::size_t element_size,
                    double min_ratio, std::vector<std::byte>& work) {
  constexpr std::size_t kWindows = 4, kWindowElements = 1024;
  const std::size_t elements = size / element_size;
  const std::size_t sample_bytes = kWindows * kWindowElements * element_size;
  if (min_ratio <= 1.0 || size < 16 * sample_bytes) return true;
  work.resize(sample_bytes + zstd_bound(sample_bytes));
  std::byte* sample = work.data();
  for (std::size_t p = 0; p < element_size; ++p) {
    for (std::size_t w = 0; w < kWindows; ++w) {
      const std::byte* window =
          raw + ((2 * w + 1) * elements / (2 * kWindows) - kWindowElements / 2) * element_size + p;
      std::byte* out = sample + (p * kWindows + w) * kWindowElements;
      for (std::size_t i = 0; i < kWindowElements; ++i) out[i] = window[i * element_size];
    }
  }
  const std::size_t compressed = zstd_compress(
      level, sample, sample_bytes, work.data() + sample_bytes, work.size() - sample_bytes);
  return compressed != 0 &&
         static_cast<double>(compressed) * min_ratio <= static_cast<double>(sample_bytes);
}

}  // namespace

std::optional<ChunkItem> ChunkSequence::next() {
  if (next_plan_ == plans_.size()) return std::nullopt;
  const WritePlan& plan = plans_[next_plan_];
  const std::size_t count = plan.layout ? plan.layout->chunk_count() : 0;
  ChunkItem item;
  item.plan = &plan;
  item.chunk = next_chunk_;
  item.has_chunk = count > 0;
  item.first = next_chunk_ == 0;
  item.last = next_chunk_ + 1 >= count;
  if (item.last) {
    ++next_plan_;
    next_chunk_ = 0;
  } else {
    ++next_chunk_;
  }
  return item;
}

void compress_chunk(ChunkItem& item, int zstd_level, double min_compression_ratio) {
  if (!item.has_chunk) return;
  const ChunkLayout& layout = *item.plan->layout;
  const TensorView& tensor = item.plan->record->tensor;
  const std::size_t element_size = dtype_size(tensor.dtype);
  const ChunkExtent extent = layout.extent(item.chunk);
  const std::size_t chunk_bytes = layout.chunk_elements() * element_size;
  const std::size_t valid_bytes = extent.element_count * element_size;
  ChunkBuffers& work = *item.buffers;
  const std::byte* raw =
      static_cast<const std::byte*>(tensor.data) + extent.first_element * element_size;
  if (valid_bytes < chunk_bytes) {  // HDF5 stores edge chunks at full size
    work.padded.resize(chunk_bytes);
    std::memcpy(work.padded.data(), raw, valid_bytes);
    std::memset(work.padded.data() + valid_bytes, 0, chunk_bytes - valid_bytes);
    raw = work.padded.data();
  }
  std::size_t size = 0;  // not compressed
  if (shrinks_enough(zstd_level, raw, chunk_bytes, element_size, min_compression_ratio,
                     work.compressed)) {
    const std::byte* input = raw;
    if (element_size > 1) {
      work.shuffled.resize(chunk_bytes);
      shuffle_bytes(raw, work.shuffled.data(), chunk_bytes, element_size);
      input = work.shuffled.data();
    }
    work.compressed.resize(zstd_bound(chunk_bytes));
    size = zstd_compress(zstd_level, input, chunk_bytes, work.compressed.data(),
                         work.compressed.size());
  }
  if (size == 0 ||
      static_cast<double>(size) * min_compression_ratio >= static_cast<double>(chunk_bytes)) {
    // not worth it: store the bytes as they are
    item.payload = raw;
    item.payload_size = chunk_bytes;
    item.filter_mask = schema::kAllFiltersSkipped;
    item.payload_in_record = valid_bytes == chunk_bytes;
  } else {
    item.payload = work.compressed.data();
    item.payload_size = size;
  }
  item.payload_hash = xxh3(item.payload, item.payload_size);  // format 2.0: every chunk
}

}  // namespace dynaprobe::formats
