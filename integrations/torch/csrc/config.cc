// tiermem._C's configuration: the chunk kinds and tiers, every mode of a Config
// (runtime/modes.h) as a Python enum with its predicates, the Config itself (read-only; the one
// parser, session::ParseConfig), and the free functions a session is made from: byte sizes,
// optimizer param groups (runtime/param_groups.h) and the build's device facts.
#include "runtime/config.h"

#include <torch/extension.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/env.h"
#include "integrations/torch/cpp/dtypes.h"
#include "integrations/torch/csrc/bindings.h"
#include "integrations/torch/csrc/errors.h"
#include "kernels/cpu/optim.h"
#include "runtime/param_groups.h"
#include "runtime/phase.h"
#include "runtime/tier_stack.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

using session::SessionConfig;

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
  // Not a config key: the run's phase (runtime/phase.h), for Session.phase.
  BindMode<se::RunPhase>(m, "RunPhase");
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

void BindEnums(py::module_& m) {
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
}

void BindConfigClass(py::module_& m) {
  namespace se = session;
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
}

}  // namespace

void BindConfig(py::module_& m) {
  namespace se = session;
  BindEnums(m);
  BindModes(m);
  BindConfigClass(m);
  m.def("parse_config", &ParseConfigText, py::arg("json_text"), py::arg("env") = py::none());
  m.def(
      "parse_config_file",
      [](const std::string& path, const std::optional<std::map<std::string, std::string>>& env) {
        return Check(se::ParseConfigFile(path, EnvArg(env)));
      },
      py::arg("path"), py::arg("env") = py::none());

  m.def("parse_bytes", [](const std::string& s) { return Check(ParseBytes(s)); });
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
        return Check(se::AssignParamGroups(specs, members));
      },
      py::arg("tensors"), py::arg("members"));
  m.def("resolve_device_kind",
        [](se::DeviceKind kind) { return Check(se::TierStack::ResolveDeviceKind(kind)); });
  m.def("cuda_built", [] { return se::TierStack::CudaBuilt(); });
  // "13.0": the CUDA runtime this build links (the driver must support it); "" without CUDA.
  m.def("cuda_runtime_version", [] { return se::TierStack::CudaRuntimeVersion(); });
}

}  // namespace tiermem::torch_ext
