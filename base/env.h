// The process environment, behind a getter so that the one place that parses TIERMEM_*
// variables (runtime/config.h) and the kernels' process-wide defaults read it through
// something tests can replace. Nothing else in the code base calls getenv for TIERMEM_*.
//
// Thread-safety: ProcessEnv()'s getter calls std::getenv (safe while nobody calls setenv).
#pragma once

#include <functional>
#include <map>
#include <string>

namespace tiermem {

// Returns nullptr when the variable is unset.
using EnvGetter = std::function<const char*(const char*)>;
EnvGetter ProcessEnv();
// A getter over a fixed map (tests, and the Python binding's explicit `env=` argument).
EnvGetter MapEnv(std::map<std::string, std::string> vars);

}  // namespace tiermem
