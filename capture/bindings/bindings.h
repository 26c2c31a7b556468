// The parts of the dynaprobe._C Python module, one function per C++ library.
#pragma once

#include <pybind11/pybind11.h>

void bind_formats(pybind11::module_& m);
void bind_analyze(pybind11::module_& m);
void bind_capture(pybind11::module_& m);
