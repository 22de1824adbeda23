// Units and ids shared by every layer: byte counts, tier kinds, data categories, chunk ids,
// and the parsing/printing of human sizes ("16GiB", "512MiB", "1.5G", "4096").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace tiermem {

using Bytes = uint64_t;

inline constexpr Bytes kKiB = 1024;
inline constexpr Bytes kMiB = 1024 * kKiB;
inline constexpr Bytes kGiB = 1024 * kMiB;
inline constexpr Bytes kTiB = 1024 * kGiB;

// Storage tiers, fastest first. The numeric values are part of the timeline format.
enum class TierKind : uint8_t {
  kDevice = 0,  // GPU HBM, or SimDevice posing as it
  kHost = 1,    // (pinned) host DRAM
  kNvme = 2,    // file-backed NVMe
  kNone = 255,
};
inline constexpr int kNumTierKinds = 3;
std::string_view TierKindName(TierKind kind);  // "device", "host", "nvme", "none"
StatusOr<TierKind> ParseTierKind(std::string_view name);

// What the bytes are. The numeric values are part of the timeline format.
enum class Category : uint8_t {
  kParam = 0,
  kGrad = 1,
  kOptimState = 2,
  kActivation = 3,
  kOther = 4,
};
inline constexpr int kNumCategories = 5;
std::string_view CategoryName(Category c);  // "param", "grad", "optim_state", "activation", "other"

// Identifies a chunk within one engine. kNoChunk means "not chunk data".
using ChunkId = uint32_t;
inline constexpr ChunkId kNoChunk = 0xffffffffu;

// Parses "4096", "4k", "4KiB", "4KB" (=4000), "1.5GiB", "16G" (=GiB). Case-insensitive.
// Binary units for K/M/G/T and KiB/MiB/GiB/TiB, decimal for KB/MB/GB/TB.
StatusOr<Bytes> ParseBytes(std::string_view text);
// "1.50 GiB", "512.00 MiB", "123 B".
std::string FormatBytes(Bytes n);

inline constexpr Bytes AlignUp(Bytes n, Bytes align) { return (n + align - 1) / align * align; }

}  // namespace tiermem
