// Safetensors files (https://huggingface.co/docs/safetensors): the one parser of their header in
// tiermem (pretrained weights, runtime/weights.h; the session's own checkpoints,
// runtime/checkpoint.cc), and the header text a writer puts in front of the tensor bytes.
//
// The layout: u64 N (little-endian) | N bytes of UTF-8 JSON | tensor bytes. The JSON maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end)} (bytes relative to the start
// of the tensor bytes, row-major, little-endian); an optional "__metadata__" maps strings to
// strings. ParseHeader enforces the rules the safetensors library enforces, so a file it
// accepts is one any reader accepts and a torn or crafted one is refused before a byte of it
// is used: N at most kMaxHeaderBytes; valid JSON; no key twice; every dtype known; a tensor's
// byte count equal to numel x element bits / 8 (and a whole number of bytes); offsets
// contiguous from 0 without holes or overlaps; the last tensor ending exactly at the end of
// the file (8 + N + data bytes == file length). A file shorter than its header says is
// kDataLoss (a torn write, a partial download); every other violation kInvalidArgument. Each
// message names the file and, where there is one, the tensor.
//
// Layer: L1 beside tiers/ (it includes base/ only): pure parsing and formatting, no I/O but
// reading the header of a file descriptor it is given.
// Thread-safety: pure functions; a Header is a value.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/status.h"

namespace tiermem::weights {

// The safetensors dtypes (their names in the header are DTypeName's).
enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kF8E8M0,
  kF8E4M3Fnuz,
  kF8E5M2Fnuz,
  kF4,
  kF6E2M3,
  kF6E3M2,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kC64,
  kI64,
  kU64,
};
std::optional<DType> ParseDType(std::string_view name);  // "BF16" -> kBF16
std::string_view DTypeName(DType dtype);                 // kBF16 -> "BF16"
uint32_t DTypeBits(DType dtype);                         // 16 for kBF16, 4 for kF4

// safetensors' own limit on N (its HeaderTooLarge).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string key;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;  // empty: a scalar (numel 1)
  uint64_t numel = 1;
  uint64_t begin = 0;  // data_offsets, bytes from the start of the tensor bytes
  uint64_t end = 0;
  uint64_t bytes() const { return end - begin; }
};

// A validated header.
struct Header {
  std::string path;  // the file, for messages
  uint64_t file_bytes = 0;
  uint64_t data_start = 0;          // 8 + N: file offset of the tensor bytes
  std::vector<TensorInfo> tensors;  // in data order (by begin)
  std::map<std::string, std::string> metadata;
  // The tensor named `key`, or nullptr.
  const TensorInfo* Find(std::string_view key) const;

  std::unordered_map<std::string, size_t> by_key;  // key -> index in tensors
};

// Reads u64 N and the N bytes of header text from `fd`, and the file's length into
// *file_bytes. kInvalidArgument: fewer than 8 bytes, N of 0 or above kMaxHeaderBytes;
// kDataLoss: a file shorter than 8 + N; kIOError for read errors. `path` is for messages.
StatusOr<std::string> ReadHeaderText(int fd, std::string_view path, uint64_t* file_bytes);
// Parses and validates `text` (see the file comment) of a file of `file_bytes` bytes.
StatusOr<Header> ParseHeader(std::string_view path, std::string_view text, uint64_t file_bytes);
// ReadHeaderText and ParseHeader of the file at `path` (kNotFound when it is missing).
StatusOr<Header> ReadHeader(const std::string& path);

// The header text of `tensors` (their offsets as given) and `metadata` (none when empty),
// padded with spaces — which the format allows — so that 8 + the text ends on a multiple of
// `align` (8 at least, safetensors' rule: the tensor bytes start 8-aligned; 4096 puts them on
// a page boundary, which O_DIRECT writes and reads need). Keys appear sorted.
std::string HeaderText(const std::vector<TensorInfo>& tensors,
                       const std::map<std::string, std::string>& metadata, uint64_t align);

}  // namespace tiermem::weights
