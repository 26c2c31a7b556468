// The stages of StepWriter's write pipeline that need no HDF5: which chunk comes next, and
// compressing one chunk. writer.cpp runs them, with the stage that writes chunks to HDF5, in a
// tbb::parallel_pipeline (docs/design.md, Threads). Private to formats; tests/formats includes
// it for white-box tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "chunk_layout.h"
#include "dynaprobe/formats/record.h"

namespace dynaprobe::formats {

// Work buffers of one pipeline token, reused from chunk to chunk and step to step.
struct ChunkBuffers {
  std::vector<std::byte> padded;  // a partial edge chunk, zero-padded to the chunk size
  std::vector<std::byte> shuffled;
  std::vector<std::byte> compressed;
};

// One record of a write() and its chunk layout (none for 0-d and empty tensors).
struct WritePlan {
  const Record* record = nullptr;
  std::optional<ChunkLayout> layout;
};

// One item of the pipeline: a chunk, or a whole record without chunks (0-d and empty tensors).
struct ChunkItem {
  const WritePlan* plan = nullptr;
  std::size_t chunk = 0;
  bool has_chunk = false;
  bool first = false;               // the record's first item: its dataset is created
  bool last = false;                // the record's last item: its dataset is closed and indexed
  ChunkBuffers* buffers = nullptr;  // the token's buffers, for items with a chunk
  // What compress_chunk() made of the chunk: the bytes to store (in `buffers` or the record's
  // tensor) and HDF5's filter mask for them.
  const std::byte* payload = nullptr;
  std::size_t payload_size = 0;
  unsigned filter_mask = 0;
  // Whether the payload is the record's own bytes (a chunk stored as it is, not at the edge):
  // memory that lives as long as the write() call, which the disk may write from directly.
  bool payload_in_record = false;
  // Of a record's only chunk, for /index, and of every chunk stored as it is, for /chunk_hashes.
  std::uint64_t payload_hash = 0;
};

// The items of `plans` in order: every chunk of every record, one item for a record without
// chunks. `plans` must outlive the sequence and its items.
class ChunkSequence {
 public:
  explicit ChunkSequence(const std::vector<WritePlan>& plans) : plans_(plans) {}
  // The next item, without buffers; nullopt after the last.
  std::optional<ChunkItem> next();

 private:
  const std::vector<WritePlan>& plans_;
  std::size_t next_plan_ = 0;
  std::size_t next_chunk_ = 0;
};

// Sets the payload of an item with a chunk (others are left as they are): the chunk shuffled and
// zstd-compressed at `zstd_level` into item.buffers, or, when that would not shrink it by
// `min_compression_ratio`, its bytes as they are (zero-padded to the full chunk size at the edge),
// with filter mask schema::kAllFiltersSkipped. Thread-safe for items with distinct buffers.
void compress_chunk(ChunkItem& item, int zstd_level, double min_compression_ratio);

}  // namespace dynaprobe::formats
