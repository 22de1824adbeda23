// The configuration's modes (the choice-valued keys of SessionConfig, config.h) as types: each
// an enum class, one table of its spellings, and the predicates code asks of it.
//
// A mode's JSON / TIERMEM_* spelling is written in one place, its table (ModeTraits<Mode>):
// the parser, ToJson, the error messages ("expected one of 'off', 'auto', 'always'", in the
// table's order) and the Python enums (integrations/torch/csrc/config.cc) all read it. Adding a
// value touches its enum, its table and the predicates that should answer differently for it.
// Code never compares spellings: it asks a predicate (CountsActivations(mode)) or switches on
// the enum. The facts that depend on the model's layout too (what the compute tier holds, the
// serving minimum) are the session's (session.h).
//
// The Python package's frozen `shared.Modes` and FSDP2's frozen policy dataclasses are the
// model: typed values, immutable once parsed, asked rather than compared.
//
// Thread-safety: constants and pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace tiermem::session {

// One spelling of a mode value.
template <typename Mode>
struct ModeSpelling {
  Mode mode;
  std::string_view name;
};

// Specialized below for every mode: kKey, the config key ("device_kind"; its TIERMEM_*
// variable is the parser's), and kNames, every value's spelling in the order messages list
// them.
template <typename Mode>
struct ModeTraits;

// The spelling of `m` ("sim-async").
template <typename Mode>
constexpr std::string_view ModeName(Mode m) {
  for (const ModeSpelling<Mode>& s : ModeTraits<Mode>::kNames) {
    if (s.mode == m) return s.name;
  }
  return "?";  // not reached: every value has a spelling (modes_test.cc checks it)
}

// The value spelled `name`, or nullopt (the caller names the key and the choices).
template <typename Mode>
constexpr std::optional<Mode> ParseMode(std::string_view name) {
  for (const ModeSpelling<Mode>& s : ModeTraits<Mode>::kNames) {
    if (s.name == name) return s.mode;
  }
  return std::nullopt;
}

// ---- precision ----------------------------------------------------------------------------
// The compute copy's dtype: fp32, or bf16 / fp16 with fp32 masters.
enum class Precision : uint8_t { kFp32 = 0, kBf16 = 1, kFp16 = 2 };
template <>
struct ModeTraits<Precision> {
  static constexpr std::string_view kKey = "precision";
  static constexpr std::array<ModeSpelling<Precision>, 3> kNames = {
      {{Precision::kFp32, "fp32"}, {Precision::kBf16, "bf16"}, {Precision::kFp16, "fp16"}}};
};
// bf16 / fp16: the model computes on low-precision copies of fp32 masters.
constexpr bool IsMixed(Precision p) { return p != Precision::kFp32; }
// fp16: gradients are held loss-scaled (dynamic loss scaling; config loss_scaling).
constexpr bool ScalesLoss(Precision p) { return p == Precision::kFp16; }

// ---- device_kind ----------------------------------------------------------------------------
// What computes and what the device tier is. kAuto is resolved when a session is created
// (TierStack::ResolveDeviceKind: kCuda with a GPU, else kHost); a session's device kind is
// never kAuto.
enum class DeviceKind : uint8_t {
  kAuto = 0,
  kCuda = 1,      // the CUDA tier; three tiers
  kHost = 2,      // no device tier: compute on chunks in host memory (host mode)
  kSim = 3,       // SimDevice: host memory posing as a device of `device` bytes
  kSimAsync = 4,  // SimDevice's adversarial asynchronous mode (tests)
};
template <>
struct ModeTraits<DeviceKind> {
  static constexpr std::string_view kKey = "device_kind";
  static constexpr std::array<ModeSpelling<DeviceKind>, 5> kNames = {
      {{DeviceKind::kAuto, "auto"},
       {DeviceKind::kCuda, "cuda"},
       {DeviceKind::kHost, "host"},
       {DeviceKind::kSim, "sim"},
       {DeviceKind::kSimAsync, "sim-async"}}};
};
constexpr bool IsCuda(DeviceKind k) { return k == DeviceKind::kCuda; }
// Host mode: the host tier is the compute tier, and there is no device tier.
constexpr bool IsHostCompute(DeviceKind k) { return k == DeviceKind::kHost; }
// SimDevice, in either mode.
constexpr bool IsSimulated(DeviceKind k) {
  return k == DeviceKind::kSim || k == DeviceKind::kSimAsync;
}
// SimDevice whose copies complete asynchronously (a missing wait reads wrong bytes).
constexpr bool IsAsyncSim(DeviceKind k) { return k == DeviceKind::kSimAsync; }

// ---- nvme.engine ----------------------------------------------------------------------------
// The NVMe tier's I/O backend (tiers/nvme/nvme_tier.h NvmeIoBackend, which TierStack maps it to).
enum class NvmeEngine : uint8_t {
  kAuto = 0,     // io_uring if the kernel allows it, else pread/pwrite (said once)
  kIoUring = 1,  // io_uring or kUnavailable
  kPosix = 2,    // pread/pwrite workers
};
template <>
struct ModeTraits<NvmeEngine> {
  static constexpr std::string_view kKey = "nvme.engine";
  static constexpr std::array<ModeSpelling<NvmeEngine>, 3> kNames = {{
      {NvmeEngine::kAuto, "auto"},
      {NvmeEngine::kIoUring, "io_uring"},
      {NvmeEngine::kPosix, "posix"},
  }};
};

// ---- kernel_isa ----------------------------------------------------------------------------
// Which CPU kernels run: kAuto leaves the CPUID pick (kernels::BestSupportedIsa, or
// TIERMEM_KERNEL_ISA read by the kernels themselves); the others pin one
// (config.h KernelIsaOf; kUnavailable when the CPU lacks it).
enum class KernelIsaMode : uint8_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };
template <>
struct ModeTraits<KernelIsaMode> {
  static constexpr std::string_view kKey = "kernel_isa";
  static constexpr std::array<ModeSpelling<KernelIsaMode>, 4> kNames = {
      {{KernelIsaMode::kAuto, "auto"},
       {KernelIsaMode::kScalar, "scalar"},
       {KernelIsaMode::kAvx2, "avx2"},
       {KernelIsaMode::kAvx512, "avx512"}}};
};

// ---- plan ----------------------------------------------------------------------------------
// Plans from a warm-up iteration (session.h "Plans", plan_runner.h).
enum class PlanMode : uint8_t {
  kOff = 0,     // the reactive engine only
  kAuto = 1,    // plan, and execute the plan unless it moves more bytes than the engine did
  kAlways = 2,  // plan, and execute the plan whatever its bytes
};
template <>
struct ModeTraits<PlanMode> {
  static constexpr std::string_view kKey = "plan";
  static constexpr std::array<ModeSpelling<PlanMode>, 3> kNames = {
      {{PlanMode::kOff, "off"}, {PlanMode::kAuto, "auto"}, {PlanMode::kAlways, "always"}}};
};
// The session records an iteration at the boundary and plans from it.
constexpr bool PlansIterations(PlanMode m) { return m != PlanMode::kOff; }
// A plan that would move more bytes or stall longer than the reactive engine (both simulated on
// the recorded trace; runtime/plan_runner.h, PlanDecision) is declined.
constexpr bool DeclinesCostlierPlans(PlanMode m) { return m == PlanMode::kAuto; }

// ---- activations -----------------------------------------------------------------------------
// Where saved activations live and who accounts for them (config.h `activations`).
enum class ActivationMode : uint8_t {
  kOutside = 0,    // torch's, outside every budget
  kBudget = 1,     // counted in the compute tier's budget
  kOffload = 2,    // counted, and units' moved to host memory when the device is short
  kRecompute = 3,  // counted, and every innermost unit recomputes them in its backward
  kAuto = 4,       // counted, and an executed plan picks keep / offload / recompute per unit
};
template <>
struct ModeTraits<ActivationMode> {
  static constexpr std::string_view kKey = "activations";
  static constexpr std::array<ModeSpelling<ActivationMode>, 5> kNames = {
      {{ActivationMode::kOutside, "outside"},
       {ActivationMode::kBudget, "budget"},
       {ActivationMode::kOffload, "offload"},
       {ActivationMode::kRecompute, "recompute"},
       {ActivationMode::kAuto, "auto"}}};
};
// The bindings count saved activations in the compute tier's budget (external bytes), and
// plans account for them.
constexpr bool CountsActivations(ActivationMode m) { return m != ActivationMode::kOutside; }
// The binding moves units' activations from the device to host memory (and on to NVMe) when
// the device cannot hold them; with a plan followed, as the plan says.
constexpr bool OffloadsActivations(ActivationMode m) {
  return m == ActivationMode::kOffload || m == ActivationMode::kAuto;
}
// Every unit that contains no other unit recomputes its activations in its backward, whatever
// a plan would choose.
constexpr bool RecomputesEveryUnit(ActivationMode m) { return m == ActivationMode::kRecompute; }
// An executed plan chooses per unit (keep, offload or recompute).
constexpr bool PlanChoosesActivations(ActivationMode m) { return m == ActivationMode::kAuto; }

// ---- optimizer_placement ---------------------------------------------------------------------
enum class OptimizerPlacement : uint8_t {
  kAuto = 0,  // groups whose state fits the device next to the working set step there
  kHost = 1,  // every group steps on host copies
};
template <>
struct ModeTraits<OptimizerPlacement> {
  static constexpr std::string_view kKey = "optimizer_placement";
  static constexpr std::array<ModeSpelling<OptimizerPlacement>, 2> kNames = {
      {{OptimizerPlacement::kAuto, "auto"}, {OptimizerPlacement::kHost, "host"}}};
};
// Some groups may step on the device (optimizer_stepper.h "Placement"; never in host mode).
constexpr bool MayStepOnDevice(OptimizerPlacement p) { return p == OptimizerPlacement::kAuto; }

// ---- optimizer_overlap -----------------------------------------------------------------------
enum class OptimizerOverlap : uint8_t {
  kNextForward = 0,  // a group's update runs when the next forward first needs it
  kBackward = 1,     // that, and speculatively in the backward
  kOff = 2,          // every update inside Step()
};
template <>
struct ModeTraits<OptimizerOverlap> {
  static constexpr std::string_view kKey = "optimizer_overlap";
  static constexpr std::array<ModeSpelling<OptimizerOverlap>, 3> kNames = {
      {{OptimizerOverlap::kNextForward, "next-forward"},
       {OptimizerOverlap::kBackward, "backward"},
       {OptimizerOverlap::kOff, "off"}}};
};
// Step() may leave updates pending until something touches their group (deferred steps).
constexpr bool DefersSteps(OptimizerOverlap o) { return o != OptimizerOverlap::kOff; }
// Groups whose gradients are final step speculatively in the backward (the bindings announce
// the next step's hyper-parameters at each iteration's first forward).
constexpr bool SpeculatesSteps(OptimizerOverlap o) { return o == OptimizerOverlap::kBackward; }

// ---- prefetch_lookahead ----------------------------------------------------------------------
// How far the engine's lookahead prefetch reaches in the recorded order (chunks/engine.h).
enum class PrefetchLookahead : uint8_t {
  kRoom = 0,   // as far as host room can be made (dirty chunks used later written home first),
               // across the iteration boundary
  kDepth = 1,  // prefetch_depth acquires within the iteration, evicting only clean chunks
};
template <>
struct ModeTraits<PrefetchLookahead> {
  static constexpr std::string_view kKey = "prefetch_lookahead";
  static constexpr std::array<ModeSpelling<PrefetchLookahead>, 2> kNames = {
      {{PrefetchLookahead::kRoom, "room"}, {PrefetchLookahead::kDepth, "depth"}}};
};

// ---- checkpoint_io ---------------------------------------------------------------------------
enum class CheckpointIo : uint8_t {
  kAuto = 0,      // = kDirect
  kDirect = 1,    // O_DIRECT where the file system allows it, else the page cache
  kBuffered = 2,  // always the page cache
};
template <>
struct ModeTraits<CheckpointIo> {
  static constexpr std::string_view kKey = "checkpoint_io";
  static constexpr std::array<ModeSpelling<CheckpointIo>, 3> kNames = {
      {{CheckpointIo::kAuto, "auto"},
       {CheckpointIo::kDirect, "direct"},
       {CheckpointIo::kBuffered, "buffered"}}};
};
// Checkpoint files are written and read with O_DIRECT where the file system allows it.
constexpr bool CheckpointsDirect(CheckpointIo c) { return c != CheckpointIo::kBuffered; }

// ---- in_place --------------------------------------------------------------------------------
// Serving a checkpoint (tiermem.inference(..., weights=DIR), runtime/weights.h "Serving in
// place"): whether NVMe-homed compute chunks read their values from the checkpoint's files
// themselves instead of a copy written into the NVMe tier.
enum class InPlace : uint8_t {
  kAuto = 0,  // in place where it applies (the file dtype is the compute dtype), else copied
  kOn = 1,    // in place, and an error naming the tensor where it does not apply
  kOff = 2,   // always copied into the NVMe tier (today's load)
};
template <>
struct ModeTraits<InPlace> {
  static constexpr std::string_view kKey = "in_place";
  static constexpr std::array<ModeSpelling<InPlace>, 3> kNames = {
      {{InPlace::kAuto, "auto"}, {InPlace::kOn, "on"}, {InPlace::kOff, "off"}}};
};
// A served load may home chunks in the checkpoint's files.
constexpr bool ServesInPlace(InPlace m) { return m != InPlace::kOff; }
// A served NVMe-homed chunk that cannot be read in place is an error, not a copy.
constexpr bool RequiresInPlace(InPlace m) { return m == InPlace::kOn; }

// ---- unmaterialized_reads --------------------------------------------------------------------
// A parameter read outside every unit containing it (the Python package's ChunkTensor).
enum class UnmaterializedReads : uint8_t {
  kMaterialize = 0,  // materialized on demand (a warning inside a forward)
  kError = 1,        // a RuntimeError naming the parameter and where
};
template <>
struct ModeTraits<UnmaterializedReads> {
  static constexpr std::string_view kKey = "unmaterialized_reads";
  static constexpr std::array<ModeSpelling<UnmaterializedReads>, 2> kNames = {
      {{UnmaterializedReads::kMaterialize, "materialize"}, {UnmaterializedReads::kError, "error"}}};
};
constexpr bool RaisesOnUnmaterializedRead(UnmaterializedReads u) {
  return u == UnmaterializedReads::kError;
}

}  // namespace tiermem::session
