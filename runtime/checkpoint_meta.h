// CheckpointMeta: what a checkpoint holds besides the tensors and the session's own counters —
// the optimizer param groups, the binding's RNG state and the user's `extra` — in the one
// format both bindings write and read (checkpoint.cc stores it; docs/checkpoints.md).
//
// In the file (safetensors `__metadata__`, version 3; every value a string):
//   param_groups  a JSON array, one object per optimizer param group in the binding's order:
//                 "lr", "betas" ([beta1, beta2]), "eps", "weight_decay" (numbers, as the LR
//                 schedule left them), and any other keys the binding keeps (torch's
//                 param-group keys such as "amsgrad" or a scheduler's "initial_lr"), which the
//                 core stores as given and never reads
//   rng_state     base64 of torch's default CPU generator state (the bytes of
//                 torch.get_rng_state() in Python, of getDefaultCPUGenerator().get_state() in
//                 LibTorch: the same), "" when none was saved
//   extra         the user's JSON value, "null" when none
//
// Earlier files (format 1, and safetensors files of version 2) kept this in one string of the
// binding's own JSON, in one of two shapes, both read here:
//   Python    {"tiermem.python": {"param_groups": [...], "torch_rng": base64, "extra": ...}}
//   LibTorch  {"param_groups": [{"lr", "betas", "eps", "weight_decay"}, ...]}  (no RNG, extra)
// Anything else is kInvalidArgument naming what is missing.
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstddef>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "runtime/config.h"

namespace tiermem::session {

// One optimizer param group as saved: its AdamW hyper-parameters, and the binding's other keys
// (an object; kept opaque).
struct CheckpointGroup {
  OptimizerConfig hyper;
  nlohmann::json other = nlohmann::json::object();
};

struct CheckpointMeta {
  std::vector<CheckpointGroup> groups;
  std::string rng_state;  // bytes, opaque; empty = none saved
  nlohmann::json extra;   // null = none
};

// What a load checks against the binding before anything changes (and whether it applies).
struct CheckpointLoad {
  // The binding's optimizer param groups: a file with another count is kInvalidArgument.
  // nullopt: not checked (Python's load_checkpoint without an optimizer).
  std::optional<size_t> num_groups;
  // The byte size of the binding's RNG state: a saved state of another size is
  // kInvalidArgument (none saved is fine). nullopt: not checked.
  std::optional<size_t> rng_state_bytes;
  bool verify_only = false;  // every check of a load, nothing applied
};

// The version-3 metadata entries of `meta` (param_groups, rng_state, extra). A group's other
// keys that repeat a hyper-parameter's name are overwritten by the hyper-parameter.
std::map<std::string, std::string> EncodeCheckpointMeta(const CheckpointMeta& meta);
// From the entries of a version-3 file. kInvalidArgument naming the missing or bad entry.
StatusOr<CheckpointMeta> DecodeCheckpointMeta(const std::map<std::string, std::string>& entries);
// From the binding string of an earlier file (the two shapes above). kInvalidArgument naming
// what is missing when it is neither.
StatusOr<CheckpointMeta> ParseLegacyCheckpointMeta(std::string_view binding);
// A JSON array of param-group objects (the `param_groups` entry, either shape) as groups:
// "lr", "betas", "eps", "weight_decay" required, the rest kept in `other`. kInvalidArgument
// naming the group and key.
StatusOr<std::vector<CheckpointGroup>> ParseCheckpointGroups(const nlohmann::json& groups);
// `meta` against what the binding has (CheckpointLoad); the message says nothing was loaded.
Status CheckCheckpointMeta(const CheckpointMeta& meta, const CheckpointLoad& how);

// RFC 4648 base64 (with padding), for the RNG state. Decode: kInvalidArgument for a character
// outside the alphabet or a bad length.
std::string Base64Encode(std::string_view bytes);
StatusOr<std::string> Base64Decode(std::string_view text);

}  // namespace tiermem::session
