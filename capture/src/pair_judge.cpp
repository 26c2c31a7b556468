#include "pair_judge.h"

#include <algorithm>

#include "dynaprobe/formats/vocabulary.h"

namespace dynaprobe::capture::detail {

PairJudge::PairJudge(analyze::Judging judging, const formats::Provenance& provenance,
                     StoreMode mode, std::size_t chunk_bytes, std::size_t hold_cap)
    : judging_(std::move(judging)), mode_(mode), chunk_bytes_(chunk_bytes), hold_cap_(hold_cap) {
  namespace vocabulary = formats::vocabulary;
  const std::string capture_mode =
      formats::provenance_value(provenance, vocabulary::provenance::kMode);
  single_pass_ = capture_mode == vocabulary::mode::kSinglePass;
  active_ = single_pass_ || capture_mode == vocabulary::mode::kTwoPass;
  cast_roundoff_ = analyze::unit_roundoff_of_name(
      formats::provenance_value(provenance, vocabulary::provenance::kCastDtype));
}

bool PairJudge::expects_reference(const formats::RecordKey& key) const {
  if (key.kind == formats::Kind::kParamGrad) return referenced_modules_.count(key.module) > 0;
  const CallKey call{key.module, key.call};
  return referenced_calls_.count(call) > 0 || held_calls_.count(call) > 0;
}

bool PairJudge::fails_alone(const formats::RecordKey& key, const formats::TensorView& a,
                            const formats::TensorView& b,
                            const formats::TensorMetrics& metrics) const {
  return !metrics.allclose ||
         judging_.beyond_screen(key.module, key.kind, a.dtype, b.dtype, metrics);
}

void PairJudge::hold_for_reference(const std::string& module, std::uint32_t call) {
  if (active_) held_calls_.emplace(module, call);
}

void PairJudge::settle_reference(const std::string& module, std::uint32_t call,
                                 std::vector<RecordItem>& store,
                                 std::vector<RecordItem>& describe) {
  if (held_calls_.erase({module, call}) == 0) return;
  std::vector<PairKey> settled;
  for (const auto& [pair, slot] : pending_) {
    if (std::get<0>(pair) == module && std::get<1>(pair) == call && slot.eager && slot.compiled &&
        !slot.reference) {
      settled.push_back(pair);
    }
  }
  for (const PairKey& pair : settled) finish(pair, store, describe);
}

void PairJudge::judge_held(const formats::RecordKey& key, Slot& slot,
                           std::vector<RecordItem>& store, std::vector<RecordItem>& describe) {
  const formats::TensorView& a = slot.eager->record.tensor;
  const formats::TensorView& b = slot.compiled->record.tensor;
  bool fails = a.shape != b.shape;
  if (!fails) {
    auto pair = std::make_shared<JudgedPair>();
    pair->eager = a.data;
    pair->compiled = b.data;
    pair->tolerances = judging_.row_tolerances(key.module, key.kind, a.dtype, b.dtype);
    pair->metrics = analyze::compare_in_memory(a, b, pair->tolerances, chunk_bytes_);
    pair->judged = true;
    fails = fails_alone(key, a, b, pair->metrics);
    slot.eager->judged = slot.compiled->judged = std::move(pair);
  }
  if (fails) failing_before_reference_.emplace_back(key.module, key.call);
  slot.listed = true;
  if (mode_ == StoreMode::kFull) return;  // stored when they came
  const bool store_them = mode_ == StoreMode::kFailing && fails;
  for (const RecordItem* side : {&*slot.eager, &*slot.compiled}) {
    (store_them ? store : describe).push_back(*side);
  }
}

void PairJudge::take(RecordItem item, std::vector<RecordItem>& store,
                     std::vector<RecordItem>& describe) {
  const formats::RecordKey& key = item.record.key;
  if (!active_ || key.kind == formats::Kind::kLoss || !formats::is_compared(key.kind) ||
      spilled_.count(pair_key(key))) {
    store.push_back(std::move(item));
    return;
  }
  if (key.side == formats::Side::kReference) {
    referenced_calls_.emplace(key.module, key.call);
    referenced_modules_.insert(key.module);
  }
  if (mode_ == StoreMode::kFull) store.push_back(item);
  const PairKey pair = pair_key(key);
  const bool waits_for_reference = expects_reference(key);
  const bool held = held_calls_.count({key.module, key.call}) > 0;
  Slot& slot = pending_[pair];
  held_bytes_ += item.bytes;
  const formats::Side side = key.side;
  (side == formats::Side::kEager      ? slot.eager
   : side == formats::Side::kCompiled ? slot.compiled
                                      : slot.reference) = std::move(item);
  order_.push_back(pair);
  if (slot.eager && slot.compiled && (slot.reference || !waits_for_reference)) {
    finish(pair, store, describe);
  } else if (slot.eager && slot.compiled && held) {
    judge_held(slot.compiled->record.key, slot, store, describe);
  }
  spill_over_cap(store, describe);
}

void PairJudge::end_step(std::vector<RecordItem>& store, std::vector<RecordItem>& describe) {
  while (!pending_.empty()) finish(pending_.begin()->first, store, describe);
  order_.clear();
  spilled_.clear();
  held_calls_.clear();
  referenced_calls_.clear();
  referenced_modules_.clear();
}

void PairJudge::judge_ahead(JudgeItem& item) const {
  JudgedPair& pair = *item.pair;
  const formats::TensorView& a = item.eager;
  const formats::TensorView& b = item.compiled;
  if (a.shape != b.shape) return;  // judged as a shape mismatch when the records come
  pair.tolerances = judging_.row_tolerances(item.module, item.kind, a.dtype, b.dtype);
  if (item.reference && item.reference->shape == a.shape) {
    const analyze::ReferenceComparisons compared = analyze::compare_with_reference_in_memory(
        a, b, *item.reference, pair.tolerances, chunk_bytes_);
    pair.metrics = compared.pair;
    pair.reference_eager = compared.reference_eager;
    pair.reference_compiled = compared.reference_compiled;
    pair.reference = item.reference->data;
  } else {
    pair.metrics = analyze::compare_in_memory(a, b, pair.tolerances, chunk_bytes_);
  }
  pair.judged = true;
}

bool PairJudge::judge(const RecordItem& eager, const RecordItem& compiled,
                      const RecordItem* reference) {
  const formats::TensorView& a = eager.record.tensor;
  const formats::TensorView& b = compiled.record.tensor;
  formats::StoredMetrics row;
  row.key = compiled.record.key;
  row.tolerances = judging_.row_tolerances(row.key.module, row.key.kind, a.dtype, b.dtype);
  // A pair judged already (Recorder::judge_pair, judge_ahead), these very bytes with these
  // tolerances and the same chunks: the same metrics, not computed twice.
  const auto& early = compiled.judged;
  const bool judged_before = early && early == eager.judged && early->judged &&
                             early->eager == a.data && early->compiled == b.data &&
                             early->tolerances.atol == row.tolerances.atol &&
                             early->tolerances.rtol == row.tolerances.rtol;
  // Each side against the reference (reference = a), as the engine's reference tasks compute
  // them (the verdict's metrics, MetricSet::kVerdict): stored under the eager record's key and
  // the reference record's. The three comparisons go together, each tensor read once.
  const bool referenced =
      reference && &eager != &compiled && reference->record.tensor.shape == a.shape;
  bool fails = false;
  if (referenced) {
    const bool reference_judged_before =
        judged_before && early->reference == reference->record.tensor.data;
    const analyze::ReferenceComparisons compared =
        reference_judged_before
            ? analyze::ReferenceComparisons{early->metrics, early->reference_eager,
                                            early->reference_compiled}
            : analyze::compare_with_reference_in_memory(
                  a, b, reference->record.tensor, row.tolerances, chunk_bytes_, !judged_before);
    row.metrics = judged_before ? early->metrics : compared.pair;
    fails = !row.metrics.allclose;
    formats::StoredMetrics against_eager{eager.record.key, row.tolerances,
                                         compared.reference_eager};
    formats::StoredMetrics against_compiled{reference->record.key, row.tolerances,
                                            compared.reference_compiled};
    const double roundoff = std::max(
        {analyze::unit_roundoff(a.dtype), analyze::unit_roundoff(b.dtype), cast_roundoff_});
    const analyze::NoiseMeasure measure = analyze::measure_noise(
        against_eager.metrics, against_compiled.metrics, roundoff, judging_.tolerances.atol);
    if (judging_.reference_decides) fails = measure.divergence;
    metrics_.push_back(std::move(against_eager));
    metrics_.push_back(std::move(against_compiled));
  } else {
    row.metrics = judged_before ? early->metrics
                                : analyze::compare_in_memory(a, b, row.tolerances, chunk_bytes_);
    fails = fails_alone(row.key, a, b, row.metrics);
  }
  metrics_.push_back(std::move(row));
  return fails;
}

void PairJudge::finish(const PairKey& pair, std::vector<RecordItem>& store,
                       std::vector<RecordItem>& describe) {
  auto found = pending_.find(pair);
  Slot slot = std::move(found->second);
  pending_.erase(found);
  const RecordItem* eager = slot.eager ? &*slot.eager : nullptr;
  const RecordItem* compiled = slot.compiled ? &*slot.compiled : nullptr;
  if (!eager || !compiled) {
    const RecordItem* only = eager ? eager : compiled;
    if (only && analyze::recorded_once(only->record.key.kind, single_pass_))
      eager = compiled = only;
  }
  bool keep_tensors = true;  // a one-sided row, a shape mismatch or a failing pair
  if (eager && compiled && eager->record.tensor.shape == compiled->record.tensor.shape) {
    keep_tensors = judge(*eager, *compiled, slot.reference ? &*slot.reference : nullptr);
  }
  if (keep_tensors && eager && compiled)
    failing_.emplace_back(std::get<0>(pair), std::get<1>(pair));
  for (std::optional<RecordItem>* side : {&slot.eager, &slot.compiled, &slot.reference}) {
    if (!*side) continue;
    held_bytes_ -= (*side)->bytes;
    if (mode_ == StoreMode::kFull) continue;               // stored when it came
    if (slot.listed && side != &slot.reference) continue;  // handed on by judge_held()
    const bool store_it = mode_ == StoreMode::kFailing && keep_tensors;
    (store_it ? store : describe).push_back(std::move(**side));
  }
}

void PairJudge::spill_over_cap(std::vector<RecordItem>& store, std::vector<RecordItem>& describe) {
  while (held_bytes_ > hold_cap_ && !order_.empty()) {
    const PairKey pair = order_.front();
    order_.pop_front();
    auto found = pending_.find(pair);
    if (found == pending_.end()) continue;
    if (found->second.listed) {  // judged and handed on already: finished without its reference
      finish(pair, store, describe);
      continue;
    }
    for (std::optional<RecordItem>* side :
         {&found->second.eager, &found->second.compiled, &found->second.reference}) {
      if (!*side) continue;
      held_bytes_ -= (*side)->bytes;
      if (mode_ != StoreMode::kFull) store.push_back(std::move(**side));
    }
    pending_.erase(found);
    spilled_.insert(pair);
    failing_.emplace_back(std::get<0>(pair), std::get<1>(pair));  // judged later, from the dump
    if (held_calls_.count({std::get<0>(pair), std::get<1>(pair)}) > 0)
      failing_before_reference_.emplace_back(std::get<0>(pair), std::get<1>(pair));
  }
}

}  // namespace dynaprobe::capture::detail
