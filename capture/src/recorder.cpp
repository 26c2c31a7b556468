// Only Tensor methods and the per-operator headers below: this TU must not pull in all of ATen
// (ATen/ATen.h or torch/torch.h cost minutes per build on two cores).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "dynaprobe/capture/recorder.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <pthread.h>
#include <tbb/info.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/formats/dump_lock.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/niceness.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::capture {
namespace fs = std::filesystem;

namespace {

// The dump's dtype of a torch dtype, by torch's own name of it (torch.bfloat16 -> "bfloat16"),
// which the dump's dtype names are (formats/dtype.h): a dtype formats learns needs nothing here.
// None for dtypes a dump does not hold (quantized ones).
std::optional<formats::DType> stored_dtype(at::ScalarType type) {
  return formats::parse_dtype(c10::getDtypeNames(type).first);
}

[[noreturn]] void throw_bad_dtype(at::ScalarType type) {
  throw UsageError(std::string("cannot record a tensor of dtype ") + c10::toString(type) +
                   ": a dump holds floating-point (float64/32/16, bfloat16, float8), complex "
                   "(complex32/64/128), integer and bool tensors; convert it first (e.g. "
                   "tensor.int_repr() for a quantized tensor)");
}

}  // namespace

formats::DType dtype_of(const at::Tensor& tensor) {
  const auto dtype = stored_dtype(tensor.scalar_type());
  if (!dtype) throw_bad_dtype(tensor.scalar_type());
  return *dtype;
}

namespace {

// A snapshot waiting for the writer. `snapshot` owns the bytes `record.tensor.data` points to;
// for a device tensor they are valid once `copied` has completed (see snapshot_of).
struct RecordItem {
  formats::Record record;
  at::Tensor snapshot;
  std::size_t bytes = 0;
  std::shared_ptr<c10::Event> copied;
  std::uint64_t batch = 0;  // the background thread's batch that took it from the queue
};
struct BeginItem {
  std::int64_t step = 0;
};
struct EndItem {};
using Item = std::variant<BeginItem, RecordItem, formats::Graph, formats::ModuleInfo, EndItem>;

// Bytes of the contiguous host copy of `tensor`.
std::size_t host_bytes(const at::Tensor& tensor) {
  return static_cast<std::size_t>(tensor.numel()) * static_cast<std::size_t>(tensor.element_size());
}

// Host memory for snapshots, recycled. The background thread frees each snapshot once written,
// and glibc returns memory freed on another thread to that thread's arena: without recycling,
// every snapshot page-faults fresh memory in (which the kernel zeroes first) and the training
// thread pays about twice a memcpy per byte. Freed blocks are kept by exact size (a training
// step records the same sizes step after step), up to `cap` bytes; the rest goes back to malloc.
class SnapshotPool : public std::enable_shared_from_this<SnapshotPool> {
 public:
  explicit SnapshotPool(std::size_t cap) : cap_(cap) {}
  ~SnapshotPool() {
    for (auto& [size, block] : free_) std::free(block);
  }

  // An uninitialised contiguous CPU tensor; its memory comes back here when the tensor dies.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType type) {
    const std::size_t bytes =
        std::max<std::size_t>(c10::multiply_integers(sizes) * c10::elementSize(type), 1);
    void* block = take(bytes);
    if (block == nullptr) {
      const std::size_t alignment = alignment_of(bytes);
      block = std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
    }
    if (block == nullptr) throw std::bad_alloc();
    std::weak_ptr<SnapshotPool> pool = weak_from_this();
    return at::from_blob(
        block, sizes,
        [pool, bytes](void* data) {
          if (auto alive = pool.lock()) return alive->give_back(data, bytes);
          std::free(data);
        },
        at::TensorOptions().dtype(type).device(at::kCPU));
  }

 private:
  // Page-aligned from 64 KiB on: the writer stores the chunks of such tensors straight from
  // this memory, past the page cache (O_DIRECT needs page-aligned buffers).
  static std::size_t alignment_of(std::size_t bytes) { return bytes >= (64 << 10) ? 4096 : 64; }
  void* take(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    auto found = free_.find(bytes);
    if (found == free_.end()) return nullptr;
    void* block = found->second;
    free_.erase(found);
    kept_ -= bytes;
    return block;
  }
  void give_back(void* block, std::size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      if (kept_ + bytes <= cap_) {
        free_.emplace(bytes, block);
        kept_ += bytes;
        return;
      }
    }
    std::free(block);
  }

  std::size_t cap_;
  std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  std::size_t kept_ = 0;
};

// A device tensor's copy to the host, in flight: the snapshot's bytes are valid once `copied`
// has completed.
struct Snapshot {
  at::Tensor host;
  std::shared_ptr<c10::Event> copied;  // null: a CPU tensor, copied already
};

// Copies a device tensor (CUDA, or any device with streams) without stalling the device or the
// training thread. The caller may change the tensor as soon as record() returns, so first a
// device-to-device copy on the producing stream (fast, in order with whatever changes it next),
// then a non-blocking copy of that into pinned host memory (torch's caching host allocator) on a
// side stream that waits for the producing stream. The caching device allocator is told that the
// side stream uses the staging copy, so its memory is not reused before the copy has read it. The
// background thread waits for `copied` before reading the bytes.
Snapshot device_snapshot(const at::Tensor& source) {
  const c10::Device device = source.device();
  const c10::impl::VirtualGuardImpl guard(device.type());
  const at::Tensor staged = source.resolve_conj().resolve_neg().clone(at::MemoryFormat::Contiguous);
  const c10::Stream producer = guard.getStream(device);
  const c10::Stream side = guard.getStreamFromGlobalPool(device);
  c10::Event staged_event(device.type());
  staged_event.record(producer);
  staged_event.block(side);
  Snapshot snapshot;
  snapshot.host = at::empty(
      staged.sizes(),
      at::TensorOptions().dtype(staged.scalar_type()).device(at::kCPU).pinned_memory(true));
  {
    const c10::StreamGuard on_side(side);
    snapshot.host.copy_(staged, /*non_blocking=*/true);
  }
  guard.recordDataPtrOnStream(staged.storage().data_ptr(), side);
  snapshot.copied = std::make_shared<c10::Event>(device.type());
  snapshot.copied->record(side);
  return snapshot;
}

// Copies `tensor` into contiguous host memory: any device, any strides (views, expanded and
// transposed tensors), conjugate and negative bits resolved, sparse made dense (complex stays
// complex: the dump stores it as such since format 2.0). CPU tensors go into memory from `pool`;
// device tensors as device_snapshot() says.
Snapshot snapshot_of(const at::Tensor& tensor, SnapshotPool& pool) {
  at::Tensor source = tensor.detach();
  if (source.layout() != at::kStrided) source = source.to_dense();
  Snapshot snapshot;
  if (source.device().is_cpu()) {
    // One copy: copy_ into a plain tensor materialises the lazy conj/neg bits of `source`.
    snapshot.host = pool.empty(source.sizes(), source.scalar_type());
    snapshot.host.copy_(source);
  } else {
    snapshot = device_snapshot(source);
  }
  return snapshot;
}

// The background thread's judging in memory (see Recorder): holds each snapshot until its twin
// arrives, compares the pair with the engine's code and says which tensors to store.
class PairJudge {
 public:
  PairJudge(const formats::Provenance& provenance, const fs::path& dump, StoreMode mode,
            std::size_t chunk_bytes, std::size_t hold_cap)
      : judging_(analyze::dump_judging(provenance, dump)),
        mode_(mode),
        chunk_bytes_(chunk_bytes),
        hold_cap_(hold_cap) {
    namespace vocabulary = formats::vocabulary;
    const std::string capture_mode =
        formats::provenance_value(provenance, vocabulary::provenance::kMode);
    single_pass_ = capture_mode == vocabulary::mode::kSinglePass;
    active_ = single_pass_ || capture_mode == vocabulary::mode::kTwoPass;
  }

  // Takes a record: into `store` (its tensor is written), `describe` (its index row only) or
  // held for its twin; a held record may go out later, with another record's call.
  void take(RecordItem item, std::vector<RecordItem>& store, std::vector<RecordItem>& describe) {
    const formats::RecordKey& key = item.record.key;
    if (!active_ || key.kind == formats::Kind::kLoss || !formats::is_compared(key.kind) ||
        key.side == formats::Side::kReference || spilled_.count(pair_key(key))) {
      store.push_back(std::move(item));
      return;
    }
    if (mode_ == StoreMode::kFull) store.push_back(item);
    const PairKey pair = pair_key(key);
    Slot& slot = pending_[pair];
    held_bytes_ += item.bytes;
    (key.side == formats::Side::kEager ? slot.eager : slot.compiled) = std::move(item);
    order_.push_back(pair);
    if (slot.eager && slot.compiled) finish(pair, store, describe);
    spill_over_cap(store);
  }

  // The step's end: records whose twin never came (single-pass fwd_input and grad_output are
  // recorded once and compared with themselves; others are one-sided rows).
  void end_step(std::vector<RecordItem>& store, std::vector<RecordItem>& describe) {
    while (!pending_.empty()) finish(pending_.begin()->first, store, describe);
    order_.clear();
    spilled_.clear();
  }

  std::vector<formats::StoredMetrics> take_metrics() { return std::exchange(metrics_, {}); }
  // The calls with a pair found failing (or spilled, so not judged in memory) since the last
  // take, as (module, call).
  std::vector<CallKey> take_failing() { return std::exchange(failing_, {}); }
  std::size_t held_bytes() const { return held_bytes_; }

 private:
  using PairKey = std::tuple<std::string, std::uint32_t, formats::Kind, std::uint32_t>;
  struct Slot {
    std::optional<RecordItem> eager, compiled;
  };
  static PairKey pair_key(const formats::RecordKey& key) {
    return {key.module, key.call, key.kind, key.tensor_index};
  }

  // Judges pending pair `pair` (or its one record) and hands its records on.
  void finish(const PairKey& pair, std::vector<RecordItem>& store,
              std::vector<RecordItem>& describe) {
    auto found = pending_.find(pair);
    Slot slot = std::move(found->second);
    pending_.erase(found);
    const RecordItem* eager = slot.eager ? &*slot.eager : nullptr;
    const RecordItem* compiled = slot.compiled ? &*slot.compiled : nullptr;
    if (!eager || !compiled) {
      const RecordItem* only = eager ? eager : compiled;
      if (analyze::recorded_once(only->record.key.kind, single_pass_)) eager = compiled = only;
    }
    bool keep_tensors = true;  // a one-sided row, a shape mismatch or a failing pair
    if (eager && compiled && eager->record.tensor.shape == compiled->record.tensor.shape) {
      const formats::TensorView& a = eager->record.tensor;
      const formats::TensorView& b = compiled->record.tensor;
      formats::StoredMetrics stored;
      stored.key = compiled->record.key;
      stored.tolerances =
          judging_.row_tolerances(stored.key.module, stored.key.kind, a.dtype, b.dtype);
      stored.metrics = analyze::compare_in_memory(a, b, stored.tolerances, chunk_bytes_);
      keep_tensors = !stored.metrics.allclose;
      metrics_.push_back(std::move(stored));
    }
    if (keep_tensors && eager && compiled)
      failing_.emplace_back(std::get<0>(pair), std::get<1>(pair));
    for (std::optional<RecordItem>* side : {&slot.eager, &slot.compiled}) {
      if (!*side) continue;
      held_bytes_ -= (*side)->bytes;
      if (mode_ == StoreMode::kFull) continue;  // stored when it came
      const bool store_it = mode_ == StoreMode::kFailing && keep_tensors;
      (store_it ? store : describe).push_back(std::move(**side));
    }
  }

  // Holds at most hold_cap_ bytes: the oldest waiting records are stored whole, and their twins
  // follow them when they come (the pair is then compared from the dump).
  void spill_over_cap(std::vector<RecordItem>& store) {
    while (held_bytes_ > hold_cap_ && !order_.empty()) {
      const PairKey pair = order_.front();
      order_.pop_front();
      auto found = pending_.find(pair);
      if (found == pending_.end()) continue;
      for (std::optional<RecordItem>* side : {&found->second.eager, &found->second.compiled}) {
        if (!*side) continue;
        held_bytes_ -= (*side)->bytes;
        if (mode_ != StoreMode::kFull) store.push_back(std::move(**side));
      }
      pending_.erase(found);
      spilled_.insert(pair);
      failing_.emplace_back(std::get<0>(pair), std::get<1>(pair));  // judged later, from the dump
    }
  }

  analyze::Judging judging_;
  StoreMode mode_;
  std::size_t chunk_bytes_;
  std::size_t hold_cap_;
  bool single_pass_ = false;
  bool active_ = false;  // the step holds both sides
  std::map<PairKey, Slot> pending_;
  std::deque<PairKey> order_;  // when each record came, for spilling the oldest first
  std::set<PairKey> spilled_;
  std::size_t held_bytes_ = 0;
  std::vector<formats::StoredMetrics> metrics_;
  std::vector<CallKey> failing_;
};

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

}  // namespace

struct Recorder::Impl {
  fs::path dump_dir;
  formats::Provenance provenance;
  RecorderOptions options;
  std::unique_ptr<formats::DumpLock> lock;  // one writer per folder
  // Why nothing can be written (the folder cannot be made, its lock is held): strict_io false.
  std::exception_ptr storage_error;
  // Keeps up to a quarter of the budget of written snapshots' memory for the next snapshots.
  std::shared_ptr<SnapshotPool> pool;

  // Caller side: guarded by `call_mutex`, held for the whole of each public call so that calls
  // from several threads (e.g. autograd's device threads running hooks) take turns.
  std::mutex call_mutex;
  bool in_step = false;
  std::int64_t step = 0;
  bool error_reported = false;  // record*() already threw this step's background error
  std::set<formats::RecordKey> keys;
  std::set<std::string, std::less<>> graph_names;
  std::set<std::string, std::less<>> module_names;

  // Shared with the background thread, under `mutex`.
  mutable std::mutex mutex;
  std::condition_variable work_cv;    // the background thread waits for items
  std::condition_variable caller_cv;  // callers wait for budget or for the end of a step
  std::deque<Item> queue;
  std::size_t queued_bytes = 0;   // snapshots queued, being judged or written
  std::size_t held_bytes = 0;     // snapshots the background thread holds for their twin
  std::exception_ptr step_error;  // why the current step is lost
  std::uint64_t pushed = 0;       // items queued so far
  std::uint64_t handled = 0;      // items the background thread has judged or handled
  std::set<CallKey> failing;      // of the current step (PairJudge::take_failing)
  // The current step once the background thread has judged its EndItem.
  std::optional<formats::PendingStep> judged;
  bool stopping = false;

  std::thread worker;  // last: starts once everything above exists

  void push(Item item) {
    {
      std::lock_guard lock(mutex);
      queue.push_back(std::move(item));
      ++pushed;
    }
    work_cv.notify_one();
  }
  void require_step(std::string_view action) const {
    if (!in_step) {
      throw UsageError("cannot " + std::string(action) +
                       " outside a step: call begin_step() first (dump " + dump_dir.string() + ")");
    }
  }
  // Throws the current step's background error the first time a caller can see it; afterwards
  // returns true: the step is lost and further items are dropped. Needs `mutex` held.
  bool step_lost_locked() {
    if (!step_error) return false;
    if (!error_reported) {
      error_reported = true;
      std::rethrow_exception(step_error);
    }
    return true;
  }
  bool check_step(std::string_view action) {
    require_step(action);
    std::lock_guard lock(mutex);
    return step_lost_locked();
  }

  void run();
};

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

// The background thread. Its judging side turns queue items into verdicts (PairJudge) and write
// operations, batching consecutive records so that StepWriter::write compresses many tensors in
// parallel; its writing side owns the StepWriter and carries the operations out in order. It
// judges whatever is queued before it writes anything more, so that finish_step() returns once a
// step is judged while the step's last tensors (the parameter gradients) are still being written.
void Recorder::Impl::run() {
  // A batch stays well under the budget, so that the caller can keep snapshotting while it is
  // written.
  const std::size_t batch_cap = std::max<std::size_t>(options.memory_budget_bytes / 4, 1);
  constexpr std::size_t kMaxBatchRecords = 4096;
  // A write operation holds about this many bytes, so that judging waits at most for one.
  constexpr std::size_t kWriteOpBytes = std::size_t{32} << 20;

  // Judging side: the step being judged.
  std::unique_ptr<PairJudge> judge;
  std::int64_t judging_step = 0;
  bool judging_open = false;  // its EndItem is not judged yet: the caller is in it
  bool judge_lost = false;    // the step failed: drop its items
  formats::PendingStep pending;
  // Writing side: the step being written.
  std::deque<WriteOp> writes;
  std::unique_ptr<formats::StepWriter> writer;
  std::int64_t writing_step = 0;
  std::exception_ptr write_error;  // the step being written is lost: skip its operations

  // Named, so that per-thread profiles (top -H, perf, py-spy) tell it from torch's threads;
  // the TBB workers it starts inherit the name.
  pthread_setname_np(pthread_self(), "dynaprobe-rec");
  // Judging runs below the training threads, at the writer's niceness: this thread and the TBB
  // workers that compare its large pairs in parallel (analyze::compare_in_memory). On a host
  // whose cores training keeps busy, judging at the same priority preempts one of torch's
  // OpenMP threads and the whole parallel region waits for it; below them it takes the gaps,
  // and every core once the training thread waits for it at the step's end (docs/performance.md,
  // Scale).
  const int nice = options.writer.nice;
  if (nice != 0) setpriority(PRIO_PROCESS, 0, nice);  // with 0, Linux means the calling thread
  tbb::task_arena judge_arena;
  judge_arena.initialize();
  std::optional<formats::NiceObserver> judge_nice;
  if (nice != 0) judge_nice.emplace(judge_arena, nice);

  // The step being judged is lost: the caller hears of it at its next call.
  const auto fail_judging = [&](std::exception_ptr error) {
    judge.reset();  // frees the snapshots it held
    judge_lost = true;
    {
      std::lock_guard lock(mutex);
      held_bytes = 0;
      if (!step_error) step_error = step_lost(error, judging_step, dump_dir);
    }
    caller_cv.notify_all();
  };
  // The step being written is lost: its partial file goes, and the error reaches the caller
  // through the step's commit (and at once while the caller is still in the step).
  // Without strict_io only the file is lost: the step is still judged in memory.
  const auto fail_writing = [&](std::exception_ptr error) {
    writer.reset();  // removes the partial file
    write_error = step_lost(error, writing_step, dump_dir);
    if (options.strict_io && judging_open && judging_step == writing_step && !judge_lost) {
      fail_judging(error);
    }
  };
  std::uint64_t batches = 0;
  const auto judge_batch = [&](std::vector<RecordItem>& batch) {
    std::size_t bytes = 0;
    for (const auto& r : batch) bytes += r.bytes;
    const std::size_t count = batch.size();
    const std::uint64_t this_batch = ++batches;
    std::size_t released = bytes;  // of the queue's bytes, those not waiting for a write
    if (judge && !judge_lost) {
      try {
        std::vector<RecordItem> store, describe;
        judge_arena.execute([&] {
          for (auto& r : batch) {
            if (r.copied) r.copied->synchronize();  // a device tensor's copy has landed
            r.batch = this_batch;
            judge->take(std::move(r), store, describe);
          }
        });
        add_pending(pending, store, true);
        add_pending(pending, describe, false);
        for (RecordItem& r : describe) {  // only their index rows are written
          r.snapshot = at::Tensor();
          r.copied.reset();
          r.record.tensor.data = nullptr;
        }
        // Cut into operations of about kWriteOpBytes, never between the sides of a pair (the
        // writer stores a repeat of a multi-chunk tensor once only within one write). Each
        // releases the queue's bytes of its records from this batch once written; the rest of
        // the batch (held for a twin, described only) is released now.
        const auto pair_of = [](const formats::RecordKey& k) {
          return std::tie(k.module, k.call, k.kind, k.tensor_index);
        };
        std::vector<RecordsWrite> ops;
        std::size_t from = 0, op_bytes = 0, op_queued = 0;
        for (std::size_t i = 0; i < store.size(); ++i) {
          op_bytes += store[i].bytes;
          if (store[i].batch == this_batch) op_queued += store[i].bytes;
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
        for (RecordsWrite& op : ops) {
          released -= op.bytes;
          writes.push_back(std::move(op));
        }
        {  // judged: failing_calls() need not wait for the write
          std::lock_guard lock(mutex);
          for (auto& call : judge->take_failing()) failing.insert(std::move(call));
          held_bytes = judge->held_bytes();
          queued_bytes -= released;
          handled += count;
        }
        caller_cv.notify_all();
        return;
      } catch (...) {
        fail_judging(std::current_exception());
      }
    }
    batch.clear();  // frees the snapshots before the budget says they are gone
    {
      std::lock_guard lock(mutex);
      queued_bytes -= bytes;
      handled += count;
    }
    caller_cv.notify_all();
  };
  const auto judge_item = [&](Item& item) {
    std::visit(
        [&](auto& value) {
          using T = std::decay_t<decltype(value)>;
          if constexpr (std::is_same_v<T, BeginItem>) {
            judging_step = value.step;
            judging_open = true;
            judge_lost = false;
            pending = formats::PendingStep{};
            pending.file = dump_dir / formats::step_file_name(value.step);
            pending.step = value.step;
            pending.provenance = provenance;
            judge = std::make_unique<PairJudge>(provenance, dump_dir, options.store,
                                                options.writer.chunk_bytes,
                                                options.memory_budget_bytes / 2);
            {
              std::lock_guard lock(mutex);
              failing.clear();
            }
            writes.push_back(BeginWrite{value.step});
          } else if constexpr (std::is_same_v<T, formats::Graph>) {
            if (!judge_lost) writes.push_back(std::move(value));
          } else if constexpr (std::is_same_v<T, formats::ModuleInfo>) {
            if (!judge_lost) {
              pending.modules.push_back(value);
              writes.push_back(std::move(value));
            }
          } else if constexpr (std::is_same_v<T, EndItem>) {
            auto state = std::make_shared<CommitState>();
            CommitWrite commit{{}, state};
            if (judge && !judge_lost) {
              try {
                std::vector<RecordItem> store, describe;
                judge_arena.execute([&] { judge->end_step(store, describe); });
                add_pending(pending, store, true);
                add_pending(pending, describe, false);
                writes.push_back(RecordsWrite{std::move(store), std::move(describe), 0});
                commit.metrics = judge->take_metrics();
                pending.metrics = commit.metrics;
              } catch (...) {
                fail_judging(std::current_exception());
              }
            }
            judge.reset();
            judging_open = false;
            pending.wait_committed = [state] { state->wait(); };
            {
              std::lock_guard lock(mutex);
              held_bytes = 0;
              // A lost step is never committed: its commit says why, as end_step() does.
              if (judge_lost) state->finish(step_error);
              judged = std::move(pending);
            }
            if (!judge_lost) writes.push_back(std::move(commit));
            caller_cv.notify_all();
          }
        },
        item);
  };
  const auto write_op = [&](WriteOp& op) {
    std::size_t released = 0;
    std::shared_ptr<CommitState> committed;
    std::exception_ptr commit_error;
    try {
      std::visit(
          [&](auto& value) {
            using T = std::decay_t<decltype(value)>;
            if constexpr (std::is_same_v<T, BeginWrite>) {
              writer.reset();
              writing_step = value.step;
              write_error = storage_error;
              if (!write_error) {
                writer = std::make_unique<formats::StepWriter>(dump_dir, value.step, provenance,
                                                               options.writer);
              }
            } else if constexpr (std::is_same_v<T, RecordsWrite>) {
              released = value.bytes;
              if (writer && !write_error) write_items(*writer, value.store, value.describe);
            } else if constexpr (std::is_same_v<T, formats::Graph>) {
              if (writer && !write_error) writer->write_graph(value);
            } else if constexpr (std::is_same_v<T, formats::ModuleInfo>) {
              if (writer && !write_error) writer->write_module(value);
            } else if constexpr (std::is_same_v<T, CommitWrite>) {
              committed = value.state;
              if (writer && !write_error) {
                writer->write_metrics(value.metrics);
                writer->commit();
              }
              writer.reset();
              commit_error = write_error;
            }
          },
          op);
    } catch (...) {
      fail_writing(std::current_exception());
      if (committed) commit_error = write_error;
    }
    op = BeginWrite{};  // frees the snapshots before the budget says they are gone
    if (released) {
      std::lock_guard lock(mutex);
      queued_bytes -= released;
    }
    if (committed) committed->finish(commit_error);
    caller_cv.notify_all();
  };

  for (;;) {
    std::vector<RecordItem> batch;
    std::optional<Item> item;
    {
      std::unique_lock lock(mutex);
      work_cv.wait(lock, [&] { return stopping || !queue.empty() || !writes.empty(); });
      if (stopping) {
        for (const Item& left : queue) {  // the step in progress is discarded (see ~Recorder)
          if (const auto* record = std::get_if<RecordItem>(&left)) queued_bytes -= record->bytes;
        }
        queue.clear();
        break;
      }
      std::size_t batch_bytes = 0;
      while (!queue.empty() && std::holds_alternative<RecordItem>(queue.front()) &&
             batch.size() < kMaxBatchRecords) {
        auto& next = std::get<RecordItem>(queue.front());
        if (!batch.empty() && batch_bytes + next.bytes > batch_cap) break;
        batch_bytes += next.bytes;
        batch.push_back(std::move(next));
        queue.pop_front();
      }
      if (batch.empty() && !queue.empty()) {
        item = std::move(queue.front());
        queue.pop_front();
      }
    }
    if (!batch.empty()) {
      judge_batch(batch);
      continue;
    }
    if (item) {
      try {
        judge_item(*item);
      } catch (...) {
        fail_judging(std::current_exception());
        if (std::holds_alternative<EndItem>(*item)) {
          judging_open = false;
          std::lock_guard lock(mutex);
          if (!judged) judged.emplace();  // finish_step() throws the step's error
        }
      }
      {
        std::lock_guard lock(mutex);
        ++handled;
      }
      caller_cv.notify_all();
      continue;
    }
    write_op(writes.front());
    writes.pop_front();
  }
  // Stopping: the steps the caller ended are written and committed; the step in progress (its
  // operations after the last commit) is discarded with its partial file.
  while (!writes.empty() && std::any_of(writes.begin(), writes.end(), [](const WriteOp& op) {
    return std::holds_alternative<CommitWrite>(op);
  })) {
    write_op(writes.front());
    writes.pop_front();
  }
  writes.clear();
  writer.reset();
}

// Who holds a dump folder's lock, as a second writer's message names it.
static std::string lock_holder(const formats::Provenance& provenance) {
  const auto value = [&](std::string_view key) {
    const std::string text = formats::provenance_value(provenance, key);
    return text.empty() ? std::string("?") : text;
  };
  return "host " + value("host") + ", pid " + std::to_string(::getpid()) + ", run started " +
         value(formats::vocabulary::provenance::kCreated);
}

Recorder::Recorder(fs::path dump_dir, formats::Provenance provenance, RecorderOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  for (const auto reserved : {formats::schema::kFormatVersionAttr, formats::schema::kStepAttr}) {
    if (provenance.count(std::string(reserved))) {
      throw UsageError("provenance key '" + std::string(reserved) +
                       "' is reserved by the dump format; choose another name");
    }
  }
  if (options.writer.chunk_bytes == 0) {
    throw UsageError("RecorderOptions.writer.chunk_bytes must be positive, but is 0");
  }
  analyze::dump_judging(provenance, dump_dir);  // a bad tolerance fails here, not at a step
  try {
    std::error_code error;
    fs::create_directories(dump_dir, error);
    if (error) {
      throw IoError("cannot create dump folder " + dump_dir.string() + ": " + error.message());
    }
    impl.lock = std::make_unique<formats::DumpLock>(dump_dir, lock_holder(provenance));
  } catch (const IoError&) {
    if (options.strict_io) throw;
    impl.storage_error = std::current_exception();
  }
  impl.dump_dir = std::move(dump_dir);
  impl.provenance = std::move(provenance);
  impl.options = options;
  impl.options.writer.create_folder = false;  // made above, with its lock
  if (impl.options.writer.threads == 0) {
    impl.options.writer.threads =
        std::max(1, tbb::info::default_concurrency() - at::get_num_threads());
  }
  impl.pool = std::make_shared<SnapshotPool>(options.memory_budget_bytes / 4);
  impl.worker = std::thread([&impl] { impl.run(); });
}

Recorder::~Recorder() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->work_cv.notify_one();
  impl_->worker.join();
}

void Recorder::begin_step(std::int64_t step) {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  if (impl.in_step) {
    throw UsageError("cannot begin step " + std::to_string(step) + ": step " +
                     std::to_string(impl.step) + " is still open; call end_step() first");
  }
  impl.in_step = true;
  impl.step = step;
  impl.error_reported = false;
  impl.keys.clear();
  impl.graph_names.clear();
  impl.module_names.clear();
  {
    std::lock_guard lock(impl.mutex);
    impl.step_error = nullptr;
  }
  impl.push(BeginItem{step});
}

void Recorder::record(formats::RecordKey key, const at::Tensor& tensor, std::string label,
                      bool handed_over) {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  if (impl.check_step("record " + key.module)) return;
  key.step = impl.step;
  formats::validate_module_path(key.module);
  if (impl.keys.count(key)) {
    throw UsageError("record " + formats::to_string(key) +
                     " was already recorded in this step; each (module, call, kind, "
                     "tensor_index, side) is recorded once per step");
  }
  if (!tensor.defined()) {
    throw UsageError("record " + formats::to_string(key) + ": the tensor is undefined (None)");
  }
  if (tensor.is_meta()) {
    throw UsageError("record " + formats::to_string(key) +
                     ": a tensor on the meta device has no values to record");
  }
  if (tensor.key_set().has(c10::DispatchKey::Python)) {
    throw UsageError("record " + formats::to_string(key) +
                     ": expected a plain tensor, but received a tensor subclass with "
                     "__torch_dispatch__ (FakeTensor, DTensor, ...); record its local data");
  }
  // Checked before any copy, so a bad dtype costs nothing.
  const at::ScalarType type = tensor.scalar_type();
  if (!stored_dtype(type)) throw_bad_dtype(type);
  const std::size_t bytes = host_bytes(tensor);

  // Back-pressure: wait for room before allocating the snapshot, so host memory stays within
  // the budget (plus one tensor larger than the budget, taken once the queue is empty).
  {
    std::unique_lock lock(impl.mutex);
    impl.caller_cv.wait(lock, [&] {
      return impl.step_error || impl.queued_bytes == 0 ||
             impl.queued_bytes + impl.held_bytes + bytes <= impl.options.memory_budget_bytes;
    });
    if (impl.step_lost_locked()) return;
  }

  RecordItem item;
  const bool keep_as_is = handed_over && tensor.device().is_cpu() && tensor.is_contiguous() &&
                          tensor.layout() == at::kStrided && !tensor.is_conj() && !tensor.is_neg();
  Snapshot snapshot =
      keep_as_is ? Snapshot{tensor.detach(), nullptr} : snapshot_of(tensor, *impl.pool);
  item.snapshot = std::move(snapshot.host);
  item.copied = std::move(snapshot.copied);
  item.bytes = bytes;
  item.record.key = key;
  item.record.label = std::move(label);
  item.record.tensor.dtype = dtype_of(item.snapshot);
  const auto sizes = item.snapshot.sizes();
  item.record.tensor.shape.assign(sizes.begin(), sizes.end());
  item.record.tensor.data = item.snapshot.const_data_ptr();
  {
    std::lock_guard lock(impl.mutex);
    impl.queued_bytes += bytes;
    impl.queue.push_back(std::move(item));
    ++impl.pushed;
  }
  impl.work_cv.notify_one();
  impl.keys.insert(std::move(key));
}

at::Tensor Recorder::copy(const at::Tensor& tensor) {
  const at::Tensor source = tensor.detach();
  if (source.layout() != at::kStrided) return source.clone();  // sparse stays sparse
  if (!source.device().is_cpu()) return source.clone(at::MemoryFormat::Contiguous);
  return snapshot_of(source, *impl_->pool).host;
}

void Recorder::record_graph(formats::Graph graph) {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  if (impl.check_step("record graph " + graph.name)) return;
  formats::validate_module_path(graph.name);
  if (graph.attributes.count(std::string(formats::schema::kGraphKindAttr))) {
    throw UsageError("graph " + graph.name +
                     ": attribute 'kind' is reserved; pass the kind as Graph::kind instead");
  }
  if (impl.graph_names.count(graph.name)) {
    throw UsageError("graph " + graph.name + " was already recorded in step " +
                     std::to_string(impl.step));
  }
  impl.graph_names.insert(graph.name);
  impl.push(std::move(graph));
}

void Recorder::record_module(formats::ModuleInfo module) {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  if (impl.check_step("record module " + module.module)) return;
  formats::validate_module_path(module.module);
  if (impl.module_names.count(module.module)) {
    throw UsageError("module " + module.module + " was already described in step " +
                     std::to_string(impl.step));
  }
  impl.module_names.insert(module.module);
  impl.push(std::move(module));
}

formats::PendingStep Recorder::finish_step() {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  impl.require_step("end a step");
  impl.push(EndItem{});
  std::exception_ptr error;
  formats::PendingStep pending;
  {
    std::unique_lock lock(impl.mutex);
    impl.caller_cv.wait(lock, [&] { return impl.judged.has_value(); });
    error = std::exchange(impl.step_error, nullptr);
    pending = std::move(*impl.judged);
    impl.judged.reset();
  }
  impl.in_step = false;
  if (error) std::rethrow_exception(error);
  return pending;
}

fs::path Recorder::end_step() {
  formats::PendingStep pending = finish_step();
  pending.wait_committed();
  return pending.file;
}

std::vector<CallKey> Recorder::failing_calls() {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  impl.require_step("ask for the failing calls");
  std::unique_lock lock(impl.mutex);
  const std::uint64_t queued = impl.pushed;
  impl.caller_cv.wait(lock, [&] { return impl.step_error || impl.handled >= queued; });
  return {impl.failing.begin(), impl.failing.end()};
}

const fs::path& Recorder::dump_dir() const { return impl_->dump_dir; }

std::size_t Recorder::held_bytes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->held_bytes;
}

std::size_t Recorder::queued_bytes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->queued_bytes;
}

}  // namespace dynaprobe::capture
