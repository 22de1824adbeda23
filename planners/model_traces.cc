#include "planners/model_traces.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

namespace tiermem::planners {
namespace {

constexpr uint64_t kAlign = 32;  // elements, as chunks/chunk_layout.h aligns tensors

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Tensor {
  uint64_t numel;
  int expert;  // -1: dense
};

uint64_t Ns(double flops, double rate) {
  return static_cast<uint64_t>(std::llround(flops / rate * 1e9));
}

}  // namespace

StatusOr<Trace> ModelTrace(const ModelShape& s) {
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
  const uint64_t d = s.d_model, T = s.seq, tokens = s.batch * s.seq;
  const uint32_t L = s.layers;
  const uint32_t num_units = L + 2;
  // Tensors in first-use order; per unit the tensors it uses.
  std::vector<Tensor> tensors;
  std::vector<std::vector<size_t>> unit_tensors(num_units);
  auto add = [&](uint32_t unit, uint64_t numel, int expert = -1) {
    unit_tensors[unit].push_back(tensors.size());
    tensors.push_back({numel, expert});
  };
  add(0, s.vocab * d);  // wte
  add(0, T * d);        // wpe
  for (uint32_t b = 0; b < L; ++b) {
    const uint32_t u = b + 1;
    add(u, 2 * d);              // ln_1
    add(u, 3 * d * d + 3 * d);  // attn.c_attn
    add(u, d * d + d);          // attn.c_proj
    add(u, 2 * d);              // ln_2
    if (s.experts == 0) {
      add(u, 4 * d * d + 4 * d);  // mlp.c_fc
      add(u, 4 * d * d + d);      // mlp.c_proj
    } else {
      add(u, d * s.experts);  // router
      for (uint32_t e = 0; e < s.experts; ++e) {
        add(u, 4 * d * d + 4 * d, static_cast<int>(e));
        add(u, 4 * d * d + d, static_cast<int>(e));
      }
    }
  }
  add(L + 1, 2 * d);  // ln_f
  if (s.tied_embeddings) {
    unit_tensors[L + 1].push_back(0);  // lm_head is wte
  } else {
    add(L + 1, s.vocab * d);
  }
  uint64_t largest = 0;
  for (const Tensor& t : tensors) largest = std::max(largest, t.numel);
  // With experts, as the session lays them out (chunks/chunk_layout.h): one expert per chunk,
  // the chunk the size of an expert's tensors (aligned); a larger tensor (the embeddings) is
  // split into pieces, one per chunk.
  const uint64_t expert_item =
      s.experts == 0 ? 0 : AlignUp(AlignUp(4 * d * d + 4 * d, kAlign) + 4 * d * d + d, kAlign);
  const uint64_t chunk_elems = s.chunk_elems != 0 ? s.chunk_elems
                               : expert_item != 0 ? expert_item
                                                  : AlignUp(largest, kAlign);
  if (chunk_elems < largest && s.experts == 0) {
    return InvalidArgumentError("model: chunk_elems " + std::to_string(chunk_elems) +
                                " is smaller than the largest tensor (" + std::to_string(largest) +
                                " elements)");
  }
  if (chunk_elems < expert_item) {
    return InvalidArgumentError("model: chunk_elems " + std::to_string(chunk_elems) +
                                " is smaller than an expert (" + std::to_string(expert_item) +
                                " elements)");
  }
  // Pack into groups: tensors in order at aligned offsets, a tensor never straddling two
  // chunks unless it is larger than one (then it is pieces filling whole chunks, the last
  // one shared); an expert's tensors in a chunk of their own, which nothing else shares.
  std::vector<std::vector<uint32_t>> groups_of(tensors.size());
  std::vector<uint64_t> group_used;
  {
    uint64_t used = chunk_elems;  // forces a first group
    bool sealed = true;
    auto open = [&] {
      group_used.push_back(0);
      used = 0;
      sealed = false;
    };
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      const bool starts_expert = t.expert >= 0 && (i == 0 || tensors[i - 1].expert != t.expert);
      const uint64_t off = AlignUp(used, kAlign);
      if (group_used.empty() || sealed || starts_expert || off + t.numel > chunk_elems) {
        open();
      } else {
        used = off;
      }
      uint64_t left = t.numel;
      while (true) {
        groups_of[i].push_back(static_cast<uint32_t>(group_used.size() - 1));
        const uint64_t take = std::min(left, chunk_elems - used);
        used += take;
        group_used.back() = used;
        left -= take;
        if (left == 0) break;
        open();
      }
      // An expert's chunk takes nothing after its last tensor.
      sealed = t.expert >= 0 && (i + 1 == tensors.size() || tensors[i + 1].expert != t.expert);
    }
  }
  const uint32_t groups = static_cast<uint32_t>(group_used.size());
  // The chunks of an expert belong to its block's expert set (set b for blocks.b): which of
  // them an iteration uses is the routing's choice.
  std::vector<uint32_t> group_set(groups, kNoExpertSet);
  for (uint32_t u = 1; u <= L && s.experts > 0; ++u) {
    for (size_t ti : unit_tensors[u]) {
      if (tensors[ti].expert < 0) continue;
      for (uint32_t g : groups_of[ti]) group_set[g] = u - 1;
    }
  }
  const Bytes chunk_bytes = chunk_elems * 4;
  if (!(s.state_bytes_per_elem > 0 && s.state_bytes_per_elem <= 4)) {
    return InvalidArgumentError("model trace: state_bytes_per_elem must be in (0, 4]");
  }
  const Bytes state_bytes =
      static_cast<Bytes>(std::ceil(static_cast<double>(chunk_elems) * s.state_bytes_per_elem));

  TraceBuilder tb;
  const char* kinds[4] = {"param", "grad", "exp_avg", "exp_avg_sq"};
  const Category cats[4] = {Category::kParam, Category::kGrad, Category::kOptimState,
                            Category::kOptimState};
  uint16_t kind_index[4];
  for (int k = 0; k < 4; ++k) kind_index[k] = tb.KindIndex(kinds[k]);
  auto chunk_id = [](uint32_t g, int k) { return static_cast<ChunkId>(4 * g + k); };
  for (uint32_t g = 0; g < groups; ++g) {
    for (int k = 0; k < 4; ++k) {
      tb.DeclareChunk(chunk_id(g, k), TraceChunk{k >= 2 ? state_bytes : chunk_bytes, cats[k], g,
                                                 kind_index[k], TierKind::kHost});
      // The runtime acquires an expert's param and grad chunks as class members (its
      // optimizer state only in the group's optimizer step): those are what it marks.
      if (s.mark_experts && group_set[g] != kNoExpertSet && k < 2) {
        tb.MarkExpertSet(chunk_id(g, k), group_set[g]);
      }
    }
  }
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
  const Bytes total = Bytes{groups} * 4 * chunk_bytes;
  tb.SetBudgets(TraceBudgets{total, 2 * total, 0});
  tb.SetSource("tiermem plan synth " + s.name + ": layers=" + std::to_string(L) +
               " d_model=" + std::to_string(d) + " heads=" + std::to_string(s.heads) +
               " vocab=" + std::to_string(s.vocab) + " seq=" + std::to_string(T) +
               " batch=" + std::to_string(s.batch) + (s.tied_embeddings ? " tied" : "") +
               (s.checkpointing ? " checkpointing" : "") +
               (s.experts > 0 ? " experts=" + std::to_string(s.experts) + " top_k=" +
                                    std::to_string(s.top_k) + (s.mark_experts ? "" : " unmarked")
                              : "") +
               " chunk_elems=" + std::to_string(chunk_elems) +
               " iterations=" + std::to_string(s.iterations) + " seed=" + std::to_string(s.seed));

  auto label = [&](uint32_t u) {
    if (u == 0) return std::string("embed");
    if (u == L + 1) return std::string("head");
    return "blocks." + std::to_string(u - 1);
  };
  // Activation model (bytes).
  const Bytes full_block = tokens * (16 * d * 4) + tokens * 10 * s.heads * T;  // 2.5*heads*T*4
  std::vector<Bytes> saved(num_units), temp_fwd(num_units), temp_bwd(num_units);
  saved[0] = tokens * d * 4;
  for (uint32_t u = 1; u <= L; ++u) {
    saved[u] = s.checkpointing ? tokens * d * 4 : full_block;
    temp_fwd[u] = tokens * 4 * d * 4;
    temp_bwd[u] = temp_fwd[u] + (s.checkpointing ? full_block : 0);
  }
  saved[L + 1] = tokens * d * 4;
  temp_fwd[L + 1] = temp_bwd[L + 1] = tokens * s.vocab * 4;

  uint64_t rng = s.seed;
  for (uint32_t it = 0; it < s.iterations; ++it) {
    // Experts used per block this iteration.
    std::vector<std::set<int>> used(num_units);
    for (uint32_t u = 1; u <= L && s.experts > 0; ++u) {
      while (used[u].size() < s.top_k) {
        used[u].insert(static_cast<int>(SplitMix64(rng) % s.experts));
      }
    }
    std::vector<std::vector<uint32_t>> unit_groups(num_units);
    std::vector<double> fwd_flops(num_units);
    for (uint32_t u = 0; u < num_units; ++u) {
      std::set<uint32_t> gs;
      uint64_t params = 0;
      for (size_t ti : unit_tensors[u]) {
        if (tensors[ti].expert >= 0 && !used[u].count(tensors[ti].expert)) continue;
        gs.insert(groups_of[ti].begin(), groups_of[ti].end());
        params += tensors[ti].numel;
      }
      unit_groups[u].assign(gs.begin(), gs.end());
      fwd_flops[u] = 2.0 * tokens * params + (u >= 1 && u <= L ? 4.0 * tokens * T * d : 0.0);
    }
    tb.BeginIteration();
    Bytes live_saved = 0;
    for (uint32_t u = 0; u < num_units; ++u) {
      tb.BeginMoment("fwd:" + label(u), MomentKind::kPreForward, u);
      for (uint32_t g : unit_groups[u])
        tb.Access(chunk_id(g, 0), AccessMode::kRead, TierKind::kDevice);
      live_saved += saved[u];
      tb.SetSavedBytes(saved[u]);
      tb.SetActivationBytes(live_saved + temp_fwd[u]);
      tb.EndMoment(Ns(fwd_flops[u], s.device_flops));
    }
    std::vector<bool> grad_touched(groups, false);
    for (uint32_t k = num_units; k-- > 0;) {
      const uint32_t u = k;
      tb.BeginMoment("bwd:" + label(u), MomentKind::kPreBackward, u);
      for (uint32_t g : unit_groups[u]) {
        tb.Access(chunk_id(g, 0), AccessMode::kRead, TierKind::kDevice);
        tb.Access(chunk_id(g, 1), grad_touched[g] ? AccessMode::kReadWrite : AccessMode::kWrite,
                  TierKind::kDevice);
        grad_touched[g] = true;
      }
      tb.SetActivationBytes(live_saved + temp_bwd[u]);
      live_saved -= saved[u];
      const double flops =
          2 * fwd_flops[u] + (s.checkpointing && u >= 1 && u <= L ? fwd_flops[u] : 0);
      tb.EndMoment(Ns(flops, s.device_flops));
    }
    for (uint32_t g = 0; g < groups; ++g) {
      if (!grad_touched[g]) continue;
      tb.BeginMoment("opt:g" + std::to_string(g), MomentKind::kOptimizerStep);
      tb.Access(chunk_id(g, 1), AccessMode::kRead, TierKind::kHost);
      tb.Access(chunk_id(g, 0), AccessMode::kReadWrite, TierKind::kHost);
      tb.Access(chunk_id(g, 2), AccessMode::kReadWrite, TierKind::kHost);
      tb.Access(chunk_id(g, 3), AccessMode::kReadWrite, TierKind::kHost);
      tb.SetWorkElems(group_used[g]);
      tb.EndMoment(Ns(static_cast<double>(group_used[g]), s.cpu_optim_elems_per_s));
    }
  }
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
