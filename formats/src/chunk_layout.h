// dynaprobe's chunk layout: chunk dimensions (1, ..., 1, k, d[s+1], ..., d[n-1]), so that every
// chunk covers one contiguous run of the tensor's elements in C order. That makes a chunk a plain
// byte range for H5Dwrite_chunk / H5Dread_chunk, whatever the rank of the tensor.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dynaprobe/formats/stored_tensor.h"

namespace dynaprobe::formats {

class ChunkLayout {
 public:
  // Chunks of at most max(target_bytes, element_size) bytes for a tensor of this shape.
  // The shape must be non-empty (rank >= 1) with no zero dimension.
  static ChunkLayout plan(const std::vector<std::int64_t>& shape, std::size_t element_size,
                          std::size_t target_bytes);
  // The layout of existing chunk dimensions, if they have dynaprobe's form.
  static std::optional<ChunkLayout> from_chunk_dims(const std::vector<std::int64_t>& shape,
                                                    const std::vector<hsize_t>& chunk_dims);

  const std::vector<hsize_t>& chunk_dims() const { return chunk_dims_; }
  std::size_t chunk_count() const { return outer_count_ * blocks_; }
  std::uint64_t chunk_elements() const { return rows_ * inner_; }  // nominal, with padding
  ChunkExtent extent(std::size_t chunk) const;
  std::vector<hsize_t> offset(std::size_t chunk) const;  // for H5Dwrite_chunk / H5Dread_chunk

 private:
  std::vector<std::int64_t> shape_;
  std::vector<hsize_t> chunk_dims_;
  std::size_t split_ = 0;        // the one dimension that chunks cut in blocks of rows_
  std::uint64_t rows_ = 1;       // chunk extent along split_
  std::uint64_t inner_ = 1;      // elements in the dimensions after split_
  std::size_t blocks_ = 1;       // chunks along split_
  std::size_t outer_count_ = 1;  // product of the dimensions before split_
};

}  // namespace dynaprobe::formats
