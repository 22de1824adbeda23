// ParseConfig (see config.h). Order: JSON keys are checked and applied, then the TIERMEM_*
// variables override them, then the cross-field checks run once on the result. Each helper
// returns kInvalidArgument naming the key ("optimizer.lr") or the variable and the offending
// value (JSON text for keys, the raw string for variables).
#include "runtime/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "base/fs.h"

namespace tiermem::session {
namespace {

using nlohmann::json;

const std::set<std::string> kTopKeys = {"device",
                                        "host",
                                        "nvme",
                                        "precision",
                                        "optimizer",
                                        "gradient_accumulation_steps",
                                        "gradient_clipping",
                                        "chunk_size",
                                        "timeline",
                                        "prefetch_depth",
                                        "prefetch_lookahead",
                                        "loss_scaling",
                                        "device_kind",
                                        "cpu_threads",
                                        "kernel_isa",
                                        "log_level",
                                        "unmaterialized_reads",
                                        "write_behind",
                                        "plan",
                                        "activations",
                                        "optimizer_placement",
                                        "optimizer_overlap",
                                        "checkpoint_io",
                                        "in_place",
                                        "host_reserve"};

std::string Keys(const std::set<std::string>& keys) {
  std::string out = "[";
  for (const std::string& k : keys) out += (out.size() > 1 ? ", '" : "'") + k + "'";
  return out + "]";
}

Status Bad(const std::string& key, const std::string& why) {
  return InvalidArgumentError("config '" + key + "': " + why);
}

Status CheckKeys(const json& obj, const std::set<std::string>& valid, const std::string& where) {
  std::string bad;
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (!valid.count(it.key())) bad += (bad.empty() ? "'" : ", '") + it.key() + "'";
  }
  if (bad.empty()) return OkStatus();
  return InvalidArgumentError(where + ": unknown key(s) [" + bad + "]; valid keys: " + Keys(valid));
}

StatusOr<Bytes> Size(const std::string& key, const json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) {
    if (v.is_number_integer() && v.get<int64_t>() <= 0) {
      return Bad(key, "size must be > 0, got " + v.dump());
    }
    return v.get<Bytes>();
  }
  if (v.is_string()) {
    StatusOr<Bytes> n = ParseBytes(v.get<std::string>());
    if (!n.ok()) return Bad(key, v.dump() + " is not a size (" + n.status().message() + ")");
    if (*n == 0) return Bad(key, "size must be > 0, got " + v.dump());
    return *n;
  }
  return Bad(key, "expected a size like '2GiB' or a byte count, got " + v.dump());
}

// A number in [lo, hi] (`hi` < `lo`: no upper bound); `lo_open` / `hi_open` exclude the ends.
StatusOr<double> Number(const std::string& key, const json& v, double lo, double hi = -1,
                        bool lo_open = false, bool hi_open = false) {
  if (!v.is_number()) return Bad(key, "expected a number, got " + v.dump());
  const double d = v.get<double>();
  const bool bounded = hi >= lo;
  if (!(d >= lo) || (lo_open && d == lo) || (bounded && (d > hi || (hi_open && d == hi)))) {
    std::string range = (lo_open ? "(" : "[") + json(lo).dump() + ", " +
                        (bounded ? json(hi).dump() + (hi_open ? ")" : "]") : "inf)");
    return Bad(key, v.dump() + " is out of range " + range);
  }
  return d;
}

StatusOr<int> Int(const std::string& key, const json& v, int64_t lo, int64_t hi) {
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
    return Bad(key, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                        "], got " + v.dump());
  }
  return static_cast<int>(v.get<int64_t>());
}

StatusOr<std::string> Choice(const std::string& key, const json& v,
                             std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (v.is_string() && v.get<std::string>() == a) return std::string(a);
    list += (list.empty() ? "'" : ", '") + std::string(a) + "'";
  }
  return Bad(key, "expected one of " + list + ", got " + v.dump());
}

StatusOr<std::string> Path(const std::string& key, const json& v) {
  if (!v.is_string() || v.get<std::string>().empty()) {
    return Bad(key, "expected a path, got " + v.dump());
  }
  return v.get<std::string>();
}

// `dir` must be a writable directory. With `create_last`, a missing last component is
// created when its parent is a directory; a path missing more than that is an error (more
// likely a mistake — a mount point mistyped or not mounted — than a wish, and creating it
// would put the NVMe tier's files on another disk in silence).
Status WritableDir(const std::string& key, std::string dir, bool create_last) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  auto bad = [&](const std::string& why) {
    return Bad(key, "'" + dir + "' is not a writable directory (" + why + ")");
  };
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return bad(std::strerror(errno));
    std::string parent = DirName(dir);
    if (parent.empty()) parent = ".";
    struct stat pst {};
    if (!create_last || stat(parent.c_str(), &pst) != 0 || !S_ISDIR(pst.st_mode)) {
      return bad(create_last ? "it does not exist, nor does its parent '" + parent +
                                   "': tiermem creates only the last directory of the path"
                             : "it does not exist");
    }
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return bad(std::string("cannot create it: ") + std::strerror(errno));
    }
  } else if (!S_ISDIR(st.st_mode)) {
    return bad("not a directory");
  }
  const std::string probe = dir + "/.tiermem-probe-" + std::to_string(getpid());
  const int fd = open(probe.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return bad(std::strerror(errno));
  close(fd);
  unlink(probe.c_str());
  return OkStatus();
}

// ---- environment ------------------------------------------------------------------------
// A set, non-empty variable, else nullptr.
const char* Var(const EnvGetter& env, const char* name) {
  const char* v = env(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

Status BadVar(const char* var, const char* value, const std::string& why) {
  return InvalidArgumentError(std::string(var) + "='" + value + "': " + why);
}

Status SizeVar(const EnvGetter& env, const char* var, Bytes* out) {
  const char* v = Var(env, var);
  if (v == nullptr) return OkStatus();
  StatusOr<Bytes> n = ParseBytes(v);
  if (!n.ok()) return BadVar(var, v, n.status().message());
  if (*n == 0) return BadVar(var, v, "size must be > 0");
  *out = *n;
  return OkStatus();
}

Status IntVar(const EnvGetter& env, const char* var, int* out, long lo, long hi) {
  const char* v = Var(env, var);
  if (v == nullptr) return OkStatus();
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || errno != 0 || n < lo || n > hi) {
    return BadVar(
        var, v, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  *out = static_cast<int>(n);
  return OkStatus();
}

Status ChoiceVar(const EnvGetter& env, const char* var, std::string* out,
                 std::initializer_list<const char*> allowed) {
  const char* v = Var(env, var);
  if (v == nullptr) return OkStatus();
  std::string list;
  for (const char* a : allowed) {
    if (std::strcmp(v, a) == 0) {
      *out = a;
      return OkStatus();
    }
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  return BadVar(var, v, "expected one of " + list);
}

// ---- modes (modes.h): their tables spell them, here and in messages -----------------------
// "'a', 'b'" (JSON messages) or "a, b" (variables), in the table's order.
template <typename Mode>
std::string ModeChoices(bool quoted) {
  std::string list;
  for (const ModeSpelling<Mode>& s : ModeTraits<Mode>::kNames) {
    const std::string name(s.name);
    list += (list.empty() ? "" : ", ") + (quoted ? "'" + name + "'" : name);
  }
  return list;
}

// The mode spelled by `v` at `key` (default: the mode's own key).
template <typename Mode>
StatusOr<Mode> ModeChoice(const json& v, std::string_view key = ModeTraits<Mode>::kKey) {
  if (v.is_string()) {
    if (std::optional<Mode> m = ParseMode<Mode>(v.get<std::string>())) return *m;
  }
  return Bad(std::string(key), "expected one of " + ModeChoices<Mode>(true) + ", got " + v.dump());
}

// A top-level mode key, when present and not null.
template <typename Mode>
Status JsonMode(const json& config, Mode* out) {
  const std::string key(ModeTraits<Mode>::kKey);
  if (!config.contains(key) || config[key].is_null()) return OkStatus();
  TIERMEM_ASSIGN_OR_RETURN(*out, ModeChoice<Mode>(config[key]));
  return OkStatus();
}

template <typename Mode>
Status ModeVar(const EnvGetter& env, const char* var, Mode* out) {
  const char* v = Var(env, var);
  if (v == nullptr) return OkStatus();
  std::optional<Mode> m = ParseMode<Mode>(v);
  if (!m) return BadVar(var, v, "expected one of " + ModeChoices<Mode>(false));
  *out = *m;
  return OkStatus();
}

constexpr std::initializer_list<const char*> kStateDTypes = {"fp32", "bf16", "int8"};
constexpr std::initializer_list<const char*> kRoundings = {"nearest", "stochastic"};

Status ApplyNvme(const json& nv, SessionConfig* c, bool* nvme_given) {
  if (!nv.is_object()) {
    return Bad("nvme", "expected {'path': ..., 'size': ...}, got " + nv.dump());
  }
  TIERMEM_RETURN_IF_ERROR(
      CheckKeys(nv, {"path", "size", "engine", "queue_depth", "piece_size"}, "config 'nvme'"));
  if (!nv.contains("size")) return Bad("nvme", "'size' is required");
  TIERMEM_ASSIGN_OR_RETURN(c->nvme_size, Size("nvme.size", nv["size"]));
  *nvme_given = true;
  if (nv.contains("path") && !nv["path"].is_null()) {
    TIERMEM_ASSIGN_OR_RETURN(c->nvme_path, Path("nvme.path", nv["path"]));
  }
  if (nv.contains("engine")) {
    TIERMEM_ASSIGN_OR_RETURN(c->nvme_engine, ModeChoice<NvmeEngine>(nv["engine"]));
  }
  if (nv.contains("queue_depth")) {
    TIERMEM_ASSIGN_OR_RETURN(c->io_depth, Int("nvme.queue_depth", nv["queue_depth"], 1, 4096));
  }
  if (nv.contains("piece_size")) {
    TIERMEM_ASSIGN_OR_RETURN(c->io_piece, Size("nvme.piece_size", nv["piece_size"]));
    if (c->io_piece < 4 * kKiB || c->io_piece > 64 * kMiB || c->io_piece % (4 * kKiB) != 0) {
      return Bad("nvme.piece_size", "must be a multiple of 4 KiB from 4 KiB to 64 MiB, got " +
                                        std::to_string(c->io_piece));
    }
  }
  return OkStatus();
}

Status ApplyOptimizer(const json& o, SessionConfig* c) {
  if (!o.is_object()) return Bad("optimizer", "expected an object, got " + o.dump());
  TIERMEM_RETURN_IF_ERROR(CheckKeys(o,
                                    {"type", "lr", "betas", "eps", "weight_decay", "state_dtype",
                                     "state_block", "state_rounding", "state_min_elems"},
                                    "config 'optimizer'"));
  if (o.contains("type")) {
    TIERMEM_RETURN_IF_ERROR(Choice("optimizer.type", o["type"], {"adamw"}).status());
  }
  if (o.contains("lr")) {
    TIERMEM_ASSIGN_OR_RETURN(c->optimizer.lr, Number("optimizer.lr", o["lr"], 0));
  }
  if (o.contains("betas")) {
    const json& b = o["betas"];
    if (!b.is_array() || b.size() != 2) {
      return Bad("optimizer.betas", "expected two numbers, got " + b.dump());
    }
    TIERMEM_ASSIGN_OR_RETURN(c->optimizer.beta1,
                             Number("optimizer.betas[0]", b[0], 0, 1, false, true));
    TIERMEM_ASSIGN_OR_RETURN(c->optimizer.beta2,
                             Number("optimizer.betas[1]", b[1], 0, 1, false, true));
  }
  if (o.contains("eps")) {
    TIERMEM_ASSIGN_OR_RETURN(c->optimizer.eps, Number("optimizer.eps", o["eps"], 0, -1, true));
  }
  if (o.contains("weight_decay")) {
    TIERMEM_ASSIGN_OR_RETURN(c->optimizer.weight_decay,
                             Number("optimizer.weight_decay", o["weight_decay"], 0));
  }
  kernels::StateFormat& f = c->optimizer_state.format;
  if (o.contains("state_dtype")) {
    TIERMEM_ASSIGN_OR_RETURN(const std::string d,
                             Choice("optimizer.state_dtype", o["state_dtype"], kStateDTypes));
    f.dtype = kernels::ParseStateDType(d).value();
  }
  if (o.contains("state_block")) {
    TIERMEM_ASSIGN_OR_RETURN(const int b, Int("optimizer.state_block", o["state_block"],
                                              kernels::kMinStateBlock, kernels::kMaxStateBlock));
    f.block = static_cast<uint32_t>(b);
    if (Status v = kernels::ValidateStateFormat(f); !v.ok()) {
      return Bad("optimizer.state_block", std::string(v.message()));
    }
  }
  if (o.contains("state_rounding")) {
    TIERMEM_ASSIGN_OR_RETURN(const std::string r,
                             Choice("optimizer.state_rounding", o["state_rounding"], kRoundings));
    f.stochastic = r == "stochastic";
  }
  if (o.contains("state_min_elems")) {
    const json& v = o["state_min_elems"];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      return Bad("optimizer.state_min_elems", "expected an integer >= 0, got " + v.dump());
    }
    c->optimizer_state.min_elems = v.get<uint64_t>();
  }
  return OkStatus();
}

Status ApplyLossScaling(const json& ls, LossScalingConfig* s) {
  if (!ls.is_object()) return Bad("loss_scaling", "expected an object, got " + ls.dump());
  TIERMEM_RETURN_IF_ERROR(
      CheckKeys(ls, {"initial_scale", "growth_interval", "growth_factor", "backoff_factor"},
                "config 'loss_scaling'"));
  if (ls.contains("initial_scale")) {
    TIERMEM_ASSIGN_OR_RETURN(
        s->initial_scale, Number("loss_scaling.initial_scale", ls["initial_scale"], 0, -1, true));
  }
  if (ls.contains("growth_interval")) {
    TIERMEM_ASSIGN_OR_RETURN(
        s->growth_interval, Int("loss_scaling.growth_interval", ls["growth_interval"], 1, 1 << 30));
  }
  if (ls.contains("growth_factor")) {
    TIERMEM_ASSIGN_OR_RETURN(s->growth_factor,
                             Number("loss_scaling.growth_factor", ls["growth_factor"], 1));
  }
  if (ls.contains("backoff_factor")) {
    TIERMEM_ASSIGN_OR_RETURN(
        s->backoff_factor, Number("loss_scaling.backoff_factor", ls["backoff_factor"], 0, 1, true));
  }
  return OkStatus();
}

// The keys in the order they are checked (the first bad one is the error).
Status ApplyJson(const json& config, SessionConfig* c, bool* nvme_given) {
  TIERMEM_RETURN_IF_ERROR(CheckKeys(config, kTopKeys, "config"));
  auto has = [&](const char* k) { return config.contains(k) && !config[k].is_null(); };
  if (has("device")) {
    TIERMEM_ASSIGN_OR_RETURN(c->device_budget, Size("device", config["device"]));
    c->device_budget_given = true;
  }
  if (has("host")) {
    TIERMEM_ASSIGN_OR_RETURN(c->host_budget, Size("host", config["host"]));
  }
  if (has("host_reserve")) {
    TIERMEM_ASSIGN_OR_RETURN(c->host_reserve, Size("host_reserve", config["host_reserve"]));
  }
  if (has("nvme")) TIERMEM_RETURN_IF_ERROR(ApplyNvme(config["nvme"], c, nvme_given));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->precision));
  if (has("optimizer")) TIERMEM_RETURN_IF_ERROR(ApplyOptimizer(config["optimizer"], c));
  if (has("gradient_accumulation_steps")) {
    TIERMEM_ASSIGN_OR_RETURN(
        c->gradient_accumulation_steps,
        Int("gradient_accumulation_steps", config["gradient_accumulation_steps"], 1, 1 << 20));
  }
  if (has("gradient_clipping")) {
    TIERMEM_ASSIGN_OR_RETURN(c->gradient_clipping,
                             Number("gradient_clipping", config["gradient_clipping"], 0));
  }
  if (has("chunk_size")) {
    const json& v = config["chunk_size"];
    if (!v.is_number_integer() || v.get<int64_t>() < 1) {
      return Bad("chunk_size", "expected an integer >= 1, got " + v.dump());
    }
    c->chunk_size = v.get<uint64_t>();
  }
  if (has("timeline")) {
    TIERMEM_ASSIGN_OR_RETURN(c->timeline, Path("timeline", config["timeline"]));
  }
  if (has("prefetch_depth")) {
    TIERMEM_ASSIGN_OR_RETURN(c->prefetch_depth,
                             Int("prefetch_depth", config["prefetch_depth"], 0, 1024));
  }
  if (has("write_behind")) {
    const json& v = config["write_behind"];
    if (!v.is_boolean()) return Bad("write_behind", "expected true or false, got " + v.dump());
    c->write_behind = v.get<bool>();
  }
  if (has("loss_scaling")) {
    TIERMEM_RETURN_IF_ERROR(ApplyLossScaling(config["loss_scaling"], &c->loss_scaling));
  }
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->device_kind));
  if (has("cpu_threads")) {
    TIERMEM_ASSIGN_OR_RETURN(c->cpu_threads, Int("cpu_threads", config["cpu_threads"], 0, 4096));
  }
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->kernel_isa));
  if (has("log_level")) {
    TIERMEM_ASSIGN_OR_RETURN(const std::string l, Choice("log_level", config["log_level"],
                                                         {"error", "warn", "info", "debug"}));
    c->log_level = ParseLogLevel(l).value();
  }
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->activations));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->plan));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->optimizer_placement));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->optimizer_overlap));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->checkpoint_io));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->prefetch_lookahead));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->in_place));
  TIERMEM_RETURN_IF_ERROR(JsonMode(config, &c->unmaterialized_reads));
  return OkStatus();
}

Status ApplyEnv(const EnvGetter& env, SessionConfig* c, bool* nvme_given) {
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_DEVICE", &c->device_kind));
  if (Var(env, "TIERMEM_DEVICE_BUDGET") != nullptr) {
    TIERMEM_RETURN_IF_ERROR(SizeVar(env, "TIERMEM_DEVICE_BUDGET", &c->device_budget));
    c->device_budget_given = true;
  }
  TIERMEM_RETURN_IF_ERROR(SizeVar(env, "TIERMEM_HOST_BUDGET", &c->host_budget));
  TIERMEM_RETURN_IF_ERROR(SizeVar(env, "TIERMEM_HOST_RESERVE", &c->host_reserve));
  if (Var(env, "TIERMEM_NVME_SIZE") != nullptr) {
    TIERMEM_RETURN_IF_ERROR(SizeVar(env, "TIERMEM_NVME_SIZE", &c->nvme_size));
    *nvme_given = true;
  }
  if (const char* p = Var(env, "TIERMEM_NVME_PATH")) {
    if (!*nvme_given) {
      return InvalidArgumentError(
          "TIERMEM_NVME_PATH is set but no NVMe size is (config 'nvme.size' or "
          "TIERMEM_NVME_SIZE)");
    }
    c->nvme_path = p;
  }
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_NVME_ENGINE", &c->nvme_engine));
  TIERMEM_RETURN_IF_ERROR(IntVar(env, "TIERMEM_IO_DEPTH", &c->io_depth, 1, 4096));
  TIERMEM_RETURN_IF_ERROR(IntVar(env, "TIERMEM_CPU_THREADS", &c->cpu_threads, 0, 4096));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_KERNEL_ISA", &c->kernel_isa));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_PLAN", &c->plan));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_ACTIVATIONS", &c->activations));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_OPTIMIZER_PLACEMENT", &c->optimizer_placement));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_OPTIMIZER_OVERLAP", &c->optimizer_overlap));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_CHECKPOINT_IO", &c->checkpoint_io));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_PREFETCH_LOOKAHEAD", &c->prefetch_lookahead));
  TIERMEM_RETURN_IF_ERROR(ModeVar(env, "TIERMEM_IN_PLACE", &c->in_place));
  std::string state_dtype(kernels::StateDTypeName(c->optimizer_state.format.dtype));
  TIERMEM_RETURN_IF_ERROR(ChoiceVar(env, "TIERMEM_STATE_DTYPE", &state_dtype, kStateDTypes));
  c->optimizer_state.format.dtype = kernels::ParseStateDType(state_dtype).value();
  if (const char* t = Var(env, "TIERMEM_TIMELINE")) c->timeline = t;
  if (const char* l = Var(env, "TIERMEM_LOG_LEVEL")) {
    StatusOr<LogLevel> level = ParseLogLevel(l);
    if (!level.ok()) return BadVar("TIERMEM_LOG_LEVEL", l, level.status().message());
    c->log_level = *level;
  }
  return OkStatus();
}

}  // namespace

std::string_view PrecisionName(Precision p) { return ModeName(p); }

kernels::DType ComputeDType(Precision p) {
  switch (p) {
    case Precision::kBf16:
      return kernels::DType::kBF16;
    case Precision::kFp16:
      return kernels::DType::kF16;
    case Precision::kFp32:
      break;
  }
  return kernels::DType::kF32;
}

std::optional<kernels::Isa> KernelIsaOf(KernelIsaMode m) {
  switch (m) {
    case KernelIsaMode::kScalar:
      return kernels::Isa::kScalar;
    case KernelIsaMode::kAvx2:
      return kernels::Isa::kAvx2;
    case KernelIsaMode::kAvx512:
      return kernels::Isa::kAvx512;
    case KernelIsaMode::kAuto:
      break;
  }
  return std::nullopt;
}

StatusOr<SessionConfig> ParseConfig(const json& config, const EnvGetter& env) {
  SessionConfig c;
  if (!config.is_null() && !config.is_object()) {
    return InvalidArgumentError("config must be a JSON object, got " + config.dump());
  }
  bool nvme_given = false;
  if (config.is_object()) TIERMEM_RETURN_IF_ERROR(ApplyJson(config, &c, &nvme_given));
  TIERMEM_RETURN_IF_ERROR(ApplyEnv(env, &c, &nvme_given));
  if (nvme_given && !c.nvme_path.empty()) {
    // Checked (its last directory created) before anything is built or any model touched.
    TIERMEM_RETURN_IF_ERROR(WritableDir("nvme.path", c.nvme_path, /*create_last=*/true));
  }
  if (c.optimizer_state.format.stochastic &&
      c.optimizer_state.format.dtype != kernels::StateDType::kBF16) {
    return InvalidArgumentError(
        "config 'optimizer.state_rounding': 'stochastic' rounds bf16 state; the state dtype is " +
        std::string(kernels::StateDTypeName(c.optimizer_state.format.dtype)) +
        " (set optimizer.state_dtype 'bf16', or drop state_rounding)");
  }
  if (c.host_reserve > 0 && c.nvme_size == 0) {
    return InvalidArgumentError(
        "config 'host_reserve' (or TIERMEM_HOST_RESERVE) = " + std::to_string(c.host_reserve) +
        " bytes without an NVMe tier: it keeps host room free of chunk homes, and without "
        "'nvme' every chunk is homed in host memory; drop it, or give 'nvme'");
  }
  if (c.host_reserve >= c.host_budget && c.host_reserve > 0) {
    return InvalidArgumentError("config 'host_reserve' = " + std::to_string(c.host_reserve) +
                                " bytes is not below the host budget of " +
                                std::to_string(c.host_budget) + " bytes");
  }
  if (IsHostCompute(c.device_kind) && c.device_budget_given) {
    return InvalidArgumentError(
        "config 'device' (or TIERMEM_DEVICE_BUDGET) = " + std::to_string(c.device_budget) +
        " bytes with device_kind 'host': host mode has no device tier (compute runs on the "
        "CPU against host memory, whose budget is 'host'); drop 'device', or pick "
        "device_kind 'sim' to simulate a device of that budget");
  }
  return c;
}

Status CheckNvmePath(const SessionConfig& config) {
  if (config.nvme_size == 0 || config.nvme_path.empty()) return OkStatus();
  return WritableDir("nvme.path", config.nvme_path, /*create_last=*/false);
}

StatusOr<SessionConfig> ParseConfigFile(const std::string& path, const EnvGetter& env) {
  std::ifstream in(path);
  if (!in) {
    return InvalidArgumentError("config file '" + path + "': " + std::strerror(errno));
  }
  std::stringstream text;
  text << in.rdbuf();
  json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return InvalidArgumentError("config file '" + path + "': invalid JSON");
  }
  return ParseConfig(j, env);
}

json ToJson(const SessionConfig& c) {
  json j;
  // Not given: null, so that parsing it again keeps it "not given" (host mode refuses one).
  j["device"] = c.device_budget_given ? json(c.device_budget) : json(nullptr);
  j["host"] = c.host_budget;
  if (c.host_reserve > 0) j["host_reserve"] = c.host_reserve;
  if (c.nvme_size > 0) {
    j["nvme"] = {{"size", c.nvme_size},
                 {"engine", std::string(ModeName(c.nvme_engine))},
                 {"queue_depth", c.io_depth},
                 {"piece_size", c.io_piece}};
    if (!c.nvme_path.empty()) j["nvme"]["path"] = c.nvme_path;
  }
  j["device_kind"] = std::string(ModeName(c.device_kind));
  if (!c.timeline.empty()) j["timeline"] = c.timeline;
  j["cpu_threads"] = c.cpu_threads;
  j["kernel_isa"] = std::string(ModeName(c.kernel_isa));
  j["log_level"] = std::string(LogLevelName(c.log_level));
  j["precision"] = std::string(ModeName(c.precision));
  j["optimizer"] = {
      {"type", "adamw"},
      {"lr", c.optimizer.lr},
      {"betas", {c.optimizer.beta1, c.optimizer.beta2}},
      {"eps", c.optimizer.eps},
      {"weight_decay", c.optimizer.weight_decay},
      {"state_dtype", std::string(kernels::StateDTypeName(c.optimizer_state.format.dtype))},
      {"state_block", c.optimizer_state.format.block},
      {"state_rounding", c.optimizer_state.format.stochastic ? "stochastic" : "nearest"},
      {"state_min_elems", c.optimizer_state.min_elems}};
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  j["gradient_clipping"] = c.gradient_clipping;
  if (c.chunk_size) j["chunk_size"] = *c.chunk_size;
  j["prefetch_depth"] = c.prefetch_depth;
  j["prefetch_lookahead"] = std::string(ModeName(c.prefetch_lookahead));
  j["write_behind"] = c.write_behind;
  j["loss_scaling"] = {{"initial_scale", c.loss_scaling.initial_scale},
                       {"growth_interval", c.loss_scaling.growth_interval},
                       {"growth_factor", c.loss_scaling.growth_factor},
                       {"backoff_factor", c.loss_scaling.backoff_factor}};
  j["unmaterialized_reads"] = std::string(ModeName(c.unmaterialized_reads));
  j["plan"] = std::string(ModeName(c.plan));
  j["activations"] = std::string(ModeName(c.activations));
  j["optimizer_placement"] = std::string(ModeName(c.optimizer_placement));
  j["optimizer_overlap"] = std::string(ModeName(c.optimizer_overlap));
  j["checkpoint_io"] = std::string(ModeName(c.checkpoint_io));
  j["in_place"] = std::string(ModeName(c.in_place));
  return j;
}

}  // namespace tiermem::session
