// Chunk layout: which tensor lives in which chunk group, at which offset.
//
// A model's tensors (in first-use order; module registration order until a trace exists) are
// packed greedily into chunk groups of a fixed capacity in elements. A tensor that fits in a
// chunk never straddles two; a larger one is split into *pieces* of whole rows of its first
// dimension (PackPieces), each in one chunk. Tensors of an *expert set* (the experts of one
// mixture-of-experts layer: fused tensors whose first dimension indexes the experts, or
// per-expert tensors) are packed expert by expert: one expert's slices of every tensor of the
// set, contiguous, never straddling chunks when they fit in one. Every group has one chunk per kind
// (low-precision params, fp32 master params, Adam m, Adam v, grads) and all kinds of a group use
// the same element offsets, so one layout serves all of them; a kind's chunk size in bytes is
// capacity * its element size. Offsets are aligned to kAlignElems elements so every tensor starts
// on a 128-byte boundary for fp32 (vector kernels) and a 64-byte boundary for 16-bit kinds.
//
// The session lays out a model with it (runtime/session.cc), and the planners' synthetic model
// traces (planners/model_traces.cc) do too, so a synthetic trace has the chunks a session makes.
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
  kParamLowp = 0,  // bf16/fp16 compute copy (absent in fp32 training)
  kParamFp32 = 1,  // fp32 master params (the compute params in fp32 training)
  kExpAvg = 2,     // Adam m
  kExpAvgSq = 3,   // Adam v
  kGrad = 4,       // gradients (in the compute dtype: bf16/fp16 in mixed precision, else fp32)
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
  uint64_t chunk_elems = 0;                // capacity of every chunk, in elements
  std::vector<Placement> placements;       // one per input tensor, same order
  std::vector<uint64_t> group_used_elems;  // per group: end of its last tensor (aligned)
  uint64_t total_numel = 0;                // sum of tensor numels

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
StatusOr<ChunkSizeChoice> ChooseChunkElems(const std::vector<uint64_t>& numels, Bytes device_budget,
                                           Bytes device_bytes_per_elem, int min_resident_chunks,
                                           uint64_t align_elems = kAlignElems);

// The device budget below which ChooseChunkElems fails.
Bytes MinimumDeviceBudget(uint64_t max_numel, Bytes device_bytes_per_elem, int min_resident_chunks);

// ---- pieces: tensors larger than a chunk, expert sets ------------------------------------

// A tensor as PackPieces sees it.
struct PackTensor {
  uint64_t numel = 0;
  uint64_t rows = 1;    // its first dimension: a piece is whole rows (numel % rows == 0)
  int expert_set = -1;  // >= 0: a tensor of that expert set
  int expert = -1;      // in a set: -1 = fused (row e is expert e's), >= 0 = all of it is
                        // that expert's (a ModuleList of expert modules)
  uint64_t row_elems() const { return rows == 0 ? numel : numel / rows; }
};

// Elements [begin, begin + numel) of a tensor (row-major, whole rows) at `offset` in every
// chunk of group `group`.
struct Piece {
  uint32_t group = 0;
  uint64_t offset = 0;
  uint64_t numel = 0;
  uint64_t begin = 0;
  int expert = -1;  // the expert these elements belong to (expert-set tensors), else -1
};

struct PieceLayout {
  uint64_t chunk_elems = 0;
  std::vector<std::vector<Piece>> pieces;  // per input tensor, in element order, covering it
  std::vector<uint64_t> group_used_elems;  // per group: end of its last piece (aligned)
  uint64_t total_numel = 0;

  size_t num_groups() const { return group_used_elems.size(); }
  uint64_t waste_elems() const { return num_groups() * chunk_elems - total_numel; }
};

// Packs `tensors` (first-use order) into chunks of `chunk_elems` elements, in order; a tensor
// that fits in a chunk is placed whole (a new chunk when the current one's rest is too
// small), a larger one as pieces of as many whole rows as fit (filling the current chunk's
// rest first). An expert set is placed where its first tensor comes: for e = 0..E-1, expert
// e's item — row e of each fused tensor and every tensor of expert e, in input order — in
// chunks of its own (starting a new chunk, and nothing else placed in its last one): one
// contiguous run when it fits in a chunk, else piece by piece. kInvalidArgument: chunk_elems 0, a
// tensor of 0 elements or whose rows do not divide it, a row larger than the chunk (named by
// index), an inconsistent expert set (fused tensors with different expert counts, an expert index
// outside them). Every piece starts at a multiple of `align_elems` (a multiple of kAlignElems, as
// PackTensors).
StatusOr<PieceLayout> PackPieces(const std::vector<PackTensor>& tensors, uint64_t chunk_elems,
                                 uint64_t align_elems = kAlignElems);

// Elements of the largest expert item (one expert's slices of its set, aligned), 0 without
// expert sets; kInvalidArgument for an inconsistent set (as PackPieces).
StatusOr<uint64_t> LargestExpertItem(const std::vector<PackTensor>& tensors);

// The chunk capacity for `tensors` and the device working set (`min_resident_chunks` chunks of
// `device_bytes_per_elem` bytes per element within `device_budget`):
//   - with expert sets: one expert per chunk — the largest expert item (at least the largest
//     row), or the largest that fits the budget when that is smaller;
//   - else, when a chunk can hold the largest tensor: the least waste between it and the
//     budget's limit (as the numel overload; nothing is split);
//   - else: the least waste between half the limit (at least the largest row) and the limit;
//     larger tensors are split.
// kResourceExhausted, naming the minimum device budget in bytes and the largest piece (the
// largest row of any tensor), when even a chunk of that piece does not fit. The chunk capacity
// is a multiple of `align_elems` and the pieces are packed with that alignment.
StatusOr<ChunkSizeChoice> ChooseChunkElems(const std::vector<PackTensor>& tensors,
                                           Bytes device_budget, Bytes device_bytes_per_elem,
                                           int min_resident_chunks,
                                           uint64_t align_elems = kAlignElems);

}  // namespace tiermem::chunks
