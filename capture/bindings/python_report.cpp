// The Python renderer of the report model (analyze/include/dynaprobe/analyze/report_model.h):
// the same tree the JSON report serialises, as Python objects, so dynaprobe._C's row dicts and
// the JSON report have the same fields by construction. Numbers stay numbers (NaN and infinities
// as floats, where JSON spells them "nan", "inf", "-inf").
#include <Python.h>

#include "bindings.h"
#include "dynaprobe/formats/record.h"

namespace py = pybind11;
namespace analyze = dynaprobe::analyze;

namespace {

// The dump's text as it is when it is UTF-8; otherwise as the reports print it ("\xCF").
py::str python_string(const std::string& text) {
  PyObject* decoded =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "strict");
  if (decoded) return py::reinterpret_steal<py::str>(decoded);
  PyErr_Clear();
  return py::str(dynaprobe::formats::printable_name(text));
}

}  // namespace

py::object to_python(const analyze::Value& value) {
  if (value.is_null()) return py::none();
  if (const bool* b = value.get<bool>()) return py::bool_(*b);
  if (const std::int64_t* i = value.get<std::int64_t>()) return py::int_(*i);
  if (const double* d = value.get<double>()) return py::float_(*d);
  if (const std::string* s = value.get<std::string>()) return python_string(*s);
  if (const auto* array = value.get<analyze::Value::Array>()) {
    py::list out;
    for (const analyze::Value& element : *array) out.append(to_python(element));
    return out;
  }
  py::dict out;
  for (const auto& [key, member] : *value.get<analyze::Value::Object>()) {
    out[python_string(key)] = to_python(member);
  }
  return out;
}
