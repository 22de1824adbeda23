// Packing is greedy first-fit-in-order (the next tensor goes into the current chunk if it fits
// after alignment, else opens a new chunk): order is preserved, so a module's tensors stay in
// as few chunks as possible and a forward pass walks the chunks in order. The automatic size
// search evaluates this packing at up to kCandidates capacities between the largest tensor
// and the device-budget limit (linearly spaced, plus the exact ends) and keeps the least waste.
//
// Pieces (PackPieces) keep the same greedy order. A tensor larger than a chunk fills the rest
// of the current chunk with whole rows and continues in new chunks; a tensor that fits is
// never split. An expert set is expanded, where its first tensor comes, into one *item* per
// expert (that expert's rows and tensors); an item that fits in a chunk is placed like a
// tensor that fits (contiguous, never straddling), so with a chunk of one item each expert
// has a chunk of its own and moves alone; an item always starts a new chunk and nothing else
// is placed in its last one, so an expert's chunks hold only that expert's slices. Invariants of a
// PieceLayout: every tensor's pieces cover [0, numel) in order, each inside one chunk at an aligned
// offset, none overlapping.
#include "layout/chunk_layout.h"

#include <algorithm>

namespace tiermem::chunks {

std::string_view ChunkKindName(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParamLowp:
      return "param_lowp";
    case ChunkKind::kParamFp32:
      return "param_fp32";
    case ChunkKind::kExpAvg:
      return "exp_avg";
    case ChunkKind::kExpAvgSq:
      return "exp_avg_sq";
    case ChunkKind::kGrad:
      return "grad";
  }
  return "unknown";
}

Category ChunkKindCategory(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParamLowp:
    case ChunkKind::kParamFp32:
      return Category::kParam;
    case ChunkKind::kGrad:
      return Category::kGrad;
    case ChunkKind::kExpAvg:
    case ChunkKind::kExpAvgSq:
      return Category::kOptimState;
  }
  return Category::kOther;
}

// Tensor offsets are multiples of `align_elems`, itself a multiple of kAlignElems.
static Status CheckAlign(uint64_t align_elems) {
  if (align_elems == 0 || align_elems % kAlignElems != 0) {
    return InvalidArgumentError("tensor alignment of " + std::to_string(align_elems) +
                                " elements is not a multiple of " + std::to_string(kAlignElems));
  }
  return OkStatus();
}

StatusOr<ChunkLayout> PackTensors(const std::vector<uint64_t>& numels, uint64_t chunk_elems,
                                  uint64_t align_elems) {
  if (chunk_elems == 0) return InvalidArgumentError("chunk size must be > 0 elements");
  TIERMEM_RETURN_IF_ERROR(CheckAlign(align_elems));
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

StatusOr<ChunkSizeChoice> ChooseChunkElems(const std::vector<uint64_t>& numels, Bytes device_budget,
                                           Bytes device_bytes_per_elem, int min_resident_chunks,
                                           uint64_t align_elems) {
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
  TIERMEM_RETURN_IF_ERROR(CheckAlign(align_elems));
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

namespace {

// One expert's slices: (tensor, first row, rows) in input order.
struct ItemSlice {
  size_t tensor;
  uint64_t row, rows;
};

// Expert sets in order of their first tensor: per set, its expert items.
struct ExpertSets {
  std::vector<int> order;                                  // set ids, first-seen order
  std::vector<std::vector<std::vector<ItemSlice>>> items;  // per set (order), per expert
  std::vector<size_t> first;                               // per set: its first tensor
};

StatusOr<ExpertSets> FindExpertSets(const std::vector<PackTensor>& tensors) {
  ExpertSets sets;
  std::vector<int> index_of;  // set id -> position in order
  std::vector<uint64_t> experts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const PackTensor& t = tensors[i];
    if (t.expert_set < 0) continue;
    const size_t id = static_cast<size_t>(t.expert_set);
    if (id >= index_of.size()) index_of.resize(id + 1, -1);
    if (index_of[id] < 0) {
      index_of[id] = static_cast<int>(sets.order.size());
      sets.order.push_back(t.expert_set);
      sets.first.push_back(i);
      experts.push_back(0);
    }
    if (t.expert < 0) {
      uint64_t& e = experts[static_cast<size_t>(index_of[id])];
      if (e != 0 && e != t.rows) {
        return InvalidArgumentError("expert set " + std::to_string(id) + ": tensor " +
                                    std::to_string(i) + " has " + std::to_string(t.rows) +
                                    " experts in its first dimension, another of the set " +
                                    std::to_string(e));
      }
      e = t.rows;
    }
  }
  sets.items.resize(sets.order.size());
  for (size_t k = 0; k < sets.order.size(); ++k) {
    uint64_t e = experts[k];
    for (size_t i = 0; i < tensors.size(); ++i) {  // per-expert tensors only: the largest index
      const PackTensor& t = tensors[i];
      if (t.expert_set == sets.order[k] && t.expert >= 0 && experts[k] == 0) {
        e = std::max<uint64_t>(e, static_cast<uint64_t>(t.expert) + 1);
      }
    }
    sets.items[k].resize(e);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const PackTensor& t = tensors[i];
    if (t.expert_set < 0) continue;
    const size_t k = static_cast<size_t>(index_of[static_cast<size_t>(t.expert_set)]);
    auto& items = sets.items[k];
    if (t.expert < 0) {
      for (uint64_t e = 0; e < items.size(); ++e) items[e].push_back({i, e, 1});
    } else if (static_cast<uint64_t>(t.expert) >= items.size()) {
      return InvalidArgumentError("expert set " + std::to_string(t.expert_set) + ": tensor " +
                                  std::to_string(i) + " is expert " + std::to_string(t.expert) +
                                  " of a set of " + std::to_string(items.size()) + " experts");
    } else {
      items[static_cast<size_t>(t.expert)].push_back({i, 0, t.rows});
    }
  }
  return sets;
}

uint64_t ItemElems(const std::vector<PackTensor>& tensors, const std::vector<ItemSlice>& item) {
  uint64_t end = 0;
  for (const ItemSlice& s : item) {
    end = AlignUp(end, kAlignElems) + s.rows * tensors[s.tensor].row_elems();
  }
  return end;
}

Status CheckTensors(const std::vector<PackTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const PackTensor& t = tensors[i];
    if (t.numel == 0)
      return InvalidArgumentError("tensor " + std::to_string(i) + " has 0 elements");
    if (t.rows == 0 || t.numel % t.rows != 0) {
      return InvalidArgumentError("tensor " + std::to_string(i) + " of " + std::to_string(t.numel) +
                                  " elements cannot be split into " + std::to_string(t.rows) +
                                  " rows");
    }
  }
  return OkStatus();
}

// The greedy packer over one layout (see the file comment).
class Packer {
 public:
  Packer(const std::vector<PackTensor>& tensors, PieceLayout* l, uint64_t align)
      : tensors_(tensors), l_(l), align_(align) {}

  uint64_t Rest() const {
    if (l_->group_used_elems.empty() || sealed_) return 0;
    const uint64_t start = AlignUp(l_->group_used_elems.back(), align_);
    return start >= l_->chunk_elems ? 0 : l_->chunk_elems - start;
  }

  // `numel` contiguous elements (<= chunk) for tensor `t` from element `begin`.
  void Put(size_t t, uint64_t begin, uint64_t numel, int expert) {
    if (Rest() < numel) NewChunk();
    const uint64_t start = AlignUp(l_->group_used_elems.back(), align_);
    l_->pieces[t].push_back(
        Piece{static_cast<uint32_t>(l_->group_used_elems.size() - 1), start, numel, begin, expert});
    l_->group_used_elems.back() = start + numel;
  }

  // Rows [row, row + rows) of tensor `t`: whole when they fit in a chunk, else as pieces of
  // as many whole rows as fit, the current chunk's rest first.
  Status PutRows(size_t t, uint64_t row, uint64_t rows, int expert) {
    const uint64_t re = tensors_[t].row_elems();
    if (re > l_->chunk_elems) {
      return InvalidArgumentError("tensor " + std::to_string(t) + " has rows of " +
                                  std::to_string(re) + " elements, more than the chunk size of " +
                                  std::to_string(l_->chunk_elems) + " elements");
    }
    if (rows * re <= l_->chunk_elems) {
      Put(t, row * re, rows * re, expert);
      return OkStatus();
    }
    while (rows > 0) {
      uint64_t fit = Rest() / re;
      if (fit == 0) {
        NewChunk();
        fit = l_->chunk_elems / re;
      }
      const uint64_t take = std::min(fit, rows);
      Put(t, row * re, take * re, expert);
      row += take;
      rows -= take;
    }
    return OkStatus();
  }

  // An expert's item in chunks of its own: it starts a new chunk, and nothing else goes into
  // its last one.
  Status PutItem(const std::vector<ItemSlice>& item, int expert) {
    const uint64_t n = ItemElems(tensors_, item);
    sealed_ = true;
    for (const ItemSlice& s : item) {
      const uint64_t re = tensors_[s.tensor].row_elems();
      if (n <= l_->chunk_elems) {
        Put(s.tensor, s.row * re, s.rows * re, expert);
      } else {
        TIERMEM_RETURN_IF_ERROR(PutRows(s.tensor, s.row, s.rows, expert));
      }
    }
    sealed_ = true;
    return OkStatus();
  }

 private:
  void NewChunk() {
    l_->group_used_elems.push_back(0);
    sealed_ = false;
  }

  const std::vector<PackTensor>& tensors_;
  PieceLayout* l_;
  uint64_t align_;       // every piece starts at a multiple of it
  bool sealed_ = false;  // the current chunk takes nothing more (an expert's last chunk)
};

}  // namespace

StatusOr<PieceLayout> PackPieces(const std::vector<PackTensor>& tensors, uint64_t chunk_elems,
                                 uint64_t align_elems) {
  if (chunk_elems == 0) return InvalidArgumentError("chunk size must be > 0 elements");
  TIERMEM_RETURN_IF_ERROR(CheckAlign(align_elems));
  TIERMEM_RETURN_IF_ERROR(CheckTensors(tensors));
  TIERMEM_ASSIGN_OR_RETURN(ExpertSets sets, FindExpertSets(tensors));
  PieceLayout layout;
  layout.chunk_elems = chunk_elems;
  layout.pieces.resize(tensors.size());
  Packer packer(tensors, &layout, align_elems);
  size_t next_set = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const PackTensor& t = tensors[i];
    layout.total_numel += t.numel;
    if (t.expert_set >= 0) {
      // The whole set goes where its first tensor comes (sets are first-seen ordered).
      if (next_set < sets.first.size() && sets.first[next_set] == i) {
        const auto& items = sets.items[next_set++];
        for (size_t e = 0; e < items.size(); ++e) {
          TIERMEM_RETURN_IF_ERROR(packer.PutItem(items[e], static_cast<int>(e)));
        }
      }
      continue;
    }
    TIERMEM_RETURN_IF_ERROR(packer.PutRows(i, 0, t.rows, -1));
  }
  for (std::vector<Piece>& ps : layout.pieces) {  // element order (a set's rows came by expert)
    std::sort(ps.begin(), ps.end(),
              [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  }
  return layout;
}

StatusOr<uint64_t> LargestExpertItem(const std::vector<PackTensor>& tensors) {
  TIERMEM_RETURN_IF_ERROR(CheckTensors(tensors));
  TIERMEM_ASSIGN_OR_RETURN(ExpertSets sets, FindExpertSets(tensors));
  uint64_t largest = 0;
  for (const auto& items : sets.items) {
    for (const auto& item : items) largest = std::max(largest, ItemElems(tensors, item));
  }
  return largest;
}

StatusOr<ChunkSizeChoice> ChooseChunkElems(const std::vector<PackTensor>& tensors,
                                           Bytes device_budget, Bytes device_bytes_per_elem,
                                           int min_resident_chunks, uint64_t align_elems) {
  if (tensors.empty()) return InvalidArgumentError("no tensors to lay out");
  if (device_bytes_per_elem == 0) return InvalidArgumentError("element size must be > 0");
  TIERMEM_ASSIGN_OR_RETURN(const uint64_t item, LargestExpertItem(tensors));
  uint64_t max_numel = 0, max_row = 0;
  size_t row_of = 0;
  std::vector<uint64_t> numels;
  for (size_t i = 0; i < tensors.size(); ++i) {
    max_numel = std::max(max_numel, tensors[i].numel);
    if (tensors[i].row_elems() > max_row) {
      max_row = tensors[i].row_elems();
      row_of = i;
    }
    numels.push_back(tensors[i].numel);
  }
  const int resident = std::max(1, min_resident_chunks);
  const uint64_t limit = device_budget / device_bytes_per_elem / resident;
  if (limit < max_row) {
    return ResourceExhaustedError(
        "device budget of " + std::to_string(device_budget) + " bytes is below the minimum of " +
        std::to_string(MinimumDeviceBudget(max_row, device_bytes_per_elem, resident)) + " bytes (" +
        std::to_string(resident) + " chunks holding the largest piece a unit " +
        "needs at once: a row of " + std::to_string(max_row) + " elements of tensor " +
        std::to_string(row_of) + ")");
  }
  TIERMEM_RETURN_IF_ERROR(CheckAlign(align_elems));
  // A coarser alignment (blockwise-quantized state): a multiple of it, never below `floor`
  // (rounded up to it then). The default keeps the candidates as they are.
  auto aligned = [&](uint64_t elems, uint64_t floor) {
    if (align_elems == kAlignElems) return elems;
    const uint64_t down = elems / align_elems * align_elems;
    return down >= floor ? down : AlignUp(floor, align_elems);
  };
  auto evaluate = [&](uint64_t elems, uint64_t floor) -> StatusOr<ChunkSizeChoice> {
    elems = aligned(elems, floor);
    TIERMEM_ASSIGN_OR_RETURN(PieceLayout l, PackPieces(tensors, elems, align_elems));
    return ChunkSizeChoice{elems, l.waste_elems(), l.num_groups()};
  };
  if (item > 0) return evaluate(std::min(std::max(item, max_row), limit), max_row);
  if (limit >= max_numel) {
    return ChooseChunkElems(numels, device_budget, device_bytes_per_elem, min_resident_chunks,
                            align_elems);
  }
  const uint64_t lo = std::max(max_row, limit / 2), hi = limit;
  constexpr int kCandidates = 65;
  ChunkSizeChoice best;
  TIERMEM_ASSIGN_OR_RETURN(best, evaluate(hi, lo));
  for (int i = 0; i + 1 < kCandidates && hi > lo; ++i) {
    uint64_t elems = lo + (hi - lo) * static_cast<uint64_t>(i) / (kCandidates - 1);
    elems = std::max(lo, elems / kAlignElems * kAlignElems);
    TIERMEM_ASSIGN_OR_RETURN(ChunkSizeChoice c, evaluate(elems, lo));
    if (c.waste_elems < best.waste_elems ||
        (c.waste_elems == best.waste_elems && c.chunk_elems > best.chunk_elems)) {
      best = c;
    }
  }
  return best;
}

}  // namespace tiermem::chunks
