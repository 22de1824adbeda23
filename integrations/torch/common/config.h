// The LibTorch API's configuration: the same JSON keys as the Python package's
// `tiermem.initialize(model, config)` (integrations/torch/python/tiermem/config.py), parsed
// and checked in C++. Every key is checked; an unknown key or a bad value is kInvalidArgument
// naming the key and the value (for unknown keys, also the valid ones). Sizes are strings
// like "2GiB" (runtime/base ParseBytes) or positive byte counts.
//
// Thread-safety: values and pure functions.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/base/status.h"
#include "runtime/base/units.h"

namespace tiermem::torch_common {

struct TorchConfig {
  Bytes device_budget = 2 * kGiB;
  Bytes host_budget = 8 * kGiB;
  std::string nvme_path;  // "" = no NVMe tier unless nvme_size > 0 (then a temp dir default)
  Bytes nvme_size = 0;
  std::string precision = "fp32";
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;       // 0 = off
  std::optional<uint64_t> chunk_size;   // elements per chunk; nullopt = automatic
  std::string timeline;                 // "" = a temporary file, removed at the end
  int prefetch_depth = 4;
  // fp16 dynamic loss scaling (parsed for parity with Python; used only with fp16).
  double initial_scale = 65536.0;
  int growth_interval = 2000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::string device_kind = "auto";  // "auto", "cuda" or "sim"; TIERMEM_DEVICE overrides
};

// Parses `config` (a JSON object; null = all defaults). `env_device` is the value of
// TIERMEM_DEVICE ("" when unset), which overrides "device_kind" like in Python.
StatusOr<TorchConfig> ParseTorchConfig(const nlohmann::json& config,
                                       const std::string& env_device = "");

}  // namespace tiermem::torch_common
