// tiermem._C: the Python binding of the chunk engine (pybind11 through torch's headers).
//
// A Runtime owns the tiers (SimDevice as the device tier on CPU-only machines; stand-ins for
// the host and NVMe tiers until tiers/host and tiers/nvme land), the mover (a DirectMover
// stand-in until runtime/mover.cc lands), an in-memory timeline recorder and the Engine.
// Chunk memory reaches Python as 1-D tensors made with torch::from_blob over the region's
// address: they do not own the memory and are valid only while the chunk stays acquired
// (the Python layer drops every view on release). Status codes become Python exceptions
// here, in one place: kInvalidArgument/kOutOfRange -> ValueError, kResourceExhausted ->
// MemoryError, kNotFound/kIOError/kDataLoss -> OSError, anything else -> RuntimeError.
//
// Threading: a Runtime is externally synchronized (the training thread); the GIL is held.
#include <torch/extension.h>

#include <memory>
#include <string>

#include "chunks/chunk_layout.h"
#include "runtime/engine/direct_mover.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/memory_recorder.h"
#include "runtime/engine/stand_in_tiers.h"
#include "tiers/fake/sim_device.h"

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

class Runtime {
 public:
  Runtime(uint64_t device_budget, uint64_t host_budget, uint64_t nvme_size, int prefetch_depth,
          uint64_t host_reserve) {
    SimDeviceConfig dc;
    dc.capacity = device_budget;
    device_ = NewSimDevice(dc);
    host_ = engine::NewStandInTier(TierKind::kHost, host_budget);
    if (nvme_size > 0) nvme_ = engine::NewStandInTier(TierKind::kNvme, nvme_size);
    mover_ = engine::NewDirectMover(&recorder_);
    engine::EngineConfig cfg;
    cfg.prefetch_depth = prefetch_depth;
    cfg.host_reserve_bytes = host_reserve;
    engine_ = Check(engine::Engine::Create(
        cfg, engine::EngineTiers{device_.get(), host_.get(), nvme_.get()}, mover_.get(),
        &recorder_));
  }
  ~Runtime() { engine_.reset(); }

  uint32_t AddChunk(uint64_t bytes, int category) {
    return Check(engine_->AddChunk(bytes, static_cast<Category>(category)));
  }
  torch::Tensor Acquire(uint32_t chunk, const std::string& tier, torch::Dtype dtype,
                        int64_t numel) {
    const TierKind t = Check(TierArg(tier));
    void* addr = Check(engine_->Acquire(chunk, t));
    const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
    if (numel * elem > static_cast<int64_t>(engine_->ChunkBytes(chunk))) {
      Check(engine_->Release(chunk, false));
      throw py::value_error("view of " + std::to_string(numel) + " elements exceeds chunk " +
                            std::to_string(chunk));
    }
    return torch::from_blob(addr, {numel}, torch::TensorOptions().dtype(dtype));
  }
  void Release(uint32_t chunk, bool modified) { Check(engine_->Release(chunk, modified)); }
  void Zero(uint32_t chunk) { Check(engine_->Zero(chunk)); }
  void Flush() { Check(engine_->Flush()); }
  void Synchronize() { Check(engine_->Synchronize()); }
  void BeginIteration() { engine_->BeginIteration(); }
  void Moment(const std::string& l) { engine_->Moment(l); }
  void Phase(const std::string& l) { engine_->Phase(l); }
  std::string Resident(uint32_t c) const { return std::string(TierKindName(engine_->Resident(c))); }
  std::string Home(uint32_t c) const { return std::string(TierKindName(engine_->Home(c))); }
  bool Dirty(uint32_t c) const { return engine_->Dirty(c); }
  int Pins(uint32_t c) const { return engine_->Pins(c); }

  py::dict Stats() const {
    const engine::EngineStats s = engine_->Stats();
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
        moved[py::str(std::string(TierKindName(static_cast<TierKind>(a))) + "->" +
                      std::string(TierKindName(static_cast<TierKind>(b))))] = s.bytes_moved[a][b];
      }
    }
    d["bytes_moved"] = moved;
    d["stall_ns"] = s.stall_ns;
    d["stalls"] = s.stalls;
    d["evictions"] = s.evictions;
    d["clean_evictions"] = s.clean_evictions;
    d["prefetches"] = s.prefetches;
    d["acquires"] = s.acquires;
    return d;
  }

  // Peaks and copies replayed from the timeline's events (not from the engine's counters).
  py::dict TimelinePeaks() const {
    const engine::TimelinePeaks p = engine::ReplayPeaks(recorder_.events());
    py::dict d, peak, budget, copied;
    for (int k = 0; k < kNumTierKinds; ++k) {
      const std::string n(TierKindName(static_cast<TierKind>(k)));
      peak[py::str(n)] = p.peak[k];
      budget[py::str(n)] = p.budget[k];
      for (int j = 0; j < kNumTierKinds; ++j) {
        if (p.copied[k][j] == 0) continue;
        copied[py::str(n + "->" + std::string(TierKindName(static_cast<TierKind>(j))))] =
            p.copied[k][j];
      }
    }
    d["peak"] = peak;
    d["budget"] = budget;
    d["copied"] = copied;
    d["over_budget"] = p.over_budget;
    d["stall_ns"] = p.stall_ns;
    d["events"] = recorder_.events().size();
    return d;
  }

  // (ts_ns, type, tier, tier2, bytes, chunk, category, flags, label)
  py::list Events() const {
    py::list out;
    for (const Event& e : recorder_.events()) {
      out.append(py::make_tuple(e.ts_ns, static_cast<int>(e.type), static_cast<int>(e.tier),
                                static_cast<int>(e.tier2), e.bytes, e.chunk,
                                static_cast<int>(e.category), static_cast<int>(e.flags),
                                recorder_.label(e.label)));
    }
    return out;
  }

 private:
  engine::MemoryRecorder recorder_;
  std::unique_ptr<Tier> device_, host_, nvme_;
  std::unique_ptr<Mover> mover_;
  std::unique_ptr<engine::Engine> engine_;
};

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
  py::class_<Runtime>(m, "Runtime")
      .def(py::init<uint64_t, uint64_t, uint64_t, int, uint64_t>(), py::arg("device_budget"),
           py::arg("host_budget"), py::arg("nvme_size"), py::arg("prefetch_depth"),
           py::arg("host_reserve"))
      .def("add_chunk", &Runtime::AddChunk)
      .def("acquire", &Runtime::Acquire)
      .def("release", &Runtime::Release)
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
      .def("timeline_peaks", &Runtime::TimelinePeaks)
      .def("events", &Runtime::Events);
}
