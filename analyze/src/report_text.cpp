#include "report_text.h"

#include <cmath>

#include "dynaprobe/analyze/report.h"

namespace dynaprobe::analyze::detail {

std::string shape_text(const Row& row) {
  if (row.shape_mismatch()) {
    return "(" + formats::shape_string(row.eager->shape) + ", " +
           formats::shape_string(row.compiled->shape) + ")";
  }
  const auto& side = row.eager ? row.eager : row.compiled;
  return side ? formats::shape_string(side->shape) : "";
}

Numbers numbers(const Row& row) {
  if (row.metrics) return {row.metrics->max_abs, row.metrics->mean_abs, row.metrics->max_rel};
  return {INFINITY, INFINITY, INFINITY};
}

std::string noise_units_text(double units) {
  if (!std::isfinite(units)) return "inf x noise";
  return format_float(units, units < 10 ? "%.1f" : "%.0f") + "x noise";
}

std::string reference_text(const Row& row) {
  std::string text = (row.reference_dtype.empty() ? "fp64" : row.reference_dtype) + ": " +
                     row.reference_verdict +
                     (row.noise_units ? ", " + noise_units_text(*row.noise_units) : "") +
                     " (rmse compiled=" + format_float(row.reference_compiled->rmse, "%.1e") +
                     " eager=" + format_float(row.reference_eager->rmse, "%.1e");
  if (row.tolerance_status) {
    text += *row.tolerance_status == Status::kPass ? "; tolerances pass" : "; tolerances fail";
  }
  return text + ")";
}

std::string row_note(const Row& row) {
  const std::string note = formats::printable_name(row.note);
  std::string reason = formats::printable_name(row.reason);
  if (!row.reference_verdict.empty()) {
    reason += (reason.empty() ? "" : "; ") + reference_text(row);
  }
  if (note.empty()) return reason;
  return reason.empty() ? note : note + ": " + reason;
}

std::string result_text(const StepCounts& counts) {
  return std::string(verdict_text(counts.all_pass()));
}

std::string verdict_reasons(const StepCounts& counts) {
  std::string text;
  if (!counts.all_pass()) {
    text = std::to_string(counts.fail) + " FAIL, " + std::to_string(counts.warn) + " WARN";
    if (counts.loss_failed) text += ", loss FAIL";
    if (counts.nothing_compared()) text += ", nothing compared";
  }
  // How close the passes were, and what could not be referenced (nothing for a step without a
  // reference, whose line the spec fixes).
  const auto add = [&text](const std::string& part) { text += (text.empty() ? "" : ", ") + part; };
  if (counts.noise_pass > 0) {
    add(std::to_string(counts.noise_pass) + " pass only within reference noise");
  }
  if (counts.no_reference_calls > 0) {
    add(std::to_string(counts.no_reference_calls) + " call(s) without a reference");
  }
  if (counts.screened > 0) add(std::to_string(counts.screened) + " beyond fp32 noise");
  if (counts.low_precision_unreferenced > 0) {
    add(std::to_string(counts.low_precision_unreferenced) +
        " low-precision row(s) without a reference: judged by the tolerances");
  }
  return text.empty() ? "" : text + "; ";
}

std::string result_details(const StepReport& report) {
  const StepCounts counts = report.counts();
  return verdict_reasons(counts) + deciding_rule(counts, report.tolerances);
}

std::string deciding_rule(const StepCounts& counts, const Tolerances& tolerances) {
  const std::string spec =
      "atol=" + format_tolerance(tolerances.atol) + " rtol=" + format_tolerance(tolerances.rtol);
  if (counts.referenced == 0) return spec;
  const std::string rule = "reference: noise within " + format_float(kReferenceFactor, "%g") + "x";
  if (counts.referenced + counts.shared == counts.compared) return rule;
  return rule + " (" + std::to_string(counts.referenced) +
         (counts.referenced == 1 ? " row" : " rows") + "), else " + spec;
}

const char* markup_entity(char c) {
  switch (c) {
    case '&':
      return "&amp;";
    case '<':
      return "&lt;";
    case '>':
      return "&gt;";
    case '"':
      return "&quot;";
    case '\'':
      return "&apos;";
    default:
      return nullptr;
  }
}

}  // namespace dynaprobe::analyze::detail
