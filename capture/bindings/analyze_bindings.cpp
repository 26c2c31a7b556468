// Python access to the comparison engine and its reports: the same code as the dynaprobe CLI,
// so PrecisionChecker.report() and `dynaprobe compare` print the same bytes, and the row dicts
// are the report model's (python_report.cpp), field for field the JSON report's rows.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <sstream>
#include <utility>
#include <variant>

#include "bindings.h"
#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/analyze/number_text.h"
#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/report_model.h"
#include "dynaprobe/analyze/run.h"
#include "dynaprobe/analyze/run_folders.h"

namespace py = pybind11;
namespace analyze = dynaprobe::analyze;
namespace fmt = dynaprobe::formats;

namespace {

// The report's words (report.h, comparison.h), beside the dump's names bind_formats exported:
// verdicts and statuses, a tensor row's details, shapes, the status a note gives.
void bind_report_words(py::module_& m) {
  auto vocabulary = m.attr("vocabulary").cast<py::module_>();
  vocabulary.attr("VERDICT_ALL_PASS") = std::string(analyze::kVerdictAllPass);
  vocabulary.attr("VERDICT_FAILED") = std::string(analyze::kVerdictFailed);
  for (const auto status : {analyze::Status::kPass, analyze::Status::kFail, analyze::Status::kSkip,
                            analyze::Status::kWarn}) {
    const std::string name(analyze::status_name(status));
    vocabulary.attr(("STATUS_" + name).c_str()) = name;
  }
  m.def(
      "tensor_detail",
      [](bool ok, double max_abs, double mean_abs, double max_rel, const std::string& shape) {
        return analyze::tensor_detail_text(ok, max_abs, mean_abs, max_rel, shape);
      },
      py::arg("ok"), py::arg("max_abs"), py::arg("mean_abs"), py::arg("max_rel"), py::arg("shape"),
      "A tensor row's details as the stdout report shows them: \"[OK] max_abs=...  mean_abs=...  "
      "max_rel=...  shape=...\" ([!!] when not ok); shape as the report writes it.");
  using Shape = std::vector<std::int64_t>;
  m.def(
      "shape_text",
      [](const std::variant<Shape, std::pair<Shape, Shape>>& shape) {
        if (const auto* one = std::get_if<Shape>(&shape)) return fmt::shape_string(*one);
        const auto& [eager, compiled] = std::get<std::pair<Shape, Shape>>(shape);
        return "(" + fmt::shape_string(eager) + ", " + fmt::shape_string(compiled) + ")";
      },
      py::arg("shape"),
      "A shape as the reports write it: \"(2, 3)\", \"(4,)\", \"()\"; an (eager, compiled) "
      "pair of a shape mismatch as \"((2, 3), (3, 2))\".");
  m.def(
      "note_status",
      [](const std::string& note) {
        return std::string(analyze::status_name(analyze::note_status(note)));
      },
      py::arg("note"),
      "The status a note gives its row: \"SKIP\" or \"WARN\" (comparison.cpp's table)");
  m.def("format_tolerance", &analyze::format_tolerance, py::arg("value"),
        "A tolerance as the reports and messages write it: \"1e-4\", \"0.001\", \"0.01\".");
  m.def("format_bytes", &analyze::format_bytes, py::arg("bytes"),
        "A size as the CLI and the capture's messages write it: \"512 B\", \"3.4 KiB\", "
        "\"1.2 MiB\", \"2.05 GiB\".");
}

// Judging: the tolerances rows are judged with, typed as the engine takes them from Python
// (Recorder(judging=...), tensors_pass()).
void bind_judging(py::module_& m) {
  using Rule = std::tuple<std::string, double, double>;
  py::class_<analyze::Judging>(m, "Judging", R"doc(
The tolerances rows are judged with: atol and rtol, raised to the dtype-aware floor of either
side's dtype (dtype_aware), then the last rule (pattern, atol, rtol) whose shell-style pattern
matches the row's module, kind or name ("layers.*.mlp", "grad_*", "layers.0.grad_input"); and
whether a row's reference verdict decides it (reference_decides; False: verdict="tolerances").
)doc")
      .def(py::init([](double atol, double rtol, const std::vector<Rule>& rules, bool dtype_aware,
                       bool reference_decides) {
             analyze::Judging judging;
             judging.tolerances = {atol, rtol};
             for (const auto& [pattern, rule_atol, rule_rtol] : rules) {
               judging.rules.push_back({pattern, {rule_atol, rule_rtol}});
             }
             judging.dtype_aware = dtype_aware;
             judging.reference_decides = reference_decides;
             return judging;
           }),
           py::arg("atol"), py::arg("rtol"), py::arg("rules") = std::vector<Rule>{},
           py::arg("dtype_aware") = true, py::arg("reference_decides") = true)
      .def_static(
          "of_dump",
          [](const dynaprobe::formats::Provenance& provenance, const std::filesystem::path& dump) {
            return analyze::dump_judging(provenance, dump);
          },
          py::arg("provenance"), py::arg("dump"),
          "The judging a dump's provenance asks for, as the engine reads it (its defaults where "
          "the dump names none); FormatError naming `dump` for a damaged value.")
      .def_property_readonly("atol", [](const analyze::Judging& j) { return j.tolerances.atol; })
      .def_property_readonly("rtol", [](const analyze::Judging& j) { return j.tolerances.rtol; })
      .def_property_readonly(
          "rules",
          [](const analyze::Judging& j) {
            std::vector<Rule> rules;
            for (const auto& rule : j.rules) {
              rules.emplace_back(rule.pattern, rule.tolerances.atol, rule.tolerances.rtol);
            }
            return rules;
          },
          "(pattern, atol, rtol), the last match winning")
      .def_readonly("dtype_aware", &analyze::Judging::dtype_aware)
      .def_readonly("reference_decides", &analyze::Judging::reference_decides);
}

// StepReport: one step's report, its rows as the report model's dicts.
void bind_step_report(py::module_& m) {
  py::class_<analyze::StepReport>(m, "StepReport")
      .def_readonly("step", &analyze::StepReport::step)
      .def_readonly("loss_eager", &analyze::StepReport::loss_eager)
      .def_readonly("loss_compiled", &analyze::StepReport::loss_compiled)
      .def_readonly("single_pass", &analyze::StepReport::single_pass)
      .def_readonly("cast_dtype", &analyze::StepReport::cast_dtype)
      .def_readonly("not_stored", &analyze::StepReport::not_stored,
                    "Why the step's file was not written, when its report found out; else ''")
      .def_readonly("modules", &analyze::StepReport::modules,
                    "{module: {attribute: value}} from the dump's /modules (compiled_functions, "
                    "graph_breaks, note, ...)")
      .def_property_readonly("atol", [](const analyze::StepReport& r) { return r.tolerances.atol; })
      .def_property_readonly("rtol", [](const analyze::StepReport& r) { return r.tolerances.rtol; })
      .def_property_readonly("all_pass", &analyze::StepReport::all_pass)
      .def_property_readonly(
          "counts",
          [](const analyze::StepReport& r) { return to_python(analyze::counts_model(r.counts())); },
          "What all_pass rests on, as the RESULT line states it (the JSON report's \"result\"): "
          "verdict, rows by status (pass, fail, warn, skip), compared (tensor rows with both "
          "sides), loss_fail, nothing_compared")
      .def_property_readonly("loss_status",
                             [](const analyze::StepReport& r) {
                               return std::string(analyze::status_name(r.loss_status()));
                             })
      .def_property_readonly(
          "rows",
          [](const analyze::StepReport& r) {
            py::list rows;
            for (const auto& row : r.rows) rows.append(to_python(analyze::row_model(row)));
            return rows;
          },
          "The rows as dicts with the JSON report's row fields (docs/report-format.md#json)")
      .def_property_readonly(
          "root_cause",
          [](const analyze::StepReport& r) { return to_python(analyze::root_cause_model(r)); },
          "The JSON report's root_cause: None, or {forward, backward, next}")
      .def_property_readonly(
          "ops", [](const analyze::StepReport& r) { return to_python(analyze::ops_model(r)); },
          "The JSON report's ops: the op localisations (dynaprobe bisect --ops) found beside the "
          "dump for this step, [{module, call, backend, dump, error, graphs}]")
      .def_property_readonly("root_cause_json", &analyze::render_root_cause_json)
      .def(
          "render_text",
          [](const analyze::StepReport& report, const std::string& not_stored, bool only_failing) {
            if (not_stored.empty() || !report.not_stored.empty()) {
              return analyze::render_text(report, only_failing);
            }
            analyze::StepReport known = report;  // what the capture learnt after judging it
            known.not_stored = not_stored;
            return analyze::render_text(known, only_failing);
          },
          py::arg("not_stored") = "", py::arg("only_failing") = false,
          "The stdout report; not_stored: why the step's file was not written, when the capture "
          "found out after the report was made; only_failing: the FAIL and WARN rows alone");
}

// Comparison of two dumps, and compare() / compare_pending() that make it.
void bind_comparison(py::module_& m) {
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
         bool recompute, std::optional<bool> reference_decides) {
        analyze::CompareOptions options;
        options.step = step;
        options.atol = atol;
        options.rtol = rtol;
        options.module_glob = module_glob;
        options.threads = threads;
        options.dtype_aware = dtype_aware;
        options.recompute = recompute;
        options.reference_decides = reference_decides;
        py::gil_scoped_release release;
        return analyze::compare(eager_dump, compiled_dump, options);
      },
      py::arg("eager_dump"), py::arg("compiled_dump"), py::arg("step") = py::none(),
      py::arg("atol") = py::none(), py::arg("rtol") = py::none(), py::arg("module_glob") = "",
      py::arg("threads") = 0, py::arg("dtype_aware") = py::none(), py::arg("recompute") = false,
      py::arg("reference_decides") = py::none(),
      "Compares the eager side of eager_dump with the compiled side of compiled_dump.");
  m.def(
      "compare_pending",
      [](const dynaprobe::formats::PendingStep& pending) {
        dynaprobe::formats::PendingStep copy = pending;
        py::gil_scoped_release release;
        return analyze::compare_pending(std::move(copy), {});
      },
      py::arg("pending"),
      "Compares a step the recorder is still writing (Recorder.finish_step()): the report "
      "compare() gives of its dump once committed; waits for the commit only for pairs not "
      "judged in memory.");
}

// The whole-run report formats and their renderers.
void bind_report_formats(py::module_& m) {
  m.def("render_csv", &analyze::render_csv, py::arg("steps"));
  m.def(
      "report_formats",
      [] {
        py::list formats;
        for (const auto& format : analyze::report_formats()) {
          formats.append(py::make_tuple(std::string(format.name), std::string(format.title)));
        }
        return formats;
      },
      "The whole-run report formats, (name, title) in the CLI's order: the names of its --NAME "
      "options (merged-csv, json, html, ...), the titles of its \"TITLE report saved to\"");
  m.def(
      "render_report",
      [](const std::string& name,
         const std::vector<std::tuple<int, std::string, analyze::Comparison, std::string>>& ranks) {
        const analyze::ReportFormat& format = analyze::report_format(name);
        std::vector<analyze::RankComparison> converted;
        for (const auto& [rank, scenario, comparison, compiled_dump] : ranks) {
          analyze::RankComparison result{rank, scenario, comparison};
          result.path = result.compiled_path = compiled_dump;  // a dump holding both sides
          if (format.needs_graphs && !compiled_dump.empty()) {
            result.graphs = analyze::read_graphs(compiled_dump);
          }
          converted.push_back(std::move(result));
        }
        py::gil_scoped_release release;
        return format.render(converted);
      },
      py::arg("format"), py::arg("ranks"),
      "The report in a registered format. ranks: (rank, scenario, Comparison, dump path) "
      "tuples; the dump is read for the formats that show graphs (html)");
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

// Runs (folders of ranks' dumps): planning, the JSON report, merging partial reports.
void bind_runs(py::module_& m) {
  m.def(
      "choose_run",
      [](const std::string& command, const std::filesystem::path& path) {
        analyze::ChosenRun chosen = analyze::choose_run(command, path);
        return std::pair{chosen.path.string(), std::move(chosen.said)};
      },
      py::arg("command"), py::arg("path"),
      "(run, said): the run `command` (\"bundle\") reads for `path`, the newest of a folder of "
      "runs or `path` itself, and what to say on stderr of that choice (\"\" when none was made), "
      "as the dynaprobe CLI says it");
  m.def(
      "find_rank_dumps",
      [](const std::filesystem::path& path) {
        std::vector<std::pair<int, std::string>> out;
        for (const auto& rank : analyze::find_rank_dumps(path)) {
          out.emplace_back(rank.rank, rank.path.string());
        }
        return out;
      },
      py::arg("path"),
      "[(rank, dump)] of a run folder (its rank<R>/ folders, by rank), or [(rank, path)] of one "
      "dump, its rank read from its provenance. Raises DumpIOError when path does not exist.");
  m.def(
      "plan_run",
      [](const std::filesystem::path& eager_run, const std::filesystem::path& compiled_run,
         const std::string& ranks, const std::string& steps) {
        analyze::RunOptions options;
        if (!ranks.empty()) options.ranks = analyze::IndexSet::parse(ranks, "ranks");
        if (!steps.empty()) options.steps = analyze::IndexSet::parse(steps, "steps");
        std::vector<std::pair<int, std::vector<std::int64_t>>> out;
        for (const auto& rank : analyze::plan_run(eager_run, compiled_run, options).ranks) {
          out.emplace_back(rank.rank, rank.steps);
        }
        return out;
      },
      py::arg("eager_run"), py::arg("compiled_run"), py::arg("ranks") = "", py::arg("steps") = "",
      "The ranks and steps of a run that ranks and steps (\"0-3,8\", empty: all) select: "
      "[(rank, [step, ...])], as dynaprobe compare --ranks/--steps plans them");
  m.def(
      "analyze_run_json",
      [](const std::filesystem::path& eager_run, const std::filesystem::path& compiled_run,
         const std::string& ranks, const std::string& steps, std::optional<double> atol,
         std::optional<double> rtol, const std::string& module_glob, int threads) {
        analyze::RunOptions options;
        if (!ranks.empty()) options.ranks = analyze::IndexSet::parse(ranks, "ranks");
        if (!steps.empty()) options.steps = analyze::IndexSet::parse(steps, "steps");
        options.compare.atol = atol;
        options.compare.rtol = rtol;
        options.compare.module_glob = module_glob;
        options.compare.threads = threads;
        py::gil_scoped_release release;
        const analyze::RunPlan plan = analyze::plan_run(eager_run, compiled_run, options);
        std::ostringstream out;
        const auto writer = analyze::report_format("json").open(out, plan.shape);
        analyze::analyze_run(plan, options, {writer.get()});
        return std::move(out).str();
      },
      py::arg("eager_run"), py::arg("compiled_run"), py::arg("ranks") = "", py::arg("steps") = "",
      py::arg("atol") = py::none(), py::arg("rtol") = py::none(), py::arg("module_glob") = "",
      py::arg("threads") = 0,
      "The JSON report of the ranks and steps of a run that ranks and steps select, as "
      "dynaprobe compare --ranks R --steps S --json writes it");
  m.def(
      "render_run",
      [](const std::vector<std::pair<std::string, std::string>>& reports, const std::string& format,
         bool all_steps) {
        std::vector<analyze::JsonReport> parts;
        for (const auto& [name, text] : reports) parts.push_back({name, text});
        py::gil_scoped_release release;
        const std::vector<analyze::RankComparison> ranks = analyze::read_json_reports(parts);
        const analyze::RunShape shape = analyze::RunShape::of(ranks);
        std::ostringstream out;
        std::unique_ptr<analyze::ReportWriter> writer;
        if (format == "text") {
          analyze::TextOptions text;
          text.every_step = all_steps;
          writer = analyze::open_text_report(out, shape, text);
        } else {
          writer = analyze::report_format(format).open(out, shape);
        }
        analyze::write_run(ranks, {writer.get()});
        return std::move(out).str();
      },
      py::arg("reports"), py::arg("format"), py::arg("all_steps") = false,
      "The report of a run in `format` (\"text\": the stdout report, or a registered format) "
      "from partial JSON reports [(name, text)], as dynaprobe merge writes it");
}

}  // namespace

void bind_analyze(py::module_& m) {
  bind_report_words(m);
  bind_judging(m);
  bind_step_report(m);
  bind_comparison(m);
  bind_report_formats(m);
  bind_runs(m);
}
