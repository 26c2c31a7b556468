// The reports of a comparison: the spec's stdout report and CSV (报告说明, CSV 报告格式), the
// multi-rank CSV (多卡 CSV 报告格式), JSON with every metric for scripts and CI, and a
// self-contained HTML page. One renderer file each (analyze/src/render_*.cpp); JSON, HTML and
// Python's row dicts serialise the one report model (report_model.h). docs/report-format.md
// explains the choices where the spec's examples disagree.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "dynaprobe/analyze/comparison.h"
#include "dynaprobe/analyze/number_text.h"
#include "dynaprobe/formats/record.h"

namespace dynaprobe::analyze {

// The verdict of a step or a run, as every report words it (the RESULT line, the JSON's
// "verdict", the Markdown title, `dynaprobe runs`) and Python has it
// (dynaprobe._C.vocabulary.VERDICT_ALL_PASS / VERDICT_FAILED,
// capture/bindings/analyze_bindings.cpp).
inline constexpr std::string_view kVerdictAllPass = "ALL PASS";
inline constexpr std::string_view kVerdictFailed = "FAILED";
constexpr std::string_view verdict_text(bool all_pass) {
  return all_pass ? kVerdictAllPass : kVerdictFailed;
}

// The stdout report of one step, byte for byte in the spec's layout. `only_failing`: the FAIL and
// WARN rows alone (report(..., only_failing=True), dynaprobe compare --failing), a line under the
// loss saying how many others are not shown; the RESULT line and the root cause are the whole
// step's.
std::string render_text(const StepReport& report, bool only_failing = false);

// A compared tensor's details as the stdout report's row shows them:
// "[OK] max_abs=1.000e-05  mean_abs=…  max_rel=…  shape=(2, 3)", "[!!]" when `ok` is false;
// `shape` as formats::shape_string writes it. Python's TensorDiff.__str__ is this text.
std::string tensor_detail_text(bool ok, double max_abs, double mean_abs, double max_rel,
                               std::string_view shape);

// The spec's 9-column CSV of one or more steps (a header, then each step's LOSS row and rows).
std::string render_csv(const std::vector<StepReport>& steps);

// One comparison per rank and scenario, for the reports of a run.
struct RankComparison {
  int rank = 0;
  std::string scenario;
  Comparison comparison;
  // The compiler's graphs (read_graphs() of the compiled side's dump), for the formats that show
  // them (ReportFormat::needs_graphs); empty otherwise.
  std::vector<formats::Graph> graphs{};
  // The rank's dump, and its compiled side's when two are compared; empty when not known.
  std::filesystem::path path{};
  std::filesystem::path compiled_path{};
};

// The totals of a run, which its reports' summaries state (the JSON's "summary").
struct RunTotals {
  bool all_pass = false;  // at least one step, and every step of every rank passes
  std::size_t ranks = 0;
  std::size_t steps = 0;  // (rank, step) pairs
  std::size_t failed_steps = 0;
  std::size_t nothing_compared_steps = 0;
  std::size_t loss_fail = 0;  // steps whose loss check FAILs
  std::size_t rows = 0, pass = 0, fail = 0, warn = 0, skip = 0, compared = 0;
  // Where a root cause first appears: the earliest step, on its lowest rank.
  struct Place {
    int rank = 0;
    std::int64_t step = 0;
  };
  std::optional<Place> root_cause_first_seen;
  // What makes the run inconsistent (run.h): each names the rank folders concerned.
  std::vector<std::string> warnings;
};

// A report written while a run is analysed (run.h): the steps arrive one at a time, rank by rank,
// so a writer that streams (merged CSV, JSON, JUnit) holds one step, never the run.
class ReportWriter {
 public:
  virtual ~ReportWriter() = default;
  // One step of `rank`, whose comparison holds the rank's provenance but none of its steps.
  virtual void add_step(const RankComparison& rank, const StepReport& step) = 0;
  // After a rank's last step: its warnings are in rank.comparison.warnings.
  virtual void end_rank(const RankComparison& rank, bool all_pass) = 0;
  // After the last rank.
  virtual void finish(const RunTotals& totals) = 0;
};

// What a writer is told before the run starts.
struct RunShape {
  std::size_t ranks = 0;       // ranks to come
  bool several_steps = false;  // some rank has more than one step (a CSV's step column)
  // Of `ranks`, as write_run() is given them.
  static RunShape of(const std::vector<RankComparison>& ranks);
};
// "rank,scenario" followed by the 9 columns, every rank's rows in rank order.
std::string render_merged_csv(const std::vector<RankComparison>& ranks);

// A step's root-cause summary as JSON (null when nothing FAILs), as render_json() has it under
// "root_cause"; Python's CompareResult.root_cause parses this very text.
std::string render_root_cause_json(const StepReport& report);

// Every row with every metric, the provenance of both sides and a summary: the report model
// (report_model.h) as JSON.
std::string render_json(const std::vector<RankComparison>& ranks);

// One self-contained HTML page (docs/report-format.md#html): the report model, each rank's graphs
// and the charting library embedded, nothing fetched at view time.
std::string render_html(const std::vector<RankComparison>& ranks);

// JUnit XML for CI (docs/report-format.md#junit): a <testsuite> per (rank, step) named
// "dynaprobe.rank<R>.step<S>", a <testcase> per module; a module with a FAIL or WARN row fails,
// its <failure> listing those rows and the step's root cause; one whose rows all SKIP is
// <skipped/>. The loss check and a step where nothing was compared are testcases too, so a suite
// has failures exactly when its step's RESULT is FAILED.
std::string render_junit(const std::vector<RankComparison>& ranks);

// A GitHub Actions job summary in GitHub-flavoured Markdown (docs/report-format.md#markdown): the
// verdict and counts, a table of the failing rows (rank, step, module, check, status, max_abs; at
// most 200) and the root cause where it is first seen.
std::string render_markdown(const std::vector<RankComparison>& ranks);

// A report written to a file for a whole run (every rank, every step). The registry is the one
// place a format is added: the CLI offers --NAME PATH and Python report(..., NAME_path=PATH) for
// each entry ("merged-csv" is merged_csv_path).
struct ReportFormat {
  std::string_view name;         // "json"
  std::string_view title;        // "JSON", as in "JSON report saved to: PATH"
  std::string_view description;  // the CLI option's help
  bool needs_graphs;             // fill RankComparison::graphs before rendering
  // The format's writer, writing to `out` as the run arrives.
  std::unique_ptr<ReportWriter> (*open)(std::ostream& out, const RunShape& shape);

  // The whole report of `ranks` at once (run.cpp: it runs the run's writer loop, write_run).
  std::string render(const std::vector<RankComparison>& ranks) const;
};
// The writers of the registered formats (one renderer file each).
std::unique_ptr<ReportWriter> open_merged_csv(std::ostream& out, const RunShape& shape);
std::unique_ptr<ReportWriter> open_json(std::ostream& out, const RunShape& shape);
std::unique_ptr<ReportWriter> open_html(std::ostream& out, const RunShape& shape);
std::unique_ptr<ReportWriter> open_junit(std::ostream& out, const RunShape& shape);
std::unique_ptr<ReportWriter> open_markdown(std::ostream& out, const RunShape& shape);
// The 9-column CSV of each rank to a file of its own ("report.csv" -> "report_rank1.csv" when the
// run has several ranks); each file is written when its rank ends.
std::unique_ptr<ReportWriter> open_rank_csvs(
    const std::filesystem::path& path, const RunShape& shape,
    std::function<void(const std::filesystem::path&, const std::string&)> write_file);
// In the order the CLI writes them.
const std::vector<ReportFormat>& report_formats();
// The format called `name`; throws UsageError naming the known formats otherwise.
const ReportFormat& report_format(std::string_view name);

// The graphs stored in a dump (every step file; a graph stored by several steps once), in the
// order they were stored. Throws IoError / FormatError as formats::StepReader does.
std::vector<formats::Graph> read_graphs(const std::filesystem::path& dump);

// When the sides come from two dumps: where each side was captured (host, torch version, device,
// backend, dtypes, mode) and what differs between them. Empty for a single dump.
std::string render_provenance(const Comparison& comparison);

}  // namespace dynaprobe::analyze
