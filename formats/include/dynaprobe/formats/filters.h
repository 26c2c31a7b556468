// The chunk filters of a dump: HDF5's byte shuffle (id 2) and zstd (registered id 32015), both
// also usable directly on buffers for H5Dwrite_chunk / H5Dread_chunk.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dynaprobe::formats {

// Registers the zstd filter with the HDF5 library in this process (idempotent). Compatible with
// the reference plugin of hdf5_plugins and with hdf5plugin.Zstd: one zstd frame per chunk with
// its content size (dynaprobe's writer adds zstd's content checksum), level in cd_values[0].
void register_zstd_filter();

// HDF5's shuffle: byte b of element i goes to position b * n + i (n = size / element_size);
// trailing bytes that do not fill an element are copied unchanged. `dst` and `src` must not
// overlap.
void shuffle_bytes(const std::byte* src, std::byte* dst, std::size_t size,
                   std::size_t element_size);
void unshuffle_bytes(const std::byte* src, std::byte* dst, std::size_t size,
                     std::size_t element_size);

// XXH64 with seed 0 (the hash of xxHash, whose low 32 bits zstd stores as a frame's content
// checksum): /index keeps it for the stored bytes of each single-chunk record, so a reader that
// fetches such a chunk by its file offset can tell the right bytes from stale ones.
std::uint64_t xxh64(const std::byte* data, std::size_t size);

// XXH3-64 with seed 0 (libxxhash's XXH3_64bits): the checksums of format 2.0, about three times
// as fast as XXH64 on long inputs.
std::uint64_t xxh3(const std::byte* data, std::size_t size);

// The hash of a dump's checksums: XXH64 in formats 1.x, XXH3-64 since 2.0.
enum class HashAlgorithm : std::uint8_t { kXxh64, kXxh3 };
std::uint64_t hash_bytes(HashAlgorithm algorithm, const std::byte* data, std::size_t size);

}  // namespace dynaprobe::formats
