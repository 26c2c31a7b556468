// The capture library: records at::Tensors into a dump. On the caller's (training) thread it only
// snapshots each tensor into host memory; compression and HDF5 writes run on a background thread
// through formats::StepWriter, under a host-memory budget with back-pressure.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dynaprobe/capture/recorder_options.h"
#include "dynaprobe/formats/metrics.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/record.h"
#include "dynaprobe/formats/writer.h"

namespace dynaprobe::capture {

// StoreMode, RecorderOptions and CallKey are in recorder_options.h.

// formats::DType of a tensor's dtype; throws UsageError for dtypes a dump cannot hold.
formats::DType dtype_of(const at::Tensor& tensor);
// `tensor`'s values as a contiguous strided CPU tensor without conjugate or negative bits: itself
// (detached) when it already is one, else a copy.
at::Tensor host_values(const at::Tensor& tensor);
// A view of the values of such a tensor (host_values), valid while the tensor lives.
formats::TensorView view_of(const at::Tensor& tensor);

// Judging in memory: when a step holds both sides (provenance mode single-pass or two-pass), the
// background thread pairs each eager record with its compiled twin as they arrive, computes
// their metrics from the snapshots with RecorderOptions::judging or else the tolerances the
// provenance names (the engine's own code, analyze/judging.h: the same bits a comparison of the
// stored tensors gives) and writes them to the step's /metrics, so that comparing the step reads
// no tensor. StoreMode decides which tensors are stored as well. Snapshots waiting for their twin
// are held within half the memory budget; beyond it the oldest are stored whole (also under
// kStats) and their pairs compared from the dump. The loss and the fp64 reference's records are
// always stored whole.
//
// One recorder per dump (one process, one rank): steps are begun and ended in order.
// Thread-safety: the methods may be called from any thread; calls from several threads take turns
// (each call holds the recorder for its duration, record() also while it waits for the budget).
// queued_bytes() and dump_dir() never wait.
//
// Errors: the background thread stores the first error of a step (IoError for disk full, ...).
// While the step is open, the next record(), record_graph() or record_module() throws it once and
// finish_step() / end_step() throw it (again); the step's file is removed and its remaining items
// are dropped without being copied. An error once the step is ended (its last writes, the commit)
// is thrown by its PendingStep::wait_committed() (and end_step()). Earlier steps are intact and
// the next begin_step() works normally. An error creating the step file (begin_step) surfaces
// the same way, as begin_step() itself does not wait for the file. With strict_io false, write
// errors only lose the file (RecorderOptions::strict_io).
//
// One writer per folder: the recorder holds the folder's formats::DumpLock while it lives.
class Recorder {
 public:
  // `dump_dir` is created if needed; step files go there (formats::StepWriter). Throws IoError
  // when it cannot be made, DumpBusyError when another writer holds its lock (with strict_io
  // false: the recorder judges in memory and writes nothing). Throws UsageError for a provenance
  // key the format reserves or options.judging writes, or a tolerance not >= 0; FormatError for
  // a damaged tolerance in `provenance` without options.judging.
  Recorder(std::filesystem::path dump_dir, formats::Provenance provenance,
           RecorderOptions options = {});
  // Writes and commits the steps already ended; a step begun but not ended is discarded (its
  // queued snapshots dropped, its partial file removed). Never throws: a write error is left to
  // the ended step's PendingStep::wait_committed().
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // Starts a step; records until end_step() go into its file. Throws UsageError while a step is
  // open (end_step() closes a step even when it throws).
  void begin_step(std::int64_t step);
  // Snapshots `tensor` (any dtype, device, layout, view; complex as complex) into
  // contiguous host memory and queues it; `tensor` may change as soon as record() returns.
  // key.step is set to the current step. Waits while the queued snapshots plus this one would
  // exceed memory_budget_bytes. Throws an error the background thread met earlier (disk full,
  // ...), UsageError outside a step, for a key recorded twice in a step, a bad module path, a
  // dtype a dump cannot hold or a tensor without host-copyable data (meta, tensor subclasses
  // with __torch_dispatch__). Once the step is lost, returns without copying.
  //
  // `handed_over`: the caller gives `tensor` up, it is a private copy that nobody changes or
  // reuses afterwards (e.g. summed gradients): a contiguous CPU tensor is then kept as it is,
  // without a snapshot copy (its memory counts against the budget the same way).
  void record(formats::RecordKey key, const at::Tensor& tensor, std::string label = {},
              bool handed_over = false);
  // A private contiguous copy of `tensor` to hand over later (record() with handed_over): a CPU
  // tensor is copied into the recorder's recycled snapshot memory (no fresh pages to fault in,
  // step after step), a device tensor is cloned on its device. Needs no step.
  at::Tensor copy(const at::Tensor& tensor);
  // The metrics of a pair (every one, over the chunks the dump stores, as the background thread
  // judges a pair with `tolerances`). A pair judge_later() queued, both tensors unchanged since,
  // is taken from the background thread once it has judged it (waiting for it) when judged with
  // the same tolerances; any other is computed now on the caller's thread. When both tensors
  // are then recorded unchanged (handed_over, each kept as it is) as the two sides of one pair
  // judged with the same tolerances, the background thread takes these metrics instead of
  // comparing the pair again: a float32 call's late-reference decision judges its parameters'
  // gradient sums, which collect() records (docs/performance.md). Holds both tensors until the
  // step ends, so that no other tensor takes their memory. Throws UsageError outside a step.
  formats::TensorMetrics judge_pair(const at::Tensor& eager, const at::Tensor& compiled,
                                    const formats::Tolerances& tolerances);
  // Has the background thread judge the pair of `module`'s parameter gradient `eager` and
  // `compiled` (with `reference`, if defined, each side against it too) ahead of its records,
  // as it would judge their row, and returns at once. When the three are then recorded
  // unchanged (handed_over, kept as they are) as one row, the background thread takes those
  // metrics instead of comparing them again: single-pass judges a module's parameter gradient
  // sums once its backward is done, while training goes on, not at collect(). Holds the
  // tensors until the step ends; a side it cannot keep as it is (a device tensor, a strided one)
  // is judged in a copy taken now (a device's asynchronously, as record() takes it), which its
  // record then reuses, within a quarter of the memory budget a step (past it, and for a pair
  // judge_pair() judged already, nothing is done). Throws UsageError outside a step.
  void judge_later(const std::string& module, const at::Tensor& eager, const at::Tensor& compiled,
                   const at::Tensor& reference);
  // Single-pass, a call whose reference is decided after its records (float32: once its
  // backward has run, from its outputs' and gradients' verdicts): until settle_reference(), the
  // pairs of `module`'s call `call` other than parameter gradients wait for that reference, each
  // judged on the background thread as soon as both sides are in; fails_before_reference() says
  // whether one fails without it. Call it before the call's first record; settle it once the
  // reference has been recorded, or when none will be (pairs still waiting are then judged
  // without one). Throws UsageError outside a step.
  void hold_for_reference(const std::string& module, std::uint32_t call);
  void settle_reference(const std::string& module, std::uint32_t call);
  // Whether a pair of a call held for its reference, queued so far, fails its tolerances or the
  // screen without the reference (or was held beyond half the budget), as the report would judge
  // it without one. Waits until the background thread has judged every record queued before.
  // Throws UsageError outside a step.
  bool fails_before_reference(const std::string& module, std::uint32_t call);
  // Queue a graph / a module description, written in call order with the records. Names are
  // checked here (UsageError for a bad or repeated name), the rest by the background thread.
  void record_graph(formats::Graph graph);
  void record_module(formats::ModuleInfo module);
  // Ends the step once the background thread has judged every record, without waiting for the
  // disk: returns the step as judged (for analyze::compare_pending) while the background thread
  // goes on writing it and commits it. Its wait_committed() waits for the commit and rethrows a
  // write error (the step is then lost, its partial file removed). The next step may begin
  // meanwhile: its records queue behind the writes, within the memory budget. Rethrows a
  // background error met while the step was open (the step is then lost, earlier steps intact).
  formats::PendingStep finish_step();
  // finish_step(), then waits for the commit; returns the step's file.
  std::filesystem::path end_step();

  // The calls of the current step with a pair judged in memory that fails its tolerances (not
  // allclose, or shapes that differ), as the report will judge it; also calls with a pair held
  // beyond half the budget (spilled, compared from the dump later). Waits until the background
  // thread has judged every record queued before (not until they are written). Pairs whose twin
  // has not come yet are not counted. Throws UsageError outside a step; once the step is lost,
  // returns what was judged before.
  std::vector<CallKey> failing_calls();

  const std::filesystem::path& dump_dir() const;
  std::size_t queued_bytes() const;  // snapshots not yet written or judged
  std::size_t held_bytes() const;    // snapshots waiting for their twin

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dynaprobe::capture
