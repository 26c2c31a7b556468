#include "background_thread.h"

#include <pthread.h>
#include <sys/resource.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/niceness.h"
#include "dynaprobe/formats/writer.h"
#include "pair_judge.h"

namespace dynaprobe::capture::detail {
namespace fs = std::filesystem;

void SharedState::push(Item item) {
  {
    std::lock_guard lock(mutex);
    queue.push_back(std::move(item));
    ++pushed;
  }
  work_cv.notify_one();
}

namespace {

// `error` with a note that the step is lost, keeping its type so callers can tell disk trouble
// (IoError) from a bad record (UsageError).
std::exception_ptr step_lost(std::exception_ptr error, std::int64_t step, const fs::path& dir) {
  const std::string note = "\n(dynaprobe discarded step " + std::to_string(step) + " of dump " +
                           dir.string() + "; earlier steps are intact)";
  try {
    std::rethrow_exception(error);
  } catch (const FormatError& e) {
    return std::make_exception_ptr(FormatError(e.what() + note));
  } catch (const IoError& e) {
    return std::make_exception_ptr(IoError(e.what() + note));
  } catch (const UsageError& e) {
    return std::make_exception_ptr(UsageError(e.what() + note));
  } catch (const Error& e) {
    return std::make_exception_ptr(Error(e.what() + note));
  } catch (...) {
    return error;  // bad_alloc and the like: as they are
  }
}

// Whether a step's file is committed yet (Recorder::finish_step): shared by the background
// thread, which commits it, and by the step's PendingStep, which may outlive the recorder.
struct CommitState {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;  // why the step could not be committed

  void finish(std::exception_ptr why) {
    {
      std::lock_guard lock(mutex);
      if (done) return;
      done = true;
      error = std::move(why);
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return done; });
    if (error) std::rethrow_exception(error);
  }
};

// The writer's side of the background thread: what is left to write, in queue order. The judging
// side runs ahead of it, so that a step is judged (and reported) while its tensors are still
// being written.
struct BeginWrite {
  std::int64_t step = 0;
};
struct RecordsWrite {
  std::vector<RecordItem> store, describe;  // see PairJudge::take
  std::size_t bytes = 0;                    // of the queue's snapshots this write releases
};
struct CommitWrite {
  std::vector<formats::StoredMetrics> metrics;
  std::shared_ptr<CommitState> state;
};
using WriteOp =
    std::variant<BeginWrite, RecordsWrite, formats::Graph, formats::ModuleInfo, CommitWrite>;

// Records of a step as its index will list them, and the bytes of the smallest (the loss), for
// the step's PendingStep.
void add_pending(formats::PendingStep& pending, const std::vector<RecordItem>& items, bool stored) {
  constexpr std::size_t kKeptBytes = 64;
  for (const RecordItem& item : items) {
    formats::RecordInfo info;
    info.key = item.record.key;
    info.label = item.record.label;
    info.dtype = item.record.tensor.dtype;
    info.shape = item.record.tensor.shape;
    info.stored = stored || info.numel() == 0;
    // A device tensor's copy has landed by now: the background thread waited for it to judge.
    if (stored && item.bytes <= kKeptBytes && item.bytes > 0) {
      const auto* data = static_cast<const std::byte*>(item.record.tensor.data);
      pending.small_tensors.emplace(info.key, std::vector<std::byte>(data, data + item.bytes));
    }
    pending.records.push_back(std::move(info));
  }
}

// Writes the tensors of `store` and the index rows of `describe` (see PairJudge).
void write_items(formats::StepWriter& writer, std::vector<RecordItem>& store,
                 std::vector<RecordItem>& describe) {
  for (auto* items : {&store, &describe}) {
    if (items->empty()) continue;
    std::vector<formats::Record> records;
    records.reserve(items->size());
    for (auto& r : *items) records.push_back(std::move(r.record));
    if (items == &store) {
      writer.write(records);
    } else {
      writer.describe(records);
    }
  }
}

// The step the judging stage is on.
struct JudgingStep {
  enum class State {
    kNone,  // no step: before the first, or the last one ended sound
    kOpen,  // begun and sound: its records are judged while the caller is in it
    kLost,  // failed, while open or at its end: its items are dropped until the next step begins
  };
  State state = State::kNone;
  std::int64_t step = 0;
  std::unique_ptr<PairJudge> judge;  // while kOpen
  formats::PendingStep pending;      // the step as finish_step() will return it
};

// The step the writing stage is on.
struct WritingStep {
  enum class State {
    kNone,     // no file: before the first step, or the last one committed
    kWriting,  // its file is open
    kLost,     // its file cannot be written: its operations are skipped, its commit fails
  };
  State state = State::kNone;
  std::int64_t step = 0;
  std::unique_ptr<formats::StepWriter> writer;  // while kWriting
  std::exception_ptr error;                     // while kLost: why
};

// The background thread's stages: take work from the queue; judge it (records in batches, and a
// step's begin and end), which turns it into write operations; carry those out whenever nothing
// is left to judge; and on an error, lose the step (its judging, its file or both) and tell the
// caller. Each stage keeps its step's state: the judging stage runs a step ahead of the writing
// stage, so that a step is judged (and reported) while its tensors are still being written.
class BackgroundThread {
 public:
  BackgroundThread(SharedState& shared, const BackgroundConfig& config)
      : shared_(shared),
        config_(config),
        // A batch stays well under the budget, so that the caller can keep snapshotting while it
        // is written.
        batch_cap_(std::max<std::size_t>(config.options.memory_budget_bytes / 4, 1)) {}

  void run();

 private:
  using JudgingState = JudgingStep::State;
  using WritingState = WritingStep::State;
  static constexpr std::size_t kMaxBatchRecords = 4096;
  // A write operation holds about this many bytes, so that judging waits at most for one.
  static constexpr std::size_t kWriteOpBytes = std::size_t{32} << 20;

  void start();
  // Queue: waits for work; false once the recorder stops.
  bool take_work(std::vector<RecordItem>& batch, std::optional<Item>& item);
  // Judging.
  void judge_records(std::vector<RecordItem>& batch);
  std::size_t queue_writes(std::vector<RecordItem>& store, std::vector<RecordItem>& describe,
                           std::uint64_t batch);
  void publish_judged(std::size_t released, std::size_t count);
  void judge_item(Item& item);
  void judge_ahead(JudgeItem& item);
  void judge_reference(const ReferenceItem& item);
  void add_judged(std::vector<RecordItem>& store, std::vector<RecordItem>& describe);
  void begin_judging(std::int64_t step);
  void end_judging();
  // Writing.
  bool writing() const { return writing_.state == WritingState::kWriting; }
  void write_next();
  void begin_file(std::int64_t step);
  std::exception_ptr commit_file(const std::vector<formats::StoredMetrics>& metrics);
  void write_ended_steps();
  // Errors.
  void fail_judging(std::exception_ptr error);
  void fail_writing(std::exception_ptr error);

  SharedState& shared_;
  const BackgroundConfig& config_;
  const std::size_t batch_cap_;
  tbb::task_arena judge_arena_;
  std::optional<formats::NiceObserver> judge_nice_;  // after judge_arena_: observes it
  std::uint64_t batches_ = 0;
  JudgingStep judging_;
  std::deque<WriteOp> writes_;  // what is left to write, in queue order
  WritingStep writing_;
};

void BackgroundThread::run() {
  start();
  for (;;) {
    std::vector<RecordItem> batch;
    std::optional<Item> item;
    if (!take_work(batch, item)) break;
    if (!batch.empty()) {
      judge_records(batch);
    } else if (item) {
      judge_item(*item);
    } else {
      write_next();
    }
  }
  write_ended_steps();
}

void BackgroundThread::start() {
  // Named, so that per-thread profiles (top -H, perf, py-spy) tell it from torch's threads;
  // the TBB workers it starts inherit the name.
  pthread_setname_np(pthread_self(), "dynaprobe-rec");
  // Judging runs below the training threads, at the writer's niceness: this thread and the TBB
  // workers that compare its large pairs in parallel (analyze::compare_in_memory). On a host
  // whose cores training keeps busy, judging at the same priority preempts one of torch's
  // OpenMP threads and the whole parallel region waits for it; below them it takes the gaps,
  // and every core once the training thread waits for it at the step's end (docs/performance.md,
  // Scale).
  const int nice = config_.options.writer.nice;
  if (nice != 0) setpriority(PRIO_PROCESS, 0, nice);  // with 0, Linux means the calling thread
  judge_arena_.initialize();
  if (nice != 0) judge_nice_.emplace(judge_arena_, nice);
}

// Takes a batch of consecutive records, else one other item; neither when only writes are left.
bool BackgroundThread::take_work(std::vector<RecordItem>& batch, std::optional<Item>& item) {
  std::unique_lock lock(shared_.mutex);
  shared_.work_cv.wait(
      lock, [&] { return shared_.stopping || !shared_.queue.empty() || !writes_.empty(); });
  if (shared_.stopping) {
    for (const Item& left : shared_.queue) {  // the step in progress is discarded (see ~Recorder)
      if (const auto* record = std::get_if<RecordItem>(&left))
        shared_.queued_bytes -= record->bytes;
    }
    shared_.queue.clear();
    return false;
  }
  std::size_t batch_bytes = 0;
  while (!shared_.queue.empty() && std::holds_alternative<RecordItem>(shared_.queue.front()) &&
         batch.size() < kMaxBatchRecords) {
    auto& next = std::get<RecordItem>(shared_.queue.front());
    if (!batch.empty() && batch_bytes + next.bytes > batch_cap_) break;
    batch_bytes += next.bytes;
    batch.push_back(std::move(next));
    shared_.queue.pop_front();
  }
  if (batch.empty() && !shared_.queue.empty()) {
    item = std::move(shared_.queue.front());
    shared_.queue.pop_front();
  }
  return true;
}

// Judges a batch of records into write operations; a batch of a lost step (or none) is dropped.
void BackgroundThread::judge_records(std::vector<RecordItem>& batch) {
  std::size_t bytes = 0;
  for (const auto& r : batch) bytes += r.bytes;
  const std::size_t count = batch.size();
  const std::uint64_t this_batch = ++batches_;
  if (judging_.state == JudgingState::kOpen) {
    try {
      std::vector<RecordItem> store, describe;
      judge_arena_.execute([&] {
        for (auto& r : batch) {
          if (r.snapshot) r.snapshot->wait_copied();  // a device tensor's copy has landed
          r.batch = this_batch;
          judging_.judge->take(std::move(r), store, describe);
        }
      });
      add_judged(store, describe);
      // The rest of the batch (held for a twin, described only) is released now.
      publish_judged(bytes - queue_writes(store, describe, this_batch), count);
      return;
    } catch (...) {
      fail_judging(std::current_exception());
    }
  }
  batch.clear();  // frees the snapshots before the budget says they are gone
  {
    std::lock_guard lock(shared_.mutex);
    shared_.queued_bytes -= bytes;
    shared_.handled += count;
  }
  shared_.caller_cv.notify_all();
}

// Judged records join the step: `store` to be written, `describe` as index rows only, whose
// snapshots go now.
void BackgroundThread::add_judged(std::vector<RecordItem>& store,
                                  std::vector<RecordItem>& describe) {
  add_pending(judging_.pending, store, true);
  add_pending(judging_.pending, describe, false);
  for (RecordItem& r : describe) {
    r.snapshot.reset();
    r.record.tensor.data = nullptr;
  }
}

// Cuts judged records into operations of about kWriteOpBytes, never between the sides of a pair
// (the writer stores a repeat of a multi-chunk tensor once only within one write), and queues
// them. Each releases the queue's bytes of its records from batch `batch` once written; returns
// the sum.
std::size_t BackgroundThread::queue_writes(std::vector<RecordItem>& store,
                                           std::vector<RecordItem>& describe, std::uint64_t batch) {
  const auto pair_of = [](const formats::RecordKey& k) {
    return std::tie(k.module, k.call, k.kind, k.tensor_index);
  };
  std::vector<RecordsWrite> ops;
  std::size_t from = 0, op_bytes = 0, op_queued = 0;
  for (std::size_t i = 0; i < store.size(); ++i) {
    op_bytes += store[i].bytes;
    if (store[i].batch == batch) op_queued += store[i].bytes;
    const bool last = i + 1 == store.size();
    if (!last && (op_bytes < kWriteOpBytes ||
                  pair_of(store[i].record.key) == pair_of(store[i + 1].record.key))) {
      continue;
    }
    RecordsWrite op;
    op.store.assign(std::make_move_iterator(store.begin() + from),
                    std::make_move_iterator(store.begin() + i + 1));
    if (last) op.describe = std::move(describe);
    op.bytes = op_queued;
    ops.push_back(std::move(op));
    from = i + 1;
    op_bytes = op_queued = 0;
  }
  if (store.empty()) ops.push_back(RecordsWrite{{}, std::move(describe), 0});
  std::size_t queued = 0;
  for (RecordsWrite& op : ops) {
    queued += op.bytes;
    writes_.push_back(std::move(op));
  }
  return queued;
}

// A batch is judged: failing_calls() need not wait for its writes.
void BackgroundThread::publish_judged(std::size_t released, std::size_t count) {
  {
    std::lock_guard lock(shared_.mutex);
    for (auto& call : judging_.judge->take_failing()) shared_.failing.insert(std::move(call));
    for (auto& call : judging_.judge->take_failing_before_reference())
      shared_.failing_before_reference.insert(std::move(call));
    shared_.held_bytes = judging_.judge->held_bytes();
    shared_.queued_bytes -= released;
    shared_.handled += count;
  }
  shared_.caller_cv.notify_all();
}

// A step's begin or end, a graph or a module description; an error loses the step.
void BackgroundThread::judge_item(Item& item) {
  try {
    std::visit(
        [&](auto& value) {
          using T = std::decay_t<decltype(value)>;
          if constexpr (std::is_same_v<T, BeginItem>) {
            begin_judging(value.step);
          } else if constexpr (std::is_same_v<T, JudgeItem>) {
            judge_ahead(value);
          } else if constexpr (std::is_same_v<T, ReferenceItem>) {
            judge_reference(value);
          } else if constexpr (std::is_same_v<T, formats::Graph>) {
            if (judging_.state != JudgingState::kLost) writes_.push_back(std::move(value));
          } else if constexpr (std::is_same_v<T, formats::ModuleInfo>) {
            if (judging_.state != JudgingState::kLost) {
              judging_.pending.modules.push_back(value);
              writes_.push_back(std::move(value));
            }
          } else if constexpr (std::is_same_v<T, EndItem>) {
            end_judging();
          }
        },
        item);
  } catch (...) {
    fail_judging(std::current_exception());
    if (std::holds_alternative<EndItem>(item)) {
      std::lock_guard lock(shared_.mutex);
      if (!shared_.judged) shared_.judged.emplace();  // finish_step() throws the step's error
    }
  }
  {
    std::lock_guard lock(shared_.mutex);
    ++shared_.handled;
  }
  shared_.caller_cv.notify_all();
}

// A pair judged ahead of its records (Recorder::judge_later). One that cannot be judged now is
// left for its records, which meet the same error where it belongs to the step.
void BackgroundThread::judge_ahead(JudgeItem& item) {
  if (judging_.state != JudgingState::kOpen) return;
  try {
    for (const auto& copy : item.copies) copy->wait_copied();
    judge_arena_.execute([&] { judging_.judge->judge_ahead(item); });
  } catch (...) {
    item.pair->judged = false;
  }
}

// A call's reference to be decided later (Recorder::hold_for_reference): its pairs wait for it;
// or decided (settle_reference): those still waiting are judged without one.
void BackgroundThread::judge_reference(const ReferenceItem& item) {
  if (judging_.state != JudgingState::kOpen) return;
  if (!item.settled) {
    judging_.judge->hold_for_reference(item.module, item.call);
    return;
  }
  std::vector<RecordItem> store, describe;
  judge_arena_.execute(
      [&] { judging_.judge->settle_reference(item.module, item.call, store, describe); });
  add_judged(store, describe);
  queue_writes(store, describe, 0);  // held records: their queued bytes went when they came
  publish_judged(0, 0);
}

void BackgroundThread::begin_judging(std::int64_t step) {
  judging_.step = step;
  judging_.state = JudgingState::kOpen;
  judging_.pending = formats::PendingStep{};
  judging_.pending.file = config_.dump_dir / formats::step_file_name(step);
  judging_.pending.step = step;
  judging_.pending.provenance = config_.provenance;
  const RecorderOptions& options = config_.options;
  judging_.judge =
      std::make_unique<PairJudge>(config_.judging, config_.provenance, options.store,
                                  options.writer.chunk_bytes, options.memory_budget_bytes / 2);
  {
    std::lock_guard lock(shared_.mutex);
    shared_.failing.clear();
    shared_.failing_before_reference.clear();
  }
  writes_.push_back(BeginWrite{step});
}

// The step's end: its last verdicts, then the step as judged for finish_step(), and its commit
// queued behind its writes (a lost step's commit fails with its error at once).
void BackgroundThread::end_judging() {
  auto state = std::make_shared<CommitState>();
  CommitWrite commit{{}, state};
  if (judging_.state == JudgingState::kOpen) {
    try {
      std::vector<RecordItem> store, describe;
      judge_arena_.execute([&] { judging_.judge->end_step(store, describe); });
      add_judged(store, describe);
      writes_.push_back(RecordsWrite{std::move(store), std::move(describe), 0});
      commit.metrics = judging_.judge->take_metrics();
      judging_.pending.metrics = commit.metrics;
    } catch (...) {
      fail_judging(std::current_exception());
    }
  }
  judging_.judge.reset();
  if (judging_.state == JudgingState::kOpen) judging_.state = JudgingState::kNone;
  const bool lost = judging_.state == JudgingState::kLost;
  judging_.pending.wait_committed = [state] { state->wait(); };
  {
    std::lock_guard lock(shared_.mutex);
    shared_.held_bytes = 0;
    // A lost step is never committed: its commit says why, as end_step() does.
    if (lost) state->finish(shared_.step_error);
    shared_.judged = std::move(judging_.pending);
  }
  if (!lost) writes_.push_back(std::move(commit));
  shared_.caller_cv.notify_all();
}

// Carries out the next write operation. An error loses the step being written (and, with
// strict_io, the step being judged when it is the same one).
void BackgroundThread::write_next() {
  WriteOp& op = writes_.front();
  std::size_t released = 0;
  std::shared_ptr<CommitState> committed;
  std::exception_ptr commit_error;
  try {
    std::visit(
        [&](auto& value) {
          using T = std::decay_t<decltype(value)>;
          if constexpr (std::is_same_v<T, BeginWrite>) {
            begin_file(value.step);
          } else if constexpr (std::is_same_v<T, RecordsWrite>) {
            released = value.bytes;
            if (writing()) write_items(*writing_.writer, value.store, value.describe);
          } else if constexpr (std::is_same_v<T, formats::Graph>) {
            if (writing()) writing_.writer->write_graph(value);
          } else if constexpr (std::is_same_v<T, formats::ModuleInfo>) {
            if (writing()) writing_.writer->write_module(value);
          } else if constexpr (std::is_same_v<T, CommitWrite>) {
            committed = value.state;
            commit_error = commit_file(value.metrics);
          }
        },
        op);
  } catch (...) {
    fail_writing(std::current_exception());
    if (committed) commit_error = writing_.error;
  }
  op = BeginWrite{};  // frees the snapshots before the budget says they are gone
  if (released) {
    std::lock_guard lock(shared_.mutex);
    shared_.queued_bytes -= released;
  }
  if (committed) committed->finish(commit_error);
  shared_.caller_cv.notify_all();
  writes_.pop_front();
}

void BackgroundThread::begin_file(std::int64_t step) {
  writing_.writer.reset();
  writing_.step = step;
  writing_.error = config_.storage_error;
  if (writing_.error) {
    writing_.state = WritingState::kLost;
    return;
  }
  writing_.state = WritingState::kNone;  // until its file is made
  writing_.writer = std::make_unique<formats::StepWriter>(
      config_.dump_dir, step, config_.provenance, config_.options.writer);
  writing_.state = WritingState::kWriting;
}

// Writes the step's metrics and commits its file; returns why the step could not be (it was
// lost), or null.
std::exception_ptr BackgroundThread::commit_file(
    const std::vector<formats::StoredMetrics>& metrics) {
  if (writing()) {
    writing_.writer->write_metrics(metrics);
    writing_.writer->commit();
  }
  writing_.writer.reset();
  writing_.state = WritingState::kNone;
  return std::exchange(writing_.error, nullptr);
}

// Stopping: the steps the caller ended are written and committed; the step in progress (its
// operations after the last commit) is discarded with its partial file.
void BackgroundThread::write_ended_steps() {
  while (!writes_.empty() && std::any_of(writes_.begin(), writes_.end(), [](const WriteOp& op) {
    return std::holds_alternative<CommitWrite>(op);
  })) {
    write_next();
  }
  writes_.clear();
  writing_.writer.reset();
}

// The step being judged is lost: the caller hears of it at its next call.
void BackgroundThread::fail_judging(std::exception_ptr error) {
  judging_.judge.reset();  // frees the snapshots it held
  judging_.state = JudgingState::kLost;
  {
    std::lock_guard lock(shared_.mutex);
    shared_.held_bytes = 0;
    if (!shared_.step_error) {
      shared_.step_error = step_lost(error, judging_.step, config_.dump_dir);
    }
  }
  shared_.caller_cv.notify_all();
}

// The step being written is lost: its partial file goes, and the error reaches the caller
// through the step's commit (and at once while the caller is still in the step).
// Without strict_io only the file is lost: the step is still judged in memory.
void BackgroundThread::fail_writing(std::exception_ptr error) {
  writing_.writer.reset();  // removes the partial file
  writing_.error = step_lost(error, writing_.step, config_.dump_dir);
  writing_.state = WritingState::kLost;
  if (config_.options.strict_io && judging_.state == JudgingState::kOpen &&
      judging_.step == writing_.step) {
    fail_judging(error);
  }
}

}  // namespace

void run_background(SharedState& shared, const BackgroundConfig& config) {
  BackgroundThread(shared, config).run();
}

}  // namespace dynaprobe::capture::detail
