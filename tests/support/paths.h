// Paths a test reads at run time, from the environment ctest gives it (tiermem_test in
// tests/CMakeLists.txt: $TIERMEM_TEST_SOURCE_DIR for every test, ENV for the rest). No path of
// the checkout is compiled into a test object, so the objects of two clones are identical
// and a clean clone's build hits ccache (docs/testing.md).
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace tiermem::testing {

// $name; throws (failing the test with this message) when it is unset or empty. Call it from
// a test body, never from a static initializer: discovery (`--gtest_list_tests`) runs the
// binary without the test's environment.
inline std::string TestEnv(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    throw std::runtime_error(std::string("$") + name +
                             " is unset: ctest sets it (tests/CMakeLists.txt); export it to run "
                             "this test binary by hand");
  }
  return v;
}

// The source tree's tests/data/NAME.
inline std::string TestData(const std::string& name) {
  return TestEnv("TIERMEM_TEST_SOURCE_DIR") + "/tests/data/" + name;
}

}  // namespace tiermem::testing
