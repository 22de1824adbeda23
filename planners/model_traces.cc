// How a model trace is made: the model's tensors are listed in first-use order (ListTensors),
// laid out into chunk groups by the session's own packer (LayOut: layout/chunk_layout.h, so a
// synthetic trace has the chunks a recorded one would), declared with their sizes, rates and
// budgets (DeclareChunks, DeclareMachine), and each iteration is recorded moment by moment
// (RecordIteration) against a fixed activation model (ActivationsOf).
//
// Invariants every step relies on: units are 0 = embed, 1..L = blocks.0..L-1, L + 1 = head;
// group g's chunk of kind k (0 param, 1 grad, 2 exp_avg, 3 exp_avg_sq) has id 4g + k; a
// tensor's `expert` is >= 0 exactly for the experts of an MoE block, whose expert set is the
// block's index.
#include "planners/model_traces.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "layout/chunk_layout.h"

namespace tiermem::planners {
namespace {

using chunks::PackTensor;

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Ns(double flops, double rate) {
  return static_cast<uint64_t>(std::llround(flops / rate * 1e9));
}

constexpr int kKinds = 4;  // param, grad, exp_avg, exp_avg_sq
ChunkId ChunkOf(uint32_t group, int kind) { return static_cast<ChunkId>(kKinds * group + kind); }

// The model's tensors in first-use order, as the packer sees them (rows: the first
// dimension; a weight and its bias are one tensor, the bias one more row), and per unit the
// tensors it uses.
struct ModelTensors {
  std::vector<PackTensor> tensors;
  std::vector<std::vector<size_t>> unit_tensors;  // per unit: indices into tensors
  uint64_t largest = 0;                           // elements of the largest tensor
};

// The chunk groups the session makes of them.
struct ModelLayout {
  uint64_t chunk_elems = 0;
  std::vector<std::vector<uint32_t>> groups_of;  // per tensor: the groups of its pieces
  std::vector<uint64_t> group_used;              // per group: the end of its last piece
  std::vector<uint32_t> group_set;               // per group: its expert set or kNoExpertSet
  uint32_t groups() const { return static_cast<uint32_t>(group_used.size()); }
};

// Activation bytes per unit (model_traces.h): saved for the backward at its pre-forward,
// temporaries of its forward and of its backward.
struct Activations {
  std::vector<Bytes> saved, temp_fwd, temp_bwd;
};

Status CheckShape(const ModelShape& s) {
  if (s.layers == 0 || s.d_model == 0 || s.heads == 0 || s.vocab == 0 || s.seq == 0 ||
      s.batch == 0 || s.iterations == 0) {
    return InvalidArgumentError(
        "model: layers, d_model, heads, vocab, seq, batch and iterations "
        "must be positive");
  }
  if (s.experts > 0 && (s.top_k == 0 || s.top_k > s.experts)) {
    return InvalidArgumentError("model: top_k must be in 1..experts");
  }
  if (!(s.device_flops > 0 && s.cpu_optim_elems_per_s > 0 && s.device_optim_elems_per_s > 0 &&
        s.pcie_bytes_per_s > 0 && s.nvme_read_bytes_per_s > 0 && s.nvme_write_bytes_per_s > 0)) {
    return InvalidArgumentError("model: rates must be positive");
  }
  if (!(s.state_bytes_per_elem > 0 && s.state_bytes_per_elem <= 4)) {
    return InvalidArgumentError("model trace: state_bytes_per_elem must be in (0, 4]");
  }
  return OkStatus();
}

ModelTensors ListTensors(const ModelShape& s) {
  const uint64_t d = s.d_model;
  const uint32_t L = s.layers;
  ModelTensors m;
  m.unit_tensors.resize(L + 2);
  auto add = [&](uint32_t unit, uint64_t rows, uint64_t row_elems, int set = -1, int expert = -1) {
    m.unit_tensors[unit].push_back(m.tensors.size());
    m.tensors.push_back(PackTensor{rows * row_elems, rows, set, expert});
    m.largest = std::max(m.largest, rows * row_elems);
  };
  add(0, s.vocab, d);  // wte
  add(0, s.seq, d);    // wpe
  for (uint32_t b = 0; b < L; ++b) {
    const uint32_t u = b + 1;
    add(u, 2, d);          // ln_1
    add(u, d + 1, 3 * d);  // attn.c_attn
    add(u, d + 1, d);      // attn.c_proj
    add(u, 2, d);          // ln_2
    if (s.experts == 0) {
      add(u, d + 1, 4 * d);  // mlp.c_fc
      add(u, 4 * d + 1, d);  // mlp.c_proj
    } else {
      add(u, s.experts, d);  // router
      for (uint32_t e = 0; e < s.experts; ++e) {
        add(u, d + 1, 4 * d, static_cast<int>(b), static_cast<int>(e));
        add(u, 4 * d + 1, d, static_cast<int>(b), static_cast<int>(e));
      }
    }
  }
  add(L + 1, 2, d);  // ln_f
  if (s.tied_embeddings) {
    m.unit_tensors[L + 1].push_back(0);  // lm_head is wte
  } else {
    add(L + 1, s.vocab, d);
  }
  return m;
}

// The chunk capacity (the shape's, else the largest tensor's, with experts one expert's)
// and the packing of the session (layout/chunk_layout.h: a tensor larger than a chunk is
// split into pieces of whole rows; each expert in chunks of its own).
StatusOr<ModelLayout> LayOut(const ModelShape& s, const ModelTensors& m) {
  TIERMEM_ASSIGN_OR_RETURN(const uint64_t expert_item, chunks::LargestExpertItem(m.tensors));
  ModelLayout l;
  l.chunk_elems = s.chunk_elems != 0 ? s.chunk_elems
                  : expert_item != 0 ? expert_item
                                     : AlignUp(m.largest, chunks::kAlignElems);
  if (l.chunk_elems < m.largest && s.experts == 0) {
    return InvalidArgumentError("model: chunk_elems " + std::to_string(l.chunk_elems) +
                                " is smaller than the largest tensor (" +
                                std::to_string(m.largest) + " elements)");
  }
  if (l.chunk_elems < expert_item) {
    return InvalidArgumentError("model: chunk_elems " + std::to_string(l.chunk_elems) +
                                " is smaller than an expert (" + std::to_string(expert_item) +
                                " elements)");
  }
  TIERMEM_ASSIGN_OR_RETURN(chunks::PieceLayout packed,
                           chunks::PackPieces(m.tensors, l.chunk_elems));
  l.group_used = std::move(packed.group_used_elems);
  l.group_set.assign(l.groups(), kNoExpertSet);
  l.groups_of.resize(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    for (const chunks::Piece& p : packed.pieces[t]) {
      l.groups_of[t].push_back(p.group);
      // The chunks of an expert belong to its block's expert set: which of them an iteration
      // uses is the routing's choice.
      if (m.tensors[t].expert >= 0) l.group_set[p.group] = m.tensors[t].expert_set;
    }
  }
  return l;
}

// Every group's param and grad chunk of chunk_elems * 4 bytes and its exp_avg and exp_avg_sq
// chunks of chunk_elems * state_bytes_per_elem, all homed on the host.
void DeclareChunks(TraceBuilder& tb, const ModelShape& s, const ModelLayout& l) {
  const Bytes chunk_bytes = l.chunk_elems * 4;
  const Bytes state_bytes =
      static_cast<Bytes>(std::ceil(static_cast<double>(l.chunk_elems) * s.state_bytes_per_elem));
  const char* kinds[kKinds] = {"param", "grad", "exp_avg", "exp_avg_sq"};
  const Category cats[kKinds] = {Category::kParam, Category::kGrad, Category::kOptimState,
                                 Category::kOptimState};
  uint16_t kind_index[kKinds];
  for (int k = 0; k < kKinds; ++k) kind_index[k] = tb.KindIndex(kinds[k]);
  for (uint32_t g = 0; g < l.groups(); ++g) {
    for (int k = 0; k < kKinds; ++k) {
      tb.DeclareChunk(ChunkOf(g, k), TraceChunk{k >= 2 ? state_bytes : chunk_bytes, cats[k], g,
                                                kind_index[k], TierKind::kHost});
      // The runtime acquires an expert's param and grad chunks as class members (its
      // optimizer state only in the group's optimizer step): those are what it marks.
      if (s.mark_experts && l.group_set[g] != kNoExpertSet && k < 2) {
        tb.MarkExpertSet(ChunkOf(g, k), l.group_set[g]);
      }
    }
  }
}

// The modelled machine's rates, budgets that hold the model (device: every chunk; host:
// twice that) and the source line naming the shape.
void DeclareMachine(TraceBuilder& tb, const ModelShape& s, const ModelLayout& l) {
  MeasuredRates r;
  auto link = [&r](TierKind a, TierKind b, double bw, uint64_t lat) {
    r.link[static_cast<int>(a)][static_cast<int>(b)] = LinkRate{bw, lat};
  };
  link(TierKind::kHost, TierKind::kDevice, s.pcie_bytes_per_s, 10000);
  link(TierKind::kDevice, TierKind::kHost, s.pcie_bytes_per_s, 10000);
  link(TierKind::kHost, TierKind::kNvme, s.nvme_write_bytes_per_s, 100000);
  link(TierKind::kNvme, TierKind::kHost, s.nvme_read_bytes_per_s, 100000);
  r.cpu_optim_elems_per_s = s.cpu_optim_elems_per_s;
  r.device_optim_elems_per_s = s.device_optim_elems_per_s;
  r.cpu_cores = s.cpu_cores;
  tb.SetRates(r);
  const Bytes total = Bytes{l.groups()} * kKinds * l.chunk_elems * 4;
  tb.SetBudgets(TraceBudgets{total, 2 * total, 0});
  tb.SetSource("tiermem plan synth " + s.name + ": layers=" + std::to_string(s.layers) +
               " d_model=" + std::to_string(s.d_model) + " heads=" + std::to_string(s.heads) +
               " vocab=" + std::to_string(s.vocab) + " seq=" + std::to_string(s.seq) +
               " batch=" + std::to_string(s.batch) + (s.tied_embeddings ? " tied" : "") +
               (s.checkpointing ? " checkpointing" : "") +
               (s.experts > 0 ? " experts=" + std::to_string(s.experts) + " top_k=" +
                                    std::to_string(s.top_k) + (s.mark_experts ? "" : " unmarked")
                              : "") +
               " chunk_elems=" + std::to_string(l.chunk_elems) +
               " iterations=" + std::to_string(s.iterations) + " seed=" + std::to_string(s.seed));
}

Activations ActivationsOf(const ModelShape& s) {
  const uint64_t d = s.d_model, T = s.seq, tokens = s.batch * s.seq;
  const uint32_t L = s.layers;
  const Bytes full_block = tokens * (16 * d * 4) + tokens * 10 * s.heads * T;  // 2.5*heads*T*4
  Activations a;
  a.saved.assign(L + 2, 0);
  a.temp_fwd.assign(L + 2, 0);
  a.temp_bwd.assign(L + 2, 0);
  a.saved[0] = tokens * d * 4;
  for (uint32_t u = 1; u <= L; ++u) {
    a.saved[u] = s.checkpointing ? tokens * d * 4 : full_block;
    a.temp_fwd[u] = tokens * 4 * d * 4;
    a.temp_bwd[u] = a.temp_fwd[u] + (s.checkpointing ? full_block : 0);
  }
  a.saved[L + 1] = tokens * d * 4;
  a.temp_fwd[L + 1] = a.temp_bwd[L + 1] = tokens * s.vocab * 4;
  return a;
}

std::string UnitLabel(uint32_t u, uint32_t layers) {
  if (u == 0) return "embed";
  if (u == layers + 1) return "head";
  return "blocks." + std::to_string(u - 1);
}

// One iteration: the routing (top_k experts per block, drawn from `rng`), then the forward,
// the backward in reverse and an optimizer step per group whose grads were written.
void RecordIteration(TraceBuilder& tb, const ModelShape& s, const ModelTensors& m,
                     const ModelLayout& l, const Activations& act, uint64_t& rng) {
  const uint64_t tokens = s.batch * s.seq;
  const uint32_t L = s.layers, num_units = L + 2;
  std::vector<std::set<int>> used(num_units);  // experts used per block this iteration
  for (uint32_t u = 1; u <= L && s.experts > 0; ++u) {
    while (used[u].size() < s.top_k) used[u].insert(static_cast<int>(SplitMix64(rng) % s.experts));
  }
  std::vector<std::vector<uint32_t>> unit_groups(num_units);
  std::vector<double> fwd_flops(num_units);
  for (uint32_t u = 0; u < num_units; ++u) {
    std::set<uint32_t> gs;
    uint64_t params = 0;
    for (size_t ti : m.unit_tensors[u]) {
      if (m.tensors[ti].expert >= 0 && !used[u].count(m.tensors[ti].expert)) continue;
      gs.insert(l.groups_of[ti].begin(), l.groups_of[ti].end());
      params += m.tensors[ti].numel;
    }
    unit_groups[u].assign(gs.begin(), gs.end());
    fwd_flops[u] =
        2.0 * tokens * params + (u >= 1 && u <= L ? 4.0 * tokens * s.seq * s.d_model : 0.0);
  }
  tb.BeginIteration();
  Bytes live_saved = 0;
  for (uint32_t u = 0; u < num_units; ++u) {
    tb.BeginMoment("fwd:" + UnitLabel(u, L), MomentKind::kPreForward, u);
    for (uint32_t g : unit_groups[u])
      tb.Access(ChunkOf(g, 0), AccessMode::kRead, TierKind::kDevice);
    live_saved += act.saved[u];
    tb.SetSavedBytes(act.saved[u]);
    tb.SetActivationBytes(live_saved + act.temp_fwd[u]);
    tb.EndMoment(Ns(fwd_flops[u], s.device_flops));
  }
  std::vector<bool> grad_touched(l.groups(), false);
  for (uint32_t u = num_units; u-- > 0;) {
    tb.BeginMoment("bwd:" + UnitLabel(u, L), MomentKind::kPreBackward, u);
    for (uint32_t g : unit_groups[u]) {
      tb.Access(ChunkOf(g, 0), AccessMode::kRead, TierKind::kDevice);
      tb.Access(ChunkOf(g, 1), grad_touched[g] ? AccessMode::kReadWrite : AccessMode::kWrite,
                TierKind::kDevice);
      grad_touched[g] = true;
    }
    tb.SetActivationBytes(live_saved + act.temp_bwd[u]);
    live_saved -= act.saved[u];
    const double flops =
        2 * fwd_flops[u] + (s.checkpointing && u >= 1 && u <= L ? fwd_flops[u] : 0);
    tb.EndMoment(Ns(flops, s.device_flops));
  }
  for (uint32_t g = 0; g < l.groups(); ++g) {
    if (!grad_touched[g]) continue;
    tb.BeginMoment("opt:g" + std::to_string(g), MomentKind::kOptimizerStep);
    tb.Access(ChunkOf(g, 1), AccessMode::kRead, TierKind::kHost);
    for (int k : {0, 2, 3}) tb.Access(ChunkOf(g, k), AccessMode::kReadWrite, TierKind::kHost);
    tb.SetWorkElems(l.group_used[g]);
    tb.EndMoment(Ns(static_cast<double>(l.group_used[g]), s.cpu_optim_elems_per_s));
  }
}

}  // namespace

StatusOr<Trace> ModelTrace(const ModelShape& s) {
  TIERMEM_RETURN_IF_ERROR(CheckShape(s));
  const ModelTensors tensors = ListTensors(s);
  TIERMEM_ASSIGN_OR_RETURN(const ModelLayout layout, LayOut(s, tensors));
  const Activations act = ActivationsOf(s);
  TraceBuilder tb;
  DeclareChunks(tb, s, layout);
  DeclareMachine(tb, s, layout);
  uint64_t rng = s.seed;
  for (uint32_t it = 0; it < s.iterations; ++it) RecordIteration(tb, s, tensors, layout, act, rng);
  return tb.Finish();
}
StatusOr<ModelShape> CanonicalShape(const std::string& name) {
  ModelShape s;
  s.name = name;
  s.layers = 24;
  s.d_model = 2048;
  s.heads = 16;
  s.vocab = 32000;
  s.seq = 1024;
  s.iterations = 4;  // a warm-up and three measured iterations (simulator.h)
  if (name == "gpt") {
    s.batch = 2;
  } else if (name == "gpt-ckpt") {
    s.batch = 8;
    s.checkpointing = true;
  } else if (name == "gpt-tied") {
    s.batch = 8;
    s.checkpointing = true;
    s.tied_embeddings = true;
  } else if (name == "moe") {
    s.layers = 12;
    s.d_model = 1024;
    s.vocab = 16384;
    s.batch = 8;
    s.checkpointing = true;
    s.experts = 8;
    s.top_k = 2;
    s.iterations = 5;
  } else {
    return NotFoundError("no canonical model '" + name + "' (gpt, gpt-ckpt, gpt-tied, moe)");
  }
  return s;
}

}  // namespace tiermem::planners
