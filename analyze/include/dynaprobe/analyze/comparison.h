// The result of a comparison, as the engine makes it and every report reads it: a row per
// compared tensor or module note with its status, each step's report with its counts and root
// cause, and the comparison of two dumps. Data and the verdicts it implies, nothing that reads a
// dump: engine.h makes it, root_cause.h fills a step's root cause, report.h and report_model.h
// render it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/analyze/metrics.h"
#include "dynaprobe/formats/dtype.h"
#include "dynaprobe/formats/record.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::analyze {

enum class Status { kPass, kFail, kSkip, kWarn };
std::string_view status_name(Status status);  // "PASS", "FAIL", "SKIP", "WARN"

// The notes and /modules attributes, as the dump spells them (formats/vocabulary.h).
namespace notes = formats::vocabulary::note;
namespace module_attributes = formats::vocabulary::module_attribute;

// What a note makes of its row: the table in comparison.cpp (the spec's SKIP markers and IGNORED
// are skips; every other note, known or not, is a warning: a module that could not be compared
// is never a pass).
Status note_status(std::string_view note);

struct TensorSide {
  formats::DType dtype = formats::DType::kFloat32;
  std::vector<std::int64_t> shape;
};

// One line of the report: a compared tensor, a tensor present on one side only, or (no kind) a
// note about a whole module.
struct Row {
  std::string module;
  std::uint32_t call = 0;
  std::optional<formats::Kind> kind;
  std::uint32_t tensor_index = 0;
  std::string label;
  Status status = Status::kPass;
  std::string note;    // one of notes::*, or a capture note such as NOT_COMPILED
  std::string reason;  // why, in words (failures and notes)
  std::optional<TensorSide> eager;
  std::optional<TensorSide> compiled;
  std::optional<TensorMetrics> metrics;  // both sides present with equal shapes
  // The tolerances it was judged with, when not the step's (a tolerance rule, the dtype floor).
  std::optional<Tolerances> tolerances;
  // The reference (PrecisionChecker(reference=...), on by default in bf16/fp16): each side's
  // error against the module re-run in a wider dtype on the same inputs, and the verdict drawn
  // from them (judging.h, the noise rule). With a verdict, it decides the status (unless the dump's
  // verdict is "tolerances"), and tolerance_status keeps what the tolerances alone said.
  std::optional<TensorMetrics> reference_eager;     // reference (a) vs eager (b)
  std::optional<TensorMetrics> reference_compiled;  // reference (a) vs compiled (b)
  std::string reference_verdict;                    // "noise", "divergence" or empty
  // With a verdict: the compiled error in units of the noise (judging.h, NoiseMeasure::units).
  std::optional<double> noise_units;
  // A float32 row without a verdict: its RMSE relative to eager's magnitude when that is beyond
  // fp32 noise (judging.h, relative_screen), which made it FAIL.
  std::optional<double> beyond_screen;
  std::string reference_dtype;             // "fp32", "fp64": what the reference ran in
  std::optional<Status> tolerance_status;  // with a verdict: the tolerance check's
  // Where its record stands in capture order (the compiled side's, else the eager side's): the
  // order in which the step ran; root_cause.h uses it.
  std::uint64_t sequence = 0;

  // Shapes differ, or one side is complex and the other not (complex values compare as pairs).
  bool shape_mismatch() const {
    return eager && compiled &&
           (eager->shape != compiled->shape ||
            formats::is_complex(eager->dtype) != formats::is_complex(compiled->dtype));
  }
};

// Where a step's differences start: the first row in execution order that FAILs, and whether
// the module made the difference itself or received it. See root_cause.h.
struct Finding {
  std::size_t row = 0;   // index into StepReport::rows
  std::string origin;    // "local", "carried" or "unknown"
  std::string evidence;  // why, in words: what its inputs or received gradients showed
};
struct RootCause {
  std::optional<Finding> forward;   // first forward output (or input) to differ, in run order
  std::optional<Finding> backward;  // first gradient to differ, in backward order
  // What to do next: one line, naming the docs' entry. Also without a finding when the step
  // FAILED by warnings only (modules not compared): then about the first of them.
  std::string next;
  bool found() const { return forward || backward; }  // some row FAILs
  bool empty() const { return !found() && next.empty(); }
};

// The op localisation of one call (dynaprobe bisect --ops), read from its ops dump beside the
// dump (formats::schema::kOpsDir): per aten graph, how many ops were compared, how many FAIL and
// the first that does in graph order (the ops dump's rows, judged by this engine against eager
// with the fp64 reference as the noise bound).
struct OpFailure {
  std::string node;    // "rsqrt": the graph's node
  std::string op;      // "aten.rsqrt.default"
  std::string source;  // "/path/models.py:162  norm = ...", empty without a stack trace
  double max_abs = 0;
  double mean_abs = 0;
  Status status = Status::kFail;
};
struct OpsGraph {
  std::string graph;  // "forward", "backward", "inference"
  std::size_t ops = 0;
  std::size_t failing = 0;
  std::optional<OpFailure> first_failing;
};
struct OpsDump {
  std::string module;  // the module whose call was localised (provenance ops_module)
  std::uint32_t call = 0;
  std::string backend;         // in words (provenance ops_backend)
  std::filesystem::path dump;  // the ops dump's folder: `dynaprobe compare` it for every op
  std::vector<OpsGraph> graphs;
  // Why the ops dump could not be read ("...: not an HDF5 file"); graphs is then empty and
  // module/call are the folder name's.
  std::string error;
};

// What a step's verdict rests on; the RESULT line, the CSV and the JSON report state the same.
struct StepCounts {
  // Rows by status: tensor rows and module notes, as the CSV lists them after its LOSS row.
  std::size_t pass = 0;
  std::size_t fail = 0;
  std::size_t warn = 0;
  std::size_t skip = 0;
  std::size_t compared = 0;  // tensor rows with both sides present (passing or failing)
  // Passing rows that fail the tolerances but are within the reference's noise: how much of a
  // pass was close (counted in `pass` too).
  std::size_t noise_pass = 0;
  // Calls that got no reference although one was asked for (NO_REFERENCE rows say why).
  std::size_t no_reference_calls = 0;
  // Compared rows the reference's verdict decided (the noise rule), rows the fp32 screen FAILed,
  // and compared rows in bf16/fp16/float8 that no reference judged (the dtype's tolerances did):
  // what the RESULT line names as the rule that decided.
  std::size_t referenced = 0;
  std::size_t screened = 0;
  std::size_t shared = 0;  // single-pass fwd_input and grad_output: one record for both sides
  std::size_t low_precision_unreferenced = 0;
  bool loss_failed = false;  // the LOSS check (the CSV's LOSS row) is a FAIL

  bool nothing_compared() const { return compared == 0; }
  bool all_pass() const { return fail == 0 && warn == 0 && !loss_failed && compared > 0; }
};

struct StepReport {
  std::int64_t step = 0;
  // The compiled side's dump as the comparison was given it (a folder or step file): the next
  // line's commands name it. Empty for a report read back from JSON.
  std::string dump;
  std::optional<double> loss_eager;
  std::optional<double> loss_compiled;
  bool single_pass = false;  // loss_eager is NaN by design
  bool capture_input = true;
  std::string cast_dtype;  // "torch.bfloat16" when the capture used autocast, else empty
  std::string autocast;    // the user's own torch.autocast dtype around the modules, else empty
  bool reference_decides = true;  // a reference verdict decides its row (dump provenance verdict)
  std::size_t no_reference_calls = 0;  // calls without the reference asked for (NO_REFERENCE)
  // Why the step's file was not written, when the report of a pending step found out (a
  // capture with strict_io off judges such a step in memory); empty otherwise.
  std::string not_stored;
  Tolerances tolerances;
  std::vector<ToleranceRule> tolerance_rules;  // the dump's, then CompareOptions'
  bool dtype_aware = true;                     // the dtype-aware rtol floor applies
  std::vector<Row> rows;  // modules in model order, then call, kind, tensor index
  // What the capture wrote about each module in /modules (both sides merged; the eager dump's
  // value wins where both have a key): role, note and reason, and for compiled modules the
  // compiled functions they became (compiled_functions: "__compiled_fn_1,__compiled_fn_3", the
  // names of their graphs in /graphs), graph_breaks, graph_break_reasons, calls, ... Only modules
  // selected by CompareOptions::module_glob.
  std::map<std::string, std::map<std::string, std::string>> modules;
  RootCause root_cause;  // empty when no row FAILs
  // The op localisations of this step's calls beside the dump (CompareOptions::read_ops), in
  // the order of their folders' names; empty when there are none.
  std::vector<OpsDump> ops;

  // True when the loss check and every row pass (skipped and ignored rows do not count) and at
  // least one tensor was compared (both sides present), as the RESULT line says: a step where
  // nothing was compared is never a pass.
  bool all_pass() const;
  // The counts behind all_pass() and the RESULT line (docs/report-format.md).
  StepCounts counts() const;
  // A compared row in bf16/fp16/float8 that no reference judged: the dtype's tolerances decided
  // it (counted in StepCounts::low_precision_unreferenced; the CSV note says so).
  bool judged_by_tolerances_only(const Row& row) const;
  // The LOSS check: two-pass compares the two losses with the tolerances; single-pass has only
  // the compiled loss and PASSes when it is finite; without a recorded loss there is no check.
  Status loss_status() const;
};

struct ProvenanceDifference {
  std::string key;
  std::string eager;
  std::string compiled;
};

struct Comparison {
  std::vector<StepReport> steps;
  formats::Provenance eager_provenance;
  formats::Provenance compiled_provenance;
  bool separate_dumps = false;  // eager and compiled sides come from two different dumps
  // Both dumps hold only the compiled side (PrecisionChecker.capture(side="compiled")): the first
  // is a baseline, its compiled side compared in the eager side's place with the second's, e.g.
  // before and after a torch upgrade. The report's "eager" numbers are the baseline's.
  bool compiled_baseline = false;
  std::vector<ProvenanceDifference> provenance_differences;  // only when two dumps are compared
  std::vector<std::string> warnings;  // unfinished steps, steps found on one side only, ...

  // False when there is no step, or any step is not a pass.
  bool all_pass() const;
};

}  // namespace dynaprobe::analyze
