// Helpers the CPU kernel tests share: float bits, restoring the ISA, the ISAs this CPU runs.
#pragma once

#include <bit>
#include <cstdint>
#include <vector>

#include "kernels/cpu/optim.h"

namespace tiermem::kernels {

inline uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

// Restores the ISA chosen at start-up after each test.
class IsaGuard {
 public:
  IsaGuard() : saved_(KernelIsa()) {}
  ~IsaGuard() { SetKernelIsa(saved_).IgnoreError(); }

 private:
  Isa saved_;
};

inline std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out{Isa::kScalar};
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    IsaGuard guard;
    if (SetKernelIsa(isa).ok()) out.push_back(isa);
  }
  return out;
}

}  // namespace tiermem::kernels
