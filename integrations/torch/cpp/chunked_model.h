// tiermem::torch::ChunkedModel — the LibTorch (C++) API of tiermem: an adapter over the
// torch-free session core (runtime/session.h), like the Python package.
//
// C++ modules have no forward hooks and C++ autograd has no saved-tensor hooks, so the model
// says explicitly which *unit* (a submodule and the code that uses its parameters, what the
// Python package's hooks find by themselves: docs/architecture.md's glossary) runs when:
//
//   auto created = tiermem::torch::ChunkedModel::Create(*model, config);   // StatusOr
//   auto& cm = **created;
//   for (...) {
//     auto x = cm.Run(*model->blocks[i], [&](const auto& in) {
//       return model->blocks[i]->forward(in[0]);
//     }, {x});                                                        // StatusOr<Tensor>
//     ...
//     cm.ScaleLoss(loss).backward();   // (fp16: the loss scale; else the identity)
//     cm.Step();  cm.ZeroGrad();
//   }
//
// Create packs every parameter of the model (registration order; a parameter shared by
// several modules, e.g. tied embeddings, once) into the session's chunk groups, writes the
// values, and replaces each parameter's data by a placeholder of its shape filled with NaN.
// Run(unit, fn, inputs) acquires the unit's chunks on the device tier, makes each of
// its parameters' data a view of its chunk, runs fn *without* recording a graph, then releases
// the chunks and restores the placeholders. Backward is correct without keeping the chunks
// resident: the unit is a custom autograd function whose backward re-acquires the chunks,
// recomputes fn with grad enabled (activation checkpointing) and backpropagates through it;
// parameter gradients are added into the grad chunks. Step() hands the per-group
// hyper-parameters to the session, which runs AdamW (clipping, accumulation, fp16 loss
// scaling) on the fused CPU kernels.
//
// What the core gives both bindings: fp32, bf16 and fp16 (params compute in bf16/fp16 with
// fp32 masters on the host; fp16 with dynamic loss scaling), several param groups with their
// own hyper-parameters, LR changes between steps (SetLearningRate), checkpoints (Save/Load,
// the session's checksummed format), pretrained weights in and out (PretrainedWeights at
// Create, SaveWeights: safetensors files and Hugging Face directories, runtime/weights.h),
// the TIERMEM_* environment, the timeline.
//
// Rules for fn: it must compute the same thing twice (it runs twice: forward and recompute);
// RNG from torch's default CPU generator (dropout, rand) is fine — the recompute runs from the
// generator state the forward found, as torch.utils.checkpoint does, and leaves the generator
// where it was — but a generator of fn's own is not replayed. It must read parameters only of
// `unit` (any other managed parameter reads NaN,
// so a violation shows as a NaN loss at once, never as plausible numbers), take the
// activations that need gradients through `inputs`, and return a new tensor.
// Under ::torch::NoGradGuard, Run just runs fn on the chunk views (eval / inference), with
// untraced acquires that do not disturb the order training replays.
//
// Devices: SimDevice only for now — a config that resolves to the CUDA tier is
// kUnimplemented (the Python package has the CUDA path).
//
// Errors: Status/StatusOr for everything recoverable; no exception crosses the API except
// torch's own (c10::Error) — from fn itself, and from backward, which cannot return a Status
// and reports a session failure as c10::Error.
// Thread-safety: externally synchronized (the training thread), like the model.
// Ownership: the model must outlive this object; this object must outlive every autograd
// graph built by Run. Close() (or destruction) gives the parameters back as ordinary tensors
// holding their current values.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "runtime/session.h"
#include "runtime/unit_protocol.h"

namespace tiermem::torch {

// A torch::optim-style parameter group: its tensors and the AdamW hyper-parameters that
// differ from the config's (unset = the config's optimizer.* value).
struct ParamGroup {
  std::vector<::torch::Tensor> params;
  std::optional<double> lr, beta1, beta2, eps, weight_decay;
};

// Statistics of the run so far. `timeline` is computed by tiermem::prof from the binary
// timeline file (not from counters the engine keeps about itself).
struct Stats {
  prof::Report timeline;
  chunks::EngineStats counters;               // the chunk engine's own counters
  Bytes device_budget = 0;                    // 0 in host mode (no device tier)
  TierKind compute_tier = TierKind::kDevice;  // kHost in host mode (device_kind "host")
  Bytes peak(TierKind tier) const { return timeline.tiers[static_cast<int>(tier)].peak.bytes; }
};

// Pretrained weights loaded at Create (docs/pretrained.md): a .safetensors file or a Hugging
// Face checkpoint directory whose keys are the model's parameter names (a tied parameter's
// other names accepted) and buffer names, streamed into the chunks (every header checked
// first: a bad checkpoint is kInvalidArgument naming the key and file, the model untouched).
struct PretrainedWeights {
  std::string path;  // empty: none (the parameters' own values)
  // False: parameters and buffers the checkpoint lacks keep the model's values (logged once).
  bool strict = true;
};

// SaveWeights: Hugging Face's layout (a directory), or one file for a path ending in
// ".safetensors"; the fp32 values, or rounded to `dtype` (kBFloat16 / kHalf, nearest even,
// floating buffers too).
struct SaveWeightsOptions {
  uint64_t max_shard_bytes = 5'000'000'000;
  std::optional<::torch::Dtype> dtype;
};

class ChunkedModel {
 public:
  using UnitFn = std::function<::torch::Tensor(const std::vector<::torch::Tensor>&)>;
  // The earlier spelling ("segment" for a unit), kept for programs written against it.
  using SegmentFn [[deprecated("tiermem: use ChunkedModel::UnitFn")]] = UnitFn;

  // kInvalidArgument: bad config key/value (the TIERMEM_* environment applies), a non-fp32
  // or non-CPU parameter, no parameters, bad groups (a tensor in no group, in two, frozen or
  // not managed: the session's rule and messages, runtime/param_groups.h); kUnimplemented: a CUDA
  // device; kResourceExhausted: a device budget below the minimum (the message names the minimum
  // bytes) or no host/NVMe room. `groups` empty: one group of every trainable parameter. On failure
  // the model is untouched.
  static StatusOr<std::unique_ptr<ChunkedModel>> Create(::torch::nn::Module& model,
                                                        const nlohmann::json& config,
                                                        std::vector<ParamGroup> groups = {},
                                                        const PretrainedWeights& weights = {});
  ~ChunkedModel();
  ChunkedModel(const ChunkedModel&) = delete;
  ChunkedModel& operator=(const ChunkedModel&) = delete;

  // Runs fn(inputs) with `unit`'s parameters materialized from chunks on the device tier
  // (see the rules above). kInvalidArgument if `unit` has a parameter this model does not
  // manage or fn returns an undefined tensor; kResourceExhausted if its chunks do not fit in
  // the device budget together; kFailedPrecondition after Close() or inside another Run.
  StatusOr<::torch::Tensor> Run(::torch::nn::Module& unit, const UnitFn& fn,
                                std::vector<::torch::Tensor> inputs = {});

  // `loss` times the fp16 loss scale (the identity in fp32 / bf16): backward this.
  ::torch::Tensor ScaleLoss(const ::torch::Tensor& loss) const;
  // One AdamW step over every parameter with a gradient (every N-th call with gradient
  // accumulation N). True when it updated; false between accumulation micro-steps and when
  // an fp16 overflow skipped it (the loss scale is lowered).
  StatusOr<bool> Step();
  // Clears the gradients (lazily: no bytes move). A no-op inside an accumulation window.
  Status ZeroGrad();
  // sqrt(sum of squares) of every (unscaled) gradient (the kernels' GradNormAndOverflow).
  StatusOr<double> GradNorm();
  double loss_scale() const { return session_->optimizer().loss_scale(); }

  // Optimizer groups: their count, and the hyper-parameters the next Step uses.
  size_t num_groups() const { return hyper_.size(); }
  const session::GroupHyper& group_options(size_t g) const { return hyper_.at(g); }
  Status SetGroupOptions(size_t g, const session::GroupHyper& h);
  Status SetLearningRate(size_t g, double lr);

  // A consolidated copy (an ordinary fp32 tensor) of a managed parameter's current value.
  StatusOr<::torch::Tensor> ParamValue(const ::torch::Tensor& param);
  // Its accumulated gradient (kNotFound if it has none; unscaled in fp16).
  StatusOr<::torch::Tensor> Grad(const ::torch::Tensor& param);
  // Its Adam state: `kind` "exp_avg" or "exp_avg_sq".
  StatusOr<::torch::Tensor> OptimizerState(const ::torch::Tensor& param, const std::string& kind);

  // Checkpoints: every parameter's fp32 value, the Adam state, step counts, the loss scale,
  // the groups' hyper-parameters, torch's default CPU generator state and `extra` (any JSON),
  // in the session's checksummed format (atomic rename) — the format the Python package
  // writes and reads too (runtime/checkpoint_meta.h), so either binding resumes the other's.
  // Load verifies the whole file (and that it has as many param groups as this model) before
  // changing anything, then sets the groups' hyper-parameters and the generator state (when
  // the file has one) and gives back `extra`.
  Status Save(const std::string& path, const nlohmann::json& extra = nullptr);
  Status Load(const std::string& path, nlohmann::json* extra = nullptr);

  // Writes every parameter (under its first name) and buffer, streamed from the chunks, in
  // the layout PretrainedWeights reads (see SaveWeightsOptions).
  Status SaveWeights(const std::string& path, const SaveWeightsOptions& options = {});

  StatusOr<Stats> GetStats();

  // Gives every parameter back as an ordinary tensor with its current value and frees the
  // chunks; the timeline file is complete afterwards. Idempotent.
  Status Close();

  const session::SessionConfig& config() const { return session_->config(); }
  uint64_t chunk_elems() const { return session_->layout().chunk_elems; }
  size_t num_chunk_groups() const { return session_->layout().num_groups(); }
  // Every chunk byte of tensor data: params (+ fp32 masters) + grads + AdamW state.
  Bytes model_bytes() const { return session_->layout().model_bytes; }
  const std::string& timeline_path() const { return session_->timeline_path(); }
  session::Session& session() { return *session_; }

 private:
  struct ParamRec {
    ::torch::Tensor param;  // the module's parameter (its data is swapped)
    std::string name;
    std::vector<int64_t> shape;
    size_t index = 0;  // tensor index in the session
  };
  friend struct UnitFunction;
  friend struct UnitCall;

  ChunkedModel() = default;
  // Writes every parameter's value into the session: from `weights` (the parameters it lacks,
  // strict = false, from the model), else from the model; `buffers` gets the checkpoint's
  // values of the model's buffers, (buffer, value), copied in once nothing can fail.
  Status WriteValues(::torch::nn::Module& model, const PretrainedWeights& weights,
                     std::vector<std::pair<::torch::Tensor, ::torch::Tensor>>* buffers);
  StatusOr<std::vector<ParamRec*>> UnitParams(::torch::nn::Module& unit);
  // `unit`'s index in the unit protocol, declared at its first Run (`params`: its parameters).
  StatusOr<uint32_t> UnitIndex(::torch::nn::Module& unit, const std::vector<ParamRec*>& params);
  // Acquires the compute chunks of `params`' groups on the device tier and makes each
  // param's data a view of its chunk; `views` gets (group, base view) of each pin.
  Status Materialize(const std::vector<ParamRec*>& params,
                     std::vector<std::pair<size_t, ::torch::Tensor>>* views);
  // Releases what Materialize pinned and restores the placeholders.
  Status Dematerialize(const std::vector<ParamRec*>& params,
                       std::vector<std::pair<size_t, ::torch::Tensor>>* views);
  // Adds `grad` into the grad chunk of `p` (copies it when p has no gradient yet).
  Status AccumulateGrad(ParamRec* p, const ::torch::Tensor& grad);
  ::torch::Tensor View(void* addr, size_t group, session::ChunkKind kind) const;
  StatusOr<ParamRec*> Find(const ::torch::Tensor& param);
  ::torch::Tensor Placeholder(const ParamRec& p) const;
  ::torch::Dtype compute_dtype() const;

  ::torch::nn::Module* model_ = nullptr;  // must outlive this object
  std::unique_ptr<session::Session> session_;
  // The unit protocol over session_ (runtime/unit_protocol.h): every Run's iteration, moment
  // and deferred updates, and the backward's moments. Declared after session_ (destroyed first).
  std::unique_ptr<session::UnitProtocol> protocol_;
  std::unordered_map<const ::torch::nn::Module*, uint32_t> unit_index_;  // unit -> its index
  std::vector<std::unique_ptr<ParamRec>> params_;
  std::unordered_map<const void*, ParamRec*> by_impl_;  // TensorImpl* -> param
  std::vector<session::GroupHyper> hyper_;
  bool closed_ = false;
  bool in_run_ = false;
  ::torch::Tensor dummy_;  // requires grad: makes every unit output part of the graph
};

}  // namespace tiermem::torch
