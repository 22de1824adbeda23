// Session checkpoints (SaveCheckpoint / LoadCheckpoint, see session.h).
//
// File format, version 1 (little-endian, no padding):
//   header   "TMCKPT01" | u32 version | u64 num_tensors | u64 micro_steps | f64 loss_scale |
//            i32 good_steps | u64 skipped_steps | u32 metadata_bytes | metadata |
//            u32 crc32c(everything before it)
//   record   per tensor, in session order: u32 name_bytes | name | u64 numel | u8 trainable |
//            i64 step | f32 value[numel] | (trainable) f32 exp_avg[numel] |
//            f32 exp_avg_sq[numel] | u32 crc32c(the record before it)
//   trailer  "TMCKEND1" | u32 crc32c(all record checksums, concatenated)
// Values are fp32 whatever the session's precision (the master copy), so a checkpoint moves
// between fp32, bf16 and fp16 sessions of the same model (the loss-scaling state is restored
// only into an fp16 session). Gradients are not saved: saving inside an accumulation window
// is refused, and a load clears every "has a gradient" flag.
//
// Saving streams tensor by tensor through one buffer of the largest tensor (a model larger
// than RAM can be saved) into `path`.tmp, fsyncs it, renames it over `path` and fsyncs the
// directory. Loading reads the file twice: a verification pass (checksums, names, sizes) that
// changes nothing, then the pass that writes the values — so a torn, corrupt or mismatched
// file leaves the session exactly as it was.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "runtime/base/crc32c.h"
#include "runtime/base/fs.h"
#include "runtime/session/session.h"

namespace tiermem::session {
namespace {

constexpr char kMagic[8] = {'T', 'M', 'C', 'K', 'P', 'T', '0', '1'};
constexpr char kEndMagic[8] = {'T', 'M', 'C', 'K', 'E', 'N', 'D', '1'};
constexpr uint32_t kVersion = 1;

Status Errno(const std::string& what, int err) {
  return IOError(what + ": " + std::strerror(err));
}

// Buffered writer with a running CRC32C over what it wrote since the last Mark().
class Writer {
 public:
  explicit Writer(int fd) : fd_(fd) { buf_.reserve(kBuf); }
  Status Put(const void* p, size_t n) {
    crc_ = Crc32c(p, n, crc_);
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      const size_t k = std::min(n, kBuf - buf_.size());
      buf_.insert(buf_.end(), c, c + k);
      c += k;
      n -= k;
      if (buf_.size() == kBuf) TIERMEM_RETURN_IF_ERROR(Drain());
    }
    return OkStatus();
  }
  template <typename T>
  Status PutValue(const T& v) {
    return Put(&v, sizeof(v));
  }
  uint32_t TakeCrc() {
    const uint32_t c = crc_;
    crc_ = 0;
    return c;
  }
  Status Drain() {
    size_t off = 0;
    while (off < buf_.size()) {
      const ssize_t w = write(fd_, buf_.data() + off, buf_.size() - off);
      if (w < 0) {
        if (errno == EINTR) continue;
        return Errno("checkpoint write", errno);
      }
      off += static_cast<size_t>(w);
    }
    buf_.clear();
    return OkStatus();
  }

 private:
  static constexpr size_t kBuf = 1 << 20;
  int fd_;
  std::vector<char> buf_;
  uint32_t crc_ = 0;
};

class Reader {
 public:
  explicit Reader(int fd) : fd_(fd) {}
  Status Get(void* p, size_t n) {
    char* c = static_cast<char*>(p);
    size_t got = 0;
    while (got < n) {
      const ssize_t r = read(fd_, c + got, n - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        return Errno("checkpoint read", errno);
      }
      if (r == 0) return DataLossError("checkpoint is truncated (torn file)");
      got += static_cast<size_t>(r);
    }
    crc_ = Crc32c(p, n, crc_);
    return OkStatus();
  }
  template <typename T>
  Status GetValue(T* v) {
    return Get(v, sizeof(*v));
  }
  uint32_t TakeCrc() {
    const uint32_t c = crc_;
    crc_ = 0;
    return c;
  }
  // Reads a stored checksum (not itself checksummed) and compares it with the running one.
  Status CheckCrc(const std::string& what) {
    const uint32_t want = TakeCrc();
    uint32_t stored = 0;
    TIERMEM_RETURN_IF_ERROR(Get(&stored, sizeof(stored)));
    crc_ = 0;
    if (stored != want) return DataLossError("checkpoint " + what + ": checksum mismatch");
    return OkStatus();
  }

 private:
  int fd_;
  uint32_t crc_ = 0;
};

struct Header {
  uint64_t num_tensors = 0;
  uint64_t micro = 0;
  double scale = 1;
  int32_t good_steps = 0;
  uint64_t skipped = 0;
  std::string metadata;
};

Status ReadHeader(Reader& r, Header* h) {
  char magic[8];
  TIERMEM_RETURN_IF_ERROR(r.Get(magic, 8));
  if (std::memcmp(magic, kMagic, 8) != 0) {
    return InvalidArgumentError("not a tiermem checkpoint (bad magic)");
  }
  uint32_t version = 0;
  TIERMEM_RETURN_IF_ERROR(r.GetValue(&version));
  if (version != kVersion) {
    return InvalidArgumentError("checkpoint version " + std::to_string(version) +
                                " is not supported (this build reads version " +
                                std::to_string(kVersion) + ")");
  }
  uint32_t meta_bytes = 0;
  TIERMEM_RETURN_IF_ERROR(r.GetValue(&h->num_tensors));
  TIERMEM_RETURN_IF_ERROR(r.GetValue(&h->micro));
  TIERMEM_RETURN_IF_ERROR(r.GetValue(&h->scale));
  TIERMEM_RETURN_IF_ERROR(r.GetValue(&h->good_steps));
  TIERMEM_RETURN_IF_ERROR(r.GetValue(&h->skipped));
  TIERMEM_RETURN_IF_ERROR(r.GetValue(&meta_bytes));
  if (meta_bytes > (64u << 20)) return DataLossError("checkpoint header: metadata too large");
  h->metadata.resize(meta_bytes);
  TIERMEM_RETURN_IF_ERROR(r.Get(h->metadata.data(), meta_bytes));
  return r.CheckCrc("header");
}

}  // namespace

Status Session::SaveCheckpoint(const std::string& path, const std::string& metadata) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (accumulating_) {
    return FailedPreconditionError(
        "checkpoint: saving inside a gradient accumulation window would lose the accumulated "
        "gradients; save after a step that applied");
  }
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("checkpoint: cannot create " + tmp, errno);
  auto fail = [&](Status s) {
    close(fd);
    unlink(tmp.c_str());
    return s.WithContext("checkpoint " + path);
  };
  Writer w(fd);
  Status s = w.Put(kMagic, 8);
  if (s.ok()) s = w.PutValue(kVersion);
  if (s.ok()) s = w.PutValue(static_cast<uint64_t>(specs_.size()));
  if (s.ok()) s = w.PutValue(micro_);
  if (s.ok()) s = w.PutValue(scaler_.scale);
  if (s.ok()) s = w.PutValue(static_cast<int32_t>(scaler_.good_steps));
  if (s.ok()) s = w.PutValue(scaler_.skipped_steps);
  if (s.ok()) s = w.PutValue(static_cast<uint32_t>(metadata.size()));
  if (s.ok()) s = w.Put(metadata.data(), metadata.size());
  if (s.ok()) s = w.PutValue(w.TakeCrc());
  w.TakeCrc();
  uint64_t max_numel = 0;
  for (const TensorSpec& t : specs_) max_numel = std::max(max_numel, t.numel);
  std::vector<float> buf(max_numel);
  std::vector<uint32_t> record_crcs;
  for (size_t i = 0; i < specs_.size() && s.ok(); ++i) {
    const TensorSpec& t = specs_[i];
    s = w.PutValue(static_cast<uint32_t>(t.name.size()));
    if (s.ok()) s = w.Put(t.name.data(), t.name.size());
    if (s.ok()) s = w.PutValue(t.numel);
    if (s.ok()) s = w.PutValue(static_cast<uint8_t>(t.trainable));
    if (s.ok()) s = w.PutValue(steps_[i]);
    std::vector<ChunkKind> kinds = {ChunkKind::kParamFp32};
    if (t.trainable) kinds.insert(kinds.end(), {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq});
    for (ChunkKind k : kinds) {
      if (s.ok()) s = ReadTensor(i, k, buf.data());
      if (s.ok()) s = w.Put(buf.data(), t.numel * sizeof(float));
    }
    const uint32_t crc = w.TakeCrc();
    record_crcs.push_back(crc);
    if (s.ok()) s = w.PutValue(crc);
    w.TakeCrc();
  }
  if (s.ok()) s = w.Put(kEndMagic, 8);
  if (s.ok()) {
    const uint32_t all = Crc32c(record_crcs.data(), record_crcs.size() * sizeof(uint32_t));
    s = w.PutValue(all);
  }
  if (s.ok()) s = w.Drain();
  if (s.ok() && fsync(fd) != 0) s = Errno("checkpoint fsync", errno);
  if (!s.ok()) return fail(s);
  if (close(fd) != 0) {
    unlink(tmp.c_str());
    return Errno("checkpoint close " + tmp, errno);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return Errno("checkpoint: rename to " + path, err);
  }
  std::string dir = DirName(path);
  if (dir.empty()) dir = ".";
  const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);  // best effort: the rename is durable once the directory is
    close(dfd);
  }
  return OkStatus();
}

StatusOr<std::string> Session::CheckpointMetadata(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("checkpoint: cannot open " + path, errno);
  Reader r(fd);
  Header h;
  Status s = ReadHeader(r, &h);
  close(fd);
  if (!s.ok()) return s.WithContext("checkpoint " + path);
  return h.metadata;
}

Status Session::LoadCheckpoint(const std::string& path, std::string* metadata) {
  TIERMEM_RETURN_IF_ERROR(Live());
  uint64_t max_numel = 0;
  for (const TensorSpec& t : specs_) max_numel = std::max(max_numel, t.numel);
  std::vector<float> buf(max_numel);
  // Pass 0 verifies; pass 1 applies. Both read the whole file the same way.
  for (int pass = 0; pass < 2; ++pass) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Errno("checkpoint: cannot open " + path, errno);
    Reader r(fd);
    Status s;
    Header h;
    s = ReadHeader(r, &h);
    if (s.ok() && h.num_tensors != specs_.size()) {
      s = InvalidArgumentError("checkpoint holds " + std::to_string(h.num_tensors) +
                               " tensors, this model has " + std::to_string(specs_.size()));
    }
    std::vector<uint32_t> record_crcs;
    for (size_t i = 0; i < specs_.size() && s.ok(); ++i) {
      const TensorSpec& t = specs_[i];
      uint32_t name_bytes = 0;
      s = r.GetValue(&name_bytes);
      if (s.ok() && name_bytes > 65536) s = DataLossError("checkpoint record: bad name length");
      std::string name(s.ok() ? name_bytes : 0, '\0');
      if (s.ok()) s = r.Get(name.data(), name_bytes);
      uint64_t numel = 0;
      uint8_t trainable = 0;
      int64_t step = 0;
      if (s.ok()) s = r.GetValue(&numel);
      if (s.ok()) s = r.GetValue(&trainable);
      if (s.ok()) s = r.GetValue(&step);
      if (s.ok() && (name != t.name || numel != t.numel || (trainable != 0) != t.trainable)) {
        s = InvalidArgumentError("checkpoint tensor " + std::to_string(i) + " is '" + name +
                                 "' (" + std::to_string(numel) + " elements" +
                                 (trainable ? "" : ", frozen") + "), this model has '" + t.name +
                                 "' (" + std::to_string(t.numel) + " elements" +
                                 (t.trainable ? "" : ", frozen") + ")");
      }
      std::vector<ChunkKind> kinds = {ChunkKind::kParamFp32};
      if (t.trainable) kinds.insert(kinds.end(), {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq});
      for (ChunkKind k : kinds) {
        if (s.ok()) s = r.Get(buf.data(), t.numel * sizeof(float));
        if (s.ok() && pass == 1) {
          s = k == ChunkKind::kParamFp32 ? WriteParam(i, buf.data()) : WriteTensor(i, k, buf.data());
        }
      }
      if (pass == 1 && s.ok()) steps_[i] = step;
      uint32_t crc = r.TakeCrc();
      record_crcs.push_back(crc);
      uint32_t stored = 0;
      if (s.ok()) s = r.GetValue(&stored);
      r.TakeCrc();
      if (s.ok() && stored != crc) {
        s = DataLossError("checkpoint record " + std::to_string(i) + " (" + t.name +
                          "): checksum mismatch");
      }
    }
    char end[8];
    uint32_t all = 0;
    if (s.ok()) s = r.Get(end, 8);
    if (s.ok() && std::memcmp(end, kEndMagic, 8) != 0) {
      s = DataLossError("checkpoint trailer missing (torn file)");
    }
    if (s.ok()) s = r.GetValue(&all);
    if (s.ok() && all != Crc32c(record_crcs.data(), record_crcs.size() * sizeof(uint32_t))) {
      s = DataLossError("checkpoint trailer: checksum mismatch");
    }
    close(fd);
    if (!s.ok()) {
      return s.WithContext(pass == 0 ? "checkpoint " + path + " (nothing was loaded)"
                                     : "checkpoint " + path + " changed while loading");
    }
    if (pass == 1) {
      // Gradients are not part of a checkpoint: the next backward starts them afresh.
      micro_ = h.micro;
      accumulating_ = false;
      std::fill(has_grad_.begin(), has_grad_.end(), 0);
      if (config_.precision == Precision::kFp16) {
        scaler_.scale = h.scale;
        scaler_.good_steps = h.good_steps;
        scaler_.skipped_steps = h.skipped;
      }
      if (metadata != nullptr) *metadata = h.metadata;
    }
  }
  return OkStatus();
}

}  // namespace tiermem::session
