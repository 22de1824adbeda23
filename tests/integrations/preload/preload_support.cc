#include "tests/integrations/preload/preload_support.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

namespace tiermem::preload::testing {

Output RunShell(const std::string& command) {
  Output o;
  std::FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return o;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) o.out.append(buf, n);
  const int status = ::pclose(p);
  if (WIFEXITED(status)) {
    o.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    o.code = 128 + WTERMSIG(status);
  }
  return o;
}

std::string TestCli() { return ::tiermem::testing::TestEnv("TIERMEM_TEST_CLI"); }
std::string TestShim() { return ::tiermem::testing::TestEnv("TIERMEM_TEST_SHIM"); }
std::string TestSourceDir() { return ::tiermem::testing::TestEnv("TIERMEM_TEST_SOURCE_DIR"); }
std::string TestProbe(int cuda_major) {
  return ::tiermem::testing::TestEnv(cuda_major == 13 ? "TIERMEM_TEST_PROBE13" : "TIERMEM_TEST_PROBE12");
}

std::string SanitizerPreloadEnv() {
  const std::string san = TIERMEM_TEST_SANITIZER_RUNTIME;
  return san.empty() ? "" : "LD_PRELOAD=" + san;
}

std::string PreloadEnv() {
  const std::string san = TIERMEM_TEST_SANITIZER_RUNTIME;
  return "LD_PRELOAD=" + (san.empty() ? "" : san + ":") + TestShim();
}

nlohmann::json ProfReport(const std::string& timeline) {
  Output o = RunShell(TestCli() + " prof report --json " + timeline);
  EXPECT_EQ(o.code, 0) << o.out;
  if (o.code != 0) return nullptr;
  try {
    return nlohmann::json::parse(o.out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON: " << e.what() << "\n" << o.out;
    return nullptr;
  }
}

std::vector<std::string> ReadLines(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

std::vector<std::string> Grep(const std::vector<std::string>& lines, const std::string& prefix) {
  std::vector<std::string> out;
  for (const std::string& l : lines) {
    if (l.rfind(prefix, 0) == 0) out.push_back(l);
  }
  return out;
}

std::string Value(const std::string& out, const std::string& name) {
  const std::string key = name + "=";
  size_t pos = 0;
  while ((pos = out.find(key, pos)) != std::string::npos) {
    if (pos == 0 || out[pos - 1] == '\n' || out[pos - 1] == ' ') {
      const size_t end = out.find_first_of(" \n", pos + key.size());
      return out.substr(pos + key.size(), end == std::string::npos ? end : end - pos - key.size());
    }
    pos += key.size();
  }
  return "";
}

std::string ScratchDir() {
  const char* tmp = std::getenv("TMPDIR");
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  // One directory per build tree and test, emptied when the test starts again (so runs do not
  // pile up, and the sanitizer trees' runs do not collide with this one's).
  const size_t tree = std::hash<std::string>{}(TestShim()) % 100000;
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/tiermem_preload_" +
                    std::to_string(tree) + "_" + info->test_suite_name() + "_" + info->name();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace tiermem::preload::testing
