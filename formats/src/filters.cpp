#include "dynaprobe/formats/filters.h"

#include <hdf5.h>
#include <xxhash.h>
#if defined(__x86_64__)
// XXH3_64bits becomes libxxhash's runtime dispatch: the AVX2 / AVX-512 code where the CPU has it
// (about 40 GB/s here, against 19 for the SSE2 baseline the library is built for), same hashes.
#include <xxh_x86dispatch.h>
#endif
// ZSTD_c_literalCompressionMode (zstd >= 1.5.1) is in zstd's experimental section. It is set
// through ZSTD_CCtx_setParameter, a stable entry point of the shared library; a library that does
// not know it refuses it, and frames are then written with its default literals.
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstring>
#include <memory>
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
  const std::size_t bound = zstd_bound(nbytes);
  void* out = H5allocate_memory(bound, false);
  if (out == nullptr) return 0;
  const std::size_t got = zstd_compress(level, static_cast<const std::byte*>(*buf), nbytes,
                                        static_cast<std::byte*>(out), bound);
  if (got == 0) {
    H5free_memory(out);
    return 0;
  }
  H5free_memory(*buf);
  *buf = out;
  *buf_size = bound;
  return got;
}

// Scalar shuffle of elements [first, n); the SIMD versions below do the bulk and leave the rest.
template <std::size_t N>
void shuffle_fixed(const std::byte* src, std::byte* dst, std::size_t n, std::size_t first) {
  for (std::size_t i = first; i < n; ++i) {
    for (std::size_t b = 0; b < N; ++b) dst[b * n + i] = src[i * N + b];
  }
}

template <std::size_t N>
void unshuffle_fixed(const std::byte* src, std::byte* dst, std::size_t n, std::size_t first) {
  for (std::size_t i = first; i < n; ++i) {
    for (std::size_t b = 0; b < N; ++b) dst[i * N + b] = src[b * n + i];
  }
}

// SSE2 (every x86-64 CPU has it) versions for 2- and 4-byte elements, 16 elements per step. The
// scalar loops above are only vectorised by GCC at -O3, and at -O2 (RelWithDebInfo, other
// packagers) run at 3 GB/s: slower than zstd decompresses, which made (un)shuffle the reader's
// bottleneck. Each returns how many elements it handled; the caller finishes the rest.
#if defined(__SSE2__)
__m128i load(const std::byte* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
void store(std::byte* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

std::size_t shuffle2_simd(const std::byte* src, std::byte* dst, std::size_t n) {
  // Each 16-bit lane is one element, byte 0 in its low half. Masking or shifting leaves values
  // <= 255, so the saturating pack simply narrows: 16 byte-0s, then 16 byte-1s.
  const __m128i low = _mm_set1_epi16(0x00ff);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = load(src + 2 * i);
    const __m128i b = load(src + 2 * i + 16);
    store(dst + i, _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low)));
    store(dst + n + i, _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
  }
  return i;
}

std::size_t unshuffle2_simd(const std::byte* src, std::byte* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i byte0 = load(src + i);
    const __m128i byte1 = load(src + n + i);
    store(dst + 2 * i, _mm_unpacklo_epi8(byte0, byte1));
    store(dst + 2 * i + 16, _mm_unpackhi_epi8(byte0, byte1));
  }
  return i;
}

std::size_t shuffle4_simd(const std::byte* src, std::byte* dst, std::size_t n) {
  // A 16 x 4 byte transpose in three rounds of byte interleaving; each round doubles the runs of
  // consecutive elements that hold the same byte position.
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const std::byte* s = src + 4 * i;
    const __m128i e0 = load(s);  // elements 0-3
    const __m128i e1 = load(s + 16);
    const __m128i e2 = load(s + 32);
    const __m128i e3 = load(s + 48);  // elements 12-15
    // Round 1: elements (0, 4), (1, 5), ... side by side.
    const __m128i r0 = _mm_unpacklo_epi8(e0, e1);
    const __m128i r1 = _mm_unpackhi_epi8(e0, e1);
    const __m128i r2 = _mm_unpacklo_epi8(e2, e3);
    const __m128i r3 = _mm_unpackhi_epi8(e2, e3);
    // Round 2: runs of 4 elements per byte position.
    const __m128i q0 = _mm_unpacklo_epi8(r0, r1);
    const __m128i q1 = _mm_unpackhi_epi8(r0, r1);
    const __m128i q2 = _mm_unpacklo_epi8(r2, r3);
    const __m128i q3 = _mm_unpackhi_epi8(r2, r3);
    // Round 3: elements 0-7 (p0, p1) and 8-15 (p2, p3); bytes 0 and 1 in p0/p2, 2 and 3 in p1/p3.
    const __m128i p0 = _mm_unpacklo_epi8(q0, q1);
    const __m128i p1 = _mm_unpackhi_epi8(q0, q1);
    const __m128i p2 = _mm_unpacklo_epi8(q2, q3);
    const __m128i p3 = _mm_unpackhi_epi8(q2, q3);
    store(dst + i, _mm_unpacklo_epi64(p0, p2));
    store(dst + n + i, _mm_unpackhi_epi64(p0, p2));
    store(dst + 2 * n + i, _mm_unpacklo_epi64(p1, p3));
    store(dst + 3 * n + i, _mm_unpackhi_epi64(p1, p3));
  }
  return i;
}

std::size_t unshuffle4_simd(const std::byte* src, std::byte* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b0 = load(src + i);
    const __m128i b1 = load(src + n + i);
    const __m128i b2 = load(src + 2 * n + i);
    const __m128i b3 = load(src + 3 * n + i);
    // Byte pairs (0, 1) and (2, 3) of each element, then the pairs joined into elements.
    const __m128i b01_lo = _mm_unpacklo_epi8(b0, b1);
    const __m128i b01_hi = _mm_unpackhi_epi8(b0, b1);
    const __m128i b23_lo = _mm_unpacklo_epi8(b2, b3);
    const __m128i b23_hi = _mm_unpackhi_epi8(b2, b3);
    std::byte* d = dst + 4 * i;
    store(d, _mm_unpacklo_epi16(b01_lo, b23_lo));
    store(d + 16, _mm_unpackhi_epi16(b01_lo, b23_lo));
    store(d + 32, _mm_unpacklo_epi16(b01_hi, b23_hi));
    store(d + 48, _mm_unpackhi_epi16(b01_hi, b23_hi));
  }
  return i;
}
#else
std::size_t shuffle2_simd(const std::byte*, std::byte*, std::size_t) { return 0; }
std::size_t unshuffle2_simd(const std::byte*, std::byte*, std::size_t) { return 0; }
std::size_t shuffle4_simd(const std::byte*, std::byte*, std::size_t) { return 0; }
std::size_t unshuffle4_simd(const std::byte*, std::byte*, std::size_t) { return 0; }
#endif

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

// Every frame carries zstd's content checksum: without it a damaged chunk (a bad sector, a bit
// flip in transit) whose bytes fall in raw literals decompresses without error into silent
// garbage; with it any zstd decoder (ours, hdf5plugin, the HDF5 reference plugin) reports the
// corruption. Costs 4 bytes per chunk and one XXH64 pass over the uncompressed chunk when writing
// and when reading.
std::size_t zstd_compress(int level, const std::byte* src, std::size_t size, std::byte* dst,
                          std::size_t capacity) {
  thread_local std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> context(ZSTD_createCCtx(),
                                                                            ZSTD_freeCCtx);
  ZSTD_CCtx* compressor = context.get();
  if (compressor == nullptr) return 0;
  ZSTD_CCtx_setParameter(compressor, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(compressor, ZSTD_c_checksumFlag, 1);
  ZSTD_CCtx_setParameter(compressor, ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
  const std::size_t got = ZSTD_compress2(compressor, dst, capacity, src, size);
  return ZSTD_isError(got) ? 0 : got;
}

std::size_t zstd_bound(std::size_t size) { return ZSTD_compressBound(size); }

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
    case 2:
      shuffle_fixed<2>(src, dst, n, shuffle2_simd(src, dst, n));
      break;
    case 4:
      shuffle_fixed<4>(src, dst, n, shuffle4_simd(src, dst, n));
      break;
    case 8:
      shuffle_fixed<8>(src, dst, n, 0);
      break;
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
    case 2:
      unshuffle_fixed<2>(src, dst, n, unshuffle2_simd(src, dst, n));
      break;
    case 4:
      unshuffle_fixed<4>(src, dst, n, unshuffle4_simd(src, dst, n));
      break;
    case 8:
      unshuffle_fixed<8>(src, dst, n, 0);
      break;
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

namespace {
constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr std::uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr std::uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
std::uint64_t load64(const std::byte* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);  // dumps are little-endian, like the hosts dynaprobe supports
  return v;
}
std::uint32_t load32(const std::byte* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
std::uint64_t xxh_round(std::uint64_t acc, std::uint64_t input) {
  return rotl(acc + input * kPrime2, 31) * kPrime1;
}
std::uint64_t xxh_merge(std::uint64_t acc, std::uint64_t lane) {
  return (acc ^ xxh_round(0, lane)) * kPrime1 + kPrime4;
}
}  // namespace

std::uint64_t xxh64(const std::byte* data, std::size_t size) {
  const std::byte* p = data;
  const std::byte* const end = data + size;
  std::uint64_t h;
  if (size >= 32) {
    std::uint64_t v1 = kPrime1 + kPrime2, v2 = kPrime2, v3 = 0, v4 = 0 - kPrime1;
    for (; end - p >= 32; p += 32) {
      v1 = xxh_round(v1, load64(p));
      v2 = xxh_round(v2, load64(p + 8));
      v3 = xxh_round(v3, load64(p + 16));
      v4 = xxh_round(v4, load64(p + 24));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    for (const std::uint64_t lane : {v1, v2, v3, v4}) h = xxh_merge(h, lane);
  } else {
    h = kPrime5;
  }
  h += size;
  for (; end - p >= 8; p += 8) h = rotl(h ^ xxh_round(0, load64(p)), 27) * kPrime1 + kPrime4;
  if (end - p >= 4) {
    h = rotl(h ^ (load32(p) * kPrime1), 23) * kPrime2 + kPrime3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (std::to_integer<std::uint64_t>(*p) * kPrime5), 11) * kPrime1;
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  return h ^ (h >> 32);
}

std::uint64_t xxh3(const std::byte* data, std::size_t size) { return XXH3_64bits(data, size); }

std::uint64_t hash_bytes(HashAlgorithm algorithm, const std::byte* data, std::size_t size) {
  return algorithm == HashAlgorithm::kXxh3 ? xxh3(data, size) : xxh64(data, size);
}

}  // namespace dynaprobe::formats
