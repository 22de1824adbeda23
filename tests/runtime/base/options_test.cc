#include <map>
#include <string>

#include <gtest/gtest.h>

#include "runtime/base/options.h"

namespace tiermem {
namespace {

EnvGetter FakeEnv(std::map<std::string, std::string> vars) {
  auto owned = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [owned](const char* name) -> const char* {
    auto it = owned->find(name);
    return it == owned->end() ? nullptr : it->second.c_str();
  };
}

TEST(Options, EnvironmentOverridesConfig) {
  Options base;
  base.device_budget = 1 * kGiB;
  auto o = ParseOptions(base, FakeEnv({{"TIERMEM_DEVICE_BUDGET", "512MiB"},
                                       {"TIERMEM_HOST_BUDGET", "3GiB"},
                                       {"TIERMEM_NVME_ENGINE", "posix"},
                                       {"TIERMEM_IO_DEPTH", "16"},
                                       {"TIERMEM_LOG_LEVEL", "debug"},
                                       {"TIERMEM_DEVICE", "sim"}}));
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->device_budget, 512 * kMiB);
  EXPECT_EQ(o->host_budget, 3 * kGiB);
  EXPECT_EQ(o->nvme_engine, "posix");
  EXPECT_EQ(o->io_depth, 16);
  EXPECT_EQ(o->log_level, LogLevel::kDebug);
  EXPECT_EQ(o->device, "sim");
}

TEST(Options, UnsetEnvironmentKeepsConfig) {
  Options base;
  base.host_budget = 5 * kGiB;
  auto o = ParseOptions(base, FakeEnv({}));
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->host_budget, 5 * kGiB);
}

TEST(Options, BadValueNamesTheVariable) {
  auto o = ParseOptions(Options{}, FakeEnv({{"TIERMEM_HOST_BUDGET", "lots"}}));
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("TIERMEM_HOST_BUDGET='lots'"), std::string::npos)
      << o.status().message();

  o = ParseOptions(Options{}, FakeEnv({{"TIERMEM_IO_DEPTH", "0"}}));
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("TIERMEM_IO_DEPTH"), std::string::npos);

  o = ParseOptions(Options{}, FakeEnv({{"TIERMEM_NVME_ENGINE", "spdk"}}));
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("TIERMEM_NVME_ENGINE='spdk'"), std::string::npos)
      << o.status().message();
  o = ParseOptions(Options{}, FakeEnv({{"TIERMEM_KERNEL_ISA", "neon"}}));
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("TIERMEM_KERNEL_ISA='neon'"), std::string::npos);

  o = ParseOptions(Options{}, FakeEnv({{"TIERMEM_DEVICE_BUDGET", "0"}}));
  EXPECT_FALSE(o.ok());
}

}  // namespace
}  // namespace tiermem
