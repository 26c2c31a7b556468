// What a Recorder (recorder.h) is set up with, and the names its results use. Needs no torch
// headers: the recorder's background thread (judging in memory, writing step files) is compiled
// without them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/formats/writer.h"

namespace dynaprobe::capture {

// What a step keeps of the pairs it judges (PrecisionChecker(dump=...)).
enum class StoreMode {
  kFull,     // every tensor, and the metrics of every pair
  kFailing,  // metrics of every pair; tensors of the pairs that fail and of one-sided records
  kStats,    // metrics only (dtype and shape of every record)
};
// The word PrecisionChecker(dump=...) names each mode by, in enumerator order.
inline constexpr std::array<std::string_view, 3> kStoreModeWords = {"full", "failing", "stats"};

struct RecorderOptions {
  // Host bytes of snapshots waiting to be written. record() waits (the caller blocks) while the
  // queue holds more; nothing is dropped. A single tensor larger than the budget is still taken
  // once the queue is empty. The memory of written snapshots is kept for the next ones (up to a
  // quarter of the budget), so that snapshotting does not page-fault fresh memory in each step.
  std::size_t memory_budget_bytes = std::size_t{1} << 30;
  // The background thread (judging in memory, compression, writes) and the TBB workers it uses
  // run at a lower priority (niceness 10) than the training threads: on a machine whose cores
  // training keeps busy, capture fills the gaps instead of slowing it. writer.threads 0: the
  // step files are compressed and written by as many threads as training leaves cores free (the
  // cores TBB may use less torch's intra-op threads), at least one. More would only wait for
  // the disk, and TBB workers waiting for work spin: on a 2-core host training on both, a second
  // writer thread took 0.3 s of CPU per 124M-parameter step from training (docs/performance.md).
  formats::WriterOptions writer{.nice = 10};
  StoreMode store = StoreMode::kFull;
  // What a dump that cannot be written costs. true: the step is lost (Recorder's Errors). false:
  // only the file is: a step whose file cannot be written (no space, an I/O error, a folder
  // removed or made read-only) or a recorder that cannot write at all (its folder cannot be made,
  // or another writer holds the folder's lock, formats::DumpLock) is judged in memory as usual,
  // finish_step() gives it, and its PendingStep::wait_committed() throws why it was not stored.
  // Each step tries to write again, so a disk that has room again is written again.
  bool strict_io = true;
  // What the pairs are judged with in memory (Recorder). Given, the recorder writes its
  // provenance entries itself (analyze::judging_provenance: atol, rtol, tolerance_rules,
  // dtype_aware_tolerances), which the provenance it is given must then not hold; not given, it
  // judges with what the provenance names, as the engine reads a dump (analyze::dump_judging).
  std::optional<analyze::Judging> judging;
};

// A call of a module: (module path, call index).
using CallKey = std::pair<std::string, std::uint32_t>;

}  // namespace dynaprobe::capture
