// ShardWriter (see shard_writer.h for the layout and the crash-safety rules).
#include "weights/shard_writer.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "base/fs.h"
#include "weights/weight_files.h"

namespace tiermem::weights {
namespace {

constexpr uint64_t kHeaderAlign = 4096;  // tensor bytes start page-aligned

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string ShardName(size_t k, size_t n) {
  char b[64];
  std::snprintf(b, sizeof(b), "model-%05zu-of-%05zu.safetensors", k, n);
  return b;
}

// "model-00001-of-00003.safetensors" and the like (any widths of digits).
bool IsShardName(const std::string& name) {
  unsigned a = 0, b = 0;
  int used = 0;
  return std::sscanf(name.c_str(), "model-%u-of-%u.safetensors%n", &a, &b, &used) == 2 &&
         static_cast<size_t>(used) == name.size();
}

Status RemoveIfPresent(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoToStatus(errno, "removing " + path);
  }
  return OkStatus();
}

}  // namespace

uint64_t ShardEntry::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t ShardEntry::bytes() const { return numel() * DTypeBits(dtype) / 8; }

ShardLayout PlanShards(const std::vector<ShardEntry>& entries, uint64_t max_shard_bytes) {
  ShardLayout out;
  for (size_t i = 0; i < entries.size(); ++i) {
    const uint64_t b = entries[i].bytes();
    if (out.shards.empty() || (max_shard_bytes > 0 && !out.shards.back().entries.empty() &&
                               out.shards.back().bytes + b > max_shard_bytes)) {
      out.shards.emplace_back();
    }
    out.shards.back().entries.push_back(i);
    out.shards.back().bytes += b;
  }
  for (ShardLayout::Shard& s : out.shards) {  // data order: element size, largest first
    std::stable_sort(s.entries.begin(), s.entries.end(), [&](size_t a, size_t b) {
      return DTypeBits(entries[a].dtype) > DTypeBits(entries[b].dtype);
    });
  }
  const size_t n = out.shards.size();
  for (size_t k = 0; k < n; ++k) {
    out.shards[k].name = n == 1 ? std::string(kSingleFileName) : ShardName(k + 1, n);
  }
  return out;
}

StatusOr<std::unique_ptr<ShardWriter>> ShardWriter::Create(const std::string& path,
                                                           std::vector<ShardEntry> entries,
                                                           const ShardWriterOptions& options) {
  if (entries.empty()) return InvalidArgumentError("weights export: no tensors to write");
  std::set<std::string> keys;
  for (const ShardEntry& e : entries) {
    if (e.key.empty()) return InvalidArgumentError("weights export: a tensor has no name");
    if (!keys.insert(e.key).second) {
      return InvalidArgumentError("weights export: tensor '" + e.key + "' is named twice");
    }
  }
  std::unique_ptr<ShardWriter> w(new ShardWriter());
  w->options_ = options;
  w->layout_ = PlanShards(entries, options.single_file ? 0 : options.max_shard_bytes);
  if (options.single_file) {
    w->single_ = path;
    w->dir_ = DirName(path);
    w->layout_.shards[0].name = path;
  } else {
    w->dir_ = path;
    TIERMEM_RETURN_IF_ERROR(MakeDirs(path));
    // The index of an earlier export goes first: with it gone, a shard renamed over one of
    // its shards can never make an old index and new shards look like one checkpoint.
    TIERMEM_RETURN_IF_ERROR(RemoveIfPresent(Join(path, kIndexFileName)));
  }
  for (const ShardLayout::Shard& s : w->layout_.shards) {
    w->order_.insert(w->order_.end(), s.entries.begin(), s.entries.end());
    w->total_left_ += s.bytes;
  }
  w->entries_ = std::move(entries);
  TIERMEM_RETURN_IF_ERROR(w->OpenShard());
  TIERMEM_RETURN_IF_ERROR(w->Advance());  // shards of empty tensors only
  return w;
}

ShardWriter::~ShardWriter() { Abandon(); }

void ShardWriter::Abandon() {
  if (w_ != nullptr) {
    w_.reset();
    unlink(tmp_.c_str());
  }
}

Status ShardWriter::OpenShard() {
  const ShardLayout::Shard& s = layout_.shards[shard_];
  std::vector<TensorInfo> tensors;
  uint64_t at = 0;
  for (size_t i : s.entries) {
    const ShardEntry& e = entries_[i];
    TensorInfo t;
    t.key = e.key;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.numel = e.numel();
    t.begin = at;
    t.end = at + e.bytes();
    at = t.end;
    tensors.push_back(std::move(t));
  }
  const std::string text = HeaderText(tensors, {{"format", "pt"}}, kHeaderAlign);
  tmp_ = (single_.empty() ? Join(dir_, s.name) : single_) + ".tmp";
  TIERMEM_ASSIGN_OR_RETURN(w_, FileWriter::Create(tmp_, options_.direct_io));
  const uint64_t n = text.size();
  TIERMEM_RETURN_IF_ERROR(w_->Put(&n, sizeof(n)));
  TIERMEM_RETURN_IF_ERROR(w_->Put(text.data(), text.size()));
  shard_left_ = s.bytes;
  return OkStatus();
}

Status ShardWriter::CommitShard() {
  TIERMEM_RETURN_IF_ERROR(w_->Finish());
  TIERMEM_RETURN_IF_ERROR(w_->Close());
  w_.reset();
  const ShardLayout::Shard& s = layout_.shards[shard_];
  const std::string path = single_.empty() ? Join(dir_, s.name) : single_;
  if (single_.empty() && shard_ + 1 == layout_.shards.size() && layout_.shards.size() > 1) {
    // Before the index: an earlier single-file export would shadow it (transformers reads
    // model.safetensors first).
    TIERMEM_RETURN_IF_ERROR(RemoveIfPresent(Join(dir_, kSingleFileName)));
  }
  return CommitFile(tmp_, path);
}

Status ShardWriter::Advance() {
  // Complete shards (empty ones too) are committed as soon as their last byte is in.
  while (w_ != nullptr && shard_left_ == 0) {
    TIERMEM_RETURN_IF_ERROR(CommitShard());
    if (++shard_ < layout_.shards.size()) TIERMEM_RETURN_IF_ERROR(OpenShard());
  }
  return OkStatus();
}

Status ShardWriter::Put(const void* data, size_t n) {
  if (finished_ || w_ == nullptr) {
    return FailedPreconditionError("weights export: Put after the last byte (or a failure)");
  }
  if (n > total_left_) {
    return InvalidArgumentError("weights export: " + std::to_string(n - total_left_) +
                                " bytes more than the tensors hold");
  }
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    const size_t k = static_cast<size_t>(std::min<uint64_t>(n, shard_left_));
    Status s = w_->Put(c, k);
    c += k;
    n -= k;
    shard_left_ -= k;
    total_left_ -= k;
    if (s.ok()) s = Advance();
    if (!s.ok()) {  // the export is over: no half-written file stays behind
      Abandon();
      return s;
    }
  }
  return OkStatus();
}

StatusOr<std::span<char>> ShardWriter::Space(size_t want) {
  if (finished_ || w_ == nullptr || total_left_ == 0) {
    return FailedPreconditionError("weights export: Space after the last byte (or a failure)");
  }
  return w_->Space(static_cast<size_t>(std::min<uint64_t>(std::max<size_t>(want, 1), shard_left_)));
}

Status ShardWriter::Commit(size_t n) {
  if (finished_ || w_ == nullptr) {
    return FailedPreconditionError("weights export: Commit after the last byte (or a failure)");
  }
  if (n > shard_left_) {
    return InvalidArgumentError("weights export: Commit past the end of a shard");
  }
  Status s = w_->Commit(n);
  shard_left_ -= n;
  total_left_ -= n;
  if (s.ok()) s = Advance();
  if (!s.ok()) Abandon();  // as Put: no half-written file stays behind
  return s;
}

Status ShardWriter::Finish() {
  if (finished_) return OkStatus();
  if (total_left_ > 0 || shard_ < layout_.shards.size()) {
    return FailedPreconditionError("weights export: " + std::to_string(total_left_) +
                                   " bytes of the tensors were not written");
  }
  finished_ = true;
  if (!single_.empty()) return OkStatus();
  std::set<std::string> mine;
  for (const ShardLayout::Shard& s : layout_.shards) mine.insert(s.name);
  if (layout_.shards.size() > 1) {
    nlohmann::json map = nlohmann::json::object();
    uint64_t total = 0, params = 0;
    for (const ShardLayout::Shard& s : layout_.shards) {
      for (size_t i : s.entries) map[entries_[i].key] = s.name;
      total += s.bytes;
    }
    for (const ShardEntry& e : entries_) params += e.numel();
    const nlohmann::json index = {
        {"metadata", {{"total_parameters", params}, {"total_size", total}}}, {"weight_map", map}};
    const std::string text = index.dump(2) + "\n";
    const std::string path = Join(dir_, kIndexFileName);
    TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<FileWriter> w,
                             FileWriter::Create(path + ".tmp", /*want_direct=*/false, 64 * 1024));
    Status s = w->Put(text.data(), text.size());
    if (s.ok()) s = w->Finish();
    if (s.ok()) s = w->Close();
    if (!s.ok()) {
      unlink((path + ".tmp").c_str());
      return s;
    }
    TIERMEM_RETURN_IF_ERROR(CommitFile(path + ".tmp", path));
  }
  // Stale shards of an earlier export, after the index (which does not name them).
  DIR* d = opendir(dir_.empty() ? "." : dir_.c_str());
  if (d == nullptr) return OkStatus();
  std::vector<std::string> stale;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (IsShardName(name) && !mine.count(name)) stale.push_back(name);
  }
  closedir(d);
  for (const std::string& name : stale) TIERMEM_RETURN_IF_ERROR(RemoveIfPresent(Join(dir_, name)));
  return OkStatus();
}

}  // namespace tiermem::weights
