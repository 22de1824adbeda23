// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and leveldb.
// Checksums the timeline's blocks. Uses the SSE4.2 crc32 instruction when the CPU has it
// (checked once at run time) and a slice-by-8 table otherwise; both give identical results.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tiermem {

// Extends `crc` (the value returned for the preceding bytes; 0 for none) over `data[0, n)`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

namespace internal {
// The portable slice-by-8 path, exposed so tests can compare it with the hardware path.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);
bool Crc32cHardwareAvailable();
}  // namespace internal

}  // namespace tiermem
