#include "pair_judge.h"

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
}

void PairJudge::take(RecordItem item, std::vector<RecordItem>& store,
                     std::vector<RecordItem>& describe) {
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

void PairJudge::end_step(std::vector<RecordItem>& store, std::vector<RecordItem>& describe) {
  while (!pending_.empty()) finish(pending_.begin()->first, store, describe);
  order_.clear();
  spilled_.clear();
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

void PairJudge::spill_over_cap(std::vector<RecordItem>& store) {
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

}  // namespace dynaprobe::capture::detail
