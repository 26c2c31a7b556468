// How dynaprobe writes a number in its reports and messages: as Python formats floats in the
// spec's reports, and the engine's and renderers' own printf forms. The lowest layer of analyze's
// text: the engine's messages (engine.cpp, metric_tasks.cpp), the root cause and the reports
// (report.h) all use it.
#pragma once

#include <string>

namespace dynaprobe::analyze {

// Python's formatting of floats in the spec's reports: "%.3e"/"%.6e"/"%.6f", with "nan", "inf"
// and "-inf" spelled as Python spells them.
std::string format_float(double value, const char* printf_format);

namespace detail {

// printf of one number.
std::string printf_string(const char* format, double value);
// "%g" of a number, as warnings and notes name tolerances: "0.0001", "1e-05".
std::string format_double(double value);
// "1e-4", "0.001"... as a person writes a tolerance.
std::string format_tolerance(double value);

}  // namespace detail
}  // namespace dynaprobe::analyze
