// The main job from C++: trains the repo's GPT-style decoder (gpt.h, the architecture of
// tiermem/examples/gpt.py; smaller defaults) with tiermem::torch::ChunkedModel on synthetic text,
// with a device budget of about 25% of params + grads + AdamW state; prints the loss per
// step and the per-tier peaks read from the timeline.
//
//   build/integrations/torch/tiermem_train_gpt [--steps 10] [--n-layer 4] [--n-embd 128]
//       [--batch 8] [--budget-fraction 0.25] [--timeline build/train_gpt_cpp.tmt]
//       [--seed 0] [--data-seed 0] [--dropout 0] [--threads N]
//       [--resume PATH] [--save PATH] [--print-losses] [--print-data]
//
// Checkpoints: --save PATH saves after the last step (the step count in `extra`); --resume
// PATH loads one first (ChunkedModel::Save's or tiermem.save_checkpoint's: one format) and
// trains on from the step it holds up to --steps, on the same batches an uninterrupted run
// would use. --seed seeds torch (the initialisation, then dropout); --data-seed the synthetic
// text. --print-losses ends the output with one JSON line {"start": first step, "losses":
// [...]} (each loss exactly, as a double), plus "data": the batches' input tokens with
// --print-data. tests/python/test_checkpoint_cross_binding.py runs it against Python.
#include <algorithm>
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
               "[--block-size N] [--batch N] [--lr X] [--budget-fraction X] [--timeline PATH] "
               "[--seed N] [--data-seed N] [--dropout X] [--threads N] [--resume PATH] "
               "[--save PATH] [--record-trace PATH] [--print-losses] [--print-data]\n",
               argv0);
  return 2;
}

// The command line (see the file comment); false on a bad one.
struct Args {
  tiermem_example::GPTConfig c;
  int steps = 10;
  int64_t batch = 8;
  double lr = 1e-3, fraction = 0.25;
  std::string timeline = "build/train_gpt_cpp.tmt";
  uint64_t seed = 0, data_seed = 0;
  int threads = 0;
  std::string resume, save, trace;
  bool print_losses = false, print_data = false;
};

bool Parse(int argc, char** argv, Args* a) {
  tiermem_example::GPTConfig& c = a->c;
  c.n_layer = 4;
  c.n_embd = 128;
  c.n_head = 4;
  c.block_size = 64;
  for (int i = 1; i < argc; ++i) {
    auto next = [&](const char* flag) -> const char* {
      if (std::strcmp(argv[i], flag) != 0 || i + 1 >= argc) return nullptr;
      return argv[++i];
    };
    if (const char* v = next("--steps"))
      a->steps = std::atoi(v);
    else if (const char* v = next("--n-layer"))
      c.n_layer = std::atoll(v);
    else if (const char* v = next("--n-embd"))
      c.n_embd = std::atoll(v);
    else if (const char* v = next("--n-head"))
      c.n_head = std::atoll(v);
    else if (const char* v = next("--block-size"))
      c.block_size = std::atoll(v);
    else if (const char* v = next("--batch"))
      a->batch = std::atoll(v);
    else if (const char* v = next("--lr"))
      a->lr = std::atof(v);
    else if (const char* v = next("--budget-fraction"))
      a->fraction = std::atof(v);
    else if (const char* v = next("--timeline"))
      a->timeline = v;
    else if (const char* v = next("--seed"))
      a->seed = std::strtoull(v, nullptr, 10);
    else if (const char* v = next("--data-seed"))
      a->data_seed = std::strtoull(v, nullptr, 10);
    else if (const char* v = next("--dropout"))
      c.dropout = std::atof(v);
    else if (const char* v = next("--threads"))
      a->threads = std::atoi(v);
    else if (const char* v = next("--resume"))
      a->resume = v;
    else if (const char* v = next("--save"))
      a->save = v;
    else if (const char* v = next("--record-trace"))
      a->trace = v;
    else if (std::strcmp(argv[i], "--print-losses") == 0)
      a->print_losses = true;
    else if (std::strcmp(argv[i], "--print-data") == 0)
      a->print_data = true;
    else
      return false;
  }
  return a->steps >= 0 && a->batch >= 1 && c.n_layer >= 1 && c.n_embd % c.n_head == 0 &&
         a->fraction > 0 && c.dropout >= 0 && c.dropout < 1 && a->threads >= 0;
}

}  // namespace

int main(int argc, char** argv) {
  using tiermem_example::GPT;
  Args args;
  if (!Parse(argc, argv, &args)) return Usage(argv[0]);
  const tiermem_example::GPTConfig& c = args.c;
  const int steps = args.steps;
  const int64_t batch = args.batch;
  const double lr = args.lr, fraction = args.fraction;
  const std::string& timeline = args.timeline;
  const std::string &resume = args.resume, &save = args.save, &trace = args.trace;
  const bool print_data = args.print_data;
  const int threads = args.threads;
  const uint64_t seed = args.seed, data_seed = args.data_seed;
  if (threads > 0) ::at::set_num_threads(threads);

  ::torch::manual_seed(seed);
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
  std::printf(
      "model: %.2f M params; params+grads+AdamW = %.1f MiB = %.1fx the device budget "
      "of %.1f MiB; chunk %llu elements x %zu groups\n",
      n_params / 1e6, Mib(engine.model_bytes()), static_cast<double>(engine.model_bytes()) / budget,
      Mib(budget), static_cast<unsigned long long>(engine.chunk_elems()),
      engine.num_chunk_groups());

  int start = 0;
  if (!resume.empty()) {
    nlohmann::json extra;
    if (tiermem::Status s = engine.Load(resume, &extra); !s.ok()) {
      std::fprintf(stderr, "tiermem: %s\n", s.ToString().c_str());
      return 1;
    }
    if (extra.is_object() && extra.contains("step") && extra["step"].is_number_integer()) {
      start = extra["step"].get<int>();
    }
    std::printf("resumed from %s at step %d\n", resume.c_str(), start);
  }
  if (!trace.empty() && steps > start) {
    // The warm-up trace of every iteration run (docs/trace-format.md), written at Close.
    if (tiermem::Status s = engine.session().traces().RecordTrace(trace, steps - start); !s.ok()) {
      std::fprintf(stderr, "tiermem: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  const auto batches = tiermem_example::SyntheticBatches(c, batch, steps, data_seed);
  nlohmann::json losses = nlohmann::json::array(), data = nlohmann::json::array();
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = start; s < steps; ++s) {
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
                (s + 1 - start) * batch * c.block_size / secs);
    losses.push_back(loss.item<double>());
    if (print_data) {
      const ::torch::Tensor xs = x.contiguous();
      data.push_back(
          std::vector<int64_t>(xs.data_ptr<int64_t>(), xs.data_ptr<int64_t>() + xs.numel()));
    }
  }
  if (!save.empty()) {
    const int at = std::max(start, steps);  // a resume past --steps trains nothing
    if (tiermem::Status s = engine.Save(save, {{"step", at}}); !s.ok()) {
      std::fprintf(stderr, "tiermem: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("saved %s at step %d\n", save.c_str(), at);
  }
  auto stats = engine.GetStats();
  if (!stats.ok()) {
    std::fprintf(stderr, "tiermem: %s\n", stats.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "peak (from the timeline): device %.2f MiB (budget %.2f MiB), host %.2f MiB, "
      "nvme %.2f MiB; stalls %llu (%.1f ms); timeline %s\n",
      Mib(stats->peak(tiermem::TierKind::kDevice)), Mib(budget),
      Mib(stats->peak(tiermem::TierKind::kHost)), Mib(stats->peak(tiermem::TierKind::kNvme)),
      static_cast<unsigned long long>(stats->timeline.stall_count), stats->timeline.stall_ns / 1e6,
      timeline.c_str());
  for (const auto& m : stats->timeline.moves) {
    std::printf("  moved %s -> %s: %.1f MiB\n", std::string(tiermem::TierKindName(m.src)).c_str(),
                std::string(tiermem::TierKindName(m.dst)).c_str(), Mib(m.bytes));
  }
  if (tiermem::Status s = engine.Close(); !s.ok()) {
    std::fprintf(stderr, "tiermem: %s\n", s.ToString().c_str());
    return 1;
  }
  if (args.print_losses) {
    nlohmann::json out = {{"start", start}, {"losses", losses}};
    if (print_data) out["data"] = data;
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}
