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

std::string format_tolerance(double value) {
  for (int precision = 0; precision < 17; ++precision) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%.*e", precision, value);
    if (std::strtod(buffer, nullptr) != value) continue;
    std::string text = buffer;
    const auto e = text.find('e');
    std::string mantissa = text.substr(0, e);
    const int exponent = std::atoi(text.c_str() + e + 1);
    if (exponent >= -2 && exponent <= 3) return detail::printf_string("%.15g", value);
    return mantissa + "e" + std::to_string(exponent);
  }
  return detail::printf_string("%.17g", value);
}

std::string format_bytes(std::uint64_t bytes) {
  const double value = static_cast<double>(bytes);
  if (bytes < 1024) return std::to_string(bytes) + " B";
  if (bytes < (std::uint64_t{1} << 20)) return detail::printf_string("%.1f KiB", value / 1024.0);
  if (bytes < (std::uint64_t{1} << 30)) {
    return detail::printf_string("%.1f MiB", value / 1048576.0);
  }
  return detail::printf_string("%.2f GiB", value / 1073741824.0);
}

namespace detail {

std::string printf_string(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, value);
  return buffer;
}

}  // namespace detail
}  // namespace dynaprobe::analyze
