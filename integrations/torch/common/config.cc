// ParseTorchConfig: the checks of config.py, in C++ (see config.h). Each helper returns
// kInvalidArgument naming the key ("optimizer.lr") and the offending value as JSON text.
#include "integrations/torch/common/config.h"

#include <set>

namespace tiermem::torch_common {
namespace {

using nlohmann::json;

std::string Keys(const std::set<std::string>& keys) {
  std::string out = "[";
  for (const std::string& k : keys) out += (out.size() > 1 ? ", '" : "'") + k + "'";
  return out + "]";
}

Status CheckKeys(const json& obj, const std::set<std::string>& valid, const std::string& where) {
  std::string bad;
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (!valid.count(it.key())) bad += (bad.empty() ? "'" : ", '") + it.key() + "'";
  }
  if (bad.empty()) return OkStatus();
  return InvalidArgumentError(where + ": unknown key(s) [" + bad + "]; valid keys: " +
                              Keys(valid));
}

StatusOr<Bytes> Size(const std::string& key, const json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) {
    if (v.is_number_integer() && v.get<int64_t>() <= 0) {
      return InvalidArgumentError("config '" + key + "': size must be > 0, got " + v.dump());
    }
    return v.get<Bytes>();
  }
  if (v.is_string()) {
    StatusOr<Bytes> n = ParseBytes(v.get<std::string>());
    if (!n.ok()) {
      return InvalidArgumentError("config '" + key + "': " + v.dump() + " is not a size (" +
                                  n.status().message() + ")");
    }
    if (*n == 0) {
      return InvalidArgumentError("config '" + key + "': size must be > 0, got " + v.dump());
    }
    return *n;
  }
  return InvalidArgumentError("config '" + key +
                              "': expected a size like '2GiB' or a byte count, got " + v.dump());
}

// A number in [lo, hi] (hi < lo: no upper bound); `lo_open`: lo itself is refused.
StatusOr<double> Number(const std::string& key, const json& v, double lo, double hi = -1,
                        bool lo_open = false, bool hi_open = false) {
  if (!v.is_number()) {
    return InvalidArgumentError("config '" + key + "': expected a number, got " + v.dump());
  }
  const double d = v.get<double>();
  if (d < lo || (lo_open && d == lo) || (hi >= lo && (d > hi || (hi_open && d == hi)))) {
    return InvalidArgumentError("config '" + key + "': " + v.dump() + " out of range");
  }
  return d;
}

StatusOr<int> Int(const std::string& key, const json& v, int lo) {
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > (1 << 30)) {
    return InvalidArgumentError("config '" + key + "': expected an integer >= " +
                                std::to_string(lo) + ", got " + v.dump());
  }
  return static_cast<int>(v.get<int64_t>());
}

StatusOr<std::string> Path(const std::string& key, const json& v) {
  if (!v.is_string() || v.get<std::string>().empty()) {
    return InvalidArgumentError("config '" + key + "': expected a path, got " + v.dump());
  }
  return v.get<std::string>();
}

}  // namespace

StatusOr<TorchConfig> ParseTorchConfig(const json& config, const std::string& env_device) {
  TorchConfig c;
  if (config.is_null()) return c;
  if (!config.is_object()) {
    return InvalidArgumentError("config must be a JSON object, got " + config.dump());
  }
  TIERMEM_RETURN_IF_ERROR(CheckKeys(
      config,
      {"device", "host", "nvme", "precision", "optimizer", "gradient_accumulation_steps",
       "gradient_clipping", "chunk_size", "timeline", "prefetch_depth", "loss_scaling",
       "device_kind"},
      "config"));
  if (config.contains("device")) {
    TIERMEM_ASSIGN_OR_RETURN(c.device_budget, Size("device", config["device"]));
  }
  if (config.contains("host")) {
    TIERMEM_ASSIGN_OR_RETURN(c.host_budget, Size("host", config["host"]));
  }
  if (config.contains("nvme") && !config["nvme"].is_null()) {
    const json& nv = config["nvme"];
    if (!nv.is_object()) {
      return InvalidArgumentError("config 'nvme': expected {'path': ..., 'size': ...}, got " +
                                  nv.dump());
    }
    TIERMEM_RETURN_IF_ERROR(CheckKeys(nv, {"path", "size"}, "config 'nvme'"));
    if (!nv.contains("size")) return InvalidArgumentError("config 'nvme': 'size' is required");
    TIERMEM_ASSIGN_OR_RETURN(c.nvme_size, Size("nvme.size", nv["size"]));
    if (nv.contains("path") && !nv["path"].is_null()) {
      TIERMEM_ASSIGN_OR_RETURN(c.nvme_path, Path("nvme.path", nv["path"]));
    }
  }
  if (config.contains("precision")) {
    const json& p = config["precision"];
    if (p != "fp32" && p != "bf16" && p != "fp16") {
      return InvalidArgumentError("config 'precision': expected 'fp32', 'bf16' or 'fp16', got " +
                                  p.dump());
    }
    c.precision = p.get<std::string>();
  }
  if (config.contains("optimizer")) {
    const json& o = config["optimizer"];
    if (!o.is_object()) {
      return InvalidArgumentError("config 'optimizer': expected an object, got " + o.dump());
    }
    TIERMEM_RETURN_IF_ERROR(
        CheckKeys(o, {"type", "lr", "betas", "eps", "weight_decay"}, "config 'optimizer'"));
    if (o.contains("type") && o["type"] != "adamw") {
      return InvalidArgumentError("config 'optimizer.type': expected 'adamw', got " +
                                  o["type"].dump());
    }
    if (o.contains("lr")) {
      TIERMEM_ASSIGN_OR_RETURN(c.lr, Number("optimizer.lr", o["lr"], 0.0));
    }
    if (o.contains("betas")) {
      const json& b = o["betas"];
      if (!b.is_array() || b.size() != 2) {
        return InvalidArgumentError("config 'optimizer.betas': expected two numbers, got " +
                                    b.dump());
      }
      TIERMEM_ASSIGN_OR_RETURN(c.beta1,
                               Number("optimizer.betas[0]", b[0], 0.0, 1.0, false, true));
      TIERMEM_ASSIGN_OR_RETURN(c.beta2,
                               Number("optimizer.betas[1]", b[1], 0.0, 1.0, false, true));
    }
    if (o.contains("eps")) {
      TIERMEM_ASSIGN_OR_RETURN(c.eps, Number("optimizer.eps", o["eps"], 0.0, -1, true));
    }
    if (o.contains("weight_decay")) {
      TIERMEM_ASSIGN_OR_RETURN(c.weight_decay,
                               Number("optimizer.weight_decay", o["weight_decay"], 0.0));
    }
  }
  if (config.contains("gradient_accumulation_steps")) {
    TIERMEM_ASSIGN_OR_RETURN(
        c.gradient_accumulation_steps,
        Int("gradient_accumulation_steps", config["gradient_accumulation_steps"], 1));
  }
  if (config.contains("gradient_clipping")) {
    TIERMEM_ASSIGN_OR_RETURN(c.gradient_clipping,
                             Number("gradient_clipping", config["gradient_clipping"], 0.0));
  }
  if (config.contains("chunk_size") && !config["chunk_size"].is_null()) {
    const json& v = config["chunk_size"];
    if (!v.is_number_integer() || v.get<int64_t>() < 1) {
      return InvalidArgumentError("config 'chunk_size': expected an integer >= 1, got " +
                                  v.dump());
    }
    c.chunk_size = v.get<uint64_t>();
  }
  if (config.contains("timeline") && !config["timeline"].is_null()) {
    TIERMEM_ASSIGN_OR_RETURN(c.timeline, Path("timeline", config["timeline"]));
  }
  if (config.contains("loss_scaling") && !config["loss_scaling"].is_null()) {
    const json& ls = config["loss_scaling"];
    if (!ls.is_object()) {
      return InvalidArgumentError("config 'loss_scaling': expected an object, got " + ls.dump());
    }
    TIERMEM_RETURN_IF_ERROR(CheckKeys(
        ls, {"initial_scale", "growth_interval", "growth_factor", "backoff_factor"},
        "config 'loss_scaling'"));
    if (ls.contains("initial_scale")) {
      TIERMEM_ASSIGN_OR_RETURN(
          c.initial_scale, Number("loss_scaling.initial_scale", ls["initial_scale"], 0, -1, true));
    }
    if (ls.contains("growth_interval")) {
      TIERMEM_ASSIGN_OR_RETURN(c.growth_interval,
                               Int("loss_scaling.growth_interval", ls["growth_interval"], 1));
    }
    if (ls.contains("growth_factor")) {
      TIERMEM_ASSIGN_OR_RETURN(c.growth_factor,
                               Number("loss_scaling.growth_factor", ls["growth_factor"], 1.0));
    }
    if (ls.contains("backoff_factor")) {
      TIERMEM_ASSIGN_OR_RETURN(
          c.backoff_factor,
          Number("loss_scaling.backoff_factor", ls["backoff_factor"], 0.0, 1.0, true));
    }
  }
  if (config.contains("prefetch_depth")) {
    TIERMEM_ASSIGN_OR_RETURN(c.prefetch_depth, Int("prefetch_depth", config["prefetch_depth"], 0));
  }
  std::string kind = env_device;
  if (kind.empty() && config.contains("device_kind")) {
    if (!config["device_kind"].is_string()) {
      return InvalidArgumentError(
          "config 'device_kind' / TIERMEM_DEVICE: expected 'auto', 'cuda' or 'sim', got " +
          config["device_kind"].dump());
    }
    kind = config["device_kind"].get<std::string>();
  }
  if (kind.empty()) kind = "auto";
  if (kind != "auto" && kind != "cuda" && kind != "sim") {
    return InvalidArgumentError(
        "config 'device_kind' / TIERMEM_DEVICE: expected 'auto', 'cuda' or 'sim', got '" + kind +
        "'");
  }
  c.device_kind = kind;
  return c;
}

}  // namespace tiermem::torch_common
