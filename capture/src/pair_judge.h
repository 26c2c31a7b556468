// The background thread's judging in memory (see Recorder): holds each snapshot until its twin
// (and the call's reference, where it has one) arrives, compares the pair and each side against
// the reference with the engine's code (analyze/judging.h), judges the row with the engine's rule
// and says which tensors to store. Torch-free; private to capture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dynaprobe/analyze/judging.h"
#include "dynaprobe/capture/recorder_options.h"
#include "dynaprobe/formats/metrics.h"
#include "queue_items.h"

namespace dynaprobe::capture::detail {

// One step's pairs; not thread-safe (the background thread's alone).
class PairJudge {
 public:
  // Judges the pairs of a step whose `provenance` names its mode with `judging`, computing
  // metrics over chunks of `chunk_bytes` as the dump will store them, and holds at most
  // `hold_cap` bytes of snapshots waiting for their twin.
  PairJudge(analyze::Judging judging, const formats::Provenance& provenance, StoreMode mode,
            std::size_t chunk_bytes, std::size_t hold_cap);

  // Takes a record: into `store` (its tensor is written), `describe` (its index row only) or
  // held for its twin; a held record may go out later, with another record's call.
  void take(RecordItem item, std::vector<RecordItem>& store, std::vector<RecordItem>& describe);

  // Judges a pair ahead of its records (Recorder::judge_later), as judge() would judge its row,
  // and fills in its JudgedPair, which the records carry when they come.
  void judge_ahead(JudgeItem& item) const;

  // Single-pass, a call whose reference is decided later (Recorder::hold_for_reference): its
  // pairs other than parameter gradients wait for that reference. Each is judged as soon as both
  // sides are in, as judge() judges it without a reference (those metrics are reused when the
  // reference comes); a call with one that fails is said by take_failing_before_reference().
  void hold_for_reference(const std::string& module, std::uint32_t call);
  // The call's reference is decided (it came, or none will): its pairs still waiting for it are
  // finished without one.
  void settle_reference(const std::string& module, std::uint32_t call,
                        std::vector<RecordItem>& store, std::vector<RecordItem>& describe);

  // The step's end: records whose twin never came (single-pass fwd_input and grad_output are
  // recorded once and compared with themselves; others are one-sided rows).
  void end_step(std::vector<RecordItem>& store, std::vector<RecordItem>& describe);

  std::vector<formats::StoredMetrics> take_metrics() { return std::exchange(metrics_, {}); }
  // The calls with a pair found failing (or spilled, so not judged in memory) since the last
  // take, as (module, call).
  std::vector<CallKey> take_failing() { return std::exchange(failing_, {}); }
  // The calls held for a reference with a pair that fails without one (or was spilled), since
  // the last take.
  std::vector<CallKey> take_failing_before_reference() {
    return std::exchange(failing_before_reference_, {});
  }
  std::size_t held_bytes() const { return held_bytes_; }

 private:
  using PairKey = std::tuple<std::string, std::uint32_t, formats::Kind, std::uint32_t>;
  struct Slot {
    std::optional<RecordItem> eager, compiled, reference;
    bool listed = false;  // judge_held(): its eager and compiled records are handed on already
  };
  static PairKey pair_key(const formats::RecordKey& key) {
    return {key.module, key.call, key.kind, key.tensor_index};
  }

  // Whether a reference of this record's row is still to come: its call (its module, for a
  // parameter gradient, summed over calls) has sent a reference record before, or is held for
  // one (hold_for_reference).
  bool expects_reference(const formats::RecordKey& key) const;
  // A held call's pair with both sides in: judged now, without its reference, and its two
  // records handed on now, in the order records come (which orders the report's modules): to
  // `store` if it fails without the reference (StoreMode::kFailing), else to `describe`.
  void judge_held(const formats::RecordKey& key, Slot& slot, std::vector<RecordItem>& store,
                  std::vector<RecordItem>& describe);
  // Whether a pair with these metrics FAILs without a reference: outside its tolerances, or
  // (a float32 pair) beyond fp32 noise.
  bool fails_alone(const formats::RecordKey& key, const formats::TensorView& a,
                   const formats::TensorView& b, const formats::TensorMetrics& metrics) const;
  // The metrics of a pair with both sides, and (with its reference) of each side against it;
  // whether the row FAILs as the engine will judge it.
  bool judge(const RecordItem& eager, const RecordItem& compiled, const RecordItem* reference);
  // Judges pending pair `pair` (or its one record) and hands its records on.
  void finish(const PairKey& pair, std::vector<RecordItem>& store,
              std::vector<RecordItem>& describe);
  // Holds at most hold_cap_ bytes: the oldest waiting records are stored whole, and their twins
  // follow them when they come (the pair is then compared from the dump); a held call's pair
  // judged already (judge_held) is finished without its reference instead.
  void spill_over_cap(std::vector<RecordItem>& store, std::vector<RecordItem>& describe);

  analyze::Judging judging_;
  StoreMode mode_;
  std::size_t chunk_bytes_;
  std::size_t hold_cap_;
  bool single_pass_ = false;
  bool active_ = false;       // the step holds both sides
  double cast_roundoff_ = 0;  // the unit roundoff of the capture's cast_dtype, if any
  std::set<std::pair<std::string, std::uint32_t>> referenced_calls_;
  std::set<std::string> referenced_modules_;
  std::set<CallKey> held_calls_;  // hold_for_reference(), not yet settled
  std::vector<CallKey> failing_before_reference_;
  std::map<PairKey, Slot> pending_;
  std::deque<PairKey> order_;  // when each record came, for spilling the oldest first
  std::set<PairKey> spilled_;
  std::size_t held_bytes_ = 0;
  std::vector<formats::StoredMetrics> metrics_;
  std::vector<CallKey> failing_;
};

}  // namespace dynaprobe::capture::detail
