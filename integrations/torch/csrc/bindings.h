// tiermem._C's parts, one file per bound concern, each registered by module.cc's
// PYBIND11_MODULE in this order (a Python type must be registered before a signature that
// names it): the enums, modes and Config (config.cc); the named records (records.cc); the handles
// Python holds (session.cc); the unit protocol (protocol.cc); the Session (session.cc, over
// py_session.h); its reports (reports.cc); checkpoints (checkpoints.cc); the kernels' doors
// (kernels.cc); weights (weights.cc). Status codes become exceptions in one place (errors.h).
#pragma once

#include <torch/extension.h>

namespace tiermem::torch_ext {

// config.cc: ChunkKind, Tier, every mode (runtime/modes.h) with its predicates, Config and its
// parsers, parse_bytes, assign_param_groups, and the build's device facts.
void BindConfig(pybind11::module_& m);
// records.cc: the named records the Session takes and returns (TensorSpec, Piece, PieceRef,
// ChunkGroup, StateFormat, GroupHyper, ScalerState).
void BindRecords(pybind11::module_& m);
// session.cc: Pending (an asynchronous copy) and VersionCounter (a tensor's version counter).
void BindHandles(pybind11::module_& m);
// session.cc: the Session class (py_session.h).
void BindSession(pybind11::module_& m);
// reports.cc: read_timeline and timeline_report (the session's own: Session.timeline_report).
void BindReports(pybind11::module_& m);
// checkpoints.cc: checkpoint_metadata (Session.save/load_checkpoint: BindSession).
void BindCheckpoints(pybind11::module_& m);
// kernels.cc: adam_step, grad_stats, the state codecs, the CPU kernels' pool and ISA.
void BindKernels(pybind11::module_& m);

}  // namespace tiermem::torch_ext
