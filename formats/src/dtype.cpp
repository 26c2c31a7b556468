#include "dynaprobe/formats/dtype.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace dynaprobe::formats {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
};

constexpr DTypeInfo kInfos[] = {
    {DType::kFloat64, "float64", 8},
    {DType::kFloat32, "float32", 4},
    {DType::kFloat16, "float16", 2},
    {DType::kBFloat16, "bfloat16", 2},
    {DType::kFloat8E4M3FN, "float8_e4m3fn", 1},
    {DType::kFloat8E4M3FNUZ, "float8_e4m3fnuz", 1},
    {DType::kFloat8E5M2, "float8_e5m2", 1},
    {DType::kFloat8E5M2FNUZ, "float8_e5m2fnuz", 1},
    {DType::kFloat8E8M0FNU, "float8_e8m0fnu", 1},
    {DType::kInt8, "int8", 1},
    {DType::kInt16, "int16", 2},
    {DType::kInt32, "int32", 4},
    {DType::kInt64, "int64", 8},
    {DType::kUInt8, "uint8", 1},
    {DType::kUInt16, "uint16", 2},
    {DType::kUInt32, "uint32", 4},
    {DType::kUInt64, "uint64", 8},
    {DType::kBool, "bool", 1},
    {DType::kComplex32, "complex32", 4},
    {DType::kComplex64, "complex64", 8},
    {DType::kComplex128, "complex128", 16},
};

// kInfos is indexed by the enumerator: each entry must stand at its own dtype's position.
constexpr bool infos_in_enumerator_order() {
  for (std::size_t i = 0; i < std::size(kInfos); ++i) {
    if (static_cast<std::size_t>(kInfos[i].dtype) != i) return false;
  }
  return std::size(kInfos) == static_cast<std::size_t>(DType::kComplex128) + 1;
}
static_assert(infos_in_enumerator_order(), "kInfos must list every DType in enumerator order");

const DTypeInfo& info(DType dtype) { return kInfos[static_cast<std::size_t>(dtype)]; }

// Decodes an 8-bit float with the given layout. `fnuz`: 0x80 is the only NaN, no -0, no inf.
// `finite_only` (the "fn" variants): all-ones exponent and mantissa is NaN, no inf.
float decode_float8(std::uint8_t bits, int exponent_bits, int mantissa_bits, int bias, bool fnuz,
                    bool finite_only) {
  const bool negative = bits & 0x80;
  const int exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  const int max_exponent = (1 << exponent_bits) - 1;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (fnuz && bits == 0x80) return nan;
  if (finite_only && exponent == max_exponent && mantissa == (1 << mantissa_bits) - 1) return nan;
  if (!fnuz && !finite_only && exponent == max_exponent) {
    return mantissa ? nan : (negative ? -INFINITY : INFINITY);
  }
  const float fraction = static_cast<float>(mantissa) / static_cast<float>(1 << mantissa_bits);
  const float magnitude =
      exponent == 0 ? std::ldexp(fraction, 1 - bias) : std::ldexp(1.0f + fraction, exponent - bias);
  return negative ? -magnitude : magnitude;
}

using Float8Table = std::array<float, 256>;

Float8Table make_table(DType dtype) {
  Float8Table table{};
  for (int i = 0; i < 256; ++i) {
    const auto bits = static_cast<std::uint8_t>(i);
    switch (dtype) {
      case DType::kFloat8E4M3FN:
        table[i] = decode_float8(bits, 4, 3, 7, false, true);
        break;
      case DType::kFloat8E4M3FNUZ:
        table[i] = decode_float8(bits, 4, 3, 8, true, false);
        break;
      case DType::kFloat8E5M2:
        table[i] = decode_float8(bits, 5, 2, 15, false, false);
        break;
      case DType::kFloat8E5M2FNUZ:
        table[i] = decode_float8(bits, 5, 2, 16, true, false);
        break;
      case DType::kFloat8E8M0FNU:  // exponent only: 2^(e - 127), 0xff is NaN
        table[i] = i == 0xff ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, i - 127);
        break;
      default:
        break;
    }
  }
  return table;
}

const Float8Table& float8_table(DType dtype) {
  static const std::array<Float8Table, 5> tables = {
      make_table(DType::kFloat8E4M3FN), make_table(DType::kFloat8E4M3FNUZ),
      make_table(DType::kFloat8E5M2), make_table(DType::kFloat8E5M2FNUZ),
      make_table(DType::kFloat8E8M0FNU)};
  return tables[static_cast<std::size_t>(dtype) - static_cast<std::size_t>(DType::kFloat8E4M3FN)];
}

// IEEE half to single, branch-free so the loop vectorises: scaling the shifted bits by 2^112
// rebiases normals and subnormals alike; inf and NaN keep an all-ones exponent.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t magnitude = h & 0x7fffu;
  const float scaled = std::bit_cast<float>(magnitude << 13) * 0x1p112f;
  const std::uint32_t finite = std::bit_cast<std::uint32_t>(scaled);
  const std::uint32_t special = 0x7f800000u | ((magnitude & 0x3ffu) << 13);
  return std::bit_cast<float>(sign | (magnitude >= 0x7c00u ? special : finite));
}

template <typename T>
void widen(const void* src, std::size_t count, float* dst) {
  const auto* in = static_cast<const T*>(src);
  for (std::size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(in[i]);
}

}  // namespace

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

std::optional<DType> parse_dtype(std::string_view name) {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (const auto& entry : kInfos) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

std::size_t dtype_size(DType dtype) { return info(dtype).size; }

bool is_float8(DType dtype) {
  return dtype >= DType::kFloat8E4M3FN && dtype <= DType::kFloat8E8M0FNU;
}

bool is_complex(DType dtype) { return dtype >= DType::kComplex32 && dtype <= DType::kComplex128; }

DType complex_part(DType dtype) {
  switch (dtype) {
    case DType::kComplex32:
      return DType::kFloat16;
    case DType::kComplex64:
      return DType::kFloat32;
    case DType::kComplex128:
      return DType::kFloat64;
    default:
      return dtype;
  }
}

std::size_t value_count(DType dtype) { return is_complex(dtype) ? 2 : 1; }

void convert_to_float32(DType dtype, const void* src, std::size_t count, float* dst) {
  switch (dtype) {
    case DType::kComplex32:
    case DType::kComplex64:
    case DType::kComplex128:  // interleaved parts: converted as 2 * count values of the part
      return convert_to_float32(complex_part(dtype), src, 2 * count, dst);
    case DType::kFloat32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kFloat64:
      return widen<double>(src, count, dst);
    case DType::kFloat16: {
      const auto* in = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < count; ++i) dst[i] = half_to_float(in[i]);
      return;
    }
    case DType::kBFloat16: {
      const auto* in = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < count; ++i) {
        dst[i] = std::bit_cast<float>(static_cast<std::uint32_t>(in[i]) << 16);
      }
      return;
    }
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E4M3FNUZ:
    case DType::kFloat8E5M2:
    case DType::kFloat8E5M2FNUZ:
    case DType::kFloat8E8M0FNU: {
      const auto& table = float8_table(dtype);
      const auto* in = static_cast<const std::uint8_t*>(src);
      for (std::size_t i = 0; i < count; ++i) dst[i] = table[in[i]];
      return;
    }
    case DType::kInt8:
      return widen<std::int8_t>(src, count, dst);
    case DType::kInt16:
      return widen<std::int16_t>(src, count, dst);
    case DType::kInt32:
      return widen<std::int32_t>(src, count, dst);
    case DType::kInt64:
      return widen<std::int64_t>(src, count, dst);
    case DType::kUInt8:
      return widen<std::uint8_t>(src, count, dst);
    case DType::kUInt16:
      return widen<std::uint16_t>(src, count, dst);
    case DType::kUInt32:
      return widen<std::uint32_t>(src, count, dst);
    case DType::kUInt64:
      return widen<std::uint64_t>(src, count, dst);
    case DType::kBool: {
      const auto* in = static_cast<const std::uint8_t*>(src);
      for (std::size_t i = 0; i < count; ++i) dst[i] = in[i] ? 1.0f : 0.0f;
      return;
    }
  }
}

}  // namespace dynaprobe::formats
