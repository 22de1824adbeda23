// tiermem._C: the Python binding of the session core (runtime), pybind11 through
// torch's headers. It is deliberately thin: a Config (the one parser, session::ParseConfig)
// and a Session whose methods forward to session::Session, plus the conversions only a torch
// binding can do — chunk memory as tensors, and the kernels' entry points for tests.
//
// Chunk memory reaches Python as 1-D tensors made with torch::from_blob over the region's
// address (CPU tensors on SimDevice and host, CUDA tensors on the CUDA tier): they do not own
// the memory and are valid only while the chunk stays acquired (the Python layer drops every
// view on release). Status codes become Python exceptions in one place (csrc/errors.h).
// Pretrained weights in and out are registered from csrc/weights.cc.
//
// Threading: a Session is externally synchronized (the training thread); the GIL is held
// except inside the optimizer step and the kernels.
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <string>

#include "base/env.h"
#include "base/timeline_reader.h"
#include "integrations/torch/cpp/dtypes.h"
#include "integrations/torch/cpp/torch_pool.h"
#include "integrations/torch/csrc/errors.h"
#include "integrations/torch/csrc/protocol.h"
#include "integrations/torch/csrc/weights.h"
#include "kernels/cpu/optim.h"
#include "layout/chunk_layout.h"
#include "prof/analysis.h"
#include "runtime/checkpoint_meta.h"
#include "runtime/config.h"
#include "runtime/device_kernels.h"
#include "runtime/param_groups.h"
#include "runtime/session.h"
#include "runtime/tier_stack.h"
#include "runtime/unit_protocol.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

using chunks::ChunkKind;
using session::Session;
using session::SessionConfig;

using torch_dtypes::TorchDType;

// The core element type of a tensor (torch_dtypes::CoreDType), or a ValueError.
kernels::DType KernelDType(const torch::Tensor& t) {
  const std::optional<kernels::DType> d = torch_dtypes::CoreDType(t.scalar_type());
  if (!d) {
    throw py::value_error(std::string("unsupported dtype ") +
                          std::string(c10::toString(t.scalar_type())));
  }
  return *d;
}

void CheckHostSpan(const torch::Tensor& t, const char* what, int64_t n, torch::Dtype dtype) {
  if (!t.is_contiguous() || t.device().type() != torch::kCPU) {
    throw py::value_error(std::string(what) + " must be a contiguous CPU tensor");
  }
  if (t.numel() != n) {
    throw py::value_error(std::string(what) + " has " + std::to_string(t.numel()) +
                          " elements, expected " + std::to_string(n));
  }
  if (t.scalar_type() != dtype) {
    throw py::value_error(std::string(what) + " must be " + std::string(c10::toString(dtype)) +
                          ", got " + std::string(c10::toString(t.scalar_type())));
  }
}

py::dict ReportDict(const prof::Report& r) {
  py::dict d, peak, budget, moved, stalls, categories;
  for (int k = 0; k < kNumTierKinds; ++k) {
    const std::string n(TierKindName(static_cast<TierKind>(k)));
    peak[py::str(n)] = r.tiers[k].peak.bytes;
    budget[py::str(n)] = r.tiers[k].budget_bytes;
    py::dict per;  // peak bytes per category on this tier
    for (int c = 0; c < kNumCategories; ++c) {
      per[py::str(std::string(CategoryName(static_cast<Category>(c))))] =
          r.tiers[k].categories[c].peak.bytes;
    }
    categories[py::str(n)] = per;
  }
  for (const prof::MoveStats& m : r.moves) {
    moved[py::str(std::string(TierKindName(m.src)) + "->" + std::string(TierKindName(m.dst)))] =
        m.bytes;
  }
  for (const prof::StallStats& s : r.stalls) stalls[py::str(s.cause)] = s.ns;
  d["peak"] = peak;
  d["budget"] = budget;
  d["category_peak"] = categories;
  d["copied"] = moved;
  bool over = false;
  for (int k = 0; k < kNumTierKinds; ++k) {
    if (r.tiers[k].budget_bytes != 0 && r.tiers[k].peak.bytes > r.tiers[k].max_budget_bytes) {
      over = true;
    }
  }
  d["over_budget"] = over;
  d["stall_ns"] = r.stall_ns;
  d["stalls"] = r.stall_count;
  d["stall_causes"] = stalls;
  d["events"] = r.events;
  d["iterations"] = r.iterations;
  d["step_mean_ns"] = r.step_mean_ns;
  py::dict coll;  // sharded sessions: {op: (count, bytes, ns)}
  for (const prof::CollectiveStats& c : r.collectives) {
    coll[py::str(c.op)] = py::make_tuple(c.count, c.bytes, c.ns);
  }
  d["collectives"] = coll;
  py::dict io;  // per tier: bytes copied out of / into it and the union of those copies' times
  for (int k = 0; k < kNumTierKinds; ++k) {
    const prof::IoStats& x = r.io[k];
    py::dict t;
    t["read_bytes"] = x.read_bytes;
    t["read_active_ns"] = x.read_active_ns;
    t["write_bytes"] = x.write_bytes;
    t["write_active_ns"] = x.write_active_ns;
    t["active_ns"] = x.active_ns;
    py::dict by_category;
    for (int c = 0; c < kNumCategories; ++c) {
      by_category[py::str(std::string(CategoryName(static_cast<Category>(c))))] =
          x.category_bytes[c];
    }
    t["category_bytes"] = by_category;
    io[py::str(std::string(TierKindName(static_cast<TierKind>(k))))] = t;
  }
  d["io"] = io;
  return d;
}

// ---- the config's modes (runtime/modes.h) -------------------------------------------------
// A mode as a Python enum: one value per spelling in the mode's table ('-' becomes '_':
// DeviceKind.sim_async) and str() the spelling, so that no value is listed twice. Python code
// asks the predicates bound on each (BindModes), never compares spellings: comparing a mode
// with a string raises TypeError (it would be False in silence, whatever the string).
template <typename Mode>
py::enum_<Mode> BindMode(py::module_& m, const char* name) {
  py::enum_<Mode> e(m, name);
  for (const session::ModeSpelling<Mode>& s : session::ModeTraits<Mode>::kNames) {
    std::string n(s.name);
    std::replace(n.begin(), n.end(), '-', '_');
    e.value(n.c_str(), s.mode);
  }
  // These replace pybind11's own (a def would add an overload it never reaches); __hash__
  // stays pybind11's.
  py::setattr(
      e, "__str__",
      py::cpp_function([](Mode v) { return std::string(session::ModeName(v)); }, py::is_method(e)));
  const std::string type(name);
  auto equal = [type](Mode v, const py::object& other) -> bool {
    if (py::isinstance<py::str>(other)) {
      throw py::type_error("tiermem." + type + "." + std::string(session::ModeName(v)) +
                           " compared with the string '" + other.cast<std::string>() +
                           "': compare with a tiermem." + type + " value, or ask its predicates");
    }
    return py::isinstance<Mode>(other) && other.cast<Mode>() == v;
  };
  py::setattr(e, "__eq__", py::cpp_function(equal, py::is_method(e)));
  py::setattr(e, "__ne__",
              py::cpp_function([equal](Mode v, const py::object& o) { return !equal(v, o); },
                               py::is_method(e)));
  return e;
}

void BindModes(py::module_& m) {
  namespace se = session;
  BindMode<se::Precision>(m, "Precision")
      .def_property_readonly("mixed", [](se::Precision p) { return se::IsMixed(p); })
      .def_property_readonly("loss_scaled", [](se::Precision p) { return se::ScalesLoss(p); })
      .def_property_readonly("torch_dtype", [](se::Precision p) {
        return torch_dtypes::TorchDType(se::ComputeDType(p));
      });
  BindMode<se::DeviceKind>(m, "DeviceKind")
      .def_property_readonly("is_cuda", [](se::DeviceKind k) { return se::IsCuda(k); })
      .def_property_readonly("host_compute", [](se::DeviceKind k) { return se::IsHostCompute(k); })
      .def_property_readonly("simulated", [](se::DeviceKind k) { return se::IsSimulated(k); })
      .def_property_readonly("async_sim", [](se::DeviceKind k) { return se::IsAsyncSim(k); });
  BindMode<se::NvmeEngine>(m, "NvmeEngine");
  BindMode<se::KernelIsaMode>(m, "KernelIsa");
  BindMode<se::PlanMode>(m, "PlanMode").def_property_readonly("plans", [](se::PlanMode p) {
    return se::PlansIterations(p);
  });
  BindMode<se::ActivationMode>(m, "ActivationMode")
      .def_property_readonly("counted",
                             [](se::ActivationMode a) { return se::CountsActivations(a); })
      .def_property_readonly("offloaded",
                             [](se::ActivationMode a) { return se::OffloadsActivations(a); })
      .def_property_readonly("recompute_every_unit",
                             [](se::ActivationMode a) { return se::RecomputesEveryUnit(a); })
      .def_property_readonly("planned",
                             [](se::ActivationMode a) { return se::PlanChoosesActivations(a); });
  BindMode<se::OptimizerPlacement>(m, "OptimizerPlacement");
  BindMode<se::OptimizerOverlap>(m, "OptimizerOverlap")
      .def_property_readonly("deferred", [](se::OptimizerOverlap o) { return se::DefersSteps(o); })
      .def_property_readonly("speculative",
                             [](se::OptimizerOverlap o) { return se::SpeculatesSteps(o); });
  BindMode<se::CheckpointIo>(m, "CheckpointIo");
  BindMode<se::InPlace>(m, "InPlace")
      .def_property_readonly("serves_in_place", [](se::InPlace i) { return se::ServesInPlace(i); })
      .def_property_readonly("required", [](se::InPlace i) { return se::RequiresInPlace(i); });
  BindMode<se::UnmaterializedReads>(m, "UnmaterializedReads")
      .def_property_readonly(
          "raises", [](se::UnmaterializedReads u) { return se::RaisesOnUnmaterializedRead(u); });
}

EnvGetter EnvArg(const std::optional<std::map<std::string, std::string>>& env) {
  return env ? MapEnv(*env) : ProcessEnv();
}

SessionConfig ParseConfigText(const std::string& json_text,
                              const std::optional<std::map<std::string, std::string>>& env) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw py::value_error("config is not valid JSON: " + json_text);
  return Check(session::ParseConfig(j, EnvArg(env)));
}

// session::Collectives implemented by a Python object (tiermem.distributed's, over
// torch.distributed): `all_gather(shard, full)` with uint8 CPU tensors viewing the session's
// buffers. The GIL is taken for the call (the session calls it from a bound method).
class PyCollectives final : public session::Collectives {
 public:
  explicit PyCollectives(py::object impl) : impl_(std::move(impl)) {}
  ~PyCollectives() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }
  Status AllGather(const void* shard, void* full, Bytes bytes) override {
    py::gil_scoped_acquire gil;
    auto opts = torch::TensorOptions().dtype(torch::kUInt8);
    torch::Tensor s =
        torch::from_blob(const_cast<void*>(shard), {static_cast<int64_t>(bytes)}, opts);
    torch::Tensor f = torch::from_blob(full, {static_cast<int64_t>(bytes) * world()}, opts);
    try {
      impl_.attr("all_gather")(s, f);
    } catch (py::error_already_set& e) {
      return UnavailableError(std::string("collective all_gather failed: ") + e.what());
    }
    return OkStatus();
  }
  int world() const {
    py::gil_scoped_acquire gil;
    return impl_.attr("world").cast<int>();
  }

 private:
  py::object impl_;
};

// Checkpoint metadata (runtime/checkpoint_meta.h) across the boundary, in the file's own
// encoding: param_groups and extra as JSON text (json.loads / json.dumps on the Python side),
// the RNG state as bytes.
py::dict MetaDict(const session::CheckpointMeta& meta) {
  std::map<std::string, std::string> e = session::EncodeCheckpointMeta(meta);
  py::dict d;
  d["param_groups"] = e["param_groups"];
  d["rng_state"] = py::bytes(meta.rng_state);
  d["extra"] = e["extra"];
  return d;
}

session::CheckpointMeta MetaFrom(const std::string& param_groups, const std::string& rng_state,
                                 const std::string& extra) {
  session::CheckpointMeta meta;
  const nlohmann::json groups = nlohmann::json::parse(param_groups, nullptr, false);
  if (groups.is_discarded()) throw py::value_error("checkpoint: param_groups is not JSON");
  meta.groups = Check(session::ParseCheckpointGroups(groups));
  meta.rng_state = rng_state;
  meta.extra = nlohmann::json::parse(extra, nullptr, false);
  if (meta.extra.is_discarded()) throw py::value_error("checkpoint: extra is not JSON");
  return meta;
}

// The Python face of session::Session. Views are made here; everything else forwards.
class PySession {
 public:
  // `sharding`: None, or (world, rank, collectives) with a Python collectives object.
  PySession(const SessionConfig& config, const std::vector<py::tuple>& tensors,
            const py::object& sharding) {
    std::vector<session::TensorSpec> specs;
    for (const py::tuple& t : tensors) {
      if (t.size() != 4 && t.size() != 5 && t.size() != 7) {
        throw py::value_error(
            "tensor spec must be (name, numel, trainable, group[, shape[, expert_set, expert]])");
      }
      specs.push_back(session::TensorSpec{t[0].cast<std::string>(), t[1].cast<uint64_t>(),
                                          t[2].cast<bool>(), t[3].cast<int>()});
      if (t.size() >= 5) specs.back().shape = t[4].cast<std::vector<int64_t>>();
      if (t.size() == 7) {
        specs.back().expert_set = t[5].cast<int>();
        specs.back().expert = t[6].cast<int>();
      }
    }
    session::Sharding sh;
    if (!sharding.is_none()) {
      const py::tuple t = sharding.cast<py::tuple>();
      if (t.size() != 3) throw py::value_error("sharding must be (world, rank, collectives)");
      sh.world = t[0].cast<int>();
      sh.rank = t[1].cast<int>();
      collectives_ = std::make_unique<PyCollectives>(t[2]);
      sh.collectives = collectives_.get();
    }
    s_ = Check(Session::Create(config, std::move(specs), sh));
    protocol_ = std::make_unique<session::UnitProtocol>(s_.get());
  }

  torch::Tensor View(void* addr, size_t group, ChunkKind kind, TierKind where) const {
    auto opts = torch::TensorOptions().dtype(TorchDType(s_->dtype(kind)));
    if (where == TierKind::kDevice && s_->cuda()) opts = opts.device(torch::kCUDA, 0);
    if ((kind == ChunkKind::kExpAvg || kind == ChunkKind::kExpAvgSq) &&
        s_->state_format(group).compressed()) {
      // Compressed m or v: the chunk's bytes (codes, then int8's absmax); read_tensor
      // dequantizes.
      return torch::from_blob(addr, {static_cast<int64_t>(s_->ChunkBytes(group, kind))},
                              opts.dtype(torch::kUInt8));
    }
    // Sharded: this rank's whole shard; else the chunk up to its last tensor.
    const uint64_t n = s_->sharded() ? s_->shard_elems() : s_->group(group).used_elems;
    return torch::from_blob(addr, {static_cast<int64_t>(n)}, opts);
  }
  // A scratch region of `bytes` (sharded gathers) as (token, uint8 view); FreeScratch(token).
  py::tuple AllocateScratch(TierKind where, uint64_t bytes) {
    const Region r = Check(s_->AllocateScratch(where, bytes));
    auto opts = torch::TensorOptions().dtype(torch::kUInt8);
    if (where == TierKind::kDevice && s_->cuda()) opts = opts.device(torch::kCUDA, 0);
    torch::Tensor v = torch::from_blob(r.addr, {static_cast<int64_t>(bytes)}, opts);
    return py::make_tuple(py::make_tuple(r.id, r.bytes, reinterpret_cast<uintptr_t>(r.addr)), v);
  }
  void FreeScratch(TierKind where, const std::tuple<uint64_t, uint64_t, uintptr_t>& token) {
    Region r{std::get<0>(token), std::get<1>(token), reinterpret_cast<void*>(std::get<2>(token))};
    Check(s_->FreeScratch(where, r));
  }
  // An NVMe region for spilled activations as a token (id, bytes, 0); StartSpillCopy moves
  // bytes between it and host scratch (a token AllocateScratch(host) returned).
  py::tuple AllocateSpill(uint64_t bytes) {
    const Region r = Check(s_->AllocateSpill(bytes));
    return py::make_tuple(r.id, r.bytes, uintptr_t{0});
  }
  void FreeSpill(const std::tuple<uint64_t, uint64_t, uintptr_t>& token) {
    Check(s_->FreeSpill(FromToken(token)));
  }
  // Starts the copy; the returned Pending's wait() (without the GIL) raises its error.
  std::shared_ptr<Completion> StartSpillCopy(const std::tuple<uint64_t, uint64_t, uintptr_t>& spill,
                                             uint64_t spill_offset,
                                             const std::tuple<uint64_t, uint64_t, uintptr_t>& host,
                                             uint64_t host_offset, uint64_t bytes, bool to_nvme) {
    return Check(s_->StartSpillCopy(FromToken(spill), spill_offset, FromToken(host), host_offset,
                                    bytes, to_nvme));
  }
  static Region FromToken(const std::tuple<uint64_t, uint64_t, uintptr_t>& token) {
    return Region{std::get<0>(token), std::get<1>(token),
                  reinterpret_cast<void*>(std::get<2>(token))};
  }
  // `cls` >= 0: acquired as a member of that class (an expert chosen by the routing).
  torch::Tensor Acquire(size_t group, ChunkKind kind, TierKind where, int64_t cls) {
    return View(Check(s_->Acquire(group, kind, where, ClassOf(cls))), group, kind, where);
  }
  // For a caller about to write into (part of) the chunk: a lazily zero chunk landing on the
  // device is zeroed here by torch on the compute device (a memset kernel on CUDA, ordered on
  // the current stream before the caller's writes) instead of a copy from a zeros buffer.
  torch::Tensor AcquireForWrite(size_t group, ChunkKind kind, TierKind where, int64_t cls) {
    bool must_zero = false;
    void* addr = Check(s_->AcquireForWrite(group, kind, where, &must_zero, ClassOf(cls)));
    torch::Tensor v = View(addr, group, kind, where);
    if (must_zero) {
      const int64_t bytes = static_cast<int64_t>(s_->ChunkBytes(group, kind));
      torch::from_blob(addr, {bytes}, v.options().dtype(torch::kUInt8)).zero_();
    }
    return v;
  }

  torch::Tensor ReadParam(size_t t) {
    torch::Tensor out = torch::empty({Numel(t)}, torch::kFloat32);
    Check(s_->ReadParam(t, out.data_ptr<float>()));
    return out;
  }
  void WriteParam(size_t t, const torch::Tensor& v) {
    CheckHostSpan(v, "value", Numel(t), torch::kFloat32);
    Check(s_->WriteParam(t, v.data_ptr<float>()));
  }
  torch::Tensor ReadTensor(size_t t, ChunkKind kind) {
    torch::Tensor out = torch::empty({Numel(t)}, TorchDType(s_->dtype(kind)));
    Check(s_->ReadTensor(t, kind, out.data_ptr()));
    return out;
  }
  void WriteTensor(size_t t, ChunkKind kind, const torch::Tensor& v) {
    CheckHostSpan(v, "value", Numel(t), TorchDType(s_->dtype(kind)));
    Check(s_->WriteTensor(t, kind, v.data_ptr()));
  }
  void SetHasGrad(const std::vector<bool>& flags) {
    if (flags.size() != s_->num_tensors()) throw py::value_error("one flag per tensor");
    for (size_t i = 0; i < flags.size(); ++i) s_->SetHasGrad(i, flags[i]);
  }
  // `global_stats`: None, or (sum of squares, overflow) of the whole model's gradients (a
  // sharded binding's all-reduce of every rank's grad_stats()).
  py::dict Step(const std::vector<std::tuple<double, double, double, double, double>>& hyper,
                const py::object& global_stats) {
    std::vector<session::GroupHyper> h;
    for (const auto& [lr, b1, b2, eps, wd] : hyper) h.push_back({lr, b1, b2, eps, wd});
    std::optional<kernels::GradStats> global;
    if (!global_stats.is_none()) {
      const auto [sq, overflow] = global_stats.cast<std::tuple<double, bool>>();
      global = kernels::GradStats{sq, overflow};
    }
    StatusOr<session::StepResult> r = InternalError("not run");
    {
      py::gil_scoped_release nogil;
      kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
      r = s_->Step(h, global ? &*global : nullptr);
    }
    const session::StepResult res = Check(std::move(r));
    py::dict d;
    d["applied"] = res.applied;
    d["skipped"] = res.skipped;
    d["grad_norm"] = res.grad_norm;
    d["clip_coef"] = res.clip_coef;
    return d;
  }
  // The hyper-parameters the next step() will pass (speculative steps,
  // runtime/optimizer_stepper.h).
  void SetStepHyper(const std::vector<std::tuple<double, double, double, double, double>>& hyper) {
    std::vector<session::GroupHyper> h;
    for (const auto& [lr, b1, b2, eps, wd] : hyper) h.push_back({lr, b1, b2, eps, wd});
    s_->SetStepHyper(std::move(h));
  }
  py::tuple GradStats() {
    StatusOr<kernels::GradStats> st = InternalError("not run");
    {
      py::gil_scoped_release nogil;
      kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
      st = s_->GradStats();
    }
    const kernels::GradStats g = Check(std::move(st));
    return py::make_tuple(g.sq_norm, g.overflow);
  }
  py::dict Stats() {
    const chunks::EngineStats s = Check(s_->Stats());
    py::dict d, tiers, moved;
    for (int k = 0; k < kNumTierKinds; ++k) {
      py::dict t;
      t["capacity"] = s.tiers[k].capacity;
      t["used"] = s.tiers[k].used;
      t["peak"] = s.tiers[k].peak;
      t["host_overhead"] = s.tiers[k].host_overhead;
      tiers[py::str(std::string(TierKindName(static_cast<TierKind>(k))))] = t;
    }
    for (int a = 0; a < kNumTierKinds; ++a) {
      for (int b = 0; b < kNumTierKinds; ++b) {
        if (s.bytes_moved[a][b] == 0) continue;
        moved[py::str(std::string(TierKindName(static_cast<TierKind>(a))) + "->" +
                      std::string(TierKindName(static_cast<TierKind>(b))))] = s.bytes_moved[a][b];
      }
    }
    d["tiers"] = tiers;
    // Host memory no budget counts (runtime.py adds the saved activations).
    py::dict outside;
    outside["runtime_bytes"] = Check(s_->RuntimeHostBytes());
    d["outside_budget"] = outside;
    d["bytes_moved"] = moved;
    d["stall_ns"] = s.stall_ns;
    d["stalls"] = s.stalls;
    d["evictions"] = s.evictions;
    d["clean_evictions"] = s.clean_evictions;
    d["prefetches"] = s.prefetches;
    d["hint_prefetches"] = s.hint_prefetches;
    d["write_behinds"] = s.write_behinds;
    d["acquires"] = s.acquires;
    d["iterations"] = s.iterations;
    d["diverged"] = s.diverged;
    d["resynced"] = s.resynced;
    d["device_waits"] = s.device_waits;
    // Acquires that waited for bytes from below (chunks/engine.h): in all and by phase.
    auto waits = [](const chunks::AcquireWaits& w) {
      py::dict o;
      o["misses"] = w.misses;
      o["miss_bytes"] = w.miss_bytes;
      o["late"] = w.late;
      o["late_bytes"] = w.late_bytes;
      return o;
    };
    py::dict acquire_waits = waits(s.waits), by_phase;
    for (const auto& [label, w] : s.waits_by_phase) {
      if (w.misses + w.late > 0) by_phase[py::str(label.empty() ? "none" : label)] = waits(w);
    }
    acquire_waits["by_phase"] = by_phase;
    d["acquire_waits"] = acquire_waits;
    // Where each chunk group's optimizer steps (decided at the first applied step).
    py::dict opt;
    opt["placed"] = s_->optimizer_placed();
    py::list on_device;
    for (size_t g = 0; g < s_->num_groups(); ++g) {
      if (s_->OptimizerOnDevice(g)) on_device.append(g);
    }
    opt["device_groups"] = on_device;
    // The optimizer-state format (optimizer.state_dtype): the bytes of every m and v chunk,
    // what they would be in fp32, the optimizer-state bytes moved to or from NVMe so far, and
    // what those moves would have added in fp32 state (estimated with the layout's ratio).
    const Bytes state = s_->state_bytes(), state_fp32 = s_->state_bytes_fp32();
    const Bytes nvme_state = s.nvme_bytes_by_category[static_cast<int>(Category::kOptimState)];
    opt["state_dtype"] =
        std::string(kernels::StateDTypeName(s_->config().optimizer_state.format.dtype));
    opt["state_bytes"] = state;
    opt["state_bytes_fp32"] = state_fp32;
    opt["nvme_state_bytes"] = nvme_state;
    opt["nvme_bytes_saved"] =
        state > 0 ? static_cast<Bytes>(static_cast<double>(nvme_state) *
                                       (static_cast<double>(state_fp32) / state - 1.0))
                  : Bytes{0};
    d["optimizer"] = opt;
    // Plans (plan: auto): the runner's counters and the engine's planned actions.
    const session::Session::PlanStatus ps = s_->plan_status();
    py::dict plan;
    plan["active"] = ps.active;
    plan["plans"] = ps.runner.plans;
    plan["planned_iterations"] = ps.runner.planned_iterations;
    plan["followed_iterations"] = ps.runner.followed_iterations;
    plan["divergences"] = ps.runner.divergences;
    plan["last_divergence"] = ps.runner.last_divergence;
    plan["error"] = ps.error;
    plan["declined"] = ps.declined;
    plan["actions"] = ps.actions;
    plan["predicted_iteration_ns"] = ps.estimate.steady_iteration_ns;
    plan["predicted_stall_ns"] = ps.estimate.steady_stall_ns;
    plan["predicted_device_in_bytes"] = ps.estimate.steady_device_in_bytes;
    plan["predicted_nvme_bytes"] = ps.estimate.steady_nvme_bytes;
    plan["prefetches"] = s.plan_prefetches;
    plan["evictions"] = s.plan_evictions;
    plan["skipped"] = s.plan_skipped;
    plan["deferred"] = s.plan_deferred;
    d["plan"] = plan;
    return d;
  }
  py::tuple Group(size_t g) const {
    if (g >= s_->num_groups()) throw py::value_error("unknown chunk group");
    const session::ChunkGroup& grp = s_->group(g);
    std::vector<std::pair<uint32_t, uint32_t>> pieces;
    for (const session::PieceRef& r : grp.pieces) pieces.emplace_back(r.tensor, r.piece);
    return py::make_tuple(grp.trainable, grp.used_elems, grp.tensors, pieces);
  }
  // [(group, offset, numel, begin, expert)] in element order: one per piece.
  py::list Place(size_t t) const {
    if (t >= s_->num_tensors()) throw py::value_error("unknown tensor");
    py::list out;
    for (const session::Piece& p : s_->place(t).pieces) {
      out.append(py::make_tuple(p.group, p.offset, p.numel, p.begin, p.expert));
    }
    return out;
  }
  py::dict LoadCheckpoint(const std::string& path, bool verify_only,
                          std::optional<size_t> num_groups, std::optional<size_t> rng_state_bytes) {
    session::CheckpointMeta meta;
    session::CheckpointLoad how;
    how.verify_only = verify_only;
    how.num_groups = num_groups;
    how.rng_state_bytes = rng_state_bytes;
    Check(s_->LoadCheckpoint(path, &meta, how));
    return MetaDict(meta);
  }

  Session& s() { return *s_; }
  const Session& s() const { return *s_; }
  session::UnitProtocol& protocol() { return *protocol_; }
  // Closes the session, then lets go of the Python collectives (and so of its process
  // group): a group kept alive until interpreter exit takes its threads down during
  // finalization, which aborts the process.
  void Close() {
    s_->Close();
    collectives_.reset();
  }

 private:
  static uint32_t ClassOf(int64_t cls) {
    return cls < 0 ? chunks::kNoClass : static_cast<uint32_t>(cls);
  }
  int64_t Numel(size_t t) const {
    if (t >= s_->num_tensors()) throw py::value_error("unknown tensor " + std::to_string(t));
    return static_cast<int64_t>(s_->place(t).numel);
  }
  std::unique_ptr<PyCollectives> collectives_;  // outlives s_ (declared first)
  std::unique_ptr<Session> s_;
  std::unique_ptr<session::UnitProtocol> protocol_;  // over s_ (declared after: destroyed first)
};

kernels::AdamConfig AdamConfigOf(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, int64_t step) {
  kernels::AdamConfig c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.eps = static_cast<float>(eps);
  c.weight_decay = static_cast<float>(weight_decay);
  c.step = step;
  return c;
}

// The spans of four checked tensors (fp32 param and state; grad in its own dtype).
kernels::AdamSpans AdamSpansOf(torch::Tensor& param, torch::Tensor& grad, torch::Tensor& exp_avg,
                               torch::Tensor& exp_avg_sq) {
  kernels::AdamSpans s;
  s.param = param.data_ptr<float>();
  s.exp_avg = exp_avg.data_ptr<float>();
  s.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  s.grad = grad.data_ptr();
  s.grad_dtype = KernelDType(grad);
  s.n = static_cast<size_t>(param.numel());
  return s;
}

// One fused AdamW step where the tensors live — the kernels the session runs, as torch code
// can call them (tests compare the engine with them bit for bit; benchmarks race torch's fused
// AdamW). CPU tensors: kernels::AdamStep now, on this thread's pool. CUDA tensors: the
// device-placed step (session::DeviceAdamStep) enqueued on `stream`
// (torch.cuda.current_stream().cuda_stream; 0 = the legacy default stream); a build without
// CUDA raises there. Param and state are fp32, grad in its own dtype, `param_out` (the
// low-precision copy) bf16/fp16; all contiguous, of one size, on one device.
//
// Compressed state (kernels/cpu/optim.h "Compressed state"): exp_avg and exp_avg_sq as uint8
// codes with `exp_avg_absmax` / `exp_avg_sq_absmax` (fp32, one per `state_block` elements) for
// int8 state, or as bfloat16 for bf16 state (`stochastic` rounding keyed by `rounding_seed`).
void AdamStepBinding(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg,
                     torch::Tensor exp_avg_sq, std::optional<torch::Tensor> param_out, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step,
                     double inv_loss_scale, double clip_factor, uintptr_t stream,
                     std::optional<torch::Tensor> exp_avg_absmax,
                     std::optional<torch::Tensor> exp_avg_sq_absmax, int64_t state_block,
                     bool stochastic, uint64_t rounding_seed) {
  const int64_t n = param.numel();
  const torch::Device dev = param.device();
  const bool cuda = dev.is_cuda();
  if (!cuda && !dev.is_cpu()) {
    throw py::value_error("adam_step: CPU or CUDA tensors expected, got " + dev.str());
  }
  const auto check = [&](const torch::Tensor& t, const char* what) {
    if (!t.is_contiguous() || t.device() != dev || t.numel() != n) {
      throw py::value_error(std::string("adam_step: ") + what + " must be a contiguous tensor " +
                            "of " + std::to_string(n) + " elements on " + dev.str() +
                            " like param");
    }
  };
  check(grad, "grad");
  // The state format, from the state tensors' dtype.
  kernels::StateFormat format;
  if (exp_avg.scalar_type() == torch::kUInt8) format.dtype = kernels::StateDType::kInt8;
  if (exp_avg.scalar_type() == torch::kBFloat16) format.dtype = kernels::StateDType::kBF16;
  format.block = static_cast<uint32_t>(state_block);
  format.stochastic = stochastic;
  const torch::ScalarType state_type =
      format.compressed() ? exp_avg.scalar_type() : torch::kFloat32;
  for (const auto& [t, what] : {std::pair<const torch::Tensor*, const char*>{&param, "param"},
                                {&exp_avg, "exp_avg"},
                                {&exp_avg_sq, "exp_avg_sq"}}) {
    check(*t, what);
    const torch::ScalarType want = t == &param ? torch::kFloat32 : state_type;
    if (t->scalar_type() != want) {
      const char* name = want == torch::kFloat32    ? "float32"
                         : want == torch::kBFloat16 ? "bfloat16"
                                                    : "uint8";
      throw py::value_error(std::string("adam_step: ") + what + " must be " + name +
                            (t == &param ? ""
                                         : " (m and v alike: float32, or compressed: "
                                           "bfloat16, or uint8 codes with their absmax)") +
                            ", got " + std::string(c10::toString(t->scalar_type())));
    }
  }
  kernels::AdamConfig c = AdamConfigOf(lr, beta1, beta2, eps, weight_decay, step);
  c.inv_loss_scale = static_cast<float>(inv_loss_scale);
  c.clip_factor = static_cast<float>(clip_factor);
  c.rounding_seed = rounding_seed;
  kernels::AdamSpans s;
  if (!format.compressed()) {
    s = AdamSpansOf(param, grad, exp_avg, exp_avg_sq);
  } else {
    s.param = param.data_ptr<float>();
    s.grad = grad.data_ptr();
    s.grad_dtype = KernelDType(grad);
    s.n = static_cast<size_t>(n);
    s.state = format;
    Check(kernels::ValidateStateFormat(format));
    float* absmax[2] = {nullptr, nullptr};
    if (format.dtype == kernels::StateDType::kInt8) {
      const int64_t blocks = static_cast<int64_t>(kernels::StateBlocks(format, n));
      int k = 0;
      for (const auto& [t, what] : {std::pair<std::optional<torch::Tensor>*, const char*>{
                                        &exp_avg_absmax, "exp_avg_absmax"},
                                    {&exp_avg_sq_absmax, "exp_avg_sq_absmax"}}) {
        if (!*t || !(*t)->is_contiguous() || (*t)->device() != dev ||
            (*t)->scalar_type() != torch::kFloat32 || (*t)->numel() != blocks) {
          throw py::value_error(std::string("adam_step: uint8 state needs ") + what +
                                ": a contiguous float32 tensor of " + std::to_string(blocks) +
                                " elements (one per block of " + std::to_string(state_block) + ")");
        }
        absmax[k++] = (*t)->data_ptr<float>();
      }
    }
    s.exp_avg_q = {exp_avg.data_ptr(), absmax[0]};
    s.exp_avg_sq_q = {exp_avg_sq.data_ptr(), absmax[1]};
  }
  if (param_out) {
    check(*param_out, "param_out");
    s.param_out = param_out->data_ptr();
    s.out_dtype = KernelDType(*param_out);
    if (s.out_dtype == kernels::DType::kF32) throw py::value_error("param_out must be bf16/fp16");
  }
  if (cuda) {
    Check(session::DeviceAdamStep(true, c, s, ComputeStream{stream}));
    return;
  }
  if (stream != 0) throw py::value_error("adam_step: a stream is for CUDA tensors only");
  Check(kernels::ValidateAdam(c, s));
  py::gil_scoped_release nogil;
  kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
  kernels::AdamStep(c, s);
}

py::tuple GradStatsBinding(torch::Tensor grad) {
  if (!grad.is_contiguous() || grad.device().type() != torch::kCPU) {
    throw py::value_error("grad must be a contiguous CPU tensor");
  }
  const kernels::DType dt = KernelDType(grad);
  kernels::GradStats st;
  {
    py::gil_scoped_release nogil;
    kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
    st = kernels::GradNormAndOverflow(grad.data_ptr(), dt, static_cast<size_t>(grad.numel()));
  }
  return py::make_tuple(st.sq_norm, st.overflow);
}

// (ts_ns, type, tier, tier2, bytes, chunk, category, flags, label, id) in time order.
py::list ReadTimeline(const std::string& path) {
  py::list out;
  Check(prof::ForEachOrdered(path, [&](const TimelineEntry& t) {
    const Event& e = t.event;
    out.append(py::make_tuple(e.ts_ns, static_cast<int>(e.type), static_cast<int>(e.tier),
                              static_cast<int>(e.tier2), e.bytes, e.chunk,
                              static_cast<int>(e.category), static_cast<int>(e.flags),
                              std::string(t.label), e.id));
  }));
  return out;
}

}  // namespace
}  // namespace tiermem::torch_ext

PYBIND11_MODULE(_C, m) {
  using tiermem::torch_ext::Check;
  using tiermem::torch_ext::PySession;
  namespace se = tiermem::session;
  m.doc() = "tiermem session core (C++)";

  py::enum_<tiermem::chunks::ChunkKind>(m, "ChunkKind")
      .value("param_lowp", tiermem::chunks::ChunkKind::kParamLowp)
      .value("param_fp32", tiermem::chunks::ChunkKind::kParamFp32)
      .value("exp_avg", tiermem::chunks::ChunkKind::kExpAvg)
      .value("exp_avg_sq", tiermem::chunks::ChunkKind::kExpAvgSq)
      .value("grad", tiermem::chunks::ChunkKind::kGrad);
  py::enum_<tiermem::TierKind>(m, "Tier")
      .value("device", tiermem::TierKind::kDevice)
      .value("host", tiermem::TierKind::kHost)
      .value("nvme", tiermem::TierKind::kNvme)
      .value("none", tiermem::TierKind::kNone);

  tiermem::torch_ext::BindModes(m);
  // The modes are the enums above (their predicates answer what code asks of them).
  py::class_<se::SessionConfig>(m, "Config")
      .def_readonly("device_budget", &se::SessionConfig::device_budget)
      .def_readonly("host_budget", &se::SessionConfig::host_budget)
      .def_readonly("nvme_size", &se::SessionConfig::nvme_size)
      .def_property_readonly("nvme_path",
                             [](const se::SessionConfig& c) -> py::object {
                               if (c.nvme_path.empty()) return py::none();
                               return py::str(c.nvme_path);
                             })
      .def_property_readonly("timeline",
                             [](const se::SessionConfig& c) -> py::object {
                               if (c.timeline.empty()) return py::none();
                               return py::str(c.timeline);
                             })
      .def_readonly("device_kind", &se::SessionConfig::device_kind)
      .def_readonly("nvme_engine", &se::SessionConfig::nvme_engine)
      .def_readonly("kernel_isa", &se::SessionConfig::kernel_isa)
      .def_readonly("precision", &se::SessionConfig::precision)
      .def_property_readonly("lr", [](const se::SessionConfig& c) { return c.optimizer.lr; })
      .def_property_readonly("betas",
                             [](const se::SessionConfig& c) {
                               return py::make_tuple(c.optimizer.beta1, c.optimizer.beta2);
                             })
      .def_property_readonly("eps", [](const se::SessionConfig& c) { return c.optimizer.eps; })
      .def_property_readonly("weight_decay",
                             [](const se::SessionConfig& c) { return c.optimizer.weight_decay; })
      .def_readonly("gradient_accumulation_steps", &se::SessionConfig::gradient_accumulation_steps)
      .def_readonly("gradient_clipping", &se::SessionConfig::gradient_clipping)
      .def_readonly("chunk_size", &se::SessionConfig::chunk_size)
      .def_readonly("prefetch_depth", &se::SessionConfig::prefetch_depth)
      .def_readonly("write_behind", &se::SessionConfig::write_behind)
      .def_readonly("unmaterialized_reads", &se::SessionConfig::unmaterialized_reads)
      .def_readonly("plan", &se::SessionConfig::plan)
      .def_readonly("activations", &se::SessionConfig::activations)
      .def_readonly("optimizer_placement", &se::SessionConfig::optimizer_placement)
      .def_readonly("optimizer_overlap", &se::SessionConfig::optimizer_overlap)
      .def_readonly("checkpoint_io", &se::SessionConfig::checkpoint_io)
      .def_readonly("in_place", &se::SessionConfig::in_place)
      .def_property_readonly(
          "state_dtype",
          [](const se::SessionConfig& c) {
            return std::string(tiermem::kernels::StateDTypeName(c.optimizer_state.format.dtype));
          })
      .def("to_dict",
           [](const se::SessionConfig& c) {
             return py::module_::import("json").attr("loads")(se::ToJson(c).dump());
           })
      .def("__repr__", [](const se::SessionConfig& c) {
        return "tiermem.Config(" + se::ToJson(c).dump() + ")";
      });
  m.def("parse_config", &tiermem::torch_ext::ParseConfigText, py::arg("json_text"),
        py::arg("env") = py::none());
  m.def(
      "parse_config_file",
      [](const std::string& path, const std::optional<std::map<std::string, std::string>>& env) {
        return Check(se::ParseConfigFile(path, tiermem::torch_ext::EnvArg(env)));
      },
      py::arg("path"), py::arg("env") = py::none());

  using K = tiermem::chunks::ChunkKind;
  // An asynchronous copy in flight (Session::StartSpillCopy).
  py::class_<tiermem::Completion, std::shared_ptr<tiermem::Completion>>(m, "Pending")
      .def_property_readonly("done", [](const tiermem::Completion& c) { return c.Poll(); })
      .def("wait", [](const tiermem::Completion& c) {
        tiermem::Status st;
        {
          py::gil_scoped_release nogil;
          st = c.Wait();
        }
        Check(st);
      });

  tiermem::torch_ext::BindProtocol(m);
  py::class_<PySession>(m, "Session")
      .def(py::init<const se::SessionConfig&, const std::vector<py::tuple>&, const py::object&>(),
           py::arg("config"), py::arg("tensors"), py::arg("sharding") = py::none())
      // The unit protocol over this session (runtime/unit_protocol.h): the hooks' calls.
      .def_property_readonly(
          "units", [](PySession& s) -> se::UnitProtocol& { return s.protocol(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly("world", [](const PySession& s) { return s.s().world(); })
      .def_property_readonly("rank", [](const PySession& s) { return s.s().rank(); })
      .def_property_readonly("sharded", [](const PySession& s) { return s.s().sharded(); })
      .def_property_readonly("shard_elems", [](const PySession& s) { return s.s().shard_elems(); })
      .def_property_readonly("shard_begin", [](const PySession& s) { return s.s().shard_begin(); })
      .def("allocate_scratch", &PySession::AllocateScratch)
      .def("free_scratch", &PySession::FreeScratch)
      .def("allocate_spill", &PySession::AllocateSpill)
      .def("free_spill", &PySession::FreeSpill)
      .def("start_spill_copy", &PySession::StartSpillCopy)
      .def("close", &PySession::Close)
      .def_property_readonly("closed", [](const PySession& s) { return s.s().closed(); })
      .def("acquire", &PySession::Acquire, py::arg("group"), py::arg("kind"), py::arg("where"),
           py::arg("cls") = -1)
      .def("acquire_for_write", &PySession::AcquireForWrite, py::arg("group"), py::arg("kind"),
           py::arg("where"), py::arg("cls") = -1)
      .def(
          "prefetch",
          [](PySession& s, size_t g, K k, tiermem::TierKind where, double p) {
            return Check(s.s().Prefetch(g, k, where, p));
          },
          py::arg("group"), py::arg("kind"), py::arg("where"), py::arg("probability") = 1.0)
      .def("release",
           [](PySession& s, size_t g, K k, bool modified) { Check(s.s().Release(g, k, modified)); })
      .def("zero_chunk", [](PySession& s, size_t g, K k) { Check(s.s().ZeroChunk(g, k)); })
      .def("pins", [](const PySession& s, size_t g, K k) { return s.s().Pins(g, k); })
      .def("lazily_zero", [](const PySession& s, size_t g, K k) { return s.s().LazilyZero(g, k); })
      .def("resident", [](const PySession& s, size_t g, K k) { return s.s().Resident(g, k); })
      .def("home", [](const PySession& s, size_t g, K k) { return s.s().Home(g, k); })
      .def("has_kind", [](const PySession& s, size_t g, K k) { return s.s().has_kind(g, k); })
      .def("chunk_bytes", [](const PySession& s, size_t g, K k) { return s.s().ChunkBytes(g, k); })
      // The optimizer-state format of a group's m and v: (dtype name, block, stochastic).
      .def("state_format",
           [](const PySession& s, size_t g) {
             if (g >= s.s().num_groups()) throw py::index_error("no such chunk group");
             const tiermem::kernels::StateFormat& f = s.s().state_format(g);
             return py::make_tuple(std::string(tiermem::kernels::StateDTypeName(f.dtype)), f.block,
                                   f.stochastic);
           })
      // Bytes per element of a kind's chunks (the core's dtype for the kind: the compute dtype
      // for compute params and grads, fp32 otherwise), so the binding never re-derives it.
      .def("element_size",
           [](const PySession& s, K k) { return tiermem::kernels::DTypeSize(s.s().dtype(k)); })
      .def("read_param", &PySession::ReadParam)
      .def("write_param", &PySession::WriteParam)
      .def("read_tensor", &PySession::ReadTensor)
      .def("write_tensor", &PySession::WriteTensor)
      .def("step_count", [](const PySession& s, size_t t) { return s.s().step_count(t); })
      .def("set_step_count",
           [](PySession& s, size_t t, int64_t n) { Check(s.s().SetStepCount(t, n)); })
      .def("set_has_grad", &PySession::SetHasGrad)
      .def("has_grad", [](const PySession& s, size_t t) { return s.s().has_grad(t); })
      .def("grad_stats", &PySession::GradStats)
      .def("zero_grad", [](PySession& s) { return Check(s.s().ZeroGrad()); })
      .def_property_readonly("accumulating",
                             [](const PySession& s) { return s.s().accumulating(); })
      .def_property_readonly("next_step_applies",
                             [](const PySession& s) { return s.s().next_step_applies(); })
      .def("step", &PySession::Step, py::arg("hyper"), py::arg("global_stats") = py::none())
      .def_property_readonly("loss_scale", [](const PySession& s) { return s.s().loss_scale(); })
      .def_property(
          "scaler",
          [](const PySession& s) {
            const se::ScalerState st = s.s().scaler();
            return py::make_tuple(st.scale, st.good_steps, st.skipped_steps);
          },
          [](PySession& s, const std::tuple<double, int, uint64_t>& v) {
            s.s().set_scaler({std::get<0>(v), std::get<1>(v), std::get<2>(v)});
          })
      .def("begin_iteration", [](PySession& s) { s.s().BeginIteration(); })
      // A moment outside the unit protocol (a unit's moments: Session.units); unit: the unit
      // index (-1: none).
      .def(
          "moment",
          [](PySession& s, const std::string& l, tiermem::planners::MomentKind kind, int64_t unit) {
            s.s().Moment(l, kind,
                         unit < 0 ? tiermem::planners::kNoUnit : static_cast<uint32_t>(unit));
          },
          py::arg("label"), py::arg("kind") = tiermem::planners::MomentKind::kOther,
          py::arg("unit") = -1)
      .def(
          "record_trace",
          [](PySession& s, const std::string& path, int iterations) {
            Check(s.s().RecordTrace(path, iterations));
          },
          py::arg("path"), py::arg("iterations") = 1)
      .def("finish_trace", [](PySession& s) { return Check(s.s().FinishTrace()); })
      .def_property_readonly("recording_trace",
                             [](const PySession& s) { return s.s().recording_trace(); })
      .def_property_readonly("trace_armed", [](const PySession& s) { return s.s().trace_armed(); })
      .def_property_readonly("written_trace",
                             [](const PySession& s) { return s.s().written_trace(); })
      .def("add_saved_bytes", [](PySession& s, uint64_t b) { s.s().AddSavedBytes(b); })
      .def("phase", [](PySession& s, const std::string& l) { s.s().Phase(l); })
      .def("record_collective", [](PySession& s, const std::string& op, uint64_t bytes,
                                   uint64_t ns) { s.s().RecordCollective(op, bytes, ns); })
      .def("set_tracing", [](PySession& s, bool on) { s.s().SetTracing(on); })
      .def("set_cyclic", [](PySession& s, bool on) { s.s().SetCyclic(on); })
      // The compute stream as an integer handle (torch.cuda.current_stream().cuda_stream on
      // CUDA; 0 = work on the calling thread, CPU tensors).
      .def("set_compute_stream",
           [](PySession& s, uintptr_t handle) { s.s().SetComputeStream({handle}); })
      .def("set_external_device_bytes",
           [](PySession& s, uint64_t b) { Check(s.s().SetExternalDeviceBytes(b)); })
      .def("set_external_compute_bytes",
           [](PySession& s, uint64_t b) { Check(s.s().SetExternalComputeBytes(b)); })
      .def("set_external_host_bytes",
           [](PySession& s, uint64_t b) { Check(s.s().SetExternalHostBytes(b)); })
      .def("plan_offloads_unit",
           [](const PySession& s, uint32_t u) { return s.s().PlanOffloadsUnit(u); })
      .def("plan_recomputes_unit",
           [](const PySession& s, uint32_t u) { return s.s().PlanRecomputesUnit(u); })
      .def_property_readonly("plan_followed",
                             [](const PySession& s) { return s.s().PlanFollowed(); })
      .def("take_activation_fetches", [](PySession& s) { return s.s().TakeActivationFetches(); })
      .def("synchronize", [](PySession& s) { Check(s.s().Synchronize()); })
      .def("flush", [](PySession& s) { Check(s.s().Flush()); })
      // Deferred optimizer updates (optimizer_stepper.h): a unit's groups before its forward
      // moment.
      .def(
          "finish_steps",
          [](PySession& s, const std::vector<size_t>& groups) {
            tiermem::Status st;
            {
              py::gil_scoped_release nogil;
              tiermem::kernels::ScopedParallelFor pool(tiermem::torch_pool::ForThisThread());
              for (size_t g : groups) {
                st = s.s().FinishStep(g);
                if (!st.ok()) break;
              }
            }
            Check(st);
          },
          py::arg("groups"))
      .def_property_readonly("pending_steps", [](PySession& s) { return s.s().pending_steps(); })
      .def("set_step_hyper", &PySession::SetStepHyper, py::arg("hyper"))
      .def_property_readonly("speculation",
                             [](PySession& s) {
                               const auto& st = s.s().speculation_stats();
                               py::dict d;
                               d["speculated"] = st.speculated;
                               d["committed"] = st.committed;
                               d["dropped"] = st.dropped;
                               d["no_room"] = st.no_room;
                               return d;
                             })
      .def("stats", &PySession::Stats)
      .def("timeline_report",
           [](PySession& s) {
             return tiermem::torch_ext::ReportDict(Check(s.s().TimelineReport()));
           })
      // param_groups and extra: JSON text; rng_state: bytes (runtime/checkpoint_meta.h).
      .def(
          "save_checkpoint",
          [](PySession& s, const std::string& path, const std::string& param_groups,
             const py::bytes& rng_state, const std::string& extra) {
            Check(s.s().SaveCheckpoint(
                path, tiermem::torch_ext::MetaFrom(param_groups, rng_state, extra)));
          },
          py::arg("path"), py::arg("param_groups") = "[]", py::arg("rng_state") = py::bytes(),
          py::arg("extra") = "null")
      // -> {"param_groups": JSON text, "rng_state": bytes, "extra": JSON text}
      .def("load_checkpoint", &PySession::LoadCheckpoint, py::arg("path"),
           py::arg("verify_only") = false, py::arg("num_groups") = py::none(),
           py::arg("rng_state_bytes") = py::none())
      .def("group", &PySession::Group)
      .def("place", &PySession::Place)
      .def_property_readonly("num_groups", [](const PySession& s) { return s.s().num_groups(); })
      .def_property_readonly("num_tensors", [](const PySession& s) { return s.s().num_tensors(); })
      .def_property_readonly("chunk_elems", [](const PySession& s) { return s.s().chunk_elems(); })
      .def_property_readonly("model_bytes", [](const PySession& s) { return s.s().model_bytes(); })
      .def_property_readonly("total_chunk_bytes",
                             [](const PySession& s) { return s.s().total_chunk_bytes(); })
      .def_property_readonly("minimum_device_budget",
                             [](const PySession& s) { return s.s().minimum_device_budget(); })
      .def_property_readonly("compute_kind",
                             [](const PySession& s) { return s.s().compute_kind(); })
      .def_property_readonly("mixed", [](const PySession& s) { return s.s().mixed(); })
      .def_property_readonly("cuda", [](const PySession& s) { return s.s().cuda(); })
      .def_property_readonly("device_kind", [](const PySession& s) { return s.s().device_kind(); })
      // What the Python parts ask of the layout (session.h, "what the bindings ask"): the
      // compute copy's torch dtype (dtypes.h's map) and element size, the compute budget,
      // and the caps derived from them.
      .def_property_readonly("compute_dtype",
                             [](const PySession& s) {
                               return tiermem::torch_dtypes::TorchDType(s.s().compute_dtype());
                             })
      .def_property_readonly("compute_element_size",
                             [](const PySession& s) { return s.s().compute_element_size(); })
      .def_property_readonly("compute_budget",
                             [](const PySession& s) { return s.s().compute_budget(); })
      .def_property_readonly(
          "compute_tier_holds_every_chunk",
          [](const PySession& s) { return s.s().compute_tier_holds_every_chunk(); })
      .def_property_readonly("holds_grad_chunks",
                             [](const PySession& s) { return s.s().holds_grad_chunks(); })
      .def(
          "activation_cap",
          [](const PySession& s, size_t unit_groups) { return s.s().ActivationCap(unit_groups); },
          py::arg("unit_groups"))
      .def(
          "recent_full_chunks",
          [](const PySession& s, size_t unit_groups) {
            return s.s().RecentFullChunks(unit_groups);
          },
          py::arg("unit_groups"))
      .def(
          "unit_compute_bytes",
          [](const PySession& s, const std::vector<size_t>& groups,
             const std::vector<std::vector<size_t>>& experts) {
            return Check(s.s().UnitComputeBytes(groups, experts));
          },
          py::arg("groups"), py::arg("experts") = std::vector<std::vector<size_t>>{})
      .def_property_readonly("host_compute",
                             [](const PySession& s) { return s.s().host_compute(); })
      .def_property_readonly("compute_tier",
                             [](const PySession& s) { return s.s().compute_tier(); })
      .def_property_readonly("io_backend", [](const PySession& s) { return s.s().io_backend(); })
      .def_property_readonly("nvme_registered_bytes",
                             [](const PySession& s) { return s.s().nvme_registered_bytes(); })
      .def_property_readonly("timeline_path",
                             [](const PySession& s) { return s.s().timeline_path(); });

  m.def("parse_bytes", [](const std::string& s) { return Check(tiermem::ParseBytes(s)); });
  // A tensor's version counter, held without the tensor (nor its storage): the saved-tensor
  // hooks check with it that an offloaded activation was not modified in place meanwhile.
  py::class_<c10::VariableVersion>(m, "VersionCounter")
      .def_property_readonly("version", &c10::VariableVersion::current_version);
  m.def("version_counter", [](const at::Tensor& t) {
    return c10::VariableVersion(t.unsafeGetTensorImpl()->version_counter());
  });
  m.def("adam_step", &tiermem::torch_ext::AdamStepBinding, py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_out"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("inv_loss_scale") = 1.0, py::arg("clip_factor") = 1.0,
        py::arg("stream") = 0, py::arg("exp_avg_absmax") = py::none(),
        py::arg("exp_avg_sq_absmax") = py::none(), py::arg("state_block") = 256,
        py::arg("stochastic") = false, py::arg("rounding_seed") = 0);
  // The compressed optimizer-state formats (kernels/cpu/optim.h "Compressed state"): the
  // dynamic code maps, and blockwise quantization of fp32 values (int8: (codes, absmax);
  // bf16: (bf16 values, None)) and back.
  m.def(
      "dynamic_code",
      [](bool is_signed) {
        return torch::from_blob(const_cast<float*>(tiermem::kernels::DynamicCode(is_signed)), {256},
                                torch::kFloat32)
            .clone();
      },
      py::arg("signed"));
  m.def(
      "quantize_state",
      [](const torch::Tensor& x, const std::string& dtype, int64_t block, bool is_signed,
         bool stochastic, uint64_t seed) {
        namespace k = tiermem::kernels;
        if (!x.is_contiguous() || !x.device().is_cpu() || x.scalar_type() != torch::kFloat32) {
          throw py::value_error("quantize_state: a contiguous float32 CPU tensor");
        }
        k::StateFormat f{Check(k::ParseStateDType(dtype)), static_cast<uint32_t>(block),
                         stochastic};
        Check(k::ValidateStateFormat(f));
        const int64_t n = x.numel();
        torch::Tensor codes =
            torch::empty({n}, f.dtype == k::StateDType::kInt8   ? torch::kUInt8
                              : f.dtype == k::StateDType::kBF16 ? torch::kBFloat16
                                                                : torch::kFloat32);
        torch::Tensor absmax =
            torch::empty({static_cast<int64_t>(k::StateBlocks(f, n))}, torch::kFloat32);
        k::QuantizeState(f, is_signed, x.data_ptr<float>(),
                         {codes.data_ptr(), absmax.data_ptr<float>()}, static_cast<size_t>(n),
                         seed);
        return py::make_tuple(codes, f.dtype == k::StateDType::kInt8 ? py::object(py::cast(absmax))
                                                                     : py::object(py::none()));
      },
      py::arg("x"), py::arg("dtype"), py::arg("block") = 256, py::arg("signed") = true,
      py::arg("stochastic") = false, py::arg("seed") = 0);
  m.def(
      "dequantize_state",
      [](const torch::Tensor& codes, const std::optional<torch::Tensor>& absmax, int64_t block,
         bool is_signed) {
        namespace k = tiermem::kernels;
        k::StateFormat f;
        if (codes.scalar_type() == torch::kUInt8)
          f.dtype = k::StateDType::kInt8;
        else if (codes.scalar_type() == torch::kBFloat16)
          f.dtype = k::StateDType::kBF16;
        else
          throw py::value_error("dequantize_state: uint8 codes (with absmax) or bfloat16");
        f.block = static_cast<uint32_t>(block);
        Check(k::ValidateStateFormat(f));
        const int64_t n = codes.numel();
        if (!codes.is_contiguous() || !codes.device().is_cpu() ||
            (f.dtype == k::StateDType::kInt8 &&
             (!absmax || !absmax->is_contiguous() || absmax->scalar_type() != torch::kFloat32 ||
              absmax->numel() != static_cast<int64_t>(k::StateBlocks(f, n))))) {
          throw py::value_error(
              "dequantize_state: contiguous CPU codes and, for uint8, float32 absmax "
              "of one value per block");
        }
        torch::Tensor out = torch::empty({n}, torch::kFloat32);
        k::DequantizeState(f, is_signed,
                           {codes.data_ptr(), absmax ? absmax->data_ptr<float>() : nullptr},
                           out.data_ptr<float>(), static_cast<size_t>(n));
        return out;
      },
      py::arg("codes"), py::arg("absmax") = py::none(), py::arg("block") = 256,
      py::arg("signed") = true);
  m.def("grad_stats", &tiermem::torch_ext::GradStatsBinding);
  m.def(
      "set_kernel_pool",
      [](const std::string& pool) {
        if (pool != "torch" && pool != "own") {
          throw py::value_error(
              "set_kernel_pool: 'torch' (torch's intra-op threads, the default) "
              "or 'own' (the kernels' oneTBB pool), not '" +
              pool + "'");
        }
        tiermem::torch_pool::SetEnabled(pool == "torch");
      },
      "Where CPU optimizer calls from torch's thread run their tiles (torch_pool.h).");
  m.def("kernel_pool",
        [] { return std::string(tiermem::torch_pool::Enabled() ? "torch" : "own"); });
  m.def("_torch_pool_width", &tiermem::torch_pool::Width);
  m.def(
      "set_kernel_threads", [](int n) { tiermem::kernels::SetKernelThreads(n); },
      "threads of the CPU kernels (0 = all cores)");
  m.def("kernel_isa",
        [] { return std::string(tiermem::kernels::IsaName(tiermem::kernels::KernelIsa())); });
  m.def("read_timeline", &tiermem::torch_ext::ReadTimeline);
  m.def("timeline_report", [](const std::string& path) {
    return tiermem::torch_ext::ReportDict(Check(tiermem::prof::AnalyzeFile(path)));
  });
  m.def("cuda_built", [] { return se::TierStack::CudaBuilt(); });
  // "13.0": the CUDA runtime this build links (the driver must support it); "" without CUDA.
  m.def("cuda_runtime_version", [] { return se::TierStack::CudaRuntimeVersion(); });
  m.def("checkpoint_metadata", [](const std::string& path) {
    return tiermem::torch_ext::MetaDict(Check(se::Session::CheckpointMetadata(path)));
  });
  // Optimizer param groups (runtime/param_groups.h): tensors as (name, trainable), `members`
  // as lists of tensor indices (-1: not the model's) or None (one group) -> each tensor's group.
  m.def(
      "assign_param_groups",
      [](const std::vector<std::pair<std::string, bool>>& tensors,
         const std::optional<std::vector<std::vector<int64_t>>>& members) {
        std::vector<se::TensorSpec> specs;
        for (const auto& [name, trainable] : tensors) {
          specs.push_back(se::TensorSpec{name, 1, trainable, 0});
        }
        return tiermem::torch_ext::Check(se::AssignParamGroups(specs, members));
      },
      py::arg("tensors"), py::arg("members"));
  m.def("resolve_device_kind",
        [](se::DeviceKind kind) { return Check(se::TierStack::ResolveDeviceKind(kind)); });
  tiermem::torch_ext::RegisterWeights(
      m, [](const py::handle& h) -> se::Session& { return h.cast<PySession&>().s(); });
}
