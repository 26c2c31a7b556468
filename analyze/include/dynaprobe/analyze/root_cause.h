// Where does it start? The root-cause summary every failing report ends with (docs/user-guide.md,
// "Reading the report"): the first module in execution order whose forward output differs, the
// first in backward order whose gradients differ, whether each made the difference itself
// ("local": its inputs, or the gradient it received, matched) or received it ("carried"), and one
// line on what to do next.
#pragma once

#include "dynaprobe/analyze/comparison.h"

namespace dynaprobe::analyze {

// Fills report.root_cause from the statuses and metrics of its rows (call after the metrics are
// computed). Single-pass gives both sides of a module the same inputs and grad_output, so every
// difference it finds is local by construction.
void find_root_cause(StepReport& report);

// The finding in words, for the text report: "layers.1 fwd_output[0] (max_abs=1.2e-02): local,
// its inputs matched".
std::string describe_finding(const StepReport& report, const Finding& finding);

}  // namespace dynaprobe::analyze
