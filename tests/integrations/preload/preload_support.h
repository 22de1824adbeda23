// Helpers of the preload tests: run a command (with environment assignments) and capture its
// output, the LD_PRELOAD assignment for the shim, `tiermem prof report --json` as JSON, the
// fake runtime's call log as lines, and a fresh scratch directory per test.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/paths.h"

namespace tiermem::preload::testing {

struct Output {
  int code = -1;    // exit code, or 128 + signal
  std::string out;  // stdout and stderr together
};

// Runs `command` through /bin/sh (so "A=1 B=2 prog args" works) and waits for it.
Output RunShell(const std::string& command);

// The built tiermem CLI, shim, probe (CUDA 12 or 13 ABI) and the source tree: $TIERMEM_TEST_CLI,
// $TIERMEM_TEST_SHIM, $TIERMEM_TEST_PROBE12/13 and $TIERMEM_TEST_SOURCE_DIR, which ctest sets
// (tests/integrations/preload/CMakeLists.txt) and scripts/gpu_check.sh sets for a relocated
// bundle. An unset one fails the test (tests/support/paths.h). Call them from test bodies.
std::string TestCli();
std::string TestShim();
std::string TestProbe(int cuda_major);
std::string TestSourceDir();

// "LD_PRELOAD=<sanitizer runtime:>libtiermem_preload.so".
std::string PreloadEnv();
// What `tiermem run` needs to find the sanitizer runtime too: "LD_PRELOAD=<runtime>" or "".
std::string SanitizerPreloadEnv();

// `tiermem prof report --json PATH`, parsed; a failure of the command fails the test and
// returns null.
nlohmann::json ProfReport(const std::string& timeline);

std::vector<std::string> ReadLines(const std::string& path);
// The lines of `lines` that start with `prefix`.
std::vector<std::string> Grep(const std::vector<std::string>& lines, const std::string& prefix);
// The value of "name=value" in the probe's output ("" if absent).
std::string Value(const std::string& out, const std::string& name);

// An empty directory under $TMPDIR (or /tmp), named after the build tree and the running test.
std::string ScratchDir();
bool Exists(const std::string& path);

}  // namespace tiermem::preload::testing
