// HDF5 datatypes of dynaprobe dtypes and of the /index table, shared by writer and reader.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dynaprobe/formats/dtype.h"
#include "dynaprobe/formats/metrics.h"
#include "h5.h"

namespace dynaprobe::formats {

// The HDF5 type a dtype is stored as: IEEE floats, a custom 2-byte float for bfloat16 (so h5py
// reads numbers), uint8 for float8 (the dtype attribute says which), h5py's int8 enum for bool.
h5::Handle stored_type(DType dtype);

// Which dtype an HDF5 type read from another tool's file holds; throws FormatError if none.
DType dtype_of_hdf5_type(hid_t type, std::string_view where);

// One row of /index in memory. Strings and shape are variable-length.
struct IndexRow {
  const char* module;
  std::uint32_t call;
  const char* kind;
  std::uint32_t tensor_index;
  const char* side;
  const char* label;
  const char* dtype;
  hvl_t shape;
  std::uint64_t stored_bytes;
  std::uint64_t chunk_offset;  // since format 1.1
  std::uint32_t chunk_filter_mask;
  std::uint64_t chunk_hash;
  std::uint64_t chunk_hashes_first;  // since format 1.2
  std::uint64_t chunk_count;
};
// The /index row type; without the chunk location fields for files of format 1.0, without the
// chunk hash fields for files older than 1.2.
h5::Handle index_row_type(bool with_chunk_location = true, bool with_chunk_hashes = true);

// The checksum of /index (format 1.2): XXH64 of a canonical byte string of every row (strings
// length-prefixed, integers little-endian), the chunk hashes, the step and the provenance (keys
// in order). Writer and reader compute it the same way; docs/dump-format.md gives the layout.
std::uint64_t index_checksum(const std::vector<IndexRow>& rows,
                             const std::vector<std::uint64_t>& chunk_hashes, std::int64_t step,
                             const std::map<std::string, std::string>& provenance);

// One row of /metrics (format 1.3) in memory: a pair's metrics judged at capture. `record` is the
// position in /index of the pair's key. The file stores the fields packed (no padding bytes).
struct MetricsRow {
  std::uint64_t record = 0;
  Tolerances tolerances;
  TensorMetrics metrics;
};
// The in-memory row type (the file's is the same, packed).
h5::Handle metrics_row_type();

}  // namespace dynaprobe::formats
