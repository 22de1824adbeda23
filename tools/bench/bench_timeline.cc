// Placeholder: replaced by the real benchmark (see tools/commands.h).
#include "tools/commands.h"

namespace tiermem::tools {
void RegisterBenchTimeline(CLI::App& bench) { (void)bench; }
}  // namespace tiermem::tools
