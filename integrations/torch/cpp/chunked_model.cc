// tiermem::torch::ChunkedModel (see chunked_model.h for the API and its rules).
//
// Invariants:
//  - Outside Run/backward every managed parameter's data is a NaN placeholder of its shape
//    (an expanded 0-d NaN): no tensor the user can reach aliases chunk memory, so a chunk may
//    move whenever it is unpinned. Inside, the data of the unit's parameters are views of
//    their compute chunks on the device tier, pinned by one Acquire per group; Dematerialize
//    restores the placeholders before it releases the pins (also when fn throws).
//  - A unit's forward runs with grad disabled (autograd Function), so no graph holds chunk
//    memory; its output is cloned when it would alias a chunk. Its backward rebuilds the
//    unit's graph (re-acquire, recompute fn with grad, autograd::grad to the inputs and the
//    parameters) and adds the parameter gradients into the grad chunks on the device tier.
//    The unit call (fn, params) is owned by the autograd node (a capsule in saved_data).
//  - Every unit output takes a `dummy_` tensor that requires grad as an extra input, so
//    a unit whose inputs need no grad (the embedding) still gets a backward.
//  - The session's has_grad flag of a tensor says its grad chunk span holds its gradient
//    since the last effective ZeroGrad; the first gradient after that is copied, later ones
//    added (torch's accumulation semantics).
#include "integrations/torch/cpp/chunked_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "base/logging.h"
#include "integrations/torch/cpp/dtypes.h"
#include "integrations/torch/cpp/torch_pool.h"
#include "integrations/torch/cpp/weight_tensors.h"
#include "runtime/param_groups.h"
#include "runtime/tier_stack.h"
#include "runtime/weights.h"

namespace tiermem::torch {
namespace {

using session::ChunkKind;

// Throws a torch error for a failed Status where no Status can be returned (backward).
void CheckOk(const Status& s) { TORCH_CHECK(s.ok(), "tiermem: ", s.ToString()); }

using torch_dtypes::TorchDType;

bool Aliases(const ::torch::Tensor& out,
             const std::vector<std::pair<size_t, ::torch::Tensor>>& views) {
  if (!out.defined() || !out.has_storage() || out.numel() == 0) return false;
  const char* p = static_cast<const char*>(out.storage().data());
  for (const auto& [g, base] : views) {
    const char* b = static_cast<const char*>(base.data_ptr());
    if (p >= b && p < b + base.nbytes()) return true;
  }
  return false;
}

}  // namespace

// One unit call, owned by its autograd node.
struct UnitCall : ::torch::CustomClassHolder {
  ChunkedModel* model = nullptr;
  std::vector<ChunkedModel::ParamRec*> params;
  ChunkedModel::UnitFn fn;
  std::vector<bool> input_requires_grad;
  std::vector<std::pair<size_t, ::torch::Tensor>>* views = nullptr;  // forward only
  uint32_t unit = 0;  // its index in the session's unit protocol
  // torch's default CPU generator as fn's forward run found it: the recompute in the
  // backward runs from the same state (then puts the generator back), so dropout and other
  // RNG in fn draw the same numbers twice, as torch.utils.checkpoint's preserve_rng_state.
  ::torch::Tensor rng_state;
};

namespace {

// The default CPU generator's state, and setting it, under the generator's lock.
::torch::Tensor CpuRngState() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void SetCpuRngState(const ::torch::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

struct UnitFunction : public ::torch::autograd::Function<UnitFunction> {
  static ::torch::Tensor forward(::torch::autograd::AutogradContext* ctx,
                                 const c10::intrusive_ptr<UnitCall>& call,
                                 const ::torch::Tensor& dummy, ::torch::TensorList inputs) {
    std::vector<::torch::Tensor> in(inputs.begin(), inputs.end());
    ctx->save_for_backward(in);
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    call->rng_state = CpuRngState();
    ::torch::Tensor out = call->fn(in);
    TORCH_CHECK(out.defined(), "tiermem: the unit function returned an undefined tensor");
    return Aliases(out, *call->views) ? out.clone() : out;
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grad_out) {
    auto call = c10::static_intrusive_pointer_cast<UnitCall>(ctx->saved_data["call"].toCapsule());
    ChunkedModel* m = call->model;
    TORCH_CHECK(!m->closed_, "tiermem: backward through a unit of a closed ChunkedModel");
    std::vector<::torch::Tensor> saved = ctx->get_saved_variables();
    std::vector<::torch::Tensor> in, targets;
    std::vector<int> input_target(saved.size(), -1);
    for (size_t i = 0; i < saved.size(); ++i) {
      ::torch::Tensor d = saved[i].detach();
      if (call->input_requires_grad[i]) {
        d.requires_grad_(true);
        input_target[i] = static_cast<int>(targets.size());
        targets.push_back(d);
      }
      in.push_back(d);
    }
    std::vector<ChunkedModel::ParamRec*> trainable;
    for (ChunkedModel::ParamRec* p : call->params) {
      if (m->session_->layout().spec(p->index).trainable) trainable.push_back(p);
    }
    m->session_->iterations().SetTracing(true);
    if (m->session_->iterations().phase() != session::RunPhase::kBackward)
      m->protocol_->EnterBackward();
    m->protocol_->BackwardReached(call->unit);
    std::vector<std::pair<size_t, ::torch::Tensor>> views;
    CheckOk(m->Materialize(call->params, &views));
    ::torch::autograd::variable_list grads;
    const ::torch::Tensor rng_now = CpuRngState();
    try {
      for (ChunkedModel::ParamRec* p : trainable) targets.push_back(p->param);
      ::torch::AutoGradMode enable(true);
      SetCpuRngState(call->rng_state);
      ::torch::Tensor out = call->fn(in);
      SetCpuRngState(rng_now);  // the caller's generator goes on as if fn ran once
      if (!targets.empty() && out.requires_grad()) {
        grads = ::torch::autograd::grad({out}, targets, {grad_out[0]}, /*retain_graph=*/false,
                                        /*create_graph=*/false, /*allow_unused=*/true);
      }
      const size_t first_param = targets.size() - trainable.size();
      for (size_t k = 0; k < trainable.size() && !grads.empty(); ++k) {
        const ::torch::Tensor& g = grads[first_param + k];
        if (g.defined()) CheckOk(m->AccumulateGrad(trainable[k], g));
      }
    } catch (...) {
      SetCpuRngState(rng_now);
      m->Dematerialize(call->params, &views).IgnoreError();
      throw;
    }
    CheckOk(m->Dematerialize(call->params, &views));
    // One gradient per forward input: the call (none), the dummy (none), then the inputs.
    ::torch::autograd::variable_list result(2 + saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      if (input_target[i] >= 0 && !grads.empty()) result[2 + i] = grads[input_target[i]];
    }
    return result;
  }
};

StatusOr<std::unique_ptr<ChunkedModel>> ChunkedModel::Create(::torch::nn::Module& model,
                                                             const nlohmann::json& config,
                                                             std::vector<ParamGroup> groups,
                                                             const PretrainedWeights& weights) {
  TIERMEM_ASSIGN_OR_RETURN(session::SessionConfig cfg, session::ParseConfig(config));
  TIERMEM_ASSIGN_OR_RETURN(const session::DeviceKind device,
                           session::TierStack::ResolveDeviceKind(cfg.device_kind));
  if (session::IsCuda(device)) {
    return UnimplementedError(
        "the LibTorch API runs on the CPU only for now (config 'device_kind' / "
        "TIERMEM_DEVICE resolved to 'cuda'; set it to 'host', or 'sim' for a simulated "
        "device)");
  }
  cfg.device_kind = device;  // host, sim or sim-async (auto without a GPU: host)
  if (session::CountsActivations(cfg.activations)) {
    // Counting (and offloading) saved activations needs saved-tensor hooks, which only the
    // Python binding installs: refused rather than a budget silently not applied.
    return UnimplementedError("config 'activations' / TIERMEM_ACTIVATIONS = '" +
                              std::string(session::ModeName(cfg.activations)) +
                              "': the LibTorch API keeps activations outside the device "
                              "budget only ('outside'); 'budget' and 'offload' are Python-only");
  }
  std::unique_ptr<ChunkedModel> m(new ChunkedModel());
  // Parameters in registration order, each once (tied parameters share one TensorImpl).
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const ::torch::Tensor& t = item.value();
    if (m->by_impl_.count(t.unsafeGetTensorImpl())) continue;
    if (t.scalar_type() != ::torch::kFloat32) {
      return InvalidArgumentError("parameter " + item.key() + " is " +
                                  std::string(c10::toString(t.scalar_type())) +
                                  "; tiermem expects an fp32 model (set 'precision' for "
                                  "bf16/fp16 training)");
    }
    if (!t.device().is_cpu()) {
      return InvalidArgumentError("parameter " + item.key() +
                                  " is not on the CPU; pass a CPU model (tiermem places it)");
    }
    if (t.numel() == 0) return InvalidArgumentError("parameter " + item.key() + " is empty");
    auto rec = std::make_unique<ParamRec>();
    rec->param = t;
    rec->name = item.key();
    rec->shape = t.sizes().vec();
    rec->index = m->params_.size();
    m->by_impl_[t.unsafeGetTensorImpl()] = rec.get();
    m->params_.push_back(std::move(rec));
  }
  if (m->params_.empty()) return InvalidArgumentError("the model has no parameters");
  std::vector<session::TensorSpec> specs;
  for (auto& p : m->params_) {
    specs.push_back(session::TensorSpec{p->name, static_cast<uint64_t>(p->param.numel()),
                                        p->param.requires_grad(), 0, p->param.sizes().vec()});
  }
  // Optimizer groups: the session's rule (param_groups.h), default one group.
  std::optional<std::vector<std::vector<int64_t>>> members;
  if (groups.empty()) {
    groups.push_back(ParamGroup{});
  } else {
    members.emplace();
    for (const ParamGroup& pg : groups) {
      std::vector<int64_t>& mine = members->emplace_back();
      for (const ::torch::Tensor& t : pg.params) {
        auto it = m->by_impl_.find(t.unsafeGetTensorImpl());
        mine.push_back(it == m->by_impl_.end() ? session::kNotAModelTensor
                                               : static_cast<int64_t>(it->second->index));
      }
    }
  }
  TIERMEM_ASSIGN_OR_RETURN(const std::vector<int> group_of,
                           session::AssignParamGroups(specs, members));
  for (size_t i = 0; i < specs.size(); ++i) specs[i].opt_group = group_of[i];
  for (const ParamGroup& pg : groups) {
    session::GroupHyper h = cfg.optimizer;
    if (pg.lr) h.lr = *pg.lr;
    if (pg.beta1) h.beta1 = *pg.beta1;
    if (pg.beta2) h.beta2 = *pg.beta2;
    if (pg.eps) h.eps = *pg.eps;
    if (pg.weight_decay) h.weight_decay = *pg.weight_decay;
    m->hyper_.push_back(h);
  }
  TIERMEM_ASSIGN_OR_RETURN(m->session_, session::Session::Create(cfg, std::move(specs)));
  m->protocol_ = std::make_unique<session::UnitProtocol>(m->session_.get());
  m->model_ = &model;
  // On failure `m` is destroyed: the session frees everything; the model is untouched.
  std::vector<std::pair<::torch::Tensor, ::torch::Tensor>> buffers;
  if (Status s = m->WriteValues(model, weights, &buffers); !s.ok()) {
    m->closed_ = true;  // the parameters were never taken over: nothing to give back
    return s;
  }
  // Nothing can fail from here on: take over the parameters (and cast floating buffers to the
  // compute dtype, as module.to(dtype) would).
  {
    ::torch::NoGradGuard no_grad;
    for (auto& [b, v] : buffers) b.copy_(v);
  }
  for (auto& p : m->params_) p->param.set_data(m->Placeholder(*p));
  if (m->session_->layout().mixed()) {
    ::torch::NoGradGuard no_grad;
    for (auto& b : model.buffers(/*recurse=*/true)) {
      if (b.is_floating_point()) b.set_data(b.to(m->compute_dtype()));
    }
  }
  m->dummy_ = ::torch::empty({0}).requires_grad_(true);
  return m;
}

Status ChunkedModel::WriteValues(
    ::torch::nn::Module& model, const PretrainedWeights& weights,
    std::vector<std::pair<::torch::Tensor, ::torch::Tensor>>* buffers) {
  auto from_model = [&](const ParamRec& p) {
    ::torch::Tensor v = p.param.detach().reshape(-1).contiguous();
    return session_->values().WriteParam(p.index, v.data_ptr<float>());
  };
  if (weights.path.empty()) {
    for (auto& p : params_) TIERMEM_RETURN_IF_ERROR(from_model(*p));
    return OkStatus();
  }
  TIERMEM_ASSIGN_OR_RETURN(const weights::WeightFiles files, weights::OpenWeights(weights.path));
  // A tied parameter's other names; the buffers, checked before anything loads.
  std::vector<std::vector<std::string>> aliases(params_.size());
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    ParamRec* p = by_impl_.at(item.value().unsafeGetTensorImpl());
    if (p->name != item.key()) aliases[p->index].push_back(item.key());
  }
  std::set<std::string> allowed;
  std::vector<std::string> missing;
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    const weights::TensorInfo* t = files.Find(item.key());
    if (t == nullptr) {
      missing.push_back(item.key());
      continue;
    }
    if (std::vector<int64_t>(t->shape.begin(), t->shape.end()) != item.value().sizes().vec()) {
      return InvalidArgumentError("weights: buffer " + item.key() + ": key '" + item.key() +
                                  "' in " + files.FileOf(item.key()) + " has another shape");
    }
    TIERMEM_ASSIGN_OR_RETURN(::torch::Tensor v, torch_weights::ReadTensor(files, item.key()));
    buffers->emplace_back(item.value(), v.to(item.value().scalar_type()));
    allowed.insert(item.key());
  }
  if (weights.strict && !missing.empty()) {
    return InvalidArgumentError("weights: buffer " + missing[0] + " has no key in " + weights.path +
                                "; load with strict = false to keep its value");
  }
  session::LoadWeightsOptions o;
  o.strict = weights.strict;
  o.ignore = [&allowed](std::string_view k) { return allowed.count(std::string(k)) > 0; };
  TIERMEM_ASSIGN_OR_RETURN(
      const session::LoadWeightsReport report,
      session::LoadWeights(*session_, files,
                           session::TargetsByName(*session_, files, aliases, &allowed), o));
  for (size_t i : report.missing) {
    TIERMEM_RETURN_IF_ERROR(from_model(*params_[i]));
    missing.push_back(params_[i]->name);
  }
  if (!missing.empty()) {
    TIERMEM_LOG(kWarn) << "tiermem: " << missing.size() << " parameters and buffers are not in "
                       << weights.path << " and keep the model's values (the first: " << missing[0]
                       << ")";
  }
  return OkStatus();
}

ChunkedModel::~ChunkedModel() {
  if (!closed_) Close().IgnoreError();
}

::torch::Dtype ChunkedModel::compute_dtype() const {
  return TorchDType(session_->layout().compute_dtype());
}

::torch::Tensor ChunkedModel::Placeholder(const ParamRec& p) const {
  return ::torch::full({}, std::numeric_limits<float>::quiet_NaN(), compute_dtype())
      .expand(p.shape);
}

::torch::Tensor ChunkedModel::View(void* addr, size_t group, ChunkKind kind) const {
  return ::torch::from_blob(
      addr, {static_cast<int64_t>(session_->layout().group(group).used_elems)},
      ::torch::TensorOptions().dtype(TorchDType(session_->layout().dtype(kind))));
}

StatusOr<std::vector<ChunkedModel::ParamRec*>> ChunkedModel::UnitParams(::torch::nn::Module& unit) {
  std::vector<ParamRec*> out;
  std::set<ParamRec*> seen;
  for (const auto& item : unit.named_parameters(/*recurse=*/true)) {
    auto it = by_impl_.find(item.value().unsafeGetTensorImpl());
    if (it == by_impl_.end()) {
      return InvalidArgumentError("unit " + unit.name() + " has parameter " + item.key() +
                                  " that this model does not manage");
    }
    if (seen.insert(it->second).second) out.push_back(it->second);
  }
  return out;
}

StatusOr<uint32_t> ChunkedModel::UnitIndex(::torch::nn::Module& unit,
                                           const std::vector<ParamRec*>& params) {
  if (auto it = unit_index_.find(&unit); it != unit_index_.end()) return it->second;
  // Declared at its first Run, named as the Python package names a unit: its qualified name
  // in the model (the root: its class name), so both bindings' traces label units alike.
  session::UnitInfo info;
  for (const auto& item : model_->named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (item.value().get() == &unit) info.name = item.key();
  }
  if (info.name.empty()) info.name = unit.name();
  std::set<size_t> groups;
  for (const ParamRec* p : params) {
    for (const session::Piece& pc : session_->layout().place(p->index).pieces)
      groups.insert(pc.group);
  }
  info.groups.assign(groups.begin(), groups.end());
  TIERMEM_ASSIGN_OR_RETURN(const uint32_t u, protocol_->Declare(std::move(info)));
  unit_index_.emplace(&unit, u);
  return u;
}

Status ChunkedModel::Materialize(const std::vector<ParamRec*>& params,
                                 std::vector<std::pair<size_t, ::torch::Tensor>>* views) {
  const ChunkKind ck = session_->layout().compute_kind();
  for (ParamRec* p : params) {
    const std::vector<session::Piece>& pieces = session_->layout().place(p->index).pieces;
    if (pieces.size() > 1) {
      // A parameter larger than a chunk computes with a contiguous copy of its pieces
      // (read-only, as every unit's parameters are here), assembled one piece's chunk pinned
      // at a time: the host floor counts one (runtime/host_floor.h).
      ::torch::Tensor copy;
      for (const session::Piece& pc : pieces) {
        StatusOr<void*> addr =
            session_->chunks().Acquire(pc.group, ck, session_->placement().compute_tier());
        Status released;
        if (addr.ok()) {
          const ::torch::Tensor base = View(*addr, pc.group, ck);
          if (!copy.defined()) copy = ::torch::empty(p->shape, base.options());
          copy.view({-1})
              .narrow(0, static_cast<int64_t>(pc.begin), static_cast<int64_t>(pc.numel))
              .copy_(
                  base.narrow(0, static_cast<int64_t>(pc.offset), static_cast<int64_t>(pc.numel)));
          released = session_->chunks().Release(pc.group, ck, false);
        }
        if (!addr.ok() || !released.ok()) {
          Dematerialize(params, views).IgnoreError();
          return addr.ok() ? released : addr.status();
        }
      }
      p->param.set_data(copy);
      continue;
    }
    std::vector<::torch::Tensor> parts;
    for (const session::Piece& pc : pieces) {
      auto it = std::find_if(views->begin(), views->end(),
                             [&](const auto& v) { return v.first == pc.group; });
      if (it == views->end()) {
        StatusOr<void*> addr =
            session_->chunks().Acquire(pc.group, ck, session_->placement().compute_tier());
        if (!addr.ok()) {
          Dematerialize(params, views).IgnoreError();
          return addr.status();
        }
        views->emplace_back(pc.group, View(*addr, pc.group, ck));
        it = views->end() - 1;
      }
      parts.push_back(
          it->second.narrow(0, static_cast<int64_t>(pc.offset), static_cast<int64_t>(pc.numel)));
    }
    p->param.set_data((parts.size() == 1 ? parts[0] : ::torch::cat(parts)).view(p->shape));
  }
  return OkStatus();
}

Status ChunkedModel::Dematerialize(const std::vector<ParamRec*>& params,
                                   std::vector<std::pair<size_t, ::torch::Tensor>>* views) {
  for (ParamRec* p : params) p->param.set_data(Placeholder(*p));
  Status first;
  for (const auto& [g, base] : *views) {
    Status s = session_->chunks().Release(g, session_->layout().compute_kind(), false);
    if (first.ok()) first = s;
  }
  views->clear();
  return first;
}

Status ChunkedModel::AccumulateGrad(ParamRec* p, const ::torch::Tensor& grad) {
  const bool had = session_->optimizer().has_grad(p->index);
  const ::torch::Tensor flat = grad.reshape(-1);
  for (const session::Piece& pc : session_->layout().place(p->index).pieces) {
    const session::ChunkGroup& g = session_->layout().group(pc.group);
    if (std::none_of(g.tensors.begin(), g.tensors.end(),
                     [&](uint32_t t) { return session_->optimizer().has_grad(t); })) {
      // Nothing in the chunk is needed: zero it lazily, so acquiring it moves no bytes.
      TIERMEM_RETURN_IF_ERROR(session_->chunks().ZeroChunk(pc.group, ChunkKind::kGrad));
    }
    bool must_zero = false;
    TIERMEM_ASSIGN_OR_RETURN(void* addr, session_->chunks().AcquireForWrite(
                                             pc.group, ChunkKind::kGrad,
                                             session_->placement().compute_tier(), &must_zero));
    ::torch::Tensor base = View(addr, pc.group, ChunkKind::kGrad);
    {
      ::torch::NoGradGuard no_grad;
      if (must_zero) base.zero_();
      ::torch::Tensor dst =
          base.narrow(0, static_cast<int64_t>(pc.offset), static_cast<int64_t>(pc.numel));
      const ::torch::Tensor src =
          flat.narrow(0, static_cast<int64_t>(pc.begin), static_cast<int64_t>(pc.numel));
      if (had) {
        dst.add_(src);
      } else {
        dst.copy_(src);
      }
    }
    TIERMEM_RETURN_IF_ERROR(session_->chunks().Release(pc.group, ChunkKind::kGrad, true));
  }
  session_->optimizer().SetHasGrad(p->index, true);
  return OkStatus();
}

StatusOr<::torch::Tensor> ChunkedModel::Run(::torch::nn::Module& unit, const UnitFn& fn,
                                            std::vector<::torch::Tensor> inputs) {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  if (in_run_) return FailedPreconditionError("ChunkedModel::Run called inside another Run");
  TIERMEM_ASSIGN_OR_RETURN(std::vector<ParamRec*> params, UnitParams(unit));
  TIERMEM_ASSIGN_OR_RETURN(const uint32_t u, UnitIndex(unit, params));
  const bool grad = ::torch::GradMode::is_enabled();
  session_->iterations().SetTracing(grad);
  if (grad && !protocol_->in_iteration()) {
    protocol_->BeginIteration();
    // What Step() will pass, announced for the updates run inside the backward
    // (optimizer_overlap "backward"); a change before Step() drops them (optimizer_stepper.h).
    session_->SetStepHyper(hyper_);
  }
  {
    kernels::ScopedParallelFor pool(torch_pool::ForThisThread());  // torch_pool.h
    TIERMEM_RETURN_IF_ERROR(protocol_->EnterUnit(u, grad));        // deferred updates, the moment
  }

  auto call = c10::make_intrusive<UnitCall>();
  call->model = this;
  call->params = std::move(params);
  call->fn = fn;
  call->unit = u;
  for (const ::torch::Tensor& t : inputs) {
    call->input_requires_grad.push_back(t.defined() && t.requires_grad());
  }
  std::vector<std::pair<size_t, ::torch::Tensor>> views;
  if (Status st = Materialize(call->params, &views); !st.ok()) {
    protocol_->ExitUnit(u).IgnoreError();
    return st;
  }
  call->views = &views;
  in_run_ = true;
  ::torch::Tensor out;
  try {
    if (grad) {
      out = UnitFunction::apply(call, dummy_, ::torch::TensorList(inputs));
    } else {
      out = fn(inputs);
      if (Aliases(out, views)) out = out.clone();
    }
  } catch (...) {
    in_run_ = false;
    call->views = nullptr;
    Dematerialize(call->params, &views).IgnoreError();
    protocol_->ExitUnit(u).IgnoreError();
    throw;
  }
  in_run_ = false;
  call->views = nullptr;
  const Status released = Dematerialize(call->params, &views);
  TIERMEM_RETURN_IF_ERROR(protocol_->ExitUnit(u));
  TIERMEM_RETURN_IF_ERROR(released);
  if (!out.defined()) return InvalidArgumentError("the unit function returned no tensor");
  return out;
}

::torch::Tensor ChunkedModel::ScaleLoss(const ::torch::Tensor& loss) const {
  const double s = session_->optimizer().loss_scale();
  return s == 1.0 ? loss : loss * s;
}

StatusOr<bool> ChunkedModel::Step() {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  protocol_->EndIteration();
  session_->iterations().SetTracing(true);
  kernels::ScopedParallelFor pool(torch_pool::ForThisThread());  // torch_pool.h
  TIERMEM_ASSIGN_OR_RETURN(const session::StepResult r, session_->optimizer().Step(hyper_));
  return r.applied;
}

Status ChunkedModel::ZeroGrad() {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  return session_->optimizer().ZeroGrad().status();
}

StatusOr<double> ChunkedModel::GradNorm() {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
  TIERMEM_ASSIGN_OR_RETURN(const kernels::GradStats st, session_->optimizer().GradStats());
  return std::sqrt(st.sq_norm);
}

Status ChunkedModel::SetGroupOptions(size_t g, const session::GroupHyper& h) {
  if (g >= hyper_.size()) {
    return OutOfRangeError("param group " + std::to_string(g) + " of " +
                           std::to_string(hyper_.size()));
  }
  hyper_[g] = h;  // validated (with a clear error) by the next Step, which then changes nothing
  return OkStatus();
}

Status ChunkedModel::SetLearningRate(size_t g, double lr) {
  if (g >= hyper_.size()) {
    return OutOfRangeError("param group " + std::to_string(g) + " of " +
                           std::to_string(hyper_.size()));
  }
  session::GroupHyper h = hyper_[g];
  h.lr = lr;
  return SetGroupOptions(g, h);
}

StatusOr<ChunkedModel::ParamRec*> ChunkedModel::Find(const ::torch::Tensor& param) {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  auto it = by_impl_.find(param.unsafeGetTensorImpl());
  if (it == by_impl_.end()) return NotFoundError("not a parameter managed by this model");
  return it->second;
}

StatusOr<::torch::Tensor> ChunkedModel::ParamValue(const ::torch::Tensor& param) {
  TIERMEM_ASSIGN_OR_RETURN(ParamRec * p, Find(param));
  ::torch::Tensor out = ::torch::empty(p->shape, ::torch::kFloat32);
  TIERMEM_RETURN_IF_ERROR(session_->values().ReadParam(p->index, out.data_ptr<float>()));
  return out;
}

StatusOr<::torch::Tensor> ChunkedModel::Grad(const ::torch::Tensor& param) {
  TIERMEM_ASSIGN_OR_RETURN(ParamRec * p, Find(param));
  if (!session_->layout().spec(p->index).trainable) {
    return NotFoundError("parameter " + p->name + " is frozen: no gradient");
  }
  if (!session_->optimizer().has_grad(p->index)) {
    return NotFoundError("parameter " + p->name + " has no gradient (none since ZeroGrad)");
  }
  ::torch::Tensor out = ::torch::empty(p->shape, compute_dtype());
  TIERMEM_RETURN_IF_ERROR(
      session_->values().ReadTensor(p->index, ChunkKind::kGrad, out.data_ptr()));
  const double s = session_->optimizer().loss_scale();
  return s == 1.0 ? out : out.to(::torch::kFloat32) / s;
}

StatusOr<::torch::Tensor> ChunkedModel::OptimizerState(const ::torch::Tensor& param,
                                                       const std::string& kind) {
  TIERMEM_ASSIGN_OR_RETURN(ParamRec * p, Find(param));
  if (!session_->layout().spec(p->index).trainable) {
    return NotFoundError("parameter " + p->name + " is frozen: no optimizer state");
  }
  ChunkKind k;
  if (kind == "exp_avg") {
    k = ChunkKind::kExpAvg;
  } else if (kind == "exp_avg_sq") {
    k = ChunkKind::kExpAvgSq;
  } else {
    return InvalidArgumentError("optimizer state kind must be 'exp_avg' or 'exp_avg_sq', got '" +
                                kind + "'");
  }
  ::torch::Tensor out = ::torch::empty(p->shape, ::torch::kFloat32);
  TIERMEM_RETURN_IF_ERROR(session_->values().ReadTensor(p->index, k, out.data_ptr()));
  return out;
}

Status ChunkedModel::Save(const std::string& path, const nlohmann::json& extra) {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  session::CheckpointMeta meta;
  for (const session::GroupHyper& h : hyper_) meta.groups.push_back({h});
  const ::torch::Tensor rng = CpuRngState().contiguous();
  meta.rng_state.assign(static_cast<const char*>(rng.data_ptr()), rng.nbytes());
  meta.extra = extra;
  return session_->SaveCheckpoint(path, meta);
}

Status ChunkedModel::Load(const std::string& path, nlohmann::json* extra) {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  // The session checks the groups and the RNG state's size against ours before it loads
  // anything (and verifies every tensor before it writes one): a failed Load changes nothing.
  session::CheckpointMeta meta;
  session::CheckpointLoad how;
  how.num_groups = hyper_.size();
  how.rng_state_bytes = static_cast<size_t>(CpuRngState().nbytes());
  TIERMEM_RETURN_IF_ERROR(session_->LoadCheckpoint(path, &meta, how));
  for (size_t g = 0; g < hyper_.size(); ++g) hyper_[g] = meta.groups[g].hyper;
  if (!meta.rng_state.empty()) {
    ::torch::Tensor rng =
        ::torch::empty({static_cast<int64_t>(meta.rng_state.size())}, ::torch::kUInt8);
    std::memcpy(rng.data_ptr(), meta.rng_state.data(), meta.rng_state.size());
    SetCpuRngState(rng);
  }
  if (extra != nullptr) *extra = std::move(meta.extra);
  return OkStatus();
}

Status ChunkedModel::SaveWeights(const std::string& path, const SaveWeightsOptions& options) {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  session::ExportOptions o;
  o.writer.max_shard_bytes = options.max_shard_bytes;
  o.writer.single_file = path.size() >= 12 && path.rfind(".safetensors") == path.size() - 12;
  if (options.dtype) {
    const std::optional<weights::DType> d = torch_dtypes::WeightsDType(*options.dtype);
    if (!d ||
        (*d != weights::DType::kBF16 && *d != weights::DType::kF16 && *d != weights::DType::kF32)) {
      return InvalidArgumentError("SaveWeights: dtype must be float32, bfloat16 or float16");
    }
    o.dtype = *d;
  }
  std::vector<session::ExportEntry> entries;
  for (const auto& p : params_) {
    entries.push_back(
        {p->name, p->shape, {{p->index, 0, static_cast<uint64_t>(p->param.numel())}}});
  }
  std::vector<::torch::Tensor> held;  // the buffers' bytes, alive during the export
  for (const auto& item : model_->named_buffers(/*recurse=*/true)) {
    ::torch::Tensor b = item.value().detach();
    if (options.dtype && b.is_floating_point()) b = b.to(*options.dtype);
    held.push_back(b.contiguous());
    const std::optional<weights::DType> d = torch_dtypes::WeightsDType(b.scalar_type());
    if (!d) return InvalidArgumentError("SaveWeights: buffer " + item.key() + " has no dtype");
    session::ExportEntry e{item.key(), b.sizes().vec(), {}};
    e.host_bytes = held.back().data_ptr();
    e.host_dtype = *d;
    entries.push_back(std::move(e));
  }
  return session::ExportWeights(*session_, path, entries, o);
}

StatusOr<Stats> ChunkedModel::GetStats() {
  if (closed_) return FailedPreconditionError("tiermem ChunkedModel is closed");
  Stats s;
  TIERMEM_ASSIGN_OR_RETURN(s.counters, session_->Stats());
  TIERMEM_ASSIGN_OR_RETURN(s.timeline, session_->traces().TimelineReport());
  s.device_budget = session_->placement().host_compute() ? 0 : session_->config().device_budget;
  s.compute_tier = session_->placement().compute_tier();
  return s;
}

Status ChunkedModel::Close() {
  if (closed_ || !session_) {
    closed_ = true;
    return OkStatus();
  }
  std::vector<::torch::Tensor> values;
  for (auto& p : params_) {
    TIERMEM_ASSIGN_OR_RETURN(::torch::Tensor v, ParamValue(p->param));
    values.push_back(std::move(v));
  }
  for (size_t i = 0; i < params_.size(); ++i) params_[i]->param.set_data(values[i]);
  session_->Close();
  closed_ = true;
  return OkStatus();
}

}  // namespace tiermem::torch
