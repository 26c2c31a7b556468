// Python access to the comparison engine and its reports: the same code as the dynaprobe CLI,
// so PrecisionChecker.report() and `dynaprobe compare` print the same bytes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include "bindings.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/report.h"

namespace py = pybind11;
namespace analyze = dynaprobe::analyze;
namespace fmt = dynaprobe::formats;

namespace {

py::object side_dict(const std::optional<analyze::TensorSide>& side) {
  if (!side) return py::none();
  py::dict d;
  d["dtype"] = std::string(fmt::dtype_name(side->dtype));
  d["shape"] = py::tuple(py::cast(side->shape));
  return d;
}

py::dict row_dict(const analyze::Row& row) {
  py::dict d;
  d["module"] = row.module;
  d["call"] = row.call;
  d["check_type"] = row.kind ? std::string(fmt::kind_name(*row.kind)) : std::string("note");
  d["tensor_index"] = row.tensor_index;
  d["label"] = row.label;
  d["status"] = std::string(analyze::status_name(row.status));
  d["note"] = row.note;
  d["reason"] = row.reason;
  d["eager"] = side_dict(row.eager);
  d["compiled"] = side_dict(row.compiled);
  if (row.metrics) {
    const auto& m = *row.metrics;
    py::dict metrics;
    metrics["max_abs"] = m.max_abs;
    metrics["mean_abs"] = m.mean_abs;
    metrics["max_rel"] = m.max_rel;
    metrics["allclose"] = m.allclose;
    metrics["cosine"] = m.cosine;
    metrics["rmse"] = m.rmse;
    metrics["elements"] = m.elements;
    metrics["mismatches"] = m.mismatches;
    metrics["nan_eager"] = m.nan_eager;
    metrics["nan_compiled"] = m.nan_compiled;
    metrics["inf_eager"] = m.inf_eager;
    metrics["inf_compiled"] = m.inf_compiled;
    metrics["nonfinite_only_compiled"] = m.nonfinite_only_compiled;
    metrics["worst_index"] = m.worst_index;
    metrics["worst_eager"] = m.worst_eager;
    metrics["worst_compiled"] = m.worst_compiled;
    d["metrics"] = metrics;
  } else {
    d["metrics"] = py::none();
  }
  if (row.tolerances) {  // the JSON report's "tolerances": when not the step's
    py::dict tolerances;
    tolerances["atol"] = row.tolerances->atol;
    tolerances["rtol"] = row.tolerances->rtol;
    d["tolerances"] = tolerances;
  } else {
    d["tolerances"] = py::none();
  }
  if (row.reference_verdict.empty()) {
    d["reference"] = py::none();
  } else {
    py::dict reference;  // the JSON report's "reference" fields
    reference["verdict"] = row.reference_verdict;
    reference["eager_rmse"] = row.reference_eager->rmse;
    reference["compiled_rmse"] = row.reference_compiled->rmse;
    reference["eager_max_abs"] = row.reference_eager->max_abs;
    reference["compiled_max_abs"] = row.reference_compiled->max_abs;
    reference["factor"] = analyze::kReferenceFactor;
    d["reference"] = reference;
  }
  return d;
}

}  // namespace

void bind_analyze(py::module_& m) {
  py::class_<analyze::StepReport>(m, "StepReport")
      .def_readonly("step", &analyze::StepReport::step)
      .def_readonly("loss_eager", &analyze::StepReport::loss_eager)
      .def_readonly("loss_compiled", &analyze::StepReport::loss_compiled)
      .def_readonly("single_pass", &analyze::StepReport::single_pass)
      .def_readonly("cast_dtype", &analyze::StepReport::cast_dtype)
      .def_readonly("modules", &analyze::StepReport::modules,
                    "{module: {attribute: value}} from the dump's /modules (compiled_functions, "
                    "graph_breaks, note, ...)")
      .def_property_readonly("atol", [](const analyze::StepReport& r) { return r.tolerances.atol; })
      .def_property_readonly("rtol", [](const analyze::StepReport& r) { return r.tolerances.rtol; })
      .def_property_readonly("all_pass", &analyze::StepReport::all_pass)
      .def_property_readonly(
          "counts",
          [](const analyze::StepReport& r) {
            const analyze::StepCounts c = r.counts();
            py::dict d;
            d["pass"] = c.pass;
            d["fail"] = c.fail;
            d["warn"] = c.warn;
            d["skip"] = c.skip;
            d["compared"] = c.compared;
            d["loss_fail"] = c.loss_failed;
            d["nothing_compared"] = c.nothing_compared();
            return d;
          },
          "What all_pass rests on, as the RESULT line states it: rows by status (pass, fail, "
          "warn, skip), compared (tensor rows with both sides), loss_fail, nothing_compared")
      .def_property_readonly("loss_status",
                             [](const analyze::StepReport& r) {
                               return std::string(analyze::status_name(r.loss_status()));
                             })
      .def_property_readonly("rows",
                             [](const analyze::StepReport& r) {
                               py::list rows;
                               for (const auto& row : r.rows) rows.append(row_dict(row));
                               return rows;
                             })
      .def_property_readonly("root_cause_json", &analyze::render_root_cause_json)
      .def("render_text", &analyze::render_text);

  py::class_<analyze::Comparison>(m, "Comparison")
      .def_readonly("steps", &analyze::Comparison::steps)
      .def_readonly("eager_provenance", &analyze::Comparison::eager_provenance)
      .def_readonly("compiled_provenance", &analyze::Comparison::compiled_provenance)
      .def_readonly("warnings", &analyze::Comparison::warnings)
      .def_property_readonly("provenance_differences",
                             [](const analyze::Comparison& c) {
                               py::list out;
                               for (const auto& d : c.provenance_differences) {
                                 out.append(py::make_tuple(d.key, d.eager, d.compiled));
                               }
                               return out;
                             })
      .def_property_readonly("all_pass", &analyze::Comparison::all_pass)
      .def("render_provenance", &analyze::render_provenance);

  m.def(
      "compare",
      [](const std::filesystem::path& eager_dump, const std::filesystem::path& compiled_dump,
         std::optional<std::int64_t> step, std::optional<double> atol, std::optional<double> rtol,
         const std::string& module_glob, int threads, std::optional<bool> dtype_aware,
         bool recompute) {
        analyze::CompareOptions options;
        options.step = step;
        options.atol = atol;
        options.rtol = rtol;
        options.module_glob = module_glob;
        options.threads = threads;
        options.dtype_aware = dtype_aware;
        options.recompute = recompute;
        py::gil_scoped_release release;
        return analyze::compare(eager_dump, compiled_dump, options);
      },
      py::arg("eager_dump"), py::arg("compiled_dump"), py::arg("step") = py::none(),
      py::arg("atol") = py::none(), py::arg("rtol") = py::none(), py::arg("module_glob") = "",
      py::arg("threads") = 0, py::arg("dtype_aware") = py::none(), py::arg("recompute") = false,
      "Compares the eager side of eager_dump with the compiled side of compiled_dump.");
  m.def(
      "note_status",
      [](const std::string& note) {
        return std::string(analyze::status_name(analyze::note_status(note)));
      },
      py::arg("note"),
      "The status a note gives its row: \"SKIP\" or \"WARN\" (engine.cpp's table)");
  m.def("render_csv", &analyze::render_csv, py::arg("steps"));
  m.def(
      "render_merged_csv",
      [](const std::vector<std::tuple<int, std::string, analyze::Comparison>>& ranks) {
        std::vector<analyze::RankComparison> converted;
        for (const auto& [rank, scenario, comparison] : ranks) {
          converted.push_back({rank, scenario, comparison});
        }
        return analyze::render_merged_csv(converted);
      },
      py::arg("ranks"), "ranks: (rank, scenario, Comparison) tuples");
}
