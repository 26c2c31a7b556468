// The chunk filters of a dump: HDF5's byte shuffle (id 2) and zstd (registered id 32015), both
// also usable directly on buffers for H5Dwrite_chunk / H5Dread_chunk.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dynaprobe::formats {

// Registers the zstd filter with the HDF5 library in this process (idempotent). Compatible with
// the reference plugin of hdf5_plugins and with hdf5plugin.Zstd: one zstd frame per chunk with
// its content size and content checksum (zstd_compress()), level in cd_values[0].
void register_zstd_filter();

// The zstd level a dump is written at unless told otherwise: zstd's fast mode with acceleration
// 50. zstd_compress() entropy-codes literals at every level, so on float data, whose bytes rarely
// repeat, this level keeps level 1's ratio and compresses about twice as fast: a step of real
// GPT-2 bf16 activations and gradients, shuffled, 1.36 against 0.64 GB/s, 1.46x against 1.45x;
// its decompression is faster too (docs/performance.md, Dump format).
inline constexpr int kDefaultZstdLevel = -50;

// One zstd frame of `size` bytes from `src` at `level` into `dst`, which holds `capacity` bytes
// (zstd_bound(size) always suffice), with its content size and zstd's content checksum; returns
// its size, or 0 when zstd fails (`dst` too small). Literals (the bytes no match covers: most of a
// float tensor's) are Huffman-coded at every level: zstd's negative levels otherwise store them as
// they are, which leaves a shuffled float tensor's exponent bytes uncompressed.
std::size_t zstd_compress(int level, const std::byte* src, std::size_t size, std::byte* dst,
                          std::size_t capacity);
std::size_t zstd_bound(std::size_t size);

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
