// Writing weights in Hugging Face's layout, streamed: the tensors' bytes are handed over in
// order, in pieces of any size, and go to disk as they come — never the whole model in memory.
//
// Layout (what transformers' save_pretrained writes and from_pretrained reads): the entries
// are split into shards greedily in the given order, a shard taking entries while its tensor
// bytes stay within max_shard_bytes (an entry larger than that gets a shard of its own, as
// huggingface_hub does). One shard is `model.safetensors`, without an index; several are
// `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`
// ({"metadata": {"total_parameters", "total_size"}, "weight_map"}, keys sorted). Each shard's
// header carries `__metadata__` {"format": "pt"} and is padded with spaces to 4096 bytes
// (the format allows it), so its tensor bytes start page-aligned and go out with O_DIRECT.
// Within a shard, tensors are laid out by element size, largest first, then in the given
// order — so every tensor is aligned to its element size, as safetensors' own writer does.
//
// Crash safety: each shard is written to `<name>.tmp`, fsync'ed and renamed to its name when
// complete; the index is written last (the same way). A directory's earlier
// `model.safetensors` and index are removed before the first byte is written and its stale
// `model-*-of-*.safetensors` shards after the index, so an export killed at any point leaves
// no set of files that looks whole: without the index (or model.safetensors) a directory is
// not a checkpoint (weight_files.h says so). A writer destroyed before Finish removes its
// temporary file (a failed export); a killed process leaves `*.tmp` files only.
//
// Thread-safety: externally synchronized. Ownership: owns its files until Finish.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "weights/file_writer.h"
#include "weights/safetensors.h"

namespace tiermem::weights {

struct ShardEntry {
  std::string key;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  uint64_t numel() const;
  uint64_t bytes() const;
};

struct ShardLayout {
  struct Shard {
    std::string name;             // file name in the directory
    std::vector<size_t> entries;  // indices into the entries, in data order
    uint64_t bytes = 0;           // tensor bytes
  };
  std::vector<Shard> shards;
};
// The shard split and file names (see the file comment). `max_shard_bytes` 0: one shard.
ShardLayout PlanShards(const std::vector<ShardEntry>& entries, uint64_t max_shard_bytes);

struct ShardWriterOptions {
  uint64_t max_shard_bytes = 5'000'000'000;  // transformers 4's default, "5GB"
  bool direct_io = true;                     // O_DIRECT where the file system allows it
  // `path` is the .safetensors file to write, as one shard whatever its size (no index).
  bool single_file = false;
};

class ShardWriter {
 public:
  // `path`: the directory (created when missing) or, single_file, the file. kInvalidArgument
  // for no entries, a key twice, an empty key; file system errors naming the path.
  static StatusOr<std::unique_ptr<ShardWriter>> Create(const std::string& path,
                                                       std::vector<ShardEntry> entries,
                                                       const ShardWriterOptions& options = {});
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // The entries (indices) in the order their bytes must be Put: shard by shard, data order.
  const std::vector<size_t>& order() const { return order_; }
  const ShardLayout& layout() const { return layout_; }
  const std::vector<ShardEntry>& entries() const { return entries_; }

  // The next `n` bytes of the entries, in order() (an entry's bytes may come in any pieces;
  // a piece may span entries). Crossing the end of a shard commits it and starts the next.
  Status Put(const void* data, size_t n);
  // Put without a copy (FileWriter::Space): room for at most `want` of the next bytes, within
  // the current shard (at least one byte), filled by the caller and then taken with
  // Commit(n), n <= its size. kFailedPrecondition after the last byte or a failure.
  StatusOr<std::span<char>> Space(size_t want);
  Status Commit(size_t n);
  // After the last byte: commits the last shard, writes the index (several shards), removes
  // stale shards. kFailedPrecondition when bytes are missing.
  Status Finish();

 private:
  ShardWriter() = default;
  Status OpenShard();
  Status CommitShard();
  // Commits every complete shard from the current one on, opening the next.
  Status Advance();
  // Closes and removes the temporary file being written, if any.
  void Abandon();

  std::string dir_;     // where the files go
  std::string single_;  // single_file: the file; else ""
  ShardWriterOptions options_;
  std::vector<ShardEntry> entries_;
  ShardLayout layout_;
  std::vector<size_t> order_;
  size_t shard_ = 0;               // the shard being written
  uint64_t shard_left_ = 0;        // its tensor bytes still to come
  uint64_t total_left_ = 0;        // every tensor byte still to come
  std::unique_ptr<FileWriter> w_;  // the shard's temporary file, or null
  std::string tmp_;                // its path
  bool finished_ = false;
};

}  // namespace tiermem::weights
