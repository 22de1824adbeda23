// The shim's CUDA-free parts, directly: the allocation table against a std::unordered_map
// model, the access profile's learn/predict rules, the options, and the launcher's library
// lookup order and child environment.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <unordered_map>

#include "integrations/preload/access_profile.h"
#include "integrations/preload/alloc_table.h"
#include "integrations/preload/launcher.h"
#include "integrations/preload/preload_options.h"

namespace tiermem::preload {
namespace {

namespace fs = std::filesystem;

TEST(AllocTable, MatchesAMapUnderRandomInsertsAndRemoves) {
  auto t = AllocTable::Create(1 << 12);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  std::unordered_map<uint64_t, uint64_t> model;
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    // Few distinct keys so removes hit and probe runs collide and wrap.
    const uint64_t key = ((rng() % 1500) + 1) << 8;
    if (rng() % 2 == 0) {
      const uint64_t bytes = rng() % 100000;
      ASSERT_TRUE((*t)->Insert(key, AllocInfo{bytes, 0, AllocKind::kDevice}));
      model[key] = bytes;
    } else {
      AllocInfo info;
      const bool found = (*t)->Remove(key, &info);
      ASSERT_EQ(found, model.count(key) == 1) << "key " << key << " at step " << i;
      if (found) {
        EXPECT_EQ(info.bytes, model[key]);
        model.erase(key);
      }
    }
  }
  for (const auto& [key, bytes] : model) {
    AllocInfo info;
    ASSERT_TRUE((*t)->Find(key, &info));
    EXPECT_EQ(info.bytes, bytes);
  }
}

TEST(AllocTable, AFullShardRefusesTheInsertAndChangesNothing) {
  auto t = AllocTable::Create(0);  // the minimum: 16 slots per shard, 14 usable
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->capacity(), AllocTable::kShards * 16);
  int accepted = 0, refused = 0;
  for (uint64_t k = 1; k <= 4000; ++k) {
    if ((*t)->Insert(k << 8, AllocInfo{k, 0, AllocKind::kDevice})) {
      ++accepted;
    } else {
      ++refused;
      AllocInfo info;
      EXPECT_FALSE((*t)->Find(k << 8, &info));
    }
  }
  EXPECT_EQ(accepted, static_cast<int>(AllocTable::kShards * 14));
  EXPECT_EQ(refused, 4000 - accepted);
}

TEST(AccessProfile, WarmUpPrefetchesNothingThenPredictsTheNextLaunchesRanges) {
  AccessProfile p(/*ahead=*/2, /*max_bytes=*/1 << 30, /*max_ranges=*/16);
  ASSERT_TRUE(p.AddRange(0x10000, 0x1000));  // A
  ASSERT_TRUE(p.AddRange(0x20000, 0x1000));  // B
  ASSERT_TRUE(p.AddRange(0x30000, 0x1000));  // C
  PrefetchRequest out[AccessProfile::kMaxPrefetches];
  const uint64_t a = 0x10000, b = 0x20010, c = 0x30000, other = 0x99;
  auto launch = [&](uint64_t kernel, uint64_t arg) { return p.OnLaunch(kernel, &arg, 1, out); };
  // Warm-up: k1(A) k2(B) k3(C).
  EXPECT_EQ(launch(1, a), 0);
  EXPECT_EQ(launch(2, b), 0);
  EXPECT_EQ(launch(3, c), 0);
  // Second iteration: k1(A) predicts B and C (the next two launches), from the touched address.
  ASSERT_EQ(launch(1, a), 2);
  EXPECT_EQ(out[0].base, 0x20000u);
  EXPECT_EQ(out[0].start, 0x20010u);
  EXPECT_EQ(out[0].bytes, 0x1000u - 0x10);
  EXPECT_EQ(out[1].start, 0x30000u);
  EXPECT_EQ(out[1].bytes, 0x1000u);
  // k2(B) learnt C and A (the two launches after it); C was prefetched 1 launch ago (less
  // than 2 * ahead), so only A is prefetched.
  const int n = launch(2, b);
  ASSERT_EQ(n, 1);
  EXPECT_EQ(out[0].base, 0x10000u);
  // A launch touching nothing managed is not profiled as touching anything.
  EXPECT_EQ(launch(4, other), 0);
  // A freed range is never prefetched.
  p.RemoveRange(0x30000);
  EXPECT_EQ(p.ranges(), 2u);
  for (int i = 0; i < 5; ++i) {
    const int k = launch(1, a);
    for (int j = 0; j < k; ++j) EXPECT_NE(out[j].base, 0x30000u);
  }
}

TEST(AccessProfile, CapsAPrefetchAtMaxBytesAndRefusesRangesPastItsCapacity) {
  AccessProfile p(1, /*max_bytes=*/256, /*max_ranges=*/1);
  ASSERT_TRUE(p.AddRange(0x10000, 0x1000));
  EXPECT_FALSE(p.AddRange(0x20000, 0x1000));
  PrefetchRequest out[AccessProfile::kMaxPrefetches];
  uint64_t args[2] = {0x10000, 0x10000};
  EXPECT_EQ(p.OnLaunch(1, args, 1, out), 0);
  EXPECT_EQ(p.OnLaunch(2, args, 1, out), 0);
  EXPECT_EQ(p.OnLaunch(3, args, 1, out), 0);
  EXPECT_EQ(p.OnLaunch(1, args, 1, out), 1);  // k1 -> k2 touched 0x10000
  EXPECT_EQ(out[0].bytes, 256u);
}

const char* Lookup(const std::map<std::string, std::string>& m, const char* name) {
  auto it = m.find(name);
  return it == m.end() ? nullptr : it->second.c_str();
}

TEST(PreloadOptions, ParsesEveryVariableAndNamesTheBadOne) {
  std::map<std::string, std::string> env = {
      {"TIERMEM_PRELOAD_TIMELINE", "/tmp/x-%p.tmt"}, {"TIERMEM_PRELOAD_OFFLOAD", "1"},
      {"TIERMEM_PRELOAD_DEVICE_BUDGET", "16GiB"},    {"TIERMEM_PRELOAD_PREFETCH", "off"},
      {"TIERMEM_PRELOAD_AHEAD", "3"},                {"TIERMEM_PRELOAD_FLUSH_MS", "0"},
      {"TIERMEM_PRELOAD_PREFETCH_MAX", "1MiB"},      {"TIERMEM_PRELOAD_MAX_ALLOCS", "4096"},
      {"TIERMEM_PRELOAD_QUIET", "1"},                {"TIERMEM_PRELOAD_EXCLUSIVE", "1"}};
  auto get = [&](const char* n) { return Lookup(env, n); };
  auto o = ParsePreloadOptions(get);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->timeline_path, "/tmp/x-%p.tmt");
  EXPECT_TRUE(o->offload);
  EXPECT_EQ(o->device_budget, 16 * kGiB);
  EXPECT_FALSE(o->prefetch);
  EXPECT_EQ(o->ahead, 3);
  EXPECT_EQ(o->flush_ms, 0);
  EXPECT_EQ(o->prefetch_max, kMiB);
  EXPECT_EQ(o->max_allocs, 4096u);
  EXPECT_TRUE(o->quiet);
  EXPECT_TRUE(o->exclusive);
  EXPECT_EQ(ExpandPid("/tmp/x-%p.tmt", 42), "/tmp/x-42.tmt");

  env["TIERMEM_PRELOAD_AHEAD"] = "17";
  auto bad = ParsePreloadOptions(get);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("TIERMEM_PRELOAD_AHEAD='17'"), std::string::npos);
  env["TIERMEM_PRELOAD_AHEAD"] = "3";
  env.erase("TIERMEM_PRELOAD_DEVICE_BUDGET");
  auto no_budget = ParsePreloadOptions(get);
  ASSERT_FALSE(no_budget.ok());
  EXPECT_NE(no_budget.status().message().find("needs TIERMEM_PRELOAD_DEVICE_BUDGET"),
            std::string::npos);
}

class LauncherLookup : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("tiermem_lookup_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "bin");
    fs::create_directories(root_ / "lib");
    fs::create_directories(root_ / "build");
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string Touch(const fs::path& p) {
    std::ofstream(p) << "x";
    return p.string();
  }
  fs::path root_;
};

TEST_F(LauncherLookup, LooksInTheDocumentedOrder) {
  const std::string exe = (root_ / "bin" / "tiermem").string();
  const std::string build = Touch(root_ / "build" / "libtiermem_preload.so");
  std::map<std::string, std::string> env;
  auto get = [&](const char* n) { return Lookup(env, n); };
  EXPECT_EQ(*FindPreloadLibrary(get, exe, build), build);  // 4. the build tree
  const std::string lib = Touch(root_ / "lib" / "libtiermem_preload.so");
  EXPECT_EQ(*FindPreloadLibrary(get, exe, build), lib);  // 3. ../lib next to the executable
  const std::string bin = Touch(root_ / "bin" / "libtiermem_preload.so");
  EXPECT_EQ(*FindPreloadLibrary(get, exe, build), bin);  // 2. next to the executable
  const std::string custom = Touch(root_ / "custom.so");
  env["TIERMEM_PRELOAD_LIB"] = custom;
  EXPECT_EQ(*FindPreloadLibrary(get, exe, build), custom);  // 1. the variable
  env["TIERMEM_PRELOAD_LIB"] = (root_ / "missing.so").string();
  auto missing = FindPreloadLibrary(get, exe, build);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing.so' is not a file"), std::string::npos);
  env.clear();
  fs::remove(bin);
  fs::remove(lib);
  fs::remove(build);
  auto none = FindPreloadLibrary(get, exe, build);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find((root_ / "lib" / "libtiermem_preload.so").string()),
            std::string::npos);
}

TEST(LauncherEnvironment, AppendsTheShimToLdPreloadAndSetsTheOptions) {
  RunOptions o;
  o.record_path = "/abs/run.tmt";
  o.offload = true;
  o.device_budget = 16 * kGiB;
  auto env = ChildEnvironment(o, "/x/libtiermem_preload.so",
                              {"PATH=/bin", "LD_PRELOAD=/usr/lib/libjemalloc.so",
                               "TIERMEM_PRELOAD_TIMELINE=/old.tmt", "TIERMEM_PRELOAD_FLUSH_MS=5"});
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  const std::vector<std::string> expected = {
      "PATH=/bin",
      "TIERMEM_PRELOAD_FLUSH_MS=5",
      "LD_PRELOAD=/usr/lib/libjemalloc.so:/x/libtiermem_preload.so",
      "TIERMEM_PRELOAD_TIMELINE=/abs/run.tmt",
      "TIERMEM_PRELOAD_EXCLUSIVE=1",
      "TIERMEM_PRELOAD_OFFLOAD=1",
      "TIERMEM_PRELOAD_DEVICE_BUDGET=17179869184"};
  EXPECT_EQ(*env, expected);
  o.device_budget = 0;
  EXPECT_EQ(ChildEnvironment(o, "/x.so", {}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tiermem::preload
