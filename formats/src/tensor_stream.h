// TensorStream's state and how StepReader makes one: a record's dataset opened through HDF5, or a
// record whose only chunk /index locates, read with one pread. Private to formats.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "chunk_layout.h"
#include "dynaprobe/formats/stored_tensor.h"
#include "format_reader.h"
#include "h5.h"

namespace dynaprobe::formats {

struct TensorStream::State {
  std::shared_ptr<h5::Handle> file;  // keeps the file open while the stream lives
  h5::Handle dataset;
  std::string where;
  // The generation whose rules check the chunks: a step file's, or format 1's for datasets of
  // other tools (nothing to check but zstd's own checksum).
  const FormatReader* format = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 0;
  // dynaprobe's chunk layout with at most shuffle then zstd: read with H5Dread_chunk.
  std::optional<ChunkLayout> layout;
  int shuffle_bit = -1;  // position of each filter in the pipeline (its filter-mask bit)
  int zstd_bit = -1;
  // A record whose only chunk /index locates: fetch() preads it, no HDF5 call, no lock.
  struct Located {
    int fd = -1;
    std::string file_name, dataset;
    std::uint64_t offset = 0, size = 0, hash = 0;
    std::uint32_t filter_mask = 0;
    HashAlgorithm algorithm = HashAlgorithm::kXxh64;  // of `hash`: the generation's
  };
  std::optional<Located> located;
  // Per chunk, from /index: the hashes `format` checks chunks against (FormatReader::check_chunk).
  std::vector<std::uint64_t> chunk_hashes;

  // Whether filter `bit` of the pipeline was applied to a chunk stored with `filter_mask`.
  bool applied(int bit, std::uint32_t filter_mask) const {
    return bit >= 0 && !(filter_mask & (1u << bit));
  }
};

// Opens a step file read-only and tells the open observer, telling "cannot read" (IoError) from
// "not a valid HDF5 file" (FormatError).
std::shared_ptr<h5::Handle> open_file(const std::filesystem::path& path);

// Opens `dataset_name` of `file` (`file_name` names it in errors) and its chunk layout; the dtype
// attribute is read as `format` stores strings. Throws FormatError when the dataset is missing or
// its dtype is not `expected_dtype`.
std::shared_ptr<TensorStream::State> open_state(std::shared_ptr<h5::Handle> file,
                                                const std::string& dataset_name,
                                                const std::string& file_name,
                                                std::optional<DType> expected_dtype,
                                                const FormatReader& format);

// Whether `record` can be read with one pread of `fd` at the offset /index gives.
bool is_located(int fd, const RecordInfo& record);

// A stream over a record whose only chunk /index locates; nothing is read until fetch().
TensorStream located_stream(std::shared_ptr<h5::Handle> file, int fd, const RecordInfo& record,
                            const std::string& file_name, const FormatReader& format);

}  // namespace dynaprobe::formats
