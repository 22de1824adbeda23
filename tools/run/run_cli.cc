// `tiermem run [--record PATH] [--offload --device-budget SIZE] [--per-tensor] -- CMD ...`:
// runs an unmodified CUDA program under libtiermem_preload.so (docs/preload.md). A thin CLI
// over tiermem::preload::RunWithPreload (integrations/preload/launcher.h); the exit code is the
// command's (128 + N if signal N killed it).
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "base/units.h"
#include "integrations/preload/launcher.h"
#include "tools/commands.h"

namespace tiermem::tools {

void RegisterRun(CLI::App& app) {
  auto opts = std::make_shared<preload::RunOptions>();
  auto budget = std::make_shared<std::string>();
  CLI::App* run = app.add_subcommand(
      "run",
      "tiermem run [OPTIONS] -- CMD [ARGS...]: run a CUDA program under the preload "
      "shim: record its memory timeline, optionally oversubscribe device memory");
  run->add_option("--record", opts->record_path,
                  "timeline file (default tiermem-run.tmt; other processes of the job write "
                  "<stem>.<pid>.tmt)");
  run->add_flag("--offload", opts->offload,
                "serve device allocations past --device-budget from managed memory, with "
                "profile-driven prefetch");
  run->add_option("--device-budget", *budget, "device budget for --offload (e.g. 16GiB)");
  run->add_flag("--per-tensor", opts->per_tensor,
                "PyTorch: PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, so allocations are "
                "per tensor, not per cached segment");
  // After "--" CLI11 hands every argument to the positional, unparsed and in order. Without
  // "--", an option-like argument of the command would be taken apart (prefix_command() leaves
  // it in remaining(), out of order): that is refused with a pointer to "--".
  run->add_option("command", opts->command, "the command and its arguments, after --");
  run->prefix_command();
  run->callback([opts, budget, run] {
    for (const std::string& extra : run->remaining()) {
      if (extra == "--") continue;
      std::cerr << "tiermem run: '" << extra << "': put the command after -- "
                << "(tiermem run [OPTIONS] -- CMD [ARGS...])\n";
      throw CLI::RuntimeError(2);
    }
    if (opts->command.empty()) {
      std::cerr << "tiermem run: no command (tiermem run [OPTIONS] -- CMD [ARGS...])\n";
      throw CLI::RuntimeError(2);
    }
    if (!budget->empty()) {
      auto b = ParseBytes(*budget);
      if (!b.ok()) {
        std::cerr << "tiermem run: --device-budget '" << *budget << "': " << b.status().message()
                  << "\n";
        throw CLI::RuntimeError(2);
      }
      opts->device_budget = *b;
    }
    auto code = preload::RunWithPreload(*opts);
    if (!code.ok()) {
      std::cerr << code.status().ToString() << "\n";
      throw CLI::RuntimeError(code.status().code() == StatusCode::kInvalidArgument ? 2 : 127);
    }
    if (*code != 0) throw CLI::RuntimeError(*code);
  });
}

}  // namespace tiermem::tools
