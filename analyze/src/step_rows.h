// The phases of building one step's report rows (step_builder.cpp's StepBuilder runs them in
// order): the report header from the provenance, the modules in model order with their /modules
// attributes, the records paired by key, which calls each side ran, and the verdict table for
// module notes and for tensors that only one side holds. Private to analyze; the engine and
// tests/analyze/step_rows_test.cpp include it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dynaprobe/analyze/comparison.h"
#include "dynaprobe/formats/reader.h"

namespace dynaprobe::analyze {

// /modules/<module> attributes by module, both sides merged.
using ModuleAttributes = std::map<std::string, std::map<std::string, std::string>>;

using formats::is_forward;

// The fields of a report that the capture's provenance decides: single_pass (mode),
// capture_input, cast_dtype (empty for "None"), autocast. Keys that are absent keep the
// defaults.
void apply_provenance(const formats::Provenance& provenance, StepReport& report);

// The modules of a step in execution order, each once: the modules seen in records, in the order
// of their first record (the compiled side's file first: a call's records are written as it runs,
// so a module comes with its first forward call); a module of the capture's /modules list that
// has no record (not run, ignored, a failed hook) right after the module before it in that list.
class ModuleOrder {
 public:
  void add(const std::string& module) {
    if (seen_.insert(module).second) modules_.push_back(module);
  }
  // `listed` in model order: each one not placed yet goes right after the one before it there
  // (first when it is the first).
  void place_listed(const std::vector<std::string>& listed) {
    std::size_t at = 0;
    for (const std::string& module : listed) {
      if (seen_.insert(module).second) {
        modules_.insert(modules_.begin() + static_cast<std::ptrdiff_t>(at), module);
        ++at;
      } else {
        at = static_cast<std::size_t>(std::find(modules_.begin(), modules_.end(), module) -
                                      modules_.begin()) +
             1;
      }
    }
  }
  const std::vector<std::string>& modules() const { return modules_; }

 private:
  std::vector<std::string> modules_;
  std::set<std::string> seen_;
};

// The /modules attributes of both sides (either may be null); the eager side's value wins where
// both have a key.
ModuleAttributes merge_module_attributes(const formats::StepReader* eager,
                                         const formats::StepReader* compiled);

// Places the modules of both sides' /modules lists (either reader may be null) that have no record
// in `order` (after pair_records), each after the module before it in model order.
void add_listed_modules(const formats::StepReader* eager, const formats::StepReader* compiled,
                        ModuleOrder& order);

// What pairs a tensor of one side with the other's: the record key less step and side.
struct TensorKey {
  std::string module;
  std::uint32_t call;
  formats::Kind kind;
  std::uint32_t tensor_index;
  auto operator<=>(const TensorKey&) const = default;
};

// The records of one key: each null when its side has none.
struct Pair {
  const formats::RecordInfo* eager = nullptr;
  const formats::RecordInfo* compiled = nullptr;
  const formats::RecordInfo* reference = nullptr;
};
using Pairs = std::map<TensorKey, Pair>;

// Pairs the eager side's records of `eager` with the compiled side's of `compiled` (either may be
// null), and attaches the fp64 reference records, which live with the compiled side (single-pass
// writes both in one file). Loss records are not paired (the report's LOSS check reads them).
// Adds the modules of the records to `order`, the compiled side's first, each in record order.
// The pointers point into the readers' records().
// `eager_side`: the side of `eager` read as the eager one (kCompiled when a baseline capture of
// the compiled side stands in for it, Comparison::compiled_baseline).
Pairs pair_records(const formats::StepReader* eager, const formats::StepReader* compiled,
                   ModuleOrder& order, formats::Side eager_side = formats::Side::kEager);

// The pair a row compares. Single-pass re-runs the eager module on the very inputs of the compiled
// one and seeds its backward with the compiled module's grad_output: a fwd_input or grad_output
// recorded once stands for both sides.
Pair compared_pair(const TensorKey& key, Pair pair, bool single_pass);

// The row of a tensor key, before its verdict: key, each present side's dtype and shape, the label
// (eager's, else compiled's) and its place in capture order (the compiled record's position in its
// reader's records(), which the writer keeps in record order, else the eager one's).
Row tensor_row(const TensorKey& key, const Pair& pair, const formats::StepReader* eager,
               const formats::StepReader* compiled);

// The calls each side ran, from their forward records: a two-pass model can take another path
// when compiled, so a module may run on one side only. Its gradients are then missing, not a
// compiled wrapper's hooks that do not align.
struct CallsRun {
  std::set<std::pair<std::string, std::uint32_t>> compiled;
  std::map<std::string, std::set<std::uint32_t>> eager;

  // Single-pass runs both sides in one call, so there every call ran compiled.
  bool compiled_ran(const std::string& module, std::uint32_t call, bool single_pass) const {
    return single_pass || compiled.count({module, call}) > 0;
  }
  std::size_t eager_calls(const std::string& module) const {
    auto found = eager.find(module);
    return found == eager.end() ? 0 : found->second.size();
  }
};
CallsRun calls_run(const Pairs& pairs);

// The modules' roles (/modules attribute "role"): the wrapped modules (compile targets and
// nested wrapped ones) and the ignored ones.
class ModuleRoles {
 public:
  explicit ModuleRoles(const ModuleAttributes& modules);
  bool wrapped(const std::string& module) const;         // the module itself is wrapped
  bool inside_wrapped(const std::string& module) const;  // a submodule of a wrapped module
  bool ignored(const std::string& module) const;         // the module itself is ignored
  bool ignored_or_under(const std::string& module) const;

 private:
  std::vector<std::string> wrapped_, ignored_;
};

// The row of a module whose /modules entry has a non-empty note: that note and its reason, its
// status from note_status(). Two-pass, a NOT_RUN module (the capture counts the compiled copy's
// calls only) that ran `eager_calls` > 0 times eagerly gets a reason saying the copies took
// different paths. No row without a note.
std::optional<Row> module_note_row(const std::string& module,
                                   const std::map<std::string, std::string>& attributes,
                                   bool single_pass, std::size_t eager_calls);

// The row of an ignored module: SKIP, IGNORED. Its submodules get no rows.
Row ignored_row(const std::string& module);

// The WARN row of a module some of whose calls got no reference although one was asked for
// (attributes reference_missing, the number of calls, and reference_error, why); nullopt when
// every call got one.
struct NoReference {
  Row row;
  std::size_t calls = 0;
};
std::optional<NoReference> no_reference_row(const std::string& module,
                                            const std::map<std::string, std::string>& attributes);

// The verdict table for a tensor only one side holds. `kind` and the module's place decide the
// note; the status is note_status(note).
//
//   side held  kind      module                                 note
//   compiled   forward   any                                    MISSING_fwd_in_eager
//   compiled   backward  any                                    MISSING_bwd_in_eager
//   eager      forward   inside a wrapped module                SKIP_inside_compiled
//   eager      forward   otherwise                              MISSING_fwd_in_compiled
//   eager      backward  wrapped, the compiled model ran call   SKIP_compiled_wrapper
//   eager      backward  wrapped, compiled did not run call     MISSING_bwd_in_compiled
//   eager      backward  inside a wrapped module                SKIP_inside_compiled
//   eager      backward  otherwise                              MISSING_bwd_in_compiled
//
// A wrapped module's call the compiled model did not run says so in the reason (forward and
// backward alike); single-pass runs every call on both sides.
struct OneSidedCase {
  formats::Side held = formats::Side::kEager;  // kEager or kCompiled
  formats::Kind kind = formats::Kind::kFwdOutput;
  bool wrapped = false;         // ModuleRoles::wrapped
  bool inside_wrapped = false;  // ModuleRoles::inside_wrapped
  bool compiled_ran = true;     // CallsRun::compiled_ran
};
struct Verdict {
  Status status = Status::kWarn;
  std::string_view note;
  std::string reason;
};
Verdict one_sided_verdict(const OneSidedCase& row);

// Whether a stored tensor holds zeros only (either sign). A gradient only one side holds that is
// all zeros equals the other side's absence of one: a parameter or input the backward does not
// reach has a zero gradient, which autograd leaves out and AOTAutograd may return as zeros.
bool all_zeros(const formats::StepReader& reader, const formats::RecordInfo& record);

}  // namespace dynaprobe::analyze
