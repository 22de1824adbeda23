// On a GPU machine (label `gpu`; skips without a GPU or without torch): a PyTorch training
// script (gpu_train.py) under `tiermem run`.
//  - --record: the recorded device peak equals torch.cuda.max_memory_reserved() within 2 MiB.
//  - --offload with a budget of half that peak: the script completes with the same losses.
//    Step times with profile-driven prefetch and with plain unified memory (prefetch off) are
//    compared with the run without offload and written to $TIERMEM_GPU_RESULTS (JSON) when set,
//    for docs/benchmarks.md.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <numeric>

#include "tests/integrations/preload/preload_support.h"

namespace tiermem::preload::testing {
namespace {

std::string Script() { return TestSourceDir() + "/tests/integrations/preload/gpu_train.py"; }

std::string Python() {
  const char* p = std::getenv("TIERMEM_PY");
  return p != nullptr ? p : "python3";
}

bool HaveGpuAndTorch() {
  return RunShell("nvidia-smi -L").code == 0 &&
         RunShell(Python() + " -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'").code == 0;
}

nlohmann::json LastJsonLine(const std::string& out) {
  const size_t start = out.rfind("{\"max_memory_reserved\"");
  if (start == std::string::npos) return nullptr;
  return nlohmann::json::parse(out.substr(start, out.find('\n', start) - start));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

TEST(PreloadGpu, RecordsTorchsPeakAndOffloadsHalfOfItWithTheSameLosses) {
  if (!HaveGpuAndTorch()) GTEST_SKIP() << "needs a GPU and torch";
  const std::string dir = ScratchDir();
  const std::string cli = TestCli();
  Output base = RunShell(cli + " run --record " + dir + "/base.tmt -- " + Python() + " " + Script());
  ASSERT_EQ(base.code, 0) << base.out;
  nlohmann::json b = LastJsonLine(base.out);
  ASSERT_FALSE(b.is_null()) << base.out;
  nlohmann::json r = ProfReport(dir + "/base.tmt");
  ASSERT_FALSE(r.is_null());
  const int64_t reserved = b["max_memory_reserved"].get<int64_t>();
  const int64_t peak = r["tiers"]["device"]["peak"]["bytes"].get<int64_t>();
  EXPECT_LE(std::llabs(peak - reserved), 2 << 20) << "recorded " << peak << ", torch " << reserved;

  const std::string budget = std::to_string(peak / 2);
  Output off = RunShell(cli + " run --record " + dir + "/offload.tmt --offload --device-budget " + budget +
                   " -- " + Python() + " " + Script());
  ASSERT_EQ(off.code, 0) << off.out;
  EXPECT_NE(off.out.find("served from managed memory"), std::string::npos) << off.out;
  nlohmann::json o = LastJsonLine(off.out);
  ASSERT_FALSE(o.is_null()) << off.out;
  ASSERT_EQ(o["losses"].size(), b["losses"].size());
  for (size_t i = 0; i < b["losses"].size(); ++i) {
    const double x = b["losses"][i], y = o["losses"][i];
    EXPECT_NEAR(x, y, 1e-6 * std::fabs(x)) << "step " << i;
  }
  Output um = RunShell("TIERMEM_PRELOAD_PREFETCH=off " + cli + " run --record " + dir +
                  "/um.tmt --offload --device-budget " + budget + " -- " + Python() + " " + Script());
  ASSERT_EQ(um.code, 0) << um.out;
  nlohmann::json u = LastJsonLine(um.out);
  ASSERT_FALSE(u.is_null()) << um.out;

  const double t_base = Median(b["step_s"]), t_off = Median(o["step_s"]), t_um = Median(u["step_s"]);
  nlohmann::json result = {{"peak_bytes", peak},
                           {"max_memory_reserved", reserved},
                           {"budget_bytes", peak / 2},
                           {"step_s_no_offload", t_base},
                           {"step_s_offload_profile_prefetch", t_off},
                           {"step_s_offload_plain_um", t_um},
                           {"ratio_offload_vs_no_offload", t_off / t_base},
                           {"ratio_offload_vs_plain_um", t_off / t_um}};
  std::printf("%s\n", result.dump(2).c_str());
  if (const char* path = std::getenv("TIERMEM_GPU_RESULTS")) std::ofstream(path) << result.dump(2);
}

}  // namespace
}  // namespace tiermem::preload::testing
