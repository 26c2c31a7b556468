// The parts of the dynaprobe._C Python module, one function per C++ library.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "dynaprobe/analyze/report_model.h"
#include "dynaprobe/formats/record.h"

void bind_formats(pybind11::module_& m);
void bind_analyze(pybind11::module_& m);
void bind_capture(pybind11::module_& m);

// A kind or side name given from Python, parsed once for every binding; throws UsageError
// (ValueError) naming what was received and the names there are.
dynaprobe::formats::Kind kind_arg(const std::string& kind);
dynaprobe::formats::Side side_arg(const std::string& side);

// The report model as Python objects (python_report.cpp): dicts, lists, str, int, float, bool and
// None, with the JSON report's field names.
pybind11::object to_python(const dynaprobe::analyze::Value& value);
