// `tiermem prof report|html|export|diff`: a thin CLI over tiermem::prof (prof).
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "prof/analysis.h"
#include "prof/html.h"
#include "prof/perfetto.h"
#include "prof/render.h"
#include "prof/synthetic.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

struct ProfArgs {
  std::string input, input_b, output, format = "perfetto";
  uint64_t events = 100000;
  bool json = false;
};

[[noreturn]] void Fail(const Status& s) {
  std::cerr << "tiermem prof: " << s.ToString() << "\n";
  throw CLI::RuntimeError(s.code() == StatusCode::kInvalidArgument ? 2 : 1);
}

void Report(const ProfArgs& a) {
  auto r = prof::AnalyzeFile(a.input);
  if (!r.ok()) Fail(r.status());
  if (a.json) {
    std::cout << prof::ReportToJson(*r).dump(2) << "\n";
  } else {
    std::cout << prof::RenderReportText(*r, a.input);
  }
}

void Diff(const ProfArgs& a) {
  auto ra = prof::AnalyzeFile(a.input);
  if (!ra.ok()) Fail(ra.status());
  auto rb = prof::AnalyzeFile(a.input_b);
  if (!rb.ok()) Fail(rb.status());
  if (a.json) {
    std::cout << prof::DiffToJson(*ra, *rb).dump(2) << "\n";
  } else {
    std::cout << prof::RenderDiffText(*ra, *rb, a.input, a.input_b);
  }
}

}  // namespace

void RegisterProf(CLI::App& app) {
  auto args = std::make_shared<ProfArgs>();
  CLI::App* prof = app.add_subcommand("prof", "analyse a memory timeline (.tmt)");
  prof->require_subcommand(1);

  CLI::App* report = prof->add_subcommand("report", "peaks, averages, moves, stalls, phases");
  report->add_option("timeline", args->input, "timeline file")->required();
  report->add_flag("--json", args->json, "print JSON");
  report->callback([args] { Report(*args); });

  CLI::App* html = prof->add_subcommand("html", "self-contained interactive HTML timeline");
  html->add_option("timeline", args->input, "timeline file")->required();
  html->add_option("-o,--output", args->output, "output .html")->required();
  html->callback([args] {
    Status s = prof::RenderHtml(args->input, args->output);
    if (!s.ok()) Fail(s);
  });

  CLI::App* exp = prof->add_subcommand("export", "Chrome Trace Event JSON (Perfetto)");
  exp->add_option("timeline", args->input, "timeline file")->required();
  exp->add_option("--format", args->format, "output format")->check(CLI::IsMember({"perfetto"}));
  exp->add_option("-o,--output", args->output, "output .json")->required();
  exp->callback([args] {
    Status s = prof::ExportPerfetto(args->input, args->output);
    if (!s.ok()) Fail(s);
  });

  CLI::App* diff = prof->add_subcommand("diff", "compare two runs side by side");
  diff->add_option("a", args->input, "baseline timeline")->required();
  diff->add_option("b", args->input_b, "new timeline")->required();
  diff->add_flag("--json", args->json, "print JSON");
  diff->callback([args] { Diff(*args); });

  CLI::App* synth = prof->add_subcommand(
      "synth", "write a synthetic training-run timeline (demos, scale checks)");
  synth->add_option("-o,--output", args->output, "output .tmt")->required();
  synth->add_option("--events", args->events, "at least this many events")
      ->check(CLI::PositiveNumber);
  synth->callback([args] {
    auto n = prof::WriteSyntheticTimeline(args->output, {.min_events = args->events});
    if (!n.ok()) Fail(n.status());
    std::cout << "wrote " << *n << " events to " << args->output << "\n";
  });
}

}  // namespace tiermem::tools
