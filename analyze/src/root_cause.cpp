#include "dynaprobe/analyze/root_cause.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string_view>
#include <vector>

#include "dynaprobe/analyze/number_text.h"

namespace dynaprobe::analyze {
using formats::Kind;

namespace {

bool same_call(const Row& a, const Row& b) { return a.module == b.module && a.call == b.call; }

std::string max_abs_text(const Row& row) {
  if (row.shape_mismatch()) return "shape mismatch";
  return "max_abs=" + format_float(row.metrics ? row.metrics->max_abs : NAN, "%.3e");
}

// The largest max_abs among the rows `pick` selects, and whether one of them FAILs.
struct Seen {
  bool any = false;
  bool failed = false;
  double max_abs = 0;
};
Seen seen(const StepReport& report, const std::function<bool(const Row&)>& pick) {
  Seen result;
  for (const Row& row : report.rows) {
    if (!row.kind || !pick(row)) continue;
    result.any = true;
    result.failed = result.failed || row.status == Status::kFail;
    if (row.metrics) result.max_abs = std::max(result.max_abs, row.metrics->max_abs);
  }
  return result;
}

std::string amount(double max_abs) { return "max_abs=" + format_float(max_abs, "%.3e"); }

// Did the module call of rows[index] make its forward difference, or receive it?
Finding forward_origin(const StepReport& report, std::size_t index) {
  const Row& row = report.rows[index];
  if (report.single_pass) {
    return {index, "local", "single-pass gives both sides the very same inputs"};
  }
  const Seen inputs =
      seen(report, [&](const Row& r) { return same_call(r, row) && *r.kind == Kind::kFwdInput; });
  if (!inputs.any) {
    return report.capture_input
               ? Finding{index, "local", "it has no tensor inputs"}
               : Finding{index, "unknown", "its inputs were not captured (capture_input=False)"};
  }
  if (inputs.failed) {
    return {index, "carried",
            "its inputs already differed (" + amount(inputs.max_abs) +
                "): the difference comes "
                "from before it, outside the wrapped modules or in an earlier call"};
  }
  return {index, "local", "its inputs matched (" + amount(inputs.max_abs) + ")"};
}

// Did the module of rows[index] make its gradient difference, or receive it?
Finding backward_origin(const StepReport& report, std::size_t index) {
  const Row& row = report.rows[index];
  if (report.single_pass) {
    return {index, "local",
            "single-pass gives both sides the same inputs and the same gradient from outside"};
  }
  // param_grad rows sum every call of the module.
  const bool all_calls = *row.kind == Kind::kParamGrad;
  const auto ours = [&](const Row& r) {
    return r.module == row.module && (all_calls || r.call == row.call);
  };
  const Seen received =
      seen(report, [&](const Row& r) { return ours(r) && *r.kind == Kind::kGradOutput; });
  if (received.failed) {
    return {index, "carried",
            "the gradient it received already differed (" + amount(received.max_abs) +
                "): the difference arises after it in the forward"};
  }
  const Seen inputs =
      seen(report, [&](const Row& r) { return ours(r) && *r.kind == Kind::kFwdInput; });
  if (inputs.failed) {
    return {index, "carried",
            "its forward inputs already differed (" + amount(inputs.max_abs) + ")"};
  }
  if (!received.any && *row.kind != Kind::kGradOutput) {
    return {index, "unknown", "the gradient it received was not recorded"};
  }
  return {index, "local", "the gradient it received matched (" + amount(received.max_abs) + ")"};
}

// Backward order: when a module call's gradients were recorded. param_grad rows (summed over
// calls, recorded at the end of the step) take their module's earliest gradient record. Indexed
// once per step: a large model has thousands of rows.
class BackwardOrder {
 public:
  explicit BackwardOrder(const StepReport& report) {
    for (const Row& r : report.rows) {
      if (!r.kind || (*r.kind != Kind::kGradInput && *r.kind != Kind::kGradOutput)) continue;
      auto [call, call_new] = by_call_.try_emplace({r.module, r.call}, r.sequence);
      if (!call_new) call->second = std::min(call->second, r.sequence);
      auto [module, module_new] = by_module_.try_emplace(r.module, r.sequence);
      if (!module_new) module->second = std::min(module->second, r.sequence);
    }
  }

  std::uint64_t operator()(const Row& row) const {
    if (*row.kind == Kind::kParamGrad) {
      auto found = by_module_.find(row.module);
      return found == by_module_.end() ? row.sequence : found->second;
    }
    auto found = by_call_.find({row.module, row.call});
    return found == by_call_.end() ? row.sequence : found->second;
  }

 private:
  std::map<std::pair<std::string, std::uint32_t>, std::uint64_t> by_call_;
  std::map<std::string, std::uint64_t> by_module_;
};

// The first row (in `order`) among those `pick` selects; nullopt when none.
std::optional<std::size_t> first_row(const StepReport& report,
                                     const std::function<bool(const Row&)>& pick,
                                     const std::function<std::uint64_t(const Row&)>& order) {
  std::optional<std::size_t> best;
  for (std::size_t i = 0; i < report.rows.size(); ++i) {
    const Row& row = report.rows[i];
    if (!row.kind || row.status != Status::kFail || !pick(row)) continue;
    if (!best || order(row) < order(report.rows[*best])) best = i;
  }
  return best;
}

const std::string* module_attribute(const StepReport& report, const std::string& module,
                                    std::string_view key) {
  auto found = report.modules.find(module);
  if (found == report.modules.end()) return nullptr;
  auto value = found->second.find(std::string(key));
  return value == found->second.end() ? nullptr : &value->second;
}

// The reduced precision a row was computed in: the capture's autocast (cast_dtype, or the
// user's own), else a bfloat16/float16 side; empty in full precision.
std::string reduced_precision(const StepReport& report, const Row& row) {
  if (!report.cast_dtype.empty()) return "autocast " + report.cast_dtype;
  if (!report.autocast.empty()) return "autocast " + report.autocast;
  for (const auto* side : {&row.eager, &row.compiled}) {
    if (*side && ((*side)->dtype == formats::DType::kBFloat16 ||
                  (*side)->dtype == formats::DType::kFloat16)) {
      return std::string(formats::dtype_name((*side)->dtype));
    }
  }
  return "";
}

// A word of a command line as a POSIX shell reads it: as it is when it needs no quoting.
std::string shell_word(const std::string& word) {
  const bool plain = !word.empty() && std::all_of(word.begin(), word.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) ||
           std::string_view("_./:=@%+,-").find(c) != std::string_view::npos;
  });
  if (plain) return word;
  std::string quoted = "'";
  for (char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// The modules a replay attribute (JSON written by the capture, replay_store.py) names as where
// its backend and inductor config objects were defined or are imported from ("module:attr"), in
// order, without the capture script (__main__), which no replay can import: the --import words
// of a bisect command, as stored_call.recorded_imports reads them.
std::vector<std::string> recorded_imports(const std::string& replay) {
  std::vector<std::string> modules;
  for (const std::string_view key :
       {std::string_view("\"defined\": \""), std::string_view("\"import\": \"")}) {
    for (std::size_t at = replay.find(key); at != std::string::npos;
         at = replay.find(key, at + 1)) {
      const std::size_t begin = at + key.size();
      const std::size_t end = replay.find('"', begin);
      const std::string path = replay.substr(begin, end == std::string::npos ? 0 : end - begin);
      const std::size_t colon = path.find(':');
      const std::string name = path.substr(0, colon);
      if (colon == std::string::npos || name == "__main__") continue;
      if (std::find(modules.begin(), modules.end(), name) == modules.end()) {
        modules.push_back(name);
      }
    }
  }
  return modules;
}

// The commands that find the compile stage and op where `module`'s numbers change (dynaprobe
// bisect --ops) and the smallest change that makes it pass (dynaprobe remedy), on this dump,
// importing the modules that define its backend and inductor passes, when it keeps the
// module's call for replay, else what to keep first.
std::string diagnose_and_fix_hint(const StepReport& report, const std::string& module) {
  const std::string dump = " " +
                           (report.dump.empty() ? std::string("DUMP") : shell_word(report.dump)) +
                           " --module " + shell_word(module);
  std::string imports;
  const std::string* replay = module_attribute(report, module, module_attributes::kReplay);
  if (replay) {
    for (const std::string& name : recorded_imports(*replay)) {
      imports += " --import " + shell_word(name);
    }
  }
  const std::string commands = "find the compile stage and op that change it: dynaprobe bisect" +
                               dump + " --ops" + imports +
                               "; then a change that fixes it: dynaprobe remedy" + dump + imports;
  if (replay) return commands;
  return "keep its call for replay (single-pass with dump=\"full\" or \"failing\", whose "
         "replay=\"failing\" is the default) and " +
         commands;
}

// What to do next: the first rule that applies, naming the docs/troubleshooting.md entry.
std::string next_step(const StepReport& report) {
  const RootCause& cause = report.root_cause;
  const Finding& first = cause.forward ? *cause.forward : *cause.backward;
  const Row& row = report.rows[first.row];
  const std::uint64_t nonfinite =
      row.metrics ? row.metrics->nonfinite_only_compiled : std::uint64_t{0};
  if (nonfinite > 0) {
    return "NaN/Inf appear only in the compiled run of " + row.module +
           ": a real divergence (overflow in a fused kernel, a wrong decomposition); narrow it "
           "down with finer wrapping (troubleshooting: \"Narrowing down: wrap finer\")";
  }
  // A module compiled in several graphs (graph breaks) is compared like any other, and its
  // graphs are bisected and remedied each (troubleshooting: a break changes no number by itself),
  // so only a module Dynamo did not compile at all has a next line of its own.
  const std::string* note = module_attribute(report, row.module, module_attributes::kNote);
  if (note && *note == notes::kNotCompiled) {
    return row.module +
           " was not compiled in this step (its compiled side ran eagerly): see "
           "troubleshooting, \"Graph breaks and NOT_COMPILED\"";
  }
  if (const std::string* drawn =
          module_attribute(report, row.module, module_attributes::kRandomDraws)) {
    return row.module + " draws random numbers (dropout, torch.rand; generator " + *drawn +
           ") in its compiled call, and inductor draws its own: set "
           "torch._inductor.config.fallback_random = True to compare the rest (troubleshooting: "
           "\"Random ops: dropout under inductor\")";
  }
  const std::string reference = row.reference_dtype.empty() ? "fp64" : row.reference_dtype;
  if (row.reference_verdict == "divergence") {
    return row.module + " is beyond " + reference +
           "-reference noise (its compiled error is more than " +
           format_float(kReferenceFactor, "%g") + "x eager's own): a compiler divergence; " +
           diagnose_and_fix_hint(report, row.module);
  }
  if (row.reference_verdict == "noise") {
    return row.module + " differs within " + reference +
           "-reference noise (the compiled error is no larger "
           "than eager's own, within " +
           format_float(kReferenceFactor, "%g") +
           "x): expected "
           "reordering of float arithmetic; loosen the tolerances for it rather than the compiler";
  }
  if (first.origin == "carried") {
    return "the difference enters " + row.module +
           " from outside the wrapped modules: wrap the "
           "code before it (troubleshooting: \"Narrowing down: wrap finer\")";
  }
  const std::string low_precision = reduced_precision(report, row);
  if (!low_precision.empty()) {
    return "in reduced precision (" + low_precision +
           ") reordered arithmetic differs by about the dtype's precision, and no reference "
           "judged " +
           row.module +
           ": run with the default reference=\"auto\" (or \"fp64\") to tell that noise from "
           "a divergence (troubleshooting: \"Reduced precision (autocast bf16, fp16)\")";
  }
  return "if " + row.module +
         " draws random numbers (dropout), inductor draws its own: see "
         "troubleshooting, \"Random ops: dropout under inductor\"; else " +
         diagnose_and_fix_hint(report, row.module);
}

// What to do after a step that FAILED by warnings alone: about its first row that WARNs (in
// execution order), by its note; empty when no row WARNs.
std::string warning_next_step(const StepReport& report) {
  const Row* first = nullptr;
  std::size_t warnings = 0;
  std::set<std::string> modules;
  for (const Row& row : report.rows) {
    if (row.status != Status::kWarn) continue;
    ++warnings;
    modules.insert(row.module);
    if (!first) first = &row;
  }
  if (!first) return "";
  const std::string_view note = first->note;
  std::string name = first->module;
  if (first->call > 0) name.append(" (call ").append(std::to_string(first->call)).append(")");
  if (first->kind) name.append(" ").append(formats::kind_name(*first->kind));
  std::string what;
  if (note == notes::kHookError) {
    what =
        "dynaprobe's own work for it failed: read its reason; wrap finer or check it in "
        "two-pass (reading-the-report: \"WARN HOOK_ERROR\")";
  } else if (note == notes::kNotCompiled) {
    what =
        "its compiled side ran eagerly: see troubleshooting, \"Graph breaks and "
        "NOT_COMPILED\"";
  } else if (note == notes::kNotRun) {
    what = "the step did not call it: wrap modules that run, or check the step";
  } else if (note == notes::kNoReference) {
    what =
        "it was judged without a reference: reference=\"fp32\" where float64 has no "
        "kernel, or reference=None (diagnosis: \"Is it noise?\")";
  } else if (note.rfind("MISSING_", 0) == 0) {
    what =
        "a tensor recorded on one side only: check the wrap granularity and that both runs "
        "call the module and run a backward through it (reading-the-report: \"Statuses "
        "and markers\")";
  } else {
    what = "read its reason (reading-the-report: \"Statuses and markers\")";
  }
  std::string out = "no row FAILs, but ";
  out.append(std::to_string(warnings)).append(warnings == 1 ? " row in " : " rows in ");
  out.append(std::to_string(modules.size())).append(modules.size() == 1 ? " module" : " modules");
  out.append(" could not be compared; the first, ").append(name).append(" ").append(note);
  return out.append(": ").append(what);
}

}  // namespace

void find_root_cause(StepReport& report) {
  RootCause cause;
  const auto run_order = [](const Row& row) { return row.sequence; };
  auto forward = first_row(
      report, [](const Row& r) { return *r.kind == Kind::kFwdOutput; }, run_order);
  if (!forward) {
    // No wrapped module's output differs, yet some inputs do: the difference comes from code
    // outside the wrapped modules.
    forward = first_row(
        report, [](const Row& r) { return *r.kind == Kind::kFwdInput; }, run_order);
  }
  if (forward) cause.forward = forward_origin(report, *forward);
  const BackwardOrder backward_order(report);
  auto backward = first_row(
      report,
      [](const Row& r) { return *r.kind == Kind::kGradInput || *r.kind == Kind::kParamGrad; },
      backward_order);
  if (!backward) {
    backward = first_row(
        report, [](const Row& r) { return *r.kind == Kind::kGradOutput; }, backward_order);
  }
  if (backward) cause.backward = backward_origin(report, *backward);
  report.root_cause = std::move(cause);
  report.root_cause.next =
      report.root_cause.found() ? next_step(report) : warning_next_step(report);
}

std::string describe_finding(const StepReport& report, const Finding& finding) {
  const Row& row = report.rows[finding.row];
  std::string name = row.module;
  if (row.call > 0) name += " (call " + std::to_string(row.call) + ")";
  // appended piece by piece: GCC 12 warns of " " + string (its bug 105329)
  name.append(" ").append(formats::kind_name(*row.kind)).append("[");
  name.append(std::to_string(row.tensor_index)).append("]");
  if (row.kind == Kind::kParamGrad && !row.label.empty()) name += " " + row.label;
  return formats::printable_name(name) + " (" + max_abs_text(row) + "): " + finding.origin + ", " +
         finding.evidence;
}

}  // namespace dynaprobe::analyze
