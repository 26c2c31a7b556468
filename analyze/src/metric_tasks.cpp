#include "metric_tasks.h"

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/analyze/number_text.h"
#include "dynaprobe/formats/error.h"
#include "tensor_pair.h"

namespace dynaprobe::analyze {
using formats::StepReader;

namespace {

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

// The metrics the capture stored for a task's pair, if they hold for the task's tolerances: a
// row's under its compiled record's key; a side against the reference (which the tolerances do
// not change) under the eager record's key (reference vs eager) or the reference record's
// (reference vs compiled). See capture's PairJudge.
const formats::StoredMetrics* usable_stored_metrics(const Task& task) {
  switch (task.target) {
    case Target::kRow: {
      const formats::StoredMetrics* stored = task.compiled_reader->find_metrics(task.compiled->key);
      return stored && stored_metrics_hold(*stored, task.tolerances) ? stored : nullptr;
    }
    case Target::kReferenceEager:
      return task.compiled_reader->find_metrics(task.compiled->key);
    case Target::kReferenceCompiled:
      return task.eager_reader->find_metrics(task.eager->key);
  }
  return nullptr;
}

// A pair judged at capture that cannot be judged again with these tolerances: its tensors were
// not stored. An error rather than a guess.
[[noreturn]] void throw_needs_tensors(const Task& task, std::size_t count) {
  const Row& row = task.report->rows[task.row];
  const formats::StoredMetrics* stored = task.compiled_reader->find_metrics(task.compiled->key);
  std::string judged = "no stored metrics";
  if (stored) {
    judged = "judged at capture with atol=" + format_tolerance(stored->tolerances.atol) +
             " rtol=" + format_tolerance(stored->tolerances.rtol);
  }
  throw UsageError(
      task.compiled_reader->path().string() + ": " + std::to_string(count) +
      " compared pair(s) cannot be judged with these tolerances, because the capture did not "
      "store their tensors (PrecisionChecker(dump=\"failing\" or \"stats\")); e.g. " +
      formats::printable_name(row.module) + " " + std::string(formats::kind_name(*row.kind)) + "[" +
      std::to_string(row.tensor_index) + "], " + judged + ", asked for atol=" +
      format_tolerance(task.tolerances.atol) + " rtol=" + format_tolerance(task.tolerances.rtol) +
      ". Compare with the capture's tolerances (leave --atol, --rtol and --tolerance out), or "
      "capture with dump=\"full\" to judge again with others");
}

// A row's pair gets every metric; a side against the reference what judging reads (kVerdict).
MetricSet metric_set(const Task& task) {
  return task.target == Target::kRow ? MetricSet::kAll : MetricSet::kVerdict;
}

// Sets a task's metrics on its row; those of a kRow task decide the row's status.
void set_result(Task& task, const TensorMetrics& metrics) {
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
}

// Pairs the capture judged in memory take its metrics (the same bits the tensors give: see
// compare_in_memory); returns the rest, to be computed from the stored tensors.
std::vector<Task*> set_stored_results(std::vector<Task>& all_tasks, const CompareOptions& options) {
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
  return tasks;
}

// A step still being committed is read once committed: wait here, before the reads take the
// HDF5 lock, which the committing writer needs. A step whose file was not written (a capture
// with strict_io off) was judged in memory; the pairs it kept for the file only (reference
// pairs, pairs held beyond the budget) cannot be compared, and the step says why. Removes those
// from `tasks`.
void drop_unreadable(std::vector<Task*>& tasks) {
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
}

// The tasks' metrics from their stored tensors.
void compare_stored(const std::vector<Task*>& tasks, const CompareOptions& options) {
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
                             task.compiled_reader->open(*task.compiled), task.tolerances,
                             metric_set(task)};
        },
        [&](std::size_t i, const TensorMetrics& metrics) { set_result(*small[i], metrics); }, done);
    tbb::parallel_for(std::size_t{0}, large.size(), [&](std::size_t i) {
      Task& task = *large[i];
      const formats::TensorStream eager = task.eager_reader->open(*task.eager);
      const formats::TensorStream compiled = task.compiled_reader->open(*task.compiled);
      set_result(task, compare_tensors(eager, compiled, task.tolerances, metric_set(task), done));
    });
  });
}

}  // namespace

void run_tasks(std::vector<Task>& all_tasks, const CompareOptions& options) {
  std::vector<Task*> tasks = set_stored_results(all_tasks, options);
  drop_unreadable(tasks);
  compare_stored(tasks, options);
}

}  // namespace dynaprobe::analyze
