#include "dynaprobe/analyze/engine.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/analyze/number_text.h"
#include "dynaprobe/analyze/root_cause.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"
#include "metric_tasks.h"
#include "ops_dumps.h"
#include "step_builder.h"

namespace dynaprobe::analyze {
namespace fs = std::filesystem;
using formats::Kind;
using formats::RecordInfo;
using formats::Side;
using formats::StepReader;
namespace vocabulary = formats::vocabulary;

namespace {

// The committed steps of one dump, opened (which reads each file's index, no tensor data).
struct OpenDump {
  std::map<std::int64_t, std::shared_ptr<StepReader>> steps;
  std::vector<fs::path> unfinished;
};

OpenDump open_dump(const fs::path& path, const formats::DumpFiles& files,
                   std::optional<std::int64_t> only_step) {
  require_committed_steps(path, files);
  OpenDump dump;
  dump.unfinished = files.unfinished;
  std::vector<fs::path> candidates = files.steps;
  if (only_step) {
    // The step is in the file name: open that file only, not every step of a long run (a checker
    // compares each step as it ends). Files renamed by hand are all opened and asked.
    const fs::path name = formats::step_file_name(*only_step);
    std::vector<fs::path> named;
    for (const fs::path& file : files.steps) {
      if (file.filename() == name) named.push_back(file);
    }
    if (!named.empty()) candidates = std::move(named);
  }
  for (const fs::path& file : candidates) {
    auto reader = std::make_shared<StepReader>(file);
    if (only_step && reader->step() != *only_step) continue;
    const std::int64_t step = reader->step();
    if (!dump.steps.emplace(step, std::move(reader)).second) {
      throw FormatError(file.string() + ": step " + std::to_string(step) + " appears twice in " +
                        path.string());
    }
  }
  return dump;
}

// Which sides a dump holds records of.
struct SidesHeld {
  bool eager = false;
  bool compiled = false;
};
SidesHeld sides_held(const OpenDump& dump) {
  SidesHeld held;
  for (const auto& [step, reader] : dump.steps) {
    for (const RecordInfo& info : reader->records()) {
      (info.key.side == Side::kEager ? held.eager : held.compiled) |=
          info.key.side != Side::kReference;
    }
  }
  return held;
}

// Two dumps given in the wrong order (or both of one side) would compare nothing or the wrong
// things; their provenance ("mode" of a one-sided capture) and their records tell. Returns the
// side of `eager` read as the eager one: the compiled side when both dumps hold only that side (a
// baseline capture of the compiled side, compared with one made later: after a torch upgrade).
Side check_sides(const fs::path& eager_path, const OpenDump& eager, const fs::path& compiled_path,
                 const OpenDump& compiled, const formats::Provenance& eager_provenance,
                 const formats::Provenance& compiled_provenance) {
  const std::string eager_mode =
      formats::provenance_value(eager_provenance, vocabulary::provenance::kMode);
  const std::string compiled_mode =
      formats::provenance_value(compiled_provenance, vocabulary::provenance::kMode);
  const SidesHeld e = sides_held(eager), c = sides_held(compiled);
  const bool eager_is_compiled =
      eager_mode == vocabulary::mode::kCompiledOnly || (!e.eager && e.compiled);
  const bool compiled_is_eager =
      compiled_mode == vocabulary::mode::kEagerOnly || (!c.compiled && c.eager);
  const bool compiled_only =
      compiled_mode == vocabulary::mode::kCompiledOnly || (!c.eager && c.compiled);
  if (eager_is_compiled && compiled_only) return Side::kCompiled;
  if (eager_is_compiled && compiled_is_eager) {
    throw UsageError("the two sides look swapped: " + eager_path.string() +
                     " holds the compiled side (mode=" + formats::printable_name(eager_mode) +
                     ") and " + compiled_path.string() +
                     " the eager side (mode=" + formats::printable_name(compiled_mode) +
                     "); give the eager dump first: dynaprobe compare " + compiled_path.string() +
                     " " + eager_path.string());
  }
  if (eager_is_compiled) {
    throw UsageError(eager_path.string() + " is given as the eager side but holds only the " +
                     "compiled side (mode=" + formats::printable_name(eager_mode) +
                     "); give an eager capture first, then the compiled one");
  }
  if (compiled_is_eager) {
    throw UsageError(compiled_path.string() + " is given as the compiled side but holds only " +
                     "the eager side (mode=" + formats::printable_name(compiled_mode) +
                     "); give the eager capture first, then the compiled one");
  }
  return Side::kEager;
}

// A --module filter that selects nothing would print an empty report: a usage error instead,
// naming the filter and a few of the modules the dumps have, so a typo is seen at once.
void check_module_glob(const std::string& glob, const OpenDump& eager, const OpenDump& compiled) {
  std::vector<std::string> names;  // in model order, each once
  std::set<std::string> seen;
  const auto add = [&](const std::string& module) {
    if (seen.insert(module).second) names.push_back(module);
  };
  for (const OpenDump* dump : {&eager, &compiled}) {
    for (const auto& [step, reader] : dump->steps) {
      for (const auto& info : reader->modules()) add(info.module);
      for (const RecordInfo& info : reader->records()) {
        if (info.key.kind != Kind::kLoss) add(info.key.module);
      }
    }
  }
  if (std::any_of(names.begin(), names.end(),
                  [&](const std::string& module) { return module_matches(glob, module); })) {
    return;
  }
  constexpr std::size_t kShown = 8;
  std::string listed;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) {
    listed += (i ? ", " : "") + names[i];
  }
  if (names.size() > kShown) listed += ", ... (" + std::to_string(names.size()) + " in all)";
  throw UsageError(
      "the module filter '" + glob + "' (--module) matches no module of the dump" +
      (names.empty() ? std::string(", which has no modules") : "; its modules are: " + listed) +
      ". Filters are shell-style globs matched against the whole name, e.g. "
      "'layers.*'");
}

// The unit roundoff a row computed in: its own dtypes', or the autocast its module ran under
// (the capture's cast_dtype, or the user's own torch.autocast), whichever is coarser.
double row_roundoff(const Row& row, const StepReport& report) {
  double roundoff = 0;
  if (row.eager) roundoff = std::max(roundoff, unit_roundoff(row.eager->dtype));
  if (row.compiled) roundoff = std::max(roundoff, unit_roundoff(row.compiled->dtype));
  roundoff = std::max(roundoff, unit_roundoff_of_name(report.cast_dtype));
  auto module = report.modules.find(row.module);
  if (module != report.modules.end()) {
    auto autocast = module->second.find(std::string(vocabulary::provenance::kAutocast));
    if (autocast != module->second.end()) {
      roundoff = std::max(roundoff, unit_roundoff_of_name(autocast->second));
    }
  }
  return roundoff;
}

// A row's verdict beyond the tolerances: the reference's, which (unless the tolerances alone
// decide) becomes its status; without one (and unless the tolerances alone decide), a float32 row
// that passes the tolerances but is beyond fp32 noise relative to its own magnitude FAILs
// (judging.h, relative_screen).
void judge_row(Row& row, const StepReport& report, const Judging& judging,
               double module_magnitude) {
  if (!row.metrics) return;
  if (row.reference_eager && row.reference_compiled) {
    const NoiseMeasure measure = measure_noise(*row.reference_eager, *row.reference_compiled,
                                               row_roundoff(row, report), report.tolerances.atol);
    row.reference_verdict = measure.divergence ? "divergence" : "noise";
    row.noise_units = measure.units;
    if (!report.reference_decides) return;
    row.tolerance_status = row.status;
    row.status = measure.divergence ? Status::kFail : Status::kPass;
    return;
  }
  if (row.status != Status::kPass || !row.kind || !row.eager || !row.compiled ||
      !row.note.empty()) {
    return;
  }
  if (judging.beyond_screen(row.module, *row.kind, row.eager->dtype, row.compiled->dtype,
                            *row.metrics, module_magnitude)) {
    const double relative = relative_error(*row.metrics);
    row.beyond_screen = relative;
    row.tolerance_status = Status::kPass;
    row.status = Status::kFail;
    row.reason +=
        (row.reason.empty() ? "" : "; ") + std::string("beyond fp32 noise: rmse ") +
        detail::printf_string("%.1e", relative) + " of its magnitude (screen " +
        detail::printf_string(
            "%.1e", judging.screen(row.module, *row.kind, row.eager->dtype, row.compiled->dtype)) +
        "); tolerances pass";
  }
}

}  // namespace

void require_committed_steps(const fs::path& path, const formats::DumpFiles& files) {
  if (!files.steps.empty()) return;
  if (files.unfinished.empty()) {
    throw FormatError(path.string() +
                      ": no step files (step_<N>.h5): expected a dump folder, a step file or a "
                      "run folder with rank<R>/ folders");
  }
  throw FormatError(path.string() + ": no committed step, only " +
                    std::to_string(files.unfinished.size()) + " unfinished one(s) (" +
                    files.unfinished.front().filename().string() +
                    (files.unfinished.size() > 1 ? ", ..." : "") +
                    "): the writer stopped before committing any step, so there is nothing to "
                    "read");
}

namespace {

void check_tolerance_options(const CompareOptions& options) {
  for (const auto& [name, value] :
       {std::pair{"atol", options.atol}, std::pair{"rtol", options.rtol}}) {
    if (value && !valid_tolerance(*value)) {
      throw UsageError(std::string(name) + " must be a finite number >= 0, but received " +
                       format_tolerance(*value));
    }
  }
}

// The comparison of dumps already opened; `same`: one dump holds both sides (`compiled` unused).
Comparison compare_open(const fs::path& eager_dump, const OpenDump& eager,
                        const fs::path& compiled_dump, const OpenDump& compiled, bool same,
                        const CompareOptions& options);

}  // namespace

Comparison compare(const fs::path& eager_dump, const fs::path& compiled_dump,
                   const CompareOptions& options) {
  check_tolerance_options(options);  // before reading: a usage error first
  std::error_code error;
  const bool same = fs::equivalent(eager_dump, compiled_dump, error);
  const formats::DumpFiles eager_files = formats::list_dump(eager_dump);
  const formats::DumpFiles compiled_files =
      same ? formats::DumpFiles{} : formats::list_dump(compiled_dump);
  return compare_listed(eager_dump, eager_files, compiled_dump, compiled_files, same, options);
}

Comparison compare_listed(const fs::path& eager_dump, const formats::DumpFiles& eager_files,
                          const fs::path& compiled_dump, const formats::DumpFiles& compiled_files,
                          bool same, const CompareOptions& options) {
  check_tolerance_options(options);
  const OpenDump eager = open_dump(eager_dump, eager_files, options.step);
  const OpenDump compiled =
      same ? OpenDump{} : open_dump(compiled_dump, compiled_files, options.step);
  return compare_open(eager_dump, eager, compiled_dump, compiled, same, options);
}

Comparison compare_pending(formats::PendingStep pending, const CompareOptions& options) {
  check_tolerance_options(options);
  const fs::path dump = pending.file.parent_path();
  fs::path partial = pending.file;
  partial += formats::schema::kPartialSuffix;
  OpenDump open;
  // What `dynaprobe compare` of this step will warn about: other unfinished steps of the dump
  // (none when the folder is gone: a capture judges its steps in memory all the same).
  std::error_code gone;
  if (fs::is_directory(dump, gone)) {
    for (fs::path& file : formats::list_dump(dump).unfinished) {
      if (file != partial) open.unfinished.push_back(std::move(file));
    }
  }
  const std::int64_t step = pending.step;
  open.steps.emplace(step, std::make_shared<StepReader>(std::move(pending)));
  CompareOptions for_step = options;
  for_step.step = step;
  return compare_open(dump, open, dump, OpenDump{}, true, for_step);
}

namespace {

// What the dumps themselves warn of: unfinished steps, records this reader does not know.
void add_dump_warnings(const OpenDump& eager, const OpenDump& compiled, bool same,
                       Comparison& result) {
  for (const auto& path : eager.unfinished) {
    result.warnings.push_back(path.string() +
                              ": unfinished step (the writer stopped while writing it); skipped");
  }
  if (!same) {
    for (const auto& path : compiled.unfinished) {
      result.warnings.push_back(path.string() +
                                ": unfinished step (the writer stopped while writing it); skipped");
    }
  }
  for (const OpenDump* dump : {&eager, &compiled}) {
    for (const auto& [step, reader] : dump->steps) {
      for (const auto& skipped : reader->skipped_records()) {
        result.warnings.push_back(reader->path().string() + ": " + skipped + "; skipped");
      }
    }
  }
}

// The provenance of two dumps captured separately that differs, key by key.
std::vector<ProvenanceDifference> provenance_differences(const formats::Provenance& eager,
                                                         const formats::Provenance& compiled) {
  std::vector<ProvenanceDifference> differences;
  std::set<std::string> keys;
  for (const auto& [key, value] : eager) keys.insert(key);
  for (const auto& [key, value] : compiled) keys.insert(key);
  for (const std::string& key : keys) {
    // Always differ between two captures: when, and the run folder each was written to.
    if (key == vocabulary::provenance::kCreated || key == vocabulary::provenance::kRun) continue;
    const std::string a = formats::provenance_value(eager, key);
    const std::string b = formats::provenance_value(compiled, key);
    // Two one-sided captures differ in their mode by design (check_sides checks the sides).
    if (key == vocabulary::provenance::kMode && a == vocabulary::mode::kEagerOnly &&
        b == vocabulary::mode::kCompiledOnly) {
      continue;
    }
    if (a != b) differences.push_back({key, a, b});
  }
  return differences;
}

// A --step that is in neither dump: a usage error naming the steps there are, from the committed
// step files' names (step_<N>.h5).
[[noreturn]] void throw_step_not_found(std::int64_t step, const fs::path& eager_dump,
                                       const fs::path& compiled_dump, bool same) {
  std::set<std::int64_t> present;
  for (const fs::path& dump : {eager_dump, compiled_dump}) {
    for (const fs::path& file : formats::list_dump(dump).steps) {
      if (const auto number = formats::step_of_file_name(file)) present.insert(*number);
    }
  }
  std::string listed;
  for (std::int64_t other : present) {
    if (listed.size() > 60) {
      listed += ", ...";
      break;
    }
    listed += (listed.empty() ? "" : ", ") + std::to_string(other);
  }
  throw UsageError("step " + std::to_string(step) + " is not in " + eager_dump.string() +
                   (same ? "" : " nor in " + compiled_dump.string()) +
                   (listed.empty() ? "" : "; the steps there are " + listed) +
                   "; give one of them with --step, or leave --step out to compare every step");
}

// The user's tolerance rules, after the dump's own (they win), each checked.
void add_tolerance_rules(const std::vector<ToleranceRule>& rules, Judging& judging) {
  for (const ToleranceRule& rule : rules) {
    if (!valid_tolerance(rule.tolerances.atol) || !valid_tolerance(rule.tolerances.rtol)) {
      throw UsageError("the tolerances of rule '" + rule.pattern +
                       "' must be finite numbers >= 0, but received atol=" +
                       format_tolerance(rule.tolerances.atol) +
                       " rtol=" + format_tolerance(rule.tolerances.rtol));
    }
    judging.rules.push_back(rule);
  }
}

// Each step's report and metric tasks (StepBuilder), then the tasks computed (run_tasks), then
// the verdicts that need the metrics: each row's reference verdict and each step's root cause.
void judge_steps(const OpenDump& eager, const OpenDump& compiled_side,
                 const fs::path& compiled_dump, const std::set<std::int64_t>& steps,
                 StepBuilder& builder, const CompareOptions& options, Comparison& result) {
  std::vector<Task> tasks;
  result.steps.reserve(steps.size());  // the tasks point into it
  for (std::int64_t step : steps) {
    auto e = eager.steps.find(step);
    auto c = compiled_side.steps.find(step);
    const StepReader* eager_reader = e == eager.steps.end() ? nullptr : e->second.get();
    const StepReader* compiled_reader = c == compiled_side.steps.end() ? nullptr : c->second.get();
    if (!eager_reader || !compiled_reader) {
      result.warnings.push_back("step " + std::to_string(step) + " is only in the " +
                                (eager_reader ? "eager" : "compiled") + " dump");
    }
    const std::size_t first_task = tasks.size();
    result.steps.push_back(builder.build(step, eager_reader, compiled_reader, tasks));
    result.steps.back().dump = compiled_dump.string();
    for (std::size_t i = first_task; i < tasks.size(); ++i) tasks[i].report = &result.steps.back();
  }
  run_tasks(tasks, options);
  for (StepReport& report : result.steps) {
    Judging judging;  // the step's, for the fp32 screen
    judging.tolerances = report.tolerances;
    judging.rules = report.tolerance_rules;
    judging.dtype_aware = report.dtype_aware;
    judging.reference_decides = report.reference_decides;
    // The magnitude of each module's rows per pass (judging.h, kRoundingLevel).
    std::map<std::pair<std::string, bool>, double> magnitude;
    for (const Row& row : report.rows) {
      if (!row.kind || !row.metrics || !std::isfinite(row.metrics->rms_eager)) continue;
      double& largest = magnitude[{row.module, formats::is_forward(*row.kind)}];
      largest = std::max(largest, row.metrics->rms_eager);
    }
    for (Row& row : report.rows) {
      const auto found =
          row.kind ? magnitude.find({row.module, formats::is_forward(*row.kind)}) : magnitude.end();
      judge_row(row, report, judging, found == magnitude.end() ? 0.0 : found->second);
    }
    find_root_cause(report);
  }
}

Comparison compare_open(const fs::path& eager_dump, const OpenDump& eager,
                        const fs::path& compiled_dump, const OpenDump& compiled, bool same,
                        const CompareOptions& options) {
  const OpenDump& compiled_side = same ? eager : compiled;
  Comparison result;
  add_dump_warnings(eager, compiled, same, result);
  if (!eager.steps.empty()) result.eager_provenance = eager.steps.begin()->second->provenance();
  if (!compiled_side.steps.empty()) {
    result.compiled_provenance = compiled_side.steps.begin()->second->provenance();
  }
  result.separate_dumps = !same;
  if (!same) {
    result.provenance_differences =
        provenance_differences(result.eager_provenance, result.compiled_provenance);
    result.compiled_baseline =
        check_sides(eager_dump, eager, compiled_dump, compiled, result.eager_provenance,
                    result.compiled_provenance) == Side::kCompiled;
  }
  const fs::path& tolerance_source = same ? eager_dump : compiled_dump;
  Judging judging = dump_judging(result.compiled_provenance, tolerance_source, options.atol,
                                 options.rtol, options.dtype_aware, options.reference_decides);

  std::set<std::int64_t> steps;
  for (const auto& [step, reader] : eager.steps) steps.insert(step);
  for (const auto& [step, reader] : compiled_side.steps) steps.insert(step);
  if (options.step && steps.empty()) {
    throw_step_not_found(*options.step, eager_dump, compiled_dump, same);
  }
  if (!options.module_glob.empty() && options.require_module_match) {
    check_module_glob(options.module_glob, eager, compiled_side);
  }
  add_tolerance_rules(options.tolerance_rules, judging);
  StepBuilder builder(options, std::move(judging),
                      result.compiled_baseline ? Side::kCompiled : Side::kEager);
  judge_steps(eager, compiled_side, same ? eager_dump : compiled_dump, steps, builder, options,
              result);
  detail::attach_ops_dumps(
      result.steps,
      same ? std::vector<fs::path>{eager_dump} : std::vector<fs::path>{eager_dump, compiled_dump},
      options,
      [](const fs::path& dump, const CompareOptions& own) { return compare(dump, dump, own); });
  return result;
}

}  // namespace

void check_module_glob(const fs::path& eager_dump, const fs::path& compiled_dump,
                       const std::string& glob) {
  std::error_code error;
  const bool same = fs::equivalent(eager_dump, compiled_dump, error);
  const OpenDump eager = open_dump(eager_dump, formats::list_dump(eager_dump), std::nullopt);
  check_module_glob(
      glob, eager,
      same ? eager : open_dump(compiled_dump, formats::list_dump(compiled_dump), std::nullopt));
}

}  // namespace dynaprobe::analyze
