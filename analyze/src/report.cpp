// The report formats a comparison can be written in, and what they share. Each format is one
// renderer file (render_text.cpp, render_csv.cpp, render_json.cpp, render_html.cpp,
// render_junit.cpp, render_markdown.cpp); the
// structured ones serialise the report model (report_model.cpp). A new format is one new
// renderer file plus one entry in kFormats below: the CLI gets its --NAME PATH option and Python
// its report(..., NAME_path=...) from this table.
#include "dynaprobe/analyze/report.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::analyze {

const std::vector<ReportFormat>& report_formats() {
  static const std::vector<ReportFormat> kFormats = {
      {"merged-csv", "Merged CSV",
       "Also write one CSV for all ranks to PATH: rank,scenario and the 9 columns", false,
       open_merged_csv},
      {"json", "JSON",
       "Also write every row with every metric (cosine, RMSE, NaN/Inf counts, worst element, "
       "...) and both sides' provenance to PATH as JSON",
       false, open_json},
      {"html", "HTML",
       "Also write a self-contained HTML report to PATH: error along execution order, "
       "histograms of |diff|, graph code, rank and step views (opens offline)",
       true, open_html},
      {"junit", "JUnit XML",
       "Also write JUnit XML for CI to PATH: a testsuite per rank and step, a testcase per "
       "module, each failure with its failing rows and the root cause",
       false, open_junit},
      {"markdown", "Markdown",
       "Also write a GitHub Actions job summary to PATH (Markdown: the verdict, a table of the "
       "failing rows, the root cause)",
       false, open_markdown},
  };
  return kFormats;
}

RunShape RunShape::of(const std::vector<RankComparison>& ranks) {
  RunShape shape;
  shape.ranks = ranks.size();
  for (const RankComparison& rank : ranks) {
    shape.several_steps = shape.several_steps || rank.comparison.steps.size() > 1;
  }
  return shape;
}

const ReportFormat& report_format(std::string_view name) {
  for (const ReportFormat& format : report_formats()) {
    if (format.name == name) return format;
  }
  std::string known;
  for (const ReportFormat& format : report_formats()) {
    known += (known.empty() ? "" : ", ") + std::string(format.name);
  }
  throw UsageError("expected a report format (" + known + "), but received '" + std::string(name) +
                   "'");
}

std::vector<formats::Graph> read_graphs(const std::filesystem::path& dump) {
  std::vector<formats::Graph> graphs;
  std::map<std::string, std::size_t> seen;  // name -> index in graphs
  for (const auto& file : formats::list_dump(dump).steps) {
    formats::StepReader reader(file);
    for (auto& graph : reader.graphs()) {
      if (seen.count(graph.name)) continue;  // the same graph, stored again by a later step
      seen[graph.name] = graphs.size();
      graphs.push_back(std::move(graph));
    }
  }
  return graphs;
}

}  // namespace dynaprobe::analyze
