// How dynaprobe writes a number in its reports and messages: as Python formats floats in the
// spec's reports, and the engine's and renderers' own printf forms. The lowest layer of analyze's
// text: the engine's messages (engine.cpp, metric_tasks.cpp), the root cause and the reports
// (report.h) all use it.
#pragma once

#include <cstdint>
#include <string>

namespace dynaprobe::analyze {

// Python's formatting of floats in the spec's reports: "%.3e"/"%.6e"/"%.6f", with "nan", "inf"
// and "-inf" spelled as Python spells them.
std::string format_float(double value, const char* printf_format);

// A tolerance as a person writes it, the one spelling of tolerances in reports and messages:
// "1e-4", "0.001", "0.01"; any other number (an invalid one received) as exactly.
std::string format_tolerance(double value);

// A size for people, in binary units: "512 B", "3.4 KiB", "1.2 MiB", "2.05 GiB".
std::string format_bytes(std::uint64_t bytes);

namespace detail {

// printf of one number.
std::string printf_string(const char* format, double value);

}  // namespace detail
}  // namespace dynaprobe::analyze
