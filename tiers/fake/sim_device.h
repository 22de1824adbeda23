// SimDevice: host memory posing as GPU HBM.
//
// It has what the engine cares about in a device: a byte budget, an allocation alignment, and
// copy lanes with an optional bandwidth/latency model, so timing-dependent behaviour (late
// prefetches, stalls, overlap) is testable without a GPU. Region addresses are ordinary host
// pointers, so a CPU-only run computes directly on "device" memory.
//
// Copies run on two lanes (host->device and device->host), like the two copy engines of a GPU.
// By default each lane is one worker thread: copies on one lane complete in submission order;
// the two lanes run concurrently. With a bandwidth model a copy of n bytes takes at least
// latency + n / bandwidth of wall time.
//
// Ordering against compute (tiers/tier.h): SimDevice implements ComputeOrdering exactly as the
// CUDA tier does, with SimStream (sim_stream.h) as the compute stream: a copy waits, on its
// lane thread, for the last compute use of its region and for the fences its memory inherited
// from freed regions; ComputeWaits enqueues a wait for the region's copies in on the stream
// (or, for kHostStream, blocks the caller until they landed). Freed memory with compute still
// pending is neither reused without its fence nor given back to the heap until the compute
// ran.
//
// Asynchronous mode (`async`; config device_kind "sim-async"): adversarial timing for tests.
// Each lane runs copies on several threads, each after a random delay, so copies land late and
// complete out of submission order; together with a SimStream's delay (device work that runs
// after the host has moved on), a missing wait in the engine or a binding produces wrong
// numbers on a CPU. `drop_waits_for_test` removes one kind of wait, so a test can prove that
// it notices.
//
// Threading: thread-safe. Completions fire on the lane threads.
#pragma once

#include <memory>

#include "tiers/tier.h"

namespace tiermem {

// Bits of SimDeviceConfig::drop_waits_for_test.
enum SimDropWait : uint32_t {
  kDropCopyAfterCompute = 1,  // copies ignore compute uses and inherited fences
  kDropComputeAfterCopy = 2,  // ComputeWaits does nothing
};

struct SimDeviceConfig {
  Bytes capacity = 2 * kGiB;
  Bytes alignment = 256;         // region sizes are rounded up to this (like cudaMalloc)
  double h2d_bytes_per_s = 0;    // 0 = as fast as memcpy
  double d2h_bytes_per_s = 0;    // 0 = as fast as memcpy
  uint64_t copy_latency_ns = 0;  // added to each copy
  // Asynchronous mode: `async_lane_threads` threads per lane, each copy delayed by a random
  // async_min_delay_ns..async_max_delay_ns (seeded) before its bytes move.
  bool async = false;
  int async_lane_threads = 3;
  uint64_t async_min_delay_ns = 0;
  uint64_t async_max_delay_ns = 300'000;
  uint64_t async_seed = 1;
  uint32_t drop_waits_for_test = 0;  // SimDropWait bits; tests of the tests only
};

// Caller owns the result.
std::unique_ptr<Tier> NewSimDevice(const SimDeviceConfig& config);

}  // namespace tiermem
