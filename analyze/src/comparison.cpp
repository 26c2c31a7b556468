// The comparison's data model: statuses, a step's counts and verdict, a comparison's verdict.
#include "dynaprobe/analyze/comparison.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace dynaprobe::analyze {

Status note_status(std::string_view note) {
  // The spec's skip markers (常见标记说明); all other notes warn.
  static constexpr std::pair<std::string_view, Status> kNoteStatus[] = {
      {notes::kIgnored, Status::kSkip},
      {notes::kCompiledWrapper, Status::kSkip},
      {notes::kInsideCompiled, Status::kSkip},
  };
  for (const auto& [name, status] : kNoteStatus) {
    if (name == note) return status;
  }
  return Status::kWarn;
}

std::string_view status_name(Status status) {
  switch (status) {
    case Status::kPass:
      return "PASS";
    case Status::kFail:
      return "FAIL";
    case Status::kSkip:
      return "SKIP";
    case Status::kWarn:
      return "WARN";
  }
  return "?";
}

bool StepReport::all_pass() const { return counts().all_pass(); }

StepCounts StepReport::counts() const {
  StepCounts counts;
  for (const Row& row : rows) {
    switch (row.status) {
      case Status::kPass:
        ++counts.pass;
        break;
      case Status::kFail:
        ++counts.fail;
        break;
      case Status::kWarn:
        ++counts.warn;
        break;
      case Status::kSkip:
        ++counts.skip;
        break;
    }
    if (row.kind && row.eager && row.compiled) ++counts.compared;
    if (row.status == Status::kPass && row.tolerance_status == Status::kFail) ++counts.noise_pass;
    if (!row.kind || !row.metrics || !row.eager || !row.compiled) continue;
    if (recorded_once(*row.kind, single_pass)) {
      ++counts.shared;
    } else if (!row.reference_verdict.empty()) {
      if (reference_decides) ++counts.referenced;
    } else if (row.beyond_screen) {
      ++counts.screened;
    } else if (judged_by_tolerances_only(row)) {
      ++counts.low_precision_unreferenced;
    }
  }
  counts.loss_failed = loss_status() == Status::kFail;
  counts.no_reference_calls = no_reference_calls;
  return counts;
}

bool StepReport::judged_by_tolerances_only(const Row& row) const {
  if (!row.kind || !row.metrics || !row.eager || !row.compiled) return false;
  if (recorded_once(*row.kind, single_pass) || !row.reference_verdict.empty()) return false;
  if (row.beyond_screen) return false;
  const double float32 = unit_roundoff(formats::DType::kFloat32);
  return unit_roundoff(row.eager->dtype) > float32 || unit_roundoff(row.compiled->dtype) > float32;
}

Status StepReport::loss_status() const {
  if (!loss_compiled) return Status::kPass;  // no loss recorded: nothing to check
  const double compiled = *loss_compiled;
  if (single_pass || !loss_eager) return std::isfinite(compiled) ? Status::kPass : Status::kFail;
  const double eager = *loss_eager;
  // torch.isclose on the two scalars (eager = a, compiled = b).
  const bool close =
      eager == compiled ||
      (std::isfinite(std::fabs(eager - compiled)) &&
       std::fabs(eager - compiled) <= tolerances.atol + tolerances.rtol * std::fabs(compiled));
  return close ? Status::kPass : Status::kFail;
}

bool Comparison::all_pass() const {
  return !steps.empty() &&
         std::all_of(steps.begin(), steps.end(), [](const StepReport& s) { return s.all_pass(); });
}

}  // namespace dynaprobe::analyze
