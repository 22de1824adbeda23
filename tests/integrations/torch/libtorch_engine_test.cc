// tiermem::torch::Engine against plain LibTorch: the main job's GPT (small), 5 AdamW steps
// on synthetic text with a device budget of 25% of params + grads + AdamW state, compared
// with the same model, data and torch::optim::AdamW. Peaks come from the timeline file.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "integrations/torch/examples/gpt.h"

namespace tiermem_example {
using tiermem::Bytes;
using tiermem::StatusCode;
using tiermem::TierKind;
namespace {

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

TEST(LibTorchEngine, TrainsLikePlainLibTorchWithin25PercentDeviceBudget) {
  ::torch::set_num_threads(1);
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 4, kSteps);

  // Plain LibTorch.
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

  // tiermem.
  GPT model = MakeModel(c);
  const Bytes model_bytes = static_cast<Bytes>(NumParams(model)) * 16;
  const Bytes budget = model_bytes / 4;
  auto created = tiermem::torch::Engine::Create(
      *model, {{"device", budget}, {"host", "256MiB"},
               {"optimizer", {{"lr", kLr}, {"weight_decay", 0.01}}}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto& engine = **created;
  EXPECT_EQ(engine.model_bytes(), model_bytes);
  EXPECT_GT(engine.num_groups(), 1u);
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

  auto stats = engine.Stats();
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

TEST(LibTorchEngine, GradientsMatchPlainLibTorch) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 2, 1);
  GPT ref = MakeModel(c);
  LmLoss(ref->forward(batches[0].first), batches[0].second).backward();
  GPT model = MakeModel(c);
  auto created = tiermem::torch::Engine::Create(*model, {{"device", "1MiB"}, {"host", "64MiB"}});
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

TEST(LibTorchEngine, NoGradForwardMatchesPlainForward) {
  const GPTConfig c = SmallConfig();
  const auto batches = SyntheticBatches(c, 2, 1);
  GPT ref = MakeModel(c);
  GPT model = MakeModel(c);
  auto created = tiermem::torch::Engine::Create(*model, {{"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  ::torch::NoGradGuard no_grad;
  auto logits = model->forward(**created, batches[0].first);
  ASSERT_TRUE(logits.ok()) << logits.status().ToString();
  EXPECT_TRUE(::torch::equal(*logits, ref->forward(batches[0].first)));
}

TEST(LibTorchEngine, BadInputIsAClearStatusAndLeavesTheModelUntouched) {
  const GPTConfig c = SmallConfig();
  GPT model = MakeModel(c);
  GPT ref = MakeModel(c);
  auto tiny = tiermem::torch::Engine::Create(*model, {{"device", "4KiB"}});
  ASSERT_FALSE(tiny.ok());
  EXPECT_EQ(tiny.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(tiny.status().message().find("minimum"), std::string::npos)
      << tiny.status().ToString();

  auto bad_key = tiermem::torch::Engine::Create(*model, {{"devise", "1MiB"}});
  ASSERT_FALSE(bad_key.ok());
  EXPECT_EQ(bad_key.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_key.status().message().find("devise"), std::string::npos);

  auto bad_value = tiermem::torch::Engine::Create(*model, {{"optimizer", {{"lr", "fast"}}}});
  ASSERT_FALSE(bad_value.ok());
  EXPECT_EQ(bad_value.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_value.status().message().find("optimizer.lr"), std::string::npos);

  auto bad_size = tiermem::torch::Engine::Create(*model, {{"host", "lots"}});
  ASSERT_FALSE(bad_size.ok());
  EXPECT_EQ(bad_size.status().code(), StatusCode::kInvalidArgument);

  auto bf16 = tiermem::torch::Engine::Create(*model, {{"precision", "bf16"}});
  ASSERT_FALSE(bf16.ok());
  EXPECT_EQ(bf16.status().code(), StatusCode::kUnimplemented);

  auto ref_params = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(::torch::equal(item.value(), ref_params[item.key()])) << item.key();
  }
}

TEST(LibTorchEngine, RunRefusesASegmentWithUnmanagedParameters) {
  const GPTConfig c = SmallConfig();
  GPT model = MakeModel(c);
  ::torch::nn::Linear stranger(4, 4);
  auto created = tiermem::torch::Engine::Create(*model, {{"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto out = (*created)->Run(*stranger, [&](const auto&) { return stranger(::torch::ones({1, 4})); });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tiermem_example
