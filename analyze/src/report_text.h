// What the renderers share (private to analyze/src): a row's shape, metrics, reference verdict
// and note, and a step's verdict, as the spec's reports spell them, and markup's entities. How a
// number is written is number_text.h's.
#pragma once

#include <string>

#include "dynaprobe/analyze/comparison.h"
#include "dynaprobe/analyze/number_text.h"

namespace dynaprobe::analyze::detail {

// The entity XML and HTML write for one of & < > " ', or nullptr for any other character.
const char* markup_entity(char c);
// The shape column: "(2, 3)", or "((2, 3), (3, 2))" for a shape mismatch.
std::string shape_text(const Row& row);
// The three metrics of a row; infinite for a shape mismatch, as the spec's tool reports them.
struct Numbers {
  double max_abs, mean_abs, max_rel;
};
Numbers numbers(const Row& row);
// A compiled error in units of the noise (Row::noise_units): "1.2x noise", "35x noise".
std::string noise_units_text(double units);
// The reference verdict of a row: "fp32: noise, 1.2x noise (rmse compiled=1.2e-03
// eager=1.0e-03)", with "; tolerances fail" (or pass) inside the parentheses when the verdict
// decided the status.
std::string reference_text(const Row& row);
// The CSV's note column: "NOTE: reason; fp64: ...".
std::string row_note(const Row& row);
// "ALL PASS" or "FAILED" (verdict_text).
std::string result_text(const StepCounts& counts);
// Why a step FAILED, before the tolerances in the RESULT line: "2 FAIL, 3 WARN; ", then ", loss
// FAIL" and ", nothing compared" when they apply. Empty for a pass, whose line the spec fixes.
std::string verdict_reasons(const StepCounts& counts);
// The rule that decided the step's rows, ending the RESULT line: the tolerances
// ("atol=1e-4 rtol=1e-3"), or the reference's noise rule when it decided every compared row
// ("reference: noise within 2x"), or both, with how many rows the reference decided.
std::string deciding_rule(const StepCounts& counts, const Tolerances& tolerances);
// The text inside the RESULT line's parentheses: verdict_reasons, then deciding_rule.
std::string result_details(const StepReport& report);

}  // namespace dynaprobe::analyze::detail
