// SessionConfig: the one configuration of a tiermem session, parsed once from JSON (the
// Python `config` dict / JSON file, the LibTorch `nlohmann::json`) and then overridden by the
// TIERMEM_* environment. Both bindings call ParseConfig; nothing else parses configuration,
// so the keys, the defaults and the error messages are the same in Python and C++
// (tests/runtime/config_cases.json is run through both).
//
// Every key is checked: an unknown key or a bad value is kInvalidArgument naming the key
// ("optimizer.eps") or the variable ("TIERMEM_NVME_SIZE") and the offending value. Sizes are
// strings like "2GiB" (ParseBytes) or positive byte counts. An environment variable that is
// set but empty counts as unset.
//
//   key / variable                                 default     meaning
//   device          TIERMEM_DEVICE_BUDGET          2GiB        device tier budget (an error with
//                                                              device_kind host; ignored, with
//                                                              a warning, when auto picks host)
//   host            TIERMEM_HOST_BUDGET            8GiB        host tier budget
//   nvme.size       TIERMEM_NVME_SIZE              (none)      NVMe tier budget; no key = no NVMe
//   nvme.path       TIERMEM_NVME_PATH              temp dir    directory for the NVMe files
//   nvme.engine     TIERMEM_NVME_ENGINE            auto        auto | io_uring | posix
//   nvme.queue_depth TIERMEM_IO_DEPTH              8           io_uring queue depth, 1..4096
//   device_kind     TIERMEM_DEVICE                 auto        auto | cuda | host | sim | sim-async
//                                                              host: compute on the CPU against
//                                                              chunks in host memory (two tiers:
//                                                              host, NVMe); auto: cuda with a
//                                                              GPU, else host; sim: SimDevice, a
//                                                              simulated device of `device` bytes
//                                                              (sim-async: its adversarial
//                                                              asynchronous mode, for tests)
//   timeline        TIERMEM_TIMELINE               temp file   binary timeline path
//   cpu_threads     TIERMEM_CPU_THREADS            0           CPU kernel threads (0 = all)
//   kernel_isa      TIERMEM_KERNEL_ISA             auto        auto | scalar | avx2 | avx512
//   log_level       TIERMEM_LOG_LEVEL              warn        error | warn | info | debug
//   precision                                      fp32        fp32 | bf16 | fp16
//   optimizer.{type,lr,betas,eps,weight_decay}     adamw, 1e-3, [0.9, 0.999], 1e-8, 0.01
//   optimizer.state_dtype TIERMEM_STATE_DTYPE      fp32        fp32 | bf16 | int8: how Adam's m
//                                                              and v are stored, in every tier
//                                                              (kernels/cpu/optim.h "Compressed
//                                                              state"); fp32 masters stay fp32
//   optimizer.state_block                          256         int8: elements per absmax (a
//                                                              power of two, 64..4096)
//   optimizer.state_rounding                       nearest     nearest | stochastic (bf16 only)
//   optimizer.state_min_elems                      4096        tensors with fewer elements keep
//                                                              fp32 state (bitsandbytes'
//                                                              min_8bit_size); 0 = none
//   gradient_accumulation_steps                    1           step every N-th call
//   gradient_clipping                              0 (off)     global-norm clip
//   chunk_size                                     automatic   elements per chunk
//   prefetch_depth                                 4           acquires of lookahead
//   prefetch_lookahead TIERMEM_PREFETCH_LOOKAHEAD  depth       room: as far as host room can
//                                                              be made, across iterations |
//                                                              depth: prefetch_depth acquires
//   write_behind                                   true        background write-back (engine.h)
//   plan            TIERMEM_PLAN                   auto        auto: plan from a warm-up
//                                                              iteration and execute the plan
//                                                              unless it moves more bytes than
//                                                              the reactive engine | always:
//                                                              execute it whatever its bytes
//                                                              | off
//   activations     TIERMEM_ACTIVATIONS            outside     outside | budget | offload |
//                                                              recompute | auto: the bindings
//                                                              count saved activations in the
//                                                              device budget (offload: and move
//                                                              them to host memory when the
//                                                              device is short; recompute:
//                                                              units recompute them in the
//                                                              backward; auto: the executed
//                                                              plan picks per unit)
//   optimizer_placement TIERMEM_OPTIMIZER_PLACEMENT auto    auto | host: auto steps a chunk
//                                                              group on the device when its
//                                                              optimizer state fits next to
//                                                              the working set (session.h)
//   optimizer_overlap TIERMEM_OPTIMIZER_OVERLAP next-forward  next-forward | backward | off:
//                                                              a group's optimizer step runs
//                                                              when the next forward first
//                                                              needs it (session.h, "deferred
//                                                              steps"); backward: also
//                                                              speculatively in the backward
//                                                              (session.h, "speculative steps")
//   checkpoint_io   TIERMEM_CHECKPOINT_IO          auto        auto | direct | buffered: how
//                                                              checkpoints are written and read
//                                                              (auto = direct: O_DIRECT)
//   loss_scaling.{initial_scale,growth_interval,growth_factor,backoff_factor}   (fp16)
//   unmaterialized_reads                           materialize materialize | error (Python)
//   in_place        TIERMEM_IN_PLACE               auto        auto | on | off: a served
//                                                              checkpoint's NVMe-homed chunks
//                                                              read in place from its files
//                                                              (runtime/weights.h)
//
// The choice-valued keys are enums (modes.h): their spellings are written once, in their
// tables there, and code asks their predicates.
//
// Thread-safety: values and pure functions (ParseConfig reads the environment only through
// the getter it is given).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "base/env.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/units.h"
#include "kernels/cpu/optim.h"
#include "runtime/modes.h"

namespace tiermem::session {

std::string_view PrecisionName(Precision p);  // "fp32", "bf16", "fp16" (ModeName)
// The element type of the compute copy (params and grads the model computes with): fp32, or
// the low precision of mixed precision.
kernels::DType ComputeDType(Precision p);
// The kernels `kernel_isa` pins; nullopt for kAuto (the kernels' own pick stays).
std::optional<kernels::Isa> KernelIsaOf(KernelIsaMode m);

struct OptimizerConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// fp16 dynamic loss scaling: torch.amp.GradScaler's defaults and semantics.
struct LossScalingConfig {
  double initial_scale = 65536.0;
  int growth_interval = 2000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
};

// How Adam's m and v are stored (optimizer.state_*). fp32 is exact and the default.
struct OptimizerStateConfig {
  kernels::StateFormat format;  // dtype, int8 block, bf16 stochastic rounding
  // Tensors of fewer elements keep fp32 state (in chunk groups of their own): their share of
  // the bytes is small, and their state (biases, norms) the most sensitive to rounding.
  uint64_t min_elems = 4096;
};

struct SessionConfig {
  Bytes device_budget = 2 * kGiB;
  bool device_budget_given = false;  // `device` / TIERMEM_DEVICE_BUDGET was set
  Bytes host_budget = 8 * kGiB;
  // Host bytes kept free of chunk homes (with NVMe): room for what else counts in the host
  // budget — in host mode the KV cache of a served model and activations counted there.
  // Homes otherwise fill the budget less the room for NVMe-homed chunks in use, and host
  // homes never move, so a KV cache larger than that room could not grow.
  Bytes host_reserve = 0;
  Bytes nvme_size = 0;    // 0 = no NVMe tier (only when no nvme key/variable is given)
  std::string nvme_path;  // "" = a fresh directory under $TMPDIR
  NvmeEngine nvme_engine = NvmeEngine::kAuto;
  int io_depth = 8;
  Bytes io_piece = kMiB;  // NVMe I/O size: larger copies go in pieces of this size
  // As parsed; Session::config() holds the resolved kind (never kAuto).
  DeviceKind device_kind = DeviceKind::kAuto;
  std::string timeline;  // "" = a temporary file, removed when the session closes
  int cpu_threads = 0;
  KernelIsaMode kernel_isa = KernelIsaMode::kAuto;
  LogLevel log_level = LogLevel::kWarn;
  Precision precision = Precision::kFp32;
  OptimizerConfig optimizer;
  OptimizerStateConfig optimizer_state;
  int gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;      // 0 = off
  std::optional<uint64_t> chunk_size;  // elements per chunk; nullopt = automatic
  int prefetch_depth = 4;
  PrefetchLookahead prefetch_lookahead = PrefetchLookahead::kDepth;
  bool write_behind = true;
  PlanMode plan = PlanMode::kAuto;  // modes.h; session.h "Plans"
  // "outside": saved activations are torch's, outside the device budget; "budget": the
  // bindings count them in it (SetExternalDeviceBytes), and plans account for them;
  // "offload": counted too, and the binding offloads units' activations to host memory
  // (SetExternalHostBytes) when the device cannot hold them; "recompute": counted, and every
  // unit that contains no other unit drops what its forward saves and recomputes it in its
  // backward (activation checkpointing per unit); "auto": counted, and an executed plan chooses
  // per unit keep / offload / recompute (without one, or off it: offload).
  ActivationMode activations = ActivationMode::kOutside;
  // "auto": chunk groups whose optimizer state fits the device next to the training working
  // set step there (the CUDA kernels on CUDA, the CPU kernels on SimDevice's memory); "host":
  // every group steps on host copies.
  OptimizerPlacement optimizer_placement = OptimizerPlacement::kAuto;
  // "next-forward": Step() computes the gradient stats and the clip/scale factors and
  // captures the hyper-parameters, and each chunk group's AdamW update runs later, just before
  // anything reads or writes that group (the next forward's first use): its optimizer-state
  // reads and write-backs overlap the forward's compute. Exact: the same kernels on the same
  // values. "off": every group is updated inside Step().
  OptimizerOverlap optimizer_overlap = OptimizerOverlap::kNextForward;
  // Checkpoint file I/O: "auto" and "direct" write and read with O_DIRECT where the file
  // system allows it (else through the page cache): the page cache's writeback and readahead
  // run far below the disk's rate here, and a checkpoint larger than RAM only churns it;
  // "buffered" always goes through the page cache (a file still cached from a recent save
  // loads faster that way).
  CheckpointIo checkpoint_io = CheckpointIo::kAuto;
  LossScalingConfig loss_scaling;
  UnmaterializedReads unmaterialized_reads = UnmaterializedReads::kMaterialize;
  // Serving a checkpoint (runtime/weights.h, "Serving in place"): "auto" homes each NVMe-homed
  // compute chunk whose tensors the files hold in the compute dtype in those files, read in
  // place (no copy written, a load that reads nothing); "on" also makes any other NVMe-homed
  // compute chunk an error; "off" copies like a training load. The default follows the
  // measurement in docs/benchmarks.md ("Serving in place").
  InPlace in_place = InPlace::kAuto;
};

// `config`: a JSON object (null = all defaults). `env`: the TIERMEM_* source (tests pass a
// map; the bindings pass ProcessEnv()).
StatusOr<SessionConfig> ParseConfig(const nlohmann::json& config,
                                    const EnvGetter& env = ProcessEnv());
// Reads `path` as JSON, then ParseConfig. An unreadable file or invalid JSON is
// kInvalidArgument naming the file.
StatusOr<SessionConfig> ParseConfigFile(const std::string& path,
                                        const EnvGetter& env = ProcessEnv());
// kInvalidArgument naming 'nvme.path' and the path unless the config has no NVMe tier, no
// path (a temporary directory), or an existing writable directory there. ParseConfig checks
// the path already (creating its last directory when its parent exists); TierStack checks it
// again, for configs built otherwise and for a directory removed since.
Status CheckNvmePath(const SessionConfig& config);
// The config as JSON with every key present (defaults filled in): what the session runs
// with, for logs and the Python repr. Parsing it again gives the same config.
nlohmann::json ToJson(const SessionConfig& config);

}  // namespace tiermem::session
