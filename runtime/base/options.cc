#include "runtime/base/options.h"

#include <cstdlib>
#include <string>

namespace tiermem {
namespace {

Status BadEnv(const char* var, const char* value, const Status& why) {
  return InvalidArgumentError(std::string(var) + "='" + value + "': " + why.message());
}

StatusOr<int> ParseInt(std::string_view text, long lo, long hi) {
  std::string s(text);
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno != 0 || v < lo || v > hi) {
    return InvalidArgumentError("expected an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "]");
  }
  return static_cast<int>(v);
}

Status OneOf(std::string_view what, const std::string& value,
             std::initializer_list<std::string_view> allowed) {
  std::string list;
  for (auto a : allowed) {
    if (value == a) return OkStatus();
    if (!list.empty()) list += ", ";
    list += a;
  }
  return InvalidArgumentError(std::string(what) + " '" + value + "' is not one of: " + list);
}

}  // namespace

EnvGetter ProcessEnv() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

StatusOr<LogLevel> ParseLogLevel(std::string_view t) {
  if (t == "error") return LogLevel::kError;
  if (t == "warn" || t == "warning") return LogLevel::kWarn;
  if (t == "info") return LogLevel::kInfo;
  if (t == "debug") return LogLevel::kDebug;
  return InvalidArgumentError("expected one of error, warn, info, debug");
}

Status ValidateOptions(const Options& o) {
  TIERMEM_RETURN_IF_ERROR(OneOf("device", o.device, {"auto", "cuda", "sim"}));
  TIERMEM_RETURN_IF_ERROR(OneOf("nvme engine", o.nvme_engine, {"auto", "io_uring", "posix"}));
  TIERMEM_RETURN_IF_ERROR(OneOf("kernel isa", o.kernel_isa, {"auto", "scalar", "avx2", "avx512"}));
  if (o.device_budget == 0) return InvalidArgumentError("device budget must be > 0");
  if (o.io_depth < 1 || o.io_depth > 4096) {
    return InvalidArgumentError("io depth " + std::to_string(o.io_depth) + " not in [1, 4096]");
  }
  if (o.cpu_threads < 0) return InvalidArgumentError("cpu threads must be >= 0");
  return OkStatus();
}

StatusOr<Options> ParseOptions(const Options& base, const EnvGetter& env) {
  Options o = base;
  auto size_var = [&](const char* var, Bytes* out) -> Status {
    const char* v = env(var);
    if (v == nullptr) return OkStatus();
    auto parsed = ParseBytes(v);
    if (!parsed.ok()) return BadEnv(var, v, parsed.status());
    *out = *parsed;
    return OkStatus();
  };
  auto int_var = [&](const char* var, int* out, long lo, long hi) -> Status {
    const char* v = env(var);
    if (v == nullptr) return OkStatus();
    auto parsed = ParseInt(v, lo, hi);
    if (!parsed.ok()) return BadEnv(var, v, parsed.status());
    *out = *parsed;
    return OkStatus();
  };
  auto str_var = [&](const char* var, std::string* out) {
    if (const char* v = env(var)) *out = v;
  };
  // An enumerated variable is checked where it is read, so the error names the variable.
  auto enum_var = [&](const char* var, std::string* out,
                      std::initializer_list<std::string_view> allowed) -> Status {
    const char* v = env(var);
    if (v == nullptr) return OkStatus();
    Status s = OneOf("value", v, allowed);
    if (!s.ok()) return BadEnv(var, v, s);
    *out = v;
    return OkStatus();
  };
  TIERMEM_RETURN_IF_ERROR(enum_var("TIERMEM_DEVICE", &o.device, {"auto", "cuda", "sim"}));
  TIERMEM_RETURN_IF_ERROR(size_var("TIERMEM_DEVICE_BUDGET", &o.device_budget));
  TIERMEM_RETURN_IF_ERROR(size_var("TIERMEM_HOST_BUDGET", &o.host_budget));
  str_var("TIERMEM_NVME_PATH", &o.nvme_path);
  TIERMEM_RETURN_IF_ERROR(size_var("TIERMEM_NVME_SIZE", &o.nvme_size));
  TIERMEM_RETURN_IF_ERROR(
      enum_var("TIERMEM_NVME_ENGINE", &o.nvme_engine, {"auto", "io_uring", "posix"}));
  TIERMEM_RETURN_IF_ERROR(int_var("TIERMEM_IO_DEPTH", &o.io_depth, 1, 4096));
  TIERMEM_RETURN_IF_ERROR(int_var("TIERMEM_CPU_THREADS", &o.cpu_threads, 0, 4096));
  TIERMEM_RETURN_IF_ERROR(
      enum_var("TIERMEM_KERNEL_ISA", &o.kernel_isa, {"auto", "scalar", "avx2", "avx512"}));
  str_var("TIERMEM_TIMELINE", &o.timeline_path);
  if (const char* v = env("TIERMEM_LOG_LEVEL")) {
    auto lvl = ParseLogLevel(v);
    if (!lvl.ok()) return BadEnv("TIERMEM_LOG_LEVEL", v, lvl.status());
    o.log_level = *lvl;
  }
  Status valid = ValidateOptions(o);
  if (!valid.ok()) return valid.WithContext("tiermem options");
  return o;
}

}  // namespace tiermem
