// The main job from C++: trains the repo's GPT-style decoder (gpt.h, the architecture of
// tiermem/examples/gpt.py; smaller defaults) with tiermem::torch::ChunkedModel on synthetic text,
// with a device budget of about 25% of params + grads + AdamW state; prints the loss per
// step and the per-tier peaks read from the timeline.
//
//   build/integrations/torch/tiermem_train_gpt [--steps 10] [--n-layer 4] [--n-embd 128]
//       [--batch 8] [--budget-fraction 0.25] [--timeline build/train_gpt_cpp.tmt]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "gpt.h"

namespace {

double Mib(tiermem::Bytes b) { return static_cast<double>(b) / (1 << 20); }

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--steps N] [--n-layer N] [--n-embd N] [--n-head N] "
               "[--block-size N] [--batch N] [--lr X] [--budget-fraction X] [--timeline PATH]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using tiermem_example::GPT;
  using tiermem_example::GPTConfig;
  GPTConfig c;
  c.n_layer = 4;
  c.n_embd = 128;
  c.n_head = 4;
  c.block_size = 64;
  int steps = 10;
  int64_t batch = 8;
  double lr = 1e-3, fraction = 0.25;
  std::string timeline = "build/train_gpt_cpp.tmt";
  for (int i = 1; i < argc; ++i) {
    auto next = [&](const char* flag) -> const char* {
      if (std::strcmp(argv[i], flag) != 0 || i + 1 >= argc) return nullptr;
      return argv[++i];
    };
    if (const char* v = next("--steps")) steps = std::atoi(v);
    else if (const char* v = next("--n-layer")) c.n_layer = std::atoll(v);
    else if (const char* v = next("--n-embd")) c.n_embd = std::atoll(v);
    else if (const char* v = next("--n-head")) c.n_head = std::atoll(v);
    else if (const char* v = next("--block-size")) c.block_size = std::atoll(v);
    else if (const char* v = next("--batch")) batch = std::atoll(v);
    else if (const char* v = next("--lr")) lr = std::atof(v);
    else if (const char* v = next("--budget-fraction")) fraction = std::atof(v);
    else if (const char* v = next("--timeline")) timeline = v;
    else return Usage(argv[0]);
  }
  if (steps < 1 || batch < 1 || c.n_layer < 1 || c.n_embd % c.n_head != 0 || fraction <= 0) {
    return Usage(argv[0]);
  }

  ::torch::manual_seed(0);
  GPT model(c);
  int64_t n_params = 0;
  std::set<const void*> seen;
  for (auto& p : model->parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) n_params += p.numel();
  }
  const auto budget = static_cast<tiermem::Bytes>(static_cast<double>(n_params) * 16 * fraction);
  nlohmann::json config = {{"device", budget},
                           {"host", "1GiB"},
                           {"timeline", timeline},
                           {"optimizer", {{"lr", lr}, {"weight_decay", 0.01}}}};
  auto created = tiermem::torch::ChunkedModel::Create(*model, config);
  if (!created.ok()) {
    std::fprintf(stderr, "tiermem: %s\n", created.status().ToString().c_str());
    return 1;
  }
  tiermem::torch::ChunkedModel& engine = **created;
  std::printf("model: %.2f M params; params+grads+AdamW = %.1f MiB = %.1fx the device budget "
              "of %.1f MiB; chunk %llu elements x %zu groups\n",
              n_params / 1e6, Mib(engine.model_bytes()),
              static_cast<double>(engine.model_bytes()) / budget, Mib(budget),
              static_cast<unsigned long long>(engine.chunk_elems()), engine.num_chunk_groups());

  const auto batches = tiermem_example::SyntheticBatches(c, batch, steps);
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    const auto& [x, y] = batches[s];
    auto logits = model->forward(engine, x);
    if (!logits.ok()) {
      std::fprintf(stderr, "tiermem: %s\n", logits.status().ToString().c_str());
      return 1;
    }
    auto loss = tiermem_example::LmLoss(*logits, y);
    loss.backward();
    auto stepped = engine.Step();
    tiermem::Status z = stepped.ok() ? engine.ZeroGrad() : stepped.status();
    if (!z.ok()) {
      std::fprintf(stderr, "tiermem: %s\n", z.ToString().c_str());
      return 1;
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("step %3d  loss %.4f  %.0f tokens/s\n", s + 1, loss.item<double>(),
                (s + 1) * batch * c.block_size / secs);
  }
  auto stats = engine.GetStats();
  if (!stats.ok()) {
    std::fprintf(stderr, "tiermem: %s\n", stats.status().ToString().c_str());
    return 1;
  }
  std::printf("peak (from the timeline): device %.2f MiB (budget %.2f MiB), host %.2f MiB, "
              "nvme %.2f MiB; stalls %llu (%.1f ms); timeline %s\n",
              Mib(stats->peak(tiermem::TierKind::kDevice)), Mib(budget),
              Mib(stats->peak(tiermem::TierKind::kHost)),
              Mib(stats->peak(tiermem::TierKind::kNvme)),
              static_cast<unsigned long long>(stats->timeline.stall_count),
              stats->timeline.stall_ns / 1e6, timeline.c_str());
  for (const auto& m : stats->timeline.moves) {
    std::printf("  moved %s -> %s: %.1f MiB\n", std::string(tiermem::TierKindName(m.src)).c_str(),
                std::string(tiermem::TierKindName(m.dst)).c_str(), Mib(m.bytes));
  }
  if (tiermem::Status s = engine.Close(); !s.ok()) {
    std::fprintf(stderr, "tiermem: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
