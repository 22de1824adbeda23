// Sharded sessions (session.h, "Sharding"): N sessions, one per rank, each in its own thread,
// exchange shards through a test fake of the Collectives interface (threads and a barrier; the
// product's collectives are torch.distributed's, tested in tests/python/test_distributed.py).
// Checked here: the layout is the unsharded one split N ways; local writes and collective
// reads give back the full values; the step on shards equals the unsharded step bit for bit
// (fp32 and bf16, with clipping from summed stats); a checkpoint written at one world size
// loads at another.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/session.h"
#include "runtime/weights.h"
#include "tests/support/status_matchers.h"
#include "weights/shard_writer.h"
#include "weights/weight_files.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using nlohmann::json;

// All-gather among `world` threads: each puts its shard in its slot, all wait, each copies
// every slot, all wait again (so slots are not overwritten before everyone has read them).
class ThreadCollectives {
 public:
  explicit ThreadCollectives(int world) : world_(world), slots_(world), barrier_(world) {}
  class Rank final : public Collectives {
   public:
    Rank(ThreadCollectives* c, int rank) : c_(c), rank_(rank) {}
    Status AllGather(const void* shard, void* full, Bytes bytes) override {
      c_->slots_[rank_] = static_cast<const char*>(shard);
      c_->barrier_.arrive_and_wait();
      for (int r = 0; r < c_->world_; ++r) {
        std::memcpy(static_cast<char*>(full) + r * bytes, c_->slots_[r], bytes);
      }
      c_->barrier_.arrive_and_wait();
      return OkStatus();
    }
    double SumOverRanks(double v) {
      c_->sums_[rank_] = v;
      c_->barrier_.arrive_and_wait();
      double total = 0;
      for (int r = 0; r < c_->world_; ++r) total += c_->sums_[r];
      c_->barrier_.arrive_and_wait();
      return total;
    }

   private:
    ThreadCollectives* c_;
    int rank_;
  };

 private:
  const int world_;
  std::vector<const char*> slots_;
  std::vector<double> sums_ = std::vector<double>(64);
  std::barrier<> barrier_;
};

const std::vector<TensorSpec> kTensors = {{"emb", 3000, true, 0}, {"w", 2048, true, 0},
                                          {"b", 77, true, 0},     {"ln", 500, true, 0},
                                          {"frozen", 900, false, 0}};

std::unique_ptr<Session> Make(json config, Sharding sharding) {
  config["device_kind"] = "sim";
  config["host"] = "64MiB";
  config["chunk_size"] = 4096;
  auto c = ParseConfig(config, MapEnv({}));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  auto s = Session::Create(*c, kTensors, sharding);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

float Init(size_t t, size_t k) { return std::sin(0.01f * (k + 1) + t); }

// Ten steps; each step's gradient is a function of the current value (read collectively),
// written into this rank's grad shard the way a binding's reduce-scatter leaves it.
std::vector<std::vector<float>> Train(Session& s, ThreadCollectives::Rank* comm, bool mixed) {
  for (size_t t = 0; t < kTensors.size(); ++t) {
    std::vector<float> v(kTensors[t].numel);
    for (size_t k = 0; k < v.size(); ++k) v[k] = Init(t, k);
    EXPECT_THAT(s.values().WriteParam(t, v.data()), IsOk());
  }
  const std::vector<GroupHyper> hyper = {GroupHyper{1e-2, 0.9, 0.999, 1e-8, 0.01}};
  for (int step = 0; step < 10; ++step) {
    s.iterations().BeginIteration();
    for (size_t t = 0; t < kTensors.size(); ++t) {
      if (!kTensors[t].trainable) continue;
      const TensorPlace& p = s.layout().place(t);
      std::vector<float> cur(p.numel), g(p.numel);
      EXPECT_THAT(s.values().ReadParam(t, cur.data()), IsOk());
      for (size_t k = 0; k < g.size(); ++k) g[k] = 0.3f * cur[k] + std::cos(0.2f * step + k);
      // This rank's part of the tensor's gradient, at its place in the shard.
      const uint64_t lo = std::max(p.offset, s.layout().shard_begin);
      const uint64_t hi = std::min(p.offset + p.numel, s.layout().shard_begin + s.layout().shard_elems);
      auto base = s.chunks().Acquire(p.group, ChunkKind::kGrad, TierKind::kDevice);
      EXPECT_TRUE(base.ok()) << base.status().ToString();
      if (lo < hi) {
        const size_t es = kernels::DTypeSize(s.layout().dtype(ChunkKind::kGrad));
        char* dst = static_cast<char*>(*base) + (lo - s.layout().shard_begin) * es;
        if (!mixed) {
          std::memcpy(dst, g.data() + (lo - p.offset), (hi - lo) * 4);
        } else {
          kernels::CastFromF32(g.data() + (lo - p.offset), dst, s.layout().dtype(ChunkKind::kGrad),
                               hi - lo);
        }
      }
      EXPECT_THAT(s.chunks().Release(p.group, ChunkKind::kGrad, true), IsOk());
      s.optimizer().SetHasGrad(t, true);
    }
    StatusOr<StepResult> r = InternalError("not run");
    if (s.layout().sharded()) {
      auto local = s.optimizer().GradStats();
      EXPECT_TRUE(local.ok());
      kernels::GradStats global;
      global.sq_norm = comm->SumOverRanks(local->sq_norm);
      global.overflow = comm->SumOverRanks(local->overflow ? 1 : 0) > 0;
      r = s.optimizer().Step(hyper, &global);
    } else {
      r = s.optimizer().Step(hyper);
    }
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_THAT(s.optimizer().ZeroGrad(), IsOk());
  }
  std::vector<std::vector<float>> out;
  for (size_t t = 0; t < kTensors.size(); ++t) {
    out.emplace_back(kTensors[t].numel);
    EXPECT_THAT(s.values().ReadParam(t, out.back().data()), IsOk());
  }
  return out;
}

// Runs `fn(session, comm)` on `world` threads, one sharded session each.
std::vector<std::vector<std::vector<float>>> OnRanks(
    int world, json config,
    const std::function<std::vector<std::vector<float>>(Session&, ThreadCollectives::Rank*)>& fn,
    std::vector<Bytes>* chunk_bytes = nullptr) {
  ThreadCollectives tc(world);
  std::vector<std::vector<std::vector<float>>> out(world);
  if (chunk_bytes) chunk_bytes->assign(world, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      ThreadCollectives::Rank comm(&tc, r);
      auto s = Make(config, Sharding{world, r, &comm});
      if (!s) return;
      if (chunk_bytes) (*chunk_bytes)[r] = s->placement().total_chunk_bytes;
      out[r] = fn(*s, &comm);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(SessionShard, BadShardingIsRefused) {
  auto c = ParseConfig(json{{"device_kind", "sim"}}, MapEnv({}));
  ASSERT_TRUE(c.ok());
  EXPECT_THAT(Session::Create(*c, kTensors, Sharding{2, 2, nullptr}),
              ::tiermem::testing::StatusIs(StatusCode::kInvalidArgument, "rank 2 of a world of 2"));
  EXPECT_THAT(Session::Create(*c, kTensors, Sharding{2, 0, nullptr}),
              ::tiermem::testing::StatusIs(StatusCode::kInvalidArgument, "collectives"));
}

TEST(SessionShard, StepsOnShardsEqualTheUnshardedStepBitForBit) {
  for (bool mixed : {false, true}) {
    for (double clip : {0.0, 0.5}) {
      const json config = {{"device", "1MiB"},
                           {"precision", mixed ? "bf16" : "fp32"},
                           {"gradient_clipping", clip}};
      auto one = Make(config, {});
      ASSERT_TRUE(one);
      const auto want = Train(*one, nullptr, mixed);
      for (int world : {2, 3}) {
        SCOPED_TRACE("world " + std::to_string(world) + (mixed ? " bf16" : " fp32") + " clip " +
                     std::to_string(clip));
        std::vector<Bytes> bytes;
        const auto got = OnRanks(world, config,
                                 [&](Session& s, ThreadCollectives::Rank* c) {
                                   EXPECT_EQ(s.layout().chunk_elems % (64 * world), 0u);
                                   EXPECT_EQ(s.layout().shard_elems * world, s.layout().chunk_elems);
                                   return Train(s, c, mixed);
                                 },
                                 &bytes);
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(got[r].size(), want.size());
          for (size_t t = 0; t < want.size(); ++t) {
            EXPECT_EQ(std::memcmp(got[r][t].data(), want[t].data(), want[t].size() * 4), 0)
                << "rank " << r << " tensor " << kTensors[t].name;
          }
          // Each rank holds its share of the chunks (the chunk size rounds up a little).
          EXPECT_LE(bytes[r], one->placement().total_chunk_bytes / world + one->placement().total_chunk_bytes / 8);
        }
      }
    }
  }
}

// int8 optimizer state (tensors from 256 elements quantized; shards hold whole blocks): the
// step on shards equals the unsharded one, values and m/v read back whole, and a checkpoint
// saved at 2 ranks (its codes gathered) loads at 3 with the same codes.
TEST(SessionShard, Int8StateOnShardsEqualsTheUnshardedStepAndItsCheckpointMoves) {
  const json config = {{"device", "1MiB"},
                       {"optimizer", {{"state_dtype", "int8"}, {"state_min_elems", 256}}}};
  auto one = Make(config, {});
  ASSERT_TRUE(one);
  const auto want = Train(*one, nullptr, false);
  auto state_of = [](Session& s) {
    std::vector<std::vector<float>> out;
    for (size_t t = 0; t < kTensors.size(); ++t) {
      if (!kTensors[t].trainable) continue;
      for (ChunkKind k : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
        out.emplace_back(kTensors[t].numel);
        EXPECT_THAT(s.values().ReadTensor(t, k, out.back().data()), IsOk());
      }
    }
    return out;
  };
  const auto want_state = state_of(*one);
  const std::string dir = ::testing::TempDir() + "tiermem_shard_int8";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/ckpt.safetensors";
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const auto got = OnRanks(world, config, [&](Session& s, ThreadCollectives::Rank* c) {
      EXPECT_EQ(s.layout().shard_elems % 256, 0u);
      EXPECT_EQ(s.values().state_format(s.layout().place(0).group).dtype, kernels::StateDType::kInt8);
      auto v = Train(s, c, false);
      EXPECT_EQ(state_of(s), want_state);
      if (s.layout().world == 2) {
        EXPECT_THAT(s.SaveCheckpoint(path), IsOk());
      }
      return v;
    });
    for (int r = 0; r < world; ++r) EXPECT_EQ(got[r], want) << "rank " << r;
  }
  OnRanks(3, config, [&](Session& s, ThreadCollectives::Rank*) {
    EXPECT_THAT(s.LoadCheckpoint(path), IsOk());
    EXPECT_EQ(state_of(s), want_state);
    return std::vector<std::vector<float>>{};
  });
  std::filesystem::remove_all(dir);
}

TEST(SessionShard, ACheckpointSavedAtOneWorldSizeLoadsAtAnother) {
  const std::string dir = ::testing::TempDir() + "tiermem_shard_ckpt";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/ckpt.safetensors";
  const json config = {{"device", "1MiB"}};
  // Trained at 2 ranks, saved (rank 0 writes).
  const auto trained = OnRanks(2, config, [&](Session& s, ThreadCollectives::Rank* c) {
    auto v = Train(s, c, false);
    EXPECT_THAT(s.SaveCheckpoint(path), IsOk());
    return v;
  });
  // Loaded at 3 ranks and at 1: the same values (every rank reads the file, keeps its part;
  // the reads gather).
  for (int world : {3, 1}) {
    std::vector<std::vector<std::vector<float>>> got;
    if (world == 1) {
      auto s = Make(config, {});
      ASSERT_THAT(s->LoadCheckpoint(path), IsOk());
      std::vector<std::vector<float>> v;
      for (size_t t = 0; t < kTensors.size(); ++t) {
        v.emplace_back(kTensors[t].numel);
        EXPECT_THAT(s->values().ReadParam(t, v.back().data()), IsOk());
        EXPECT_EQ(s->values().step_count(t), kTensors[t].trainable ? 10 : 0);
      }
      got.push_back(v);
    } else {
      got = OnRanks(world, config, [&](Session& s, ThreadCollectives::Rank*) {
        CheckpointLoad verify;
        verify.verify_only = true;
        EXPECT_THAT(s.LoadCheckpoint(path, nullptr, verify), IsOk());
        EXPECT_THAT(s.LoadCheckpoint(path), IsOk());
        std::vector<std::vector<float>> v;
        for (size_t t = 0; t < kTensors.size(); ++t) {
          v.emplace_back(kTensors[t].numel);
          EXPECT_THAT(s.values().ReadParam(t, v.back().data()), IsOk());
        }
        return v;
      });
    }
    for (const auto& rank_values : got) {
      for (size_t t = 0; t < kTensors.size(); ++t) {
        EXPECT_EQ(rank_values[t], trained[0][t]) << "world " << world << " " << kTensors[t].name;
      }
    }
  }
  std::filesystem::remove_all(dir);
}

// Pretrained weights on shards (runtime/weights.h): each rank reads only the bytes of its
// shard of every chunk and writes only its shard, with no collective; the values gathered
// afterwards are the file's (bf16 ones widened, mixed precision rounded as WriteParam). An
// export from the shards (every rank reads collectively, rank 0 writes) loads back into an
// unsharded session.
TEST(SessionShard, PretrainedWeightsLoadIntoShardsAndExportFromThem) {
  char tmpl[] = "/tmp/tiermem-shard-weights-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<weights::ShardEntry> entries;
  std::vector<std::vector<float>> want(kTensors.size());
  for (size_t t = 0; t < kTensors.size(); ++t) {
    const weights::DType d = t % 2 ? weights::DType::kBF16 : weights::DType::kF32;
    entries.push_back({kTensors[t].name, d, {kTensors[t].numel}});
    for (size_t k = 0; k < kTensors[t].numel; ++k) want[t].push_back(Init(t, k));
    if (d == weights::DType::kBF16) {
      std::vector<uint16_t> low(want[t].size());
      kernels::CastFromF32(want[t].data(), low.data(), kernels::DType::kBF16, low.size());
      kernels::CastToF32(low.data(), kernels::DType::kBF16, want[t].data(), low.size());
    }
  }
  weights::ShardWriterOptions wo;
  wo.max_shard_bytes = 8000;
  auto w = weights::ShardWriter::Create(dir + "/ckpt", entries, wo);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  uint64_t total = 0;
  for (size_t i : (*w)->order()) {
    total += entries[i].bytes();
    if (entries[i].dtype == weights::DType::kF32) {
      ASSERT_THAT((*w)->Put(want[i].data(), want[i].size() * 4), IsOk());
    } else {
      std::vector<uint16_t> low(want[i].size());
      kernels::CastFromF32(want[i].data(), low.data(), kernels::DType::kBF16, low.size());
      ASSERT_THAT((*w)->Put(low.data(), low.size() * 2), IsOk());
    }
  }
  ASSERT_THAT((*w)->Finish(), IsOk());
  auto files = weights::OpenWeights(dir + "/ckpt");
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  // The loads (no collective in them) take turns: each makes and drops an io_uring ring, whose
  // memory liburing maps with raw syscalls TSan does not see, so rings of threads posing as
  // ranks reusing each other's addresses would look like races (real ranks are processes).
  std::mutex one_load;
  for (const char* precision : {"fp32", "bf16"}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(precision) + " world " + std::to_string(world));
      const std::string out = dir + "/out" + std::to_string(world) + precision;
      std::vector<uint64_t> needed(world);
      const auto got = OnRanks(world, {{"device", "1MiB"}, {"precision", precision}},
                               [&](Session& s, ThreadCollectives::Rank*) {
                                 std::vector<WeightTarget> targets;
                                 for (size_t t = 0; t < s.layout().num_tensors(); ++t) {
                                   targets.push_back({t, {{s.layout().spec(t).name}}});
                                 }
                                 std::unique_lock<std::mutex> turn(one_load);
                                 auto r = LoadWeights(s, *files, targets);
                                 turn.unlock();
                                 EXPECT_TRUE(r.ok()) << r.status().ToString();
                                 if (r.ok()) needed[s.layout().rank] = r->bytes_needed;
                                 std::vector<ExportEntry> e;
                                 for (size_t t = 0; t < s.layout().num_tensors(); ++t) {
                                   e.push_back({s.layout().spec(t).name,
                                                {static_cast<int64_t>(s.layout().spec(t).numel)},
                                                {{t, 0, s.layout().spec(t).numel}}});
                                 }
                                 // Pieces smaller than the tensors: every rank reads the
                                 // same ranges, piece by piece (the reads gather).
                                 ExportOptions o;
                                 o.piece_elems = 7;
                                 EXPECT_THAT(ExportWeights(s, out, e, o), IsOk());
                                 std::vector<std::vector<float>> v;
                                 for (size_t t = 0; t < s.layout().num_tensors(); ++t) {
                                   v.emplace_back(s.layout().spec(t).numel);
                                   EXPECT_THAT(s.values().ReadParam(t, v.back().data()), IsOk());
                                 }
                                 return v;
                               });
      uint64_t sum = 0;
      for (int r = 0; r < world; ++r) {
        EXPECT_LT(needed[r], total) << "rank " << r;  // its shard's bytes only
        sum += needed[r];
        ASSERT_EQ(got[r].size(), want.size());
        for (size_t t = 0; t < want.size(); ++t) EXPECT_EQ(got[r][t], want[t]) << kTensors[t].name;
      }
      EXPECT_EQ(sum, total);  // each byte by exactly one rank
      auto one = Make({{"device", "1MiB"}}, {});
      ASSERT_TRUE(one);
      auto back = weights::OpenWeights(out);
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      std::vector<WeightTarget> targets;
      for (size_t t = 0; t < one->layout().num_tensors(); ++t) targets.push_back({t, {{kTensors[t].name}}});
      ASSERT_THAT(LoadWeights(*one, *back, targets).status(), IsOk());
      for (size_t t = 0; t < want.size(); ++t) {
        std::vector<float> v(kTensors[t].numel);
        ASSERT_THAT(one->values().ReadParam(t, v.data()), IsOk());
        EXPECT_EQ(v, want[t]) << kTensors[t].name;
      }
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem::session
