// CRC32C (Castagnoli), the checksum the NVMe tier keeps per block.
//
// Uses the SSE4.2 crc32 instruction (three interleaved streams for long inputs) when the CPU
// has it, else a slice-by-8 table. Both produce identical values (tested). Thread-safe: pure.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tiermem::nvme {

// CRC32C of `n` bytes continuing from `crc` (0 for a fresh checksum). Standard convention:
// Crc32c("123456789") == 0xE3069283.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// The portable table implementation (exposed so tests can compare it with the hardware one).
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);
// True when Crc32c uses the SSE4.2 instruction.
bool Crc32cHardware();

}  // namespace tiermem::nvme
