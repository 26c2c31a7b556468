// dynaprobe._C: the Python binding. C++ errors map to Python exceptions here, in one place:
// FormatError -> dynaprobe.FormatError (a ValueError), IoError -> dynaprobe.DumpIOError (an
// OSError), UsageError -> ValueError.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "dynaprobe/formats/error.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "dynaprobe's C++ core: dump format, capture and analysis";
  static py::exception<dynaprobe::FormatError> format_error(m, "FormatError", PyExc_ValueError);
  static py::exception<dynaprobe::IoError> io_error(m, "DumpIOError", PyExc_OSError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dynaprobe::FormatError& e) {
      py::set_error(format_error, e.what());
    } catch (const dynaprobe::IoError& e) {
      py::set_error(io_error, e.what());
    } catch (const dynaprobe::UsageError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  bind_formats(m);
  bind_analyze(m);
  bind_capture(m);
}
