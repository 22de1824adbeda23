// Invariant: for every group g, sum over states of counts_[g] == sizes_[g], and
// counts_[g][s] == |{t in g : states_[t] == s}|. Set() is the only mutator of states_.
#include "chunks/tensor_states.h"

namespace tiermem::chunks {

std::string_view TensorStateName(TensorState s) {
  switch (s) {
    case TensorState::kFree: return "FREE";
    case TensorState::kCompute: return "COMPUTE";
    case TensorState::kHold: return "HOLD";
    case TensorState::kHoldAfterFwd: return "HOLD_AFTER_FWD";
    case TensorState::kHoldAfterBwd: return "HOLD_AFTER_BWD";
  }
  return "UNKNOWN";
}

TensorStates::TensorStates(const ChunkLayout& layout)
    : states_(layout.placements.size(), TensorState::kFree),
      sizes_(layout.num_groups(), 0),
      counts_(layout.num_groups()),
      dirty_(layout.num_groups()) {
  group_of_.reserve(layout.placements.size());
  for (const Placement& p : layout.placements) {
    group_of_.push_back(p.group);
    ++sizes_[p.group];
  }
  for (size_t g = 0; g < counts_.size(); ++g) {
    counts_[g].fill(0);
    counts_[g][static_cast<int>(TensorState::kFree)] = sizes_[g];
    dirty_[g].fill(false);
  }
}

StatusOr<TensorState> TensorStates::Set(size_t tensor, TensorState s) {
  if (tensor >= states_.size()) {
    return OutOfRangeError("tensor " + std::to_string(tensor) + " of " +
                           std::to_string(states_.size()));
  }
  const TensorState old = states_[tensor];
  const uint32_t g = group_of_[tensor];
  --counts_[g][static_cast<int>(old)];
  ++counts_[g][static_cast<int>(s)];
  states_[tensor] = s;
  return old;
}

}  // namespace tiermem::chunks
