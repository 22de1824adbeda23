#include "integrations/preload/preload_options.h"

#include <cerrno>
#include <cstdlib>

namespace tiermem::preload {
namespace {

Status Bad(const char* var, const char* value, std::string_view why) {
  return InvalidArgumentError(std::string(var) + "='" + value + "': " + std::string(why));
}

StatusOr<long long> ParseInteger(const char* var, const char* v, long long lo, long long hi) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (*v == '\0' || *end != '\0' || errno != 0 || x < lo || x > hi) {
    return Bad(var, v,
               "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return x;
}

StatusOr<bool> ParseFlag(const char* var, const char* v) {
  const std::string s(v);
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off" || s.empty()) return false;
  return Bad(var, v, "expected 0 or 1");
}

StatusOr<Bytes> ParseSize(const char* var, const char* v) {
  auto b = ParseBytes(v);
  if (!b.ok()) return Bad(var, v, b.status().message());
  return *b;
}

}  // namespace

StatusOr<PreloadOptions> ParsePreloadOptions(const EnvGetter& env) {
  PreloadOptions o;
  if (const char* v = env("TIERMEM_PRELOAD_TIMELINE")) o.timeline_path = v;
  if (const char* v = env("TIERMEM_PRELOAD_EXCLUSIVE")) {
    TIERMEM_ASSIGN_OR_RETURN(o.exclusive, ParseFlag("TIERMEM_PRELOAD_EXCLUSIVE", v));
  }
  if (const char* v = env("TIERMEM_PRELOAD_OFFLOAD")) {
    TIERMEM_ASSIGN_OR_RETURN(o.offload, ParseFlag("TIERMEM_PRELOAD_OFFLOAD", v));
  }
  if (const char* v = env("TIERMEM_PRELOAD_DEVICE_BUDGET")) {
    TIERMEM_ASSIGN_OR_RETURN(o.device_budget, ParseSize("TIERMEM_PRELOAD_DEVICE_BUDGET", v));
  }
  if (const char* v = env("TIERMEM_PRELOAD_PREFETCH")) {
    const std::string s(v);
    if (s != "profile" && s != "off")
      return Bad("TIERMEM_PRELOAD_PREFETCH", v, "expected profile or off");
    o.prefetch = s == "profile";
  }
  if (const char* v = env("TIERMEM_PRELOAD_AHEAD")) {
    TIERMEM_ASSIGN_OR_RETURN(long long x, ParseInteger("TIERMEM_PRELOAD_AHEAD", v, 1, 16));
    o.ahead = static_cast<int>(x);
  }
  if (const char* v = env("TIERMEM_PRELOAD_PREFETCH_MAX")) {
    TIERMEM_ASSIGN_OR_RETURN(o.prefetch_max, ParseSize("TIERMEM_PRELOAD_PREFETCH_MAX", v));
    if (o.prefetch_max == 0) return Bad("TIERMEM_PRELOAD_PREFETCH_MAX", v, "must be > 0");
  }
  if (const char* v = env("TIERMEM_PRELOAD_FLUSH_MS")) {
    TIERMEM_ASSIGN_OR_RETURN(long long x, ParseInteger("TIERMEM_PRELOAD_FLUSH_MS", v, 0, 3600000));
    o.flush_ms = static_cast<int>(x);
  }
  if (const char* v = env("TIERMEM_PRELOAD_MAX_ALLOCS")) {
    TIERMEM_ASSIGN_OR_RETURN(long long x,
                             ParseInteger("TIERMEM_PRELOAD_MAX_ALLOCS", v, 1024, 1ll << 30));
    o.max_allocs = static_cast<size_t>(x);
  }
  if (const char* v = env("TIERMEM_PRELOAD_QUIET")) {
    TIERMEM_ASSIGN_OR_RETURN(o.quiet, ParseFlag("TIERMEM_PRELOAD_QUIET", v));
  }
  if (o.offload && o.device_budget == 0) {
    return InvalidArgumentError(
        "TIERMEM_PRELOAD_OFFLOAD=1 needs TIERMEM_PRELOAD_DEVICE_BUDGET (e.g. 16GiB)");
  }
  return o;
}

std::string ExpandPid(const std::string& path, long pid) {
  std::string out;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] == '%' && i + 1 < path.size() && path[i + 1] == 'p') {
      out += std::to_string(pid);
      ++i;
    } else {
      out += path[i];
    }
  }
  return out;
}

}  // namespace tiermem::preload
