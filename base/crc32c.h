// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and leveldb.
// Checksums the timeline's blocks and the NVMe tier's 4 KiB blocks.
//
// Uses AVX-512 VPCLMULQDQ folding for long inputs where the CPU has it, else the SSE4.2 crc32
// instruction (three interleaved streams for long inputs), else a slice-by-8 table. All
// produce identical values (tested). Thread-safe: pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tiermem {

// CRC32C of `n` bytes continuing from `crc` (0 for a fresh checksum; pass the previous result
// to extend over following bytes). Crc32c("123456789", 9) == 0xE3069283.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// The portable table implementation (exposed so tests can compare it with the hardware one).
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);
// The SSE4.2 implementation (the table one where the CPU lacks SSE4.2), for tests.
uint32_t Crc32cSse42(const void* data, size_t n, uint32_t crc = 0);
// Which implementation Crc32c uses for long inputs: "vpclmulqdq", "sse4.2" or "table".
std::string_view Crc32cVariant();

}  // namespace tiermem
