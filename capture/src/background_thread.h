// A Recorder's background thread: what it shares with the recorder's callers, and its body, as
// named stages over explicit step states (background_thread.cpp). Torch-free; private to capture.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/capture/recorder_options.h"
#include "dynaprobe/formats/reader.h"
#include "queue_items.h"

namespace dynaprobe::capture::detail {

// What a recorder's callers and its background thread share, under `mutex`.
struct SharedState {
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
  // Calls of the current step whose pairs, held for a reference, fail without one
  // (PairJudge::take_failing_before_reference).
  std::set<CallKey> failing_before_reference;
  // The current step once the background thread has judged its EndItem.
  std::optional<formats::PendingStep> judged;
  bool stopping = false;  // the recorder is going: stop, writing only the steps already ended

  // Queues `item` and wakes the background thread.
  void push(Item item);
};

// What the background thread knows of its recorder.
struct BackgroundConfig {
  std::filesystem::path dump_dir;
  formats::Provenance provenance;
  analyze::Judging judging;  // what the pairs are judged with in memory
  RecorderOptions options;   // writer.threads and writer.create_folder as the recorder set them
  // Why nothing can be written (the folder cannot be made, its lock is held): strict_io false.
  std::exception_ptr storage_error;
};

// The background thread's body. Its judging stage turns queue items into verdicts (PairJudge) and
// write operations, batching consecutive records so that StepWriter::write compresses many
// tensors in parallel; its writing stage owns the StepWriter and carries the operations out in
// order. It judges whatever is queued before it writes anything more, so that finish_step()
// returns once a step is judged while the step's last tensors (the parameter gradients) are still
// being written. Returns once `shared.stopping` is set, having written and committed the steps
// the caller ended.
void run_background(SharedState& shared, const BackgroundConfig& config);

}  // namespace dynaprobe::capture::detail
