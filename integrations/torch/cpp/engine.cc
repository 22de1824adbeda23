// tiermem::torch::Engine (see engine.h for the API and its rules).
//
// Invariants:
//  - Outside Run/backward every managed parameter's data is a zero-byte placeholder of its
//    shape (an expanded 0-d zero): no tensor the user can reach aliases chunk memory, so a
//    chunk may move whenever it is unpinned. Inside, the data of the segment's parameters
//    are views of their param chunks on the device tier, pinned by one Acquire per group;
//    Dematerialize restores the placeholders before it releases the pins (also when fn
//    throws).
//  - A segment's forward runs with grad disabled (autograd Function), so no graph holds chunk
//    memory; its output is cloned when it would alias a chunk. Its backward rebuilds the
//    segment's graph (re-acquire, recompute fn with grad, autograd::grad to the inputs and the
//    parameters) and adds the parameter gradients into the grad chunks on the device tier.
//    The segment call (fn, params) is owned by the autograd node (a capsule in saved_data).
//  - Every segment output takes a `dummy_` tensor that requires grad as an extra input, so
//    a segment whose inputs need no grad (the embedding) still gets a backward.
//  - Grad chunks hold the sum of the gradients since the last effective ZeroGrad; has_grad
//    says a param received one (the optimizer skips params without, like torch).
//  - Step runs on host views of param/grad/m/v chunks of a group (Acquire on the host tier
//    brings the device copies home); params of a group with the same step count that are
//    adjacent go through one kernel call.
#include "integrations/torch/cpp/engine.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "chunks/chunk_layout.h"
#include "kernels/cpu/optim.h"

namespace tiermem::torch {
namespace {

constexpr int kMinResidentChunks = 4;  // as in the Python runtime
constexpr int kParam = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3;
constexpr Bytes kPage = 4096;

// Throws a torch error for a failed Status where no Status can be returned (backward).
void CheckOk(const Status& s) { TORCH_CHECK(s.ok(), "tiermem: ", s.ToString()); }

}  // namespace

// One segment call, owned by its autograd node.
struct SegmentCall : ::torch::CustomClassHolder {
  Engine* engine = nullptr;
  std::vector<Engine::ParamRec*> params;
  Engine::SegmentFn fn;
  std::vector<bool> input_requires_grad;
  std::vector<std::pair<int, ::torch::Tensor>>* views = nullptr;  // forward only
  std::string label;
};

struct SegmentFunction : public ::torch::autograd::Function<SegmentFunction> {
  static ::torch::Tensor forward(::torch::autograd::AutogradContext* ctx,
                                 const c10::intrusive_ptr<SegmentCall>& call,
                                 const ::torch::Tensor& dummy, ::torch::TensorList inputs) {
    std::vector<::torch::Tensor> in(inputs.begin(), inputs.end());
    ctx->save_for_backward(in);
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    ::torch::Tensor out = call->fn(in);
    TORCH_CHECK(out.defined(), "tiermem: the segment function returned an undefined tensor");
    if (out.has_storage() && out.numel() > 0) {
      const char* p = static_cast<const char*>(out.storage().data());
      for (const auto& [g, base] : *call->views) {
        const char* b = static_cast<const char*>(base.data_ptr());
        if (p >= b && p < b + base.nbytes()) {
          out = out.clone();
          break;
        }
      }
    }
    return out;
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grad_out) {
    auto call = c10::static_intrusive_pointer_cast<SegmentCall>(
        ctx->saved_data["call"].toCapsule());
    Engine* e = call->engine;
    TORCH_CHECK(!e->closed_, "tiermem: backward through a segment of a closed engine");
    std::vector<::torch::Tensor> saved = ctx->get_saved_variables();
    std::vector<::torch::Tensor> in;
    std::vector<::torch::Tensor> targets;
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
    std::vector<Engine::ParamRec*> trainable;
    for (Engine::ParamRec* p : call->params) {
      if (p->trainable) trainable.push_back(p);
    }
    e->stack_->Live().value()->Moment(call->label + ":pre-backward");
    std::vector<std::pair<int, ::torch::Tensor>> views;
    CheckOk(e->Materialize(call->params, &views));
    ::torch::autograd::variable_list grads;
    try {
      for (Engine::ParamRec* p : trainable) targets.push_back(p->param);
      ::torch::AutoGradMode enable(true);
      ::torch::Tensor out = call->fn(in);
      if (!targets.empty() && out.requires_grad()) {
        grads = ::torch::autograd::grad({out}, targets, {grad_out[0]}, /*retain_graph=*/false,
                                        /*create_graph=*/false, /*allow_unused=*/true);
      }
      const size_t first_param = targets.size() - trainable.size();
      for (size_t k = 0; k < trainable.size() && !grads.empty(); ++k) {
        const ::torch::Tensor& g = grads[first_param + k];
        if (g.defined()) CheckOk(e->AccumulateGrad(trainable[k], g));
      }
    } catch (...) {
      e->Dematerialize(call->params, &views).IgnoreError();
      throw;
    }
    CheckOk(e->Dematerialize(call->params, &views));
    // One gradient per forward input: the call (none), the dummy (none), then the inputs.
    ::torch::autograd::variable_list result(2 + saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      if (input_target[i] >= 0 && !grads.empty()) result[2 + i] = grads[input_target[i]];
    }
    return result;
  }
};

StatusOr<std::unique_ptr<Engine>> Engine::Create(::torch::nn::Module& model,
                                                 const nlohmann::json& config) {
  const char* env = std::getenv("TIERMEM_DEVICE");
  TIERMEM_ASSIGN_OR_RETURN(torch_common::TorchConfig cfg,
                           torch_common::ParseTorchConfig(config, env ? env : ""));
  if (cfg.precision != "fp32") {
    return UnimplementedError("config 'precision': the LibTorch API trains in fp32 only, got '" +
                              cfg.precision + "' (bf16/fp16 are in the Python package)");
  }
  if (cfg.device_kind == "cuda") {
    return UnimplementedError(
        "config 'device_kind' / TIERMEM_DEVICE: the LibTorch API runs on SimDevice only for "
        "now, got 'cuda'");
  }
  std::unique_ptr<Engine> e(new Engine());
  e->cfg_ = std::move(cfg);
  TIERMEM_RETURN_IF_ERROR(e->Init(model));
  return e;
}

Status Engine::Init(::torch::nn::Module& model) {
  // Parameters in registration order, each once (tied parameters share one TensorImpl).
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const ::torch::Tensor& t = item.value();
    if (by_impl_.count(t.unsafeGetTensorImpl())) continue;
    if (t.scalar_type() != ::torch::kFloat32) {
      return InvalidArgumentError("parameter " + item.key() + " is " +
                                  std::string(c10::toString(t.scalar_type())) +
                                  "; tiermem expects an fp32 model");
    }
    if (!t.device().is_cpu()) {
      return InvalidArgumentError("parameter " + item.key() + " is on " + t.device().str() +
                                  "; pass a CPU model (tiermem places it)");
    }
    auto r = std::make_unique<ParamRec>();
    r->param = t;
    r->name = item.key();
    r->shape = t.sizes().vec();
    r->numel = t.numel();
    r->trainable = t.requires_grad();
    by_impl_[t.unsafeGetTensorImpl()] = r.get();
    params_.push_back(std::move(r));
  }
  if (params_.empty()) return InvalidArgumentError("model has no parameters");

  // Layout: trainable params, then frozen ones (no grad/optimizer chunks for those).
  std::vector<ParamRec*> trainable, frozen;
  for (auto& p : params_) (p->trainable ? trainable : frozen).push_back(p.get());
  const Bytes per_elem = 4 + (trainable.empty() ? 0 : 4);  // device: param + grad chunks
  if (!cfg_.chunk_size) {
    std::vector<uint64_t> numels;
    for (auto& p : params_) numels.push_back(static_cast<uint64_t>(p->numel));
    TIERMEM_ASSIGN_OR_RETURN(chunks::ChunkSizeChoice choice,
                             chunks::ChooseChunkElems(numels, cfg_.device_budget, per_elem,
                                                      kMinResidentChunks));
    chunk_elems_ = choice.chunk_elems;
  } else {
    chunk_elems_ = *cfg_.chunk_size;
    const Bytes need = chunk_elems_ * per_elem * kMinResidentChunks;
    if (need > cfg_.device_budget) {
      return ResourceExhaustedError("device budget of " + std::to_string(cfg_.device_budget) +
                                    " bytes is below the minimum of " + std::to_string(need) +
                                    " bytes for chunk_size=" + std::to_string(chunk_elems_));
    }
  }
  for (const auto& [subset, is_trainable] :
       {std::pair{&trainable, true}, std::pair{&frozen, false}}) {
    if (subset->empty()) continue;
    std::vector<uint64_t> numels;
    for (ParamRec* p : *subset) numels.push_back(static_cast<uint64_t>(p->numel));
    TIERMEM_ASSIGN_OR_RETURN(chunks::ChunkLayout layout,
                             chunks::PackTensors(numels, chunk_elems_));
    const size_t base = groups_.size();
    groups_.resize(base + layout.num_groups());
    for (size_t g = base; g < groups_.size(); ++g) groups_[g].trainable = is_trainable;
    for (size_t i = 0; i < subset->size(); ++i) {
      ParamRec* p = (*subset)[i];
      p->group = static_cast<int>(base + layout.placements[i].group);
      p->offset = static_cast<int64_t>(layout.placements[i].offset);
      Group& grp = groups_[p->group];
      grp.params.push_back(p);
      grp.used = std::max(grp.used, p->offset + p->numel);
    }
  }
  for (ParamRec* p : trainable) model_bytes_ += static_cast<Bytes>(p->numel) * 16;
  for (ParamRec* p : frozen) model_bytes_ += static_cast<Bytes>(p->numel) * 4;

  // The timeline: the configured path, or a temporary file removed at the end.
  std::string timeline = cfg_.timeline;
  if (timeline.empty()) {
    char tmpl[] = "/tmp/tiermem-XXXXXX.tmt";
    const int fd = mkstemps(tmpl, 4);
    if (fd < 0) return IOError("cannot create a temporary timeline file in /tmp");
    close(fd);
    timeline = tmpl;
    own_timeline_ = true;
  } else {
    const std::filesystem::path dir = std::filesystem::path(timeline).parent_path();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);
    if (ec) {
      return InvalidArgumentError("config 'timeline': cannot create directory '" + dir.string() +
                                  "' (" + ec.message() + ")");
    }
  }
  torch_common::StackConfig sc;
  sc.device_budget = cfg_.device_budget;
  sc.host_budget = cfg_.host_budget;
  sc.nvme_path = cfg_.nvme_path;
  sc.nvme_size = cfg_.nvme_size;
  sc.prefetch_depth = cfg_.prefetch_depth;
  sc.chunk_bytes = chunk_elems_ * 4;
  sc.host_reserve =
      cfg_.nvme_size ? 4 * ((sc.chunk_bytes + kPage - 1) / kPage * kPage) : 0;
  sc.timeline_path = timeline;
  sc.device = "sim";
  auto stack = torch_common::RuntimeStack::Create(sc);
  if (!stack.ok()) {
    if (own_timeline_) unlink(timeline.c_str());
    return stack.status();
  }
  stack_ = std::move(stack).value();

  // Chunks: params and grads first so they get host homes; optimizer state spills first.
  Status s;
  engine::Engine* eng = stack_->Live().value();
  const std::array<Category, 4> cats{Category::kParam, Category::kGrad, Category::kOptimState,
                                     Category::kOptimState};
  for (int kind = kParam; kind <= kExpAvgSq && s.ok(); ++kind) {
    for (Group& g : groups_) {
      if (kind != kParam && !g.trainable) continue;
      StatusOr<ChunkId> id = eng->AddChunk(chunk_elems_ * 4, cats[kind]);
      if (!id.ok()) {
        s = id.status();
        break;
      }
      g.chunks[kind] = *id;
    }
  }
  // Initial values into the param chunks (host).
  for (size_t gi = 0; gi < groups_.size() && s.ok(); ++gi) {
    StatusOr<::torch::Tensor> base = Acquire(static_cast<int>(gi), kParam, TierKind::kHost);
    if (!base.ok()) {
      s = base.status();
      break;
    }
    {
      ::torch::NoGradGuard no_grad;
      for (ParamRec* p : groups_[gi].params) {
        base->narrow(0, p->offset, p->numel).copy_(p->param.detach().reshape(-1));
      }
    }
    s = ReleaseChunk(static_cast<int>(gi), kParam, true);
  }
  if (!s.ok()) {
    stack_->Close();
    if (own_timeline_) unlink(timeline.c_str());
    closed_ = true;
    return s;
  }
  // Nothing can fail from here on: take over the parameters.
  for (auto& p : params_) p->param.set_data(Placeholder(*p));
  dummy_ = ::torch::empty({0}).requires_grad_(true);
  return OkStatus();
}

Engine::~Engine() {
  if (!closed_) Close().IgnoreError();
}

::torch::Tensor Engine::Placeholder(const ParamRec& p) const {
  return ::torch::zeros({}, ::torch::kFloat32).expand(p.shape);
}

StatusOr<::torch::Tensor> Engine::Acquire(int group, int kind, TierKind tier) {
  TIERMEM_ASSIGN_OR_RETURN(engine::Engine * eng, stack_->Live());
  const Group& g = groups_[group];
  TIERMEM_ASSIGN_OR_RETURN(void* addr, eng->Acquire(g.chunks[kind], tier));
  return ::torch::from_blob(addr, {g.used}, ::torch::TensorOptions().dtype(::torch::kFloat32));
}

Status Engine::ReleaseChunk(int group, int kind, bool modified) {
  TIERMEM_ASSIGN_OR_RETURN(engine::Engine * eng, stack_->Live());
  return eng->Release(groups_[group].chunks[kind], modified);
}

StatusOr<std::vector<Engine::ParamRec*>> Engine::SegmentParams(::torch::nn::Module& segment) {
  std::vector<ParamRec*> out;
  std::set<ParamRec*> seen;
  for (const auto& item : segment.named_parameters(/*recurse=*/true)) {
    auto it = by_impl_.find(item.value().unsafeGetTensorImpl());
    if (it == by_impl_.end()) {
      return InvalidArgumentError("segment " + segment.name() + " has parameter " + item.key() +
                                  " that this engine does not manage");
    }
    if (seen.insert(it->second).second) out.push_back(it->second);
  }
  return out;
}

Status Engine::Materialize(const std::vector<ParamRec*>& params,
                           std::vector<std::pair<int, ::torch::Tensor>>* views) {
  for (ParamRec* p : params) {
    auto it = std::find_if(views->begin(), views->end(),
                           [&](const auto& v) { return v.first == p->group; });
    if (it == views->end()) {
      StatusOr<::torch::Tensor> base = Acquire(p->group, kParam, TierKind::kDevice);
      if (!base.ok()) {
        Dematerialize(params, views).IgnoreError();
        return base.status();
      }
      views->emplace_back(p->group, *base);
      it = views->end() - 1;
    }
    p->param.set_data(it->second.narrow(0, p->offset, p->numel).view(p->shape));
  }
  return OkStatus();
}

Status Engine::Dematerialize(const std::vector<ParamRec*>& params,
                             std::vector<std::pair<int, ::torch::Tensor>>* views) {
  for (ParamRec* p : params) p->param.set_data(Placeholder(*p));
  Status first;
  for (const auto& [g, base] : *views) {
    Status s = ReleaseChunk(g, kParam, false);
    if (first.ok()) first = s;
  }
  views->clear();
  return first;
}

Status Engine::AccumulateGrad(ParamRec* p, const ::torch::Tensor& grad) {
  TIERMEM_ASSIGN_OR_RETURN(::torch::Tensor base, Acquire(p->group, kGrad, TierKind::kDevice));
  {
    ::torch::NoGradGuard no_grad;
    base.narrow(0, p->offset, p->numel).add_(grad.reshape(-1));
  }
  p->has_grad = true;
  return ReleaseChunk(p->group, kGrad, true);
}

StatusOr<::torch::Tensor> Engine::Run(::torch::nn::Module& segment, const SegmentFn& fn,
                                      std::vector<::torch::Tensor> inputs) {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  if (in_run_) return FailedPreconditionError("Engine::Run called inside another Run");
  TIERMEM_ASSIGN_OR_RETURN(std::vector<ParamRec*> params, SegmentParams(segment));
  TIERMEM_ASSIGN_OR_RETURN(engine::Engine * eng, stack_->Live());
  const bool grad = ::torch::GradMode::is_enabled();
  if (grad && !in_iteration_) {
    eng->BeginIteration();
    in_iteration_ = true;
  }
  eng->Phase(grad ? "forward" : "eval");
  eng->Moment(segment.name() + ":pre-forward");

  auto call = c10::make_intrusive<SegmentCall>();
  call->engine = this;
  call->params = std::move(params);
  call->fn = fn;
  call->label = segment.name();
  for (const ::torch::Tensor& t : inputs) {
    call->input_requires_grad.push_back(t.defined() && t.requires_grad());
  }
  std::vector<std::pair<int, ::torch::Tensor>> views;
  TIERMEM_RETURN_IF_ERROR(Materialize(call->params, &views));
  call->views = &views;
  in_run_ = true;
  ::torch::Tensor out;
  try {
    if (grad) {
      out = SegmentFunction::apply(call, dummy_, ::torch::TensorList(inputs));
    } else {
      out = fn(inputs);
      if (out.defined() && out.has_storage()) {
        for (const auto& [g, base] : views) {
          const char* p = static_cast<const char*>(out.storage().data());
          const char* b = static_cast<const char*>(base.data_ptr());
          if (p >= b && p < b + base.nbytes()) {
            out = out.clone();
            break;
          }
        }
      }
    }
  } catch (...) {
    in_run_ = false;
    call->views = nullptr;
    Dematerialize(call->params, &views).IgnoreError();
    throw;
  }
  in_run_ = false;
  call->views = nullptr;
  TIERMEM_RETURN_IF_ERROR(Dematerialize(call->params, &views));
  if (!out.defined()) return InvalidArgumentError("the segment function returned no tensor");
  return out;
}

StatusOr<double> Engine::GradNorm() {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  double sq = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!groups_[gi].trainable) continue;
    TIERMEM_ASSIGN_OR_RETURN(::torch::Tensor base,
                             Acquire(static_cast<int>(gi), kGrad, TierKind::kHost));
    const kernels::GradStats st = kernels::GradNormAndOverflow(
        base.data_ptr(), kernels::DType::kF32, static_cast<size_t>(base.numel()));
    TIERMEM_RETURN_IF_ERROR(ReleaseChunk(static_cast<int>(gi), kGrad, false));
    sq += st.sq_norm;
  }
  return std::sqrt(sq);
}

StatusOr<bool> Engine::Step() {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  in_iteration_ = false;
  ++micro_;
  if (micro_ % cfg_.gradient_accumulation_steps != 0) {
    stepped_ = false;
    return false;
  }
  stepped_ = true;
  TIERMEM_ASSIGN_OR_RETURN(engine::Engine * eng, stack_->Live());
  eng->Phase("optimizer");
  float clip = 1.0f;
  if (cfg_.gradient_clipping > 0) {
    // torch::nn::utils::clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1,
    // computed in fp32 like the tensor math there.
    TIERMEM_ASSIGN_OR_RETURN(double norm, GradNorm());
    const float total = static_cast<float>(norm);
    clip = std::min(static_cast<float>(cfg_.gradient_clipping) / (total + 1e-6f), 1.0f);
  }
  kernels::AdamConfig ac;
  ac.lr = static_cast<float>(cfg_.lr);
  ac.beta1 = static_cast<float>(cfg_.beta1);
  ac.beta2 = static_cast<float>(cfg_.beta2);
  ac.eps = static_cast<float>(cfg_.eps);
  ac.weight_decay = static_cast<float>(cfg_.weight_decay);
  ac.clip_factor = clip;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    if (!g.trainable ||
        std::none_of(g.params.begin(), g.params.end(), [](ParamRec* p) { return p->has_grad; })) {
      continue;
    }
    eng->Moment("optimizer-substep");
    std::array<::torch::Tensor, 4> v;
    int acquired = 0;
    Status s;
    for (; acquired < 4; ++acquired) {
      StatusOr<::torch::Tensor> t = Acquire(static_cast<int>(gi), acquired, TierKind::kHost);
      if (!t.ok()) {
        s = t.status();
        break;
      }
      v[acquired] = *t;
    }
    if (s.ok()) {
      // Runs of adjacent params with the same step count go in one kernel call.
      struct RunSpan { int64_t lo, hi, step; };
      std::vector<RunSpan> runs;
      for (ParamRec* p : g.params) {
        if (!p->has_grad) continue;
        ++p->step;
        if (!runs.empty() && runs.back().hi == p->offset && runs.back().step == p->step) {
          runs.back().hi = p->offset + p->numel;
        } else {
          runs.push_back({p->offset, p->offset + p->numel, p->step});
        }
      }
      for (const RunSpan& r : runs) {
        ac.step = r.step;
        kernels::AdamSpans sp;
        sp.param = v[kParam].data_ptr<float>() + r.lo;
        sp.grad = v[kGrad].data_ptr<float>() + r.lo;
        sp.exp_avg = v[kExpAvg].data_ptr<float>() + r.lo;
        sp.exp_avg_sq = v[kExpAvgSq].data_ptr<float>() + r.lo;
        sp.grad_dtype = kernels::DType::kF32;
        sp.n = static_cast<size_t>(r.hi - r.lo);
        s = kernels::ValidateAdam(ac, sp);
        if (!s.ok()) break;
        kernels::AdamStep(ac, sp);
      }
    }
    for (int k = 0; k < acquired; ++k) {
      Status r = ReleaseChunk(static_cast<int>(gi), k, k != kGrad);
      if (s.ok()) s = r;
    }
    TIERMEM_RETURN_IF_ERROR(s);
  }
  return true;
}

Status Engine::ZeroGrad() {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  if (!stepped_) return OkStatus();
  TIERMEM_ASSIGN_OR_RETURN(engine::Engine * eng, stack_->Live());
  for (Group& g : groups_) {
    if (g.trainable) TIERMEM_RETURN_IF_ERROR(eng->Zero(g.chunks[kGrad]));
  }
  for (auto& p : params_) p->has_grad = false;
  return OkStatus();
}

StatusOr<::torch::Tensor> Engine::SliceCopy(const ParamRec& p, int kind) {
  TIERMEM_ASSIGN_OR_RETURN(::torch::Tensor base, Acquire(p.group, kind, TierKind::kHost));
  ::torch::Tensor out = base.narrow(0, p.offset, p.numel).clone().view(p.shape);
  TIERMEM_RETURN_IF_ERROR(ReleaseChunk(p.group, kind, false));
  return out;
}

StatusOr<::torch::Tensor> Engine::ParamValue(const ::torch::Tensor& param) {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  auto it = by_impl_.find(param.unsafeGetTensorImpl());
  if (it == by_impl_.end()) return NotFoundError("not a parameter managed by this engine");
  return SliceCopy(*it->second, kParam);
}

StatusOr<::torch::Tensor> Engine::Grad(const ::torch::Tensor& param) {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  auto it = by_impl_.find(param.unsafeGetTensorImpl());
  if (it == by_impl_.end()) return NotFoundError("not a parameter managed by this engine");
  if (!it->second->trainable) {
    return NotFoundError("parameter " + it->second->name + " is frozen: no gradient");
  }
  return SliceCopy(*it->second, kGrad);
}

StatusOr<::torch::Tensor> Engine::OptimizerState(const ::torch::Tensor& param,
                                                 const std::string& kind) {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  auto it = by_impl_.find(param.unsafeGetTensorImpl());
  if (it == by_impl_.end()) return NotFoundError("not a parameter managed by this engine");
  if (!it->second->trainable) {
    return NotFoundError("parameter " + it->second->name + " is frozen: no optimizer state");
  }
  if (kind == "exp_avg") return SliceCopy(*it->second, kExpAvg);
  if (kind == "exp_avg_sq") return SliceCopy(*it->second, kExpAvgSq);
  return InvalidArgumentError("optimizer state kind must be 'exp_avg' or 'exp_avg_sq', got '" +
                              kind + "'");
}

StatusOr<EngineStats> Engine::Stats() {
  if (closed_) return FailedPreconditionError("tiermem engine is closed");
  EngineStats s;
  TIERMEM_ASSIGN_OR_RETURN(engine::Engine * eng, stack_->Live());
  s.counters = eng->Stats();
  TIERMEM_ASSIGN_OR_RETURN(s.timeline, stack_->TimelineReport());
  s.device_budget = cfg_.device_budget;
  return s;
}

Status Engine::Close() {
  if (closed_ || !stack_) {
    closed_ = true;
    return OkStatus();
  }
  std::vector<::torch::Tensor> values;
  for (auto& p : params_) {
    TIERMEM_ASSIGN_OR_RETURN(::torch::Tensor v, SliceCopy(*p, kParam));
    values.push_back(std::move(v));
  }
  for (size_t i = 0; i < params_.size(); ++i) params_[i]->param.set_data(values[i]);
  const std::string timeline = stack_->timeline_path();
  stack_->Close();
  if (own_timeline_) unlink(timeline.c_str());
  closed_ = true;
  return OkStatus();
}

}  // namespace tiermem::torch
