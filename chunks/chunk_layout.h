// Chunk layout: which tensor lives in which chunk group, at which offset.
//
// A model's tensors (in first-use order; module registration order until a trace exists) are
// packed greedily into chunk groups of a fixed capacity in elements. A tensor never straddles
// two chunks. Every group has one chunk per kind (low-precision params, fp32 master params,
// Adam m, Adam v, grads) and all kinds of a group use the same element offsets, so one layout
// serves all of them; a kind's chunk size in bytes is capacity * its element size.
// Offsets are aligned to kAlignElems elements so every tensor starts on a 128-byte boundary
// for fp32 (vector kernels) and a 64-byte boundary for 16-bit kinds.
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/units.h"

namespace tiermem::chunks {

enum class ChunkKind : uint8_t {
  kParamLowp = 0,   // bf16/fp16 compute copy (absent in fp32 training)
  kParamFp32 = 1,   // fp32 master params (the compute params in fp32 training)
  kExpAvg = 2,      // Adam m
  kExpAvgSq = 3,    // Adam v
  kGrad = 4,        // gradients (fp32)
};
inline constexpr int kNumChunkKinds = 5;
std::string_view ChunkKindName(ChunkKind kind);
Category ChunkKindCategory(ChunkKind kind);

inline constexpr uint64_t kAlignElems = 32;

struct Placement {
  uint32_t group = 0;   // index of the chunk group
  uint64_t offset = 0;  // element offset inside each chunk of the group
  uint64_t numel = 0;
};

struct ChunkLayout {
  uint64_t chunk_elems = 0;               // capacity of every chunk, in elements
  std::vector<Placement> placements;      // one per input tensor, same order
  std::vector<uint64_t> group_used_elems; // per group: end of its last tensor (aligned)
  uint64_t total_numel = 0;               // sum of tensor numels

  size_t num_groups() const { return group_used_elems.size(); }
  // Elements allocated but holding no tensor (chunk tails and alignment padding).
  uint64_t waste_elems() const { return num_groups() * chunk_elems - total_numel; }
};

// Packs `numels` (first-use order) into chunks of `chunk_elems` elements, every offset a
// multiple of `align_elems` (a multiple of kAlignElems: blockwise-quantized optimizer state
// aligns tensors to its block so no block straddles two). kInvalidArgument if chunk_elems is 0
// or smaller than the largest tensor (named by index), or a numel is 0.
StatusOr<ChunkLayout> PackTensors(const std::vector<uint64_t>& numels, uint64_t chunk_elems,
                                  uint64_t align_elems = kAlignElems);

struct ChunkSizeChoice {
  uint64_t chunk_elems = 0;
  uint64_t waste_elems = 0;
  size_t num_groups = 0;
};

// Chooses the chunk capacity with the least waste among candidates between the largest tensor
// and the largest size for which `min_resident_chunks` chunks of `device_bytes_per_elem` bytes
// per element fit in `device_budget` (ties: the smaller chunk). kResourceExhausted, naming the
// minimum device budget in bytes, when even a chunk holding just the largest tensor doesn't fit.
// Candidates are multiples of `align_elems`, and packed with that alignment.
StatusOr<ChunkSizeChoice> ChooseChunkElems(const std::vector<uint64_t>& numels,
                                           Bytes device_budget, Bytes device_bytes_per_elem,
                                           int min_resident_chunks,
                                           uint64_t align_elems = kAlignElems);

// The device budget below which ChooseChunkElems fails.
Bytes MinimumDeviceBudget(uint64_t max_numel, Bytes device_bytes_per_elem,
                          int min_resident_chunks);

}  // namespace tiermem::chunks
