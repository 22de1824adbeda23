// tiermem._C's named records: what the Session takes and returns as read-only classes with
// named fields, so that no Python code indexes a record by position or builds one from a
// tuple. Each wraps the core's own struct (runtime/layout.h, runtime/session.h,
// kernels/cpu/optim.h): the field names are the core's.
//   TensorSpec   a tensor the session is created with (Session(config, [TensorSpec], ...))
//   Piece        where part of a tensor lives (Session.place(t) -> [Piece])
//   PieceRef     a piece of a group (ChunkGroup.pieces)
//   ChunkGroup   a chunk group's layout (Session.group(g))
//   StateFormat  a group's optimizer-state format (Session.state_format(g))
//   GroupHyper   one optimizer param group's hyper-parameters (Session.step, set_step_hyper)
//   ScalerState  fp16 dynamic loss scaling (Session.scaler)
//   GradStats    a gradient reduction: sum of squares and overflow (Session.grad_stats,
//                Session.step(global_stats=...), _C.grad_stats)
//   StepResult   what an optimizer step did (Session.step)
//   Region       a scratch or spill region (Session.allocate_spill, Scratch.region)
//   Scratch      a scratch region and its uint8 view (Session.allocate_scratch)
//   Sharding     how a session is sharded (Session(config, tensors, Sharding(...)))
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

#include "integrations/torch/csrc/bindings.h"
#include "integrations/torch/csrc/py_session.h"
#include "kernels/cpu/optim.h"
#include "runtime/layout.h"
#include "runtime/session.h"
#include "tiers/tier.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

// "Name(field=value, ...)" for a record's repr.
template <typename T>
std::string Repr(const char* type, const T& v, std::initializer_list<const char*> fields) {
  std::string out = std::string(type) + "(";
  const py::object o = py::cast(v);
  bool first = true;
  for (const char* f : fields) {
    out += (first ? "" : ", ") + std::string(f) + "=" + py::repr(o.attr(f)).cast<std::string>();
    first = false;
  }
  return out + ")";
}

void BindLayoutRecords(py::module_& m) {
  using session::TensorSpec;
  py::class_<TensorSpec>(m, "TensorSpec")
      .def(py::init([](std::string name, uint64_t numel, bool trainable, int opt_group,
                       std::vector<int64_t> shape, int expert_set, int expert,
                       std::vector<int> units, bool values_in_compute_dtype, bool read_in_place) {
             return TensorSpec{std::move(name),         numel,        trainable, opt_group,
                               std::move(shape),        expert_set,   expert,    std::move(units),
                               values_in_compute_dtype, read_in_place};
           }),
           py::arg("name"), py::arg("numel"), py::arg("trainable"), py::arg("opt_group"),
           py::arg("shape") = std::vector<int64_t>{}, py::arg("expert_set") = -1,
           py::arg("expert") = -1, py::arg("units") = std::vector<int>{},
           py::arg("values_in_compute_dtype") = false, py::arg("read_in_place") = false)
      .def_readonly("name", &TensorSpec::name)
      .def_readonly("numel", &TensorSpec::numel)
      .def_readonly("trainable", &TensorSpec::trainable)
      .def_readonly("opt_group", &TensorSpec::opt_group)
      .def_readonly("shape", &TensorSpec::shape)
      .def_readonly("expert_set", &TensorSpec::expert_set)
      .def_readonly("expert", &TensorSpec::expert)
      .def_readonly("units", &TensorSpec::units)
      .def_readonly("values_in_compute_dtype", &TensorSpec::values_in_compute_dtype)
      .def_readonly("read_in_place", &TensorSpec::read_in_place)
      .def("__repr__", [](const TensorSpec& t) {
        return Repr("TensorSpec", t,
                    {"name", "numel", "trainable", "opt_group", "shape", "expert_set", "expert",
                     "units", "values_in_compute_dtype", "read_in_place"});
      });
  using chunks::Piece;
  py::class_<Piece>(m, "Piece")
      .def_readonly("group", &Piece::group)
      .def_readonly("offset", &Piece::offset)
      .def_readonly("numel", &Piece::numel)
      .def_readonly("begin", &Piece::begin)
      .def_readonly("expert", &Piece::expert)
      .def("__repr__", [](const Piece& p) {
        return Repr("Piece", p, {"group", "offset", "numel", "begin", "expert"});
      });
  using session::PieceRef;
  py::class_<PieceRef>(m, "PieceRef")
      .def_readonly("tensor", &PieceRef::tensor)
      .def_readonly("piece", &PieceRef::piece)
      .def("__repr__", [](const PieceRef& p) {
        return Repr("PieceRef", p, {"tensor", "piece"});
      });
  using session::ChunkGroup;
  py::class_<ChunkGroup>(m, "ChunkGroup")
      .def_readonly("trainable", &ChunkGroup::trainable)
      .def_readonly("compute_only", &ChunkGroup::compute_only)
      .def_readonly("used_elems", &ChunkGroup::used_elems)
      .def_readonly("tensors", &ChunkGroup::tensors)
      .def_readonly("pieces", &ChunkGroup::pieces)
      .def("__repr__", [](const ChunkGroup& g) {
        return Repr("ChunkGroup", g,
                    {"trainable", "compute_only", "used_elems", "tensors", "pieces"});
      });
  using UnitNeed = session::Layout::UnitNeed;
  py::class_<UnitNeed>(m, "UnitNeed")
      .def_readonly("bytes", &UnitNeed::bytes)
      .def_readonly("unit", &UnitNeed::unit)
      .def("__repr__", [](const UnitNeed& n) {
        return Repr("UnitNeed", n, {"bytes", "unit"});
      });
}

void BindOptimizerRecords(py::module_& m) {
  using kernels::StateFormat;
  py::class_<StateFormat>(m, "StateFormat")
      .def_property_readonly(
          "dtype",
          [](const StateFormat& f) { return std::string(kernels::StateDTypeName(f.dtype)); })
      .def_readonly("block", &StateFormat::block)
      .def_readonly("stochastic", &StateFormat::stochastic)
      .def("__repr__", [](const StateFormat& f) {
        return Repr("StateFormat", f, {"dtype", "block", "stochastic"});
      });
  using session::GroupHyper;
  py::class_<GroupHyper>(m, "GroupHyper")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay) {
             return GroupHyper{lr, beta1, beta2, eps, weight_decay};
           }),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"))
      .def_readonly("lr", &GroupHyper::lr)
      .def_readonly("beta1", &GroupHyper::beta1)
      .def_readonly("beta2", &GroupHyper::beta2)
      .def_readonly("eps", &GroupHyper::eps)
      .def_readonly("weight_decay", &GroupHyper::weight_decay)
      .def("__repr__", [](const GroupHyper& h) {
        return Repr("GroupHyper", h, {"lr", "beta1", "beta2", "eps", "weight_decay"});
      });
  using session::ScalerState;
  py::class_<ScalerState>(m, "ScalerState")
      .def(py::init([](double scale, int good_steps, uint64_t skipped_steps) {
             return ScalerState{scale, good_steps, skipped_steps};
           }),
           py::arg("scale"), py::arg("good_steps"), py::arg("skipped_steps"))
      .def_readonly("scale", &ScalerState::scale)
      .def_readonly("good_steps", &ScalerState::good_steps)
      .def_readonly("skipped_steps", &ScalerState::skipped_steps)
      .def("__repr__", [](const ScalerState& s) {
        return Repr("ScalerState", s, {"scale", "good_steps", "skipped_steps"});
      });
  using kernels::GradStats;
  py::class_<GradStats>(m, "GradStats")
      .def(py::init([](double sq_norm, bool overflow) {
             return GradStats{sq_norm, overflow};
           }),
           py::arg("sq_norm"), py::arg("overflow"))
      .def_readonly("sq_norm", &GradStats::sq_norm)
      .def_readonly("overflow", &GradStats::overflow)
      .def("__repr__", [](const GradStats& g) {
        return Repr("GradStats", g, {"sq_norm", "overflow"});
      });
  using session::StepResult;
  py::class_<StepResult>(m, "StepResult")
      .def_readonly("applied", &StepResult::applied)
      .def_readonly("skipped", &StepResult::skipped)
      .def_readonly("grad_norm", &StepResult::grad_norm)
      .def_readonly("clip_coef", &StepResult::clip_coef)
      .def("__repr__", [](const StepResult& r) {
        return Repr("StepResult", r, {"applied", "skipped", "grad_norm", "clip_coef"});
      });
}

// Regions the binding hands out (scratch for sharded gathers and the activations' bounces,
// NVMe spill for activations) and how a session is sharded.
void BindSessionRecords(py::module_& m) {
  py::class_<Region>(m, "Region")
      .def_readonly("id", &Region::id)
      .def_readonly("bytes", &Region::bytes)
      // The base address where the tier is byte-addressable (scratch), else 0 (spill).
      .def_property_readonly("addr",
                             [](const Region& r) { return reinterpret_cast<uintptr_t>(r.addr); })
      .def("__repr__", [](const Region& r) {
        return Repr("Region", r, {"id", "bytes", "addr"});
      });
  py::class_<Scratch>(m, "Scratch")
      .def_readonly("region", &Scratch::region)
      .def_readonly("view", &Scratch::view)  // uint8, valid until the region is freed
      .def("__repr__", [](const Scratch& s) { return Repr("Scratch", s, {"region"}); });
  py::class_<Sharding>(m, "Sharding")
      .def(py::init([](int world, int rank, py::object collectives) {
             return Sharding{world, rank, std::move(collectives)};
           }),
           py::arg("world"), py::arg("rank"), py::arg("collectives"))
      .def_readonly("world", &Sharding::world)
      .def_readonly("rank", &Sharding::rank)
      .def_readonly("collectives", &Sharding::collectives)
      .def("__repr__", [](const Sharding& s) {
        return Repr("Sharding", s, {"world", "rank"});
      });
}

}  // namespace

void BindRecords(py::module_& m) {
  BindLayoutRecords(m);
  BindOptimizerRecords(m);
  BindSessionRecords(m);
}

}  // namespace tiermem::torch_ext
