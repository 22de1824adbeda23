// tiermem._C: the Python binding of the chunk engine (pybind11 through torch's headers).
//
// A Runtime wraps a torch_common::RuntimeStack (integrations/torch/common, shared with the
// LibTorch API): the tiers (SimDevice or CUDA, host, NVMe, staging), the Mover, the binary
// timeline recorder and the Engine. The summaries Python shows are computed from the timeline
// file by tiermem::prof.
// Chunk memory reaches Python as 1-D tensors made with torch::from_blob over the region's
// address (CPU tensors on SimDevice and host, CUDA tensors on the CUDA tier): they do not own
// the memory and are valid only while the chunk stays acquired (the Python layer drops every
// view on release). The optimizer math runs in the fused CPU kernels (kernels/cpu) on host
// views, through adam_step/grad_stats below. Status codes become Python exceptions here, in
// one place: kInvalidArgument/kOutOfRange -> ValueError, kResourceExhausted -> MemoryError,
// kNotFound/kIOError/kDataLoss -> OSError, anything else -> RuntimeError.
//
// Threading: a Runtime is externally synchronized (the training thread); the GIL is held.
#include <torch/extension.h>

#include <memory>
#include <string>

#include "chunks/chunk_layout.h"
#include "kernels/cpu/optim.h"
#include "runtime/base/timeline.h"
#include "runtime/base/timeline_reader.h"
#include "integrations/torch/common/runtime_stack.h"
#include "runtime/engine/engine.h"
#include "runtime/prof/analysis.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

[[noreturn]] void Throw(const Status& s) {
  const std::string msg = s.ToString();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      throw py::value_error(msg);
    case StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, msg.c_str());
      throw py::error_already_set();
    case StatusCode::kNotFound:
    case StatusCode::kIOError:
    case StatusCode::kDataLoss:
      PyErr_SetString(PyExc_OSError, msg.c_str());
      throw py::error_already_set();
    default:
      throw std::runtime_error(msg);
  }
}
void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Check(StatusOr<T> s) {
  if (!s.ok()) Throw(s.status());
  return std::move(s).value();
}

StatusOr<TierKind> TierArg(const std::string& name) { return ParseTierKind(name); }

std::string PairName(TierKind a, TierKind b) {
  return std::string(TierKindName(a)) + "->" + std::string(TierKindName(b));
}

// The report of `path` (tiermem::prof) as the dict Python shows: peak and budget per tier,
// bytes per tier pair, stall time by cause. Everything comes from the file.
py::dict ReportDict(const prof::Report& r) {
  py::dict d, peak, budget, moved, stalls;
  for (int k = 0; k < kNumTierKinds; ++k) {
    const std::string n(TierKindName(static_cast<TierKind>(k)));
    peak[py::str(n)] = r.tiers[k].peak.bytes;
    budget[py::str(n)] = r.tiers[k].budget_bytes;
  }
  for (const prof::MoveStats& m : r.moves) moved[py::str(PairName(m.src, m.dst))] = m.bytes;
  for (const prof::StallStats& s : r.stalls) stalls[py::str(s.cause)] = s.ns;
  d["peak"] = peak;
  d["budget"] = budget;
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
  return d;
}

class Runtime {
 public:
  Runtime(uint64_t device_budget, uint64_t host_budget, const std::string& nvme_path,
          uint64_t nvme_size, int prefetch_depth, uint64_t host_reserve, uint64_t chunk_bytes,
          const std::string& timeline_path, const std::string& device) {
    torch_common::StackConfig c;
    c.device_budget = device_budget;
    c.host_budget = host_budget;
    c.nvme_path = nvme_path;
    c.nvme_size = nvme_size;
    c.prefetch_depth = prefetch_depth;
    c.host_reserve = host_reserve;
    c.chunk_bytes = chunk_bytes;
    c.timeline_path = timeline_path;
    c.device = device;
    stack_ = Check(torch_common::RuntimeStack::Create(c));
  }

  // Frees every region and closes the timeline (complete file). Idempotent.
  void Close() { stack_->Close(); }

  uint32_t AddChunk(uint64_t bytes, int category) {
    return Check(Live()->AddChunk(bytes, static_cast<Category>(category)));
  }
  torch::Tensor Acquire(uint32_t chunk, const std::string& tier, torch::Dtype dtype,
                        int64_t numel) {
    const TierKind t = Check(TierArg(tier));
    engine::Engine* e = Live();
    void* addr = Check(e->Acquire(chunk, t));
    const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
    if (numel * elem > static_cast<int64_t>(e->ChunkBytes(chunk))) {
      Check(e->Release(chunk, false));
      throw py::value_error("view of " + std::to_string(numel) + " elements exceeds chunk " +
                            std::to_string(chunk));
    }
    auto opts = torch::TensorOptions().dtype(dtype);
    if (t == TierKind::kDevice && stack_->cuda()) opts = opts.device(torch::kCUDA, 0);
    return torch::from_blob(addr, {numel}, opts);
  }
  // Acquire for a caller about to write into the chunk: a lazily zero chunk landing on the
  // device tier is zeroed here by torch on the compute device (a memset kernel on CUDA, ordered
  // on the current stream before the caller's own writes; memset on SimDevice) instead of a
  // synchronous copy from a zeros buffer. The whole chunk is zeroed, not only the view.
  torch::Tensor AcquireForWrite(uint32_t chunk, const std::string& tier, torch::Dtype dtype,
                                int64_t numel) {
    const TierKind t = Check(TierArg(tier));
    engine::Engine* e = Live();
    bool must_zero = false;
    void* addr = Check(e->AcquireForWrite(chunk, t, &must_zero));
    const int64_t bytes = static_cast<int64_t>(e->ChunkBytes(chunk));
    const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
    auto opts = torch::TensorOptions();
    if (t == TierKind::kDevice && stack_->cuda()) opts = opts.device(torch::kCUDA, 0);
    if (must_zero) torch::from_blob(addr, {bytes}, opts.dtype(torch::kUInt8)).zero_();
    if (numel * elem > bytes) {
      Check(e->Release(chunk, must_zero));
      throw py::value_error("view of " + std::to_string(numel) + " elements exceeds chunk " +
                            std::to_string(chunk));
    }
    return torch::from_blob(addr, {numel}, opts.dtype(dtype));
  }
  void Release(uint32_t chunk, bool modified) { Check(Live()->Release(chunk, modified)); }
  void Zero(uint32_t chunk) { Check(Live()->Zero(chunk)); }
  void Flush() { Check(Live()->Flush()); }
  void Synchronize() { Check(Live()->Synchronize()); }
  void BeginIteration() { Live()->BeginIteration(); }
  void Moment(const std::string& l) { Live()->Moment(l); }
  void Phase(const std::string& l) { Live()->Phase(l); }
  std::string Resident(uint32_t c) { return std::string(TierKindName(Live()->Resident(c))); }
  std::string Home(uint32_t c) { return std::string(TierKindName(Live()->Home(c))); }
  bool Dirty(uint32_t c) { return Live()->Dirty(c); }
  int Pins(uint32_t c) { return Live()->Pins(c); }
  bool cuda() const { return stack_->cuda(); }
  std::string nvme_engine() const { return stack_->nvme_engine(); }
  const std::string& timeline_path() const { return stack_->timeline_path(); }

  py::dict Stats() {
    const engine::EngineStats s = Live()->Stats();
    py::dict d;
    py::dict tiers;
    for (int k = 0; k < kNumTierKinds; ++k) {
      py::dict t;
      t["capacity"] = s.tiers[k].capacity;
      t["used"] = s.tiers[k].used;
      t["peak"] = s.tiers[k].peak;
      tiers[py::str(std::string(TierKindName(static_cast<TierKind>(k))))] = t;
    }
    d["tiers"] = tiers;
    py::dict moved;
    for (int a = 0; a < kNumTierKinds; ++a) {
      for (int b = 0; b < kNumTierKinds; ++b) {
        if (s.bytes_moved[a][b] == 0) continue;
        moved[py::str(PairName(static_cast<TierKind>(a), static_cast<TierKind>(b)))] =
            s.bytes_moved[a][b];
      }
    }
    d["bytes_moved"] = moved;
    d["stall_ns"] = s.stall_ns;
    d["stalls"] = s.stalls;
    d["evictions"] = s.evictions;
    d["clean_evictions"] = s.clean_evictions;
    d["prefetches"] = s.prefetches;
    d["acquires"] = s.acquires;
    d["iterations"] = s.iterations;
    return d;
  }

  // The timeline file so far, analysed by tiermem::prof (not the engine's counters).
  py::dict TimelineReport() { return ReportDict(Check(stack_->TimelineReport())); }

 private:
  engine::Engine* Live() { return Check(stack_->Live()); }

  std::unique_ptr<torch_common::RuntimeStack> stack_;
};

kernels::DType KernelDType(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return kernels::DType::kF32;
    case torch::kBFloat16: return kernels::DType::kBF16;
    case torch::kFloat16: return kernels::DType::kF16;
    default:
      throw py::value_error(std::string("unsupported dtype ") +
                            std::string(c10::toString(t.scalar_type())));
  }
}

void CheckSpan(const torch::Tensor& t, const char* what, int64_t n) {
  if (!t.is_contiguous() || t.device().type() != torch::kCPU) {
    throw py::value_error(std::string(what) + " must be a contiguous CPU tensor");
  }
  if (t.numel() != n) {
    throw py::value_error(std::string(what) + " has " + std::to_string(t.numel()) +
                          " elements, expected " + std::to_string(n));
  }
}

// One fused AdamW step (kernels::AdamStep) over host spans: grad -> m, v, fp32 master and,
// when `param_out` is given, its bf16/fp16 copy.
void AdamStepBinding(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg,
                     torch::Tensor exp_avg_sq, std::optional<torch::Tensor> param_out, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step,
                     double inv_loss_scale, double clip_factor) {
  const int64_t n = param.numel();
  for (auto [t, w] : {std::pair{&param, "param"}, {&exp_avg, "exp_avg"},
                      {&exp_avg_sq, "exp_avg_sq"}}) {
    CheckSpan(*t, w, n);
    if (t->scalar_type() != torch::kFloat32) throw py::value_error(std::string(w) + " must be fp32");
  }
  CheckSpan(grad, "grad", n);
  kernels::AdamConfig c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.eps = static_cast<float>(eps);
  c.weight_decay = static_cast<float>(weight_decay);
  c.step = step;
  c.inv_loss_scale = static_cast<float>(inv_loss_scale);
  c.clip_factor = static_cast<float>(clip_factor);
  kernels::AdamSpans s;
  s.param = param.data_ptr<float>();
  s.exp_avg = exp_avg.data_ptr<float>();
  s.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  s.grad = grad.data_ptr();
  s.grad_dtype = KernelDType(grad);
  if (param_out) {
    CheckSpan(*param_out, "param_out", n);
    s.param_out = param_out->data_ptr();
    s.out_dtype = KernelDType(*param_out);
    if (s.out_dtype == kernels::DType::kF32) throw py::value_error("param_out must be bf16/fp16");
  }
  s.n = static_cast<size_t>(n);
  Check(kernels::ValidateAdam(c, s));
  py::gil_scoped_release nogil;
  kernels::AdamStep(c, s);
}

py::tuple GradStatsBinding(torch::Tensor grad) {
  CheckSpan(grad, "grad", grad.numel());
  const kernels::DType dt = KernelDType(grad);
  kernels::GradStats st;
  {
    py::gil_scoped_release nogil;
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
  using tiermem::torch_ext::Runtime;
  namespace ch = tiermem::chunks;
  m.doc() = "tiermem chunk engine (C++)";
  m.def("parse_bytes", [](const std::string& s) {
    return tiermem::torch_ext::Check(tiermem::ParseBytes(s));
  });
  m.def(
      "choose_chunk_elems",
      [](const std::vector<uint64_t>& numels, uint64_t budget, uint64_t bytes_per_elem,
         int min_resident) {
        auto c = tiermem::torch_ext::Check(
            ch::ChooseChunkElems(numels, budget, bytes_per_elem, min_resident));
        return py::make_tuple(c.chunk_elems, c.waste_elems, c.num_groups);
      },
      py::arg("numels"), py::arg("device_budget"), py::arg("bytes_per_elem"),
      py::arg("min_resident_chunks"));
  m.def("minimum_device_budget", &ch::MinimumDeviceBudget);
  m.def("pack_tensors", [](const std::vector<uint64_t>& numels, uint64_t chunk_elems) {
    auto l = tiermem::torch_ext::Check(ch::PackTensors(numels, chunk_elems));
    py::list out;
    for (const ch::Placement& p : l.placements) out.append(py::make_tuple(p.group, p.offset));
    return py::make_tuple(out, l.num_groups(), l.waste_elems());
  });
  m.def("adam_step", &tiermem::torch_ext::AdamStepBinding, py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_out"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("inv_loss_scale") = 1.0, py::arg("clip_factor") = 1.0);
  m.def("grad_stats", &tiermem::torch_ext::GradStatsBinding);
  m.def("kernel_isa", [] { return std::string(tiermem::kernels::IsaName(tiermem::kernels::KernelIsa())); });
  m.def("read_timeline", &tiermem::torch_ext::ReadTimeline);
  m.def("timeline_report", [](const std::string& path) {
    return tiermem::torch_ext::ReportDict(
        tiermem::torch_ext::Check(tiermem::prof::AnalyzeFile(path)));
  });
  m.def("cuda_built", [] { return tiermem::torch_common::RuntimeStack::CudaBuilt(); });
  py::class_<Runtime>(m, "Runtime")
      .def(py::init<uint64_t, uint64_t, const std::string&, uint64_t, int, uint64_t, uint64_t,
                    const std::string&, const std::string&>(),
           py::arg("device_budget"), py::arg("host_budget"), py::arg("nvme_path"),
           py::arg("nvme_size"), py::arg("prefetch_depth"), py::arg("host_reserve"),
           py::arg("chunk_bytes"), py::arg("timeline_path"), py::arg("device"))
      .def("close", &Runtime::Close)
      .def("add_chunk", &Runtime::AddChunk)
      .def("acquire", &Runtime::Acquire)
      .def("release", &Runtime::Release)
      .def("acquire_for_write", &Runtime::AcquireForWrite)
      .def("zero", &Runtime::Zero)
      .def("flush", &Runtime::Flush)
      .def("synchronize", &Runtime::Synchronize)
      .def("begin_iteration", &Runtime::BeginIteration)
      .def("moment", &Runtime::Moment)
      .def("phase", &Runtime::Phase)
      .def("resident", &Runtime::Resident)
      .def("home", &Runtime::Home)
      .def("dirty", &Runtime::Dirty)
      .def("pins", &Runtime::Pins)
      .def("stats", &Runtime::Stats)
      .def("timeline_report", &Runtime::TimelineReport)
      .def_property_readonly("cuda", &Runtime::cuda)
      .def_property_readonly("nvme_engine", &Runtime::nvme_engine)
      .def_property_readonly("timeline_path", &Runtime::timeline_path);
}
