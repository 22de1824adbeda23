// ComputeHarness over a CUDA stream (tiny kernels: a spin on %globaltimer for the delay, then a
// fill or a copy), for the ordering cases of the conformance suite on the CUDA tier. No CUDA
// types here. nullptr without a GPU.
#pragma once

#include <memory>

#include "tests/tiers/ordering_scenarios.h"

namespace tiermem::testing {

std::unique_ptr<ComputeHarness> NewCudaComputeHarness();

}  // namespace tiermem::testing
