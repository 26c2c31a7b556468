#include "dynaprobe/formats/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace dynaprobe::formats {
namespace {

TEST(DType, NamesRoundTripAndAcceptTorchPrefix) {
  for (DType dtype : kAllDTypes) {
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype) << dtype_name(dtype);
  }
  EXPECT_EQ(parse_dtype("torch.bfloat16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("float128"), std::nullopt);
}

TEST(DType, HalfToFloatCoversNormalsSubnormalsInfAndNan) {
  const std::uint16_t bits[] = {0x3c00, 0xc000, 0x0001, 0x03ff, 0x7bff,
                                0x7c00, 0xfc00, 0x7e00, 0x8000};
  float out[9];
  convert_to_float32(DType::kFloat16, bits, 9, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(out[3], std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(out[4], 65504.0f);                  // largest normal
  EXPECT_EQ(out[5], std::numeric_limits<float>::infinity());
  EXPECT_EQ(out[6], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(out[7]));
  EXPECT_TRUE(std::signbit(out[8]) && out[8] == 0.0f);
}

TEST(DType, BFloat16IsTheUpperHalfOfFloat32) {
  const float values[] = {1.5f, -3.25f, std::ldexp(1.0f, -100),
                          std::numeric_limits<float>::infinity()};
  for (float value : values) {
    std::uint32_t bits;
    std::memcpy(&bits, &value, 4);
    const auto upper = static_cast<std::uint16_t>(bits >> 16);
    float out;
    convert_to_float32(DType::kBFloat16, &upper, 1, &out);
    EXPECT_EQ(out, value);
  }
}

TEST(DType, Float8VariantsDecodeLikeTorch) {
  // Reference values from torch: torch.tensor([b], dtype=torch.uint8).view(dtype).float().
  struct Case {
    DType dtype;
    std::uint8_t bits;
    float value;
  };
  const Case cases[] = {
      {DType::kFloat8E4M3FN, 0x38, 1.0f},         {DType::kFloat8E4M3FN, 0x7e, 448.0f},
      {DType::kFloat8E4M3FN, 0x01, 0.001953125f}, {DType::kFloat8E4M3FN, 0xc0, -2.0f},
      {DType::kFloat8E5M2, 0x3c, 1.0f},           {DType::kFloat8E5M2, 0x7b, 57344.0f},
      {DType::kFloat8E4M3FNUZ, 0x40, 1.0f},       {DType::kFloat8E5M2FNUZ, 0x40, 1.0f},
      {DType::kFloat8E8M0FNU, 0x7f, 1.0f},        {DType::kFloat8E8M0FNU, 0x80, 2.0f},
  };
  for (const auto& c : cases) {
    float out;
    convert_to_float32(c.dtype, &c.bits, 1, &out);
    EXPECT_EQ(out, c.value) << dtype_name(c.dtype) << " bits " << int(c.bits);
  }
  const std::pair<DType, std::uint8_t> nans[] = {{DType::kFloat8E4M3FN, 0x7f},
                                                 {DType::kFloat8E4M3FNUZ, 0x80},
                                                 {DType::kFloat8E5M2, 0x7f},
                                                 {DType::kFloat8E5M2FNUZ, 0x80},
                                                 {DType::kFloat8E8M0FNU, 0xff}};
  for (auto [dtype, bits] : nans) {
    float out;
    convert_to_float32(dtype, &bits, 1, &out);
    EXPECT_TRUE(std::isnan(out)) << dtype_name(dtype);
  }
  const std::uint8_t inf = 0x7c;
  float out;
  convert_to_float32(DType::kFloat8E5M2, &inf, 1, &out);
  EXPECT_EQ(out, std::numeric_limits<float>::infinity());
}

TEST(DType, IntegersAndBoolsConvertToTheirValue) {
  const std::int64_t ints[] = {-5, 0, 1 << 20};
  float out[3];
  convert_to_float32(DType::kInt64, ints, 3, out);
  EXPECT_EQ(out[0], -5.0f);
  EXPECT_EQ(out[2], 1048576.0f);
  const std::uint8_t bools[] = {0, 1, 1};
  convert_to_float32(DType::kBool, bools, 3, out);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 1.0f);
}

// A complex element is two values, real then imaginary, of its part's dtype.
TEST(DType, ComplexConvertsToItsRealAndImaginaryParts) {
  EXPECT_EQ(dtype_size(DType::kComplex64), 8u);
  EXPECT_EQ(complex_part(DType::kComplex128), DType::kFloat64);
  EXPECT_EQ(value_count(DType::kComplex32), 2u);
  EXPECT_EQ(value_count(DType::kFloat32), 1u);
  const double values[] = {1.5, -2.0, 0.25, 8.0};  // two complex128 elements
  float out[4];
  convert_to_float32(DType::kComplex128, values, 2, out);
  EXPECT_EQ(std::vector<float>(out, out + 4), (std::vector<float>{1.5f, -2.0f, 0.25f, 8.0f}));
  const std::uint16_t halves[] = {0x3c00, 0xc000};  // complex32: 1 - 2i
  convert_to_float32(DType::kComplex32, halves, 1, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
}

}  // namespace
}  // namespace dynaprobe::formats
