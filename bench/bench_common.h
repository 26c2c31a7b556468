// What the C++ benchmarks share: timing, deterministic data and the page cache.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

namespace dynaprobe::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline double timed(const std::function<void()>& body) {
  const auto start = Clock::now();
  body();
  return seconds_since(start);
}

// splitmix64's step and finaliser: a cheap, good hash of an index.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rounds to the nearest bfloat16 (ties to even); the result is a float32 bit pattern whose low
// 16 bits are zero. Inputs here are finite, so NaN handling is not needed.
inline std::uint32_t bf16_rounded_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bits & 0xffff0000u;
}

// Reads `path` once: StepWriter streams a step out of the page cache as it writes it, and the
// reads timed here are those of a file in the page cache, for every contender alike.
inline void load_into_page_cache(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::vector<char> buffer(1 << 20);
  while (file.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || file.gcount()) {
  }
}

}  // namespace dynaprobe::bench
