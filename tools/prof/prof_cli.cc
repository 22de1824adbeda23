// Placeholder: replaced by `tiermem prof` (see tools/commands.h).
#include "tools/commands.h"

namespace tiermem::tools {
void RegisterProf(CLI::App& app) { (void)app; }
}  // namespace tiermem::tools
