#include "dynaprobe/formats/filters.h"

#include <hdf5.h>
#include <zstd.h>

#include <cstring>
#include <mutex>

#include "dynaprobe/formats/schema.h"

namespace dynaprobe::formats {
namespace {

// HDF5 filter callback (H5Z_func_t). Returns the size of the result in *buf, or 0 on failure.
// Buffers belong to the HDF5 library, so they are allocated and freed with its allocator.
std::size_t zstd_filter(unsigned flags, std::size_t cd_nelmts, const unsigned cd_values[],
                        std::size_t nbytes, std::size_t* buf_size, void** buf) {
  if (flags & H5Z_FLAG_REVERSE) {
    const unsigned long long size = ZSTD_getFrameContentSize(*buf, nbytes);
    if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) return 0;
    void* out = H5allocate_memory(static_cast<std::size_t>(size), false);
    if (out == nullptr) return 0;
    const std::size_t got = ZSTD_decompress(out, static_cast<std::size_t>(size), *buf, nbytes);
    if (ZSTD_isError(got) || got != size) {
      H5free_memory(out);
      return 0;
    }
    H5free_memory(*buf);
    *buf = out;
    *buf_size = static_cast<std::size_t>(size);
    return got;
  }
  // Two's complement in an unsigned carries negative (fast) levels.
  const int level = cd_nelmts > 0 ? static_cast<int>(cd_values[0]) : ZSTD_CLEVEL_DEFAULT;
  const std::size_t bound = ZSTD_compressBound(nbytes);
  void* out = H5allocate_memory(bound, false);
  if (out == nullptr) return 0;
  const std::size_t got = ZSTD_compress(out, bound, *buf, nbytes, level);
  if (ZSTD_isError(got)) {
    H5free_memory(out);
    return 0;
  }
  H5free_memory(*buf);
  *buf = out;
  *buf_size = bound;
  return got;
}

template <std::size_t N>
void shuffle_fixed(const std::byte* src, std::byte* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t b = 0; b < N; ++b) dst[b * n + i] = src[i * N + b];
  }
}

template <std::size_t N>
void unshuffle_fixed(const std::byte* src, std::byte* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t b = 0; b < N; ++b) dst[i * N + b] = src[b * n + i];
  }
}

}  // namespace

extern "C" const H5Z_class2_t kDynaprobeZstdFilterClass = {
    H5Z_CLASS_T_VERS,
    static_cast<H5Z_filter_t>(schema::kZstdFilterId),
    1,
    1,
    "Zstandard compression: http://www.zstd.net",
    nullptr,
    nullptr,
    zstd_filter,
};

void register_zstd_filter() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (H5Zfilter_avail(schema::kZstdFilterId) <= 0) H5Zregister(&kDynaprobeZstdFilterClass);
  });
}

void shuffle_bytes(const std::byte* src, std::byte* dst, std::size_t size,
                   std::size_t element_size) {
  const std::size_t n = element_size ? size / element_size : 0;
  switch (element_size) {
    case 2: shuffle_fixed<2>(src, dst, n); break;
    case 4: shuffle_fixed<4>(src, dst, n); break;
    case 8: shuffle_fixed<8>(src, dst, n); break;
    default:
      if (element_size <= 1) {
        std::memcpy(dst, src, size);
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {
        for (std::size_t b = 0; b < element_size; ++b) dst[b * n + i] = src[i * element_size + b];
      }
  }
  const std::size_t tail = n * element_size;
  std::memcpy(dst + tail, src + tail, size - tail);
}

void unshuffle_bytes(const std::byte* src, std::byte* dst, std::size_t size,
                     std::size_t element_size) {
  const std::size_t n = element_size ? size / element_size : 0;
  switch (element_size) {
    case 2: unshuffle_fixed<2>(src, dst, n); break;
    case 4: unshuffle_fixed<4>(src, dst, n); break;
    case 8: unshuffle_fixed<8>(src, dst, n); break;
    default:
      if (element_size <= 1) {
        std::memcpy(dst, src, size);
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {
        for (std::size_t b = 0; b < element_size; ++b) dst[i * element_size + b] = src[b * n + i];
      }
  }
  const std::size_t tail = n * element_size;
  std::memcpy(dst + tail, src + tail, size - tail);
}

}  // namespace dynaprobe::formats
