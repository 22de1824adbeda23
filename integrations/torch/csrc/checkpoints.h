// Checkpoint metadata (runtime/checkpoint_meta.h) across the Python boundary
// (csrc/checkpoints.cc), for Session.save_checkpoint / load_checkpoint (session.cc) and
// checkpoint_metadata.
#pragma once

#include <torch/extension.h>

#include <string>

#include "runtime/checkpoint_meta.h"

namespace tiermem::torch_ext {

// In the file's own encoding: param_groups and extra as JSON text (json.loads / json.dumps on
// the Python side), the RNG state as bytes.
pybind11::dict MetaDict(const session::CheckpointMeta& meta);
session::CheckpointMeta MetaFrom(const std::string& param_groups, const std::string& rng_state,
                                 const std::string& extra);

}  // namespace tiermem::torch_ext
