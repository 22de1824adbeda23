// ComputeHarness over a SimStream: SimDevice's compute stream for the ordering scenarios.
#pragma once

#include <chrono>
#include <cstring>
#include <thread>

#include "tests/tiers/ordering_scenarios.h"
#include "tiers/fake/sim_stream.h"

namespace tiermem::testing {

class SimComputeHarness final : public ComputeHarness {
 public:
  ComputeStream stream() override { return stream_.handle(); }
  void Fill(void* dst, Bytes n, uint8_t value, uint64_t delay_us) override {
    stream_.Enqueue([=] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      std::memset(dst, value, n);
    });
  }
  void CopyWithin(void* dst, const void* src, Bytes n, uint64_t delay_us) override {
    stream_.Enqueue([=] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      std::memcpy(dst, src, n);
    });
  }
  Status Synchronize() override { return stream_.Synchronize(); }

 private:
  SimStream stream_;
};

}  // namespace tiermem::testing
