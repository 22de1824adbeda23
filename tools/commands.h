// The `tiermem` CLI is a thin main over library functions. Each command family registers its
// subcommands on the app here; main.cc calls every Register function explicitly.
#pragma once

#include <CLI/CLI.hpp>

namespace tiermem::tools {

// `tiermem bench <what>`: one function per benchmark, each in tools/bench/bench_<what>.cc.
void RegisterBenchNvme(CLI::App& bench);      // NVMe tier vs fio
void RegisterBenchCopy(CLI::App& bench);      // host<->SimDevice vs memcpy
void RegisterBenchTimeline(CLI::App& bench);  // timeline recorder events/s
void RegisterBenchAdam(CLI::App& bench);      // CPU optimizer kernels vs roofline and torch
void RegisterBenchBounce(CLI::App& bench);    // lone device<->NVMe moves vs streaming

// `tiermem prof report|html|export|diff` (tools/prof/).
void RegisterProf(CLI::App& app);

// `tiermem run [--record] [--offload --device-budget] [--per-tensor] -- CMD` (tools/run/).
void RegisterRun(CLI::App& app);
// `tiermem plan simulate|compare|show|synth|bench-builder` (tools/plan/).
void RegisterPlan(CLI::App& app);
// `tiermem floor --layers --hidden --intermediate --vocab ...` (tools/floor/).
void RegisterFloor(CLI::App& app);

}  // namespace tiermem::tools
