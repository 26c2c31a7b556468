#include "dynaprobe/analyze/engine.h"

#include <fnmatch.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/analyze/root_cause.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"
#include "ops_dumps.h"
#include "step_rows.h"
#include "tensor_pair.h"

namespace dynaprobe::analyze {
namespace fs = std::filesystem;
using formats::Kind;
using formats::RecordInfo;
using formats::Side;
using formats::StepReader;
namespace vocabulary = formats::vocabulary;

namespace {

std::string format_double(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

// The committed steps of one dump, opened (which reads each file's index, no tensor data).
struct OpenDump {
  std::map<std::int64_t, std::shared_ptr<StepReader>> steps;
  std::vector<fs::path> unfinished;
};

OpenDump open_dump(const fs::path& path, std::optional<std::int64_t> only_step) {
  const formats::DumpFiles files = formats::list_dump(path);
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

// The loss of one side, as a double.
std::optional<double> read_loss(const StepReader* reader, Side side) {
  if (!reader) return std::nullopt;
  const RecordInfo* info = reader->find(formats::RecordKey{
      reader->step(), std::string(formats::kLossModule), 0, Kind::kLoss, 0, side});
  if (!info || info->numel() != 1) return std::nullopt;
  const auto bytes = reader->read(*info);
  if (info->dtype == formats::DType::kFloat64) {
    double value;
    std::memcpy(&value, bytes.data(), sizeof(value));
    return value;
  }
  float value;
  formats::convert_to_float32(info->dtype, bytes.data(), 1, &value);
  return value;
}

// Which metrics of a row a task computes: the row's own (eager vs compiled, which decide its
// status), or a side against the fp64 reference.
enum class Target { kRow, kReferenceEager, kReferenceCompiled };

// A comparison still to be computed: a (first) vs b (second), as the metrics define them.
struct Task {
  StepReport* report;
  std::size_t row;
  const StepReader* eager_reader;
  const RecordInfo* eager;
  const StepReader* compiled_reader;
  const RecordInfo* compiled;
  Target target = Target::kRow;
  Tolerances tolerances;
};

// A gradient only one side holds: when it is all zeros, it equals the other side's absence of one
// (all_zeros in step_rows.h), and the row passes, saying so. A file not readable (not written,
// still being written elsewhere) leaves the row as it is.
void judge_zero_gradient(const StepReader* reader, const RecordInfo& held, Row& row) {
  try {
    reader->wait_readable();
    if (!all_zeros(*reader, held)) return;
  } catch (const Error&) {
    return;
  }
  const bool eager_held = row.eager.has_value();
  (eager_held ? row.compiled : row.eager) = eager_held ? row.eager : row.compiled;
  row.metrics = TensorMetrics{};
  row.metrics->elements = held.numel();
  row.status = Status::kPass;
  row.note.clear();
  row.reason = std::string(eager_held ? "compiled" : "eager") + ": no gradient; " +
               (eager_held ? "eager" : "compiled") + ": zeros (the same gradient)";
}

bool matches(const std::string& glob, const std::string& module) {
  return fnmatch(glob.c_str(), module.c_str(), 0) == 0;
}

// Builds one step's report: its header, then, for the wanted modules in model order, a row per
// module note and per tensor key, and the metric tasks of the rows both sides hold (run_tasks
// computes them later and sets those rows' statuses). The phases are in step_rows.h.
class StepBuilder {
 public:
  StepBuilder(const CompareOptions& options, Judging judging, Side eager_side)
      : options_(options), judging_(std::move(judging)), eager_side_(eager_side) {}

  StepReport build(std::int64_t step, const StepReader* eager, const StepReader* compiled,
                   std::vector<Task>& tasks_out);

 private:
  // What the rows of one step are built from.
  struct StepRecords {
    const StepReader* eager;
    const StepReader* compiled;
    const ModuleAttributes& modules;
    const Pairs& pairs;
    const CallsRun& calls;
    const ModuleRoles& roles;
  };

  bool wanted(const std::string& module) const {
    return options_.module_glob.empty() || matches(options_.module_glob, module);
  }
  StepReport report_header(std::int64_t step, const StepReader* eager,
                           const StepReader* compiled) const;
  void add_module_rows(const std::string& module, const StepRecords& records, StepReport& report,
                       std::vector<Task>& tasks) const;
  void add_tensor_row(const TensorKey& key, Pair pair, const StepRecords& records,
                      StepReport& report, std::vector<Task>& tasks) const;
  void add_tasks(const Pair& pair, const StepRecords& records, const StepReport& report, Row& row,
                 std::vector<Task>& tasks) const;

  const CompareOptions& options_;
  Judging judging_;
  Side eager_side_;  // of the eager dump: kCompiled for a baseline (Comparison::compiled_baseline)
};

StepReport StepBuilder::build(std::int64_t step, const StepReader* eager,
                              const StepReader* compiled, std::vector<Task>& tasks) {
  StepReport report = report_header(step, eager, compiled);
  ModuleOrder order;
  const ModuleAttributes modules = merge_module_attributes(eager, compiled, order);
  for (const auto& [module, attributes] : modules) {
    if (wanted(module)) report.modules.emplace(module, attributes);
    // The user's own autocast, seen by a module's call when the step began outside it.
    auto autocast = attributes.find(std::string(vocabulary::provenance::kAutocast));
    if (report.autocast.empty() && autocast != attributes.end()) {
      report.autocast = autocast->second;
    }
  }
  const Pairs pairs = pair_records(eager, compiled, order, eager_side_);
  const CallsRun calls = calls_run(pairs);
  const ModuleRoles roles(modules);
  const StepRecords records{eager, compiled, modules, pairs, calls, roles};
  for (const std::string& module : order.modules()) {
    if (wanted(module)) add_module_rows(module, records, report, tasks);
  }
  return report;
}

StepReport StepBuilder::report_header(std::int64_t step, const StepReader* eager,
                                      const StepReader* compiled) const {
  StepReport report;
  report.step = step;
  report.tolerances = judging_.tolerances;
  report.tolerance_rules = judging_.rules;
  report.dtype_aware = judging_.dtype_aware;
  report.reference_decides = judging_.reference_decides;
  apply_provenance((eager ? eager : compiled)->provenance(), report);
  report.loss_eager = read_loss(eager, eager_side_);
  report.loss_compiled = read_loss(compiled, Side::kCompiled);
  return report;
}

void StepBuilder::add_module_rows(const std::string& module, const StepRecords& records,
                                  StepReport& report, std::vector<Task>& tasks) const {
  if (records.roles.ignored_or_under(module)) {
    // Only the ignored modules themselves get a row; their submodules are covered by it.
    if (records.roles.ignored(module)) report.rows.push_back(ignored_row(module));
    return;
  }
  const auto attributes = records.modules.find(module);
  if (attributes != records.modules.end()) {
    auto row = module_note_row(module, attributes->second, report.single_pass,
                               records.calls.eager_calls(module));
    if (row) report.rows.push_back(std::move(*row));
    if (auto missing = no_reference_row(module, attributes->second)) {
      report.no_reference_calls += missing->calls;
      report.rows.push_back(std::move(missing->row));
    }
  }
  for (auto it = records.pairs.lower_bound({module, 0, Kind::kFwdInput, 0});
       it != records.pairs.end() && it->first.module == module; ++it) {
    add_tensor_row(it->first, it->second, records, report, tasks);
  }
}

void StepBuilder::add_tensor_row(const TensorKey& key, Pair pair, const StepRecords& records,
                                 StepReport& report, std::vector<Task>& tasks) const {
  pair = compared_pair(key, pair, report.single_pass);
  Row row = tensor_row(key, pair, records.eager, records.compiled);
  if (pair.eager && pair.compiled) {
    if (row.shape_mismatch()) {
      row.status = Status::kFail;
      row.reason = "shape mismatch: eager " + formats::shape_string(pair.eager->shape) +
                   ", compiled " + formats::shape_string(pair.compiled->shape);
      if (formats::is_complex(pair.eager->dtype) != formats::is_complex(pair.compiled->dtype)) {
        row.reason = "dtype mismatch: eager " +
                     std::string(formats::dtype_name(pair.eager->dtype)) + ", compiled " +
                     std::string(formats::dtype_name(pair.compiled->dtype)) +
                     " (complex values compare with complex ones only)";
      }
    } else {
      add_tasks(pair, records, report, row, tasks);
    }
  } else {
    const bool compiled_ran = records.calls.compiled_ran(key.module, key.call, report.single_pass);
    const Verdict verdict = one_sided_verdict(
        {pair.eager ? Side::kEager : Side::kCompiled, key.kind, records.roles.wrapped(key.module),
         records.roles.inside_wrapped(key.module), compiled_ran});
    row.status = verdict.status;
    row.note = verdict.note;
    row.reason = verdict.reason;
    if (!is_forward(key.kind) && row.status == Status::kWarn && compiled_ran) {
      judge_zero_gradient(pair.eager ? records.eager : records.compiled,
                          pair.eager ? *pair.eager : *pair.compiled, row);
    }
  }
  report.rows.push_back(std::move(row));
}

// The row's own comparison and, with an fp64 reference of its shape, each side's against it;
// `row` is the next row of `report`.
void StepBuilder::add_tasks(const Pair& pair, const StepRecords& records, const StepReport& report,
                            Row& row, std::vector<Task>& tasks) const {
  const Tolerances tolerances =
      judging_.row_tolerances(row.module, *row.kind, row.eager->dtype, row.compiled->dtype);
  if (tolerances.atol != report.tolerances.atol || tolerances.rtol != report.tolerances.rtol) {
    row.tolerances = tolerances;
  }
  const std::size_t index = report.rows.size();
  const StepReader* eager = records.eager;
  const StepReader* compiled = records.compiled;
  tasks.push_back(
      Task{nullptr, index, eager, pair.eager, compiled, pair.compiled, Target::kRow, tolerances});
  if (pair.reference && pair.reference->shape == pair.eager->shape) {
    // The fp64 reference lives with the compiled side (single-pass writes both in one file).
    const StepReader* reference = compiled ? compiled : eager;
    tasks.push_back(Task{nullptr, index, reference, pair.reference, eager, pair.eager,
                         Target::kReferenceEager, tolerances});
    tasks.push_back(Task{nullptr, index, reference, pair.reference, compiled, pair.compiled,
                         Target::kReferenceCompiled, tolerances});
  }
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
                  [&](const std::string& module) { return matches(glob, module); })) {
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

// Prints nothing itself: calls options.progress from a helper thread every 100 ms while the
// comparison runs.
class ProgressTicker {
 public:
  ProgressTicker(const CompareOptions& options, std::atomic<std::uint64_t>& done,
                 std::uint64_t total)
      : options_(options), done_(done), total_(total) {
    if (options_.progress) thread_ = std::thread([this] { run(); });
  }
  ~ProgressTicker() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
    options_.progress(done_.load(), total_);
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      options_.progress(done_.load(), total_);
    }
  }
  const CompareOptions& options_;
  std::atomic<std::uint64_t>& done_;
  std::uint64_t total_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

// The metrics the capture stored for a task's pair, if they hold for the task's tolerances.
const formats::StoredMetrics* usable_stored_metrics(const Task& task) {
  if (task.target != Target::kRow) return nullptr;
  const formats::StoredMetrics* stored = task.compiled_reader->find_metrics(task.compiled->key);
  return stored && stored_metrics_hold(*stored, task.tolerances) ? stored : nullptr;
}

// A pair judged at capture that cannot be judged again with these tolerances: its tensors were
// not stored. An error rather than a guess.
[[noreturn]] void throw_needs_tensors(const Task& task, std::size_t count) {
  const Row& row = task.report->rows[task.row];
  const formats::StoredMetrics* stored = task.compiled_reader->find_metrics(task.compiled->key);
  std::string judged = "no stored metrics";
  if (stored) {
    judged = "judged at capture with atol=" + format_double(stored->tolerances.atol) +
             " rtol=" + format_double(stored->tolerances.rtol);
  }
  throw UsageError(
      task.compiled_reader->path().string() + ": " + std::to_string(count) +
      " compared pair(s) cannot be judged with these tolerances, because the capture did not "
      "store their tensors (PrecisionChecker(dump=\"failing\" or \"stats\")); e.g. " +
      formats::printable_name(row.module) + " " + std::string(formats::kind_name(*row.kind)) + "[" +
      std::to_string(row.tensor_index) + "], " + judged + ", asked for atol=" +
      format_double(task.tolerances.atol) + " rtol=" + format_double(task.tolerances.rtol) +
      ". Compare with the capture's tolerances (leave --atol, --rtol and --tolerance out), or "
      "capture with dump=\"full\" to judge again with others");
}

void run_tasks(std::vector<Task>& all_tasks, const CompareOptions& options) {
  const auto set_result = [](Task& task, const TensorMetrics& metrics) {
    Row& row = task.report->rows[task.row];
    if (task.target != Target::kRow) {
      (task.target == Target::kReferenceEager ? row.reference_eager : row.reference_compiled) =
          metrics;
      return;
    }
    row.metrics = metrics;
    row.status = metrics.allclose ? Status::kPass : Status::kFail;
    if (!metrics.allclose && metrics.nonfinite_only_compiled > 0) {
      row.reason = std::to_string(metrics.nonfinite_only_compiled) + " NaN/Inf only in compiled";
    }
  };
  // Pairs the capture judged in memory take its metrics (the same bits the tensors give: see
  // compare_in_memory); the rest are computed from the stored tensors.
  std::vector<Task*> tasks;
  std::vector<const Task*> need_tensors;
  for (Task& task : all_tasks) {
    const bool tensors_stored = task.eager->stored && task.compiled->stored;
    const formats::StoredMetrics* stored = usable_stored_metrics(task);
    if (stored && !(options.recompute && tensors_stored)) {
      set_result(task, stored->metrics);
    } else if (tensors_stored) {
      tasks.push_back(&task);
    } else if (task.target == Target::kRow) {
      need_tensors.push_back(&task);
    }  // a reference pair without tensors: no reference metrics for that row
  }
  if (!need_tensors.empty()) throw_needs_tensors(*need_tensors.front(), need_tensors.size());
  // A step still being committed is read once committed: wait here, before the reads take the
  // HDF5 lock, which the committing writer needs. A step whose file was not written (a capture
  // with strict_io off) was judged in memory; the pairs it kept for the file only (reference
  // pairs, pairs held beyond the budget) cannot be compared, and the step says why.
  std::map<const StepReader*, std::string> unreadable;
  const auto readable = [&](const StepReader* reader) {
    if (unreadable.count(reader)) return false;
    try {
      reader->wait_readable();
      return true;
    } catch (const Error& error) {
      unreadable.emplace(reader, error.what());
      return false;
    }
  };
  std::erase_if(tasks, [&](Task* task) {
    const StepReader* lost = !readable(task->eager_reader)      ? task->eager_reader
                             : !readable(task->compiled_reader) ? task->compiled_reader
                                                                : nullptr;
    if (!lost) return false;
    task->report->not_stored = unreadable.at(lost);
    if (task->target == Target::kRow) {
      Row& row = task->report->rows[task->row];
      row.status = Status::kWarn;
      row.reason = "not compared: its tensors were kept for the step's file, which was not written";
    }
    return true;
  });
  std::uint64_t total = 0;
  for (const Task* task : tasks) total += task->eager->nbytes() + task->compiled->nbytes();
  std::atomic<std::uint64_t> done{0};
  ProgressTicker ticker(options, done, total);
  // Most records of a model are small, and opening their datasets costs more than comparing
  // them: those go through one pipeline (see compare_small_pairs). Large ones stream chunk pairs.
  std::vector<Task*> small, large;
  for (Task* task : tasks) {
    const bool is_small = task->eager->nbytes() + task->compiled->nbytes() <= kSmallPairBytes;
    (is_small ? small : large).push_back(task);
  }
  tbb::task_arena arena(options.threads > 0 ? options.threads : tbb::task_arena::automatic);
  arena.execute([&] {
    compare_small_pairs(
        small.size(),
        [&](std::size_t i) {
          const Task& task = *small[i];
          return PairStreams{task.eager_reader->open(*task.eager),
                             task.compiled_reader->open(*task.compiled), task.tolerances};
        },
        [&](std::size_t i, const TensorMetrics& metrics) { set_result(*small[i], metrics); }, done);
    tbb::parallel_for(std::size_t{0}, large.size(), [&](std::size_t i) {
      Task& task = *large[i];
      const formats::TensorStream eager = task.eager_reader->open(*task.eager);
      const formats::TensorStream compiled = task.compiled_reader->open(*task.compiled);
      set_result(task, compare_tensors(eager, compiled, task.tolerances, done));
    });
  });
}

// A row's reference verdict, and with it (unless the tolerances alone decide) its status.
void apply_reference(Row& row, const StepReport& report) {
  row.reference_verdict = reference_verdict(row, report.tolerances);
  if (row.reference_verdict.empty() || !report.reference_decides || !row.metrics) return;
  row.tolerance_status = row.status;
  row.status = row.reference_verdict == "noise" ? Status::kPass : Status::kFail;
}

}  // namespace

std::string reference_verdict(const Row& row, const Tolerances& step_tolerances) {
  if (!row.reference_eager || !row.reference_compiled) return "";
  const double eager = row.reference_eager->rmse, compiled = row.reference_compiled->rmse;
  if (!std::isfinite(compiled)) return "divergence";
  if (!std::isfinite(eager)) return "noise";
  return compiled <= kReferenceFactor * eager + step_tolerances.atol / 10 ? "noise" : "divergence";
}

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
  }
  counts.loss_failed = loss_status() == Status::kFail;
  counts.no_reference_calls = no_reference_calls;
  return counts;
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

namespace {

void check_tolerance_options(const CompareOptions& options) {
  for (const auto& [name, value] :
       {std::pair{"atol", options.atol}, std::pair{"rtol", options.rtol}}) {
    if (value && !valid_tolerance(*value)) {
      throw UsageError(std::string(name) + " must be a finite number >= 0, but received " +
                       format_double(*value));
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
  check_tolerance_options(options);
  std::error_code error;
  const bool same = fs::equivalent(eager_dump, compiled_dump, error);
  const OpenDump eager = open_dump(eager_dump, options.step);
  const OpenDump compiled = same ? OpenDump{} : open_dump(compiled_dump, options.step);
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

Comparison compare_open(const fs::path& eager_dump, const OpenDump& eager,
                        const fs::path& compiled_dump, const OpenDump& compiled, bool same,
                        const CompareOptions& options) {
  const OpenDump& compiled_side = same ? eager : compiled;
  Comparison result;
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
  if (!eager.steps.empty()) result.eager_provenance = eager.steps.begin()->second->provenance();
  if (!compiled_side.steps.empty()) {
    result.compiled_provenance = compiled_side.steps.begin()->second->provenance();
  }
  result.separate_dumps = !same;
  if (!same) {
    std::set<std::string> keys;
    for (const auto& [key, value] : result.eager_provenance) keys.insert(key);
    for (const auto& [key, value] : result.compiled_provenance) keys.insert(key);
    for (const std::string& key : keys) {
      if (key == vocabulary::provenance::kCreated) continue;  // always differs
      const std::string a = formats::provenance_value(result.eager_provenance, key);
      const std::string b = formats::provenance_value(result.compiled_provenance, key);
      // Two one-sided captures differ in their mode by design (the sides are checked below).
      if (key == vocabulary::provenance::kMode && a == vocabulary::mode::kEagerOnly &&
          b == vocabulary::mode::kCompiledOnly) {
        continue;
      }
      if (a != b) result.provenance_differences.push_back({key, a, b});
    }
  }
  if (!same) {
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
    // Name the steps there are, from the committed step files' names (step_<N>.h5).
    std::set<std::int64_t> present;
    for (const fs::path& dump : {eager_dump, compiled_dump}) {
      for (const fs::path& file : formats::list_dump(dump).steps) {
        if (const auto number = formats::step_of_file_name(file)) present.insert(*number);
      }
    }
    std::string listed;
    for (std::int64_t step : present) {
      if (listed.size() > 60) {
        listed += ", ...";
        break;
      }
      listed += (listed.empty() ? "" : ", ") + std::to_string(step);
    }
    throw UsageError("step " + std::to_string(*options.step) + " is not in " + eager_dump.string() +
                     (same ? "" : " nor in " + compiled_dump.string()) +
                     (listed.empty() ? "" : "; the steps there are " + listed) +
                     "; give one of them with --step, or leave --step out to compare every step");
  }
  if (!options.module_glob.empty() && options.require_module_match) {
    check_module_glob(options.module_glob, eager, compiled_side);
  }
  for (const ToleranceRule& rule : options.tolerance_rules) {
    if (!valid_tolerance(rule.tolerances.atol) || !valid_tolerance(rule.tolerances.rtol)) {
      throw UsageError("the tolerances of rule '" + rule.pattern +
                       "' must be finite numbers >= 0, but received atol=" +
                       format_double(rule.tolerances.atol) +
                       " rtol=" + format_double(rule.tolerances.rtol));
    }
    judging.rules.push_back(rule);
  }
  std::vector<Task> tasks;
  StepBuilder builder(options, std::move(judging),
                      result.compiled_baseline ? Side::kCompiled : Side::kEager);
  result.steps.reserve(steps.size());
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
    for (std::size_t i = first_task; i < tasks.size(); ++i) tasks[i].report = &result.steps.back();
  }
  run_tasks(tasks, options);
  for (StepReport& report : result.steps) {
    for (Row& row : report.rows) apply_reference(row, report);
    find_root_cause(report);
  }
  detail::attach_ops_dumps(
      result.steps,
      same ? std::vector<fs::path>{eager_dump} : std::vector<fs::path>{eager_dump, compiled_dump},
      options);
  return result;
}

}  // namespace

void check_module_glob(const fs::path& eager_dump, const fs::path& compiled_dump,
                       const std::string& glob) {
  std::error_code error;
  const bool same = fs::equivalent(eager_dump, compiled_dump, error);
  const OpenDump eager = open_dump(eager_dump, std::nullopt);
  check_module_glob(glob, eager, same ? eager : open_dump(compiled_dump, std::nullopt));
}

std::vector<RankDump> find_rank_dumps(const fs::path& path) {
  std::error_code error;
  if (!fs::exists(path, error)) {
    throw IoError(path.string() +
                  ": no such file or folder (expected a run folder, a dump folder or a step file)");
  }
  std::vector<RankDump> ranks;
  if (fs::is_directory(path, error)) {
    const std::string prefix(formats::schema::kRankDirPrefix);
    for (const auto& entry : fs::directory_iterator(path, error)) {
      const std::string name = entry.path().filename().string();
      int rank = 0;
      if (entry.is_directory() && name.starts_with(prefix) &&
          std::from_chars(name.data() + prefix.size(), name.data() + name.size(), rank).ec ==
              std::errc()) {
        ranks.push_back({rank, entry.path()});
      }
    }
  }
  if (ranks.empty()) {
    // A dump itself: its rank comes from the provenance of its files.
    int rank = 0;
    const auto files = formats::list_dump(path);
    if (!files.steps.empty()) {
      StepReader reader(files.steps.front());
      auto value = reader.provenance().find(std::string(vocabulary::provenance::kRank));
      if (value != reader.provenance().end()) rank = std::atoi(value->second.c_str());
    }
    ranks.push_back({rank, path});
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const RankDump& a, const RankDump& b) { return a.rank < b.rank; });
  return ranks;
}

namespace {

// Whether `folder` holds a run or a dump: rank<R>/ folders or step files.
bool holds_dump(const fs::path& folder) {
  std::error_code error;
  const std::string prefix(formats::schema::kRankDirPrefix);
  for (const auto& entry : fs::directory_iterator(folder, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory(error) && name.starts_with(prefix)) return true;
  }
  const auto files = formats::list_dump(folder);
  return !files.steps.empty() || !files.unfinished.empty();
}

}  // namespace

fs::file_time_type last_written(const fs::path& run) {
  std::error_code error;
  fs::file_time_type newest = fs::last_write_time(run, error);
  for (const auto& entry : fs::recursive_directory_iterator(run, error)) {
    const auto time = entry.last_write_time(error);
    if (!error && time > newest) newest = time;
  }
  return newest;
}

NewestRun newest_run(const fs::path& path) {
  std::error_code error;
  if (!fs::is_directory(path, error) || holds_dump(path)) return {path, {}};
  std::vector<std::pair<fs::file_time_type, fs::path>> runs;
  for (const auto& entry : fs::directory_iterator(path, error)) {
    if (entry.is_directory(error) && holds_dump(entry.path())) {
      runs.emplace_back(last_written(entry.path()), entry.path());
    }
  }
  if (runs.empty()) return {path, {}};
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second > b.second;
  });
  NewestRun result{runs.front().second, {}};
  for (const auto& [time, run] : runs) result.runs.push_back(run);
  return result;
}

}  // namespace dynaprobe::analyze
