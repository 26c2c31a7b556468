// Tensor element types as stored on disk. Names are torch's (`torch.bfloat16` -> "bfloat16").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace dynaprobe::formats {

enum class DType : std::uint8_t {
  kFloat64,
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3FN,
  kFloat8E4M3FNUZ,
  kFloat8E5M2,
  kFloat8E5M2FNUZ,
  kFloat8E8M0FNU,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt8,
  kUInt16,
  kUInt32,
  kUInt64,
  kBool,
  kComplex32,  // since format 2.0: real and imaginary parts of float16, float32, float64
  kComplex64,
  kComplex128,
};

inline constexpr DType kAllDTypes[] = {
    DType::kFloat64,       DType::kFloat32,        DType::kFloat16,    DType::kBFloat16,
    DType::kFloat8E4M3FN,  DType::kFloat8E4M3FNUZ, DType::kFloat8E5M2, DType::kFloat8E5M2FNUZ,
    DType::kFloat8E8M0FNU, DType::kInt8,           DType::kInt16,      DType::kInt32,
    DType::kInt64,         DType::kUInt8,          DType::kUInt16,     DType::kUInt32,
    DType::kUInt64,        DType::kBool,           DType::kComplex32,  DType::kComplex64,
    DType::kComplex128,
};

std::string_view dtype_name(DType dtype);
std::optional<DType> parse_dtype(std::string_view name);
std::size_t dtype_size(DType dtype);
bool is_float8(DType dtype);
bool is_complex(DType dtype);
// The dtype of a complex dtype's real and imaginary parts (complex64 -> float32); others: itself.
DType complex_part(DType dtype);
// Values per element as the analyzer compares them: 2 for complex (real, imaginary), else 1.
std::size_t value_count(DType dtype);

// Converts `count` elements stored as `dtype` at `src` to float32 (NaN stays NaN, integers and
// bools become their value; a complex element becomes two values, real then imaginary: `dst`
// holds count * value_count(dtype) floats). Thread-safe; vectorised for float32, float16 and
// bfloat16.
void convert_to_float32(DType dtype, const void* src, std::size_t count, float* dst);

}  // namespace dynaprobe::formats
