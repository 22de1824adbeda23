// Session checkpoints (SaveCheckpoint / LoadCheckpoint, see session.h).
//
// Format 3 (written): a safetensors file (https://huggingface.co/docs/safetensors), so any
// tool loads it without tiermem (`safetensors.torch.load_file`, or `safe_open` tensor by
// tensor for a model larger than RAM):
//   u64 header_bytes | JSON header (padded with spaces to 8 bytes) | tensor bytes
//   tensors   per session tensor, in session order: "<name>" (its fp32 value, in the
//             binding's shape) and, when trainable, "exp_avg/<name>" and "exp_avg_sq/<name>"
//             (Adam m and v, same shape); every one F32, laid out back to back
//   __metadata__ (all strings): format "tiermem-checkpoint", version "3", micro_steps,
//             loss_scale, good_steps, skipped_steps, steps (JSON {name: step count}),
//             param_groups, rng_state, extra (CheckpointMeta, checkpoint_meta.h: the one
//             format of both bindings), crc32c (JSON {key: 8 hex digits} of every tensor's
//             bytes), header_crc32c (of the header text with its own value zeroed)
// The checksums are written as fixed-width placeholders first and filled in once the data is
// streamed (the header is rewritten in place, same length).
//
// Format 2 (read only, from earlier builds): the same file with version "2", whose metadata
// has one `binding` entry instead of param_groups, rng_state and extra: the binding's own JSON
// in one of two shapes (Python's, LibTorch's), which ParseLegacyCheckpointMeta reads.
//
// Format 1 (read only, from earlier builds; little-endian, no padding; its metadata is the
// LibTorch shape of format 2's `binding`):
//   header   "TMCKPT01" | u32 version | u64 num_tensors | u64 micro_steps | f64 loss_scale |
//            i32 good_steps | u64 skipped_steps | u32 metadata_bytes | metadata |
//            u32 crc32c(everything before it)
//   record   per tensor, in session order: u32 name_bytes | name | u64 numel | u8 trainable |
//            i64 step | f32 value[numel] | (trainable) f32 exp_avg[numel] |
//            f32 exp_avg_sq[numel] | u32 crc32c(the record before it)
//   trailer  "TMCKEND1" | u32 crc32c(all record checksums, concatenated)
//
// Values are fp32 whatever the session's precision (the master copy), so a checkpoint moves
// between fp32, bf16 and fp16 sessions of the same model (the loss-scaling state is restored
// only into an fp16 session), and tensors are matched by name and size, so the same model
// loads at any budget or chunk size. Gradients are not saved: saving inside an accumulation
// window is refused, and a load clears every "has a gradient" flag.
//
// Saving streams tensor by tensor through one buffer of the largest tensor (a model larger
// than RAM can be saved) into `path`.tmp — with O_DIRECT where the file system allows it,
// 8 MiB at a time (weights::FileWriter), the header padded so the tensor bytes start
// block-aligned (weights::HeaderText) — fsyncs it, renames it over `path` and fsyncs the
// directory (weights::CommitFile). The header is read and validated by the one safetensors
// parser (weights/safetensors.h) after its checksum was checked. Loading reads the tensor bytes
// with O_DIRECT likewise (a block-aligned buffer of the largest tensor). Config checkpoint_io
// "buffered" goes through the page cache instead, both ways. Loading reads the tensors twice:
// a verification pass (checksums, names, sizes) that changes nothing, then the pass that
// writes the values — so a torn, corrupt or mismatched file leaves the session exactly as it
// was. The metadata is parsed and checked against the binding (CheckpointLoad: its number of
// param groups, its RNG state's size) before the first pass.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <vector>

#include "base/crc32c.h"
#include "base/fs.h"
#include "runtime/session.h"
#include "weights/file_writer.h"
#include "weights/safetensors.h"

namespace tiermem::session {
namespace {

constexpr char kMagic[8] = {'T', 'M', 'C', 'K', 'P', 'T', '0', '1'};
constexpr char kEndMagic[8] = {'T', 'M', 'C', 'K', 'E', 'N', 'D', '1'};
constexpr uint32_t kVersion = 1;

Status Errno(const std::string& what, int err) { return IOError(what + ": " + std::strerror(err)); }

// O_DIRECT I/O: offsets, lengths and buffers aligned to kBlock (the logical block size of any
// disk we meet is at most 4 KiB).
constexpr size_t kBlock = 4096;

struct FreeAligned {
  void operator()(char* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<char, FreeAligned>;
AlignedBuf NewAligned(size_t bytes) {
  return AlignedBuf(static_cast<char*>(std::aligned_alloc(kBlock, AlignUp(bytes, kBlock))));
}

// Opens `path` with O_DIRECT added to `flags` when `want_direct` and the file system allows
// it, else without; *direct says which.
int OpenMaybeDirect(const std::string& path, int flags, mode_t mode, bool want_direct,
                    bool* direct) {
  int fd = want_direct ? open(path.c_str(), flags | O_DIRECT, mode) : -1;
  *direct = fd >= 0;
  if (fd < 0 && (!want_direct || errno == EINVAL)) fd = open(path.c_str(), flags, mode);
  return fd;
}

Status PReadAll(int fd, void* p, size_t n, off_t off) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = pread(fd, c, n, off);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("checkpoint read", errno);
    }
    if (r == 0) return DataLossError("checkpoint is truncated (torn file)");
    c += r;
    n -= static_cast<size_t>(r);
    off += r;
  }
  return OkStatus();
}

// Reads [off, off + n) of the file and returns where the bytes are: in `buf` without O_DIRECT;
// with it (`direct`), inside the block-aligned `scratch` (at least n + 2 * kBlock bytes) that
// the covering blocks are read into.
StatusOr<const char*> ReadRange(int fd, bool direct, char* scratch, char* buf, size_t n,
                                uint64_t off) {
  if (!direct) {
    TIERMEM_RETURN_IF_ERROR(PReadAll(fd, buf, n, static_cast<off_t>(off)));
    return static_cast<const char*>(buf);
  }
  const uint64_t a = off / kBlock * kBlock;
  const size_t need = static_cast<size_t>(off + n - a);
  const size_t want = AlignUp(need, kBlock);
  size_t got = 0;
  while (got < need) {
    const ssize_t r = pread(fd, scratch + got, want - got, static_cast<off_t>(a + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("checkpoint read", errno);
    }
    if (r == 0) return DataLossError("checkpoint is truncated (torn file)");
    got += static_cast<size_t>(r);
    if (got % kBlock != 0 && got < need) {
      return DataLossError("checkpoint is truncated (torn file)");  // a short read before the end
    }
  }
  return static_cast<const char*>(scratch + (off - a));
}

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

// ---- format 2: safetensors -----------------------------------------------------------------

constexpr char kFormat[] = "tiermem-checkpoint";
constexpr char kCrcPlaceholder[] = "00000000";

std::string Hex8(uint32_t v) {
  char b[9];
  std::snprintf(b, sizeof(b), "%08" PRIx32, v);
  return b;
}

std::string Num(double v) {
  char b[40];
  std::snprintf(b, sizeof(b), "%.17g", v);
  return b;
}

std::vector<int64_t> ShapeOf(const TensorSpec& t) {
  return t.shape.empty() ? std::vector<int64_t>{static_cast<int64_t>(t.numel)} : t.shape;
}

// One safetensors entry of a tensor: its value, or a part of its m or v — the fp32 values, or
// the stored codes (BF16 / U8) and, for U8, the block absmax values that follow them.
enum class Part : uint8_t { kValues, kCodes, kAbsmax };
struct Entry {
  std::string key;
  ChunkKind kind = ChunkKind::kParamFp32;  // the value, kExpAvg or kExpAvgSq
  Part part = Part::kValues;
  std::string dtype;  // "F32", "BF16", "U8"
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  // Loading: where the entry's bytes are and their checksum.
  uint64_t begin = 0;
  std::string crc = {};
};

const char* StatePrefix(ChunkKind kind) {
  return kind == ChunkKind::kExpAvg ? "exp_avg" : "exp_avg_sq";
}

// The entries of tensor `t` as saved with its group's state format `f`, in file order.
std::vector<Entry> SavedEntries(const TensorSpec& t, const kernels::StateFormat& f) {
  std::vector<Entry> out = {
      {t.name, ChunkKind::kParamFp32, Part::kValues, "F32", ShapeOf(t), t.numel * 4}};
  if (!t.trainable) return out;
  for (ChunkKind kind : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
    const std::string key = std::string(StatePrefix(kind)) + "/" + t.name;
    switch (f.dtype) {
      case kernels::StateDType::kF32:
        out.push_back({key, kind, Part::kValues, "F32", ShapeOf(t), t.numel * 4});
        break;
      case kernels::StateDType::kBF16:
        out.push_back({key, kind, Part::kCodes, "BF16", ShapeOf(t), t.numel * 2});
        break;
      case kernels::StateDType::kInt8: {
        const uint64_t blocks = kernels::StateBlocks(f, t.numel);
        out.push_back({key, kind, Part::kCodes, "U8", ShapeOf(t), t.numel});
        out.push_back({std::string(StatePrefix(kind)) + "_absmax/" + t.name,
                       kind,
                       Part::kAbsmax,
                       "F32",
                       {static_cast<int64_t>(blocks)},
                       blocks * 4});
        break;
      }
    }
  }
  return out;
}

// The `state_format` metadata entry: how compressed m and v are stored (the session's config;
// a tensor's own entries say by their dtype whether its state is compressed).
std::string StateFormatMeta(const OptimizerStateConfig& c) {
  return nlohmann::json{{"dtype", std::string(kernels::StateDTypeName(c.format.dtype))},
                        {"block", c.format.block},
                        {"rounding", c.format.stochastic ? "stochastic" : "nearest"},
                        {"min_elems", c.min_elems},
                        {"map",
                         "dynamic (bitsandbytes create_dynamic_map: signed for exp_avg, "
                         "unsigned for exp_avg_sq), absmax per block"}}
      .dump();
}

std::string FormatName(const kernels::StateFormat& f) {
  std::string n(kernels::StateDTypeName(f.dtype));
  if (f.dtype == kernels::StateDType::kInt8) n += " (block " + std::to_string(f.block) + ")";
  return n;
}

// `text` with the value of "header_crc32c" replaced by the placeholder; npos-safe.
StatusOr<std::string> ZeroHeaderCrc(std::string text, std::string* value) {
  const std::string key = "\"header_crc32c\":\"";
  const size_t at = text.find(key);
  if (at == std::string::npos || at + key.size() + 8 > text.size()) {
    return DataLossError("checkpoint header has no header checksum");
  }
  if (value != nullptr) *value = text.substr(at + key.size(), 8);
  text.replace(at + key.size(), 8, kCrcPlaceholder);
  return text;
}

// A parsed format-2 header.
struct Header2 {
  weights::Header file;  // the tensors, validated by the safetensors parser
  std::map<std::string, std::string> meta;
  nlohmann::json steps, crcs;
};

bool IsV1(int fd) {
  char magic[8] = {};
  return pread(fd, magic, 8, 0) == 8 && std::memcmp(magic, kMagic, 8) == 0;
}

// The header of `fd` (the file `path`): tiermem's metadata first, then its checksum, then the
// safetensors rules — so a torn or edited header is named as such before its structure is.
StatusOr<Header2> ReadHeader2(int fd, const std::string& path) {
  uint64_t file_bytes = 0;
  StatusOr<std::string> read = weights::ReadHeaderText(fd, path, &file_bytes);
  if (!read.ok()) {
    if (read.status().code() == StatusCode::kInvalidArgument) {
      return InvalidArgumentError(
          "not a tiermem checkpoint (no safetensors header: " + read.status().message() + ")");
    }
    if (read.status().code() == StatusCode::kDataLoss) {
      return DataLossError("checkpoint is truncated (torn file): " + read.status().message());
    }
    return read.status();
  }
  const std::string& text = *read;
  nlohmann::json h = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded() || !h.is_object()) {
    return InvalidArgumentError("not a tiermem checkpoint (the safetensors header is not JSON)");
  }
  Header2 out;
  const auto meta = h.find("__metadata__");
  if (meta == h.end() || !meta->is_object() || meta->value("format", "") != kFormat) {
    return InvalidArgumentError(
        "not a tiermem checkpoint (a safetensors file without tiermem's metadata)");
  }
  for (const auto& [k, v] : meta->items()) {
    if (!v.is_string()) return DataLossError("checkpoint metadata '" + k + "' is not a string");
    out.meta[k] = v.get<std::string>();
  }
  if (out.meta["version"] != "2" && out.meta["version"] != "3") {
    return InvalidArgumentError("checkpoint version " + out.meta["version"] +
                                " is not supported (this build reads versions 1 to 3)");
  }
  std::string stored;
  TIERMEM_ASSIGN_OR_RETURN(const std::string zeroed, ZeroHeaderCrc(text, &stored));
  if (Hex8(Crc32c(zeroed.data(), zeroed.size())) != stored) {
    return DataLossError("checkpoint header: checksum mismatch");
  }
  out.steps = nlohmann::json::parse(out.meta["steps"], nullptr, false);
  out.crcs = nlohmann::json::parse(out.meta["crc32c"], nullptr, false);
  if (!out.steps.is_object() || !out.crcs.is_object()) {
    return DataLossError("checkpoint header: bad steps or checksums");
  }
  StatusOr<weights::Header> file = weights::ParseHeader(path, text, file_bytes);
  if (!file.ok()) {
    return DataLossError((file.status().code() == StatusCode::kDataLoss
                              ? "checkpoint is truncated (torn file): "
                              : "checkpoint header is malformed: ") +
                         file.status().message());
  }
  out.file = *std::move(file);
  return out;
}

// The metadata of a format-2/3 header: version 3's own entries, version 2's binding string.
StatusOr<CheckpointMeta> MetaOf(const Header2& h) {
  if (h.meta.at("version") == "2") {
    const auto b = h.meta.find("binding");
    return ParseLegacyCheckpointMeta(b == h.meta.end() ? "" : b->second);
  }
  return DecodeCheckpointMeta(h.meta);
}

}  // namespace

Status Session::SaveCheckpoint(const std::string& path, const CheckpointMeta& metadata) {
  TIERMEM_RETURN_IF_ERROR(Live());
  // The deferred updates belong to the state.
  TIERMEM_RETURN_IF_ERROR(stepper_->RunAllPending(true));
  if (accumulating_) {
    return FailedPreconditionError(
        "checkpoint: saving inside a gradient accumulation window would lose the accumulated "
        "gradients; save after a step that applied");
  }
  // The header, with checksum placeholders (fixed width: the final header has the same size).
  std::vector<weights::TensorInfo> infos;
  std::set<std::string> names;
  nlohmann::json steps = nlohmann::json::object(), crcs = nlohmann::json::object();
  uint64_t offset = 0, max_numel = 0;
  std::vector<std::vector<Entry>> saved(layout_.specs.size());
  for (size_t i = 0; i < layout_.specs.size(); ++i) {
    const TensorSpec& t = layout_.specs[i];
    max_numel = std::max(max_numel, t.numel);
    steps[t.name] = stepper_->step_count(i);
    saved[i] = SavedEntries(t, layout_.groups[layout_.tensors[i].group].state);
    for (const Entry& e : saved[i]) {
      if (!names.insert(e.key).second) {
        return InvalidArgumentError("checkpoint: two tensors are named '" + e.key + "'");
      }
      weights::TensorInfo info;
      info.key = e.key;
      info.dtype = *weights::ParseDType(e.dtype);
      info.shape.assign(e.shape.begin(), e.shape.end());
      info.begin = offset;
      info.end = offset + e.bytes;
      infos.push_back(std::move(info));
      offset += e.bytes;
      crcs[e.key] = kCrcPlaceholder;
    }
  }
  const std::map<std::string, std::string> entries = EncodeCheckpointMeta(metadata);
  auto meta_map = [&](const std::string& header_crc) {
    std::map<std::string, std::string> m = {
        {"format", kFormat},
        {"version", "3"},
        {"micro_steps", std::to_string(micro_)},
        {"loss_scale", Num(scaler_.scale)},
        {"good_steps", std::to_string(scaler_.good_steps)},
        {"skipped_steps", std::to_string(scaler_.skipped_steps)},
        {"steps", steps.dump()},
        {"crc32c", crcs.dump()},
        {"state_format", StateFormatMeta(config_.optimizer_state)},
        {"header_crc32c", header_crc}};
    for (const auto& [k, v] : entries) m[k] = v;
    return m;
  };
  const std::string placeholder = weights::HeaderText(infos, meta_map(kCrcPlaceholder), kBlock);
  const uint64_t header_bytes = placeholder.size();

  if (layout_.sharded()) {
    // Every rank takes part in the gathers, chunk by chunk (cached while consecutive tensors
    // share one); rank 0 writes the file.
    gather_cache_ = true;
    gathered_key_ = {SIZE_MAX, -1};
  }
  struct CacheOff {
    Session* s;
    ~CacheOff() {
      s->gather_cache_ = false;
      s->gathered_key_ = {SIZE_MAX, -1};
    }
  } cache_off{this};
  // One tensor's bytes at a time: its value, then m and v as stored (fp32 values, or the
  // codes and absmax read raw). Sharded, every rank makes the same (collective) reads; rank 0
  // writes. After a write error rank 0 still takes part in every gather (the other ranks would
  // wait for it), then reports the error.
  std::vector<float> buf(max_numel);
  std::vector<float> absmax(max_numel / kernels::kMinStateBlock + 1);  // any tensor's blocks
  auto read = [&](size_t i, const Entry& e) -> Status {
    if (e.part == Part::kAbsmax) return OkStatus();  // read with the codes
    if (e.part == Part::kCodes) return ReadStateRaw(i, e.kind, buf.data(), absmax.data());
    return ReadTensor(i, e.kind, buf.data());
  };
  auto bytes_of = [&](const Entry& e) {
    return e.part == Part::kAbsmax ? reinterpret_cast<const char*>(absmax.data())
                                   : reinterpret_cast<const char*>(buf.data());
  };
  if (layout_.sharded() && layout_.rank != 0) {
    for (size_t i = 0; i < layout_.specs.size(); ++i) {
      for (const Entry& e : saved[i]) TIERMEM_RETURN_IF_ERROR(read(i, e).WithContext("checkpoint"));
    }
    return OkStatus();
  }
  const std::string tmp = path + ".tmp";
  StatusOr<std::unique_ptr<weights::FileWriter>> created = weights::FileWriter::Create(
      tmp, CheckpointsDirect(config_.checkpoint_io), 8 * kMiB, /*crc=*/true);
  if (!created.ok()) return IOError("checkpoint: " + created.status().message());
  weights::FileWriter& w = **created;
  Status s = w.Put(&header_bytes, sizeof(header_bytes));
  if (s.ok()) s = w.Put(placeholder.data(), placeholder.size());
  w.TakeCrc();
  Status gathers;
  for (size_t i = 0; i < layout_.specs.size() && gathers.ok() && (s.ok() || layout_.sharded());
       ++i) {
    for (size_t k = 0; k < saved[i].size() && gathers.ok() && (s.ok() || layout_.sharded()); ++k) {
      const Entry& e = saved[i][k];
      gathers = read(i, e);
      if (s.ok()) s = gathers;
      if (s.ok()) s = w.Put(bytes_of(e), e.bytes);
      crcs[e.key] = Hex8(w.TakeCrc());
    }
  }
  if (s.ok()) s = w.Finish();
  if (s.ok()) {
    // The real checksums, then the header's own over the text with it zeroed.
    const std::string zeroed = weights::HeaderText(infos, meta_map(kCrcPlaceholder), kBlock);
    const std::string text =
        weights::HeaderText(infos, meta_map(Hex8(Crc32c(zeroed.data(), zeroed.size()))), kBlock);
    if (text.size() != header_bytes) {
      s = InternalError("checkpoint header changed size");
    } else {
      // The length and the text end on a block boundary: rewritten as whole blocks.
      std::string head(8 + text.size(), '\0');
      std::memcpy(head.data(), &header_bytes, 8);
      std::memcpy(head.data() + 8, text.data(), text.size());
      s = w.Rewrite(0, head.data(), head.size());
    }
  }
  if (s.ok()) s = w.Close();  // fsync
  if (!s.ok()) {
    created->reset();
    unlink(tmp.c_str());
    return s.WithContext("checkpoint " + path);
  }
  return weights::CommitFile(tmp, path).WithContext("checkpoint");
}

StatusOr<CheckpointMeta> Session::CheckpointMetadata(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("checkpoint: cannot open " + path, errno);
  StatusOr<CheckpointMeta> meta = InternalError("unread");
  if (IsV1(fd)) {
    Reader r(fd);
    Header h;
    Status s = ReadHeader(r, &h);
    meta = s.ok() ? ParseLegacyCheckpointMeta(h.metadata) : StatusOr<CheckpointMeta>(s);
  } else {
    auto h = ReadHeader2(fd, path);
    meta = h.ok() ? MetaOf(*h) : StatusOr<CheckpointMeta>(h.status());
  }
  close(fd);
  if (!meta.ok()) return meta.status().WithContext("checkpoint " + path);
  return meta;
}

Status Session::LoadCheckpoint(const std::string& path, CheckpointMeta* metadata,
                               const CheckpointLoad& how) {
  TIERMEM_RETURN_IF_ERROR(Live());
  // The last step's deferred updates come first (a load then replaces what they wrote; a
  // failed one leaves the stepped state, as without deferral).
  TIERMEM_RETURN_IF_ERROR(stepper_->RunAllPending(true));
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Errno("checkpoint: cannot open " + path, errno);
  if (IsV1(fd)) {
    close(fd);
    if (how.verify_only) {
      return UnimplementedError("checkpoint: format-1 files load unverified only");
    }
    return LoadCheckpointV1(path, metadata, how);
  }
  // The tensor bytes are read with O_DIRECT when checkpoint_io says so and the file system
  // allows it (a second descriptor; the header is read through the first).
  bool direct = false;
  const int dfd = CheckpointsDirect(config_.checkpoint_io)
                      ? OpenMaybeDirect(path, O_RDONLY | O_CLOEXEC, 0, true, &direct)
                      : -1;
  Status s = LoadCheckpointV2(path, fd, dfd >= 0 ? dfd : fd, dfd >= 0 && direct, metadata, how);
  if (dfd >= 0) close(dfd);
  close(fd);
  return s.WithContext("checkpoint " + path);
}

namespace {

Status NothingLoaded(const std::string& what) {
  return InvalidArgumentError(what + ": nothing was loaded");
}

// The file's state format (compressed m and v: their block and map); nullopt for files
// without one, which hold fp32 state only.
StatusOr<std::optional<kernels::StateFormat>> FileStateFormat(const Header2& h) {
  auto it = h.meta.find("state_format");
  if (it == h.meta.end()) return std::optional<kernels::StateFormat>();
  const nlohmann::json f = nlohmann::json::parse(it->second, nullptr, false);
  StatusOr<kernels::StateDType> d = f.is_object() && f.contains("dtype") && f["dtype"].is_string()
                                        ? kernels::ParseStateDType(f["dtype"].get<std::string>())
                                        : StatusOr<kernels::StateDType>(DataLossError("no dtype"));
  if (!d.ok() || !f.contains("block") || !f["block"].is_number_unsigned()) {
    return DataLossError("checkpoint metadata 'state_format' is malformed: " + it->second);
  }
  kernels::StateFormat file_format;
  file_format.dtype = *d;
  file_format.block = f["block"].get<uint32_t>();
  TIERMEM_RETURN_IF_ERROR(
      kernels::ValidateStateFormat(file_format).WithContext("checkpoint metadata 'state_format'"));
  return std::optional<kernels::StateFormat>(file_format);
}

// Tensor `t`'s entries in the file `h` (what this model has, then what the file stores for
// it: values F32, m and v F32, BF16, or U8 with their absmax), with their place and checksum.
// May throw what the header's json throws (LoadPlanOf catches it).
Status TensorEntries(const Header2& h, const TensorSpec& t,
                     const std::optional<kernels::StateFormat>& file_format,
                     std::vector<Entry>* entries) {
  std::vector<std::pair<std::string, ChunkKind>> keys = {{t.name, ChunkKind::kParamFp32}};
  if (t.trainable) {
    for (ChunkKind kind : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
      keys.emplace_back(std::string(StatePrefix(kind)) + "/" + t.name, kind);
    }
  }
  for (const auto& [key, kind] : keys) {
    const weights::TensorInfo* e = h.file.Find(key);
    if (e == nullptr) {
      const bool frozen_there = key != t.name && h.file.Find(t.name) != nullptr;
      return NothingLoaded("checkpoint has no tensor '" + key + "'" +
                           (frozen_there ? " (the parameter was frozen when it was saved)" : "") +
                           "; this model has '" + t.name + "' (" + std::to_string(t.numel) +
                           " elements" + (t.trainable ? "" : ", frozen") + ")");
    }
    const uint64_t numel = e->numel;
    const std::string dtype(weights::DTypeName(e->dtype));
    const bool state = kind != ChunkKind::kParamFp32;
    const bool compressed = state && (dtype == "BF16" || dtype == "U8");
    if ((dtype != "F32" && !compressed) || numel != t.numel) {
      return NothingLoaded("checkpoint tensor '" + key + "' has " + std::to_string(numel) +
                           " elements of " + dtype + ", this model has '" + t.name + "' (" +
                           std::to_string(t.numel) + " elements, " +
                           (state ? "F32, BF16 or U8" : "F32") + ")");
    }
    if (dtype == "U8" && (!file_format || file_format->dtype != kernels::StateDType::kInt8)) {
      return DataLossError("checkpoint tensor '" + key +
                           "' is U8 but the file's "
                           "state_format is not int8: nothing was loaded");
    }
    Entry en;
    en.key = key;
    en.kind = kind;
    en.part = compressed ? Part::kCodes : Part::kValues;
    en.dtype = dtype;
    en.bytes = t.numel * (dtype == "F32" ? 4 : dtype == "BF16" ? 2 : 1);
    entries->push_back(en);
    if (dtype == "U8") {  // its absmax follow
      Entry a;
      a.key = std::string(StatePrefix(kind)) + "_absmax/" + t.name;
      a.kind = kind;
      a.part = Part::kAbsmax;
      a.dtype = "F32";
      a.bytes = kernels::StateBlocks(*file_format, t.numel) * 4;
      const weights::TensorInfo* ae = h.file.Find(a.key);
      if (ae == nullptr || ae->dtype != weights::DType::kF32) {
        return DataLossError("checkpoint has no F32 tensor '" + a.key + "' for the int8 '" + key +
                             "': nothing was loaded");
      }
      entries->push_back(a);
    }
  }
  for (Entry& en : *entries) {
    const weights::TensorInfo* info = h.file.Find(en.key);
    if (info->bytes() != en.bytes) {
      return NothingLoaded("checkpoint tensor '" + en.key + "' holds " +
                           std::to_string(info->bytes()) + " bytes, not the " +
                           std::to_string(en.bytes) + " of " + std::to_string(t.numel) +
                           " elements of " + en.dtype);
    }
    en.begin = info->begin;
    en.crc = h.crcs.at(en.key).get<std::string>();
  }
  return OkStatus();
}

// Everything a format-2 load needs, taken out of the header first (a malformed header is an
// error here, before anything changes): every tensor of this model and nothing else.
struct LoadPlan {
  std::vector<std::vector<Entry>> entries;  // by tensor, in file order
  std::vector<int64_t> steps;               // by tensor
  uint64_t micro = 0, max_numel = 0;
  ScalerState scaler;
};

StatusOr<LoadPlan> LoadPlanOf(const Header2& h, const std::vector<TensorSpec>& specs,
                              const std::optional<kernels::StateFormat>& file_format) {
  LoadPlan plan;
  plan.entries.resize(specs.size());
  plan.steps.resize(specs.size());
  try {
    size_t expected = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorSpec& t = specs[i];
      plan.max_numel = std::max(plan.max_numel, t.numel);
      TIERMEM_RETURN_IF_ERROR(TensorEntries(h, t, file_format, &plan.entries[i]));
      expected += plan.entries[i].size();
      plan.steps[i] = h.steps.at(t.name).get<int64_t>();
    }
    if (h.file.tensors.size() != expected) {
      return NothingLoaded("checkpoint holds " + std::to_string(h.file.tensors.size()) +
                           " tensors (values and Adam state), this model has " +
                           std::to_string(expected));
    }
    plan.micro = std::stoull(h.meta.at("micro_steps"));
    plan.scaler.scale = std::stod(h.meta.at("loss_scale"));
    plan.scaler.good_steps = std::stoi(h.meta.at("good_steps"));
    plan.scaler.skipped_steps = std::stoull(h.meta.at("skipped_steps"));
  } catch (const std::exception& e) {
    return DataLossError(std::string("checkpoint header is malformed (") + e.what() +
                         "): nothing was loaded");
  }
  return plan;
}

// Says once, after a load, which m and v were stored in another format than this session's
// ("int8 (block 256) -> fp32" -> tensors) and were converted.
void WarnConversions(const std::map<std::string, size_t>& conversions) {
  for (const auto& [what, n] : conversions) {
    TIERMEM_LOG(kWarn) << "checkpoint: the optimizer state of " << n << " tensor(s) was saved as "
                       << what.substr(0, what.find(" -> ")) << " and is converted to this "
                       << "session's " << what.substr(what.find(" -> ") + 4)
                       << " (optimizer.state_dtype): "
                       << (what.rfind("fp32", 0) == 0 ? "quantized"
                                                      : "dequantized, then "
                                                        "stored in the new format");
  }
}

}  // namespace

Status Session::LoadCheckpointV2(const std::string& path, int fd, int data_fd, bool direct,
                                 CheckpointMeta* metadata, const CheckpointLoad& how) {
  const bool verify_only = how.verify_only;
  TIERMEM_ASSIGN_OR_RETURN(Header2 h, ReadHeader2(fd, path));
  TIERMEM_ASSIGN_OR_RETURN(CheckpointMeta meta, MetaOf(h));
  TIERMEM_RETURN_IF_ERROR(CheckCheckpointMeta(meta, how));
  TIERMEM_ASSIGN_OR_RETURN(const std::optional<kernels::StateFormat> stored_format,
                           FileStateFormat(h));
  const kernels::StateFormat file_format = stored_format.value_or(kernels::StateFormat{});
  TIERMEM_ASSIGN_OR_RETURN(LoadPlan plan, LoadPlanOf(h, layout_.specs, stored_format));
  const std::vector<std::vector<Entry>>& entries = plan.entries;
  const uint64_t max_numel = plan.max_numel;
  // The read target without O_DIRECT; with it the values are used where they land in
  // `scratch`, copied here only when a file puts a tensor at an offset that is not a multiple
  // of 4 (safetensors does not require one; tiermem's files never do it). A tensor's codes
  // are kept in `codes` while its absmax are read.
  std::vector<float> buf(max_numel), absmax(max_numel / kernels::kMinStateBlock + 1);
  std::vector<char> codes(max_numel * 2);
  AlignedBuf scratch = direct ? NewAligned(max_numel * 4 + 2 * kBlock) : nullptr;
  if (direct && !scratch)
    return ResourceExhaustedError("checkpoint: no memory for the read buffer");
  // m and v stored in another format than this session's: converted (dequantized, then
  // quantized to the session's format); said once, after the load.
  std::map<std::string, size_t> conversions;  // "int8 (block 256) -> fp32" -> tensors
  auto apply_state = [&](size_t i, ChunkKind kind, const kernels::StateFormat& stored,
                         const char* code_bytes, const float* values) -> Status {
    const kernels::StateFormat& mine = layout_.groups[layout_.tensors[i].group].state;
    const bool same = stored.dtype == mine.dtype &&
                      (stored.dtype != kernels::StateDType::kInt8 || stored.block == mine.block);
    if (same && stored.compressed()) return WriteStateRaw(i, kind, code_bytes, absmax.data());
    if (!same) ++conversions[FormatName(stored) + " -> " + FormatName(mine)];
    if (stored.compressed()) {
      kernels::DequantizeState(stored, kind == ChunkKind::kExpAvg,
                               {const_cast<char*>(code_bytes), absmax.data()}, buf.data(),
                               layout_.specs[i].numel);
      values = buf.data();
    }
    return WriteTensor(i, kind, values);
  };
  // Pass 0 verifies every tensor's checksum; pass 1 applies.
  for (int pass = 0; pass < (verify_only ? 1 : 2); ++pass) {
    for (size_t i = 0; i < layout_.specs.size(); ++i) {
      for (const Entry& e : entries[i]) {
        StatusOr<const char*> at =
            ReadRange(data_fd, direct, scratch.get(), reinterpret_cast<char*>(buf.data()), e.bytes,
                      h.file.data_start + e.begin);
        Status s = at.status();
        if (s.ok() && Hex8(Crc32c(*at, e.bytes)) != e.crc) {
          s = DataLossError("tensor '" + e.key + "': checksum mismatch");
        }
        if (s.ok() && pass == 0 && e.kind == ChunkKind::kParamFp32 && ComputeOnly(i)) {
          // A tensor keeping no fp32 master (layout.h, compute_only) takes only values exact
          // in the compute dtype: any other refuses the checkpoint before anything changes.
          const char* bytes = *at;
          if (reinterpret_cast<uintptr_t>(bytes) % alignof(float) != 0) {
            std::memmove(buf.data(), bytes, e.bytes);
            bytes = reinterpret_cast<const char*>(buf.data());
          }
          s = CheckExact(i, 0, layout_.specs[i].numel, reinterpret_cast<const float*>(bytes));
        }
        if (s.ok() && pass == 1) {
          const char* bytes = *at;
          if (e.part != Part::kValues || reinterpret_cast<uintptr_t>(bytes) % alignof(float) != 0) {
            char* to = e.part == Part::kCodes    ? codes.data()
                       : e.part == Part::kAbsmax ? reinterpret_cast<char*>(absmax.data())
                                                 : reinterpret_cast<char*>(buf.data());
            if (to != bytes) std::memmove(to, bytes, e.bytes);
            bytes = to;
          }
          const float* values = reinterpret_cast<const float*>(bytes);
          kernels::StateFormat stored;  // kF32 for values
          if (e.dtype == "BF16") stored.dtype = kernels::StateDType::kBF16;
          if (e.part == Part::kAbsmax) stored = file_format;  // U8: applied with its absmax
          if (e.kind == ChunkKind::kParamFp32) {
            s = WriteParam(i, values);
          } else if (e.part == Part::kValues || e.dtype == "BF16") {
            s = apply_state(i, e.kind, stored, codes.data(), values);
          } else if (e.part == Part::kAbsmax) {
            s = apply_state(i, e.kind, stored, codes.data(), nullptr);
          }  // U8 codes: applied when their absmax come
        }
        if (!s.ok()) {
          return s.WithContext(pass == 0 ? "nothing was loaded" : "the file changed while loading");
        }
      }
    }
  }
  WarnConversions(conversions);
  if (verify_only) {
    if (metadata != nullptr) *metadata = std::move(meta);
    return OkStatus();
  }
  for (size_t i = 0; i < plan.steps.size(); ++i) stepper_->set_step_count(i, plan.steps[i]);
  // Gradients are not part of a checkpoint: the next backward starts them afresh.
  micro_ = plan.micro;
  accumulating_ = false;
  std::fill(has_grad_.begin(), has_grad_.end(), 0);
  if (config_.precision == Precision::kFp16) scaler_ = plan.scaler;
  if (metadata != nullptr) *metadata = std::move(meta);
  return OkStatus();
}

Status Session::LoadCheckpointV1(const std::string& path, CheckpointMeta* metadata,
                                 const CheckpointLoad& how) {
  uint64_t max_numel = 0;
  for (const TensorSpec& t : layout_.specs) max_numel = std::max(max_numel, t.numel);
  std::vector<float> buf(max_numel);
  // Pass 0 verifies; pass 1 applies. Both read the whole file the same way.
  for (int pass = 0; pass < 2; ++pass) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Errno("checkpoint: cannot open " + path, errno);
    Reader r(fd);
    Status s;
    Header h;
    s = ReadHeader(r, &h);
    CheckpointMeta meta;
    if (s.ok()) {
      StatusOr<CheckpointMeta> m = ParseLegacyCheckpointMeta(h.metadata);
      s = m.ok() ? CheckCheckpointMeta(*m, how) : m.status();
      if (s.ok()) meta = *std::move(m);
    }
    if (s.ok() && h.num_tensors != layout_.specs.size()) {
      s = InvalidArgumentError("checkpoint holds " + std::to_string(h.num_tensors) +
                               " tensors, this model has " + std::to_string(layout_.specs.size()));
    }
    std::vector<uint32_t> record_crcs;
    for (size_t i = 0; i < layout_.specs.size() && s.ok(); ++i) {
      const TensorSpec& t = layout_.specs[i];
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
        s = InvalidArgumentError("checkpoint tensor " + std::to_string(i) + " is '" + name + "' (" +
                                 std::to_string(numel) + " elements" +
                                 (trainable ? "" : ", frozen") + "), this model has '" + t.name +
                                 "' (" + std::to_string(t.numel) + " elements" +
                                 (t.trainable ? "" : ", frozen") + ")");
      }
      std::vector<ChunkKind> kinds = {ChunkKind::kParamFp32};
      if (t.trainable) kinds.insert(kinds.end(), {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq});
      for (ChunkKind k : kinds) {
        if (s.ok()) s = r.Get(buf.data(), t.numel * sizeof(float));
        if (s.ok() && pass == 0 && k == ChunkKind::kParamFp32 && ComputeOnly(i)) {
          s = CheckExact(i, 0, t.numel, buf.data());  // refused before anything changes
        }
        if (s.ok() && pass == 1) {
          s = k == ChunkKind::kParamFp32 ? WriteParam(i, buf.data())
                                         : WriteTensor(i, k, buf.data());
        }
      }
      if (pass == 1 && s.ok()) stepper_->set_step_count(i, step);
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
      if (metadata != nullptr) *metadata = std::move(meta);
    }
  }
  return OkStatus();
}

}  // namespace tiermem::session
