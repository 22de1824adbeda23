// Trace validation, the file format and the builder.
//
// File format (little-endian; docs/trace-format.md is the prose version):
//
//   file     := header payload
//   header   := magic[8] "TMTRACE\x1a" | u32 version | u32 header_bytes (=32)
//               | u64 payload_bytes | u32 crc32c(payload) | u32 crc32c(header bytes 0..27)
//   payload  := section*
//   section  := u32 kind | u32 bytes | bytes of body
//   kind 1 (meta, once, first):  u32 cpu_cores | u32 reserved | f64 cpu_optim_elems_per_s
//               | f64 device_optim_elems_per_s | u64 budget_device | u64 budget_host
//               | u64 budget_nvme | 9 x (f64 bytes_per_s | u64 latency_ns) for link[src][dst]
//               in row-major TierKind order | u32 n | n bytes of source text
//   kind 2 (chunk kinds, once):  u32 count | count x (u16 len | len bytes)
//   kind 3 (chunks, once):       u32 count | count x (u64 bytes | u32 group | u8 category
//               | u8 home | u16 kind)                                           (16 bytes each)
//   kind 4 (iteration, repeated, in order): u32 moments | u32 accesses
//               | moments x (u8 kind | u8 reserved | u16 label_len | u32 unit | u32 accesses
//                 | u64 compute_ns | u64 activation_bytes | u64 saved_bytes | u64 work_elems
//                 | label_len bytes of label)
//               | accesses x (u32 chunk | u8 mode | u8 tier | u16 reserved)      (8 bytes each)
//   kind 5 (expert sets, version 2, at most once, after kind 3): u32 count (= chunks)
//               | count x u32 expert_set (0xffffffff: dense)
//   other kinds: skipped (a later minor revision may add sections; an incompatible change
//   bumps the version).
//
// Errors: a file that is not a trace (magic) or of a newer version is kInvalidArgument; a
// torn file (shorter than the header says), a checksum mismatch or framing that does not add
// up is kDataLoss naming the byte offset; a well-formed file whose content breaks an
// invariant is kInvalidArgument from ValidateTrace.
//
// Versions: a trace with expert sets is written as version 2 (kind 5 present); one without as
// version 1, byte for byte what version-1 builds wrote (they keep reading dense traces, and
// refuse a trace whose experts they would plan as dense chunks). Both decode to the current
// in-memory version (every chunk dense when kind 5 is absent).
#include "planners/trace.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include "base/crc32c.h"

namespace tiermem::planners {
namespace {

constexpr char kMagic[8] = {'T', 'M', 'T', 'R', 'A', 'C', 'E', '\x1a'};
constexpr size_t kHeaderBytes = 32;
constexpr uint32_t kSectionMeta = 1;
constexpr uint32_t kSectionKinds = 2;
constexpr uint32_t kSectionChunks = 3;
constexpr uint32_t kSectionIteration = 4;
constexpr uint32_t kSectionExpertSets = 5;
constexpr size_t kMomentFixedBytes = 44;
constexpr size_t kChunkBytes = 16;
constexpr size_t kAccessBytes = 8;

std::string MomentName(const TraceIteration& it, size_t iter, size_t m) {
  return "iteration " + std::to_string(iter) + " moment " + std::to_string(m) + " (" +
         it.moments[m].label + ")";
}

// ---- encoding helpers --------------------------------------------------------------------
class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Raw(&v, 2); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void F64(double v) { Raw(&v, 8); }
  void Bytes(std::string_view s) { out_.append(s); }
  size_t size() const { return out_.size(); }
  void PatchU32(size_t at, uint32_t v) { std::memcpy(&out_[at], &v, 4); }
  std::string& str() { return out_; }

 private:
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string out_;
};
static_assert(std::endian::native == std::endian::little, "the trace format is little-endian");

class Reader {
 public:
  Reader(std::string_view data, size_t base) : data_(data), base_(base) {}
  bool Has(size_t n) const { return data_.size() - pos_ >= n; }
  uint8_t U8() { return static_cast<uint8_t>(data_[pos_++]); }
  uint16_t U16() { return Get<uint16_t>(); }
  uint32_t U32() { return Get<uint32_t>(); }
  uint64_t U64() { return Get<uint64_t>(); }
  double F64() { return Get<double>(); }
  std::string_view Take(size_t n) {
    std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  size_t pos() const { return pos_; }
  size_t offset() const { return base_ + pos_; }  // byte offset in the file
  size_t left() const { return data_.size() - pos_; }

 private:
  template <typename T>
  T Get() {
    T v;
    std::memcpy(&v, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view data_;
  size_t pos_ = 0;
  size_t base_;
};

Status Torn(const Reader& r, std::string_view what, size_t need) {
  return DataLossError("trace: " + std::string(what) + " at byte " + std::to_string(r.offset()) +
                       " needs " + std::to_string(need) + " bytes, only " +
                       std::to_string(r.left()) + " left in its section");
}

}  // namespace

std::string_view MomentKindName(MomentKind k) {
  switch (k) {
    case MomentKind::kPreForward:
      return "pre-forward";
    case MomentKind::kPreBackward:
      return "pre-backward";
    case MomentKind::kOptimizerStep:
      return "optimizer-substep";
    case MomentKind::kOther:
      return "other";
  }
  return "?";
}

std::string_view AccessModeName(AccessMode m) {
  switch (m) {
    case AccessMode::kRead:
      return "read";
    case AccessMode::kWrite:
      return "write";
    case AccessMode::kReadWrite:
      return "read-write";
  }
  return "?";
}

Bytes Trace::TotalChunkBytes() const {
  Bytes n = 0;
  for (const TraceChunk& c : chunks) n += c.bytes;
  return n;
}

Bytes Trace::MaxChunkBytes() const {
  Bytes n = 0;
  for (const TraceChunk& c : chunks) n = std::max(n, c.bytes);
  return n;
}

std::string_view Trace::KindName(ChunkId c) const {
  if (c >= chunks.size() || chunks[c].kind >= kind_names.size()) return "?";
  return kind_names[chunks[c].kind];
}

bool Trace::HasExpertSets() const {
  for (const TraceChunk& c : chunks) {
    if (c.expert_set != kNoExpertSet) return true;
  }
  return false;
}

uint32_t Trace::NumGroups() const {
  uint32_t n = 0;
  for (const TraceChunk& c : chunks) n = std::max(n, c.group + 1);
  return n;
}

Status ValidateTrace(const Trace& t) {
  if (t.version != kTraceVersion) {
    return InvalidArgumentError("trace: version " + std::to_string(t.version) +
                                ", this build handles " + std::to_string(kTraceVersion));
  }
  if (t.kind_names.size() > 0xffff) return InvalidArgumentError("trace: more than 65535 kinds");
  for (size_t i = 0; i < t.kind_names.size(); ++i) {
    if (t.kind_names[i].empty() || t.kind_names[i].size() > 0xffff) {
      return InvalidArgumentError("trace: chunk kind " + std::to_string(i) +
                                  " has an empty or over-long name");
    }
  }
  if (t.chunks.size() >= kNoChunk) return InvalidArgumentError("trace: too many chunks");
  for (size_t c = 0; c < t.chunks.size(); ++c) {
    const TraceChunk& ch = t.chunks[c];
    const std::string what = "trace: chunk " + std::to_string(c);
    if (ch.bytes == 0) return InvalidArgumentError(what + " has 0 bytes");
    if (static_cast<int>(ch.category) >= kNumCategories) {
      return InvalidArgumentError(what + " has an unknown category " +
                                  std::to_string(static_cast<int>(ch.category)));
    }
    if (ch.home != TierKind::kHost && ch.home != TierKind::kNvme) {
      return InvalidArgumentError(what + ": its home must be host or nvme, not " +
                                  std::string(TierKindName(ch.home)));
    }
    if (ch.group >= t.chunks.size()) {
      return InvalidArgumentError(what + " has group index " + std::to_string(ch.group) +
                                  ", but groups are numbered below the chunk count (" +
                                  std::to_string(t.chunks.size()) + ")");
    }
    if (ch.kind >= t.kind_names.size()) {
      return InvalidArgumentError(what + " has kind index " + std::to_string(ch.kind) +
                                  " but the kind table has " + std::to_string(t.kind_names.size()) +
                                  " names");
    }
  }
  auto bad_rate = [](double v) { return !std::isfinite(v) || v < 0; };
  if (bad_rate(t.rates.cpu_optim_elems_per_s) || bad_rate(t.rates.device_optim_elems_per_s)) {
    return InvalidArgumentError("trace: optimizer rates must be finite and >= 0");
  }
  for (const auto& row : t.rates.link) {
    for (const LinkRate& l : row) {
      if (bad_rate(l.bytes_per_s)) {
        return InvalidArgumentError("trace: copy rates must be finite and >= 0");
      }
    }
  }
  std::vector<uint64_t> seen_moment(t.chunks.size(), 0);
  std::vector<TierKind> seen_tier(t.chunks.size(), TierKind::kNone);
  uint64_t stamp = 0;
  for (size_t it = 0; it < t.iterations.size(); ++it) {
    const TraceIteration& iter = t.iterations[it];
    uint64_t next = 0;
    for (size_t m = 0; m < iter.moments.size(); ++m) {
      const Moment& mo = iter.moments[m];
      ++stamp;
      if (static_cast<int>(mo.kind) >= kNumMomentKinds) {
        return InvalidArgumentError("trace: iteration " + std::to_string(it) + " moment " +
                                    std::to_string(m) + " has an unknown kind " +
                                    std::to_string(static_cast<int>(mo.kind)));
      }
      const std::string where = "trace: " + MomentName(iter, it, m);
      if (mo.label.size() > 0xffff) return InvalidArgumentError(where + ": label too long");
      if (mo.first_access != next) {
        return InvalidArgumentError(
            where + ": its accesses start at " + std::to_string(mo.first_access) + ", expected " +
            std::to_string(next) + " (accesses recorded outside a moment?)");
      }
      next += mo.num_accesses;
      if (next > iter.accesses.size()) {
        return InvalidArgumentError(where + ": access range runs past the iteration's " +
                                    std::to_string(iter.accesses.size()) + " accesses");
      }
      if (mo.unit != kNoUnit && mo.unit >= kMaxUnits) {
        return InvalidArgumentError(where + ": unit id " + std::to_string(mo.unit) +
                                    " is not below " + std::to_string(kMaxUnits));
      }
      if (mo.saved_bytes > 0 && (mo.kind != MomentKind::kPreForward || mo.unit == kNoUnit)) {
        return InvalidArgumentError(where +
                                    ": saved_bytes is only meaningful on the "
                                    "pre-forward moment of a unit");
      }
      if (mo.saved_bytes > mo.activation_bytes) {
        return InvalidArgumentError(where + ": saves " + std::to_string(mo.saved_bytes) +
                                    " bytes but only " + std::to_string(mo.activation_bytes) +
                                    " non-chunk bytes are live");
      }
      for (uint32_t a = 0; a < mo.num_accesses; ++a) {
        const TraceAccess& acc = iter.accesses[mo.first_access + a];
        const std::string aw = where + " access " + std::to_string(a);
        if (acc.chunk >= t.chunks.size()) {
          return InvalidArgumentError(aw + ": unknown chunk " + std::to_string(acc.chunk) +
                                      " (the chunk table has " + std::to_string(t.chunks.size()) +
                                      " chunks)");
        }
        if (static_cast<int>(acc.mode) >= kNumAccessModes) {
          return InvalidArgumentError(aw + ": unknown access mode " +
                                      std::to_string(static_cast<int>(acc.mode)));
        }
        if (acc.tier != TierKind::kDevice && acc.tier != TierKind::kHost) {
          return InvalidArgumentError(aw + ": chunks are accessed on device or host, not " +
                                      std::string(TierKindName(acc.tier)));
        }
        // The tier this moment first accessed the chunk on (stamped per moment: linear).
        if (seen_moment[acc.chunk] == stamp && seen_tier[acc.chunk] != acc.tier) {
          return InvalidArgumentError(aw + ": chunk " + std::to_string(acc.chunk) +
                                      " is accessed on both the device and the host in one "
                                      "moment");
        }
        seen_moment[acc.chunk] = stamp;
        seen_tier[acc.chunk] = acc.tier;
      }
    }
    if (next != iter.accesses.size()) {
      return InvalidArgumentError("trace: iteration " + std::to_string(it) + " has " +
                                  std::to_string(iter.accesses.size() - next) +
                                  " accesses outside any moment");
    }
  }
  return OkStatus();
}

// ---- file format -------------------------------------------------------------------------
std::string EncodeTrace(const Trace& t) {
  Writer p;
  auto begin_section = [&p](uint32_t kind) {
    p.U32(kind);
    const size_t at = p.size();
    p.U32(0);
    return at;
  };
  auto end_section = [&p](size_t at) { p.PatchU32(at, static_cast<uint32_t>(p.size() - at - 4)); };
  size_t s = begin_section(kSectionMeta);
  p.U32(t.rates.cpu_cores);
  p.U32(0);
  p.F64(t.rates.cpu_optim_elems_per_s);
  p.F64(t.rates.device_optim_elems_per_s);
  p.U64(t.budgets.device);
  p.U64(t.budgets.host);
  p.U64(t.budgets.nvme);
  for (const auto& row : t.rates.link) {
    for (const LinkRate& l : row) {
      p.F64(l.bytes_per_s);
      p.U64(l.latency_ns);
    }
  }
  p.U32(static_cast<uint32_t>(t.source.size()));
  p.Bytes(t.source);
  end_section(s);

  s = begin_section(kSectionKinds);
  p.U32(static_cast<uint32_t>(t.kind_names.size()));
  for (const std::string& k : t.kind_names) {
    p.U16(static_cast<uint16_t>(k.size()));
    p.Bytes(k);
  }
  end_section(s);

  s = begin_section(kSectionChunks);
  p.U32(static_cast<uint32_t>(t.chunks.size()));
  for (const TraceChunk& c : t.chunks) {
    p.U64(c.bytes);
    p.U32(c.group);
    p.U8(static_cast<uint8_t>(c.category));
    p.U8(static_cast<uint8_t>(c.home));
    p.U16(c.kind);
  }
  end_section(s);

  for (const TraceIteration& it : t.iterations) {
    s = begin_section(kSectionIteration);
    p.U32(static_cast<uint32_t>(it.moments.size()));
    p.U32(static_cast<uint32_t>(it.accesses.size()));
    for (const Moment& m : it.moments) {
      p.U8(static_cast<uint8_t>(m.kind));
      p.U8(0);
      p.U16(static_cast<uint16_t>(m.label.size()));
      p.U32(m.unit);
      p.U32(m.num_accesses);
      p.U64(m.compute_ns);
      p.U64(m.activation_bytes);
      p.U64(m.saved_bytes);
      p.U64(m.work_elems);
      p.Bytes(m.label);
    }
    for (const TraceAccess& a : it.accesses) {
      p.U32(a.chunk);
      p.U8(static_cast<uint8_t>(a.mode));
      p.U8(static_cast<uint8_t>(a.tier));
      p.U16(0);
    }
    end_section(s);
  }

  const bool experts = t.HasExpertSets();
  if (experts) {
    s = begin_section(kSectionExpertSets);
    p.U32(static_cast<uint32_t>(t.chunks.size()));
    for (const TraceChunk& c : t.chunks) p.U32(c.expert_set);
    end_section(s);
  }

  Writer h;
  h.Bytes(std::string_view(kMagic, sizeof(kMagic)));
  h.U32(experts ? kTraceVersion : 1);
  h.U32(static_cast<uint32_t>(kHeaderBytes));
  h.U64(p.size());
  h.U32(Crc32c(p.str().data(), p.size()));
  h.U32(Crc32c(h.str().data(), h.size()));
  return h.str() + p.str();
}

namespace {

Status DecodeMeta(Reader& r, Trace* t) {
  constexpr size_t kFixed = 4 + 4 + 8 + 8 + 24 + 9 * 16 + 4;
  if (!r.Has(kFixed)) return Torn(r, "meta section", kFixed);
  t->rates.cpu_cores = r.U32();
  r.U32();
  t->rates.cpu_optim_elems_per_s = r.F64();
  t->rates.device_optim_elems_per_s = r.F64();
  t->budgets.device = r.U64();
  t->budgets.host = r.U64();
  t->budgets.nvme = r.U64();
  for (auto& row : t->rates.link) {
    for (LinkRate& l : row) {
      l.bytes_per_s = r.F64();
      l.latency_ns = r.U64();
    }
  }
  const uint32_t n = r.U32();
  if (!r.Has(n)) return Torn(r, "source text", n);
  t->source = std::string(r.Take(n));
  return OkStatus();
}

Status DecodeKinds(Reader& r, Trace* t) {
  if (!r.Has(4)) return Torn(r, "kind count", 4);
  const uint32_t n = r.U32();
  if (n > r.left() / 2) return Torn(r, "kind table", size_t{n} * 2);
  for (uint32_t i = 0; i < n; ++i) {
    if (!r.Has(2)) return Torn(r, "kind name length", 2);
    const uint16_t len = r.U16();
    if (!r.Has(len)) return Torn(r, "kind name", len);
    t->kind_names.emplace_back(r.Take(len));
  }
  return OkStatus();
}

Status DecodeChunks(Reader& r, Trace* t) {
  if (!r.Has(4)) return Torn(r, "chunk count", 4);
  const uint32_t n = r.U32();
  if (n > r.left() / kChunkBytes) return Torn(r, "chunk table", size_t{n} * kChunkBytes);
  t->chunks.resize(n);
  for (TraceChunk& c : t->chunks) {
    c.bytes = r.U64();
    c.group = r.U32();
    c.category = static_cast<Category>(r.U8());
    c.home = static_cast<TierKind>(r.U8());
    c.kind = r.U16();
  }
  return OkStatus();
}

Status DecodeExpertSets(Reader& r, Trace* t) {
  if (!r.Has(4)) return Torn(r, "expert set count", 4);
  const uint32_t n = r.U32();
  if (n != t->chunks.size()) {
    return DataLossError("trace: the expert-set section has " + std::to_string(n) +
                         " entries for " + std::to_string(t->chunks.size()) + " chunks (at byte " +
                         std::to_string(r.offset() - 4) + ")");
  }
  if (n > r.left() / 4) return Torn(r, "expert set table", size_t{n} * 4);
  for (TraceChunk& c : t->chunks) c.expert_set = r.U32();
  return OkStatus();
}

Status DecodeIteration(Reader& r, Trace* t) {
  if (!r.Has(8)) return Torn(r, "iteration counts", 8);
  const uint32_t nm = r.U32();
  const uint32_t na = r.U32();
  if (nm > r.left() / kMomentFixedBytes) {
    return Torn(r, "moment table", size_t{nm} * kMomentFixedBytes);
  }
  TraceIteration& it = t->iterations.emplace_back();
  it.moments.resize(nm);
  uint64_t first = 0;
  for (Moment& m : it.moments) {
    if (!r.Has(kMomentFixedBytes)) return Torn(r, "moment", kMomentFixedBytes);
    m.kind = static_cast<MomentKind>(r.U8());
    r.U8();
    const uint16_t len = r.U16();
    m.unit = r.U32();
    m.num_accesses = r.U32();
    m.compute_ns = r.U64();
    m.activation_bytes = r.U64();
    m.saved_bytes = r.U64();
    m.work_elems = r.U64();
    if (!r.Has(len)) return Torn(r, "moment label", len);
    m.label = std::string(r.Take(len));
    if (first + m.num_accesses > na) {
      return DataLossError("trace: moment '" + m.label + "' ending at byte " +
                           std::to_string(r.offset()) + " claims accesses past the " +
                           std::to_string(na) + " of its iteration");
    }
    m.first_access = static_cast<uint32_t>(first);
    first += m.num_accesses;
  }
  if (na > r.left() / kAccessBytes) return Torn(r, "access table", size_t{na} * kAccessBytes);
  it.accesses.resize(na);
  for (TraceAccess& a : it.accesses) {
    a.chunk = r.U32();
    a.mode = static_cast<AccessMode>(r.U8());
    a.tier = static_cast<TierKind>(r.U8());
    a.reserved = r.U16();
  }
  return OkStatus();
}

}  // namespace

StatusOr<Trace> DecodeTrace(std::string_view bytes) {
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return InvalidArgumentError("trace: not a tiermem trace file (bad magic)");
  }
  if (bytes.size() < kHeaderBytes) {
    return DataLossError("trace: file ends at byte " + std::to_string(bytes.size()) +
                         " inside the " + std::to_string(kHeaderBytes) + "-byte header");
  }
  Reader h(bytes.substr(0, kHeaderBytes), 0);
  h.Take(sizeof(kMagic));
  const uint32_t version = h.U32();
  const uint32_t header_bytes = h.U32();
  const uint64_t payload_bytes = h.U64();
  const uint32_t payload_crc = h.U32();
  const uint32_t header_crc = h.U32();
  if (Crc32c(bytes.data(), kHeaderBytes - 4) != header_crc) {
    return DataLossError("trace: header checksum mismatch (bytes 0.." +
                         std::to_string(kHeaderBytes - 1) + ")");
  }
  if (version > kTraceVersion) {
    return InvalidArgumentError("trace: format version " + std::to_string(version) +
                                " is newer than this build reads (up to " +
                                std::to_string(kTraceVersion) + "); use a newer tiermem");
  }
  if (version == 0 || header_bytes != kHeaderBytes) {
    return DataLossError("trace: impossible header (version " + std::to_string(version) +
                         ", header_bytes " + std::to_string(header_bytes) + ")");
  }
  const uint64_t have = bytes.size() - kHeaderBytes;
  if (have < payload_bytes) {
    return DataLossError("trace: file is torn: it ends at byte " + std::to_string(bytes.size()) +
                         " but the header promises " + std::to_string(payload_bytes) +
                         " payload bytes after the " + std::to_string(kHeaderBytes) +
                         "-byte header (" + std::to_string(have) + " present)");
  }
  if (have > payload_bytes) {
    return DataLossError("trace: " + std::to_string(have - payload_bytes) +
                         " unexpected bytes after the payload at byte " +
                         std::to_string(kHeaderBytes + payload_bytes));
  }
  const std::string_view payload = bytes.substr(kHeaderBytes);
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  if (Crc32c(payload.data(), payload.size()) != payload_crc) {
    return DataLossError("trace: payload checksum mismatch (bytes " + std::to_string(kHeaderBytes) +
                         ".." + std::to_string(bytes.size() - 1) + " are corrupt)");
  }
#endif
  Trace t;  // in the current in-memory version whatever the file's
  Reader r(payload, kHeaderBytes);
  bool seen_meta = false, seen_kinds = false, seen_chunks = false, seen_experts = false;
  while (r.left() > 0) {
    if (!r.Has(8)) return Torn(r, "section header", 8);
    const uint32_t kind = r.U32();
    const uint32_t len = r.U32();
    if (!r.Has(len)) return Torn(r, "section " + std::to_string(kind), len);
    Reader body(r.Take(len), r.offset() - len);
    Status s;
    auto once = [&](bool* seen, const char* name) {
      if (*seen) {
        return DataLossError("trace: a second " + std::string(name) + " section at byte " +
                             std::to_string(body.offset() - 8));
      }
      *seen = true;
      return OkStatus();
    };
    switch (kind) {
      case kSectionMeta:
        s = once(&seen_meta, "meta");
        if (s.ok()) s = DecodeMeta(body, &t);
        break;
      case kSectionKinds:
        s = once(&seen_kinds, "kinds");
        if (s.ok()) s = DecodeKinds(body, &t);
        break;
      case kSectionChunks:
        s = once(&seen_chunks, "chunks");
        if (s.ok()) s = DecodeChunks(body, &t);
        break;
      case kSectionIteration:
        s = DecodeIteration(body, &t);
        break;
      case kSectionExpertSets:
        if (version < 2) continue;  // not defined in version 1: skipped as unknown
        s = once(&seen_experts, "expert-set");
        if (s.ok() && !seen_chunks) {
          s = DataLossError("trace: the expert-set section at byte " +
                            std::to_string(body.offset() - 8) + " comes before the chunks");
        }
        if (s.ok()) s = DecodeExpertSets(body, &t);
        break;
      default:
        continue;  // a section a later revision added: skip it
    }
    TIERMEM_RETURN_IF_ERROR(s);
    if (body.left() != 0) {
      return DataLossError("trace: section " + std::to_string(kind) + " has " +
                           std::to_string(body.left()) + " trailing bytes at byte " +
                           std::to_string(body.offset()));
    }
  }
  if (!seen_meta || !seen_kinds || !seen_chunks) {
    return DataLossError("trace: the meta, kinds or chunks section is missing");
  }
  TIERMEM_RETURN_IF_ERROR(ValidateTrace(t));
  return t;
}

Status WriteTraceFile(const Trace& trace, const std::string& path) {
  TIERMEM_RETURN_IF_ERROR(ValidateTrace(trace));
  const std::string bytes = EncodeTrace(trace);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return ErrnoToStatus(errno, "trace: open " + tmp);
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 || !ok) {
    std::remove(tmp.c_str());
    return ErrnoToStatus(err != 0 ? err : EIO, "trace: write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    return ErrnoToStatus(e, "trace: rename to " + path);
  }
  return OkStatus();
}

StatusOr<Trace> ReadTraceFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoToStatus(errno != 0 ? errno : ENOENT, "trace: open " + path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return IOError("trace: read " + path);
  auto t = DecodeTrace(bytes);
  if (!t.ok()) return t.status().WithContext(path);
  return t;
}

// ---- builder -----------------------------------------------------------------------------
void TraceBuilder::Misuse(std::string what) {
  if (misuse_.empty()) misuse_ = std::move(what);
}

void TraceBuilder::DeclareChunk(ChunkId id, const TraceChunk& chunk) {
  if (id >= kNoChunk) return Misuse("DeclareChunk: id " + std::to_string(id) + " is kNoChunk");
  if (id >= trace_.chunks.size()) {
    trace_.chunks.resize(size_t{id} + 1);
    declared_.resize(size_t{id} + 1, false);
  }
  if (declared_[id]) return Misuse("DeclareChunk: chunk " + std::to_string(id) + " declared twice");
  declared_[id] = true;
  trace_.chunks[id] = chunk;
}

uint16_t TraceBuilder::KindIndex(std::string_view name) {
  for (size_t i = 0; i < trace_.kind_names.size(); ++i) {
    if (trace_.kind_names[i] == name) return static_cast<uint16_t>(i);
  }
  trace_.kind_names.emplace_back(name);
  return static_cast<uint16_t>(trace_.kind_names.size() - 1);
}

void TraceBuilder::SetSource(std::string_view source) { trace_.source = std::string(source); }

void TraceBuilder::BeginIteration() {
  if (in_moment_) Misuse("BeginIteration inside a moment");
  in_moment_ = false;
  const size_t reserve = trace_.iterations.empty() ? 0 : trace_.iterations.back().accesses.size();
  cur_ = &trace_.iterations.emplace_back();
  cur_->accesses.reserve(reserve);
}

void TraceBuilder::BeginMoment(std::string_view label, MomentKind kind, uint32_t unit) {
  if (cur_ == &scratch_) return Misuse("BeginMoment before BeginIteration");
  if (in_moment_) Misuse("BeginMoment '" + std::string(label) + "' inside another moment");
  in_moment_ = true;
  Moment& m = cur_->moments.emplace_back();
  m.label = std::string(label);
  m.kind = kind;
  m.unit = unit;
  m.first_access = static_cast<uint32_t>(cur_->accesses.size());
}

void TraceBuilder::MarkWritten(ChunkId chunk) {
  for (auto it = cur_->accesses.rbegin(); it != cur_->accesses.rend(); ++it) {
    if (it->chunk != chunk) continue;
    if (it->mode == AccessMode::kRead) it->mode = AccessMode::kReadWrite;
    return;
  }
}

void TraceBuilder::SetActivationBytes(Bytes live_bytes) {
  if (!in_moment_) return Misuse("SetActivationBytes outside a moment");
  cur_->moments.back().activation_bytes = live_bytes;
}

void TraceBuilder::SetSavedBytes(Bytes saved_bytes) {
  if (!in_moment_) return Misuse("SetSavedBytes outside a moment");
  cur_->moments.back().saved_bytes = saved_bytes;
}

void TraceBuilder::SetWorkElems(uint64_t elems) {
  if (!in_moment_) return Misuse("SetWorkElems outside a moment");
  cur_->moments.back().work_elems = elems;
}

void TraceBuilder::EndMoment(uint64_t compute_ns) {
  if (!in_moment_) return Misuse("EndMoment without BeginMoment");
  in_moment_ = false;
  Moment& m = cur_->moments.back();
  m.compute_ns = compute_ns;
  m.num_accesses = static_cast<uint32_t>(cur_->accesses.size() - m.first_access);
}

void TraceBuilder::MarkExpertSet(ChunkId chunk, uint32_t set) {
  if (chunk >= kNoChunk) return Misuse("expert-set mark of chunk id " + std::to_string(chunk));
  if (chunk >= expert_marks_.size()) expert_marks_.resize(chunk + 1, kNoExpertSet);
  expert_marks_[chunk] = set;
}

StatusOr<Trace> TraceBuilder::Finish() {
  if (in_moment_) Misuse("Finish inside a moment");
  if (!scratch_.accesses.empty()) {
    Misuse(std::to_string(scratch_.accesses.size()) + " accesses before BeginIteration");
  }
  for (size_t i = 0; i < declared_.size(); ++i) {
    if (!declared_[i]) {
      Misuse("chunk " + std::to_string(i) + " was never declared (ids must be dense from 0)");
      break;
    }
  }
  Trace t = std::move(trace_);
  for (ChunkId c = 0; c < expert_marks_.size(); ++c) {
    if (expert_marks_[c] == kNoExpertSet) continue;
    if (c >= t.chunks.size()) {
      Misuse("expert-set mark of undeclared chunk " + std::to_string(c));
      break;
    }
    t.chunks[c].expert_set = expert_marks_[c];
  }
  expert_marks_.clear();
  std::string misuse = std::move(misuse_);
  trace_ = Trace();
  declared_.clear();
  scratch_ = TraceIteration();
  cur_ = &scratch_;
  in_moment_ = false;
  misuse_.clear();
  if (!misuse.empty()) return InvalidArgumentError("trace builder: " + misuse);
  TIERMEM_RETURN_IF_ERROR(ValidateTrace(t));
  return t;
}

}  // namespace tiermem::planners
