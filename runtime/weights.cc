// LoadWeights and ExportWeights (see weights.h for what they promise).
//
// The order of a load:
//   1. Validate (Validate): every segment against its checkpoint tensor and its session
//      tensor, every tensor's coverage, missing tensors and unused keys. Nothing is touched.
//   2. Plan (PlanParts): each segment is cut at its tensor's pieces into *parts* — runs of
//      source elements that land contiguously in one group's chunks — clipped to this rank's
//      shard; a part's source bytes are one span of its file (a transposed segment: the whole
//      source, scattered element by element into its one piece).
//   3. Batches (MakeBatches): the parts of every host-homed group form one batch, read in file
//      order (host homes are written in place, so any order works and reads stay sequential);
//      each NVMe-homed group is a batch of its own, so its fp32 chunk — acquired on the host,
//      a lazily zero chunk is not read from NVMe — is filled completely before it is written
//      home (never read back).
//   4. The batches (LoadBatches) as one pipeline, every stage busy at once: the SpanReader
//      (tiers/nvme/span_reader.h) reads all the batches' spans, batch after batch, with its
//      requests in flight ahead of the conversion (across batch boundaries too); on this
//      thread each request's bytes are converted to fp32 into the open batch's chunks as it
//      lands (the chunks acquired on the host when the batch's first bytes arrive; in mixed
//      precision the compute chunk then rounded from the fp32 one, DeriveLowp); when the next
//      batch's bytes arrive the batch is released and its NVMe-homed chunks start their write
//      home in the background (Engine::PlanEvict through ChunksFacet::WriteHome), which the
//      next batch's acquire waits for only when the host room for NVMe-homed chunks is full.
//      Staging stays the reader's plus that room. At the end every write is waited for
//      (Session::Flush), so a failed one is the load's error.
//   A compute_only group (layout.h: frozen, values exact in the compute dtype, no fp32 master)
//   has no fp32 chunk: its compute chunk takes the file's bytes as they are (the same dtype).
//   In place (serving; weights.h "Serving in place"): before the batches, PlanInPlace picks
//   the NVMe-homed compute chunks whose parts all read their own dtype, and HomeInPlace gives
//   each a file home of its parts' spans; their parts then write only the fp32 masters (mixed
//   precision) or nothing (fp32, and compute_only groups: the load reads nothing for them), and
//   DeriveLowp skips them.
// Acquires during a load are untraced: they are not part of the order training replays.
#include "runtime/weights.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <span>
#include <tuple>
#include <utility>

#include "runtime/session.h"
#include "runtime/tier_stack.h"
#include "tiers/nvme/file_homes.h"
#include "tiers/nvme/span_reader.h"

namespace tiermem::session {
namespace {

using weights::DType;
using weights::TensorInfo;
using weights::WeightFiles;

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}
std::vector<int64_t> Signed(const std::vector<uint64_t>& s) {
  return std::vector<int64_t>(s.begin(), s.end());
}

// A validated segment.
struct Source {
  size_t tensor = 0;
  const WeightSegment* seg = nullptr;
  uint32_t file = 0;
  const TensorInfo* info = nullptr;
  kernels::DType dtype = kernels::DType::kF32;  // in the file
  uint64_t rows = 0, cols = 0;                  // transposed: the file's [rows, cols]
};

// A run of one source's elements landing contiguously (or, transposed, scattered) in one
// group's chunks, in this rank's shard coordinates: chunk element = tensor element + shift.
struct Part {
  uint32_t source = 0;
  uint64_t src_elem = 0;  // first source element (transposed: 0, the whole source)
  uint64_t count = 0;     // source elements read (transposed: all of them)
  uint32_t group = 0;
  uint64_t dst = 0;        // first chunk element written (transposed: of the region here)
  uint64_t dst_count = 0;  // chunk elements written from dst on
  int64_t shift = 0;
};

// One load (the order of work in the file comment). Runs on the caller's thread, the
// session's; holds references to its arguments for the call and owns only its plan.
class Loader {
 public:
  Loader(Session& s, const WeightFiles& files, const std::vector<WeightTarget>& targets,
         const LoadWeightsOptions& options)
      : s_(s), files_(files), targets_(targets), options_(options) {}

  StatusOr<LoadWeightsReport> Run();

 private:
  Status Validate();
  Status CheckSegment(const WeightTarget& t, const WeightSegment& seg, Source* out) const;
  Status CheckCoverage(const WeightTarget& t) const;
  Status CheckUnused();
  void PlanParts();
  std::vector<std::vector<size_t>> MakeBatches() const;
  // One batch's reads: its spans in file order, the parts each feeds, its groups' parts.
  struct BatchPlan {
    std::vector<FileSpan> spans;
    std::vector<std::vector<size_t>> consumers;        // per span: the parts it feeds
    std::map<uint32_t, std::vector<size_t>> by_group;  // group -> its parts in the batch
  };
  BatchPlan PlanBatch(const std::vector<size_t>& batch);
  // Reads every batch's spans in one pipelined read (read -> convert -> write home).
  Status LoadBatches(SpanReader& reader, const std::vector<std::vector<size_t>>& batches);
  // Acquires batch `b`'s values chunks on the host into open_ (zeroing what it does not write).
  Status OpenBatch(const BatchPlan& b);
  // Ends the open batch: with `s` ok, derives its compute chunks; releases its chunks (all of
  // them whatever `s`), and with no error starts writing its NVMe-homed ones home. Returns
  // `s` or the first error since.
  Status CloseBatch(const BatchPlan& b, Status s);
  // Why no chunk of this load can be read in place ("" when some may be).
  std::string NoneInPlace() const;
  // The groups whose compute chunk is homed in the files (in_place_; why each other NVMe-homed
  // one is not: not_in_place_), or the error in_place "on" makes of one that cannot be.
  // Changes nothing.
  Status PlanInPlace();
  // Why group `g`'s compute chunk cannot be read in place ("" if it can); `parts`: its parts.
  std::string NotInPlace(uint32_t g, const std::vector<size_t>& parts) const;
  // The NVMe room the session's placeholder homes not in in_place_ need (Session::AddChunk:
  // chunks expected in place that are not): kResourceExhausted naming it when the tier lacks
  // it. Changes nothing.
  Status CheckPlaceholderRoom() const;
  // Gives every in_place_ group's compute chunk its file home, and the placeholders left a home
  // of the NVMe tier's own.
  Status HomeInPlace();
  // Converts `k` elements of part `p`'s source, from source element `first` on, into its
  // group's values chunk (`bytes`: the file's bytes of those elements, any alignment): the
  // fp32 chunk, or a compute_only group's compute chunk, copied as they are (EmitSame: the
  // file holds the compute dtype, checked by CheckSegment).
  void Emit(const Part& p, char* values, uint64_t first, const char* bytes, uint64_t k);
  void EmitSame(const Part& p, uint16_t* chunk, uint64_t first, const char* bytes, uint64_t k);
  // Zeros the elements (of `elem_bytes` each) and the byte tail of a `bytes`-long chunk that
  // `parts` do not write.
  void ZeroGaps(char* chunk, Bytes bytes, size_t elem_bytes,
                const std::vector<size_t>& parts) const;
  Status DeriveLowp(size_t group, const float* fp32, const std::vector<size_t>& parts);
  std::string Where(const Source& src) const;

  Session& s_;
  const WeightFiles& files_;
  const std::vector<WeightTarget>& targets_;
  const LoadWeightsOptions& options_;
  std::vector<Source> sources_;
  std::vector<Part> parts_;
  std::map<uint32_t, std::vector<size_t>> in_place_;  // group -> its parts (PlanInPlace)
  std::map<uint32_t, std::string> not_in_place_;      // NVMe-homed group -> why not (same)
  std::map<uint32_t, char*> open_;  // the open batch's groups -> their acquired values chunk
  std::set<std::string> used_;
  LoadWeightsReport report_;
  static constexpr uint64_t kBlock = 1 << 16;  // elements Emit converts at once
  std::vector<float> block_ = std::vector<float>(kBlock);
  std::vector<uint16_t> half_ = std::vector<uint16_t>(kBlock);
};

std::string Loader::Where(const Source& src) const {
  return "tensor '" + s_.layout().spec(src.tensor).name + "': key '" + src.seg->key + "' in " +
         files_.files[src.file].path;
}

Status Loader::CheckSegment(const WeightTarget& t, const WeightSegment& seg, Source* out) const {
  const TensorSpec& spec = s_.layout().spec(t.tensor);
  Source src;
  src.tensor = t.tensor;
  src.seg = &seg;
  src.info = files_.Find(seg.key, &src.file);
  if (src.info == nullptr) {
    return InvalidArgumentError("weights: tensor '" + spec.name + "': the checkpoint " +
                                files_.path + " has no key '" + seg.key + "'");
  }
  const std::string where = "weights: " + Where(src);
  const std::optional<kernels::DType> d = ValueDType(src.info->dtype);
  if (!d) {
    return InvalidArgumentError(where + " is " + std::string(weights::DTypeName(src.info->dtype)) +
                                ": only F32, BF16 and F16 load into parameters");
  }
  src.dtype = *d;
  if (s_.layout().group(s_.layout().place(t.tensor).group).compute_only &&
      src.dtype != s_.layout().compute_dtype()) {
    const std::string cd(kernels::DTypeName(s_.layout().compute_dtype()));
    return InvalidArgumentError(where + " is " + std::string(kernels::DTypeName(src.dtype)) +
                                ", but the tensor keeps its values in " + cd +
                                " only (created with values_in_compute_dtype): load it from a " +
                                cd + " checkpoint, or create the session without that flag");
  }
  const std::vector<int64_t> file_shape = Signed(src.info->shape);
  const uint64_t n = src.info->numel;
  // A tensor's only segment expects the tensor's shape (reversed when transposed).
  std::vector<int64_t> want = seg.shape;
  if (want.empty() && t.segments.size() == 1 && seg.offset == 0 && !spec.shape.empty()) {
    want = spec.shape;
    if (seg.transpose && want.size() == 2) std::swap(want[0], want[1]);
  }
  if (!want.empty() && want != file_shape) {
    return InvalidArgumentError(where + " has shape " + ShapeText(file_shape) + ", expected " +
                                ShapeText(want));
  }
  if (seg.offset > spec.numel || n > spec.numel - seg.offset) {
    return InvalidArgumentError(where + " has " + std::to_string(n) + " elements " +
                                ShapeText(file_shape) + ", which from element " +
                                std::to_string(seg.offset) + " overrun the tensor's " +
                                std::to_string(spec.numel));
  }
  if (seg.transpose) {
    if (file_shape.size() != 2) {
      return InvalidArgumentError(where + " has shape " + ShapeText(file_shape) +
                                  ": a transposed segment is 2-D");
    }
    src.rows = src.info->shape[0];
    src.cols = src.info->shape[1];
  }
  if (seg.transpose) {  // its destination must lie in one piece (it is scattered there)
    int pieces = 0;
    for (const Piece& p : s_.layout().place(t.tensor).pieces) {
      pieces += p.begin < seg.offset + n && seg.offset < p.begin + p.numel;
    }
    if (pieces != 1) {
      return InvalidArgumentError(where + " is transposed into " + std::to_string(pieces) +
                                  " chunk pieces of the tensor: a transposed segment must land "
                                  "in one (use a larger chunk_size)");
    }
  }
  *out = src;
  return OkStatus();
}

Status Loader::CheckCoverage(const WeightTarget& t) const {
  const TensorSpec& spec = s_.layout().spec(t.tensor);
  std::vector<std::pair<uint64_t, const WeightSegment*>> segs;
  for (const WeightSegment& seg : t.segments) {
    segs.emplace_back(seg.offset, &seg);
  }
  std::sort(segs.begin(), segs.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  uint64_t at = 0;
  std::string last;
  for (const auto& [offset, seg] : segs) {
    if (offset != at) {
      return InvalidArgumentError(
          "weights: tensor '" + spec.name + "': key '" + seg->key + "' starts at element " +
          std::to_string(offset) + (offset > at ? ", leaving elements from " : ", overlapping ") +
          std::to_string(at) + (last.empty() ? "" : " (after key '" + last + "')") +
          (offset > at ? " without a source" : ""));
    }
    at += files_.Find(seg->key)->numel;
    last = seg->key;
  }
  if (at != spec.numel) {
    return InvalidArgumentError("weights: tensor '" + spec.name + "' has " +
                                std::to_string(spec.numel) + " elements, its keys cover " +
                                std::to_string(at) + " (the last: '" + last + "')");
  }
  return OkStatus();
}

Status Loader::CheckUnused() {
  std::vector<std::string> unexpected;
  for (const std::string& key : files_.Keys()) {
    if (used_.count(key)) continue;
    if (options_.ignore && options_.ignore(key)) {
      report_.ignored.push_back(key);
    } else {
      unexpected.push_back(key);
    }
  }
  if (unexpected.empty()) return OkStatus();
  std::string more;
  if (unexpected.size() > 1) {
    more = " (" + std::to_string(unexpected.size()) + " unexpected keys, also '" + unexpected[1] +
           "'" + (unexpected.size() > 2 ? ", ..." : "") + ")";
  }
  return InvalidArgumentError("weights: " + files_.FileOf(unexpected[0]) + " holds key '" +
                              unexpected[0] + "', which no parameter of the model uses" + more);
}

Status Loader::Validate() {
  std::vector<uint8_t> has(s_.layout().num_tensors(), 0);
  for (const WeightTarget& t : targets_) {
    if (t.tensor >= s_.layout().num_tensors()) {
      return InvalidArgumentError("weights: no session tensor " + std::to_string(t.tensor));
    }
    if (has[t.tensor]) {
      return InvalidArgumentError("weights: tensor '" + s_.layout().spec(t.tensor).name +
                                  "' is given sources twice");
    }
    if (t.segments.empty()) continue;
    has[t.tensor] = 1;
    for (const WeightSegment& seg : t.segments) {
      Source src;
      TIERMEM_RETURN_IF_ERROR(CheckSegment(t, seg, &src));
      used_.insert(seg.key);
      sources_.push_back(src);
    }
    TIERMEM_RETURN_IF_ERROR(CheckCoverage(t));
  }
  for (size_t i = 0; i < has.size(); ++i) {
    if (!has[i]) report_.missing.push_back(i);
  }
  if (options_.strict && !report_.missing.empty()) {
    const size_t n = report_.missing.size();
    return InvalidArgumentError("weights: tensor '" + s_.layout().spec(report_.missing[0]).name +
                                "' has no source in " + files_.path +
                                (n > 1 ? " (" + std::to_string(n) + " tensors are missing)" : "") +
                                "; pass strict=False to keep their own values");
  }
  return CheckUnused();
}

void Loader::PlanParts() {
  const uint64_t lo_shard = s_.layout().shard_begin,
                 hi_shard = s_.layout().shard_begin + s_.layout().shard_elems;
  for (uint32_t i = 0; i < sources_.size(); ++i) {
    const Source& src = sources_[i];
    const uint64_t begin = src.seg->offset, end = begin + src.info->numel;
    for (const Piece& p : s_.layout().place(src.tensor).pieces) {
      const uint64_t tlo = std::max(begin, p.begin), thi = std::min(end, p.begin + p.numel);
      if (tlo >= thi) continue;
      Part part;
      part.source = i;
      part.group = p.group;
      part.shift = static_cast<int64_t>(p.offset) - static_cast<int64_t>(p.begin) -
                   static_cast<int64_t>(lo_shard);
      // The elements of [tlo, thi) that fall in this rank's shard, in chunk coordinates.
      const uint64_t clo = std::max(p.offset + (tlo - p.begin), lo_shard);
      const uint64_t chi = std::min(p.offset + (thi - p.begin), hi_shard);
      if (clo >= chi) continue;
      part.dst = clo - lo_shard;
      part.dst_count = chi - clo;
      if (src.seg->transpose) {
        part.src_elem = 0;
        part.count = src.info->numel;
      } else {
        part.src_elem = (clo - p.offset + p.begin) - begin;
        part.count = chi - clo;
      }
      parts_.push_back(part);
    }
  }
}

std::vector<std::vector<size_t>> Loader::MakeBatches() const {
  std::vector<std::vector<size_t>> out(1);  // out[0]: every host-homed group's parts
  std::map<uint32_t, size_t> nvme;          // NVMe-homed group -> its batch
  for (size_t i = 0; i < parts_.size(); ++i) {
    const uint32_t g = parts_[i].group;
    // In place, the values' chunk is the one homed in the files: the fp32 chunk in fp32, the
    // compute chunk of a compute_only group.
    const ChunkKind values = s_.layout().value_kind(g);
    if (values == s_.layout().compute_kind() && in_place_.count(g)) continue;
    if (s_.chunks().Home(g, values) != TierKind::kNvme) {
      out[0].push_back(i);
      continue;
    }
    auto [it, added] = nvme.emplace(g, 0);
    if (added) {
      it->second = out.size();
      out.emplace_back();
    }
    out[it->second].push_back(i);
  }
  return out;
}

void Loader::Emit(const Part& p, char* values, uint64_t first, const char* bytes, uint64_t k) {
  const Source& src = sources_[p.source];
  const size_t es = kernels::DTypeSize(src.dtype);
  if (s_.layout().group(p.group).compute_only) {
    EmitSame(p, reinterpret_cast<uint16_t*>(values), first, bytes, k);
    return;
  }
  float* chunk = reinterpret_cast<float*>(values);
  // Converted through aligned blocks: file bytes are only as aligned as the format makes them,
  // and a transposed source is scattered from one.
  float* block = block_.data();
  uint16_t* half = half_.data();
  for (uint64_t done = 0; done < k;) {
    const uint64_t m = std::min<uint64_t>(k - done, kBlock);
    const char* from = bytes + done * es;
    const uint64_t s = first + done;  // source element
    float* to = src.seg->transpose ? block : chunk + p.dst + (s - p.src_elem);
    if (src.dtype == kernels::DType::kF32) {
      std::memcpy(to, from, m * 4);
    } else if (reinterpret_cast<uintptr_t>(from) % 2 == 0) {
      kernels::CastToF32(from, src.dtype, to, m);
    } else {
      std::memcpy(half, from, m * 2);
      kernels::CastToF32(half, src.dtype, to, m);
    }
    if (src.seg->transpose) {  // file [rows, cols] -> tensor [cols, rows] at seg->offset
      for (uint64_t j = 0; j < m; ++j) {
        const uint64_t r = (s + j) / src.cols, c = (s + j) % src.cols;
        const int64_t at = static_cast<int64_t>(src.seg->offset + c * src.rows + r) + p.shift;
        if (at >= static_cast<int64_t>(p.dst) && at < static_cast<int64_t>(p.dst + p.dst_count)) {
          chunk[at] = block[j];
        }
      }
    }
    done += m;
  }
}

void Loader::ZeroGaps(char* chunk, Bytes bytes, size_t elem_bytes,
                      const std::vector<size_t>& parts) const {
  std::vector<std::pair<uint64_t, uint64_t>> written;  // [first, end) elements
  written.reserve(parts.size());
  for (size_t pi : parts) {
    written.emplace_back(parts_[pi].dst, parts_[pi].dst + parts_[pi].dst_count);
  }
  std::sort(written.begin(), written.end());
  const uint64_t elems = bytes / elem_bytes;
  uint64_t at = 0;  // everything before it is written or zeroed
  for (const auto& [lo, hi] : written) {
    if (lo > at) std::memset(chunk + at * elem_bytes, 0, (lo - at) * elem_bytes);
    at = std::max(at, hi);
  }
  if (elems > at) std::memset(chunk + at * elem_bytes, 0, (elems - at) * elem_bytes);
  if (const Bytes tail = bytes - elems * elem_bytes; tail > 0) {
    std::memset(chunk + elems * elem_bytes, 0, tail);
  }
}

void Loader::EmitSame(const Part& p, uint16_t* chunk, uint64_t first, const char* bytes,
                      uint64_t k) {
  const Source& src = sources_[p.source];
  if (!src.seg->transpose) {
    std::memcpy(chunk + p.dst + (first - p.src_elem), bytes, k * 2);
    return;
  }
  uint16_t* half = half_.data();
  for (uint64_t done = 0; done < k;) {
    const uint64_t m = std::min<uint64_t>(k - done, kBlock);
    std::memcpy(half, bytes + done * 2, m * 2);
    const uint64_t s = first + done;    // source element
    for (uint64_t j = 0; j < m; ++j) {  // file [rows, cols] -> tensor [cols, rows]
      const uint64_t r = (s + j) / src.cols, c = (s + j) % src.cols;
      const int64_t at = static_cast<int64_t>(src.seg->offset + c * src.rows + r) + p.shift;
      if (at >= static_cast<int64_t>(p.dst) && at < static_cast<int64_t>(p.dst + p.dst_count)) {
        chunk[at] = half[j];
      }
    }
    done += m;
  }
}

Loader::BatchPlan Loader::PlanBatch(const std::vector<size_t>& batch) {
  // Spans in file order, one per distinct byte range (a key two parts read is read once).
  struct Use {
    uint32_t file;
    uint64_t offset, bytes;
    size_t part;
  };
  std::vector<Use> uses;
  BatchPlan b;
  for (size_t i : batch) {
    const Part& p = parts_[i];
    const Source& src = sources_[p.source];
    const uint64_t es = kernels::DTypeSize(src.dtype);
    uses.push_back({src.file, files_.files[src.file].data_start + src.info->begin + p.src_elem * es,
                    p.count * es, i});
    b.by_group[p.group].push_back(i);
  }
  std::sort(uses.begin(), uses.end(), [](const Use& a, const Use& b) {
    return std::tie(a.file, a.offset, a.bytes) < std::tie(b.file, b.offset, b.bytes);
  });
  for (const Use& u : uses) {
    if (b.spans.empty() || b.spans.back().file != u.file || b.spans.back().offset != u.offset ||
        b.spans.back().bytes != u.bytes) {
      b.spans.push_back({u.file, u.offset, u.bytes});
      b.consumers.emplace_back();
      report_.bytes_needed += u.bytes;
    }
    b.consumers.back().push_back(u.part);
  }
  return b;
}

Status Loader::OpenBatch(const BatchPlan& b) {
  // The values' chunks of the batch's groups (fp32; a compute_only group's compute chunk), on
  // the host, for the whole batch. A lazily zero chunk comes unfilled: only what the batch
  // does not write is zeroed (ZeroGaps).
  for (const auto& [g, parts] : b.by_group) {
    const ChunkKind kind = s_.layout().value_kind(g);
    bool must_zero = false;
    TIERMEM_ASSIGN_OR_RETURN(void* a,
                             s_.chunks().AcquireForWrite(g, kind, TierKind::kHost, &must_zero));
    open_[g] = static_cast<char*>(a);
    if (must_zero) {
      ZeroGaps(open_[g], s_.chunks().ChunkBytes(g, kind),
               kind == ChunkKind::kParamFp32 ? sizeof(float) : sizeof(uint16_t), parts);
    }
  }
  return OkStatus();
}

Status Loader::CloseBatch(const BatchPlan& b, Status s) {
  // Mixed precision: the compute chunks, rounded from the fp32 ones (a compute_only group's
  // values are its compute chunk).
  for (const auto& [g, values] : open_) {
    if (s.ok() && s_.layout().value_kind(g) == ChunkKind::kParamFp32 && s_.layout().mixed() &&
        !in_place_.count(g)) {
      s = DeriveLowp(g, reinterpret_cast<const float*>(values), b.by_group.at(g));
    }
  }
  for (const auto& [g, values] : open_) {
    const Status r = s_.chunks().Release(g, s_.layout().value_kind(g), /*modified=*/true);
    if (s.ok()) s = r;
  }
  // NVMe-homed chunks filled completely: written home now, in the background, while the next
  // batch is read and converted into the host room beside them (its acquire waits for one of
  // these writes only when the room is short).
  for (const auto& [g, values] : open_) {
    std::vector<ChunkKind> written = {s_.layout().value_kind(g)};
    if (written[0] == ChunkKind::kParamFp32 && s_.layout().mixed()) {
      written.push_back(ChunkKind::kParamLowp);  // DeriveLowp's (unless homed in the files)
    }
    for (const ChunkKind kind : written) {
      if (!s.ok() || s_.chunks().Home(g, kind) != TierKind::kNvme ||
          s_.chunks().ReadOnlyHome(g, kind)) {
        continue;
      }
      StatusOr<bool> started = s_.chunks().WriteHome(g, kind, TierKind::kHost);
      if (!started.ok()) s = started.status();
    }
  }
  open_.clear();
  return s;
}

Status Loader::LoadBatches(SpanReader& reader, const std::vector<std::vector<size_t>>& batches) {
  // One read over every batch's spans, so the reader's requests run ahead across batches:
  // while batch k's last bytes are converted, batch k + 1's are in flight and batch k - 1's
  // chunks are being written home. A batch's chunks are acquired when its first span's bytes
  // arrive and released (and written home) when the next batch's do.
  std::vector<BatchPlan> plans;
  for (const std::vector<size_t>& batch : batches) {
    if (!batch.empty()) plans.push_back(PlanBatch(batch));
  }
  std::vector<FileSpan> spans;
  std::vector<std::pair<size_t, size_t>> where;  // per span: (its plan, its index there)
  for (size_t b = 0; b < plans.size(); ++b) {
    for (size_t i = 0; i < plans[b].spans.size(); ++i) {
      spans.push_back(plans[b].spans[i]);
      where.emplace_back(b, i);
    }
  }
  // Each span's bytes arrive in pieces that may split an element (a tensor at an offset that
  // is not a multiple of its element size): the split element waits in `carry`.
  struct State {
    uint64_t elem = 0;  // elements of the span emitted
    char carry[4] = {};
    size_t carry_n = 0;
  };
  std::vector<State> state(spans.size());
  size_t open = plans.size();  // the plan whose chunks are acquired; plans.size(): none
  auto sink = [&](size_t span, uint64_t, const char* data, size_t n) -> Status {
    const auto [b, i] = where[span];
    if (b != open) {
      if (open < plans.size()) {
        const size_t was = std::exchange(open, plans.size());
        TIERMEM_RETURN_IF_ERROR(CloseBatch(plans[was], OkStatus()));
      }
      open = b;
      TIERMEM_RETURN_IF_ERROR(OpenBatch(plans[b]));
    }
    const std::vector<size_t>& consumers = plans[b].consumers[i];
    State& st = state[span];
    const size_t es = kernels::DTypeSize(sources_[parts_[consumers[0]].source].dtype);
    auto emit = [&](const char* bytes, uint64_t k) {
      for (size_t pi : consumers) {
        const Part& p = parts_[pi];
        Emit(p, open_.at(p.group), p.src_elem + st.elem, bytes, k);
      }
      st.elem += k;
    };
    if (st.carry_n > 0) {
      const size_t take = std::min(es - st.carry_n, n);
      std::memcpy(st.carry + st.carry_n, data, take);
      st.carry_n += take;
      data += take;
      n -= take;
      if (st.carry_n < es) return OkStatus();
      emit(st.carry, 1);
      st.carry_n = 0;
    }
    const uint64_t k = n / es;
    if (k > 0) emit(data, k);
    st.carry_n = n - k * es;
    std::memcpy(st.carry, data + k * es, st.carry_n);
    return OkStatus();
  };
  Status s = reader.Read(spans, sink);
  if (open < plans.size()) s = CloseBatch(plans[open], s);
  // The writes home started above: waited for, and a failed one's error returned (Flush
  // writes again what a failed write-back left dirty, and returns its error).
  if (s.ok()) s = s_.Flush();
  return s;
}

Status Loader::DeriveLowp(size_t group, const float* fp32, const std::vector<size_t>& parts) {
  const kernels::DType cd = s_.layout().compute_dtype();
  StatusOr<void*> low = s_.chunks().Acquire(group, ChunkKind::kParamLowp, TierKind::kHost);
  if (low.ok()) {
    char* to = static_cast<char*>(*low);
    for (size_t pi : parts) {
      const Part& p = parts_[pi];
      kernels::CastFromF32(fp32 + p.dst, to + p.dst * 2, cd, p.dst_count);
    }
    return s_.chunks().Release(group, ChunkKind::kParamLowp, /*modified=*/true);
  }
  if (low.status().code() != StatusCode::kResourceExhausted) return low.status();
  // No host room beside the fp32 chunk (a served model's NVMe-homed group with a device: the
  // session keeps room for one chunk there): the ranges go to the compute chunk where it
  // lives, through a bounded buffer.
  std::vector<uint16_t> buf(kBlock);
  for (size_t pi : parts) {
    const Part& p = parts_[pi];
    for (uint64_t done = 0; done < p.dst_count;) {
      const uint64_t n = std::min<uint64_t>(p.dst_count - done, kBlock);
      const uint64_t at = p.dst + done;  // chunk element; the tensor's is at - shift
      kernels::CastFromF32(fp32 + at, buf.data(), cd, n);
      TIERMEM_RETURN_IF_ERROR(s_.values().WriteTensorRange(
          sources_[p.source].tensor, ChunkKind::kParamLowp,
          static_cast<uint64_t>(static_cast<int64_t>(at) - p.shift), n, buf.data()));
      done += n;
    }
  }
  return OkStatus();
}

std::string Loader::NotInPlace(uint32_t g, const std::vector<size_t>& parts) const {
  const ChunkGroup& grp = s_.layout().group(g);
  if (grp.trainable) return "it is trained";
  uint64_t covered = 0, elems = 0;
  for (size_t i : parts) {
    const Source& src = sources_[parts_[i].source];
    const std::string key = "key '" + src.seg->key + "' in " + files_.files[src.file].path;
    if (src.dtype != s_.layout().compute_dtype()) {
      return key + " is " + std::string(kernels::DTypeName(src.dtype)) + ", the compute dtype " +
             std::string(kernels::DTypeName(s_.layout().compute_dtype())) +
             " (set precision to the checkpoint's dtype)";
    }
    if (src.seg->transpose) return key + " is transposed into it";
    covered += parts_[i].dst_count;
  }
  for (const PieceRef& r : grp.pieces) elems += s_.layout().place(r.tensor).pieces[r.piece].numel;
  if (covered != elems) return "not every tensor of its chunk has a key in the checkpoint";
  return "";
}

std::string Loader::NoneInPlace() const {
  if (!options_.serving) return "the session trains";
  if (!ServesInPlace(s_.config().in_place)) return "in_place is 'off'";
  if (s_.layout().sharded()) return "the session is sharded";
  if (s_.chunks().file_homes() == nullptr) return "the session has no NVMe tier";
  return "";
}

Status Loader::PlanInPlace() {
  const InPlace mode = s_.config().in_place;
  if (!options_.serving && RequiresInPlace(mode)) {
    return InvalidArgumentError(
        "weights: config in_place 'on' reads a served checkpoint in place, but this session "
        "trains (a training session writes its weights, so they are copied into its tiers): "
        "serve with tiermem.inference, or set in_place to 'auto' or 'off'");
  }
  if (!NoneInPlace().empty()) return OkStatus();
  std::map<uint32_t, std::vector<size_t>> by_group;
  for (size_t i = 0; i < parts_.size(); ++i) by_group[parts_[i].group].push_back(i);
  const ChunkKind kind = s_.layout().compute_kind();
  for (uint32_t g = 0; g < s_.layout().num_groups(); ++g) {
    if (s_.chunks().Home(g, kind) != TierKind::kNvme) continue;
    const std::string why = NotInPlace(g, by_group[g]);
    if (why.empty()) {
      in_place_[g] = by_group[g];
      continue;
    }
    not_in_place_[g] = why;
    if (RequiresInPlace(mode)) {
      const std::string& t = s_.layout().spec(s_.layout().group(g).tensors.front()).name;
      return InvalidArgumentError("weights: in_place 'on': the NVMe-homed chunk of tensor '" + t +
                                  "' cannot be read in place from " + files_.path + ": " + why);
    }
  }
  return OkStatus();
}

Status Loader::CheckPlaceholderRoom() const {
  Bytes need = 0;
  size_t n = 0;
  uint32_t first = 0;
  const ChunkKind kind = s_.layout().compute_kind();
  for (uint32_t g : s_.chunks().placeholder_homes()) {
    if (in_place_.count(g) != 0) continue;
    need += s_.chunks().ChunkBytes(g, kind);
    if (n++ == 0) first = g;
  }
  if (n == 0) return OkStatus();
  const TierStats st = s_.chunks().file_homes()->Stats();
  const Bytes free = st.capacity - std::min(st.capacity, st.used);
  if (need <= free) return OkStatus();
  std::string why = NoneInPlace();
  if (why.empty()) {  // PlanInPlace visited every NVMe-homed group: `first` has its reason
    const auto it = not_in_place_.find(first);
    why = it != not_in_place_.end() ? it->second : "not readable in place";
  }
  const std::string& t = s_.layout().spec(s_.layout().group(first).tensors.front()).name;
  return ResourceExhaustedError(
      "weights: " + std::to_string(n) + " NVMe-homed chunk(s) of the served model cannot be read " +
      "in place from " + files_.path + " (the first, of tensor '" + t + "': " + why +
      "), so they need " + std::to_string(need) + " bytes of the NVMe tier, which has " +
      std::to_string(free) + " of " + std::to_string(st.capacity) +
      " free: raise nvme size by at least " + std::to_string(need - free) + " bytes");
}

Status Loader::HomeInPlace() {
  if (in_place_.empty()) return s_.chunks().HomePlaceholders({});
  FileHomeTier* homes = s_.chunks().file_homes();
  std::vector<std::string> paths;
  std::vector<uint64_t> sizes;
  for (const weights::Header& h : files_.files) {
    paths.push_back(h.path);
    sizes.push_back(h.file_bytes);
  }
  TIERMEM_ASSIGN_OR_RETURN(const uint32_t first, homes->OpenFiles(paths, sizes));
  const ChunkKind kind = s_.layout().compute_kind();
  const uint64_t es = s_.layout().compute_element_size();
  for (auto& [g, parts] : in_place_) {
    std::sort(parts.begin(), parts.end(),
              [&](size_t a, size_t b) { return parts_[a].dst < parts_[b].dst; });
    std::vector<FileHomeSpan> spans;
    for (size_t i : parts) {
      const Part& p = parts_[i];
      const Source& src = sources_[p.source];
      const uint64_t at = files_.files[src.file].data_start + src.info->begin + p.src_elem * es;
      FileHomeSpan* last = spans.empty() ? nullptr : &spans.back();
      if (last != nullptr && last->file == first + src.file &&
          last->file_offset + last->bytes == at && last->offset + last->bytes == p.dst * es) {
        last->bytes += p.count * es;  // contiguous in the file and in the chunk: one span
      } else {
        spans.push_back({first + src.file, at, p.dst * es, p.count * es});
      }
      report_.bytes_in_place += p.count * es;
    }
    TIERMEM_ASSIGN_OR_RETURN(Region home,
                             homes->AddFileHome(s_.chunks().ChunkBytes(g, kind), std::move(spans)));
    if (Status st = s_.chunks().SetReadOnlyHome(g, kind, home); !st.ok()) {
      homes->Free(home).IgnoreError();
      return st;
    }
    ++report_.chunks_in_place;
  }
  std::set<uint32_t> done;
  for (const auto& [g, parts] : in_place_) done.insert(g);
  return s_.chunks().HomePlaceholders(done);
}

StatusOr<LoadWeightsReport> Loader::Run() {
  if (s_.closed()) return FailedPreconditionError("weights: the session is closed");
  TIERMEM_RETURN_IF_ERROR(Validate());
  PlanParts();
  std::vector<std::string> paths;
  for (const weights::Header& h : files_.files) paths.push_back(h.path);
  SpanReaderConfig rc;
  rc.io_backend = IoBackendOf(s_.config().nvme_engine);
  rc.request_bytes = options_.request_bytes;
  rc.depth = options_.depth;
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<SpanReader> reader, SpanReader::Open(paths, rc));
  for (uint32_t f = 0; f < paths.size(); ++f) {
    if (reader->file_bytes(f) != files_.files[f].file_bytes) {
      return InvalidArgumentError("weights: " + paths[f] + " changed since its header was read (" +
                                  std::to_string(files_.files[f].file_bytes) + " bytes then, " +
                                  std::to_string(reader->file_bytes(f)) + " now)");
    }
  }
  report_.io_backend = std::string(reader->io_backend());
  report_.staging_bytes = reader->staging_bytes();
  TIERMEM_RETURN_IF_ERROR(PlanInPlace());
  TIERMEM_RETURN_IF_ERROR(CheckPlaceholderRoom());
  // Nothing has changed up to here. The load's acquires are not part of the recorded order.
  const bool tracing = s_.iterations().tracing();
  s_.iterations().SetTracing(false);
  Status s = HomeInPlace();
  if (s.ok()) s = LoadBatches(*reader, MakeBatches());
  s_.iterations().SetTracing(tracing);
  report_.bytes_read = reader->stats().bytes_read;
  report_.requests = reader->stats().requests;
  if (!s.ok()) {
    return s.WithContext("weights: loading " + files_.path +
                         " failed after validation (the session's values are partly loaded)");
  }
  return std::move(report_);
}

// The shard entries of an export, validated (weights.h: ExportWeights).
StatusOr<std::vector<weights::ShardEntry>> ExportShardEntries(
    Session& s, const std::vector<ExportEntry>& entries, const ExportOptions& o) {
  if (!ValueDType(o.dtype)) {
    return InvalidArgumentError("weights export: values are written as F32, BF16 or F16, not " +
                                std::string(weights::DTypeName(o.dtype)));
  }
  std::vector<weights::ShardEntry> out;
  for (const ExportEntry& e : entries) {
    weights::ShardEntry se{e.key, o.dtype, {}};
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      if (d < 0) return InvalidArgumentError("weights export: '" + e.key + "' has a negative dim");
      se.shape.push_back(static_cast<uint64_t>(d));
      numel *= static_cast<uint64_t>(d);
    }
    const std::string where = "weights export: '" + e.key + "' " + ShapeText(e.shape);
    if (e.host_bytes != nullptr) {
      if (!e.host_dtype || !e.segments.empty()) {
        return InvalidArgumentError(where + ": host bytes need a dtype and no segments");
      }
      se.dtype = *e.host_dtype;
      out.push_back(std::move(se));
      continue;
    }
    uint64_t covered = 0;
    for (const ExportSegment& seg : e.segments) {
      if (seg.tensor >= s.layout().num_tensors() ||
          seg.offset > s.layout().spec(seg.tensor).numel ||
          seg.numel > s.layout().spec(seg.tensor).numel - seg.offset) {
        return InvalidArgumentError(where + ": a segment is outside the session's tensors");
      }
      if (seg.transpose && (e.segments.size() != 1 || e.shape.size() != 2)) {
        return InvalidArgumentError(where +
                                    ": a transposed segment is an entry's only one, "
                                    "of a 2-D shape");
      }
      covered += seg.numel;
    }
    if (covered != numel) {
      return InvalidArgumentError(where + " has " + std::to_string(numel) +
                                  " elements, its segments " + std::to_string(covered));
    }
    out.push_back(std::move(se));
  }
  return out;
}

}  // namespace

std::optional<kernels::DType> ValueDType(weights::DType d) {
  switch (d) {
    case weights::DType::kF32:
      return kernels::DType::kF32;
    case weights::DType::kBF16:
      return kernels::DType::kBF16;
    case weights::DType::kF16:
      return kernels::DType::kF16;
    default:
      return std::nullopt;
  }
}

StatusOr<LoadWeightsReport> LoadWeights(Session& session, const WeightFiles& files,
                                        const std::vector<WeightTarget>& targets,
                                        const LoadWeightsOptions& options) {
  return Loader(session, files, targets, options).Run();
}

Status ExportWeights(Session& session, const std::string& path,
                     const std::vector<ExportEntry>& entries, const ExportOptions& options) {
  if (session.closed()) return FailedPreconditionError("weights export: the session is closed");
  TIERMEM_ASSIGN_OR_RETURN(std::vector<weights::ShardEntry> shard_entries,
                           ExportShardEntries(session, entries, options));
  // Sharded: every rank reads (the reads gather chunks), in the order the writer takes them,
  // which every rank computes alike; rank 0 writes.
  const weights::ShardLayout layout = weights::PlanShards(
      shard_entries, options.writer.single_file ? 0 : options.writer.max_shard_bytes);
  std::vector<size_t> order;
  for (const auto& shard : layout.shards) {
    order.insert(order.end(), shard.entries.begin(), shard.entries.end());
  }
  std::unique_ptr<weights::ShardWriter> w;
  if (!session.layout().sharded() || session.layout().rank == 0) {
    TIERMEM_ASSIGN_OR_RETURN(w, weights::ShardWriter::Create(path, shard_entries, options.writer));
  }
  const kernels::DType out = *ValueDType(options.dtype);
  const uint64_t piece = std::max<uint64_t>(options.piece_elems, 1);
  std::vector<float> values(piece);
  std::vector<uint16_t> low(out == kernels::DType::kF32 ? 0 : piece);
  Status written;  // the writer's first error: rank 0 still takes part in every read after it
  auto put = [&](const float* v, uint64_t k) {
    if (w == nullptr || !written.ok()) return;
    if (out == kernels::DType::kF32) {
      written = w->Put(v, k * 4);
      return;
    }
    for (uint64_t done = 0; done < k && written.ok(); done += piece) {
      const uint64_t n = std::min(piece, k - done);
      kernels::CastFromF32(v + done, low.data(), out, n);
      written = w->Put(low.data(), n * 2);
    }
  };
  for (size_t i : order) {
    const ExportEntry& e = entries[i];
    if (e.host_bytes != nullptr) {
      if (w != nullptr && written.ok()) written = w->Put(e.host_bytes, shard_entries[i].bytes());
      continue;
    }
    for (const ExportSegment& seg : e.segments) {
      if (seg.transpose) {  // the tensor's [C, R] read whole, written as [R, C]
        const uint64_t rows = static_cast<uint64_t>(e.shape[0]);
        const uint64_t cols = static_cast<uint64_t>(e.shape[1]);
        std::vector<float> held(seg.numel), flipped(seg.numel);
        TIERMEM_RETURN_IF_ERROR(session.values().ReadTensorRange(
            seg.tensor, ChunkKind::kParamFp32, seg.offset, seg.numel, held.data()));
        for (uint64_t r = 0; r < rows; ++r) {
          for (uint64_t c = 0; c < cols; ++c) flipped[r * cols + c] = held[c * rows + r];
        }
        put(flipped.data(), seg.numel);
        continue;
      }
      for (uint64_t done = 0; done < seg.numel;) {
        // fp32 out: read straight into the writer's buffer (no copy through `values`). Not
        // when sharded: every rank must read the same ranges (the reads gather), and only rank
        // 0 has a writer whose room would size them.
        StatusOr<std::span<char>> room = std::span<char>();
        if (w != nullptr && written.ok() && out == kernels::DType::kF32 &&
            !session.layout().sharded()) {
          room = w->Space((seg.numel - done) * sizeof(float));
          if (!room.ok()) written = room.status();
        }
        const uint64_t direct =
            room.ok() && reinterpret_cast<uintptr_t>(room->data()) % alignof(float) == 0
                ? room->size() / sizeof(float)
                : 0;
        if (direct > 0) {
          TIERMEM_RETURN_IF_ERROR(
              session.values().ReadTensorRange(seg.tensor, ChunkKind::kParamFp32, seg.offset + done,
                                               direct, reinterpret_cast<float*>(room->data())));
          written = w->Commit(direct * sizeof(float));
          done += direct;
          continue;
        }
        const uint64_t n = std::min(piece, seg.numel - done);
        TIERMEM_RETURN_IF_ERROR(session.values().ReadTensorRange(
            seg.tensor, ChunkKind::kParamFp32, seg.offset + done, n, values.data()));
        put(values.data(), n);
        done += n;
      }
    }
  }
  if (w == nullptr) return OkStatus();
  TIERMEM_RETURN_IF_ERROR(written);
  return w->Finish();
}

std::vector<WeightTarget> TargetsByName(const Session& session, const WeightFiles& files,
                                        const std::vector<std::vector<std::string>>& aliases,
                                        std::set<std::string>* alias_keys) {
  std::vector<WeightTarget> out;
  for (size_t t = 0; t < session.layout().num_tensors(); ++t) {
    WeightTarget target{t, {}};
    std::vector<std::string> names = {session.layout().spec(t).name};
    if (t < aliases.size()) names.insert(names.end(), aliases[t].begin(), aliases[t].end());
    for (const std::string& name : names) {
      if (files.Find(name) == nullptr) continue;
      if (target.segments.empty()) {
        target.segments.push_back({name});
      } else if (alias_keys != nullptr) {
        alias_keys->insert(name);
      }
    }
    out.push_back(std::move(target));
  }
  return out;
}

}  // namespace tiermem::session
