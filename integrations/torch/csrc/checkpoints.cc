#include "integrations/torch/csrc/checkpoints.h"

#include <map>

#include "integrations/torch/csrc/bindings.h"
#include "integrations/torch/csrc/errors.h"
#include "runtime/session.h"

namespace py = pybind11;

namespace tiermem::torch_ext {

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

void BindCheckpoints(py::module_& m) {
  m.def("checkpoint_metadata", [](const std::string& path) {
    return MetaDict(Check(session::Session::CheckpointMetadata(path)));
  });
}

}  // namespace tiermem::torch_ext
