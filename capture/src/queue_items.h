// What a Recorder's caller side queues for its background thread, in order: a step's begin, its
// records (each a snapshot of a tensor in host memory), graphs and module descriptions, its end.
// Torch-free: the snapshot's owner is type-erased (recorder.cpp makes it from an at::Tensor), so
// that the background thread's stages compile without torch headers. Private to capture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dynaprobe/formats/metrics.h"
#include "dynaprobe/formats/record.h"

namespace dynaprobe::capture::detail {

// Owns the host bytes a record's tensor view points to.
class HostSnapshot {
 public:
  virtual ~HostSnapshot() = default;
  // Returns once the bytes are valid: a device tensor's copy to the host has landed. Called on
  // the background thread before it reads them.
  virtual void wait_copied() = 0;
};

// A pair judged before its records came: on the caller's side (Recorder::judge_pair), or by the
// background thread from a JudgeItem (Recorder::judge_later), which fills it in before it takes
// any later item. Its metrics, for the pair whose sides are these very bytes, judged with these
// tolerances; with `reference`, each side against those bytes too.
struct JudgedPair {
  const void* eager = nullptr;
  const void* compiled = nullptr;
  const void* reference = nullptr;  // the reference the two comparisons below are against
  bool judged = false;              // false until the background thread has judged it
  formats::Tolerances tolerances;
  formats::TensorMetrics metrics;
  formats::TensorMetrics reference_eager, reference_compiled;
};

// A snapshot waiting for the writer. `snapshot` owns the bytes `record.tensor.data` points to;
// they are valid once snapshot->wait_copied() has returned. Copies share the snapshot.
struct RecordItem {
  formats::Record record;
  std::shared_ptr<HostSnapshot> snapshot;
  std::size_t bytes = 0;
  std::uint64_t batch = 0;  // the background thread's batch that took it from the queue
  // The pair judge_pair() judged this very tensor in, unchanged since, if any.
  std::shared_ptr<const JudgedPair> judged;
};
// A pair to judge now, ahead of its records (Recorder::judge_later): the background thread
// compares the views as the pair of `module`'s `kind` rows and fills in `pair`. The caller's
// side holds the tensors until the step ends. A view into a copy (a device tensor's, a strided
// one's) is valid once its snapshot in `copies` has landed.
struct JudgeItem {
  std::shared_ptr<JudgedPair> pair;
  std::string module;
  formats::Kind kind = formats::Kind::kParamGrad;
  formats::TensorView eager, compiled;
  std::optional<formats::TensorView> reference;
  std::vector<std::shared_ptr<HostSnapshot>> copies;
};
// Single-pass: a call whose reference is decided later (float32, when its backward has run).
// Until `settled`, its pairs other than parameter gradients wait for that reference, judged as
// soon as both sides are in (PairJudge::hold_for_reference); once settled, those still waiting
// are finished without one.
struct ReferenceItem {
  std::string module;
  std::uint32_t call = 0;
  bool settled = false;
};
struct BeginItem {
  std::int64_t step = 0;
};
struct EndItem {};
using Item = std::variant<BeginItem, RecordItem, JudgeItem, ReferenceItem, formats::Graph,
                          formats::ModuleInfo, EndItem>;

}  // namespace dynaprobe::capture::detail
