// The reports of a comparison: the spec's stdout report and CSV (报告说明, CSV 报告格式), the
// multi-rank CSV (多卡 CSV 报告格式), and JSON with every metric for scripts and CI.
// docs/report-format.md explains the choices where the spec's examples disagree.
#pragma once

#include <string>
#include <vector>

#include "dynaprobe/analyze/engine.h"

namespace dynaprobe::analyze {

// The stdout report of one step, byte for byte in the spec's layout.
std::string render_text(const StepReport& report);

// The spec's 9-column CSV of one or more steps (a header, then each step's LOSS row and rows).
std::string render_csv(const std::vector<StepReport>& steps);

// One comparison per rank and scenario, for the merged multi-rank CSV.
struct RankComparison {
  int rank = 0;
  std::string scenario;
  Comparison comparison;
};
// "rank,scenario" followed by the 9 columns, every rank's rows in rank order.
std::string render_merged_csv(const std::vector<RankComparison>& ranks);

// A step's root-cause summary as JSON (null when nothing FAILs), as render_json() has it under
// "root_cause"; Python's CompareResult.root_cause parses this very text.
std::string render_root_cause_json(const StepReport& report);

// Every row with every metric, the provenance of both sides and a summary.
std::string render_json(const std::vector<RankComparison>& ranks);

// When the sides come from two dumps: where each side was captured (host, torch version, device,
// backend, dtypes, mode) and what differs between them. Empty for a single dump.
std::string render_provenance(const Comparison& comparison);

// Python's formatting of floats in the spec's reports: "%.3e"/"%.6e"/"%.6f", with "nan", "inf"
// and "-inf" spelled as Python spells them.
std::string format_float(double value, const char* printf_format);

}  // namespace dynaprobe::analyze
