// Only Tensor methods and the per-operator headers below: this TU must not pull in all of ATen
// (ATen/ATen.h or torch/torch.h cost minutes per build on two cores).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "dynaprobe/capture/recorder.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/view_as_real.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>

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
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"

namespace dynaprobe::capture {
namespace fs = std::filesystem;

namespace {

// The dump's dtype of a torch dtype, by torch's own name of it (torch.bfloat16 -> "bfloat16"),
// which the dump's dtype names are (formats/dtype.h): a dtype formats learns needs nothing here.
// None for dtypes a dump does not hold (complex is recorded as real pairs, quantized ones not).
std::optional<formats::DType> stored_dtype(at::ScalarType type) {
  return formats::parse_dtype(c10::getDtypeNames(type).first);
}

[[noreturn]] void throw_bad_dtype(at::ScalarType type) {
  throw UsageError(std::string("cannot record a tensor of dtype ") + c10::toString(type) +
                   ": a dump holds floating-point (float64/32/16, bfloat16, float8), complex (as "
                   "real pairs), integer and bool tensors; convert it first (e.g. "
                   "tensor.int_repr() for a quantized tensor)");
}

}  // namespace

formats::DType dtype_of(const at::Tensor& tensor) {
  const auto dtype = stored_dtype(tensor.scalar_type());
  if (!dtype) throw_bad_dtype(tensor.scalar_type());
  return *dtype;
}

namespace {

// A snapshot waiting for the writer. `snapshot` owns the bytes `record.tensor.data` points to.
struct RecordItem {
  formats::Record record;
  at::Tensor snapshot;
  std::size_t bytes = 0;
};
struct BeginItem {
  std::int64_t step = 0;
};
struct EndItem {};
using Item = std::variant<BeginItem, RecordItem, formats::Graph, formats::ModuleInfo, EndItem>;

// Bytes of the contiguous host copy of `tensor` (complex: two reals per element).
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
    if (block == nullptr) block = std::aligned_alloc(kAlignment, round_up(bytes));
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
  static constexpr std::size_t kAlignment = 64;
  static std::size_t round_up(std::size_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
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

// Copies `tensor` into contiguous CPU memory from `pool`: any device, any strides (views,
// expanded and transposed tensors), conjugate and negative bits resolved, sparse made dense,
// complex stored as real pairs (at::view_as_real, trailing dimension 2).
at::Tensor snapshot_of(const at::Tensor& tensor, SnapshotPool& pool) {
  at::Tensor source = tensor.detach();
  if (source.layout() != at::kStrided) source = source.to_dense();
  // One copy: copy_ into a plain tensor materialises the lazy conj/neg bits of `source`.
  at::Tensor copy = pool.empty(source.sizes(), source.scalar_type());
  copy.copy_(source);
  if (copy.is_complex()) copy = at::view_as_real(copy);
  return copy;
}

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

}  // namespace

struct Recorder::Impl {
  fs::path dump_dir;
  formats::Provenance provenance;
  RecorderOptions options;
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
  std::size_t queued_bytes = 0;   // snapshots queued or being written
  std::exception_ptr step_error;  // why the current step is lost
  bool step_done = false;         // the background thread has handled the EndItem
  fs::path committed;
  bool stopping = false;

  std::thread worker;  // last: starts once everything above exists

  void push(Item item) {
    {
      std::lock_guard lock(mutex);
      queue.push_back(std::move(item));
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

// The background thread: owns the StepWriter, turns queue items into writes in queue order and
// batches consecutive records so that StepWriter::write compresses many tensors in parallel.
void Recorder::Impl::run() {
  std::unique_ptr<formats::StepWriter> writer;
  std::int64_t writing_step = 0;
  bool lost = false;  // the current step failed: drop its items until the next BeginItem
  // A batch stays well under the budget, so that the caller can keep snapshotting while it is
  // written.
  const std::size_t batch_cap = std::max<std::size_t>(options.memory_budget_bytes / 4, 1);
  constexpr std::size_t kMaxBatchRecords = 4096;

  const auto fail = [&](std::exception_ptr error) {
    writer.reset();  // removes the partial file
    lost = true;
    {
      std::lock_guard lock(mutex);
      if (!step_error) step_error = step_lost(error, writing_step, dump_dir);
    }
    caller_cv.notify_all();
  };

  for (;;) {
    std::vector<RecordItem> batch;
    std::optional<Item> item;
    {
      std::unique_lock lock(mutex);
      work_cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) {
        queue.clear();  // the step in progress is discarded (see ~Recorder)
        queued_bytes = 0;
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
      if (batch.empty()) {
        item = std::move(queue.front());
        queue.pop_front();
      }
    }

    if (!batch.empty()) {
      std::size_t bytes = 0;
      for (const auto& r : batch) bytes += r.bytes;
      if (writer && !lost) {
        try {
          std::vector<formats::Record> records;
          records.reserve(batch.size());
          for (auto& r : batch) records.push_back(std::move(r.record));
          writer->write(records);
        } catch (...) {
          fail(std::current_exception());
        }
      }
      batch.clear();  // frees the snapshots before the budget says they are gone
      {
        std::lock_guard lock(mutex);
        queued_bytes -= bytes;
      }
      caller_cv.notify_all();
      continue;
    }

    try {
      std::visit(
          [&](auto& value) {
            using T = std::decay_t<decltype(value)>;
            if constexpr (std::is_same_v<T, BeginItem>) {
              writer.reset();
              writing_step = value.step;
              lost = false;
              writer = std::make_unique<formats::StepWriter>(dump_dir, value.step, provenance,
                                                             options.writer);
            } else if constexpr (std::is_same_v<T, formats::Graph>) {
              if (writer && !lost) writer->write_graph(value);
            } else if constexpr (std::is_same_v<T, formats::ModuleInfo>) {
              if (writer && !lost) writer->write_module(value);
            } else if constexpr (std::is_same_v<T, EndItem>) {
              fs::path path;
              if (writer && !lost) path = writer->commit();
              writer.reset();
              {
                std::lock_guard lock(mutex);
                committed = std::move(path);
                step_done = true;
              }
              caller_cv.notify_all();
            }
          },
          *item);
    } catch (...) {
      const bool was_end = std::holds_alternative<EndItem>(*item);
      fail(std::current_exception());
      if (was_end) {
        {
          std::lock_guard lock(mutex);
          step_done = true;
        }
        caller_cv.notify_all();
      }
    }
  }
  writer.reset();  // an unfinished step: its partial file goes
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
  std::error_code error;
  fs::create_directories(dump_dir, error);
  if (error) {
    throw IoError("cannot create dump folder " + dump_dir.string() + ": " + error.message());
  }
  impl.dump_dir = std::move(dump_dir);
  impl.provenance = std::move(provenance);
  impl.options = options;
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
    impl.step_done = false;
  }
  impl.push(BeginItem{step});
}

void Recorder::record(formats::RecordKey key, const at::Tensor& tensor, std::string label) {
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
  const at::ScalarType stored = c10::isComplexType(type) ? c10::toRealValueType(type) : type;
  if (!stored_dtype(stored)) throw_bad_dtype(type);
  const std::size_t bytes = host_bytes(tensor);

  // Back-pressure: wait for room before allocating the snapshot, so host memory stays within
  // the budget (plus one tensor larger than the budget, taken once the queue is empty).
  {
    std::unique_lock lock(impl.mutex);
    impl.caller_cv.wait(lock, [&] {
      return impl.step_error || impl.queued_bytes == 0 ||
             impl.queued_bytes + bytes <= impl.options.memory_budget_bytes;
    });
    if (impl.step_lost_locked()) return;
  }

  RecordItem item;
  item.snapshot = snapshot_of(tensor, *impl.pool);
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
  }
  impl.work_cv.notify_one();
  impl.keys.insert(std::move(key));
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

fs::path Recorder::end_step() {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  impl.require_step("end a step");
  impl.push(EndItem{});
  std::exception_ptr error;
  fs::path path;
  {
    std::unique_lock lock(impl.mutex);
    impl.caller_cv.wait(lock, [&] { return impl.step_done; });
    error = std::exchange(impl.step_error, nullptr);
    path = std::move(impl.committed);
    impl.committed.clear();
  }
  impl.in_step = false;
  if (error) std::rethrow_exception(error);
  return path;
}

const fs::path& Recorder::dump_dir() const { return impl_->dump_dir; }

std::size_t Recorder::queued_bytes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->queued_bytes;
}

}  // namespace dynaprobe::capture
