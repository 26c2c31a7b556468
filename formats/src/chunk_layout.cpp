#include "chunk_layout.h"

#include <algorithm>

namespace dynaprobe::formats {
namespace {
std::uint64_t product(const std::vector<std::int64_t>& shape, std::size_t from, std::size_t to) {
  std::uint64_t n = 1;
  for (std::size_t i = from; i < to; ++i) n *= static_cast<std::uint64_t>(shape[i]);
  return n;
}

// Rows per chunk for a dimension of `dim` rows, at most `max_rows`. HDF5 stores an edge chunk at
// full size, so the writer pads it with zeros (a copy, and bytes to compress or store for
// nothing): with `max_rows` rows as such, a tensor of 3,072 rows of 768 float32 would end in a
// chunk of 3 rows padded to 341. So the fewest chunks that divide `dim` exactly, if at most a
// quarter more than `max_rows` needs (no edge chunk: 12 of 256 rows), else as few chunks as
// `max_rows` needs, all the same size but the last, which then lacks fewer rows than there are
// chunks.
std::uint64_t rows_per_chunk(std::uint64_t dim, std::uint64_t max_rows) {
  const std::uint64_t chunks = (dim + max_rows - 1) / max_rows;
  for (std::uint64_t count = chunks; count <= chunks + chunks / 4; ++count) {
    if (dim % count == 0) return dim / count;
  }
  return (dim + chunks - 1) / chunks;
}
}  // namespace

ChunkLayout ChunkLayout::plan(const std::vector<std::int64_t>& shape, std::size_t element_size,
                              std::size_t target_bytes) {
  const std::uint64_t target_elements = std::max<std::uint64_t>(1, target_bytes / element_size);
  // The longest suffix of dimensions that fits in one chunk is taken whole; the dimension before
  // it is cut into blocks of `rows`.
  std::size_t split = shape.size() - 1;
  while (split > 0 && product(shape, split, shape.size()) <= target_elements) --split;
  ChunkLayout layout;
  layout.shape_ = shape;
  layout.split_ = split;
  layout.inner_ = product(shape, split + 1, shape.size());
  const auto dim = static_cast<std::uint64_t>(shape[split]);
  layout.rows_ =
      rows_per_chunk(dim, std::clamp<std::uint64_t>(target_elements / layout.inner_, 1, dim));
  layout.blocks_ = static_cast<std::size_t>((dim + layout.rows_ - 1) / layout.rows_);
  layout.outer_count_ = static_cast<std::size_t>(product(shape, 0, split));
  layout.chunk_dims_.assign(shape.size(), 1);
  layout.chunk_dims_[split] = layout.rows_;
  for (std::size_t i = split + 1; i < shape.size(); ++i) layout.chunk_dims_[i] = shape[i];
  return layout;
}

std::optional<ChunkLayout> ChunkLayout::from_chunk_dims(const std::vector<std::int64_t>& shape,
                                                        const std::vector<hsize_t>& chunk_dims) {
  if (shape.empty() || chunk_dims.size() != shape.size()) return std::nullopt;
  // Find the split: the first dimension whose chunk extent is not 1 (or the last one).
  std::size_t split = 0;
  while (split + 1 < shape.size() && chunk_dims[split] == 1) ++split;
  for (std::size_t i = split + 1; i < shape.size(); ++i) {
    if (chunk_dims[i] != static_cast<hsize_t>(shape[i])) return std::nullopt;
  }
  ChunkLayout layout;
  layout.shape_ = shape;
  layout.split_ = split;
  layout.inner_ = product(shape, split + 1, shape.size());
  layout.rows_ = chunk_dims[split];
  const auto dim = static_cast<std::uint64_t>(shape[split]);
  layout.blocks_ = static_cast<std::size_t>((dim + layout.rows_ - 1) / layout.rows_);
  layout.outer_count_ = static_cast<std::size_t>(product(shape, 0, split));
  layout.chunk_dims_ = chunk_dims;
  return layout;
}

ChunkExtent ChunkLayout::extent(std::size_t chunk) const {
  const std::uint64_t outer = chunk / blocks_;
  const std::uint64_t block = chunk % blocks_;
  const auto dim = static_cast<std::uint64_t>(shape_[split_]);
  const std::uint64_t first_row = block * rows_;
  const std::uint64_t rows = std::min(rows_, dim - first_row);
  return {(outer * dim + first_row) * inner_, rows * inner_};
}

std::vector<hsize_t> ChunkLayout::offset(std::size_t chunk) const {
  std::vector<hsize_t> coordinates(shape_.size(), 0);
  std::uint64_t outer = chunk / blocks_;
  coordinates[split_] = (chunk % blocks_) * rows_;
  for (std::size_t i = split_; i-- > 0;) {
    const auto dim = static_cast<std::uint64_t>(shape_[i]);
    coordinates[i] = outer % dim;
    outer /= dim;
  }
  return coordinates;
}

std::vector<ChunkExtent> chunk_extents(DType dtype, const std::vector<std::int64_t>& shape,
                                       std::size_t chunk_bytes) {
  const std::uint64_t numel = shape_numel(shape);
  if (numel == 0) return {};
  if (shape.empty()) return {ChunkExtent{0, numel}};
  const ChunkLayout layout = ChunkLayout::plan(shape, dtype_size(dtype), chunk_bytes);
  std::vector<ChunkExtent> extents(layout.chunk_count());
  for (std::size_t i = 0; i < extents.size(); ++i) extents[i] = layout.extent(i);
  return extents;
}

}  // namespace dynaprobe::formats
