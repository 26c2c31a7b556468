// A tensor as a step file stores it: its /index entry (RecordInfo), its chunks (ChunkExtent,
// RawChunk) and a stream that reads them (TensorStream). The reader (reader.h) hands these out,
// and formats' private parts (the chunk layout, the index, the format generations) work on them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dynaprobe/formats/dtype.h"
#include "dynaprobe/formats/record.h"

namespace dynaprobe::formats {

struct RecordInfo {
  RecordKey key;
  std::string label;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::uint64_t stored_bytes = 0;  // bytes on disk after compression
  // A tensor stored as one chunk: where that chunk lies in the step file, its HDF5 filter mask
  // and the hash (XXH64 in format 1.x, XXH3-64 since 2.0) of its stored bytes, so that reading it
  // takes one pread instead of opening its dataset (the cost that dominates small records).
  // chunk_offset 0: not known (several chunks, 0-d or empty tensors, files of format 1.0); the
  // dataset is read through HDF5.
  std::uint64_t chunk_offset = 0;
  std::uint32_t chunk_filter_mask = 0;
  std::uint64_t chunk_hash = 0;
  // Per chunk in chunk order, the hash of its stored bytes: since format 2.0 of every chunk of
  // every chunked record (XXH3-64); in 1.2 to 1.4 of the chunks of a tensor stored as several,
  // XXH64 when stored as it is (filter mask 0b11), 0 when compressed (zstd's content checksum
  // covers it). Empty: not known (older files); chunks are then not checked.
  std::vector<std::uint64_t> chunk_hashes;

  // False for a record whose tensor the capture judged in memory and did not store (format
  // 1.3, PrecisionChecker(dump="failing" or "stats")): dtype and shape only; open() refuses it.
  bool stored = true;

  std::uint64_t numel() const;
  std::uint64_t nbytes() const { return numel() * dtype_size(dtype); }
};

// A run of elements of a tensor in flat C order.
struct ChunkExtent {
  std::uint64_t first_element = 0;
  std::uint64_t element_count = 0;
};

// The chunks a StepWriter with this chunk_bytes stores a tensor of this dtype and shape in, as
// TensorStream::extent() reads them back: one extent for 0-d tensors, none for empty ones.
std::vector<ChunkExtent> chunk_extents(DType dtype, const std::vector<std::int64_t>& shape,
                                       std::size_t chunk_bytes);

// A chunk as stored: its bytes and HDF5's filter mask (bit i set: filter i was skipped).
struct RawChunk {
  std::vector<std::byte> bytes;
  std::uint32_t filter_mask = 0;
};

// One stored tensor, read chunk by chunk. fetch() reads a chunk's stored bytes: with one pread
// for a record /index locates, else through HDF5 under its lock; decode() needs no lock and may
// run on many threads at once. Datasets that do not use dynaprobe's chunk layout (other tools'
// files, other filters) are one "chunk" read whole through HDF5's own pipeline.
class TensorStream {
 public:
  DType dtype() const;
  const std::vector<std::int64_t>& shape() const;
  std::size_t chunk_count() const;
  ChunkExtent extent(std::size_t chunk) const;

  void fetch(std::size_t chunk, RawChunk& raw) const;
  // Returns extent(chunk).element_count decoded elements, in `raw` (nothing to decode) or `out`.
  // `scratch` is a reusable work buffer. Throws FormatError for corrupt chunk data.
  const std::byte* decode(std::size_t chunk, RawChunk& raw, std::vector<std::byte>& out,
                          std::vector<std::byte>& scratch) const;

  struct State;
  explicit TensorStream(std::shared_ptr<const State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<const State> state_;
};

}  // namespace dynaprobe::formats
