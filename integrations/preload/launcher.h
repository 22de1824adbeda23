// The launcher behind `tiermem run`: finds libtiermem_preload.so, builds the child's
// environment (LD_PRELOAD + the shim's TIERMEM_PRELOAD_* options, PYTORCH_CUDA_ALLOC_CONF for
// --per-tensor), runs the command, forwards signals to it and returns its exit status.
// Thread-safety: RunCommand installs process-wide signal handlers while the child runs; call
// it from one thread at a time. The other functions are pure.
#pragma once

#include <string>
#include <vector>

#include "base/env.h"
#include "base/status.h"
#include "base/units.h"

namespace tiermem::preload {

struct RunOptions {
  std::string record_path = "tiermem-run.tmt";  // "" = do not record
  bool offload = false;
  Bytes device_budget = 0;  // required with offload
  bool per_tensor = false;  // PyTorch: backend:cudaMallocAsync
  std::vector<std::string> command;
};

// Where the shim is, in this order: $TIERMEM_PRELOAD_LIB (must exist when set); the directory
// of `exe_path` (the running tiermem, /proc/self/exe); `exe_dir`/../lib; `build_path` (the
// build tree's, compiled in). kNotFound lists every place looked at.
StatusOr<std::string> FindPreloadLibrary(const EnvGetter& env, const std::string& exe_path,
                                         const std::string& build_path);
// FindPreloadLibrary with the real environment, /proc/self/exe and the build-tree path.
StatusOr<std::string> FindPreloadLibrary();

// The child's environment: `parent` ("NAME=value" entries) with LD_PRELOAD extended by `lib`
// (after any libraries already preloaded) and the TIERMEM_PRELOAD_* variables set. The
// record path is made absolute (the child may chdir). --per-tensor sets
// PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (appended to an existing value; a value
// that already names another backend is kInvalidArgument).
StatusOr<std::vector<std::string>> ChildEnvironment(const RunOptions& options,
                                                    const std::string& lib,
                                                    const std::vector<std::string>& parent);

// Runs options.command (PATH lookup) with `env`. SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and
// SIGUSR2 sent to this process are forwarded to the child (those a terminal sends to the whole
// process group reach the child directly and are not sent twice). Returns the child's exit
// code, or 128 + the signal that killed it. A command that cannot be started is kNotFound or
// kFailedPrecondition naming it.
StatusOr<int> RunCommand(const RunOptions& options, const std::vector<std::string>& env);

// The timelines a run wrote: `record_path` and the "<stem>.<pid><ext>" files of the other
// processes of the job (see docs/preload.md), those modified at or after `since_s` (time(2)).
std::vector<std::string> TimelinesWritten(const std::string& record_path, long long since_s);

// All of the above for the `tiermem run` subcommand: finds the shim, removes an old timeline
// at options.record_path, runs the command, and says on stderr where the timeline(s) went and
// whether a signal killed the command. Returns the command's exit code.
StatusOr<int> RunWithPreload(const RunOptions& options);

}  // namespace tiermem::preload
