#include "dynaprobe/analyze/number_text.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace dynaprobe::analyze {

std::string format_float(double value, const char* printf_format) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return detail::printf_string(printf_format, value);
}

namespace detail {

std::string printf_string(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, value);
  return buffer;
}

std::string format_double(double value) { return printf_string("%g", value); }

std::string format_tolerance(double value) {
  for (int precision = 0; precision < 17; ++precision) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%.*e", precision, value);
    if (std::strtod(buffer, nullptr) != value) continue;
    std::string text = buffer;
    const auto e = text.find('e');
    std::string mantissa = text.substr(0, e);
    const int exponent = std::atoi(text.c_str() + e + 1);
    if (exponent >= -2 && exponent <= 3) return printf_string("%.15g", value);
    return mantissa + "e" + std::to_string(exponent);
  }
  return printf_string("%.17g", value);
}

}  // namespace detail
}  // namespace dynaprobe::analyze
