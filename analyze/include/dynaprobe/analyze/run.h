// A whole run analysed a step at a time (docs/report-format.md#runs): every rank folder and step
// file is compared, and each report written, as the steps come, so memory does not grow with the
// number of ranks and steps. The same writers render a run merged from partial JSON reports
// (dynaprobe merge), so a run analysed in shards, on one machine or a cluster, reports exactly as
// the run analysed whole. The run's totals carry what makes it inconsistent: a rank folder whose
// files say another rank, world size or run, missing ranks, steps on only some ranks, provenance
// that differs between ranks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/report.h"

namespace dynaprobe::analyze {

// A set of ranks or steps as the command line gives it: "0-3,8,10-12". Default: every index.
class IndexSet {
 public:
  IndexSet() = default;
  // Throws UsageError naming `option`, what was received and an example, unless `text` is a
  // comma-separated list of N or N-M (0 <= N <= M).
  static IndexSet parse(const std::string& text, std::string_view option);
  // What parse() expects, for messages: "N, N-M or a list of them (such as 0-3,8)".
  static constexpr std::string_view kExpected = "N, N-M or a list of them (such as 0-3,8)";
  // The set of `indices` (sorted or not), as ranges.
  static IndexSet of(std::vector<std::int64_t> indices);
  bool contains(std::int64_t index) const;
  bool all() const { return ranges_.empty(); }
  // "0-3,8": as parse() reads it; "all" for the default.
  std::string text() const;
  // The ranges, first and last included, in order; empty for the default.
  const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges() const { return ranges_; }

 private:
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges_;
};

struct RunOptions {
  CompareOptions compare;  // compare.step is not used: `steps` selects
  IndexSet ranks;
  IndexSet steps;
  bool read_graphs = false;  // fill RankComparison::graphs (a writer shows them)
  // Called with each warning of a rank's comparison (an unfinished step, a record skipped) once.
  std::function<void(const std::string&)> warn;
};

// The ranks and steps of a run that `options` selects, found from its folders and step files
// names (nothing is read yet): the eager side from `eager_run` and the compiled side from
// `compiled_run` (the same path for runs holding both sides), each a run folder (rank<R>/), a
// dump folder or a step file; two runs are paired rank by rank. Throws UsageError when the
// selection matches no rank or no step (naming those there are), the module filter
// (compare.module_glob) no module, or the two runs hold different numbers of ranks; IoError for
// a path that does not exist.
struct RunPlan {
  struct Rank {
    int rank = 0;
    std::filesystem::path eager, compiled;
    std::vector<std::int64_t> steps;  // selected, in order
  };
  std::vector<Rank> ranks;  // selected, in rank order; a rank without a selected step is left out
  IndexSet selected_ranks;  // what the run's consistency is checked within
  bool same = true;         // one run holds both sides
  RunShape shape;
};
RunPlan plan_run(const std::filesystem::path& eager_run, const std::filesystem::path& compiled_run,
                 const RunOptions& options);

// Compares the planned steps a step at a time and gives each to `writers` in rank order, steps in
// order within a rank, then finish(). Throws as compare() does. Returns the run's totals.
RunTotals analyze_run(const RunPlan& plan, const RunOptions& options,
                      const std::vector<ReportWriter*>& writers);

// Gives comparisons already made (or read back from JSON) to `writers` as analyze_run() would
// have: rank by rank, step by step, then finish(). Returns the totals.
RunTotals write_run(const std::vector<RankComparison>& ranks,
                    const std::vector<ReportWriter*>& writers);

// What the stdout report shows of a run (docs/cli.md#dynaprobe-compare): a single step of a
// single rank is the spec's report; several steps or ranks open with the summary (the verdict
// and counts, the failing (rank, step, module) in root-cause order, where the root cause was
// first seen, the run's warnings, where the full reports are) and follow with the full reports
// of the first `reports_shown` failing steps in (step, rank) order, or of every step.
struct TextOptions {
  std::size_t reports_shown = 3;
  bool every_step = false;
  bool only_failing = false;  // each step's report shows its FAIL and WARN rows alone
  // Where the full reports are, for the summary's last line: "Full reports: " and this.
  std::string full_reports;
};
std::unique_ptr<ReportWriter> open_text_report(std::ostream& out, const RunShape& shape,
                                               const TextOptions& options);

// Partial JSON reports of one run (dynaprobe merge A.json B.json ...: each from `dynaprobe
// compare --json` of some ranks or steps, or Python's analyze_run shards), read back into
// comparisons: ranks in order, a rank's steps from every report that has them, in step order.
// Throws FormatError naming the report when it is not a dynaprobe JSON report, UsageError when two
// reports hold the same step of the same rank.
struct JsonReport {
  std::string name;  // what errors call it: the file's path
  std::string text;
};
std::vector<RankComparison> read_json_reports(const std::vector<JsonReport>& reports);

}  // namespace dynaprobe::analyze
