// SimDevice: host memory posing as GPU HBM.
//
// It has what the engine cares about in a device: a byte budget, an allocation alignment, and
// copy lanes with an optional bandwidth/latency model, so timing-dependent behaviour (late
// prefetches, stalls, overlap) is testable without a GPU. Region addresses are ordinary host
// pointers, so a CPU-only run computes directly on "device" memory.
//
// Copies run on two lanes (host->device and device->host), one worker thread each, like the
// two copy engines of a GPU: copies on one lane complete in submission order; the two lanes
// run concurrently. With a bandwidth model a copy of n bytes takes at least
// latency + n / bandwidth of wall time.
//
// Threading: thread-safe. Completions fire on the lane threads.
#pragma once

#include <memory>

#include "tiers/tier.h"

namespace tiermem {

struct SimDeviceConfig {
  Bytes capacity = 2 * kGiB;
  Bytes alignment = 256;           // region sizes are rounded up to this (like cudaMalloc)
  double h2d_bytes_per_s = 0;      // 0 = as fast as memcpy
  double d2h_bytes_per_s = 0;      // 0 = as fast as memcpy
  uint64_t copy_latency_ns = 0;    // added to each copy
};

// Caller owns the result.
std::unique_ptr<Tier> NewSimDevice(const SimDeviceConfig& config);

}  // namespace tiermem
