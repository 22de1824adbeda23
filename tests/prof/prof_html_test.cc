// The HTML timeline opened in headless Chromium: the DOM (after the page's JS ran) carries one
// chart per tier with the expected series and the exact peak labels; no console errors; a
// screenshot is saved under test_output/. Skips when chromium is not installed.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "tests/prof/golden_timeline.h"
#include "tests/support/paths.h"
#include "prof/html.h"
#include "prof/synthetic.h"

namespace tiermem::prof {
namespace {

std::string FindChromium() {
  for (const char* p : {"/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"}) {
    if (std::filesystem::exists(p)) return p;
  }
  return "";
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class HtmlChromiumTest : public ::testing::Test {
 protected:
  void SetUp() override {
    chromium_ = FindChromium();
    if (chromium_.empty()) GTEST_SKIP() << "chromium is not installed";
    out_dir_ = ::tiermem::testing::TestEnv("TIERMEM_TEST_OUTPUT_DIR");
    std::filesystem::create_directories(out_dir_);
  }
  // Runs chromium headless on file://html; returns its exit status.
  int Chromium(const std::string& html, const std::string& args, const std::string& stdout_path,
               const std::string& stderr_path) {
    const std::string cmd = "timeout 120 " + chromium_ +
                            " --headless --disable-gpu --no-sandbox --no-first-run"
                            // One profile per test: ctest -j runs tests concurrently and
                            // Chromium refuses a profile another instance holds (exit 21).
                            " --user-data-dir=" + out_dir_ + "/chromium-profile-" +
                            ::testing::UnitTest::GetInstance()->current_test_info()->name() +
                            " --enable-logging=stderr --v=0 --window-size=1400,1100 " +
                            args + " file://" + html + " >" + stdout_path + " 2>" + stderr_path;
    return std::system(cmd.c_str());
  }
  std::string chromium_, out_dir_;
};

TEST_F(HtmlChromiumTest, GoldenTimelineRendersChartsSeriesAndPeaks) {
  const std::string tmt = out_dir_ + "/golden.tmt", html = out_dir_ + "/golden.html";
  testing::WriteGoldenTimeline(tmt);
  ASSERT_TRUE(RenderHtml(tmt, html).ok());
  const std::string page = ReadAll(html);
  EXPECT_EQ(page.find("http://"), page.find("http://www.w3.org/2000/svg"));  // no network
  EXPECT_EQ(page.find("https://"), std::string::npos);

  ASSERT_EQ(Chromium(html, "--dump-dom", out_dir_ + "/golden.dom.html", out_dir_ + "/golden.dom.log"), 0);
  const std::string dom = ReadAll(out_dir_ + "/golden.dom.html");
  const std::string log = ReadAll(out_dir_ + "/golden.dom.log");
  EXPECT_EQ(log.find("Uncaught"), std::string::npos) << log;
  EXPECT_EQ(log.find("ERROR:CONSOLE"), std::string::npos) << log;
  EXPECT_NE(dom.find("data-rendered=\"1\""), std::string::npos) << "the page's script did not finish";
  for (const char* tier : {"device", "host", "nvme"}) {
    EXPECT_NE(dom.find(std::string("id=\"chart-") + tier + "\""), std::string::npos) << tier;
  }
  EXPECT_NE(dom.find("data-series=\"param,grad,optim_state,activation,other\""), std::string::npos);
  for (const char* series : {"param", "grad", "optim_state", "activation", "other"}) {
    EXPECT_NE(dom.find(std::string("class=\"series\" data-series=\"") + series + "\""),
              std::string::npos)
        << series;
  }
  // Exact peak labels (20 MiB on the device at 3 us in layer1, 30 MiB on the host).
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dom, m, std::regex(R"(<text[^>]*class="peak-label"[^>]*data-tier="device"[^>]*>([^<]*)<)")));
  EXPECT_NE(m.str(0).find("data-bytes=\"20971520\""), std::string::npos) << m.str(0);
  EXPECT_EQ(m.str(1), "peak 20.00 MiB at 3.00 us \u2014 layer1.pre-forward (forward)");
  ASSERT_TRUE(std::regex_search(dom, m, std::regex(R"(<text[^>]*class="peak-label"[^>]*data-tier="host"[^>]*>([^<]*)<)")));
  EXPECT_NE(m.str(1).find("peak 30.00 MiB"), std::string::npos) << m.str(1);
  EXPECT_NE(dom.find("class=\"budget\" data-budget-bytes=\"104857600\""), std::string::npos);
  EXPECT_NE(dom.find("class=\"stall\" data-cause=\"prefetch late\""), std::string::npos);
  EXPECT_NE(dom.find("data-kind=\"host-&gt;device\""), std::string::npos);  // a copy span

  const std::string png = out_dir_ + "/golden.png";
  std::filesystem::remove(png);
  ASSERT_EQ(Chromium(html, "--screenshot=" + png, out_dir_ + "/golden.shot.out", out_dir_ + "/golden.shot.log"), 0);
  ASSERT_TRUE(std::filesystem::exists(png));
  EXPECT_GT(std::filesystem::file_size(png), 10000u);
}

TEST_F(HtmlChromiumTest, LargeRunIsDownsampledWithExactPeaks) {
  const std::string tmt = out_dir_ + "/synth.tmt", html = out_dir_ + "/synth.html";
  ASSERT_TRUE(WriteSyntheticTimeline(tmt, {.min_events = 200000}).ok());
  ASSERT_TRUE(RenderHtml(tmt, html, {.buckets = 500}).ok());
  EXPECT_LT(std::filesystem::file_size(html), std::filesystem::file_size(tmt));
  ASSERT_EQ(Chromium(html, "--dump-dom", out_dir_ + "/synth.dom.html", out_dir_ + "/synth.dom.log"), 0);
  const std::string dom = ReadAll(out_dir_ + "/synth.dom.html");
  EXPECT_EQ(ReadAll(out_dir_ + "/synth.dom.log").find("Uncaught"), std::string::npos);
  // The device peak of the synthetic run: 10 x 64 MiB params + 64 MiB grad + 352 MiB activations.
  EXPECT_NE(dom.find("data-tier=\"device\" data-bytes=\"1107296256\""), std::string::npos);
  EXPECT_NE(dom.find("data-rendered=\"1\""), std::string::npos);
}

}  // namespace
}  // namespace tiermem::prof
