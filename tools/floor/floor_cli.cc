// `tiermem floor --layers N --hidden H --intermediate I --vocab V [--heads A] [--kv-heads K]
// [--tied] [--precision fp32|bf16|fp16] [--serve]`: the minimum budgets of a Llama-shaped model
// (Hugging Face LlamaForCausalLM's parameters, in its order), computed by the session's own
// sizing rules (runtime/host_floor.h) without building anything. docs/configuration.md
// "The floors of a model".
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "base/units.h"
#include "layout/chunk_layout.h"
#include "runtime/host_floor.h"
#include "runtime/layout.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

struct LlamaShape {
  int64_t layers = 0, hidden = 0, intermediate = 0, vocab = 0, heads = 0, kv_heads = 0;
  bool tied = false;
};

struct Named {
  std::string name;
  int64_t rows = 0, cols = 1;  // cols 1: a vector
  std::vector<int> units;      // the units computing with it, as the Python package finds them
};

// LlamaForCausalLM's parameters in named_parameters() order, with the units the Python package
// makes of it (units.py): the embedding 0, decoder layer l l + 1, the final norm L + 1 and the
// head L + 2 (a tied head computes with the embedding's weight: both units name it).
std::vector<Named> LlamaTensors(const LlamaShape& s) {
  const int64_t head_dim = s.hidden / s.heads;
  const int64_t kv = s.kv_heads * head_dim;
  const int layers = static_cast<int>(s.layers);
  const int head_unit = layers + 2;
  std::vector<Named> t = {{"model.embed_tokens.weight", s.vocab, s.hidden, {0}}};
  if (s.tied) t[0].units.push_back(head_unit);
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::vector<int> u = {l + 1};
    t.push_back({p + "self_attn.q_proj.weight", s.hidden, s.hidden, u});
    t.push_back({p + "self_attn.k_proj.weight", kv, s.hidden, u});
    t.push_back({p + "self_attn.v_proj.weight", kv, s.hidden, u});
    t.push_back({p + "self_attn.o_proj.weight", s.hidden, s.hidden, u});
    t.push_back({p + "mlp.gate_proj.weight", s.intermediate, s.hidden, u});
    t.push_back({p + "mlp.up_proj.weight", s.intermediate, s.hidden, u});
    t.push_back({p + "mlp.down_proj.weight", s.hidden, s.intermediate, u});
    t.push_back({p + "input_layernorm.weight", s.hidden, 1, u});
    t.push_back({p + "post_attention_layernorm.weight", s.hidden, 1, u});
  }
  t.push_back({"model.norm.weight", s.hidden, 1, {layers + 1}});
  if (!s.tied) t.push_back({"lm_head.weight", s.vocab, s.hidden, {head_unit}});
  return t;
}

std::string Shape(const Named& n) {
  return n.cols == 1 ? std::to_string(n.rows)
                     : std::to_string(n.rows) + " x " + std::to_string(n.cols);
}

// The most chunk groups one unit pins at `chunk_elems` when serving (0 when training: its room
// does not depend on them), as the session sizes the room.
StatusOr<size_t> UnitPinGroups(const std::vector<chunks::PackTensor>& packed,
                               const session::HostSizingInputs& in, uint64_t chunk_elems) {
  if (in.trainable) return size_t{0};
  TIERMEM_ASSIGN_OR_RETURN(const chunks::PieceLayout pieces,
                           chunks::PackPieces(packed, chunk_elems, in.align_elems));
  return session::MostPinGroups(session::UnitsOf(in.units, {}, pieces.pieces));
}

std::string Both(Bytes b) { return FormatBytes(b) + " (" + std::to_string(b) + " bytes)"; }

int Run(const LlamaShape& shape, const std::string& precision, bool serve) {
  if (shape.layers < 1 || shape.hidden < 1 || shape.intermediate < 1 || shape.vocab < 1 ||
      shape.heads < 1 || shape.kv_heads < 1 || shape.hidden % shape.heads != 0) {
    std::cerr << "tiermem floor: every size must be >= 1 and --hidden a multiple of --heads\n";
    return 2;
  }
  if (precision != "fp32" && precision != "bf16" && precision != "fp16") {
    std::cerr << "tiermem floor: --precision '" << precision << "': fp32, bf16 or fp16\n";
    return 2;
  }
  const std::vector<Named> named = LlamaTensors(shape);
  std::vector<chunks::PackTensor> packed;
  for (const Named& n : named) {
    chunks::PackTensor p;
    p.numel = static_cast<uint64_t>(n.rows * n.cols);
    p.rows = static_cast<uint64_t>(n.rows);
    packed.push_back(p);
  }
  session::HostSizingInputs in;
  in.compute_esize = precision == "fp32" ? 4 : 2;
  in.per_elem = in.compute_esize * (serve ? 1 : 2);
  in.align_elems = chunks::kAlignElems;
  in.trainable = !serve;
  in.nvme = true;
  for (const Named& n : named) in.units.push_back(n.units);  // serving's room by unit
  StatusOr<session::ModelFloors> f = session::ComputeModelFloors(packed, in);
  if (!f.ok()) {
    std::cerr << "tiermem floor: " << f.status().ToString() << "\n";
    return 1;
  }
  uint64_t params = 0;
  for (const chunks::PackTensor& p : packed) params += p.numel;
  const session::HostSizing& hs = f->host_at_sufficient;
  StatusOr<size_t> unit_groups = UnitPinGroups(packed, in, hs.chunk_elems);
  if (!unit_groups.ok()) {
    std::cerr << "tiermem floor: " << unit_groups.status().ToString() << "\n";
    return 1;
  }
  std::cout << "model: Llama " << shape.layers << " x " << shape.hidden << ", vocabulary "
            << shape.vocab << ", " << params << " params, " << precision << ", "
            << (serve ? "served" : "trained (AdamW, fp32 state)") << "\n";
  std::cout << "host mode with NVMe: a host budget of " << Both(f->host_sufficient) << " is enough";
  if (hs.room_tensor >= 0) {
    const Named& t = named[static_cast<size_t>(hs.room_tensor)];
    std::cout << "; tensor '" << t.name << "' (" << Shape(t)
              << ") sets it: " << FormatBytes(hs.compute_room) << " for its compute copies, plus "
              << FormatBytes(hs.reserve) << " of room for chunks in use (" << hs.pinned_chunks
              << " of its pieces, pinned at a time while its copy is assembled, and "
              << session::HostReserveChunks(in.trainable, *unit_groups) << " more, of "
              << FormatBytes(hs.chunk_elems * 4) << ")";
  }
  std::cout << "\n";
  std::cout << "host mode with tensors kept whole (before splitting): " << Both(f->host_whole)
            << "\n";
  const Named& row = named[f->device_row_tensor];
  const Named& largest = named[f->largest_tensor];
  std::cout << "device mode: a device budget of at least " << Both(f->device_minimum)
            << " (4 chunks of a row of tensor '" << row.name << "' (" << Shape(row)
            << ")); beside it on the device, up to " << FormatBytes(f->device_split_copies)
            << " of compute copies of split tensor '" << largest.name << "' (" << Shape(largest)
            << ") while its unit computes, and the activations\n";
  return 0;
}

}  // namespace

void RegisterFloor(CLI::App& app) {
  auto shape = std::make_shared<LlamaShape>();
  auto precision = std::make_shared<std::string>("fp32");
  auto serve = std::make_shared<bool>(false);
  CLI::App* floor = app.add_subcommand(
      "floor", "the minimum host and device budgets of a Llama-shaped model (no model built)");
  floor->add_option("--layers", shape->layers, "decoder layers")->required();
  floor->add_option("--hidden", shape->hidden, "hidden size")->required();
  floor->add_option("--intermediate", shape->intermediate, "MLP intermediate size")->required();
  floor->add_option("--vocab", shape->vocab, "vocabulary size")->required();
  floor->add_option("--heads", shape->heads, "attention heads (default: hidden / 64)");
  floor->add_option("--kv-heads", shape->kv_heads, "key/value heads (default: --heads)");
  floor->add_flag("--tied", shape->tied, "the head shares the embedding");
  floor->add_option("--precision", *precision, "fp32, bf16 or fp16 (default fp32)");
  floor->add_flag("--serve", *serve, "served (no gradients nor optimizer state)");
  floor->callback([shape, precision, serve] {
    if (shape->heads == 0) shape->heads = std::max<int64_t>(1, shape->hidden / 64);
    if (shape->kv_heads == 0) shape->kv_heads = shape->heads;
    const int code = Run(*shape, *precision, *serve);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace tiermem::tools
