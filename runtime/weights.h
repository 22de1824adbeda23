// Pretrained weights in and out of a session: LoadWeights streams safetensors checkpoints
// (weights/weight_files.h: a file, or a Hugging Face directory with its index) straight into
// each chunk's home tier, and ExportWeights streams the session's values back out in Hugging
// Face's layout (weights/shard_writer.h) — never the whole model in memory either way.
//
// Names are the caller's business: both take, per session tensor, a list of *segments* — a
// checkpoint key and the elements of the tensor it covers — so a binding can rename (a
// framework's prefixes), alias (a tied parameter is one session tensor, loaded from one key),
// assemble a fused parameter from several keys (a mixture-of-experts [E, 2I, H] from
// per-expert [I, H] tensors, in any shards) and split it back per key on export; a segment may
// also be a 2-D transpose ([R, C] in the file, [C, R] in the tensor).
//
// Loading (runtime/weights.cc has the order of work):
//   - everything is validated before anything changes: every source key present, its dtype
//     BF16, F16 or F32, its shape the tensor's (or the segment's stated shape), the segments
//     of a tensor covering it exactly once, no checkpoint key left unused unless the caller
//     allows it, every file still the length its header says. Each failure is
//     kInvalidArgument naming the tensor, the key and the file, and the session is untouched.
//   - values are converted from the file's dtype to fp32 into each group's fp32 chunk (the
//     param in fp32 training, the master in mixed precision) and, in mixed precision, rounded
//     from there into the compute chunk as WriteParam rounds: a load equals WriteParam of the
//     same values, bit for bit. A tensor of a compute_only group (layout.h: frozen, created
//     with TensorSpec::values_in_compute_dtype, no fp32 master) takes its file's bytes into
//     its compute chunk as they are; its sources must be in the compute dtype (else
//     kInvalidArgument naming the tensor and the key). Adam's m and v stay lazily zero;
//     gradients are not touched.
//   - each chunk is written in its home tier: host homes in place; an NVMe-homed chunk in the
//     host room the session keeps for NVMe-homed chunks, one group at a time, filled completely
//     and then written home in the background (never read back) while the next groups are read
//     and converted beside it; the load returns once every write landed (a failed one is its
//     error). Anonymous memory stays within the host budget plus the reader's staging
//     (LoadWeightsOptions, 32 MiB by default).
//   - sharded sessions: each rank reads only the bytes of its shard of every chunk (a
//     transposed segment whole) and writes only its shard; no collective is involved.
//   - a tensor without segments is an error, or with strict = false left untouched and
//     reported in LoadWeightsReport::missing.
//
// Serving in place (options.serving, config in_place; docs/inference.md): a served session's
// values are never written, so an NVMe-homed compute chunk whose tensors the files hold in the
// compute dtype (bf16 checkpoint + bf16 compute, fp32 + fp32), untransposed, every tensor of
// its group loaded, needs no copy: its home becomes those bytes of the files (a file home,
// tiers/nvme/file_homes.h: the chunk's tensors as a list of file spans, read with O_DIRECT
// into its cached copy when it is acquired, never written) and the load reads nothing for it.
// In mixed precision the fp32 masters of frozen groups that keep them are still loaded; a
// compute_only group has none, so for a model whose frozen tensors are all compute_only (the
// Python binding's default for a checkpoint in the compute dtype) the load of its NVMe-homed
// groups is header parsing only. in_place "auto" does this where it applies and copies the rest;
// "on" makes an NVMe-homed compute chunk where it does not apply an error naming a tensor and why,
// and is an error for a training load (serving = false: training writes its weights); "off" copies.
// A sharded session copies (each rank's shard is not a span of the files).
//
// An I/O error after validation leaves the session partly loaded (said in the message); the
// bindings then drop the session.
//
// Exporting: each entry is a checkpoint key, its shape and its segments (session tensor
// elements, in the entry's element order); values are the fp32 value (master or param) or,
// with a dtype, rounded to it as torch's `.to` rounds (nearest even). Read in pieces of at
// most ExportOptions::piece_elems elements per entry segment (a transposed segment whole).
// Sharded sessions: every rank must call it (the reads gather chunks); rank 0 writes.
//
// Thread-safety: the session's (externally synchronized: the training thread).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/optim.h"
#include "weights/shard_writer.h"
#include "weights/weight_files.h"

namespace tiermem::session {

class Session;

// One checkpoint key feeding elements [offset, offset + its numel) of a session tensor.
struct WeightSegment {
  std::string key;
  uint64_t offset = 0;  // first element of the tensor it covers
  // The file's shape this segment expects; empty: the tensor's own shape when it is the
  // tensor's only segment (reversed when transposed), else only the element count matters.
  std::vector<int64_t> shape = {};
  bool transpose = false;  // [R, C] in the file lands as [C, R] (a 2-D source)
};

struct WeightTarget {
  size_t tensor = 0;  // session tensor index
  std::vector<WeightSegment> segments = {};
};

struct LoadWeightsOptions {
  // False: a tensor without segments is left untouched and reported (else an error).
  bool strict = true;
  // Checkpoint keys no segment uses that are allowed (others are an error). Null: none.
  std::function<bool(std::string_view key)> ignore;
  // The reader's staging: `depth` requests of `request_bytes` in flight.
  Bytes request_bytes = 8 * kMiB;
  int depth = 4;
  // The session serves (tiermem.inference): its values are never written, so chunks may be
  // homed in the files (see "Serving in place" above).
  bool serving = false;
};

struct LoadWeightsReport {
  std::vector<size_t> missing;       // tensors left untouched (strict = false)
  std::vector<std::string> ignored;  // checkpoint keys no segment used (allowed), sorted
  uint64_t bytes_needed = 0;         // of the tensors' bytes: this rank's shard of them
  uint64_t bytes_read = 0;           // from the files, alignment around the tensors included
  uint64_t requests = 0;
  std::string io_backend;  // "io_uring" or "posix"
  Bytes staging_bytes = 0;
  uint64_t chunks_in_place = 0;  // compute chunks homed in the files (serving in place)
  uint64_t bytes_in_place = 0;   // their tensors' bytes, not read by the load
};

StatusOr<LoadWeightsReport> LoadWeights(Session& session, const weights::WeightFiles& files,
                                        const std::vector<WeightTarget>& targets,
                                        const LoadWeightsOptions& options = {});

// The plain-name targets both bindings load with: each session tensor from the key of its own
// name or, when the checkpoint lacks it, of the first of its aliases that it has (`aliases[t]`,
// may be shorter than the tensors: the other names of a tied parameter); a tensor with none
// gets no segments (missing). The other names present are added to *alias_keys: keys that
// may stay unused.
std::vector<WeightTarget> TargetsByName(const Session& session, const weights::WeightFiles& files,
                                        const std::vector<std::vector<std::string>>& aliases,
                                        std::set<std::string>* alias_keys);

// One exported tensor: `key` of `shape`, its elements taken from session tensors in order.
struct ExportSegment {
  size_t tensor = 0;
  uint64_t offset = 0;  // first element of the tensor
  uint64_t numel = 0;
  bool transpose = false;  // the tensor holds [C, R] for the entry's [R, C] (one segment)
};
struct ExportEntry {
  std::string key;
  std::vector<int64_t> shape;
  std::vector<ExportSegment> segments = {};
  // Instead of segments: bytes the caller holds (a module's buffer) in `dtype`, written as
  // they are. Must stay valid during the export.
  const void* host_bytes = nullptr;
  std::optional<weights::DType> host_dtype = std::nullopt;
};

struct ExportOptions {
  // F32 (the fp32 values), BF16 or F16 (rounded to nearest even).
  weights::DType dtype = weights::DType::kF32;
  weights::ShardWriterOptions writer;
  uint64_t piece_elems = 4 << 20;  // elements read from the session at once
};

// Writes `entries` to `path` (a directory, or with writer.single_file the file).
// kInvalidArgument for a bad entry (an unknown tensor, segments that do not add up to the
// shape, a dtype other than F32/BF16/F16); the writer's and the session's errors otherwise.
Status ExportWeights(Session& session, const std::string& path,
                     const std::vector<ExportEntry>& entries, const ExportOptions& options = {});

// The element type a checkpoint dtype's values convert from (F32, BF16, F16); nullopt for
// any other (integers, sub-byte and 8-bit float formats: not parameter values).
std::optional<kernels::DType> ValueDType(weights::DType d);

}  // namespace tiermem::session
