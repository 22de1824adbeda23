// TIERMEM_REQUIRE_GPU(): the first statement of a test that needs a CUDA device (CTest label
// `gpu`). It skips only when the runtime says there is none — no device or no driver, which
// tiers/cuda's CudaDeviceCount() reports as kUnavailable — and fails on any other probe error,
// so a broken CUDA set-up on a GPU machine shows as a failure, never as a skip. A test that
// then cannot create what it needs (a tier, a buffer) must fail: ASSERT on it.
// Needs tiermem::tiers_cuda linked.
#pragma once

#include <gtest/gtest.h>

#include "base/status.h"
#include "tiers/cuda/cuda_tier.h"

#define TIERMEM_REQUIRE_GPU()                                                          \
  do {                                                                                 \
    const ::tiermem::StatusOr<int> tiermem_gpus = ::tiermem::CudaDeviceCount();        \
    if (!tiermem_gpus.ok()) {                                                          \
      if (tiermem_gpus.status().code() == ::tiermem::StatusCode::kUnavailable) {       \
        GTEST_SKIP() << tiermem_gpus.status().message();                               \
      }                                                                                \
      FAIL() << "probing for a CUDA device: " << tiermem_gpus.status().ToString();     \
    }                                                                                  \
  } while (0)
