// Tensor states and their per-chunk roll-up.
//
// Each tensor of a layout is in one state: FREE (its chunk bytes are not needed now), COMPUTE
// (an operator is using it: its chunk must stay where it is), HOLD (kept, movable),
// HOLD_AFTER_FWD / HOLD_AFTER_BWD (kept after the forward / backward of its module, movable).
// Each chunk group keeps one counter per state, updated on every transition, so the questions
// the engine asks — "may this chunk move?" (no COMPUTE tensor) and "is it unused?" (all
// FREE) — are O(1). A chunk group also carries a clean/dirty bit per kind (dirty = modified
// since it last matched its copy on the lower tier).
//
// Thread-safety: externally synchronized (the integration's thread).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "chunks/chunk_layout.h"
#include "runtime/base/status.h"

namespace tiermem::chunks {

enum class TensorState : uint8_t {
  kFree = 0,
  kCompute = 1,
  kHold = 2,
  kHoldAfterFwd = 3,
  kHoldAfterBwd = 4,
};
inline constexpr int kNumTensorStates = 5;
std::string_view TensorStateName(TensorState s);

class TensorStates {
 public:
  // All tensors start FREE; all chunks clean.
  explicit TensorStates(const ChunkLayout& layout);

  TensorState state(size_t tensor) const { return states_[tensor]; }
  // Sets tensor's state; returns the previous one. kOutOfRange for an unknown tensor.
  StatusOr<TensorState> Set(size_t tensor, TensorState s);

  uint64_t Count(uint32_t group, TensorState s) const {
    return counts_[group][static_cast<int>(s)];
  }
  // No tensor of the group is in COMPUTE.
  bool Movable(uint32_t group) const { return Count(group, TensorState::kCompute) == 0; }
  // Every tensor of the group is FREE.
  bool AllFree(uint32_t group) const { return Count(group, TensorState::kFree) == sizes_[group]; }

  bool dirty(uint32_t group, ChunkKind k) const { return dirty_[group][static_cast<int>(k)]; }
  void set_dirty(uint32_t group, ChunkKind k, bool d) { dirty_[group][static_cast<int>(k)] = d; }

  size_t num_tensors() const { return states_.size(); }
  size_t num_groups() const { return counts_.size(); }

 private:
  std::vector<uint32_t> group_of_;  // tensor -> group
  std::vector<TensorState> states_;
  std::vector<uint64_t> sizes_;     // tensors per group
  std::vector<std::array<uint64_t, kNumTensorStates>> counts_;
  std::vector<std::array<bool, kNumChunkKinds>> dirty_;
};

}  // namespace tiermem::chunks
