// Packing is greedy first-fit-in-order (the next tensor goes into the current chunk if it fits
// after alignment, else opens a new chunk): order is preserved, so a module's tensors stay in
// as few chunks as possible and a forward pass walks the chunks in order. The automatic size
// search evaluates this packing at up to kCandidates capacities between the largest tensor
// and the device-budget limit (linearly spaced, plus the exact ends) and keeps the least waste.
#include "chunks/chunk_layout.h"

#include <algorithm>

namespace tiermem::chunks {

std::string_view ChunkKindName(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParamLowp: return "param_lowp";
    case ChunkKind::kParamFp32: return "param_fp32";
    case ChunkKind::kExpAvg: return "exp_avg";
    case ChunkKind::kExpAvgSq: return "exp_avg_sq";
    case ChunkKind::kGrad: return "grad";
  }
  return "unknown";
}

Category ChunkKindCategory(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParamLowp:
    case ChunkKind::kParamFp32: return Category::kParam;
    case ChunkKind::kGrad: return Category::kGrad;
    case ChunkKind::kExpAvg:
    case ChunkKind::kExpAvgSq: return Category::kOptimState;
  }
  return Category::kOther;
}

StatusOr<ChunkLayout> PackTensors(const std::vector<uint64_t>& numels, uint64_t chunk_elems,
                                  uint64_t align_elems) {
  if (chunk_elems == 0) return InvalidArgumentError("chunk size must be > 0 elements");
  if (align_elems == 0 || align_elems % kAlignElems != 0) {
    return InvalidArgumentError("tensor alignment of " + std::to_string(align_elems) +
                                " elements is not a multiple of " + std::to_string(kAlignElems));
  }
  ChunkLayout layout;
  layout.chunk_elems = chunk_elems;
  layout.placements.reserve(numels.size());
  for (size_t i = 0; i < numels.size(); ++i) {
    const uint64_t n = numels[i];
    if (n == 0) return InvalidArgumentError("tensor " + std::to_string(i) + " has 0 elements");
    if (n > chunk_elems) {
      return InvalidArgumentError("tensor " + std::to_string(i) + " has " + std::to_string(n) +
                                  " elements, more than the chunk size of " +
                                  std::to_string(chunk_elems) + " elements");
    }
    uint64_t start = layout.group_used_elems.empty()
                         ? chunk_elems  // forces a first group
                         : AlignUp(layout.group_used_elems.back(), align_elems);
    if (start + n > chunk_elems) {
      layout.group_used_elems.push_back(0);
      start = 0;
    }
    layout.placements.push_back(
        Placement{static_cast<uint32_t>(layout.group_used_elems.size() - 1), start, n});
    layout.group_used_elems.back() = start + n;
    layout.total_numel += n;
  }
  return layout;
}

Bytes MinimumDeviceBudget(uint64_t max_numel, Bytes device_bytes_per_elem,
                          int min_resident_chunks) {
  return max_numel * device_bytes_per_elem * static_cast<Bytes>(std::max(1, min_resident_chunks));
}

StatusOr<ChunkSizeChoice> ChooseChunkElems(const std::vector<uint64_t>& numels,
                                           Bytes device_budget, Bytes device_bytes_per_elem,
                                           int min_resident_chunks, uint64_t align_elems) {
  if (numels.empty()) return InvalidArgumentError("no tensors to lay out");
  if (device_bytes_per_elem == 0) return InvalidArgumentError("element size must be > 0");
  const uint64_t max_numel = *std::max_element(numels.begin(), numels.end());
  const Bytes minimum = MinimumDeviceBudget(max_numel, device_bytes_per_elem, min_resident_chunks);
  if (device_budget < minimum) {
    return ResourceExhaustedError(
        "device budget of " + std::to_string(device_budget) + " bytes is below the minimum of " +
        std::to_string(minimum) + " bytes (" + std::to_string(min_resident_chunks) +
        " chunks holding the largest tensor of " + std::to_string(max_numel) + " elements)");
  }
  uint64_t total = 0;
  for (uint64_t n : numels) total += n;
  if (align_elems == 0 || align_elems % kAlignElems != 0) {
    return InvalidArgumentError("tensor alignment of " + std::to_string(align_elems) +
                                " elements is not a multiple of " + std::to_string(kAlignElems));
  }
  const uint64_t align = align_elems;
  // With a coarse alignment the smallest chunk is the largest tensor rounded up to it (which
  // the minimum above does not count: at most align - 1 elements more).
  const uint64_t lo = align > kAlignElems ? AlignUp(max_numel, align) : max_numel;
  uint64_t hi = device_budget / device_bytes_per_elem / std::max(1, min_resident_chunks);
  // Never bigger than the whole model in one chunk (rounded up for alignment slack).
  hi = std::max(lo, std::min(hi, AlignUp(total + numels.size() * align, align)));
  constexpr int kCandidates = 257;
  ChunkSizeChoice best;
  bool have = false;
  auto consider = [&](uint64_t elems) -> Status {
    TIERMEM_ASSIGN_OR_RETURN(ChunkLayout l, PackTensors(numels, elems, align));
    const uint64_t waste = l.waste_elems();
    if (!have || waste < best.waste_elems ||
        (waste == best.waste_elems && elems < best.chunk_elems)) {
      best = ChunkSizeChoice{elems, waste, l.num_groups()};
      have = true;
    }
    return OkStatus();
  };
  TIERMEM_RETURN_IF_ERROR(consider(lo));
  if (hi > lo) {
    for (int i = 1; i < kCandidates; ++i) {
      uint64_t elems = lo + (hi - lo) * static_cast<uint64_t>(i) / (kCandidates - 1);
      elems = std::max(lo, elems / align * align);
      TIERMEM_RETURN_IF_ERROR(consider(elems));
    }
    // Exact multiples of sums of leading tensors are often waste-free: try the prefix sums.
    uint64_t prefix = 0;
    for (uint64_t n : numels) {
      prefix = AlignUp(prefix, align) + n;
      if (prefix > hi) break;
      // Chunk sizes stay multiples of a coarse alignment (every chunk's blocks are whole).
      const uint64_t c = align > kAlignElems ? AlignUp(prefix, align) : prefix;
      if (c >= lo && c <= hi) TIERMEM_RETURN_IF_ERROR(consider(c));
    }
  }
  return best;
}

}  // namespace tiermem::chunks
