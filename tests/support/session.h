// A session for tests: `config` parsed with no environment, device_kind "sim" and host
// "64MiB" unless given; null (with the test failed) when it cannot be made.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "runtime/session.h"

namespace tiermem::testing {

inline std::unique_ptr<session::Session> MakeSession(nlohmann::json config,
                                                     std::vector<session::TensorSpec> specs) {
  if (!config.contains("device_kind")) config["device_kind"] = "sim";
  if (!config.contains("host")) config["host"] = "64MiB";
  auto c = session::ParseConfig(config, tiermem::MapEnv({}));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return nullptr;
  auto s = session::Session::Create(*c, std::move(specs));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

}  // namespace tiermem::testing
