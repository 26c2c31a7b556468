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
#include <tbb/info.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "background_thread.h"
#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/formats/dump_lock.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/schema.h"
#include "dynaprobe/formats/vocabulary.h"
#include "queue_items.h"

namespace dynaprobe::capture {
namespace fs = std::filesystem;

namespace {

// The dump's dtype of a torch dtype, by torch's own name of it (torch.bfloat16 -> "bfloat16"),
// which the dump's dtype names are (formats/dtype.h): a dtype formats learns needs nothing here.
// None for dtypes a dump does not hold (quantized ones).
std::optional<formats::DType> stored_dtype(at::ScalarType type) {
  return formats::parse_dtype(c10::getDtypeNames(type).first);
}

// Whether `tensor` is its own host values (host_values): record() keeps such a tensor handed over
// as it is, without a snapshot copy.
bool kept_as_is(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.is_contiguous() && tensor.layout() == at::kStrided &&
         !tensor.is_conj() && !tensor.is_neg();
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

at::Tensor host_values(const at::Tensor& tensor) {
  at::Tensor values = tensor.detach();
  if (kept_as_is(values)) return values;
  if (values.layout() != at::kStrided) values = values.to_dense();
  return values.resolve_conj().resolve_neg().cpu().contiguous();
}

formats::TensorView view_of(const at::Tensor& tensor) {
  formats::TensorView view;
  view.dtype = dtype_of(tensor);
  view.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
  view.data = tensor.const_data_ptr();
  return view;
}

namespace {

// Bytes of the contiguous host copy of `tensor`.
std::size_t host_bytes(const at::Tensor& tensor) {
  return static_cast<std::size_t>(tensor.numel()) * static_cast<std::size_t>(tensor.element_size());
}

// Contiguous CPU tensors up to this size are snapshot by a memcpy on the calling thread, not
// torch's copy_: copy_ runs an OpenMP region on every intra-op thread from 32K elements on, and
// on a host whose cores other processes also want, each region waits for its slowest thread
// (two CPU hogs beside a 14.7M bf16 step: 37 ms a step in 91 records, against 1.2 ms quiet).
// Larger tensors keep torch's parallel copy.
constexpr std::size_t kPlainCopyBytes = std::size_t{1} << 20;

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
    snapshot.host = pool.empty(source.sizes(), source.scalar_type());
    const std::size_t bytes = host_bytes(source);
    if (kept_as_is(source) && bytes <= kPlainCopyBytes) {
      if (bytes > 0) std::memcpy(snapshot.host.data_ptr(), source.const_data_ptr(), bytes);
    } else {
      // One copy: copy_ into a plain tensor materialises the lazy conj/neg bits of `source`.
      snapshot.host.copy_(source);
    }
  } else {
    snapshot = device_snapshot(source);
  }
  return snapshot;
}

// A record's snapshot for the background thread: its bytes are valid once `copied` has completed.
class TensorSnapshot final : public detail::HostSnapshot {
 public:
  explicit TensorSnapshot(Snapshot snapshot) : snapshot_(std::move(snapshot)) {}
  void wait_copied() override {
    if (snapshot_.copied) snapshot_.copied->synchronize();
  }
  const at::Tensor& host() const { return snapshot_.host; }

 private:
  Snapshot snapshot_;
};

}  // namespace

struct Recorder::Impl {
  fs::path dump_dir;
  RecorderOptions options;
  std::unique_ptr<formats::DumpLock> dump_lock;  // one writer per folder
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
  // The pairs judge_pair() and judge_later() judged this step: the tensors held, so that no
  // other tensor takes their memory, with their versions then, so that a change in place is
  // seen; found by any side's data (one lookup a record, however many pairs were judged). A
  // side the recorder could not keep as it is (on a device, strided) was judged in a copy
  // (judge_later), which its record reuses: no second copy, and the bytes judged are the bytes
  // stored.
  struct JudgedSide {
    at::Tensor tensor;
    std::int64_t version = 0;
    std::shared_ptr<TensorSnapshot> copy;  // null: judged as it is
  };
  struct EarlyJudged {
    JudgedSide eager, compiled, reference;  // reference: judge_later()'s, if any
    std::shared_ptr<const detail::JudgedPair> pair;
  };
  std::vector<EarlyJudged> early;
  std::unordered_map<const void*, std::size_t> early_by_data;  // into `early`, the latest
  std::size_t early_copied_bytes = 0;                          // judge_later()'s copies this step

  void remember_judged(EarlyJudged judged) {
    for (const JudgedSide* side : {&judged.eager, &judged.compiled, &judged.reference}) {
      if (side->tensor.defined()) early_by_data[side->tensor.const_data_ptr()] = early.size();
    }
    early.push_back(std::move(judged));
  }
  void forget_judged() {
    early.clear();
    early_by_data.clear();
    early_copied_bytes = 0;
  }
  // The pair judged this step that `tensor` is a side of, unchanged since, and which side.
  struct JudgedAs {
    const EarlyJudged* judged = nullptr;
    const JudgedSide* side = nullptr;  // null: none
    // The pair's metrics, for its eager or compiled side (a record carries them).
    std::shared_ptr<const detail::JudgedPair> pair() const {
      return side != nullptr && side != &judged->reference ? judged->pair : nullptr;
    }
  };
  JudgedAs judged_as(const at::Tensor& tensor) const {
    const auto found = early_by_data.find(tensor.const_data_ptr());
    if (found == early_by_data.end()) return {};
    const EarlyJudged& judged = early[found->second];
    for (const JudgedSide* side : {&judged.eager, &judged.compiled, &judged.reference}) {
      if (side->tensor.defined() && side->tensor.const_data_ptr() == tensor.const_data_ptr() &&
          side->tensor.numel() == tensor.numel() &&
          side->tensor.scalar_type() == tensor.scalar_type() &&
          side->tensor.sizes() == tensor.sizes() && side->tensor.strides() == tensor.strides() &&
          side->tensor.device() == tensor.device() && tensor._version() == side->version) {
        return {&judged, side};
      }
    }
    return {};
  }

  detail::SharedState shared;  // with the background thread
  std::thread worker;          // last: starts once everything above exists

  // Waits until the background thread has judged or handled every item queued so far, or the
  // step is lost.
  void wait_handled() {
    std::unique_lock lock(shared.mutex);
    const std::uint64_t queued = shared.pushed;
    shared.caller_cv.wait(lock, [&] { return shared.step_error || shared.handled >= queued; });
  }

  void require_step(std::string_view action) const {
    if (!in_step) {
      throw UsageError("cannot " + std::string(action) +
                       " outside a step: call begin_step() first (dump " + dump_dir.string() + ")");
    }
  }
  // Throws the current step's background error the first time a caller can see it; afterwards
  // returns true: the step is lost and further items are dropped. Needs `shared.mutex` held.
  bool step_lost_locked() {
    if (!shared.step_error) return false;
    if (!error_reported) {
      error_reported = true;
      std::rethrow_exception(shared.step_error);
    }
    return true;
  }
  bool check_step(std::string_view action) {
    require_step(action);
    std::lock_guard lock(shared.mutex);
    return step_lost_locked();
  }
};

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
  detail::BackgroundConfig background;
  if (options.judging) {
    for (auto& [key, value] : analyze::judging_provenance(*options.judging)) {
      if (!provenance.emplace(key, std::move(value)).second) {
        throw UsageError("provenance key '" + key +
                         "' is written from RecorderOptions::judging; leave it out of the "
                         "provenance");
      }
    }
    background.judging = *options.judging;
  } else {
    background.judging = analyze::dump_judging(provenance, dump_dir);  // fails here, not at a step
  }
  try {
    std::error_code error;
    fs::create_directories(dump_dir, error);
    if (error) {
      throw IoError("cannot create dump folder " + dump_dir.string() + ": " + error.message());
    }
    impl.dump_lock = std::make_unique<formats::DumpLock>(dump_dir, lock_holder(provenance));
  } catch (const IoError&) {
    if (options.strict_io) throw;
    background.storage_error = std::current_exception();
  }
  impl.dump_dir = std::move(dump_dir);
  impl.options = options;
  impl.options.writer.create_folder = false;  // made above, with its lock
  if (impl.options.writer.threads == 0) {
    impl.options.writer.threads =
        std::max(1, tbb::info::default_concurrency() - at::get_num_threads());
  }
  impl.pool = std::make_shared<SnapshotPool>(options.memory_budget_bytes / 4);
  background.dump_dir = impl.dump_dir;
  background.provenance = std::move(provenance);
  background.options = impl.options;
  impl.worker = std::thread([&shared = impl.shared, background = std::move(background)] {
    detail::run_background(shared, background);
  });
}

Recorder::~Recorder() {
  {
    std::lock_guard lock(impl_->shared.mutex);
    impl_->shared.stopping = true;
  }
  impl_->shared.work_cv.notify_one();
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
  impl.forget_judged();
  {
    std::lock_guard lock(impl.shared.mutex);
    impl.shared.step_error = nullptr;
  }
  impl.shared.push(detail::BeginItem{step});
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
    std::unique_lock lock(impl.shared.mutex);
    impl.shared.caller_cv.wait(lock, [&] {
      return impl.shared.step_error || impl.shared.queued_bytes == 0 ||
             impl.shared.queued_bytes + impl.shared.held_bytes + bytes <=
                 impl.options.memory_budget_bytes;
    });
    if (impl.step_lost_locked()) return;
  }

  detail::RecordItem item;
  // A tensor handed over as judged ahead, unchanged: recorded from the bytes it was judged in.
  const Impl::JudgedAs judged = handed_over ? impl.judged_as(tensor) : Impl::JudgedAs{};
  std::shared_ptr<TensorSnapshot> snapshot;
  if (judged.side != nullptr && judged.side->copy) {
    snapshot = judged.side->copy;
  } else if (handed_over && kept_as_is(tensor)) {
    snapshot = std::make_shared<TensorSnapshot>(Snapshot{tensor.detach(), nullptr});
  } else {
    snapshot = std::make_shared<TensorSnapshot>(snapshot_of(tensor, *impl.pool));
  }
  item.judged = judged.pair();
  const at::Tensor& host = snapshot->host();
  item.bytes = bytes;
  item.record.key = key;
  item.record.label = std::move(label);
  item.record.tensor.dtype = dtype_of(host);
  const auto sizes = host.sizes();
  item.record.tensor.shape.assign(sizes.begin(), sizes.end());
  item.record.tensor.data = host.const_data_ptr();
  item.snapshot = std::move(snapshot);
  {
    std::lock_guard lock(impl.shared.mutex);
    impl.shared.queued_bytes += bytes;
    impl.shared.queue.push_back(std::move(item));
    ++impl.shared.pushed;
  }
  impl.shared.work_cv.notify_one();
  impl.keys.insert(std::move(key));
}

at::Tensor Recorder::copy(const at::Tensor& tensor) {
  const at::Tensor source = tensor.detach();
  if (source.layout() != at::kStrided) return source.clone();  // sparse stays sparse
  if (!source.device().is_cpu()) return source.clone(at::MemoryFormat::Contiguous);
  return snapshot_of(source, *impl_->pool).host;
}

formats::TensorMetrics Recorder::judge_pair(const at::Tensor& eager, const at::Tensor& compiled,
                                            const formats::Tolerances& tolerances) {
  Impl& impl = *impl_;
  {
    std::lock_guard call(impl.call_mutex);
    impl.require_step("judge a pair");
    const auto queued = impl.judged_as(eager).pair();
    if (queued && queued == impl.judged_as(compiled).pair()) {
      impl.wait_handled();
      if (queued->judged && queued->tolerances.atol == tolerances.atol &&
          queued->tolerances.rtol == tolerances.rtol) {
        return queued->metrics;
      }
    }
  }
  // Held only when they are the tensors record() would keep as they are: a copy could never
  // be recorded.
  const bool kept = kept_as_is(eager) && kept_as_is(compiled);
  const at::Tensor e = host_values(eager), c = host_values(compiled);
  const std::int64_t e_version = e._version(), c_version = c._version();  // of what is compared
  const formats::TensorView e_view = view_of(e), c_view = view_of(c);
  if (e_view.numel() != c_view.numel()) {
    throw UsageError("judge_pair: the two tensors must have as many elements, but have " +
                     std::to_string(e_view.numel()) + " and " + std::to_string(c_view.numel()));
  }
  formats::TensorMetrics metrics =
      analyze::compare_in_memory(e_view, c_view, tolerances, impl.options.writer.chunk_bytes);
  if (kept) {
    std::lock_guard call(impl.call_mutex);
    auto pair = std::make_shared<detail::JudgedPair>();
    pair->eager = e_view.data;
    pair->compiled = c_view.data;
    pair->judged = true;
    pair->tolerances = tolerances;
    pair->metrics = metrics;
    impl.remember_judged({{e, e_version, nullptr}, {c, c_version, nullptr}, {}, std::move(pair)});
  }
  return metrics;
}

void Recorder::judge_later(const std::string& module, const at::Tensor& eager,
                           const at::Tensor& compiled, const at::Tensor& reference) {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  if (impl.check_step("judge " + module + " ahead")) return;
  const at::Tensor e = eager.detach(), c = compiled.detach();
  const at::Tensor r = reference.defined() ? reference.detach() : at::Tensor();
  std::size_t copied_bytes = 0;
  for (const at::Tensor* side : {&e, &c, &r}) {
    if (!side->defined()) continue;
    if (side->layout() != at::kStrided || side->is_meta() ||
        side->key_set().has(c10::DispatchKey::Python) || !stored_dtype(side->scalar_type())) {
      return;  // left to record(), which says why
    }
    if (!kept_as_is(*side)) copied_bytes += host_bytes(*side);
  }
  const auto judged = impl.judged_as(e).pair();
  if (judged && judged == impl.judged_as(c).pair()) return;  // by judge_pair() already
  // Copies (device tensors, strided ones) are held until the step ends, within a quarter of the
  // memory budget; past it the pair is judged at collect() as before.
  if (impl.early_copied_bytes + copied_bytes > impl.options.memory_budget_bytes / 4) return;
  impl.early_copied_bytes += copied_bytes;
  detail::JudgeItem item;
  const auto side_of = [&](const at::Tensor& tensor, formats::TensorView& view) {
    Impl::JudgedSide side{tensor, tensor._version(), nullptr};
    if (kept_as_is(tensor)) {
      view = view_of(tensor);
    } else {
      side.copy = std::make_shared<TensorSnapshot>(snapshot_of(tensor, *impl.pool));
      view = view_of(side.copy->host());
      item.copies.push_back(side.copy);
    }
    return side;
  };
  item.pair = std::make_shared<detail::JudgedPair>();
  item.module = module;
  Impl::EarlyJudged early{side_of(e, item.eager), side_of(c, item.compiled), {}, item.pair};
  item.pair->eager = item.eager.data;
  item.pair->compiled = item.compiled.data;
  if (r.defined()) early.reference = side_of(r, item.reference.emplace());
  impl.remember_judged(std::move(early));
  impl.shared.push(std::move(item));
}

void Recorder::hold_for_reference(const std::string& module, std::uint32_t call) {
  Impl& impl = *impl_;
  std::lock_guard lock(impl.call_mutex);
  if (impl.check_step("hold " + module + " for its reference")) return;
  impl.shared.push(detail::ReferenceItem{module, call, false});
}

void Recorder::settle_reference(const std::string& module, std::uint32_t call) {
  Impl& impl = *impl_;
  std::lock_guard lock(impl.call_mutex);
  if (impl.check_step("settle the reference of " + module)) return;
  impl.shared.push(detail::ReferenceItem{module, call, true});
}

bool Recorder::fails_before_reference(const std::string& module, std::uint32_t call) {
  Impl& impl = *impl_;
  std::lock_guard lock(impl.call_mutex);
  impl.require_step("ask whether " + module + " fails");
  impl.wait_handled();
  std::lock_guard shared(impl.shared.mutex);
  return impl.shared.failing_before_reference.count({module, call}) > 0;
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
  impl.shared.push(std::move(graph));
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
  impl.shared.push(std::move(module));
}

formats::PendingStep Recorder::finish_step() {
  Impl& impl = *impl_;
  std::lock_guard call(impl.call_mutex);
  impl.require_step("end a step");
  impl.shared.push(detail::EndItem{});
  std::exception_ptr error;
  formats::PendingStep pending;
  {
    std::unique_lock lock(impl.shared.mutex);
    impl.shared.caller_cv.wait(lock, [&] { return impl.shared.judged.has_value(); });
    error = std::exchange(impl.shared.step_error, nullptr);
    pending = std::move(*impl.shared.judged);
    impl.shared.judged.reset();
  }
  impl.in_step = false;
  impl.forget_judged();  // the step's pairs are judged: their tensors may go
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
  impl.wait_handled();
  std::lock_guard lock(impl.shared.mutex);
  return {impl.shared.failing.begin(), impl.shared.failing.end()};
}

const fs::path& Recorder::dump_dir() const { return impl_->dump_dir; }

std::size_t Recorder::held_bytes() const {
  std::lock_guard lock(impl_->shared.mutex);
  return impl_->shared.held_bytes;
}

std::size_t Recorder::queued_bytes() const {
  std::lock_guard lock(impl_->shared.mutex);
  return impl_->shared.queued_bytes;
}

}  // namespace dynaprobe::capture
