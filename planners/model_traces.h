// Synthetic traces from model shapes: GPT-style training (optionally with activation
// checkpointing, tied embeddings, mixture-of-experts blocks with sparse expert use), recorded
// through TraceBuilder exactly as the runtime would record them. The canonical traces in
// tests/data/ are made by `tiermem plan synth` over these (tests/data/make_traces.sh).
//
// The model: units embed, blocks.0..L-1, head. Tensors are packed in first-use order into
// chunk groups of `chunk_elems` fp32 elements by the session's packer (PackPieces,
// layout/chunk_layout.h): a tensor never straddles chunks unless it is larger than one, then
// it is pieces of whole rows, the first filling the current chunk's rest; with experts each
// expert's tensors are in a chunk of their own, and the chunk is the size of one expert (so
// the embeddings are pieces); each group
// has a param and a grad chunk of chunk_elems * 4 bytes and an exp_avg and exp_avg_sq chunk of
// chunk_elems * state_bytes_per_elem (4 for fp32 state; 2 for bf16; 1 + 4/256 for int8
// with blocks of 256: optimizer.state_dtype, kernels/cpu/optim.h). Per iteration:
//   pre-forward of every unit: its groups' param chunks, read on the device;
//   pre-backward in reverse: param chunks read, grad chunks written (write on the first
//     touch of the iteration: zeroed lazily; read-write after) on the device;
//   an optimizer sub-step per group whose grads were written: grad read, param / exp_avg /
//     exp_avg_sq read-write on the host (CPU AdamW, as today's engine runs it).
// Compute: 2 flops per parameter per token (+ attention 4 * T * d per token and block)
// forward, twice that backward, plus the forward again with checkpointing, at `device_flops`.
// Activations (fp32): a block saves 16 * d per token plus 2.5 * heads * T per token of
// attention (2 * d per token: just its input, when checkpointed; the backward then holds the
// full set as temporaries); embed saves its output; head keeps its logits (V per token) as
// temporaries of its forward and backward. MoE blocks route every token to the same `top_k`
// of `experts` per layer and iteration (drawn with `seed`): sparse expert use.
//
// Thread-safety: pure.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"
#include "planners/trace.h"

namespace tiermem::planners {

struct ModelShape {
  std::string name = "gpt";
  uint32_t layers = 12;
  uint64_t d_model = 768;
  uint32_t heads = 12;
  uint64_t vocab = 32000;
  uint64_t seq = 1024;
  uint64_t batch = 8;
  bool tied_embeddings = false;
  bool checkpointing = false;
  uint32_t experts = 0;             // > 0: every block's MLP is `experts` experts
  uint32_t top_k = 2;               // experts used per block and iteration
  bool mark_experts = true;         // mark the experts' chunks as expert-set members
  uint64_t chunk_elems = 0;         // 0: the largest tensor (with experts: one expert)
  double state_bytes_per_elem = 4;  // m and v each (the optimizer-state format's size)
  uint32_t iterations = 2;
  uint64_t seed = 1;
  // The machine the times and rates are modelled for (an H200-class node by default).
  double device_flops = 200e12;
  double cpu_optim_elems_per_s = 10e9;
  double device_optim_elems_per_s = 150e9;
  double pcie_bytes_per_s = 50e9;  // host<->device, each direction
  double nvme_read_bytes_per_s = 6e9, nvme_write_bytes_per_s = 4e9;
  uint32_t cpu_cores = 32;
};

StatusOr<Trace> ModelTrace(const ModelShape& shape);

// Named canonical shapes: "gpt", "gpt-ckpt", "gpt-tied", "moe". kNotFound otherwise.
StatusOr<ModelShape> CanonicalShape(const std::string& name);

}  // namespace tiermem::planners
