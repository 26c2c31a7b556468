#include "dynaprobe/analyze/report.h"

#include <cmath>
#include <cstdio>
#include <map>

#include "dynaprobe/analyze/root_cause.h"

namespace dynaprobe::analyze {
namespace {

using formats::Kind;

constexpr int kRuleWidth = 72;
constexpr int kNameWidth = 51;
const std::string kRule(kRuleWidth, '=');
const std::string kSectionRule = "  " + std::string(68, '-');
// Continuation lines of a module with several tensors start under the first tensor's details.
const std::string kContinuation(2 + 4 + 2 + kNameWidth + 2, ' ');

std::string printf_string(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, value);
  return buffer;
}

// "1e-4", "0.001"... as a person writes a tolerance.
std::string format_tolerance(double value) {
  for (int precision = 0; precision < 17; ++precision) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%.*e", precision, value);
    if (std::strtod(buffer, nullptr) != value) continue;
    std::string text = buffer;
    const auto e = text.find('e');
    std::string mantissa = text.substr(0, e);
    const int exponent = std::atoi(text.c_str() + e + 1);
    if (exponent >= -2 && exponent <= 3) return printf_string("%.15g", value);
    return mantissa + "e" + std::to_string(exponent);
  }
  return printf_string("%.17g", value);
}

std::string flag_text(Status status) {
  switch (status) {
    case Status::kPass:
      return "pass";
    case Status::kFail:
      return "FAIL";
    case Status::kSkip:
      return "skip";
    case Status::kWarn:
      return "WARN";
  }
  return "????";
}

// Worse statuses win when rows are shown together.
int severity(Status status) {
  switch (status) {
    case Status::kSkip:
      return 0;
    case Status::kPass:
      return 1;
    case Status::kWarn:
      return 2;
    case Status::kFail:
      return 3;
  }
  return 0;
}

// Below a single-pass report, what the spec's 提示 says about it (关于 single-pass 的
// loss_eager=NaN), so the nan and the zero rows are not read as a problem.
const std::string kSinglePassHint =
    "  single-pass: eager=nan is expected (no whole-model eager run); FORWARD INPUT and\n"
    "  grad_output are the tensors both sides share (0 by design): FORWARD OUTPUT and grad_input\n"
    "  are what compares the two sides.\n";

std::string display_name(const Row& row, bool backward) {
  std::string name = formats::printable_name(row.module);
  if (backward && row.kind) name += "." + std::string(formats::kind_name(*row.kind));
  if (row.call > 0) name += " (call " + std::to_string(row.call) + ")";
  return name;
}

std::string shape_text(const Row& row) {
  if (row.shape_mismatch()) {
    return "(" + formats::shape_string(row.eager->shape) + ", " +
           formats::shape_string(row.compiled->shape) + ")";
  }
  const auto& side = row.eager ? row.eager : row.compiled;
  return side ? formats::shape_string(side->shape) : "";
}

// The three metrics of a row; infinite for a shape mismatch, as the spec's tool reports them.
struct Numbers {
  double max_abs, mean_abs, max_rel;
};
Numbers numbers(const Row& row) {
  if (row.metrics) return {row.metrics->max_abs, row.metrics->mean_abs, row.metrics->max_rel};
  return {INFINITY, INFINITY, INFINITY};
}

// The fp64 reference verdict of a row: "fp64: noise (rmse compiled=1.2e-03 eager=1.0e-03)".
std::string reference_text(const Row& row) {
  return "fp64: " + row.reference_verdict +
         " (rmse compiled=" + format_float(row.reference_compiled->rmse, "%.1e") +
         " eager=" + format_float(row.reference_eager->rmse, "%.1e") + ")";
}

std::string detail_text(const Row& row) {
  if (!row.note.empty()) {
    return formats::printable_name(row.note) +
           (row.reason.empty() ? "" : "  " + formats::printable_name(row.reason));
  }
  const Numbers n = numbers(row);
  std::string text = std::string(row.status == Status::kPass ? "[OK]" : "[!!]") +
                     " max_abs=" + format_float(n.max_abs, "%.3e") +
                     "  mean_abs=" + format_float(n.mean_abs, "%.3e") +
                     "  max_rel=" + format_float(n.max_rel, "%.3e") + "  shape=" + shape_text(row);
  if (row.kind == Kind::kParamGrad && !row.label.empty()) {
    text += "  param=" + formats::printable_name(row.label);
  }
  // Why a failing row fails when the metrics alone do not say ("32 NaN/Inf only in compiled"),
  // as the CSV's note column has it.
  if (row.status != Status::kPass && !row.reason.empty() && !row.shape_mismatch()) {
    text += "  " + formats::printable_name(row.reason);
  }
  if (row.tolerances) {
    text += "  tol: atol=" + format_tolerance(row.tolerances->atol) +
            " rtol=" + format_tolerance(row.tolerances->rtol);
  }
  if (!row.reference_verdict.empty()) text += "  " + reference_text(row);
  return text;
}

std::string line(Status status, const std::string& name, const std::string& detail) {
  std::string padded = name;
  if (padded.size() < static_cast<std::size_t>(kNameWidth)) padded.resize(kNameWidth, ' ');
  return "  " + flag_text(status) + "  " + padded + "  " + detail + "\n";
}

// FORWARD INPUT, FORWARD OUTPUT (every other forward kind), then BACKWARD (every backward kind):
// a new kind is reported by its pass (formats::is_forward), with no change here.
bool in_section(const Row& row, int section) {
  if (!row.kind) return false;
  switch (section) {
    case 0:
      return *row.kind == Kind::kFwdInput;
    case 1:
      return formats::is_forward(*row.kind) && *row.kind != Kind::kFwdInput;
    default:
      return !formats::is_forward(*row.kind);
  }
}

// CSV field quoting as Python's csv module does by default (QUOTE_MINIMAL).
std::string csv_field(const std::string& field) {
  if (field.find_first_of(",\"\r\n") == std::string::npos) return field;
  std::string quoted = "\"";
  for (char c : field) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + "\"";
}

std::string csv_line(const std::vector<std::string>& fields) {
  std::string text;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (i) text += ',';
    text += csv_field(fields[i]);
  }
  return text + "\n";
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

// The 9 CSV columns of each row of a step, LOSS first. `merged` uses the multi-rank example's
// spelling for rows without metrics ("-" and "N/A").
std::vector<std::vector<std::string>> csv_rows(const StepReport& report, bool merged) {
  std::vector<std::vector<std::string>> rows;
  const std::string loss_status(status_name(report.loss_status()));
  const double compiled = report.loss_compiled.value_or(NAN);
  if (report.single_pass || !report.loss_eager) {
    rows.push_back({"LOSS", "loss", "0", loss_status, "N/A", "N/A", "N/A",
                    "compiled=" + format_float(compiled, "%.6f"),
                    report.single_pass ? "single_pass mode" : ""});
  } else {
    const double eager = *report.loss_eager;
    rows.push_back(
        {"LOSS", "loss", "0", loss_status, format_float(std::fabs(eager - compiled), "%.6e"), "N/A",
         "N/A",
         "eager=" + format_float(eager, "%.6f") + " compiled=" + format_float(compiled, "%.6f"),
         ""});
  }
  const std::string empty = merged ? "N/A" : "";
  for (const Row& row : report.rows) {
    std::string module = formats::printable_name(row.module) +
                         (row.call > 0 ? " (call " + std::to_string(row.call) + ")" : "");
    const std::string status(status_name(row.status));
    if (!row.kind) {
      rows.push_back(
          {module, merged ? "-" : "note", "0", status, empty, empty, empty, "", row_note(row)});
      continue;
    }
    const std::string kind(formats::kind_name(*row.kind));
    const std::string index = std::to_string(row.tensor_index);
    if (!row.metrics && !row.shape_mismatch()) {
      rows.push_back(
          {module, kind, index, status, empty, empty, empty, shape_text(row), row_note(row)});
      continue;
    }
    const Numbers n = numbers(row);
    rows.push_back({module, kind, index, status, format_float(n.max_abs, "%.6e"),
                    format_float(n.mean_abs, "%.6e"), format_float(n.max_rel, "%.6e"),
                    shape_text(row), row_note(row)});
  }
  return rows;
}

const std::vector<std::string> kCsvHeader = {"module_name",  "check_type",   "tensor_index",
                                             "status",       "max_abs_diff", "mean_abs_diff",
                                             "max_rel_diff", "shape",        "note"};

// JSON helpers: non-finite numbers become the strings "nan", "inf", "-inf". Strings are the
// printable_name() of the text, as in the text report, so they are valid UTF-8 without control
// characters whatever bytes a damaged dump holds.
std::string json_string(const std::string& raw) {
  const std::string text = formats::printable_name(raw);
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
          out += buffer;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return json_string(format_float(value, "%g"));
  return printf_string("%.9g", value);
}

std::string json_optional(const std::optional<double>& value) {
  return value ? json_number(*value) : "null";
}

std::string json_shape(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string json_map(const formats::Provenance& map) {
  std::string out = "{";
  bool first = true;
  for (const auto& [key, value] : map) {
    out += (first ? "" : ", ") + json_string(key) + ": " + json_string(value);
    first = false;
  }
  return out + "}";
}

std::vector<std::int64_t> unravel(std::int64_t index, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> coordinates(shape.size(), 0);
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 0) break;
    coordinates[i] = index % shape[i];
    index /= shape[i];
  }
  return coordinates;
}

std::string json_row(const Row& row) {
  std::string out = "{\"module\": " + json_string(row.module) +
                    ", \"call\": " + std::to_string(row.call) + ", \"check_type\": " +
                    json_string(row.kind ? std::string(formats::kind_name(*row.kind)) : "note") +
                    ", \"tensor_index\": " + std::to_string(row.tensor_index) +
                    ", \"label\": " + json_string(row.label) +
                    ", \"status\": " + json_string(std::string(status_name(row.status))) +
                    ", \"note\": " + json_string(row.note) +
                    ", \"reason\": " + json_string(row.reason);
  for (const auto& [name, side] :
       {std::pair{"eager", &row.eager}, std::pair{"compiled", &row.compiled}}) {
    out += std::string(", \"") + name + "\": ";
    out += *side ? "{\"dtype\": " + json_string(std::string(formats::dtype_name((*side)->dtype))) +
                       ", \"shape\": " + json_shape((*side)->shape) + "}"
                 : "null";
  }
  if (row.tolerances) {
    out += ", \"tolerances\": {\"atol\": " + json_number(row.tolerances->atol) +
           ", \"rtol\": " + json_number(row.tolerances->rtol) + "}";
  } else {
    out += ", \"tolerances\": null";
  }
  out += ", \"reference\": ";
  if (row.reference_verdict.empty()) {
    out += "null";
  } else {
    out += "{\"verdict\": " + json_string(row.reference_verdict) +
           ", \"eager_rmse\": " + json_number(row.reference_eager->rmse) +
           ", \"compiled_rmse\": " + json_number(row.reference_compiled->rmse) +
           ", \"eager_max_abs\": " + json_number(row.reference_eager->max_abs) +
           ", \"compiled_max_abs\": " + json_number(row.reference_compiled->max_abs) +
           ", \"factor\": " + json_number(kReferenceFactor) + "}";
  }
  out += ", \"metrics\": ";
  if (!row.metrics) return out + "null}";
  const TensorMetrics& m = *row.metrics;
  const double fraction =
      m.elements ? static_cast<double>(m.mismatches) / static_cast<double>(m.elements) : 0.0;
  out += "{\"max_abs\": " + json_number(m.max_abs) + ", \"mean_abs\": " + json_number(m.mean_abs) +
         ", \"max_rel\": " + json_number(m.max_rel) +
         ", \"allclose\": " + (m.allclose ? "true" : "false") +
         ", \"cosine\": " + json_number(m.cosine) + ", \"rmse\": " + json_number(m.rmse) +
         ", \"elements\": " + std::to_string(m.elements) +
         ", \"mismatches\": " + std::to_string(m.mismatches) +
         ", \"mismatch_fraction\": " + json_number(fraction) +
         ", \"nan_eager\": " + std::to_string(m.nan_eager) +
         ", \"nan_compiled\": " + std::to_string(m.nan_compiled) +
         ", \"inf_eager\": " + std::to_string(m.inf_eager) +
         ", \"inf_compiled\": " + std::to_string(m.inf_compiled) +
         ", \"nonfinite_only_compiled\": " + std::to_string(m.nonfinite_only_compiled);
  if (m.worst_index >= 0) {
    out += ", \"worst\": {\"flat_index\": " + std::to_string(m.worst_index) +
           ", \"index\": " + json_shape(unravel(m.worst_index, row.eager->shape)) +
           ", \"eager\": " + json_number(m.worst_eager) +
           ", \"compiled\": " + json_number(m.worst_compiled) + "}";
  }
  return out + "}}";
}

// The root-cause summary under the RESULT line of a failing step (nothing for a pass, whose
// report the spec fixes).
std::string root_cause_text(const StepReport& report) {
  const RootCause& cause = report.root_cause;
  if (cause.empty()) return "";
  std::string out = "\n  ROOT CAUSE\n" + kSectionRule + "\n";
  if (cause.forward) out += "  forward   " + describe_finding(report, *cause.forward) + "\n";
  if (cause.backward) out += "  backward  " + describe_finding(report, *cause.backward) + "\n";
  out += "  next      " + formats::printable_name(cause.next) + "\n";
  return out;
}

std::string json_finding(const StepReport& report, const std::optional<Finding>& finding) {
  if (!finding) return "null";
  const Row& row = report.rows[finding->row];
  return "{\"module\": " + json_string(row.module) + ", \"call\": " + std::to_string(row.call) +
         ", \"check_type\": " + json_string(std::string(formats::kind_name(*row.kind))) +
         ", \"tensor_index\": " + std::to_string(row.tensor_index) +
         ", \"label\": " + json_string(row.label) +
         ", \"origin\": " + json_string(finding->origin) +
         ", \"evidence\": " + json_string(finding->evidence) + "}";
}

std::string result_text(const StepCounts& counts) {
  return counts.all_pass() ? "ALL PASS" : "FAILED";
}

// Why a step FAILED, before the tolerances in the RESULT line: "2 FAIL, 3 WARN; ", then ", loss
// FAIL" and ", nothing compared" when they apply. Empty for a pass, whose line the spec fixes.
std::string verdict_reasons(const StepCounts& counts) {
  if (counts.all_pass()) return "";
  std::string text =
      std::to_string(counts.fail) + " FAIL, " + std::to_string(counts.warn) + " WARN";
  if (counts.loss_failed) text += ", loss FAIL";
  if (counts.nothing_compared()) text += ", nothing compared";
  return text + "; ";
}

// A step's verdict and what it rests on, with the same counts as its RESULT line and CSV.
std::string json_counts(const StepCounts& counts) {
  return "{\"verdict\": " + json_string(result_text(counts)) +
         ", \"fail\": " + std::to_string(counts.fail) +
         ", \"warn\": " + std::to_string(counts.warn) +
         ", \"pass\": " + std::to_string(counts.pass) +
         ", \"skip\": " + std::to_string(counts.skip) +
         ", \"compared\": " + std::to_string(counts.compared) +
         ", \"loss_fail\": " + (counts.loss_failed ? "true" : "false") +
         ", \"nothing_compared\": " + (counts.nothing_compared() ? "true" : "false") + "}";
}

}  // namespace

std::string format_float(double value, const char* printf_format) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return printf_string(printf_format, value);
}

std::string render_root_cause_json(const StepReport& report) {
  const RootCause& cause = report.root_cause;
  if (cause.empty()) return "null";
  return "{\"forward\": " + json_finding(report, cause.forward) +
         ", \"backward\": " + json_finding(report, cause.backward) +
         ", \"next\": " + json_string(cause.next) + "}";
}

std::string render_text(const StepReport& report) {
  std::string out = kRule + "\n";
  const double compiled = report.loss_compiled.value_or(NAN);
  const double eager = report.single_pass ? NAN : report.loss_eager.value_or(NAN);
  out += "  Loss  eager=" + format_float(eager, "%.6f") +
         "  compiled=" + format_float(compiled, "%.6f") +
         "  diff=" + format_float(std::fabs(eager - compiled), "%.3e");
  if (!report.cast_dtype.empty()) out += "  cast_dtype=" + report.cast_dtype;
  out += "\n" + kRule + "\n";

  static const char* kTitles[] = {"FORWARD INPUT", "FORWARD OUTPUT", "BACKWARD"};
  bool any_section = false;
  for (int pass = 0; pass < 2; ++pass) {
    for (int section = 0; section < 3; ++section) {
      if (section == 0 && !report.capture_input) continue;
      const bool has_tensors = std::any_of(report.rows.begin(), report.rows.end(),
                                           [&](const Row& r) { return in_section(r, section); });
      // Module notes show in every section that has tensors, or in FORWARD OUTPUT when none has.
      const bool shown = pass == 0 ? has_tensors : (!any_section && section == 1);
      if (!shown) continue;
      std::string body;
      for (std::size_t i = 0; i < report.rows.size();) {
        const Row& row = report.rows[i];
        if (!row.kind) {
          body += line(row.status, display_name(row, false), detail_text(row));
          ++i;
          continue;
        }
        if (!in_section(row, section)) {
          ++i;
          continue;
        }
        // One line per (module, call, kind); further tensors continue below it.
        std::size_t end = i + 1;
        Status worst = row.status;
        while (end < report.rows.size() && report.rows[end].kind == row.kind &&
               report.rows[end].module == row.module && report.rows[end].call == row.call) {
          if (severity(report.rows[end].status) > severity(worst)) worst = report.rows[end].status;
          ++end;
        }
        body += line(worst, display_name(row, section == 2), detail_text(row));
        for (std::size_t j = i + 1; j < end; ++j)
          body += kContinuation + detail_text(report.rows[j]) + "\n";
        i = end;
      }
      out += "\n  " + std::string(kTitles[section]) + "\n" + kSectionRule + "\n" + body;
      any_section = true;
    }
  }
  out += "\n" + kRule + "\n";
  out += "  RESULT: " + result_text(report.counts()) + "  (" + verdict_reasons(report.counts()) +
         "atol=" + format_tolerance(report.tolerances.atol) +
         " rtol=" + format_tolerance(report.tolerances.rtol) + ")\n";
  out += kRule + "\n";
  out += root_cause_text(report);
  if (report.single_pass) out += kSinglePassHint;
  return out;
}

std::string render_csv(const std::vector<StepReport>& steps) {
  std::string out = csv_line(kCsvHeader);
  for (const StepReport& report : steps) {
    for (const auto& fields : csv_rows(report, false)) out += csv_line(fields);
  }
  return out;
}

std::string render_merged_csv(const std::vector<RankComparison>& ranks) {
  std::vector<std::string> header = {"rank", "scenario"};
  header.insert(header.end(), kCsvHeader.begin(), kCsvHeader.end());
  std::string out = csv_line(header);
  for (const RankComparison& rank : ranks) {
    for (const StepReport& report : rank.comparison.steps) {
      for (auto fields : csv_rows(report, true)) {
        fields.insert(fields.begin(), {std::to_string(rank.rank), rank.scenario});
        out += csv_line(fields);
      }
    }
  }
  return out;
}

std::string render_provenance(const Comparison& comparison) {
  if (!comparison.separate_dumps) return "";
  static const char* kKeys[] = {"host",         "torch_version", "device", "backend",
                                "param_dtypes", "cast_dtype",    "mode"};
  std::string out;
  for (const auto& [label, provenance] :
       {std::pair{"Eager side:   ", &comparison.eager_provenance},
        std::pair{"Compiled side:", &comparison.compiled_provenance}}) {
    out += label;
    for (const char* key : kKeys) {
      auto found = provenance->find(key);
      if (found != provenance->end() && !found->second.empty()) {
        out += std::string(" ") + key + "=" + formats::printable_name(found->second);
      }
    }
    out += "\n";
  }
  if (comparison.provenance_differences.empty()) return out;
  out += "Provenance differs between the eager and the compiled dump:\n";
  for (const auto& difference : comparison.provenance_differences) {
    out += "  " + formats::printable_name(difference.key) + ": eager=" +
           (difference.eager.empty() ? "(none)" : formats::printable_name(difference.eager)) +
           "  compiled=" +
           (difference.compiled.empty() ? "(none)" : formats::printable_name(difference.compiled)) +
           "\n";
  }
  return out;
}

std::string render_json(const std::vector<RankComparison>& ranks) {
  std::map<Status, std::size_t> counts;
  std::size_t steps = 0, failed_steps = 0, loss_fail = 0, nothing_compared = 0, compared = 0;
  std::string first_cause = "null";  // where a root cause first appears, rank by rank
  bool all_pass = !ranks.empty();
  std::string body;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankComparison& rank = ranks[r];
    const Comparison& c = rank.comparison;
    all_pass = all_pass && c.all_pass();
    body += std::string(r ? ",\n" : "") + "    {\"rank\": " + std::to_string(rank.rank) +
            ", \"scenario\": " + json_string(rank.scenario) +
            ", \"all_pass\": " + (c.all_pass() ? "true" : "false") +
            ",\n     \"provenance\": {\"eager\": " + json_map(c.eager_provenance) +
            ", \"compiled\": " + json_map(c.compiled_provenance) +
            "},\n     \"provenance_differences\": [";
    for (std::size_t i = 0; i < c.provenance_differences.size(); ++i) {
      const auto& d = c.provenance_differences[i];
      body += std::string(i ? ", " : "") + "{\"key\": " + json_string(d.key) +
              ", \"eager\": " + json_string(d.eager) +
              ", \"compiled\": " + json_string(d.compiled) + "}";
    }
    body += "],\n     \"warnings\": [";
    for (std::size_t i = 0; i < c.warnings.size(); ++i) {
      body += std::string(i ? ", " : "") + json_string(c.warnings[i]);
    }
    body += "],\n     \"steps\": [";
    for (std::size_t s = 0; s < c.steps.size(); ++s) {
      const StepReport& step = c.steps[s];
      const StepCounts step_counts = step.counts();
      ++steps;
      failed_steps += step_counts.all_pass() ? 0 : 1;
      loss_fail += step_counts.loss_failed ? 1 : 0;
      nothing_compared += step_counts.nothing_compared() ? 1 : 0;
      compared += step_counts.compared;
      if (first_cause == "null" && !step.root_cause.empty()) {
        first_cause = "{\"rank\": " + std::to_string(rank.rank) +
                      ", \"step\": " + std::to_string(step.step) + "}";
      }
      body += std::string(s ? "," : "") + "\n      {\"step\": " + std::to_string(step.step) +
              ", \"single_pass\": " + (step.single_pass ? "true" : "false") +
              ", \"all_pass\": " + (step.all_pass() ? "true" : "false") +
              ", \"result\": " + json_counts(step_counts) +
              ", \"root_cause\": " + render_root_cause_json(step) +
              ", \"cast_dtype\": " + json_string(step.cast_dtype) +
              ", \"tolerances\": {\"atol\": " + json_number(step.tolerances.atol) +
              ", \"rtol\": " + json_number(step.tolerances.rtol) + "}" +
              ", \"loss\": {\"eager\": " +
              json_optional(step.single_pass ? std::nullopt : step.loss_eager) +
              ", \"compiled\": " + json_optional(step.loss_compiled) +
              ", \"status\": " + json_string(std::string(status_name(step.loss_status()))) +
              "},\n       \"modules\": {";
      bool first_module = true;
      for (const auto& [module, attributes] : step.modules) {
        body += std::string(first_module ? "" : ", ") + json_string(module) + ": " +
                json_map(attributes);
        first_module = false;
      }
      body += "},\n       \"rows\": [";
      for (std::size_t i = 0; i < step.rows.size(); ++i) {
        ++counts[step.rows[i].status];
        body += std::string(i ? "," : "") + "\n        " + json_row(step.rows[i]);
      }
      body += "]}";
    }
    body += "]}";
  }
  std::size_t rows = 0;
  for (const auto& [status, count] : counts) rows += count;
  return "{\n  \"summary\": {\"all_pass\": " + std::string(all_pass ? "true" : "false") +
         ", \"rows\": " + std::to_string(rows) +
         ", \"pass\": " + std::to_string(counts[Status::kPass]) +
         ", \"fail\": " + std::to_string(counts[Status::kFail]) +
         ", \"warn\": " + std::to_string(counts[Status::kWarn]) +
         ", \"skip\": " + std::to_string(counts[Status::kSkip]) +
         ", \"compared\": " + std::to_string(compared) +
         ", \"loss_fail\": " + std::to_string(loss_fail) + ", \"steps\": " + std::to_string(steps) +
         ", \"failed_steps\": " + std::to_string(failed_steps) +
         ", \"nothing_compared_steps\": " + std::to_string(nothing_compared) +
         ", \"root_cause_first_seen\": " + first_cause + "},\n  \"ranks\": [\n" + body +
         "\n  ]\n}\n";
}

}  // namespace dynaprobe::analyze
