// Trace format and builder: round trips, every torn length and every flipped byte rejected
// with the right code, newer versions refused, unknown sections skipped, invalid content
// named, builder misuse reported; the canonical traces in tests/data load and are exactly
// what the generator makes today.
#include "planners/trace.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "planners/model_traces.h"
#include "base/crc32c.h"
#include "test_support.h"
#include "tests/support/paths.h"

namespace tiermem::planners {
namespace {

using testing::StatusIs;

Trace SmallTrace() {
  TraceBuilder b;
  const uint16_t p = b.KindIndex("param"), g = b.KindIndex("grad");
  b.DeclareChunk(1, TraceChunk{4096, Category::kGrad, 0, g, TierKind::kHost});
  b.DeclareChunk(0, TraceChunk{8192, Category::kParam, 0, p, TierKind::kNvme});
  b.SetSource("unit test");
  MeasuredRates r;
  r.link[1][0] = {12.5e9, 7000};
  r.link[0][1] = {11e9, 8000};
  r.cpu_optim_elems_per_s = 1.5e9;
  r.device_optim_elems_per_s = 9e10;
  r.cpu_cores = 3;
  b.SetRates(r);
  b.SetBudgets({1 << 20, 2 << 20, 3 << 20});
  for (int it = 0; it < 2; ++it) {
    b.BeginIteration();
    b.BeginMoment("fwd:a", MomentKind::kPreForward, 7);
    b.Access(0, AccessMode::kRead, TierKind::kDevice);
    b.SetSavedBytes(100);
    b.SetActivationBytes(300);
    b.EndMoment(1234);
    b.BeginMoment("bwd:a", MomentKind::kPreBackward, 7);
    b.Access(0, AccessMode::kRead, TierKind::kDevice);
    b.Access(1, AccessMode::kWrite, TierKind::kDevice);
    b.Access(1, AccessMode::kReadWrite, TierKind::kDevice);
    b.EndMoment(2345);
    b.BeginMoment("opt:g0", MomentKind::kOptimizerStep);
    b.Access(1, AccessMode::kRead, TierKind::kHost);
    b.Access(0, AccessMode::kReadWrite, TierKind::kHost);
    b.SetWorkElems(2048);
    b.EndMoment(it == 0 ? 999 : 1001);
  }
  auto t = b.Finish();
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return *t;
}

void ExpectSame(const Trace& a, const Trace& b) {
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.source, b.source);
  EXPECT_EQ(a.kind_names, b.kind_names);
  ASSERT_EQ(a.chunks.size(), b.chunks.size());
  for (size_t c = 0; c < a.chunks.size(); ++c) {
    EXPECT_EQ(a.chunks[c].bytes, b.chunks[c].bytes);
    EXPECT_EQ(a.chunks[c].category, b.chunks[c].category);
    EXPECT_EQ(a.chunks[c].group, b.chunks[c].group);
    EXPECT_EQ(a.chunks[c].kind, b.chunks[c].kind);
    EXPECT_EQ(a.chunks[c].home, b.chunks[c].home);
    EXPECT_EQ(a.chunks[c].expert_set, b.chunks[c].expert_set);
  }
  ASSERT_EQ(a.iterations.size(), b.iterations.size());
  for (size_t i = 0; i < a.iterations.size(); ++i) {
    const TraceIteration& x = a.iterations[i];
    const TraceIteration& y = b.iterations[i];
    ASSERT_EQ(x.moments.size(), y.moments.size());
    for (size_t m = 0; m < x.moments.size(); ++m) {
      EXPECT_EQ(x.moments[m].label, y.moments[m].label);
      EXPECT_EQ(x.moments[m].kind, y.moments[m].kind);
      EXPECT_EQ(x.moments[m].unit, y.moments[m].unit);
      EXPECT_EQ(x.moments[m].compute_ns, y.moments[m].compute_ns);
      EXPECT_EQ(x.moments[m].activation_bytes, y.moments[m].activation_bytes);
      EXPECT_EQ(x.moments[m].saved_bytes, y.moments[m].saved_bytes);
      EXPECT_EQ(x.moments[m].work_elems, y.moments[m].work_elems);
      EXPECT_EQ(x.moments[m].first_access, y.moments[m].first_access);
      EXPECT_EQ(x.moments[m].num_accesses, y.moments[m].num_accesses);
    }
    ASSERT_EQ(x.accesses.size(), y.accesses.size());
    EXPECT_EQ(0, std::memcmp(x.accesses.data(), y.accesses.data(),
                             x.accesses.size() * sizeof(TraceAccess)));
  }
  for (int s = 0; s < kNumTierKinds; ++s) {
    for (int d = 0; d < kNumTierKinds; ++d) {
      EXPECT_EQ(a.rates.link[s][d].bytes_per_s, b.rates.link[s][d].bytes_per_s);
      EXPECT_EQ(a.rates.link[s][d].latency_ns, b.rates.link[s][d].latency_ns);
    }
  }
  EXPECT_EQ(a.rates.cpu_optim_elems_per_s, b.rates.cpu_optim_elems_per_s);
  EXPECT_EQ(a.rates.device_optim_elems_per_s, b.rates.device_optim_elems_per_s);
  EXPECT_EQ(a.rates.cpu_cores, b.rates.cpu_cores);
  EXPECT_EQ(a.budgets.device, b.budgets.device);
  EXPECT_EQ(a.budgets.host, b.budgets.host);
  EXPECT_EQ(a.budgets.nvme, b.budgets.nvme);
}

// Rewrites the header's version and both checksums (as a newer writer would).
std::string WithVersion(std::string bytes, uint32_t version) {
  std::memcpy(&bytes[8], &version, 4);
  const uint32_t crc = Crc32c(bytes.data(), 28);
  std::memcpy(&bytes[28], &crc, 4);
  return bytes;
}

TEST(TraceBuilderTest, RecordsWhatItIsTold) {
  const Trace t = SmallTrace();
  ASSERT_EQ(t.chunks.size(), 2u);
  EXPECT_EQ(t.chunks[0].bytes, 8192u);
  EXPECT_EQ(t.chunks[0].home, TierKind::kNvme);
  EXPECT_EQ(t.KindName(1), "grad");
  ASSERT_EQ(t.iterations.size(), 2u);
  const TraceIteration& it = t.iterations[1];
  ASSERT_EQ(it.moments.size(), 3u);
  EXPECT_EQ(it.moments[1].first_access, 1u);
  EXPECT_EQ(it.moments[1].num_accesses, 3u);
  EXPECT_EQ(it.accesses[2].mode, AccessMode::kWrite);
  EXPECT_EQ(it.moments[2].compute_ns, 1001u);
  EXPECT_EQ(it.moments[2].work_elems, 2048u);
  EXPECT_EQ(it.moments[0].saved_bytes, 100u);
  EXPECT_EQ(t.TotalChunkBytes(), 12288u);
  EXPECT_EQ(t.MaxChunkBytes(), 8192u);
  EXPECT_EQ(t.NumGroups(), 1u);
}

TEST(TraceBuilderTest, ReportsMisuseAtFinish) {
  {
    TraceBuilder b;
    b.DeclareChunk(0, TraceChunk{1, Category::kParam, 0, b.KindIndex("p")});
    b.BeginIteration();
    b.Access(0, AccessMode::kRead, TierKind::kDevice);  // outside a moment
    b.BeginMoment("m", MomentKind::kOther);
    b.EndMoment(1);
    EXPECT_THAT(b.Finish().status(), StatusIs(StatusCode::kInvalidArgument, "outside"));
  }
  {
    TraceBuilder b;
    b.DeclareChunk(0, TraceChunk{1, Category::kParam, 0, b.KindIndex("p")});
    b.DeclareChunk(0, TraceChunk{1, Category::kParam, 0, 0});
    EXPECT_THAT(b.Finish().status(), StatusIs(StatusCode::kInvalidArgument, "declared twice"));
  }
  {
    TraceBuilder b;
    b.DeclareChunk(2, TraceChunk{1, Category::kParam, 0, b.KindIndex("p")});
    EXPECT_THAT(b.Finish().status(), StatusIs(StatusCode::kInvalidArgument, "chunk 0 was never"));
  }
  {
    TraceBuilder b;
    b.BeginIteration();
    b.BeginMoment("a", MomentKind::kOther);
    b.BeginMoment("b", MomentKind::kOther);
    EXPECT_THAT(b.Finish().status(), StatusIs(StatusCode::kInvalidArgument, "inside another"));
  }
  {
    // Usable again after Finish.
    TraceBuilder b;
    b.BeginIteration();
    b.BeginMoment("a", MomentKind::kOther);
    EXPECT_FALSE(b.Finish().ok());
    b.BeginIteration();
    b.BeginMoment("a", MomentKind::kOther);
    b.EndMoment(5);
    auto t = b.Finish();
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(t->iterations.size(), 1u);
  }
}

TEST(TraceFormatTest, RoundTripsInMemoryAndThroughAFile) {
  const Trace t = SmallTrace();
  const std::string bytes = EncodeTrace(t);
  auto back = DecodeTrace(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSame(t, *back);
  EXPECT_EQ(EncodeTrace(*back), bytes);

  const std::string path =
      (std::filesystem::temp_directory_path() / "tiermem_trace_test.tmtrace").string();
  ASSERT_TRUE(WriteTraceFile(t, path).ok());
  auto file = ReadTraceFile(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ExpectSame(t, *file);
  std::filesystem::remove(path);
  EXPECT_THAT(ReadTraceFile(path).status(), StatusIs(StatusCode::kNotFound, "open"));
}

TEST(TraceFormatTest, EveryTornLengthIsRejected) {
  const std::string bytes = EncodeTrace(SmallTrace());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto t = DecodeTrace(std::string_view(bytes).substr(0, n));
    ASSERT_FALSE(t.ok()) << n;
    // Shorter than the magic cannot be told from a foreign file.
    const StatusCode want = n < 8 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss;
    EXPECT_EQ(t.status().code(), want) << n << ": " << t.status().ToString();
  }
  EXPECT_THAT(DecodeTrace(bytes.substr(0, bytes.size() - 3)).status(),
              StatusIs(StatusCode::kDataLoss, "torn"));
  EXPECT_THAT(DecodeTrace(bytes + "x").status(), StatusIs(StatusCode::kDataLoss, "unexpected"));
}

TEST(TraceFormatTest, EveryFlippedByteIsRejected) {
  const std::string bytes = EncodeTrace(SmallTrace());
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x20;
    auto t = DecodeTrace(bad);
    ASSERT_FALSE(t.ok()) << "byte " << i;
    const StatusCode want = i < 8 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss;
    EXPECT_EQ(t.status().code(), want) << "byte " << i << ": " << t.status().ToString();
  }
}

TEST(TraceFormatTest, NewerVersionAndForeignFilesAreInvalidArguments) {
  const std::string bytes = EncodeTrace(SmallTrace());
  EXPECT_THAT(DecodeTrace(WithVersion(bytes, kTraceVersion + 1)).status(),
              StatusIs(StatusCode::kInvalidArgument, "newer than this build reads"));
  EXPECT_THAT(DecodeTrace("TIERMEM\x1a not a trace at all, a timeline").status(),
              StatusIs(StatusCode::kInvalidArgument, "not a tiermem trace"));
  EXPECT_THAT(DecodeTrace("").status(), StatusIs(StatusCode::kInvalidArgument, "not a tiermem"));
}

TEST(TraceFormatTest, UnknownSectionsAreSkipped) {
  std::string bytes = EncodeTrace(SmallTrace());
  // Append a section of kind 99 to the payload and fix up the header.
  std::string extra(8 + 5, '\0');
  const uint32_t kind = 99, len = 5;
  std::memcpy(&extra[0], &kind, 4);
  std::memcpy(&extra[4], &len, 4);
  std::memcpy(&extra[8], "hello", 5);
  bytes += extra;
  uint64_t payload = bytes.size() - 32;
  std::memcpy(&bytes[16], &payload, 8);
  const uint32_t pcrc = Crc32c(bytes.data() + 32, payload);
  std::memcpy(&bytes[24], &pcrc, 4);
  const uint32_t hcrc = Crc32c(bytes.data(), 28);
  std::memcpy(&bytes[28], &hcrc, 4);
  auto t = DecodeTrace(bytes);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ExpectSame(SmallTrace(), *t);
}

uint32_t FileVersion(const std::string& bytes) {
  uint32_t v = 0;
  std::memcpy(&v, &bytes[8], 4);
  return v;
}

// SmallTrace with chunk 1 (the grad) a member of expert set 4, marked as the runtime marks it:
// at its acquires, after the chunk table was declared.
Trace SmallExpertTrace() {
  Trace t = SmallTrace();
  TraceBuilder b;
  for (ChunkId c = 0; c < t.chunks.size(); ++c) b.DeclareChunk(c, t.chunks[c]);
  for (const std::string& k : t.kind_names) b.KindIndex(k);
  b.SetSource(t.source);
  b.SetRates(t.rates);
  b.SetBudgets(t.budgets);
  for (const TraceIteration& it : t.iterations) {
    b.BeginIteration();
    for (const Moment& m : it.moments) {
      b.BeginMoment(m.label, m.kind, m.unit);
      for (uint32_t a = 0; a < m.num_accesses; ++a) {
        const TraceAccess& x = it.accesses[m.first_access + a];
        b.Access(x.chunk, x.mode, x.tier);
        if (x.chunk == 1) b.MarkExpertSet(1, 4);
      }
      if (m.saved_bytes > 0) b.SetSavedBytes(m.saved_bytes);
      if (m.activation_bytes > 0) b.SetActivationBytes(m.activation_bytes);
      if (m.work_elems > 0) b.SetWorkElems(m.work_elems);
      b.EndMoment(m.compute_ns);
    }
  }
  auto out = b.Finish();
  EXPECT_TRUE(out.ok()) << out.status().ToString();
  return *out;
}

// Expert sets (format version 2): a trace with them round-trips as version 2; one without is
// written as version 1, byte for byte as before (tests/data's dense traces did not change),
// and a version-1 file reads with every chunk dense — also the runtime's recorded one.
TEST(TraceFormatTest, ExpertSetsAreVersion2AndVersion1FilesReadAsDense) {
  const Trace dense = SmallTrace();
  EXPECT_FALSE(dense.HasExpertSets());
  const std::string v1 = EncodeTrace(dense);
  EXPECT_EQ(FileVersion(v1), 1u);
  auto back1 = DecodeTrace(v1);
  ASSERT_TRUE(back1.ok()) << back1.status().ToString();
  for (const TraceChunk& c : back1->chunks) EXPECT_EQ(c.expert_set, kNoExpertSet);

  const Trace experts = SmallExpertTrace();
  ASSERT_TRUE(experts.HasExpertSets());
  EXPECT_EQ(experts.chunks[0].expert_set, kNoExpertSet);
  EXPECT_EQ(experts.chunks[1].expert_set, 4u);
  EXPECT_TRUE(experts.IsExpert(1));
  const std::string v2 = EncodeTrace(experts);
  EXPECT_EQ(FileVersion(v2), 2u);
  EXPECT_EQ(v2.size(), v1.size() + 8 + 4 + 4 * experts.chunks.size());  // the kind-5 section
  auto back2 = DecodeTrace(v2);
  ASSERT_TRUE(back2.ok()) << back2.status().ToString();
  ExpectSame(experts, *back2);
  EXPECT_EQ(EncodeTrace(*back2), v2);
  for (size_t n = 8; n < v2.size(); ++n) {
    EXPECT_EQ(DecodeTrace(std::string_view(v2).substr(0, n)).status().code(),
              StatusCode::kDataLoss)
        << n;
  }
  // The same section in a file that says version 1 is not version 1's: skipped as unknown.
  auto as_v1 = DecodeTrace(WithVersion(v2, 1));
  ASSERT_TRUE(as_v1.ok()) << as_v1.status().ToString();
  EXPECT_FALSE(as_v1->HasExpertSets());

  // The runtime's recording of the main job (version 1, before expert sets) reads dense.
  auto job = ReadTraceFile(::tiermem::testing::TestData("main-job.tmtrace"));
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_FALSE(job->HasExpertSets());
  // The canonical MoE trace marks its experts' param and grad chunks, 16 per block.
  auto moe = ReadTraceFile(::tiermem::testing::TestData("moe.tmtrace"));
  ASSERT_TRUE(moe.ok()) << moe.status().ToString();
  size_t members = 0;
  for (const TraceChunk& c : moe->chunks) {
    if (c.expert_set == kNoExpertSet) continue;
    ++members;
    EXPECT_LT(c.expert_set, 12u);
    EXPECT_TRUE(c.category == Category::kParam || c.category == Category::kGrad);
  }
  EXPECT_EQ(members, 12u * 8 * 2);
}

TEST(TraceValidateTest, NamesTheFirstViolation) {
  Trace t = SmallTrace();
  t.iterations[1].accesses[2].chunk = 99;
  EXPECT_THAT(ValidateTrace(t),
              StatusIs(StatusCode::kInvalidArgument,
                       "iteration 1 moment 1 (bwd:a) access 1: unknown chunk 99 (the chunk "
                       "table has 2 chunks)"));
  t = SmallTrace();
  t.iterations[0].accesses[0].tier = TierKind::kNvme;
  EXPECT_THAT(ValidateTrace(t), StatusIs(StatusCode::kInvalidArgument, "not nvme"));
  t = SmallTrace();
  t.iterations[0].moments[2].saved_bytes = 1;
  EXPECT_THAT(ValidateTrace(t), StatusIs(StatusCode::kInvalidArgument, "saved_bytes"));
  t = SmallTrace();
  t.iterations[0].accesses[3].tier = TierKind::kHost;  // chunk 1 on host and device in bwd
  EXPECT_THAT(ValidateTrace(t), StatusIs(StatusCode::kInvalidArgument, "both the device"));
  t = SmallTrace();
  t.chunks[1].bytes = 0;
  EXPECT_THAT(ValidateTrace(t), StatusIs(StatusCode::kInvalidArgument, "chunk 1 has 0 bytes"));
  t = SmallTrace();
  t.iterations[0].moments[1].num_accesses = 2;
  EXPECT_THAT(ValidateTrace(t), StatusIs(StatusCode::kInvalidArgument, "accesses start at"));
  // An encoded trace with a bad chunk id is rejected on read with the same message.
  t = SmallTrace();
  t.iterations[0].accesses[0].chunk = 5;
  EXPECT_THAT(DecodeTrace(EncodeTrace(t)).status(),
              StatusIs(StatusCode::kInvalidArgument, "unknown chunk 5"));
}

// The canonical traces load and are what the generator makes today (regenerate with
// tests/data/make_traces.sh after changing the generator or the format).
TEST(CanonicalTracesTest, LoadAndMatchTheGenerator) {
  for (const char* name : {"gpt", "gpt-ckpt", "gpt-tied", "moe"}) {
    SCOPED_TRACE(name);
    const std::string path = ::tiermem::testing::TestData(std::string(name) + ".tmtrace");
    auto t = ReadTraceFile(path);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_LT(std::filesystem::file_size(path), 1u << 20);
    auto shape = CanonicalShape(name);
    ASSERT_TRUE(shape.ok());
    auto fresh = ModelTrace(*shape);
    ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
    std::ifstream in(path, std::ios::binary);
    const std::string on_disk((std::istreambuf_iterator<char>(in)), {});
    EXPECT_TRUE(EncodeTrace(*fresh) == on_disk) << "regenerate with tests/data/make_traces.sh";
    EXPECT_GE(t->iterations.size(), 2u);
  }
}

// A synthetic trace is laid out by the session's packer (layout/chunk_layout.h PackPieces), so
// its chunks are those a session makes of the model. A small MoE model whose embeddings and
// head are larger than a chunk (one expert: 8,352 elements; vocab 300 x d 32 = 9,600): wte is
// split into 261 + 39 whole rows, the block's dense tensors follow its second piece, each expert
// has a chunk of its own, and the head's first piece fills the rest of ln_f's chunk (259 rows)
// — the packer fills a chunk's rest with whole rows before it opens one — its last 41 rows a
// chunk of their own: 6 groups.
TEST(ModelTraceTest, LaidOutByTheSessionsPacker) {
  ModelShape s;
  s.layers = 1;
  s.d_model = 32;
  s.heads = 1;
  s.vocab = 300;
  s.seq = 8;
  s.batch = 1;
  s.experts = 2;
  s.top_k = 2;
  s.iterations = 1;
  auto t = ModelTrace(s);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_NE(t->source.find("chunk_elems=8352 "), std::string::npos) << t->source;
  ASSERT_EQ(t->chunks.size(), 6u * 4);
  for (ChunkId c = 0; c < t->chunks.size(); ++c) {
    const uint32_t g = static_cast<uint32_t>(c / 4);
    // Experts' param and grad chunks are marked with their block's set.
    EXPECT_EQ(t->chunks[c].expert_set, (g == 2 || g == 3) && c % 4 < 2 ? 0u : kNoExpertSet) << c;
  }
  const TraceIteration& it = t->iterations[0];
  auto chunks_of = [&](const std::string& label) {
    std::vector<ChunkId> cs;
    for (const Moment& m : it.moments) {
      if (m.label != label) continue;
      for (uint32_t a = 0; a < m.num_accesses; ++a) cs.push_back(it.accesses[m.first_access + a].chunk);
    }
    return cs;
  };
  EXPECT_EQ(chunks_of("fwd:embed"), (std::vector<ChunkId>{0, 4}));         // groups 0, 1
  EXPECT_EQ(chunks_of("fwd:blocks.0"), (std::vector<ChunkId>{4, 8, 12}));  // 1, both experts
  EXPECT_EQ(chunks_of("fwd:head"), (std::vector<ChunkId>{16, 20}));        // groups 4, 5
  // The optimizer's work per group: the end of its last piece.
  std::vector<uint64_t> work;
  for (const Moment& m : it.moments) {
    if (m.kind == MomentKind::kOptimizerStep) work.push_back(m.work_elems);
  }
  EXPECT_EQ(work, (std::vector<uint64_t>{8352, 1248 + 256 + 64 + 3168 + 1056 + 64 + 64, 8352,
                                         8352, 64 + 259 * 32, 41 * 32}));
}

// A compressed optimizer-state format shrinks the m and v chunks of a synthetic trace (the
// planner and the simulator then count those bytes): int8's 1 + 4/256 bytes per element.
TEST(ModelTraceTest, StateBytesPerElementSizeTheOptimizerStateChunks) {
  auto shape = CanonicalShape("gpt");
  ASSERT_TRUE(shape.ok());
  auto fp32 = ModelTrace(*shape);
  shape->state_bytes_per_elem = 1 + 4.0 / 256;
  auto int8 = ModelTrace(*shape);
  ASSERT_TRUE(fp32.ok() && int8.ok());
  ASSERT_EQ(fp32->chunks.size(), int8->chunks.size());
  for (size_t c = 0; c < fp32->chunks.size(); ++c) {
    const std::string& kind = fp32->kind_names[fp32->chunks[c].kind];
    const Bytes b = fp32->chunks[c].bytes;
    if (kind == "exp_avg" || kind == "exp_avg_sq") {
      // elems + elems / 256 * 4 bytes
      EXPECT_EQ(int8->chunks[c].bytes, b / 4 + static_cast<Bytes>(std::ceil(b / 4 / 64.0))) << c;
    } else {
      EXPECT_EQ(int8->chunks[c].bytes, b) << c;
    }
  }
  shape->state_bytes_per_elem = 0;
  EXPECT_FALSE(ModelTrace(*shape).ok());
}

}  // namespace
}  // namespace tiermem::planners
