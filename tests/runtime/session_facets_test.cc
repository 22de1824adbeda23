// The session's facets (session_facets.h): views of one session, each of one concern. What a
// facet moved off Session's public face is no longer there; a facet made from a const session
// offers its queries only; and every facet sees the same session (a value written through one
// is read through another, a flag set through one is seen through the const session's).
#include <gtest/gtest.h>

#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/session.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::MakeSession;
using chunks::ChunkKind;

// Whether `S` offers each call (concepts, so that a private member reads as "not offered").
template <class S>
concept Acquires = requires(S& s) { s.Acquire(0, ChunkKind::kGrad, TierKind::kHost); };
template <class S>
concept ReadsParams = requires(S& s, float* out) { s.ReadParam(0, out); };
template <class S>
concept WritesParams = requires(S& s, const float* v) { s.WriteParam(0, v); };
template <class S>
concept ZeroesGrads = requires(S& s) { s.ZeroGrad(); };
template <class S>
concept SetsHasGrad = requires(S& s) { s.SetHasGrad(0, true); };
template <class S>
concept BeginsIterations = requires(S& s) { s.BeginIteration(); };
template <class S>
concept SetsTracing = requires(S& s) { s.SetTracing(false); };
template <class S>
concept AllocatesSpills = requires(S& s) { s.AllocateSpill(Bytes{1}); };
template <class S>
concept SetsHostBytes = requires(S& s) { s.SetExternalHostBytes(Bytes{0}); };
template <class S>
concept FinishesTraces = requires(S& s) { s.FinishTrace(); };
template <class S>
concept ReportsPlans = requires(S& s) { s.plan_status(); };
template <class S>
concept ReportsHomes = requires(S& s) { s.Home(0, ChunkKind::kGrad); };

// The layout's and the placement's facts are asked of layout() and placement(), not of Session.
template <class S>
concept ForwardsFacts = requires(S& s) { s.mixed(); } || requires(S& s) { s.compute_tier(); } ||
                        requires(S& s) { s.num_groups(); } || requires(S& s) { s.cuda(); };
static_assert(!ForwardsFacts<const Session> && ForwardsFacts<const Layout> &&
              ForwardsFacts<const Placement>);

// The members the facets hold are off Session's public face (private: their implementation)...
static_assert(!Acquires<Session> && !ReadsParams<Session> && !ZeroesGrads<Session> &&
              !BeginsIterations<Session> && !AllocatesSpills<Session> &&
              !FinishesTraces<Session> && !ReportsPlans<const Session>);
// ... and reached through them.
static_assert(Acquires<ChunksFacet> && ReadsParams<ValuesFacet> && ZeroesGrads<OptimizerFacet> &&
              BeginsIterations<IterationsFacet> && AllocatesSpills<MemoryFacet> &&
              FinishesTraces<TracesFacet> && ReportsPlans<const PlansFacet>);
// One accessor per facet, callable on a const session (a facet is a handle on the session);
// a facet held const answers queries and changes nothing.
static_assert(std::is_same_v<decltype(std::declval<const Session&>().chunks()), ChunksFacet>);
static_assert(std::is_same_v<decltype(std::declval<Session&>().chunks()), ChunksFacet>);
static_assert(ReportsHomes<const ChunksFacet> && !Acquires<const ChunksFacet>);
static_assert(!WritesParams<const ValuesFacet> && !SetsHasGrad<const OptimizerFacet> &&
              !SetsTracing<const IterationsFacet> && !SetsHostBytes<const MemoryFacet>);

TEST(SessionFacets, EveryFacetSeesTheSameSession) {
  auto s = MakeSession({{"chunk_size", 256}}, {{"w", 100, true, 0}, {"b", 10, true, 0}});
  ASSERT_NE(s, nullptr);
  const Session& c = *s;
  std::vector<float> w(100), back(100, -1.0f);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i);
  ASSERT_THAT(s->values().WriteParam(0, w.data()), IsOk());
  ASSERT_THAT(s->values().ReadParam(0, back.data()), IsOk());
  EXPECT_EQ(back, w);

  EXPECT_FALSE(c.optimizer().has_grad(1));
  s->optimizer().SetHasGrad(1, true);
  EXPECT_TRUE(c.optimizer().has_grad(1));
  EXPECT_FALSE(c.optimizer().has_grad(0));

  // A chunk acquired through chunks() is pinned as the const session's chunks() reports.
  const size_t g = c.layout().tensors[0].group;
  EXPECT_EQ(c.chunks().Pins(g, ChunkKind::kGrad), 0);
  ASSERT_TRUE(s->chunks().Acquire(g, ChunkKind::kGrad, c.placement().compute_tier()).ok());
  EXPECT_EQ(c.chunks().Pins(g, ChunkKind::kGrad), 1);
  ASSERT_THAT(s->chunks().Release(g, ChunkKind::kGrad, false), IsOk());
  EXPECT_EQ(c.chunks().Pins(g, ChunkKind::kGrad), 0);

  s->iterations().SetTracing(false);
  EXPECT_FALSE(c.iterations().tracing());
  s->iterations().Phase(RunPhase::kEval);
  EXPECT_EQ(c.iterations().phase(), RunPhase::kEval);
}

}  // namespace
}  // namespace tiermem::session
