// The config's modes (runtime/modes.h): every value has one spelling in its table, the parser
// reads each spelling through the table (JSON and TIERMEM_*) and ToJson writes it back, and
// the predicates answer as their comments say, value by value.
#include "runtime/modes.h"
#include "runtime/phase.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "runtime/config.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using nlohmann::json;
using ::tiermem::testing::StatusIs;

// Every enumerator 0..n-1 (the enums are numbered densely from 0) has exactly one spelling,
// distinct from the others', that parses back to it; the table has nothing else.
template <typename Mode>
void ExpectOneSpellingEach(size_t n) {
  SCOPED_TRACE(std::string(ModeTraits<Mode>::kKey));
  EXPECT_EQ(ModeTraits<Mode>::kNames.size(), n);
  std::set<std::string_view> names;
  for (size_t i = 0; i < n; ++i) {
    const Mode m = static_cast<Mode>(i);
    const std::string_view name = ModeName(m);
    EXPECT_NE(name, "?") << "value " << i << " has no spelling";
    EXPECT_TRUE(names.insert(name).second) << name << " spells two values";
    ASSERT_TRUE(ParseMode<Mode>(name).has_value()) << name;
    EXPECT_EQ(*ParseMode<Mode>(name), m);
  }
  EXPECT_FALSE(ParseMode<Mode>("no-such-mode").has_value());
  EXPECT_FALSE(ParseMode<Mode>("").has_value());
}

TEST(Modes, EveryValueHasOneSpellingThatParsesBack) {
  ExpectOneSpellingEach<Precision>(3);
  ExpectOneSpellingEach<DeviceKind>(5);
  ExpectOneSpellingEach<NvmeEngine>(3);
  ExpectOneSpellingEach<KernelIsaMode>(4);
  ExpectOneSpellingEach<PlanMode>(3);
  ExpectOneSpellingEach<ActivationMode>(5);
  ExpectOneSpellingEach<OptimizerPlacement>(2);
  ExpectOneSpellingEach<OptimizerOverlap>(3);
  ExpectOneSpellingEach<PrefetchLookahead>(2);
  ExpectOneSpellingEach<CheckpointIo>(3);
  ExpectOneSpellingEach<InPlace>(3);
  ExpectOneSpellingEach<UnmaterializedReads>(2);
  ExpectOneSpellingEach<RunPhase>(6);  // not a config key: the run's phase (phase.h)
}

// Every spelling of a top-level mode key parses (as JSON and, where `var` is given, from the
// environment) to its value, and ToJson writes the same spelling back.
template <typename Mode>
void ExpectParsedThroughTheTable(Mode SessionConfig::*field, const char* var) {
  const std::string key(ModeTraits<Mode>::kKey);
  SCOPED_TRACE(key);
  for (const ModeSpelling<Mode>& s : ModeTraits<Mode>::kNames) {
    const std::string name(s.name);
    json j = json::object();
    j[key] = name;
    StatusOr<SessionConfig> c = ParseConfig(j, MapEnv({}));
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().ToString();
    EXPECT_EQ((*c).*field, s.mode) << name;
    EXPECT_EQ(ToJson(*c)[key], name);
    if (var != nullptr) {
      StatusOr<SessionConfig> e = ParseConfig(json::object(), MapEnv({{var, name}}));
      ASSERT_TRUE(e.ok()) << var << "=" << name << ": " << e.status().ToString();
      EXPECT_EQ((*e).*field, s.mode) << var << "=" << name;
    }
  }
}

TEST(Modes, TheParserAndToJsonSpellEveryValueByItsTable) {
  ExpectParsedThroughTheTable(&SessionConfig::precision, nullptr);
  ExpectParsedThroughTheTable(&SessionConfig::device_kind, "TIERMEM_DEVICE");
  ExpectParsedThroughTheTable(&SessionConfig::kernel_isa, "TIERMEM_KERNEL_ISA");
  ExpectParsedThroughTheTable(&SessionConfig::plan, "TIERMEM_PLAN");
  ExpectParsedThroughTheTable(&SessionConfig::activations, "TIERMEM_ACTIVATIONS");
  ExpectParsedThroughTheTable(&SessionConfig::optimizer_placement, "TIERMEM_OPTIMIZER_PLACEMENT");
  ExpectParsedThroughTheTable(&SessionConfig::optimizer_overlap, "TIERMEM_OPTIMIZER_OVERLAP");
  ExpectParsedThroughTheTable(&SessionConfig::checkpoint_io, "TIERMEM_CHECKPOINT_IO");
  ExpectParsedThroughTheTable(&SessionConfig::in_place, "TIERMEM_IN_PLACE");
  ExpectParsedThroughTheTable(&SessionConfig::unmaterialized_reads, nullptr);
  // nvme.engine is inside `nvme`.
  for (const ModeSpelling<NvmeEngine>& s : ModeTraits<NvmeEngine>::kNames) {
    StatusOr<SessionConfig> c = ParseConfig(
        json{{"nvme", {{"size", "1MiB"}, {"engine", std::string(s.name)}}}}, MapEnv({}));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->nvme_engine, s.mode);
    EXPECT_EQ(ToJson(*c)["nvme"]["engine"], std::string(s.name));
    StatusOr<SessionConfig> e = ParseConfig(
        json::object(), MapEnv({{"TIERMEM_NVME_SIZE", "1MiB"},
                                {"TIERMEM_NVME_ENGINE", std::string(s.name)}}));
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    EXPECT_EQ(e->nvme_engine, s.mode);
  }
}

TEST(Modes, ErrorsListTheChoicesInTheTablesOrder) {
  EXPECT_THAT(ParseConfig(json{{"plan", "sometimes"}}, MapEnv({})).status(),
              StatusIs(StatusCode::kInvalidArgument,
                                "config 'plan': expected one of 'off', 'auto', 'always', got "
                                "\"sometimes\""));
  EXPECT_THAT(ParseConfig(json::object(), MapEnv({{"TIERMEM_ACTIVATIONS", "keep"}})).status(),
              StatusIs(StatusCode::kInvalidArgument,
                                "TIERMEM_ACTIVATIONS='keep': expected one of outside, budget, "
                                "offload, recompute, auto"));
  EXPECT_THAT(ParseConfig(json{{"nvme", {{"size", "1MiB"}, {"engine", 3}}}}, MapEnv({})).status(),
              StatusIs(StatusCode::kInvalidArgument,
                                "config 'nvme.engine': expected one of 'auto', 'io_uring', "
                                "'posix', got 3"));
}

TEST(Modes, ActivationPredicates) {
  using A = ActivationMode;
  // counted, offloaded, every unit recomputed, chosen by the plan
  struct Row {
    A mode;
    bool counted, offloaded, recomputed, planned;
  };
  for (const Row& r : {Row{A::kOutside, false, false, false, false},
                       Row{A::kBudget, true, false, false, false},
                       Row{A::kOffload, true, true, false, false},
                       Row{A::kRecompute, true, false, true, false},
                       Row{A::kAuto, true, true, false, true}}) {
    SCOPED_TRACE(std::string(ModeName(r.mode)));
    EXPECT_EQ(CountsActivations(r.mode), r.counted);
    EXPECT_EQ(OffloadsActivations(r.mode), r.offloaded);
    EXPECT_EQ(RecomputesEveryUnit(r.mode), r.recomputed);
    EXPECT_EQ(PlanChoosesActivations(r.mode), r.planned);
  }
}

TEST(Modes, DeviceKindPredicates) {
  using D = DeviceKind;
  struct Row {
    D kind;
    bool cuda, host, simulated, async;
  };
  for (const Row& r : {Row{D::kAuto, false, false, false, false},
                       Row{D::kCuda, true, false, false, false},
                       Row{D::kHost, false, true, false, false},
                       Row{D::kSim, false, false, true, false},
                       Row{D::kSimAsync, false, false, true, true}}) {
    SCOPED_TRACE(std::string(ModeName(r.kind)));
    EXPECT_EQ(IsCuda(r.kind), r.cuda);
    EXPECT_EQ(IsHostCompute(r.kind), r.host);
    EXPECT_EQ(IsSimulated(r.kind), r.simulated);
    EXPECT_EQ(IsAsyncSim(r.kind), r.async);
  }
}

TEST(Modes, TheOtherPredicates) {
  EXPECT_FALSE(IsMixed(Precision::kFp32));
  EXPECT_TRUE(IsMixed(Precision::kBf16));
  EXPECT_TRUE(IsMixed(Precision::kFp16));
  EXPECT_FALSE(ScalesLoss(Precision::kBf16));
  EXPECT_TRUE(ScalesLoss(Precision::kFp16));
  EXPECT_EQ(ComputeDType(Precision::kFp32), kernels::DType::kF32);
  EXPECT_EQ(ComputeDType(Precision::kBf16), kernels::DType::kBF16);
  EXPECT_EQ(ComputeDType(Precision::kFp16), kernels::DType::kF16);

  EXPECT_FALSE(PlansIterations(PlanMode::kOff));
  EXPECT_TRUE(PlansIterations(PlanMode::kAuto));
  EXPECT_TRUE(PlansIterations(PlanMode::kAlways));
  EXPECT_TRUE(DeclinesCostlierPlans(PlanMode::kAuto));
  EXPECT_FALSE(DeclinesCostlierPlans(PlanMode::kAlways));

  EXPECT_TRUE(MayStepOnDevice(OptimizerPlacement::kAuto));
  EXPECT_FALSE(MayStepOnDevice(OptimizerPlacement::kHost));

  EXPECT_TRUE(DefersSteps(OptimizerOverlap::kNextForward));
  EXPECT_TRUE(DefersSteps(OptimizerOverlap::kBackward));
  EXPECT_FALSE(DefersSteps(OptimizerOverlap::kOff));
  EXPECT_FALSE(SpeculatesSteps(OptimizerOverlap::kNextForward));
  EXPECT_TRUE(SpeculatesSteps(OptimizerOverlap::kBackward));
  EXPECT_FALSE(SpeculatesSteps(OptimizerOverlap::kOff));

  EXPECT_TRUE(CheckpointsDirect(CheckpointIo::kAuto));
  EXPECT_TRUE(CheckpointsDirect(CheckpointIo::kDirect));
  EXPECT_FALSE(CheckpointsDirect(CheckpointIo::kBuffered));

  EXPECT_TRUE(ServesInPlace(InPlace::kAuto));
  EXPECT_TRUE(ServesInPlace(InPlace::kOn));
  EXPECT_FALSE(ServesInPlace(InPlace::kOff));
  EXPECT_FALSE(RequiresInPlace(InPlace::kAuto));
  EXPECT_TRUE(RequiresInPlace(InPlace::kOn));
  EXPECT_FALSE(RequiresInPlace(InPlace::kOff));

  EXPECT_FALSE(RaisesOnUnmaterializedRead(UnmaterializedReads::kMaterialize));
  EXPECT_TRUE(RaisesOnUnmaterializedRead(UnmaterializedReads::kError));

  EXPECT_EQ(KernelIsaOf(KernelIsaMode::kAuto), std::nullopt);
  EXPECT_EQ(KernelIsaOf(KernelIsaMode::kScalar), kernels::Isa::kScalar);
  EXPECT_EQ(KernelIsaOf(KernelIsaMode::kAvx2), kernels::Isa::kAvx2);
  EXPECT_EQ(KernelIsaOf(KernelIsaMode::kAvx512), kernels::Isa::kAvx512);
}

}  // namespace
}  // namespace tiermem::session
