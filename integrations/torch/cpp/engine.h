// tiermem::torch::Engine — the LibTorch (C++) API of tiermem.
//
// C++ modules have no forward hooks and C++ autograd has no saved-tensor hooks, so the model
// says explicitly which *segment* (a submodule and the code that uses its parameters) runs
// when:
//
//   auto engine = tiermem::torch::Engine::Create(model, config);   // StatusOr
//   for (...) {
//     auto x = (*engine)->Run(*model->blocks[i], [&](const auto& in) {
//       return model->blocks[i]->forward(in[0]);
//     }, {x});                                                        // StatusOr<Tensor>
//     ...
//     loss.backward();
//     (*engine)->Step();  (*engine)->ZeroGrad();
//   }
//
// Create packs every parameter of the model (module registration order; a parameter shared
// by several modules, e.g. tied embeddings, once) into chunk groups — param, grad, Adam m,
// Adam v chunks at the same offsets — homed on the host tier (or NVMe), and replaces each
// parameter's data by a zero-byte placeholder of its shape. Run(segment, fn, inputs)
// acquires the segment's param chunks on the device tier, makes each parameter's data a
// view of its chunk, runs fn *without* recording a graph, then releases the chunks and
// restores the placeholders. Backward is correct without keeping the chunks resident
// between forward and backward: the segment is a custom autograd function whose backward
// re-acquires the chunks, recomputes fn with grad enabled (activation checkpointing) and
// backpropagates through it; parameter gradients are added into the grad chunks on the
// device tier. Step() runs the fused AdamW CPU kernel (tiermem::kernels_cpu, equal to
// torch::optim::AdamW within its documented tolerance) on the host copies of the chunks.
//
// Rules for fn: it must be deterministic (it runs twice: forward and recompute — no dropout
// or other RNG), read parameters only of `segment` (others are placeholders: zeros), take
// the activations that need gradients through `inputs` (captured tensors get no gradient,
// and must not be modified in place before backward), and return a new tensor.
// Under torch::NoGradGuard, Run just runs fn on the chunk views (eval / inference).
//
// Semantics and limits: fp32 training only (config "precision": "bf16"/"fp16" →
// kUnimplemented); one optimizer param group with the config's AdamW hyper-parameters
// (frozen params — requires_grad false — get no grad or optimizer chunks);
// gradient_accumulation_steps N: only every N-th Step() updates and only the ZeroGrad()
// after it clears; gradient_clipping by global norm like torch::nn::utils::clip_grad_norm_.
// The device tier is SimDevice (CPU tensors) — "device_kind": "cuda" is refused for now.
//
// Errors: Status/StatusOr for everything recoverable; no exception crosses the API except
// torch's own (c10::Error) — from fn itself, and from backward, which cannot return a
// Status and reports an engine failure as c10::Error.
// Thread-safety: externally synchronized (the training thread), like the model.
// Ownership: the model must outlive the engine; the engine must outlive every autograd
// graph built by Run. Close() (or destruction) gives the parameters back as ordinary tensors
// holding their current values.
#pragma once

#include <torch/torch.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "integrations/torch/common/config.h"
#include "integrations/torch/common/runtime_stack.h"
#include "runtime/base/status.h"

namespace tiermem::torch {

// Statistics of the run so far. `timeline` is computed by tiermem::prof from the binary
// timeline file (not from counters the engine keeps about itself).
struct EngineStats {
  prof::Report timeline;
  engine::EngineStats counters;  // the chunk engine's own counters
  Bytes device_budget = 0;
  Bytes peak(TierKind tier) const { return timeline.tiers[static_cast<int>(tier)].peak.bytes; }
};

class Engine {
 public:
  using SegmentFn = std::function<::torch::Tensor(const std::vector<::torch::Tensor>&)>;

  // kInvalidArgument: bad config key/value, a non-fp32 or non-CPU parameter, no parameters;
  // kUnimplemented: precision other than fp32, device_kind "cuda"; kResourceExhausted: a
  // device budget below the minimum (the message names the minimum bytes) or no host/NVMe
  // room. On failure the model is untouched.
  static StatusOr<std::unique_ptr<Engine>> Create(::torch::nn::Module& model,
                                                  const nlohmann::json& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Runs fn(inputs) with `segment`'s parameters materialized from chunks on the device tier
  // (see the rules above). kInvalidArgument if `segment` has a parameter the engine does not
  // manage or fn returns an undefined tensor; kResourceExhausted if its chunks do not fit in
  // the device budget together; kFailedPrecondition after Close() or inside another Run.
  StatusOr<::torch::Tensor> Run(::torch::nn::Module& segment, const SegmentFn& fn,
                                std::vector<::torch::Tensor> inputs = {});

  // One AdamW step over every chunk group that has gradients (every N-th call with
  // gradient accumulation N). Returns true when it updated.
  StatusOr<bool> Step();
  // Clears the grad chunks (lazily: no bytes move). A no-op between accumulation micro-steps.
  Status ZeroGrad();
  // sqrt(sum of squares) of every gradient (the kernels' GradNormAndOverflow).
  StatusOr<double> GradNorm();

  // A consolidated copy (an ordinary tensor) of a managed parameter's current value.
  StatusOr<::torch::Tensor> ParamValue(const ::torch::Tensor& param);
  // Its accumulated gradient (zeros before any backward).
  StatusOr<::torch::Tensor> Grad(const ::torch::Tensor& param);
  // Its Adam state: `kind` "exp_avg" or "exp_avg_sq".
  StatusOr<::torch::Tensor> OptimizerState(const ::torch::Tensor& param, const std::string& kind);

  StatusOr<EngineStats> Stats();

  // Gives every parameter back as an ordinary tensor with its current value and frees the
  // chunks; the timeline file is complete afterwards. Idempotent; later calls but Stats-free
  // accessors return kFailedPrecondition.
  Status Close();

  const torch_common::TorchConfig& config() const { return cfg_; }
  uint64_t chunk_elems() const { return chunk_elems_; }
  size_t num_groups() const { return groups_.size(); }
  // params + grads + AdamW state (+ frozen params), bytes.
  Bytes model_bytes() const { return model_bytes_; }
  const std::string& timeline_path() const { return stack_->timeline_path(); }

 private:
  struct ParamRec {
    ::torch::Tensor param;  // the module's parameter (its data is swapped)
    std::string name;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    bool trainable = false;
    int group = -1;
    int64_t offset = 0;  // elements, in every chunk of the group
    int64_t step = 0;    // AdamW steps taken
    bool has_grad = false;
  };
  struct Group {
    bool trainable = false;
    int64_t used = 0;                        // elements (end of the last param)
    std::array<ChunkId, 4> chunks{};         // by kind: param, grad, exp_avg, exp_avg_sq
    std::vector<ParamRec*> params;
  };
  friend struct SegmentFunction;
  friend struct SegmentCall;

  Engine() = default;
  Status Init(::torch::nn::Module& model);
  // The managed params of `segment` (deduplicated), or kInvalidArgument.
  StatusOr<std::vector<ParamRec*>> SegmentParams(::torch::nn::Module& segment);
  // Acquires the param chunks of `params`' groups on the device tier and makes each param's
  // data a view of its chunk; `views` gets (group, base view) of each pin.
  Status Materialize(const std::vector<ParamRec*>& params,
                     std::vector<std::pair<int, ::torch::Tensor>>* views);
  // Releases what Materialize pinned and restores the placeholders.
  Status Dematerialize(const std::vector<ParamRec*>& params,
                       std::vector<std::pair<int, ::torch::Tensor>>* views);
  // Adds `grad` into the grad chunk of `p` on the device tier.
  Status AccumulateGrad(ParamRec* p, const ::torch::Tensor& grad);
  StatusOr<::torch::Tensor> Acquire(int group, int kind, TierKind tier);
  Status ReleaseChunk(int group, int kind, bool modified);
  StatusOr<::torch::Tensor> SliceCopy(const ParamRec& p, int kind);
  ::torch::Tensor Placeholder(const ParamRec& p) const;

  torch_common::TorchConfig cfg_;
  std::unique_ptr<torch_common::RuntimeStack> stack_;
  std::vector<std::unique_ptr<ParamRec>> params_;
  std::unordered_map<const void*, ParamRec*> by_impl_;  // TensorImpl* -> param
  std::vector<Group> groups_;
  uint64_t chunk_elems_ = 0;
  Bytes model_bytes_ = 0;
  bool own_timeline_ = false;
  bool closed_ = false;
  bool in_run_ = false;
  bool in_iteration_ = false;
  int micro_ = 0;
  bool stepped_ = true;
  ::torch::Tensor dummy_;  // requires grad: makes every segment output part of the graph
};

}  // namespace tiermem::torch
