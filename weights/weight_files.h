// A set of pretrained weights on disk, as users bring them: one safetensors file, or a Hugging
// Face checkpoint directory — `model.safetensors` alone, or `model.safetensors.index.json`
// (its `weight_map` from tensor name to shard file, its `metadata.total_size`) with the shards
// it names. OpenWeights reads and validates every header (safetensors.h) and the index against
// the shards before anything is loaded: a shard the index names but the directory lacks, a
// tensor in two shards, a tensor the index maps to a shard that does not hold it, a shard
// tensor the index does not list, a shard file outside the directory, a malformed or torn
// shard — each kInvalidArgument naming the file (and the tensor); a path that does not exist is
// kNotFound. A directory with both files is read as transformers reads it: model.safetensors.
// Only headers are read: a few MB however large the checkpoint.
//
// Thread-safety: pure functions; WeightFiles is a value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "weights/safetensors.h"

namespace tiermem::weights {

inline constexpr char kSingleFileName[] = "model.safetensors";
inline constexpr char kIndexFileName[] = "model.safetensors.index.json";

struct WeightFiles {
  std::string path;        // as given: the file or the directory
  std::string index_path;  // the index file, "" without one
  std::vector<Header> files;
  uint64_t total_size = 0;  // bytes of every tensor (the index's metadata.total_size when given)

  struct Location {
    uint32_t file = 0;    // in files
    uint32_t tensor = 0;  // in files[file].tensors
  };
  std::unordered_map<std::string, Location> keys;

  // The tensor named `key` (nullptr when none) and, when `file` is given, its file's index.
  const TensorInfo* Find(std::string_view key, uint32_t* file = nullptr) const;
  // Every tensor name, sorted.
  std::vector<std::string> Keys() const;
  // "model-00002-of-00003.safetensors" style name of the file holding `key`, for messages.
  const std::string& FileOf(std::string_view key) const;
};

// The parsed index: its weight_map and metadata.total_size.
struct WeightIndex {
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor -> shard, sorted
  std::optional<uint64_t> total_size;
};
// Parses an index's text (`path` for messages): kInvalidArgument for anything malformed, a
// shard name that leaves the directory ("a/b", "..") included.
StatusOr<WeightIndex> ParseIndex(std::string_view path, std::string_view text);

// Opens `path` (see the file comment).
StatusOr<WeightFiles> OpenWeights(const std::string& path);

// The bytes of one tensor (for small tensors: a module's buffers). kInvalidArgument when
// `files` has no `key`; read errors naming the file.
StatusOr<std::string> ReadTensorBytes(const WeightFiles& files, std::string_view key);

}  // namespace tiermem::weights
