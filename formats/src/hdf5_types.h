// HDF5 datatypes of dynaprobe dtypes and of the /index table, shared by writer and reader.
#pragma once

#include <cstdint>

#include "dynaprobe/formats/dtype.h"
#include "dynaprobe/formats/hdf5.h"

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
};
// The /index row type; without the chunk location fields for files of format 1.0.
h5::Handle index_row_type(bool with_chunk_location = true);

}  // namespace dynaprobe::formats
