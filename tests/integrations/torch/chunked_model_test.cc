// tiermem::torch::ChunkedModel against plain LibTorch: the main job's GPT (small), AdamW
// steps on synthetic text with a device budget of 25% of params + grads + AdamW state,
// compared with the same model, data and torch::optim::AdamW; bf16, param groups with LR
// changes, checkpoints, the TIERMEM_* environment, bad input. Peaks come from the timeline.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <iterator>
#include <fstream>
#include <set>
#include <thread>

#include "integrations/torch/cpp/torch_pool.h"
#include "integrations/torch/examples/gpt.h"
#include "tests/support/paths.h"
#include "weights/weight_files.h"

namespace tiermem_example {
using tiermem::Bytes;
using tiermem::StatusCode;
using tiermem::TierKind;
namespace {

// The deprecated spelling of a unit's function type still names it (programs written
// against it keep compiling, with a deprecation warning).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static_assert(std::is_same_v<tiermem::torch::ChunkedModel::SegmentFn,
                             tiermem::torch::ChunkedModel::UnitFn>);
#pragma GCC diagnostic pop

GPTConfig SmallConfig() {
  GPTConfig c;
  c.n_layer = 3;  // 25% of its data is above the minimum device budget
  c.n_embd = 64;
  c.n_head = 4;
  c.block_size = 32;
  return c;
}

GPT MakeModel(const GPTConfig& c) {
  ::torch::manual_seed(0);
  return GPT(c);
}

// The parameters, each once: LibTorch's parameters() lists a tied tensor once per module
// (torch.nn.Module.parameters() in Python dedupes), and AdamW would step it twice.
std::vector<::torch::Tensor> UniqueParams(GPT& m) {
  std::vector<::torch::Tensor> out;
  std::set<const void*> seen;
  for (auto& p : m->parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

int64_t NumParams(GPT& m) {
  int64_t n = 0;
  std::set<const void*> seen;
  for (auto& p : m->parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  }
  return n;
}

// Parameters equal within rtol 1e-4 (atol 1e-6). One exception: the key part of the qkv
// bias has an exactly-zero gradient in exact arithmetic (softmax is shift-invariant), so its
// gradient is rounding noise that AdamW normalizes into lr-sized random steps; there an
// atol of 1e-5 (1% of lr) applies.
bool ParamClose(const std::string& name, const ::torch::Tensor& a, const ::torch::Tensor& b,
                int64_t n_embd) {
  if (name.size() >= 13 && name.compare(name.size() - 13, 13, "attn.qkv.bias") == 0) {
    return ::torch::allclose(a.narrow(0, 0, n_embd), b.narrow(0, 0, n_embd), 1e-4, 1e-6) &&
           ::torch::allclose(a.narrow(0, n_embd, n_embd), b.narrow(0, n_embd, n_embd), 1e-4,
                             1e-5) &&
           ::torch::allclose(a.narrow(0, 2 * n_embd, n_embd), b.narrow(0, 2 * n_embd, n_embd),
                             1e-4, 1e-6);
  }
  return ::torch::allclose(a, b, 1e-4, 1e-6);
}

constexpr double kLr = 1e-3;
constexpr int kSteps = 5;

// Plain LibTorch's losses: torch::optim::AdamW over `batches`.
std::vector<double> PlainAdamWLosses(
    GPT& ref, const std::vector<std::pair<::torch::Tensor, ::torch::Tensor>>& batches, double lr,
    double weight_decay) {
  ::torch::optim::AdamW opt(UniqueParams(ref),
                            ::torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
  std::vector<double> losses;
  for (const auto& [x, y] : batches) {
    opt.zero_grad();
    auto loss = LmLoss(ref->forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

TEST(ChunkedModel, TrainsLikePlainLibTorchWithin25PercentDeviceBudget) {
  ::torch::set_num_threads(1);
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, kSteps);

  // Plain LibTorch.
  GPT ref = MakeModel(c);
  const std::vector<double> ref_losses = PlainAdamWLosses(ref, batches, kLr, 0.01);

  // tiermem.
  GPT model = MakeModel(c);
  const Bytes model_bytes = static_cast<Bytes>(NumParams(model)) * 16;
  const Bytes budget = model_bytes / 4;
  auto created = tiermem::torch::ChunkedModel::Create(
      *model, {{"device_kind", "sim"}, {"device", budget}, {"host", "256MiB"},
               {"optimizer", {{"lr", kLr}, {"weight_decay", 0.01}}}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto& engine = **created;
  EXPECT_EQ(engine.model_bytes(), model_bytes);
  EXPECT_GT(engine.num_chunk_groups(), 1u);
  std::vector<double> losses;
  for (const auto& [x, y] : batches) {
    auto logits = model->forward(engine, x);
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    auto loss = LmLoss(*logits, y);
    loss.backward();
    auto stepped = engine.Step();
    ASSERT_TRUE(stepped.ok()) << stepped.status().ToString();
    EXPECT_TRUE(*stepped);
    ASSERT_TRUE(engine.ZeroGrad().ok());
    losses.push_back(loss.item<double>());
  }
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_NEAR(losses[i], ref_losses[i], 1e-5 * std::abs(ref_losses[i])) << "step " << i;
  }
  EXPECT_LT(losses.back(), losses.front());

  auto stats = engine.GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_GT(stats->peak(TierKind::kDevice), 0u);
  EXPECT_LE(stats->peak(TierKind::kDevice), budget);
  EXPECT_GT(stats->timeline.events, 0u);

  // Parameters: from the engine, then given back as ordinary tensors by Close().
  auto ref_params = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    auto v = engine.ParamValue(item.value());
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    const ::torch::Tensor& want = ref_params[item.key()];
    EXPECT_TRUE(ParamClose(item.key(), *v, want, c.n_embd))
        << item.key() << " max diff " << (*v - want).abs().max().item<double>() << " at "
        << (*v - want).abs().argmax().item<int64_t>();
  }
  ASSERT_TRUE(engine.Close().ok());
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(ParamClose(item.key(), item.value(), ref_params[item.key()], c.n_embd))
        << item.key();
  }
  // The tie survives: the head's weight is still the embedding's tensor.
  EXPECT_TRUE(model->head->weight.is_same(model->embed->wte->weight));
}

// A tied embedding larger than what the budget's chunks hold: split into pieces of rows (its
// units compute with a contiguous copy), trained like plain LibTorch, its gradient whole.
TEST(ChunkedModel, AParameterLargerThanAChunkTrainsLikePlainLibTorch) {
  ::torch::set_num_threads(1);
  GPTConfig c = SmallConfig();
  c.n_layer = 2;
  c.vocab_size = 2048;  // wte: 2048 x 64 = 131072 elements
  const auto batches = SyntheticBatches(c, 2, 3);
  GPT ref = MakeModel(c);
  ::torch::optim::AdamW opt(UniqueParams(ref),
                            ::torch::optim::AdamWOptions(kLr).weight_decay(0.01));
  std::vector<double> ref_losses;
  for (const auto& [x, y] : batches) {
    opt.zero_grad();
    auto loss = LmLoss(ref->forward(x), y);
    loss.backward();
    opt.step();
    ref_losses.push_back(loss.item<double>());
  }
  GPT model = MakeModel(c);
  const Bytes whole = 4 * 8 * 131072;  // four fp32 chunks of params + grads holding wte
  auto created = tiermem::torch::ChunkedModel::Create(
      *model, {{"device_kind", "sim"}, {"device", whole / 2}, {"host", "256MiB"},
               {"optimizer", {{"lr", kLr}, {"weight_decay", 0.01}}}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto& engine = **created;
  for (size_t i = 0; i < batches.size(); ++i) {
    auto logits = model->forward(engine, batches[i].first);
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    auto loss = LmLoss(*logits, batches[i].second);
    loss.backward();
    if (i + 1 == batches.size()) {  // the whole gradient, before the last step
      auto g = engine.Grad(model->embed->wte->weight);
      ASSERT_TRUE(g.ok()) << g.status().ToString();
      EXPECT_EQ(g->sizes(), model->embed->wte->weight.sizes());
    }
    ASSERT_TRUE(engine.Step().ok());
    ASSERT_TRUE(engine.ZeroGrad().ok());
    EXPECT_NEAR(loss.item<double>(), ref_losses[i], 1e-5 * std::abs(ref_losses[i]));
  }
  auto v = engine.ParamValue(model->embed->wte->weight);
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(ParamClose("wte", *v, ref->embed->wte->weight, c.n_embd));
  auto stats = engine.GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_LE(stats->peak(TierKind::kDevice), whole / 2);
}

TEST(ChunkedModel, GradientsMatchPlainLibTorch) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 2, 1);
  GPT ref = MakeModel(c);
  LmLoss(ref->forward(batches[0].first), batches[0].second).backward();
  GPT model = MakeModel(c);
  auto created = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto logits = model->forward(**created, batches[0].first);
  ASSERT_TRUE(logits.ok()) << logits.status().ToString();
  LmLoss(*logits, batches[0].second).backward();
  auto ref_params = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    auto g = (*created)->Grad(item.value());
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_TRUE(::torch::allclose(*g, ref_params[item.key()].grad(), 1e-4, 1e-7))
        << item.key() << " max diff "
        << (*g - ref_params[item.key()].grad()).abs().max().item<double>();
  }
}

// Dropout inside units: the backward's recompute draws the same masks as the forward (the
// default CPU generator is replayed), so gradients equal plain LibTorch's with the same seed,
// and the generator ends where plain LibTorch's does. Before, the recompute drew new masks:
// plausible, wrong gradients.
TEST(ChunkedModel, DropoutInsideUnitsGivesPlainLibTorchsGradients) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 2, 1);
  const auto& idx = batches[0].first;
  constexpr double kP = 0.3;
  auto drop = [](const ::torch::Tensor& t) { return ::torch::dropout(t, kP, /*train=*/true); };
  GPT ref = MakeModel(c);
  ::torch::manual_seed(7);
  {
    auto x = drop(ref->embed(idx));
    for (auto& b : ref->blocks) x = drop(b(x));
    LmLoss(ref->head(x), batches[0].second).backward();
  }
  const double ref_next = ::torch::rand({1}).item<double>();
  GPT model = MakeModel(c);
  auto created = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto& cm = **created;
  ::torch::manual_seed(7);
  auto x = cm.Run(*model->embed, [&](const auto&) { return drop(model->embed(idx)); });
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  for (auto& b : model->blocks) {
    x = cm.Run(*b, [&](const auto& in) { return drop(b(in[0])); }, {*x});
    ASSERT_TRUE(x.ok()) << x.status().ToString();
  }
  auto logits = cm.Run(*model->head, [&](const auto& in) { return model->head(in[0]); }, {*x});
  ASSERT_TRUE(logits.ok()) << logits.status().ToString();
  LmLoss(*logits, batches[0].second).backward();
  EXPECT_EQ(::torch::rand({1}).item<double>(), ref_next);  // the generator where torch's is
  auto ref_params = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    auto g = cm.Grad(item.value());
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_TRUE(::torch::allclose(*g, ref_params[item.key()].grad(), 1e-4, 1e-7))
        << item.key() << " max diff "
        << (*g - ref_params[item.key()].grad()).abs().max().item<double>();
  }
}

TEST(ChunkedModel, NoGradForwardMatchesPlainForward) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 2, 1);
  GPT ref = MakeModel(c);
  GPT model = MakeModel(c);
  auto created = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  ::torch::NoGradGuard no_grad;
  auto logits = model->forward(**created, batches[0].first);
  ASSERT_TRUE(logits.ok()) << logits.status().ToString();
  EXPECT_TRUE(::torch::equal(*logits, ref->forward(batches[0].first)));
}

TEST(ChunkedModel, BadInputIsAClearStatusAndLeavesTheModelUntouched) {
  const GPTConfig c = SmallConfig();
  GPT model = MakeModel(c);
  GPT ref = MakeModel(c);
  auto tiny = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "4KiB"}});
  ASSERT_FALSE(tiny.ok());
  EXPECT_EQ(tiny.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(tiny.status().message().find("minimum"), std::string::npos)
      << tiny.status().ToString();

  auto bad_key = tiermem::torch::ChunkedModel::Create(*model, {{"devise", "1MiB"}});
  ASSERT_FALSE(bad_key.ok());
  EXPECT_EQ(bad_key.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_key.status().message().find("devise"), std::string::npos);

  auto bad_value = tiermem::torch::ChunkedModel::Create(*model, {{"optimizer", {{"lr", "fast"}}}});
  ASSERT_FALSE(bad_value.ok());
  EXPECT_EQ(bad_value.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_value.status().message().find("optimizer.lr"), std::string::npos);

  auto bad_size = tiermem::torch::ChunkedModel::Create(*model, {{"host", "lots"}});
  ASSERT_FALSE(bad_size.ok());
  EXPECT_EQ(bad_size.status().code(), StatusCode::kInvalidArgument);

  auto cuda = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "cuda"}});
  ASSERT_FALSE(cuda.ok());
  EXPECT_TRUE(cuda.status().code() == StatusCode::kUnavailable ||
              cuda.status().code() == StatusCode::kUnimplemented)
      << cuda.status().ToString();

  auto acts = tiermem::torch::ChunkedModel::Create(*model, {{"activations", "offload"}});
  ASSERT_FALSE(acts.ok());
  EXPECT_EQ(acts.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(acts.status().message().find("Python-only"), std::string::npos);

  tiermem::torch::ParamGroup frozen_bad;
  frozen_bad.params.push_back(model->blocks[0]->fc->weight);
  auto twice = tiermem::torch::ChunkedModel::Create(
      *model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}}, {frozen_bad, frozen_bad});
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().message(),  // the session's rule and words (runtime/param_groups.h)
            "param_groups[1]: parameter block0.fc.weight appears in more than one group");
  auto missing = tiermem::torch::ChunkedModel::Create(
      *model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}}, {frozen_bad});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("is in no param group"), std::string::npos);
  model->blocks[1]->fc->bias.set_requires_grad(false);
  tiermem::torch::ParamGroup with_frozen;
  with_frozen.params.push_back(model->blocks[1]->fc->bias);
  auto frozen = tiermem::torch::ChunkedModel::Create(
      *model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}}, {with_frozen});
  model->blocks[1]->fc->bias.set_requires_grad(true);
  ASSERT_FALSE(frozen.ok());
  EXPECT_EQ(frozen.status().message(),
            "param_groups[0]: parameter block1.fc.bias is frozen (requires_grad=False)");

  auto ref_params = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(::torch::equal(item.value(), ref_params[item.key()])) << item.key();
  }
}

TEST(ChunkedModel, RunRefusesAUnitWithUnmanagedParameters) {
  const GPTConfig c = SmallConfig();
  GPT model = MakeModel(c);
  ::torch::nn::Linear stranger(4, 4);
  auto created = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto out = (*created)->Run(*stranger, [&](const auto&) { return stranger(::torch::ones({1, 4})); });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
}

TEST(ChunkedModel, ReadingAnotherUnitsParameterIsLoudNaNNeverPlausibleNumbers) {
  const GPTConfig c = SmallConfig();
  GPT model = MakeModel(c);
  auto created = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  ::torch::NoGradGuard no_grad;
  // The unit is block 0 but fn also uses block 1's weights.
  auto out = (*created)->Run(*model->blocks[0], [&](const auto& in) {
    return model->blocks[1](model->blocks[0](in[0]));
  }, {::torch::randn({1, 4, c.n_embd})});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(out->isnan().all().item<bool>());
}

// Two param groups (no decay for biases and norms, a larger lr) and a schedule that halves
// every lr after each step, against torch::optim::AdamW with the same groups and schedule.
TEST(ChunkedModel, ParamGroupsAndLearningRateChangesMatchLibTorch) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 6);
  auto split = [](GPT& m) {
    std::vector<::torch::Tensor> decay, no_decay;
    std::set<const void*> seen;
    for (auto& p : m->parameters()) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      (p.dim() >= 2 ? decay : no_decay).push_back(p);
    }
    return std::make_pair(decay, no_decay);
  };
  GPT ref = MakeModel(c);
  auto [rd, rn] = split(ref);
  std::vector<::torch::optim::OptimizerParamGroup> rgroups;
  rgroups.emplace_back(rd, std::make_unique<::torch::optim::AdamWOptions>(
                               ::torch::optim::AdamWOptions(1e-3).weight_decay(0.1)));
  rgroups.emplace_back(rn, std::make_unique<::torch::optim::AdamWOptions>(
                               ::torch::optim::AdamWOptions(3e-3).weight_decay(0.0)));
  ::torch::optim::AdamW opt(std::move(rgroups));
  GPT model = MakeModel(c);
  auto [d, n] = split(model);
  tiermem::torch::ParamGroup g0, g1;
  g0.params = d;
  g0.lr = 1e-3;
  g0.weight_decay = 0.1;
  g1.params = n;
  g1.lr = 3e-3;
  g1.weight_decay = 0.0;
  auto created = tiermem::torch::ChunkedModel::Create(
      *model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}}, {g0, g1});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto& cm = **created;
  ASSERT_EQ(cm.num_groups(), 2u);
  for (const auto& [x, y] : batches) {
    opt.zero_grad();
    auto rl = LmLoss(ref->forward(x), y);
    rl.backward();
    opt.step();
    auto logits = model->forward(cm, x);
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    auto loss = LmLoss(*logits, y);
    loss.backward();
    ASSERT_TRUE(cm.Step().ok());
    ASSERT_TRUE(cm.ZeroGrad().ok());
    EXPECT_NEAR(loss.item<double>(), rl.item<double>(), 1e-5 * std::abs(rl.item<double>()));
    for (size_t g = 0; g < 2; ++g) {
      auto& o = static_cast<::torch::optim::AdamWOptions&>(opt.param_groups()[g].options());
      o.lr(o.lr() * 0.5);
      ASSERT_TRUE(cm.SetLearningRate(g, cm.group_options(g).lr * 0.5).ok());
    }
  }
  EXPECT_EQ(cm.SetLearningRate(2, 1.0).code(), StatusCode::kOutOfRange);
}

// bf16: the model computes in bf16 inside Run (chunk views are bf16), the fp32 masters live in
// the host chunks, and training tracks fp32 training within mixed-precision tolerance.
TEST(ChunkedModel, Bf16TrainsWithFp32MastersAndTracksFp32) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 8);
  GPT ref = MakeModel(c);
  ::torch::optim::AdamW opt(UniqueParams(ref), ::torch::optim::AdamWOptions(1e-3));
  GPT model = MakeModel(c);
  auto created = tiermem::torch::ChunkedModel::Create(
      *model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}, {"precision", "bf16"},
               {"optimizer", {{"weight_decay", 0.01}}}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto& cm = **created;
  std::vector<double> losses, ref_losses;
  for (const auto& [x, y] : batches) {
    opt.zero_grad();
    auto rl = LmLoss(ref->forward(x), y);
    rl.backward();
    opt.step();
    ref_losses.push_back(rl.item<double>());
    auto logits = model->forward(cm, x);
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    EXPECT_EQ(logits->scalar_type(), ::torch::kBFloat16);
    auto loss = LmLoss(logits->to(::torch::kFloat32), y);
    loss.backward();
    ASSERT_TRUE(cm.Step().ok());
    ASSERT_TRUE(cm.ZeroGrad().ok());
    losses.push_back(loss.item<double>());
  }
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], ref_losses[i], 2e-2 * ref_losses[i]) << i;
  }
  EXPECT_LT(losses.back(), losses.front());
  auto w = cm.ParamValue(model->blocks[0]->fc->weight);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->scalar_type(), ::torch::kFloat32);  // the master
}

std::vector<double> TrainSteps(GPT& model, tiermem::torch::ChunkedModel& cm,
                               const std::vector<std::pair<::torch::Tensor, ::torch::Tensor>>& b,
                               size_t from, size_t to) {
  std::vector<double> out;
  for (size_t i = from; i < to; ++i) {
    auto logits = model->forward(cm, b[i].first);
    EXPECT_TRUE(logits.ok()) << logits.status().ToString();
    auto loss = LmLoss(*logits, b[i].second);
    loss.backward();
    EXPECT_TRUE(cm.Step().ok());
    EXPECT_TRUE(cm.ZeroGrad().ok());
    out.push_back(loss.item<double>());
  }
  return out;
}

TEST(ChunkedModel, SaveAndLoadResumeBitForBitAndATornFileChangesNothing) {
  // No std::filesystem in a binary linked with libtorch (see base/fs.h).
  const std::string dir = ::testing::TempDir();
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 6);
  const nlohmann::json cfg = {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}};
  GPT a = MakeModel(c);
  auto ca = tiermem::torch::ChunkedModel::Create(*a, cfg);
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  TrainSteps(a, **ca, batches, 0, 3);
  ASSERT_TRUE((*ca)->SetLearningRate(0, 5e-4).ok());
  ASSERT_TRUE((*ca)->Save(dir + "/ckpt").ok());
  const auto cont = TrainSteps(a, **ca, batches, 3, 6);

  ::torch::manual_seed(7);  // a different initialisation: everything must come from the file
  GPT b(c);
  auto cb = tiermem::torch::ChunkedModel::Create(*b, cfg);
  ASSERT_TRUE(cb.ok());
  // A torn copy first: an error, and nothing changes.
  {
    std::ifstream in(dir + "/ckpt", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(dir + "/torn", std::ios::binary).write(bytes.data(), bytes.size() / 2);
  }
  auto before = (*cb)->ParamValue(b->blocks[0]->fc->weight);
  tiermem::Status torn = (*cb)->Load(dir + "/torn");
  EXPECT_EQ(torn.code(), StatusCode::kDataLoss) << torn.ToString();
  EXPECT_TRUE(::torch::equal(*(*cb)->ParamValue(b->blocks[0]->fc->weight), *before));
  EXPECT_EQ((*cb)->group_options(0).lr, 1e-3);
  ASSERT_TRUE((*cb)->Load(dir + "/ckpt").ok());
  EXPECT_EQ((*cb)->group_options(0).lr, 5e-4);
  EXPECT_EQ(TrainSteps(b, **cb, batches, 3, 6), cont);
  // A file with another number of param groups is refused before anything changes.
  GPT d = MakeModel(c);
  std::vector<tiermem::torch::ParamGroup> two(2);
  for (const auto& t : UniqueParams(d)) two[t.dim() > 1 ? 0 : 1].params.push_back(t);
  auto cd = tiermem::torch::ChunkedModel::Create(*d, cfg, two);
  ASSERT_TRUE(cd.ok()) << cd.status().ToString();
  auto d_before = (*cd)->ParamValue(d->blocks[0]->fc->weight);
  tiermem::Status groups = (*cd)->Load(dir + "/ckpt");
  EXPECT_EQ(groups.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(groups.message().find("has 1 optimizer param groups, the optimizer has 2: nothing "
                                  "was loaded"),
            std::string::npos)
      << groups.ToString();
  EXPECT_TRUE(::torch::equal(*(*cd)->ParamValue(d->blocks[0]->fc->weight), *d_before));
  unlink((dir + "/ckpt").c_str());
  unlink((dir + "/torn").c_str());
}

// Pretrained weights (PretrainedWeights at Create, SaveWeights): a model trained a few steps is
// exported in shards (the tied head once, under the embedding's name) and loaded at Create
// into a differently initialized model — the same values and forward, bit for bit; a bf16
// export rounds as .to(kBFloat16); a checkpoint of another shape is refused, the model
// untouched.
TEST(ChunkedModel, PretrainedWeightsInAndOut) {
  char tmpl[] = "/tmp/tiermem-cm-weights-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 2);
  const nlohmann::json cfg = {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}};
  GPT a = MakeModel(c);
  auto ca = tiermem::torch::ChunkedModel::Create(*a, cfg);
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  TrainSteps(a, **ca, batches, 0, 2);
  tiermem::torch::SaveWeightsOptions o;
  o.max_shard_bytes = 40'000;
  ASSERT_TRUE((*ca)->SaveWeights(dir + "/w", o).ok());
  auto files = tiermem::weights::OpenWeights(dir + "/w");
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_GT(files->files.size(), 2u);
  EXPECT_NE(files->Find("embed.wte.weight"), nullptr);
  EXPECT_EQ(files->Find("head.weight"), nullptr);  // the tie, once

  ::torch::manual_seed(7);
  GPT b(c);
  auto cb = tiermem::torch::ChunkedModel::Create(*b, cfg, {}, {dir + "/w"});
  ASSERT_TRUE(cb.ok()) << cb.status().ToString();
  for (const auto& item : a->named_parameters()) {
    const ::torch::Tensor pb = b->named_parameters()[item.key()];
    EXPECT_TRUE(::torch::equal(*(*ca)->ParamValue(item.value()), *(*cb)->ParamValue(pb)))
        << item.key();
  }
  {
    ::torch::NoGradGuard no_grad;
    EXPECT_TRUE(::torch::equal(*a->forward(**ca, batches[0].first),
                               *b->forward(**cb, batches[0].first)));
  }
  tiermem::torch::SaveWeightsOptions bf16;
  bf16.dtype = ::torch::kBFloat16;
  ASSERT_TRUE((*ca)->SaveWeights(dir + "/w16.safetensors", bf16).ok());
  GPT h = MakeModel(c);
  auto ch = tiermem::torch::ChunkedModel::Create(*h, cfg, {}, {dir + "/w16.safetensors"});
  ASSERT_TRUE(ch.ok()) << ch.status().ToString();
  const ::torch::Tensor w = *(*ca)->ParamValue(a->blocks[1]->fc->weight);
  EXPECT_TRUE(::torch::equal(*(*ch)->ParamValue(h->blocks[1]->fc->weight),
                             w.to(::torch::kBFloat16).to(::torch::kFloat32)));

  GPTConfig wide = c;
  wide.n_embd = 48;
  wide.n_head = 4;
  GPT other = MakeModel(wide);
  const ::torch::Tensor before = other->blocks[0]->fc->weight.detach().clone();
  auto co = tiermem::torch::ChunkedModel::Create(*other, cfg, {}, {dir + "/w"});
  ASSERT_FALSE(co.ok());
  EXPECT_EQ(co.status().code(), StatusCode::kInvalidArgument) << co.status().ToString();
  EXPECT_NE(co.status().message().find("key 'embed.wte.weight' in " + dir + "/w/model-00001-of-"),
            std::string::npos)
      << co.status().ToString();
  EXPECT_TRUE(::torch::equal(other->blocks[0]->fc->weight, before));  // untouched
  for (auto* m : {&*ca, &*cb, &*ch}) ASSERT_TRUE((*m)->Close().ok());
  ASSERT_EQ(system(("rm -rf " + dir).c_str()), 0);
}

// optimizer.state_dtype int8 through the LibTorch API: losses track torch's fp32 AdamW (8-bit
// state is an approximation), the state reads back dequantized in fp32, and a checkpoint of
// int8 state resumes bit for bit.
TEST(ChunkedModel, Int8OptimizerStateTracksAdamWAndResumesBitForBit) {
  const std::string dir = ::testing::TempDir();
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 8);
  GPT ref = MakeModel(c);
  const std::vector<double> ref_losses = PlainAdamWLosses(ref, batches, 1e-3, 0.01);
  const nlohmann::json cfg = {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"},
                              {"optimizer", {{"weight_decay", 0.01}, {"state_dtype", "int8"}}}};
  GPT a = MakeModel(c);
  auto ca = tiermem::torch::ChunkedModel::Create(*a, cfg);
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  EXPECT_EQ((*ca)->config().optimizer_state.format.dtype, tiermem::kernels::StateDType::kInt8);
  const auto losses = TrainSteps(a, **ca, batches, 0, 4);
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], ref_losses[i], 1e-2 * ref_losses[i]) << i;
  }
  auto m = (*ca)->OptimizerState(a->blocks[0]->fc->weight, "exp_avg");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->scalar_type(), ::torch::kFloat32);
  EXPECT_EQ(m->sizes(), a->blocks[0]->fc->weight.sizes());
  EXPECT_GT(m->abs().max().item<float>(), 0.0f);
  ASSERT_TRUE((*ca)->Save(dir + "/int8-ckpt").ok());
  const auto cont = TrainSteps(a, **ca, batches, 4, 8);
  ::torch::manual_seed(7);
  GPT b(c);
  auto cb = tiermem::torch::ChunkedModel::Create(*b, cfg);
  ASSERT_TRUE(cb.ok());
  ASSERT_TRUE((*cb)->Load(dir + "/int8-ckpt").ok());
  EXPECT_EQ(TrainSteps(b, **cb, batches, 4, 8), cont);
  unlink((dir + "/int8-ckpt").c_str());
}

// A Load puts torch's default CPU generator back where the Save found it (so dropout after a
// resume draws what it would have drawn) and gives back `extra`.
TEST(ChunkedModel, SaveAndLoadRestoreTheCpuGeneratorAndExtra) {
  const std::string dir = ::testing::TempDir();
  ::torch::nn::Linear lin(3, 2);
  auto cm = tiermem::torch::ChunkedModel::Create(*lin, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "16MiB"}});
  ASSERT_TRUE(cm.ok()) << cm.status().ToString();
  ::torch::manual_seed(5);
  ASSERT_TRUE((*cm)->Save(dir + "/rng", {{"epoch", 3}, {"batch", 17}}).ok());
  const ::torch::Tensor expected = ::torch::rand({4});
  ::torch::manual_seed(6);
  nlohmann::json extra;
  ASSERT_TRUE((*cm)->Load(dir + "/rng", &extra).ok());
  EXPECT_TRUE(::torch::equal(::torch::rand({4}), expected));
  EXPECT_EQ(extra, nlohmann::json({{"epoch", 3}, {"batch", 17}}));
  unlink((dir + "/rng").c_str());
}

// A checkpoint ChunkedModel::Save wrote before the metadata had one format (version 2, its
// {"param_groups": [...]} string; tests/data/README.md) still loads: values, Adam state, step
// counts and the group's learning rate; then it trains on.
TEST(ChunkedModel, LoadsItsVersion2Checkpoint) {
  ::torch::nn::Linear lin(3, 2);
  auto cm = tiermem::torch::ChunkedModel::Create(*lin, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "16MiB"}});
  ASSERT_TRUE(cm.ok()) << cm.status().ToString();
  ::torch::manual_seed(5);
  const ::torch::Tensor rng_before = ::torch::rand({2});
  ::torch::manual_seed(5);
  nlohmann::json extra = "unset";
  tiermem::Status s =
      (*cm)->Load(::tiermem::testing::TestData("legacy-libtorch.safetensors"), &extra);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(extra.is_null());
  EXPECT_EQ((*cm)->group_options(0).lr, 5e-4);
  EXPECT_TRUE(::torch::equal(::torch::rand({2}), rng_before));  // the file has no RNG state
  EXPECT_TRUE(::torch::equal(*(*cm)->ParamValue(lin->weight),
                             ::torch::arange(6, ::torch::kFloat32).view({2, 3}) / 8));
  EXPECT_TRUE(::torch::equal(*(*cm)->OptimizerState(lin->bias, "exp_avg_sq"),
                             (::torch::arange(2, ::torch::kFloat32) + 10) / 512));
  EXPECT_EQ((*cm)->session().values().step_count(0), 3);
  auto out = (*cm)->Run(*lin, [&](const auto&) { return lin(::torch::ones({1, 3})); });
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  out->sum().backward();
  ASSERT_TRUE((*cm)->Step().ok());
  EXPECT_EQ((*cm)->session().values().step_count(0), 4);
}

// plan: auto through the LibTorch binding: the same session core records step 3, plans it and
// executes the plan from step 4; the values are those of the reactive engine, bit for bit.
TEST(ChunkedModel, APlanIsExecutedWithTheSameLosses) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 8);
  std::vector<double> losses[2];
  for (int k = 0; k < 2; ++k) {
    GPT m = MakeModel(c);
    const Bytes budget = static_cast<Bytes>(NumParams(m)) * 16 / 4;
    auto cm = tiermem::torch::ChunkedModel::Create(
        *m, {{"device_kind", "sim"}, {"device", budget}, {"host", "64MiB"}, {"plan", k == 0 ? "off" : "auto"}});
    ASSERT_TRUE(cm.ok()) << cm.status().ToString();
    losses[k] = TrainSteps(m, **cm, batches, 0, batches.size());
    const auto ps = (*cm)->session().plans().plan_status();
    if (k == 0) {
      EXPECT_EQ(ps.runner.plans, 0u);
    } else {
      EXPECT_TRUE(ps.active) << ps.error;
      EXPECT_EQ(ps.runner.divergences, 0u) << ps.runner.last_divergence;
      EXPECT_EQ(ps.runner.followed_iterations, batches.size() - 4);
      EXPECT_GT((*cm)->session().Stats()->plan_prefetches, 0u);
    }
  }
  EXPECT_EQ(losses[1], losses[0]);
}

// The asynchronous SimDevice (copies land late and out of order; tests/python/
// test_async_device.py says what it proves on a CPU) under the LibTorch binding: the same
// losses and values as the synchronous SimDevice, bit for bit, with and without a plan.
TEST(ChunkedModel, TheAsynchronousSimDeviceTrainsBitForBitLikeTheSynchronousOne) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 8);
  for (const char* plan : {"off", "auto"}) {
    std::vector<double> losses[2];
    std::vector<::torch::Tensor> params[2];
    for (int k = 0; k < 2; ++k) {
      GPT m = MakeModel(c);
      const Bytes budget = static_cast<Bytes>(NumParams(m)) * 16 / 4;
      auto cm = tiermem::torch::ChunkedModel::Create(
          *m, {{"device", budget}, {"host", "64MiB"}, {"plan", plan},
               {"device_kind", k == 0 ? "sim" : "sim-async"}});
      ASSERT_TRUE(cm.ok()) << cm.status().ToString();
      EXPECT_EQ((*cm)->session().config().device_kind,
                k == 0 ? tiermem::session::DeviceKind::kSim : tiermem::session::DeviceKind::kSimAsync);
      losses[k] = TrainSteps(m, **cm, batches, 0, batches.size());
      EXPECT_GT((*cm)->session().Stats()->evictions, 0u);
      for (const auto& item : m->named_parameters()) {
        auto v = (*cm)->ParamValue(item.value());
        ASSERT_TRUE(v.ok()) << v.status().ToString();
        params[k].push_back(*v);
      }
    }
    EXPECT_EQ(losses[1], losses[0]) << "plan " << plan;
    ASSERT_EQ(params[1].size(), params[0].size());
    for (size_t i = 0; i < params[0].size(); ++i) {
      EXPECT_TRUE(::torch::equal(params[1][i], params[0][i])) << "plan " << plan << " param " << i;
    }
  }
}

// Step() called from torch's thread runs the optimizer's tiles on torch's intra-op pool
// (torch_pool.h) when the thread counts agree: on every one of its threads (the library is
// built with OpenMP; without it the loop would silently run on one), with the same losses and
// parameters bit for bit as on the kernels' own pool.
TEST(ChunkedModel, TheOptimizerOnTorchsThreadsEqualsItsOwnPoolBitForBit) {
  const int saved = at::get_num_threads();
  at::set_num_threads(2);
  tiermem::kernels::SetKernelThreads(2);
  if (std::thread::hardware_concurrency() >= 2) {
    EXPECT_EQ(tiermem::torch_pool::Width(), 2u);
  }
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 6);
  std::vector<double> losses[2];
  std::vector<::torch::Tensor> params[2];
  for (int k = 0; k < 2; ++k) {
    tiermem::torch_pool::SetEnabled(k == 0);
    GPT m = MakeModel(c);
    const Bytes budget = static_cast<Bytes>(NumParams(m)) * 16 / 4;
    auto cm = tiermem::torch::ChunkedModel::Create(
        *m, {{"device_kind", "sim"}, {"device", budget}, {"host", "64MiB"}, {"cpu_threads", 2}});
    ASSERT_TRUE(cm.ok()) << cm.status().ToString();
    EXPECT_EQ(tiermem::torch_pool::ForThisThread() != nullptr, k == 0);
    losses[k] = TrainSteps(m, **cm, batches, 0, batches.size());
    for (const auto& item : m->named_parameters()) {
      auto v = (*cm)->ParamValue(item.value());
      ASSERT_TRUE(v.ok()) << v.status().ToString();
      params[k].push_back(*v);
    }
  }
  tiermem::torch_pool::SetEnabled(true);
  tiermem::kernels::SetKernelThreads(0);
  at::set_num_threads(saved);
  EXPECT_EQ(losses[1], losses[0]);
  for (size_t i = 0; i < params[0].size(); ++i) {
    EXPECT_TRUE(::torch::equal(params[1][i], params[0][i])) << "param " << i;
  }
}

// optimizer_overlap "backward" in LibTorch: the groups' updates run inside the backward
// (Run announces Step()'s hyper-parameters at the iteration's start), copy-on-write to NVMe
// where the host is full, and training is bit for bit that of "off" — with clipping that never
// triggers (every speculation committed) and clipping that always does (every one dropped and
// redone with the coefficient), and an LR change between steps (announced at the next
// iteration's start, so it drops nothing).
TEST(ChunkedModel, TheUpdateInsideTheBackwardIsBitForBitTheDeferredOne) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, 6);
  struct Case {
    const char* device_kind;
    double clip;  // 100: never triggers here; 0.01: always
  };
  for (const Case& cs : {Case{"host", 100.0}, Case{"sim", 100.0}, Case{"host", 0.01}}) {
    const std::string what = std::string(cs.device_kind) + " clip " + std::to_string(cs.clip);
    std::vector<double> losses[2];
    std::vector<::torch::Tensor> params[2];
    tiermem::session::Session::SpeculationStats spec;
    for (int k = 0; k < 2; ++k) {
      GPT m = MakeModel(c);
      const Bytes state = static_cast<Bytes>(NumParams(m)) * 16;  // params, grads, m, v
      const std::string dir = ::testing::TempDir() + "inback_" + cs.device_kind + std::to_string(k);
      nlohmann::json opts{{"device_kind", cs.device_kind},
                          {"host", state / 3},  // full of homes: m and v on NVMe
                          {"gradient_clipping", cs.clip},
                          {"optimizer_overlap", k == 0 ? "off" : "backward"},
                          {"nvme", {{"path", dir}, {"size", "64MiB"}}}};
      if (std::string(cs.device_kind) == "sim") opts["device"] = state / 4;
      auto cm = tiermem::torch::ChunkedModel::Create(*m, opts);
      ASSERT_TRUE(cm.ok()) << cm.status().ToString();
      losses[k] = TrainSteps(m, **cm, batches, 0, 3);
      ASSERT_TRUE((*cm)->SetLearningRate(0, kLr / 2).ok());
      const auto more = TrainSteps(m, **cm, batches, 3, batches.size());
      losses[k].insert(losses[k].end(), more.begin(), more.end());
      if (k == 1) spec = (*cm)->session().speculation_stats();
      for (const auto& item : m->named_parameters()) {
        auto v = (*cm)->ParamValue(item.value());
        ASSERT_TRUE(v.ok()) << v.status().ToString();
        params[k].push_back(*v);
      }
    }
    EXPECT_EQ(losses[1], losses[0]) << what;
    for (size_t i = 0; i < params[0].size(); ++i) {
      EXPECT_TRUE(::torch::equal(params[1][i], params[0][i])) << what << " param " << i;
    }
    EXPECT_GT(spec.speculated_nvme, 0u) << what;
    EXPECT_EQ(spec.committed + spec.dropped, spec.speculated) << what;
    if (cs.clip > 1) {
      EXPECT_EQ(spec.committed, spec.speculated) << what;
    } else {
      EXPECT_EQ(spec.dropped, spec.speculated) << what;
    }
  }
}

TEST(ChunkedModel, TheEnvironmentOverridesTheConfigLikeInPython) {
  const GPTConfig c = SmallConfig();
  GPT model = MakeModel(c);
  setenv("TIERMEM_DEVICE_BUDGET", "3MiB", 1);
  setenv("TIERMEM_HOST_BUDGET", "48MiB", 1);
  auto created = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}});
  unsetenv("TIERMEM_DEVICE_BUDGET");
  unsetenv("TIERMEM_HOST_BUDGET");
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  EXPECT_EQ((*created)->config().device_budget, 3u << 20);
  EXPECT_EQ((*created)->config().host_budget, 48u << 20);
  ASSERT_TRUE((*created)->Close().ok());
  setenv("TIERMEM_NVME_SIZE", "0", 1);
  auto bad = tiermem::torch::ChunkedModel::Create(*model, {{"device_kind", "sim"}, {"device", "1MiB"}});
  unsetenv("TIERMEM_NVME_SIZE");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("TIERMEM_NVME_SIZE='0'"), std::string::npos);
}

}  // namespace
}  // namespace tiermem_example
