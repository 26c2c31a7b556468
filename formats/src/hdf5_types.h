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

// Format 2.0's /index: a packed compound of fixed-size fields, nothing variable-length (so nothing
// in HDF5's global heap): the strings fixed-length, NUL-padded, each field as long as its longest
// value in the file; the shape as `rank` (uint32) and `shape` (int64[the file's largest rank, at
// least 1], unused dimensions 0). docs/dump-format.md lists the fields.
struct PackedIndex {
  h5::Handle type;               // the file type (and memory type) of the table
  std::vector<std::byte> bytes;  // the rows as stored
};
PackedIndex pack_index(const std::vector<IndexRow>& rows);

// Rows of a format 2.0 /index read back from its bytes as stored: IndexRow views into strings and
// dimensions this object owns.
class UnpackedIndex {
 public:
  // `type` is the dataset's stored type, `bytes` its rows as stored (read with that type). Throws
  // FormatError naming `where` when a field is missing, variable-length or not of its 2.0 type,
  // or a row's rank exceeds the shape field.
  UnpackedIndex(hid_t type, const std::vector<std::byte>& bytes, const std::string& where);
  const std::vector<IndexRow>& rows() const { return rows_; }

 private:
  std::vector<std::string> text_;
  std::vector<std::int64_t> dims_;
  std::vector<IndexRow> rows_;
};

// Throws FormatError naming `where` when `type` holds anything variable-length (a format 2.0 file
// never does: reading it would read HDF5's global heap).
void refuse_variable_length(hid_t type, const std::string& where);

// The checksum of a format 2.0 /index: XXH3-64 of the index's bytes as stored, then the chunk
// hashes, the step and the provenance as index_checksum() appends them.
std::uint64_t index_checksum_v2(const std::vector<std::byte>& index_bytes,
                                const std::vector<std::uint64_t>& chunk_hashes, std::int64_t step,
                                const std::map<std::string, std::string>& provenance);

// Format 2.0's checksums of /modules and /graphs (XXH3-64 of canonical bytes, texts as
// index_checksum() writes them): the modules in creation order, each its name, its attribute
// count and its attributes (name, value) in byte order of the names; the graphs in byte order of
// their names, each its name, its text, its attribute count and attributes (with `kind`) so.
struct NamedAttributes {
  std::string name;
  std::string text;  // a graph's source; empty for a module
  std::map<std::string, std::string> attributes;
};
std::uint64_t group_checksum(const std::vector<NamedAttributes>& entries, bool with_text);

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
