// The configuration table (config_cases.json, shared with tests/python/test_config.py) run
// through the C++ parser: each good case parses to a config whose ToJson contains `expect`,
// each bad case fails with kInvalidArgument and a message containing `error`.
#include "runtime/config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>

#include "tests/support/status_matchers.h"
#include "tests/support/paths.h"

namespace tiermem::session {
namespace {

using nlohmann::json;
using ::tiermem::testing::StatusIs;

// Replaces every "$DIR" in strings of `j` by `dir`.
json Substitute(const json& j, const std::string& dir) {
  if (j.is_string()) {
    std::string s = j.get<std::string>();
    for (size_t p; (p = s.find("$DIR")) != std::string::npos;) s.replace(p, 4, dir);
    return s;
  }
  if (j.is_object()) {
    json out = json::object();
    for (auto it = j.begin(); it != j.end(); ++it) out[it.key()] = Substitute(it.value(), dir);
    return out;
  }
  if (j.is_array()) {
    json out = json::array();
    for (const json& e : j) out.push_back(Substitute(e, dir));
    return out;
  }
  return j;
}

// `want` is contained in `got`: objects key by key, anything else equal.
::testing::AssertionResult Contains(const json& got, const json& want, const std::string& at) {
  if (want.is_object()) {
    if (!got.is_object()) return ::testing::AssertionFailure() << at << ": not an object";
    for (auto it = want.begin(); it != want.end(); ++it) {
      if (!got.contains(it.key())) {
        return ::testing::AssertionFailure() << at << "." << it.key() << " missing in "
                                             << got.dump();
      }
      auto r = Contains(got[it.key()], it.value(), at + "." + it.key());
      if (!r) return r;
    }
    return ::testing::AssertionSuccess();
  }
  if (got != want) {
    return ::testing::AssertionFailure() << at << ": got " << got.dump() << ", want "
                                         << want.dump();
  }
  return ::testing::AssertionSuccess();
}

json LoadCases() {
  const std::string path =
      ::tiermem::testing::TestEnv("TIERMEM_TEST_SOURCE_DIR") + "/tests/runtime/config_cases.json";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in)["cases"];
}

TEST(ConfigTable, EveryCaseParsesOrFailsAsTheTableSays) {
  const json cases = LoadCases();
  ASSERT_GT(cases.size(), 40u);
  char tmpl[] = "/tmp/tiermem-config-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  int good = 0, bad = 0;
  for (const json& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    std::map<std::string, std::string> vars;
    if (c.contains("env")) {
      for (auto it = c["env"].begin(); it != c["env"].end(); ++it) {
        vars[it.key()] = Substitute(it.value(), dir).get<std::string>();
      }
    }
    StatusOr<SessionConfig> parsed = ParseConfig(Substitute(c["config"], dir), MapEnv(vars));
    if (c.contains("error")) {
      ++bad;
      EXPECT_THAT(parsed, StatusIs(StatusCode::kInvalidArgument, c["error"].get<std::string>()));
    } else {
      ++good;
      ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
      EXPECT_TRUE(Contains(ToJson(*parsed), Substitute(c["expect"], dir), "config"));
      // What ToJson writes parses back to the same config.
      StatusOr<SessionConfig> again = ParseConfig(ToJson(*parsed), MapEnv({}));
      ASSERT_TRUE(again.ok()) << again.status().ToString();
      EXPECT_EQ(ToJson(*again), ToJson(*parsed));
    }
  }
  EXPECT_GT(good, 8);
  EXPECT_GT(bad, 30);
  std::filesystem::remove_all(dir);
}

TEST(ConfigFile, ReadsJsonAndNamesTheFileOnError) {
  char tmpl[] = "/tmp/tiermem-config-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  {
    std::ofstream(dir + "/good.json") << R"({"device": "3MiB", "precision": "bf16"})";
    std::ofstream(dir + "/bad.json") << R"({"device": )";
  }
  StatusOr<SessionConfig> c = ParseConfigFile(dir + "/good.json", MapEnv({}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->device_budget, 3 * kMiB);
  EXPECT_EQ(c->precision, Precision::kBf16);
  EXPECT_THAT(ParseConfigFile(dir + "/bad.json", MapEnv({})),
              StatusIs(StatusCode::kInvalidArgument, "bad.json': invalid JSON"));
  EXPECT_THAT(ParseConfigFile(dir + "/none.json", MapEnv({})),
              StatusIs(StatusCode::kInvalidArgument, "none.json': No such file"));
  std::filesystem::remove_all(dir);
}

// nvme.path: the last directory of the path is created (its parent exists), a path missing
// more than that is refused and nothing of it is created — a mistyped mount point does not
// become a directory on another disk.
TEST(ConfigNvmePath, OnlyTheLastDirectoryIsCreated) {
  char tmpl[] = "/tmp/tiermem-config-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  StatusOr<SessionConfig> leaf =
      ParseConfig({{"nvme", {{"size", "1MiB"}, {"path", dir + "/leaf/"}}}}, MapEnv({}));
  ASSERT_TRUE(leaf.ok()) << leaf.status().ToString();
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/leaf"));
  EXPECT_THAT(ParseConfig({{"nvme", {{"size", "1MiB"}, {"path", dir + "/none/x"}}}}, MapEnv({})),
              StatusIs(StatusCode::kInvalidArgument,
                       "config 'nvme.path': '" + dir + "/none/x' is not a writable directory "
                       "(it does not exist, nor does its parent '" + dir + "/none'"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/none"));
  EXPECT_THAT(
      ParseConfig(json::object(),
                  MapEnv({{"TIERMEM_NVME_SIZE", "1MiB"}, {"TIERMEM_NVME_PATH", dir + "/no/x"}})),
      StatusIs(StatusCode::kInvalidArgument, "config 'nvme.path': '" + dir + "/no/x'"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/no"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem::session
