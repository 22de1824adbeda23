// tiermem: the command-line tool. Subcommands are registered by the library-side functions
// declared in tools/commands.h.
#include <CLI/CLI.hpp>

#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"tiermem: heterogeneous memory-offload runtime tools"};
  app.require_subcommand(1);
  CLI::App* bench = app.add_subcommand("bench", "measure tiermem against baselines in one run");
  bench->require_subcommand(1);
  tiermem::tools::RegisterBenchNvme(*bench);
  tiermem::tools::RegisterBenchCopy(*bench);
  tiermem::tools::RegisterBenchTimeline(*bench);
  tiermem::tools::RegisterBenchAdam(*bench);
  tiermem::tools::RegisterBenchBounce(*bench);
  tiermem::tools::RegisterProf(app);
  tiermem::tools::RegisterRun(app);
  tiermem::tools::RegisterPlan(app);
  tiermem::tools::RegisterFloor(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
