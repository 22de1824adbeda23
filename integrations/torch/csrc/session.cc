// tiermem._C.Session (py_session.h) and the handles Python holds: each Bind function below
// binds one concern of the Session's methods, in the order of a training run's life.
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "integrations/torch/cpp/dtypes.h"
#include "integrations/torch/cpp/torch_pool.h"
#include "integrations/torch/csrc/bindings.h"
#include "integrations/torch/csrc/checkpoints.h"
#include "integrations/torch/csrc/errors.h"
#include "integrations/torch/csrc/py_session.h"
#include "integrations/torch/csrc/reports.h"
#include "kernels/cpu/optim.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

namespace se = session;
using K = chunks::ChunkKind;

// Creation, sharding, scratch and spill regions, close.
void BindLifetime(py::class_<PySession>& c) {
  c.def(py::init<const se::SessionConfig&, std::vector<se::TensorSpec>, const Sharding*>(),
        py::arg("config"), py::arg("tensors"), py::arg("sharding") = py::none())
      // The unit protocol over this session (runtime/unit_protocol.h): the hooks' calls.
      .def_property_readonly(
          "units", [](PySession& s) -> se::UnitProtocol& { return s.protocol(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly("world", [](const PySession& s) { return s.s().layout().world; })
      .def_property_readonly("rank", [](const PySession& s) { return s.s().layout().rank; })
      .def_property_readonly("sharded", [](const PySession& s) { return s.s().layout().sharded(); })
      .def_property_readonly("shard_elems",
                             [](const PySession& s) { return s.s().layout().shard_elems; })
      .def_property_readonly("shard_begin",
                             [](const PySession& s) { return s.s().layout().shard_begin; })
      .def("allocate_scratch", &PySession::AllocateScratch)
      .def("free_scratch", &PySession::FreeScratch)
      .def("allocate_spill", &PySession::AllocateSpill)
      .def("free_spill", &PySession::FreeSpill)
      .def("start_spill_copy", &PySession::StartSpillCopy)
      .def("close", &PySession::Close)
      .def_property_readonly("closed", [](const PySession& s) { return s.s().closed(); });
}

// Chunks: acquire, release, where they are, their formats.
void BindChunks(py::class_<PySession>& c) {
  c.def("acquire", &PySession::Acquire, py::arg("group"), py::arg("kind"), py::arg("where"),
        py::arg("cls") = -1)
      .def("acquire_for_write", &PySession::AcquireForWrite, py::arg("group"), py::arg("kind"),
           py::arg("where"), py::arg("cls") = -1)
      .def(
          "prefetch",
          [](PySession& s, size_t g, K k, tiermem::TierKind where, double p) {
            return Check(s.s().chunks().Prefetch(g, k, where, p));
          },
          py::arg("group"), py::arg("kind"), py::arg("where"), py::arg("probability") = 1.0)
      .def("release", [](PySession& s, size_t g, K k,
                         bool modified) { Check(s.s().chunks().Release(g, k, modified)); })
      .def("zero_chunk", [](PySession& s, size_t g, K k) { Check(s.s().chunks().ZeroChunk(g, k)); })
      .def("pins", [](const PySession& s, size_t g, K k) { return s.s().chunks().Pins(g, k); })
      .def("lazily_zero",
           [](const PySession& s, size_t g, K k) { return s.s().chunks().LazilyZero(g, k); })
      .def("resident",
           [](const PySession& s, size_t g, K k) { return s.s().chunks().Resident(g, k); })
      .def("home", [](const PySession& s, size_t g, K k) { return s.s().chunks().Home(g, k); })
      .def("has_kind",
           [](const PySession& s, size_t g, K k) { return s.s().layout().has_kind(g, k); })
      .def("chunk_bytes",
           [](const PySession& s, size_t g, K k) { return s.s().chunks().ChunkBytes(g, k); })
      // The optimizer-state format of a group's m and v (StateFormat: records.cc).
      .def("state_format",
           [](const PySession& s, size_t g) {
             if (g >= s.s().layout().num_groups()) throw py::index_error("no such chunk group");
             return s.s().values().state_format(g);
           })
      // Bytes per element of a kind's chunks (the core's dtype for the kind: the compute dtype
      // for compute params and grads, fp32 otherwise), so the binding never re-derives it.
      .def("element_size", [](const PySession& s, K k) {
        return tiermem::kernels::DTypeSize(s.s().layout().dtype(k));
      });
}

// Tensor values in and out, step counts, which tensors have gradients.
void BindValues(py::class_<PySession>& c) {
  c.def("read_param", &PySession::ReadParam)
      .def("write_param", &PySession::WriteParam)
      .def("read_tensor", &PySession::ReadTensor)
      .def("write_tensor", &PySession::WriteTensor)
      .def("step_count", [](const PySession& s, size_t t) { return s.s().values().step_count(t); })
      .def("set_step_count",
           [](PySession& s, size_t t, int64_t n) { Check(s.s().values().SetStepCount(t, n)); })
      .def("set_has_grad", &PySession::SetHasGrad)
      .def("has_grad", [](const PySession& s, size_t t) { return s.s().optimizer().has_grad(t); });
}

// The optimizer: gradient stats, steps (deferred and speculative), the loss scaler.
void BindSteps(py::class_<PySession>& c) {
  c.def("grad_stats", &PySession::GradStats)
      .def("zero_grad", [](PySession& s) { return Check(s.s().optimizer().ZeroGrad()); })
      .def_property_readonly("accumulating",
                             [](const PySession& s) { return s.s().optimizer().accumulating(); })
      .def_property_readonly(
          "next_step_applies",
          [](const PySession& s) { return s.s().optimizer().next_step_applies(); })
      .def("step", &PySession::Step, py::arg("hyper"), py::arg("global_stats") = py::none())
      .def_property_readonly("loss_scale",
                             [](const PySession& s) { return s.s().optimizer().loss_scale(); })
      .def_property(
          "scaler", [](const PySession& s) { return s.s().optimizer().scaler(); },
          [](PySession& s, const se::ScalerState& v) { s.s().optimizer().set_scaler(v); })
      .def_property_readonly("pending_steps",
                             [](PySession& s) { return s.s().optimizer().pending_steps(); })
      .def("set_step_hyper", &PySession::SetStepHyper, py::arg("hyper"))
      .def_property_readonly("speculation", [](PySession& s) { return SpeculationDict(s.s()); });
}

// Iterations: moments, traces, phases, budgets outside the chunks, plans.
void BindIterations(py::class_<PySession>& c) {
  c.def(
       "record_trace",
       [](PySession& s, const std::string& path, int iterations) {
         Check(s.s().traces().RecordTrace(path, iterations));
       },
       py::arg("path"), py::arg("iterations") = 1)
      .def("finish_trace", [](PySession& s) { return Check(s.s().traces().FinishTrace()); })
      .def_property_readonly("recording_trace",
                             [](const PySession& s) { return s.s().traces().recording_trace(); })
      .def_property_readonly("trace_armed",
                             [](const PySession& s) { return s.s().traces().trace_armed(); })
      .def_property_readonly("written_trace",
                             [](const PySession& s) { return s.s().traces().written_trace(); })
      .def("add_saved_bytes", [](PySession& s, uint64_t b) { s.s().traces().AddSavedBytes(b); })
      .def("phase", [](PySession& s, se::RunPhase p) { s.s().iterations().Phase(p); })
      .def("record_collective",
           [](PySession& s, const std::string& op, uint64_t bytes, uint64_t ns) {
             s.s().iterations().RecordCollective(op, bytes, ns);
           })
      .def("set_tracing", [](PySession& s, bool on) { s.s().iterations().SetTracing(on); })
      .def("set_cyclic", [](PySession& s, bool on) { s.s().iterations().SetCyclic(on); })
      // The compute stream as an integer handle (torch.cuda.current_stream().cuda_stream on
      // CUDA; 0 = work on the calling thread, CPU tensors).
      .def("set_compute_stream",
           [](PySession& s, uintptr_t handle) { s.s().iterations().SetComputeStream({handle}); })
      .def("set_external_device_bytes",
           [](PySession& s, uint64_t b) { Check(s.s().memory().SetExternalDeviceBytes(b)); })
      .def("set_external_compute_bytes",
           [](PySession& s, uint64_t b) { Check(s.s().memory().SetExternalComputeBytes(b)); })
      .def("set_external_host_bytes",
           [](PySession& s, uint64_t b) { Check(s.s().memory().SetExternalHostBytes(b)); })
      .def("plan_offloads_unit",
           [](const PySession& s, uint32_t u) { return s.s().plans().PlanOffloadsUnit(u); })
      .def("plan_recomputes_unit",
           [](const PySession& s, uint32_t u) { return s.s().plans().PlanRecomputesUnit(u); })
      .def_property_readonly("plan_followed",
                             [](const PySession& s) { return s.s().plans().PlanFollowed(); })
      .def("take_activation_fetches",
           [](PySession& s) { return s.s().plans().TakeActivationFetches(); })
      .def("synchronize", [](PySession& s) { Check(s.s().Synchronize()); })
      .def("flush", [](PySession& s) { Check(s.s().Flush()); });
}

// Reports and checkpoints.
void BindReportsAndCheckpoints(py::class_<PySession>& c) {
  c.def("stats", [](PySession& s) { return StatsDict(s.s()); })
      .def("timeline_report",
           [](PySession& s) { return ReportDict(Check(s.s().traces().TimelineReport())); })
      // param_groups and extra: JSON text; rng_state: bytes (runtime/checkpoint_meta.h).
      .def(
          "save_checkpoint",
          [](PySession& s, const std::string& path, const std::string& param_groups,
             const py::bytes& rng_state, const std::string& extra) {
            Check(s.s().SaveCheckpoint(path, MetaFrom(param_groups, rng_state, extra)));
          },
          py::arg("path"), py::arg("param_groups") = "[]", py::arg("rng_state") = py::bytes(),
          py::arg("extra") = "null")
      // -> {"param_groups": JSON text, "rng_state": bytes, "extra": JSON text}
      .def(
          "load_checkpoint",
          [](PySession& s, const std::string& path, bool verify_only,
             std::optional<size_t> num_groups, std::optional<size_t> rng_state_bytes) {
            session::CheckpointMeta meta;
            session::CheckpointLoad how;
            how.verify_only = verify_only;
            how.num_groups = num_groups;
            how.rng_state_bytes = rng_state_bytes;
            Check(s.s().LoadCheckpoint(path, &meta, how));
            return MetaDict(meta);
          },
          py::arg("path"), py::arg("verify_only") = false, py::arg("num_groups") = py::none(),
          py::arg("rng_state_bytes") = py::none());
}

// The layout: groups, pieces, sizes and what the Python parts ask of them.
void BindLayout(py::class_<PySession>& c) {
  c.def("group", &PySession::Group, py::return_value_policy::copy)
      .def("place", &PySession::Place, py::return_value_policy::copy)
      .def_property_readonly("num_groups",
                             [](const PySession& s) { return s.s().layout().num_groups(); })
      .def_property_readonly("num_tensors",
                             [](const PySession& s) { return s.s().layout().num_tensors(); })
      .def_property_readonly("chunk_elems",
                             [](const PySession& s) { return s.s().layout().chunk_elems; })
      .def_property_readonly("model_bytes",
                             [](const PySession& s) { return s.s().layout().model_bytes; })
      .def_property_readonly("total_chunk_bytes",
                             [](const PySession& s) { return s.s().placement().total_chunk_bytes; })
      .def_property_readonly("minimum_device_budget",
                             [](const PySession& s) { return s.s().layout().min_device_budget; })
      .def_property_readonly("compute_kind",
                             [](const PySession& s) { return s.s().layout().compute_kind(); })
      .def_property_readonly("mixed", [](const PySession& s) { return s.s().layout().mixed(); })
      .def_property_readonly("cuda", [](const PySession& s) { return s.s().placement().cuda(); })
      .def_property_readonly("device_kind",
                             [](const PySession& s) { return s.s().config().device_kind; })
      // What the Python parts ask of the layout (session.h, "what the bindings ask"): the
      // compute copy's torch dtype (dtypes.h's map) and element size, the compute budget,
      // and the caps derived from them.
      .def_property_readonly(
          "compute_dtype",
          [](const PySession& s) {
            return tiermem::torch_dtypes::TorchDType(s.s().layout().compute_dtype());
          })
      .def_property_readonly(
          "compute_element_size",
          [](const PySession& s) { return s.s().layout().compute_element_size(); })
      .def_property_readonly("compute_budget",
                             [](const PySession& s) { return s.s().placement().compute_budget; })
      .def_property_readonly(
          "compute_tier_holds_every_chunk",
          [](const PySession& s) { return s.s().placement().compute_tier_holds_every_chunk(); })
      .def_property_readonly(
          "holds_grad_chunks",
          [](const PySession& s) { return s.s().placement().holds_grad_chunks(); })
      .def(
          "activation_cap",
          [](const PySession& s, size_t unit_groups) {
            return s.s().placement().ActivationCap(unit_groups);
          },
          py::arg("unit_groups"))
      .def(
          "recent_full_chunks",
          [](const PySession& s, size_t unit_groups) {
            return s.s().placement().RecentFullChunks(unit_groups);
          },
          py::arg("unit_groups"))
      .def_property_readonly("serving_minimum",
                             [](const PySession& s) { return s.s().layout().ServingMinimum(); })
      .def_property_readonly("host_compute",
                             [](const PySession& s) { return s.s().placement().host_compute(); })
      .def_property_readonly("compute_tier",
                             [](const PySession& s) { return s.s().placement().compute_tier(); })
      .def_property_readonly("io_backend", [](const PySession& s) { return s.s().io_backend(); })
      .def_property_readonly("nvme_registered_bytes",
                             [](const PySession& s) { return s.s().nvme_registered_bytes(); })
      .def_property_readonly("timeline_path",
                             [](const PySession& s) { return s.s().timeline_path(); });
}

}  // namespace

void BindHandles(py::module_& m) {
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
  // A tensor's version counter, held without the tensor (nor its storage): the saved-tensor
  // hooks check with it that an offloaded activation was not modified in place meanwhile.
  py::class_<c10::VariableVersion>(m, "VersionCounter")
      .def_property_readonly("version", &c10::VariableVersion::current_version);
  m.def("version_counter", [](const at::Tensor& t) {
    return c10::VariableVersion(t.unsafeGetTensorImpl()->version_counter());
  });
}

void BindSession(py::module_& m) {
  py::class_<PySession> c(m, "Session");
  BindLifetime(c);
  BindChunks(c);
  BindValues(c);
  BindSteps(c);
  BindIterations(c);
  BindReportsAndCheckpoints(c);
  BindLayout(c);
}

}  // namespace tiermem::torch_ext
