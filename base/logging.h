// Minimal leveled logging to stderr. Thread-safe (one write(2) per line).
// The level is set by the session from its config (log_level / TIERMEM_LOG_LEVEL: error, warn,
// info, debug); default warn.
#pragma once

#include <sstream>
#include <string>
#include <string_view>

#include "base/status.h"

namespace tiermem {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

void SetLogLevel(LogLevel level);
// "error", "warn" (or "warning"), "info", "debug"; else kInvalidArgument.
StatusOr<LogLevel> ParseLogLevel(std::string_view text);
std::string_view LogLevelName(LogLevel level);
LogLevel GetLogLevel();
void LogLine(LogLevel level, std::string_view message);
// Logs `message` at most once per process for each distinct `key` ("io_uring refused", ...).
void LogOnce(LogLevel level, std::string_view key, std::string_view message);

namespace internal {
class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage() { LogLine(level_, stream_.str()); }
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};
}  // namespace internal

}  // namespace tiermem

// TIERMEM_LOG(kInfo) << "host tier: " << n << " bytes";
#define TIERMEM_LOG(level)                                                                         \
  if (static_cast<int>(::tiermem::LogLevel::level) > static_cast<int>(::tiermem::GetLogLevel())) { \
  } else                                                                                           \
    ::tiermem::internal::LogMessage(::tiermem::LogLevel::level).stream()
