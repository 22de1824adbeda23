#include "base/logging.h"

#include <unistd.h>

#include <atomic>
#include <mutex>
#include <set>

namespace tiermem {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kWarn)};
const char* LevelTag(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "E";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kDebug:
      return "D";
  }
  return "?";
}
}  // namespace

// Relaxed is enough: the level is a filter, not a synchronisation point.
void SetLogLevel(LogLevel level) {
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }

StatusOr<LogLevel> ParseLogLevel(std::string_view t) {
  if (t == "error") return LogLevel::kError;
  if (t == "warn" || t == "warning") return LogLevel::kWarn;
  if (t == "info") return LogLevel::kInfo;
  if (t == "debug") return LogLevel::kDebug;
  return InvalidArgumentError("expected one of error, warn, info, debug");
}

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "error";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kDebug:
      return "debug";
  }
  return "warn";
}

void LogLine(LogLevel level, std::string_view message) {
  if (static_cast<int>(level) > static_cast<int>(GetLogLevel())) return;
  std::string line = "[tiermem ";
  line += LevelTag(level);
  line += "] ";
  line += message;
  line += '\n';
  ssize_t r = ::write(STDERR_FILENO, line.data(), line.size());
  (void)r;
}

void LogOnce(LogLevel level, std::string_view key, std::string_view message) {
  static std::mutex mu;
  static std::set<std::string, std::less<>>* seen = new std::set<std::string, std::less<>>();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen->emplace(key).second) return;
  }
  LogLine(level, message);
}

}  // namespace tiermem
