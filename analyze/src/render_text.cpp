// The stdout report (docs/report-format.md#stdout), in the spec's layout byte for byte, and the
// provenance lines printed before it when two dumps are compared.
#include <algorithm>
#include <cmath>
#include <vector>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/root_cause.h"
#include "dynaprobe/formats/vocabulary.h"
#include "report_text.h"

namespace dynaprobe::analyze {
namespace {

using formats::Kind;
using namespace detail;

constexpr int kRuleWidth = 72;
constexpr int kNameWidth = 51;
const std::string kRule(kRuleWidth, '=');
const std::string kSectionRule = "  " + std::string(68, '-');
// Continuation lines of a module with several tensors start under the first tensor's details.
const std::string kContinuation(2 + 4 + 2 + kNameWidth + 2, ' ');

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

// The end of a single-pass Loss line: why eager is nan, where the reader sees the nan (the spec's
// 提示 and 关于 single-pass 的 loss_eager=NaN; its example line is two-pass and stays as it is).
const std::string kSinglePassLoss = "  (single-pass: no whole-model eager run)";
// Below a single-pass report, so its zero rows are not read as a comparison.
const std::string kSinglePassHint =
    "  single-pass: FORWARD INPUT and grad_output are the tensors both sides share (0 by design);\n"
    "  FORWARD OUTPUT and grad_input are what compares the two sides.\n";

// A row's details (why it fails, its own tolerances, its reference verdict) go on lines of their
// own below it, indented under the module name and wrapped to a 120-column terminal: the row
// above keeps the spec's layout, and with its details on one line it reached ~230 columns.
constexpr std::size_t kTerminalWidth = 120;
const std::string kDetailIndent(2 + 4 + 2, ' ');

std::string display_name(const Row& row, bool backward) {
  std::string name = formats::printable_name(row.module);
  if (backward && row.kind) name += "." + std::string(formats::kind_name(*row.kind));
  if (row.call > 0) name += " (call " + std::to_string(row.call) + ")";
  return name;
}

// Whether an output's label (its pytree key path: "[0]", "['logits']", ".hidden") names a dict
// key or an attribute, which the index alone does not say; tuple positions are the index.
bool names_a_key(const std::string& label) {
  return label.find_first_of("'.\"") != std::string::npos;
}

// What the row's line shows after its name: the note, or [OK]/[!!], the spec's metrics and what
// tells the tensor apart (a complex dtype, a parameter, a dict key).
std::string detail_text(const Row& row) {
  if (!row.note.empty()) return formats::printable_name(row.note);
  const Numbers n = numbers(row);
  std::string text = tensor_detail_text(row.status == Status::kPass, n.max_abs, n.mean_abs,
                                        n.max_rel, shape_text(row));
  // Complex rows say so: their metrics are over the real and imaginary parts.
  for (const auto* side : {&row.eager, &row.compiled}) {
    if (*side && formats::is_complex((*side)->dtype)) {
      text += "  dtype=" + std::string(formats::dtype_name((*side)->dtype));
      break;
    }
  }
  if (row.kind == Kind::kParamGrad && !row.label.empty()) {
    text += "  param=" + formats::printable_name(row.label);
  } else if (row.kind == Kind::kFwdOutput && names_a_key(row.label)) {
    text += "  output=" + formats::printable_name(row.label);
  }
  return text;
}

// `parts` as lines of at most kTerminalWidth columns: the first line starts with `first`, the
// others with `rest`; the parts are two spaces apart. A part moves whole to the next line when it
// does not fit; one longer than a line wraps at its spaces (a word longer than a line stays whole).
std::string wrap_parts(const std::vector<std::string>& parts, const std::string& first,
                       const std::string& rest) {
  std::string out;
  std::string current;
  const auto width = [&] {  // at least 20 columns, whatever the prefix
    const std::size_t prefix = (out.empty() ? first : rest).size();
    return prefix + 20 < kTerminalWidth ? kTerminalWidth - prefix : 20;
  };
  const auto flush = [&] {
    if (!current.empty()) out += (out.empty() ? first : rest) + current + "\n";
    current.clear();
  };
  for (const std::string& part : parts) {
    if (!current.empty() && current.size() + 2 + part.size() > width()) flush();
    if (!current.empty()) current += "  ";
    std::size_t start = 0;
    while (start < part.size()) {
      std::size_t end = part.find(' ', start);
      if (end == std::string::npos) end = part.size();
      const std::string word = part.substr(start, end - start);
      start = end + 1;
      const bool first_word = current.empty() || current.ends_with("  ");
      if (!first_word && current.size() + 1 + word.size() > width()) flush();
      current += (current.empty() || current.ends_with("  ") ? "" : " ") + word;
    }
  }
  flush();
  return out;
}

// The lines below the row, where they say something the row does not: a note's reason; a failing
// row's reason when the metrics alone do not say it ("32 NaN/Inf only in compiled", as the CSV's
// note column has it); the tolerances the row was judged with when not the RESULT line's and they
// decided it (no reference verdict did) on a row that differs at all; the reference verdict
// unless it and the tolerances both pass the row (the CSV's note and the JSON keep it). Words
// wrap at kTerminalWidth; the parts are two spaces apart, as on the row.
std::string detail_lines(const Row& row, bool reference_decides) {
  std::vector<std::string> parts;
  if (!row.reason.empty() && (!row.note.empty() || !row.shape_mismatch())) {
    parts.push_back(formats::printable_name(row.reason));
  }
  const bool verdict_decided = !row.reference_verdict.empty() && reference_decides;
  const bool differs = !row.metrics || row.metrics->max_abs != 0 || row.status != Status::kPass;
  if (row.note.empty() && row.tolerances && !verdict_decided && differs) {
    parts.push_back("tol: atol=" + format_tolerance(row.tolerances->atol) +
                    " rtol=" + format_tolerance(row.tolerances->rtol));
  }
  const bool both_pass = row.status == Status::kPass &&
                         row.tolerance_status.value_or(Status::kPass) == Status::kPass &&
                         row.reference_verdict == "noise";
  if (row.note.empty() && !row.reference_verdict.empty() && !both_pass) {
    parts.push_back(reference_text(row));
  }
  return wrap_parts(parts, kDetailIndent, kDetailIndent);
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

// A path as a shell word: quoted when it holds characters the shell would read.
std::string shell_word(const std::string& text) {
  const bool plain = !text.empty() && text.find_first_not_of(
                                          "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                          "0123456789_./-+:@%,=") == std::string::npos;
  if (plain) return text;
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// "  forward   ": a graph's name in the column ROOT CAUSE's labels have.
std::string label_column(const std::string& label) {
  std::string out = "  " + label + " ";
  if (out.size() < 12) out.resize(12, ' ');
  return out;
}

// One aten graph of an op localisation: its first op that fails, or that none does.
std::string ops_graph_text(const OpsGraph& graph) {
  const std::string label = label_column(formats::printable_name(graph.graph));
  const std::string rest(label.size(), ' ');
  const std::string count = std::to_string(graph.ops) + " op" + (graph.ops == 1 ? "" : "s");
  if (!graph.first_failing) {
    return wrap_parts({"no op fails beyond fp64 noise (" + count + ")"}, label, rest);
  }
  const OpFailure& op = *graph.first_failing;
  std::vector<std::string> parts = {
      "first op that fails: " + formats::printable_name(op.node) + " (" +
          formats::printable_name(op.op) + ")",
      "max_abs=" + format_float(op.max_abs, "%.3e"),
      "(" + std::to_string(graph.failing) + " of " + count + " fail)"};
  if (!op.source.empty()) parts.push_back("at " + formats::printable_name(op.source));
  return wrap_parts(parts, label, rest);
}

// The op localisations of the step (dynaprobe bisect --ops), below ROOT CAUSE: per call, the
// first op of each aten graph that fails and the command that reports every op. Nothing without
// an ops dump, so every other report stays as it was.
std::string ops_text(const StepReport& report) {
  std::string out;
  for (const OpsDump& ops : report.ops) {
    std::string title =
        "OPS  " + formats::printable_name(ops.module) + " call " + std::to_string(ops.call);
    if (!ops.backend.empty()) title += " (" + formats::printable_name(ops.backend) + ")";
    out += '\n';  // appended piece by piece: GCC 12 warns of "\n" + string (its bug 105329)
    out += wrap_parts({title}, "  ", "  ");
    out += kSectionRule + "\n";
    const std::string dump = formats::printable_name(ops.dump.string());
    if (!ops.error.empty()) {
      out += wrap_parts({"ops dump " + dump + " unreadable: " + formats::printable_name(ops.error)},
                        "  ", "  ");
      continue;
    }
    for (const OpsGraph& graph : ops.graphs) out += ops_graph_text(graph);
    if (ops.graphs.empty()) out += "  no op compared\n";
    out += wrap_parts({"dynaprobe compare " + shell_word(dump)}, label_column("every op"),
                      std::string(12, ' '));
  }
  return out;
}

}  // namespace

std::string tensor_detail_text(bool ok, double max_abs, double mean_abs, double max_rel,
                               std::string_view shape) {
  return std::string(ok ? "[OK]" : "[!!]") + " max_abs=" + format_float(max_abs, "%.3e") +
         "  mean_abs=" + format_float(mean_abs, "%.3e") +
         "  max_rel=" + format_float(max_rel, "%.3e") + "  shape=" + std::string(shape);
}

std::string render_text(const StepReport& report, bool only_failing) {
  std::string out = kRule + "\n";
  const double compiled = report.loss_compiled.value_or(NAN);
  const double eager = report.single_pass ? NAN : report.loss_eager.value_or(NAN);
  out += "  Loss  eager=" + format_float(eager, "%.6f") +
         "  compiled=" + format_float(compiled, "%.6f") +
         "  diff=" + format_float(std::fabs(eager - compiled), "%.3e");
  if (!report.cast_dtype.empty()) out += "  cast_dtype=" + report.cast_dtype;
  if (!report.autocast.empty()) out += "  autocast=" + report.autocast;
  if (report.single_pass) out += kSinglePassLoss;
  out += "\n" + kRule + "\n";
  const auto hidden = [&](Status status) {
    return only_failing && status != Status::kFail && status != Status::kWarn;
  };
  if (only_failing) {
    const auto not_shown = std::count_if(report.rows.begin(), report.rows.end(),
                                         [&](const Row& row) { return hidden(row.status); });
    out += "  failing rows only: " + std::to_string(not_shown) +
           " passing or skipped row(s) not shown\n";
  }

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
          if (!hidden(row.status)) {
            body += line(row.status, display_name(row, false), detail_text(row)) +
                    detail_lines(row, report.reference_decides);
          }
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
        if (hidden(worst)) {
          i = end;
          continue;
        }
        body += line(worst, display_name(row, section == 2), detail_text(row)) +
                detail_lines(row, report.reference_decides);
        for (std::size_t j = i + 1; j < end; ++j) {
          body += kContinuation + detail_text(report.rows[j]) + "\n" +
                  detail_lines(report.rows[j], report.reference_decides);
        }
        i = end;
      }
      out += "\n  " + std::string(kTitles[section]) + "\n" + kSectionRule + "\n" + body;
      any_section = true;
    }
  }
  out += "\n" + kRule + "\n";
  out += "  RESULT: " + result_text(report.counts()) + "  (" + result_details(report) + ")\n";
  out += kRule + "\n";
  if (!report.not_stored.empty()) {
    out += "  NOT STORED  " + formats::printable_name(report.not_stored) + "\n";
  }
  out += root_cause_text(report);
  if (report.single_pass) out += kSinglePassHint;
  out += ops_text(report);
  return out;
}

std::string render_provenance(const Comparison& comparison) {
  if (!comparison.separate_dumps) return "";
  namespace named = formats::vocabulary::provenance;
  static constexpr std::string_view kKeys[] = {
      named::kHost,        named::kTorchVersion, named::kDevice, named::kBackend,
      named::kParamDtypes, named::kCastDtype,    named::kMode};
  std::string out;
  for (const auto& [label, provenance] :
       {std::pair{comparison.compiled_baseline ? "Baseline:     " : "Eager side:   ",
                  &comparison.eager_provenance},
        std::pair{"Compiled side:", &comparison.compiled_provenance}}) {
    out += label;
    for (const std::string_view key : kKeys) {
      auto found = provenance->find(std::string(key));
      if (found != provenance->end() && !found->second.empty()) {
        out += " " + std::string(key) + "=" + formats::printable_name(found->second);
      }
    }
    out += "\n";
  }
  if (comparison.provenance_differences.empty()) return out;
  out += comparison.compiled_baseline
             ? "Provenance differs between the baseline and the compiled dump:\n"
             : "Provenance differs between the eager and the compiled dump:\n";
  for (const auto& difference : comparison.provenance_differences) {
    out += "  " + formats::printable_name(difference.key) +
           (comparison.compiled_baseline ? ": baseline=" : ": eager=") +
           (difference.eager.empty() ? "(none)" : formats::printable_name(difference.eager)) +
           "  compiled=" +
           (difference.compiled.empty() ? "(none)" : formats::printable_name(difference.compiled)) +
           "\n";
  }
  return out;
}

}  // namespace dynaprobe::analyze
