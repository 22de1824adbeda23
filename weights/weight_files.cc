// Opening pretrained weights: a file, or a Hugging Face directory (see weight_files.h).
#include "weights/weight_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "base/logging.h"

namespace tiermem::weights {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxIndexBytes = 256ull << 20;

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

// 1: a regular file, 2: a directory, 0: missing (errno ENOENT); an error otherwise.
StatusOr<int> Kind(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return 0;
    return ErrnoToStatus(errno, "stat " + path);
  }
  if (S_ISDIR(st.st_mode)) return 2;
  if (S_ISREG(st.st_mode)) return 1;
  return InvalidArgumentError(path + " is neither a file nor a directory");
}

StatusOr<std::string> ReadSmallFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "opening " + path);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t r = read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      close(fd);
      return ErrnoToStatus(err, "reading " + path);
    }
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
    if (out.size() > kMaxIndexBytes) {
      close(fd);
      return InvalidArgumentError(path + " is larger than " + std::to_string(kMaxIndexBytes) +
                                  " bytes: not a checkpoint index");
    }
  }
  close(fd);
  return out;
}

// Every error of reading a checkpoint's headers is the user's input: kInvalidArgument (a torn
// shard is kDataLoss in safetensors.h, where a session checkpoint wants that code).
Status AsInput(const Status& s) {
  if (s.ok() || s.code() == StatusCode::kNotFound || s.code() == StatusCode::kIOError) return s;
  return InvalidArgumentError(s.message());
}

void AddFile(WeightFiles* w, Header h) {
  const uint32_t f = static_cast<uint32_t>(w->files.size());
  for (uint32_t t = 0; t < h.tensors.size(); ++t) {
    w->keys[h.tensors[t].key] = {f, t};
    w->total_size += h.tensors[t].bytes();
  }
  w->files.push_back(std::move(h));
}

// The directory form with an index: every shard's header, checked against the index.
StatusOr<WeightFiles> OpenIndexed(const std::string& dir, const std::string& index_path) {
  TIERMEM_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(index_path));
  TIERMEM_ASSIGN_OR_RETURN(const WeightIndex index, ParseIndex(index_path, text));
  std::map<std::string, std::vector<std::string>> by_shard;  // shard -> its tensors
  for (const auto& [key, shard] : index.weight_map) by_shard[shard].push_back(key);
  WeightFiles w;
  w.path = dir;
  w.index_path = index_path;
  for (const auto& [shard, keys] : by_shard) {
    const std::string path = Join(dir, shard);
    TIERMEM_ASSIGN_OR_RETURN(const int kind, Kind(path));
    if (kind != 1) {
      return InvalidArgumentError("the index " + index_path + " names the shard " + shard +
                                  ", which " + dir + " lacks" +
                                  (kind == 2 ? " (a directory of that name)" : ""));
    }
    StatusOr<Header> h = ReadHeader(path);
    if (!h.ok()) return AsInput(h.status());
    for (const std::string& key : keys) {
      if (h->Find(key) == nullptr) {
        return InvalidArgumentError("the index " + index_path + " maps tensor '" + key + "' to " +
                                    shard + ", which has no tensor of that name");
      }
    }
    for (const TensorInfo& t : h->tensors) {
      const auto it = std::lower_bound(index.weight_map.begin(), index.weight_map.end(), t.key,
                                       [](const std::pair<std::string, std::string>& e,
                                          const std::string& k) { return e.first < k; });
      if (it == index.weight_map.end() || it->first != t.key) {
        return InvalidArgumentError(path + " holds tensor '" + t.key + "', which the index " +
                                    index_path + " does not list");
      }
      if (it->second != shard) {
        return InvalidArgumentError("tensor '" + t.key + "' is in two shards: " + path + " and " +
                                    Join(dir, it->second) + " (the index names " + it->second +
                                    ")");
      }
    }
    AddFile(&w, *std::move(h));
  }
  if (index.total_size && *index.total_size != w.total_size) {
    TIERMEM_LOG(kWarn) << "weights: " << index_path << " says metadata.total_size "
                       << *index.total_size << ", its shards hold " << w.total_size
                       << " bytes of tensors (the index's figure is not used)";
  }
  return w;
}

}  // namespace

const TensorInfo* WeightFiles::Find(std::string_view key, uint32_t* file) const {
  const auto it = keys.find(std::string(key));
  if (it == keys.end()) return nullptr;
  if (file != nullptr) *file = it->second.file;
  return &files[it->second.file].tensors[it->second.tensor];
}

std::vector<std::string> WeightFiles::Keys() const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& [k, loc] : keys) out.push_back(k);
  std::sort(out.begin(), out.end());
  return out;
}

const std::string& WeightFiles::FileOf(std::string_view key) const {
  uint32_t f = 0;
  if (Find(key, &f) == nullptr) return path;
  return files[f].path;
}

StatusOr<WeightIndex> ParseIndex(std::string_view path, std::string_view text) {
  const std::string where = "checkpoint index " + std::string(path);
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return InvalidArgumentError(where + " is not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) return InvalidArgumentError(where + " is not a JSON object");
  const auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object()) {
    return InvalidArgumentError(where + " has no weight_map object");
  }
  WeightIndex out;
  for (const auto& [key, shard] : map->items()) {
    if (!shard.is_string()) {
      return InvalidArgumentError(where + ": weight_map entry '" + key + "' is not a file name");
    }
    const std::string name = shard.get<std::string>();
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      return InvalidArgumentError(where + ": weight_map entry '" + key + "' names '" + name +
                                  "', not a file of the checkpoint's directory");
    }
    out.weight_map.emplace_back(key, name);
  }
  std::sort(out.weight_map.begin(), out.weight_map.end());
  const auto meta = j.find("metadata");
  if (meta != j.end() && !meta->is_null()) {
    if (!meta->is_object()) return InvalidArgumentError(where + ": metadata is not an object");
    const auto total = meta->find("total_size");
    if (total != meta->end()) {
      if (total->is_number_unsigned()) {
        out.total_size = total->get<uint64_t>();
      } else if (total->is_number() && total->get<double>() >= 0) {
        out.total_size = static_cast<uint64_t>(total->get<double>());
      } else {
        return InvalidArgumentError(where + ": metadata.total_size is not a byte count");
      }
    }
  }
  return out;
}

StatusOr<WeightFiles> OpenWeights(const std::string& path) {
  TIERMEM_ASSIGN_OR_RETURN(const int kind, Kind(path));
  if (kind == 0) return NotFoundError("weights: " + path + " does not exist");
  // One file: `path` itself, or the directory's model.safetensors.
  auto single = [&path](const std::string& file) -> StatusOr<WeightFiles> {
    StatusOr<Header> h = ReadHeader(file);
    if (!h.ok()) return AsInput(h.status());
    WeightFiles w;
    w.path = path;
    AddFile(&w, *std::move(h));
    return w;
  };
  if (kind == 1) return single(path);
  TIERMEM_ASSIGN_OR_RETURN(const int single_kind, Kind(Join(path, kSingleFileName)));
  if (single_kind == 1) return single(Join(path, kSingleFileName));
  const std::string index = Join(path, kIndexFileName);
  TIERMEM_ASSIGN_OR_RETURN(const int index_kind, Kind(index));
  if (index_kind == 1) return OpenIndexed(path, index);
  return InvalidArgumentError("weights: the directory " + path + " has neither " + kSingleFileName +
                              " nor " + kIndexFileName +
                              " (an export that was interrupted leaves only *.tmp files)");
}

StatusOr<std::string> ReadTensorBytes(const WeightFiles& files, std::string_view key) {
  uint32_t f = 0;
  const TensorInfo* t = files.Find(key, &f);
  if (t == nullptr) {
    return InvalidArgumentError("weights: " + files.path + " has no tensor '" + std::string(key) +
                                "'");
  }
  const Header& h = files.files[f];
  const int fd = open(h.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "opening " + h.path);
  std::string out(t->bytes(), '\0');
  uint64_t got = 0;
  Status s;
  while (got < out.size() && s.ok()) {
    const ssize_t r = pread(fd, out.data() + got, out.size() - got,
                            static_cast<off_t>(h.data_start + t->begin + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) s = ErrnoToStatus(errno, "reading " + h.path);
    if (r == 0) s = InvalidArgumentError(h.path + " ends inside tensor '" + t->key + "'");
    if (r > 0) got += static_cast<uint64_t>(r);
  }
  close(fd);
  if (!s.ok()) return s;
  return out;
}

}  // namespace tiermem::weights
