// Options: the runtime's configuration, assembled once from a config struct (filled by the
// Python/C++ API from the user's config) and overridden by TIERMEM_* environment variables.
// The environment is read exactly once per ParseOptions call, through an injectable getter,
// so tests never touch the real environment. A bad value is kInvalidArgument naming the
// variable and the value.
//
//   TIERMEM_DEVICE          auto | cuda | sim     which device tier (auto: cuda if a GPU, else sim)
//   TIERMEM_DEVICE_BUDGET   size                  device tier budget (e.g. 2GiB)
//   TIERMEM_HOST_BUDGET     size                  host tier budget
//   TIERMEM_NVME_PATH       directory             where NVMe slot files go ("" = a temp dir)
//   TIERMEM_NVME_SIZE       size                  NVMe tier budget
//   TIERMEM_NVME_ENGINE     auto | io_uring | posix
//   TIERMEM_IO_DEPTH        integer 1..4096       io_uring queue depth
//   TIERMEM_CPU_THREADS     integer >= 0          CPU kernel threads (0 = all cores)
//   TIERMEM_KERNEL_ISA      auto | scalar | avx2 | avx512   force a CPU kernel variant
//   TIERMEM_TIMELINE        path                  write the memory timeline here ("" = off)
//   TIERMEM_LOG_LEVEL       error | warn | info | debug
#pragma once

#include <functional>
#include <string>

#include "runtime/base/logging.h"
#include "runtime/base/status.h"
#include "runtime/base/units.h"

namespace tiermem {

struct Options {
  std::string device = "auto";
  Bytes device_budget = 2 * kGiB;
  Bytes host_budget = 8 * kGiB;
  std::string nvme_path;  // "" = a fresh directory under $TMPDIR
  Bytes nvme_size = 0;    // 0 = no NVMe tier
  std::string nvme_engine = "auto";
  int io_depth = 8;
  int cpu_threads = 0;
  std::string kernel_isa = "auto";
  std::string timeline_path;
  LogLevel log_level = LogLevel::kWarn;
};

// Returns nullptr when unset.
using EnvGetter = std::function<const char*(const char*)>;
EnvGetter ProcessEnv();

// `base` overridden by the environment; validates the result.
StatusOr<Options> ParseOptions(const Options& base, const EnvGetter& env = ProcessEnv());
// Validation alone (ranges, enumerations); used by ParseOptions and by config front-ends.
Status ValidateOptions(const Options& options);

StatusOr<LogLevel> ParseLogLevel(std::string_view text);

}  // namespace tiermem
