// `tiermem bench adam`: the CPU optimizer kernels against this machine's memory roofline and
// against torch's CPU AdamW (fused=True, its strongest; foreach=True for reference; and for
// mixed precision torch's unscale + clip_grad_norm_ + fused AdamW + bf16 copy sequence), all
// measured in the same run.
//
//   tiermem bench adam --params 67108864 --threads 1,2 [--isa avx512,avx2,scalar] [--json]
//
// Per thread count: (1) a bandwidth probe with AdamW's access pattern (reads p, m, v, g and
// writes p, m, v: 28 bytes per param, same tiles and threads as the kernels) gives the
// roofline; (2) each ISA x dtype variant's params/s, its modelled DRAM bytes per param, the
// achieved GB/s and that as a fraction of the roofline, and its "equivalent bytes per param"
// (time x roofline bandwidth / params: the traffic it costs if it runs at the roofline);
// The probe and each variant are timed alternately, and the fraction of the roofline is the
// median over those pairs (the shared machine's bandwidth drifts between measurements).
// (3) torch's AdamW over the same number of params (tools/bench/bench_adam_torch.py, run with
// $TIERMEM_PY or ~/.cache/tiermem/venv/bin/python when present), and our ratios to it: best
// fp32 variant / AdamW(fused=True) and / AdamW(foreach=True); the mixed-precision one-pass
// step (GradNormAndOverflow over the scaled grads, then one AdamStep that unscales, clips,
// updates and writes the bf16 copy) / torch's mixed sequence for the same work.
// Each measurement is the median of --reps timed steps after one warm-up step.
// fraction_of_roofline = modelled bytes per param / equivalent bytes per param.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/optim.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

namespace k = tiermem::kernels;
using Json = nlohmann::json;

struct AdamBenchArgs {
  size_t params = 67108864;
  std::string threads = "1,2";
  std::string isas = "";  // "" = every ISA this CPU has
  int reps = 5;
  bool json = false;
  bool no_torch = false;
  std::string torch_script;
};

// A page-aligned float buffer (no value-initialisation; the caller fills it).
struct Buffer {
  explicit Buffer(size_t bytes)
      : ptr(static_cast<unsigned char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))) {}
  ~Buffer() { std::free(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  unsigned char* ptr;
  float* f() const { return reinterpret_cast<float*>(ptr); }
};

template <typename Fn>
double Seconds(const Fn& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `fn` and the roofline probe alternately (probe, fn, probe, fn, ...) after one warm-up
// of each, so both see the same machine state: these machines are shared and their bandwidth
// drifts by tens of percent within seconds. Returns the per-pair times.
struct Paired {
  std::vector<double> fn_s, probe_s;
};
template <typename Fn, typename Probe>
Paired TimePaired(int reps, const Fn& fn, const Probe& probe) {
  probe();
  fn();
  Paired out;
  for (int r = 0; r < reps; ++r) {
    out.probe_s.push_back(Seconds(probe));
    out.fn_s.push_back(Seconds(fn));
  }
  return out;
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string PythonForTorch() {
  if (const char* py = std::getenv("TIERMEM_PY"); py != nullptr && *py != '\0') return py;
  if (const char* home = std::getenv("HOME")) {
    const std::string venv = std::string(home) + "/.cache/tiermem/venv/bin/python";
    if (std::filesystem::exists(venv)) return venv;
  }
  return "";
}

// Runs the torch script; returns its JSON or a {"error": ...} object.
Json RunTorch(const AdamBenchArgs& a, int threads) {
  const std::string py = PythonForTorch();
  if (py.empty()) return Json{{"error", "no python with torch (set TIERMEM_PY)"}};
  std::string script = a.torch_script;
#ifdef TIERMEM_SOURCE_DIR
  if (script.empty()) script = std::string(TIERMEM_SOURCE_DIR) + "/tools/bench/bench_adam_torch.py";
#endif
  if (script.empty() || !std::filesystem::exists(script)) {
    return Json{{"error", "bench_adam_torch.py not found (pass --torch-script)"}};
  }
  const std::string cmd = "'" + py + "' '" + script + "' --params " + std::to_string(a.params) +
                          " --threads " + std::to_string(threads) + " --reps " +
                          std::to_string(a.reps) + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return Json{{"error", "popen failed"}};
  std::string out;
  char buf[4096];
  while (size_t got = fread(buf, 1, sizeof(buf), pipe)) out.append(buf, got);
  const int rc = pclose(pipe);
  const size_t brace = out.rfind("\n{");
  const std::string last = brace == std::string::npos ? out : out.substr(brace + 1);
  Json j = Json::parse(last, nullptr, /*allow_exceptions=*/false);
  if (rc != 0 || j.is_discarded())
    return Json{{"error", "torch script failed: " + out.substr(0, 400)}};
  return j;
}

// The ISAs to measure: --isa's list, or every one this CPU has (fastest first). Prints the
// parse error and returns false on a bad name.
bool IsasToRun(const std::string& list, std::vector<k::Isa>* isas) {
  if (list.empty()) {
    for (k::Isa isa : {k::Isa::kAvx512, k::Isa::kAvx2, k::Isa::kScalar}) {
      const k::Isa saved = k::KernelIsa();
      if (k::SetKernelIsa(isa).ok()) isas->push_back(isa);
      k::SetKernelIsa(saved).IgnoreError();
    }
    return true;
  }
  for (const std::string& name : Split(list)) {
    StatusOr<k::Isa> isa = k::ParseIsa(name);
    if (!isa.ok()) {
      std::cerr << "bench adam: " << isa.status().ToString() << "\n";
      return false;
    }
    isas->push_back(*isa);
  }
  return true;
}

// --threads as positive integers; prints the error and returns false otherwise.
bool ThreadCounts(const std::string& list, std::vector<int>* counts) {
  for (const std::string& t : Split(list)) {
    const int v = std::atoi(t.c_str());
    if (v <= 0) {
      std::cerr << "bench adam: --threads wants positive integers, got '" << t << "'\n";
      return false;
    }
    counts->push_back(v);
  }
  return true;
}

// The optimizer state of `n` params and its inputs, filled as a fresh run starts: fp32 p, m,
// v and g; g as bf16; the bf16 copy the step writes; m and v compressed (optimizer.state_dtype:
// bf16, or int8 codes with one fp32 absmax per 256).
struct AdamBuffers {
  explicit AdamBuffers(size_t n)
      : p(n * 4),
        m(n * 4),
        v(n * 4),
        g(n * 4),
        gb(n * 2),
        out(n * 2),
        mq(n * 2),
        vq(n * 2),
        ma(k::StateBlocks(kInt8State, n) * 4),
        va(k::StateBlocks(kInt8State, n) * 4) {
    for (size_t i = 0; i < n; ++i) {
      p.f()[i] = 0.5f + 1e-9f * static_cast<float>(i & 1023);
      m.f()[i] = 0.0f;
      v.f()[i] = 0.0f;
      g.f()[i] = 1e-3f * static_cast<float>(static_cast<int>(i % 2001) - 1000);
    }
    k::CastFromF32(g.f(), gb.ptr, k::DType::kBF16, n);
    std::memset(out.ptr, 0, n * 2);
    std::memset(mq.ptr, 0, n * 2);
    std::memset(vq.ptr, 0, n * 2);
    std::memset(ma.ptr, 0, k::StateBlocks(kInt8State, n) * 4);
    std::memset(va.ptr, 0, k::StateBlocks(kInt8State, n) * 4);
  }
  static constexpr k::StateFormat kInt8State{k::StateDType::kInt8, 256};
  Buffer p, m, v, g, gb, out, mq, vq, ma, va;
};

struct Variant {
  const char* name;
  k::DType grad;
  bool out;
  bool onepass;  // mixed-precision step: norm/overflow pass + unscale + clip + AdamW + copy
  k::StateFormat state = {};
};

// What one variant measured on one ISA: params/s, and its result record.
struct VariantResult {
  double params_per_s = 0;
  Json json;
};

// Times one variant on the current ISA alternately with `probe` (TimePaired) and derives its
// rates: modelled DRAM bytes per param, GB/s, the roofline and the fraction of it. Appends
// the probe's times to *probe_s; prints the row unless --json.
template <typename Probe>
VariantResult MeasureVariant(const AdamBenchArgs& a, AdamBuffers& b, k::Isa isa, const Variant& var,
                             const Probe& probe, std::vector<double>* probe_s) {
  const size_t n = a.params;
  k::AdamConfig c;
  c.weight_decay = 0.01f;
  k::AdamSpans s;
  s.param = b.p.f();
  s.exp_avg = b.m.f();
  s.exp_avg_sq = b.v.f();
  s.grad = var.grad == k::DType::kF32 ? static_cast<const void*>(b.g.f()) : b.gb.ptr;
  s.grad_dtype = var.grad;
  s.param_out = var.out ? b.out.ptr : nullptr;
  s.out_dtype = k::DType::kBF16;
  s.n = n;
  s.state = var.state;
  if (var.state.compressed()) {
    const bool int8 = var.state.dtype == k::StateDType::kInt8;
    s.exp_avg_q = {b.mq.ptr, int8 ? b.ma.f() : nullptr};
    s.exp_avg_sq_q = {b.vq.ptr, int8 ? b.va.f() : nullptr};
  }
  int64_t step = 0;
  const Paired t = TimePaired(
      a.reps,
      [&] {
        c.step = ++step;
        if (var.onepass) {
          // The grads as a scaled backward leaves them (scale 1024): the overflow check and
          // global norm first, then the fused step unscales and clips on the fly (max norm 1).
          const k::GradStats gs = k::GradNormAndOverflow(s.grad, var.grad, n);
          c.inv_loss_scale = 1.0f / 1024.0f;
          const double norm = std::sqrt(gs.sq_norm) / 1024.0;
          c.clip_factor = norm > 1.0 ? static_cast<float>(1.0 / (norm + 1e-6)) : 1.0f;
          if (!gs.overflow) k::AdamStep(c, s);
        } else {
          k::AdamStep(c, s);
        }
      },
      probe);
  // DRAM bytes per param: the grad read; the param, m and v read and written (m and v in the
  // state format: int8 adds its absmax, 8 bytes per 256 params); the copy.
  const double state_bytes = static_cast<double>(k::StateBytes(var.state, 1u << 20)) / (1u << 20);
  const double bytes_per_param = k::DTypeSize(var.grad) + 8.0 + 4.0 * state_bytes +
                                 (var.out ? 2.0 : 0.0) +
                                 (var.onepass ? k::DTypeSize(var.grad) : 0.0);
  // Per pair: kernel time / probe time = equivalent bytes per param / 28.
  std::vector<double> ratio;
  for (int r = 0; r < a.reps; ++r) ratio.push_back(t.fn_s[r] / t.probe_s[r]);
  probe_s->insert(probe_s->end(), t.probe_s.begin(), t.probe_s.end());
  const double sec = Median(t.fn_s);
  const double roof = 28.0 * static_cast<double>(n) / Median(t.probe_s);
  const double pps = static_cast<double>(n) / sec;
  const double gbps = pps * bytes_per_param;
  const double equiv = 28.0 * Median(ratio);
  const double fraction = bytes_per_param / equiv;
  if (!a.json) {
    std::printf("  %-8s %-32s %10.1f %7.1f %8.2f %9.2f %10.3f %9.1f\n",
                std::string(k::IsaName(isa)).c_str(), var.name, pps / 1e6, bytes_per_param,
                gbps / 1e9, roof / 1e9, fraction, equiv);
  }
  return {pps,
          {{"isa", k::IsaName(isa)},
           {"variant", var.name},
           {"state_dtype", k::StateDTypeName(var.state.dtype)},
           {"params_per_s", pps},
           {"bytes_per_param_model", bytes_per_param},
           {"GBps", gbps / 1e9},
           {"roofline_GBps", roof / 1e9},
           {"fraction_of_roofline", fraction},
           {"equivalent_bytes_per_param", equiv}}};
}

// torch's AdamW at `threads` and our best fp32 and one-pass rates over it, printed unless
// --json; the run record's "torch".
Json CompareWithTorch(const AdamBenchArgs& a, int threads, double best_f32, double best_onepass) {
  Json t = RunTorch(a, threads);
  if (!t.contains("fused") || best_f32 <= 0) {
    if (!a.json) std::printf("  torch: %s\n", t.value("error", std::string("no result")).c_str());
    return t;
  }
  const double fused = t["fused"].get<double>();
  t["ours_fp32_over_fused"] = best_f32 / fused;
  if (t.contains("foreach")) t["ours_fp32_over_foreach"] = best_f32 / t["foreach"].get<double>();
  if (t.contains("mixed") && best_onepass > 0) {
    t["ours_onepass_over_mixed"] = best_onepass / t["mixed"].get<double>();
  }
  if (a.json) return t;
  std::printf(
      "  torch %s AdamW(fused=True): %.1f Mparams/s; best ours (f32) / torch "
      "fused = %.2fx\n",
      t.value("torch_version", std::string("?")).c_str(), fused / 1e6, best_f32 / fused);
  if (t.contains("foreach")) {
    std::printf(
        "  torch AdamW(foreach=True): %.1f Mparams/s; best ours (f32) / torch "
        "foreach = %.2fx\n",
        t["foreach"].get<double>() / 1e6, t["ours_fp32_over_foreach"].get<double>());
  }
  if (t.contains("ours_onepass_over_mixed")) {
    std::printf(
        "  torch mixed step (unscale + clip_grad_norm_ + fused AdamW + bf16 "
        "copy): %.1f Mparams/s; ours one-pass / torch = %.2fx\n",
        t["mixed"].get<double>() / 1e6, t["ours_onepass_over_mixed"].get<double>());
  }
  return t;
}

// Every ISA x variant at one thread count, timed alternately with the roofline probe (the
// probe on the same buffers, AdamW's access pattern, with the first ISA), then torch.
Json RunAtThreads(const AdamBenchArgs& a, AdamBuffers& b, const std::vector<k::Isa>& isas,
                  int threads) {
  static const Variant kVariants[] = {
      {"adamw f32 grad", k::DType::kF32, false, false},
      {"adamw f32 grad + bf16 copy", k::DType::kF32, true, false},
      {"adamw bf16 grad + bf16 copy", k::DType::kBF16, true, false},
      {"mixed one-pass (norm+step+bf16)", k::DType::kF32, true, true},
      {"adamw f32 grad, bf16 state", k::DType::kF32, false, false, {k::StateDType::kBF16}},
      {"adamw f32 grad, int8 state", k::DType::kF32, false, false, AdamBuffers::kInt8State},
      {"adamw bf16 grad + copy, int8 st", k::DType::kBF16, true, false, AdamBuffers::kInt8State}};
  const size_t n = a.params;
  k::SetKernelThreads(threads);
  Json run = {{"threads", threads}};
  const k::Isa probe_isa = isas.front();
  auto probe = [&] {
    const k::Isa isa = k::KernelIsa();
    k::SetKernelIsa(probe_isa).IgnoreError();
    k::BandwidthProbe(b.p.f(), b.m.f(), b.v.f(), b.g.f(), n);
    k::SetKernelIsa(isa).IgnoreError();
  };
  if (!a.json) {
    std::printf(
        "threads %d (roofline probe: %s, reads 4 streams and writes 3, 28 B/param; "
        "timed alternately with each variant)\n",
        threads, std::string(k::IsaName(probe_isa)).c_str());
    std::printf("  %-8s %-32s %10s %7s %8s %9s %10s %9s\n", "isa", "variant", "Mparams/s",
                "B/param", "GB/s", "roof GB/s", "x roofline", "equiv B/p");
  }
  double best_f32 = 0, best_onepass = 0;
  std::vector<double> all_probe_s;
  Json results = Json::array();
  for (k::Isa isa : isas) {
    k::SetKernelIsa(isa).IgnoreError();
    for (const Variant& var : kVariants) {
      VariantResult r = MeasureVariant(a, b, isa, var, probe, &all_probe_s);
      if (var.grad == k::DType::kF32 && !var.out && !var.state.compressed()) {
        best_f32 = std::max(best_f32, r.params_per_s);
      }
      if (var.onepass) best_onepass = std::max(best_onepass, r.params_per_s);
      results.push_back(std::move(r.json));
    }
  }
  run["results"] = results;
  run["roofline_GBps"] = 28.0 * static_cast<double>(n) / Median(all_probe_s) / 1e9;
  if (!a.no_torch) run["torch"] = CompareWithTorch(a, threads, best_f32, best_onepass);
  return run;
}

int RunAdamBench(const AdamBenchArgs& a) {
  std::vector<k::Isa> isas;
  std::vector<int> thread_counts;
  if (!IsasToRun(a.isas, &isas) || !ThreadCounts(a.threads, &thread_counts)) return 2;
  AdamBuffers buffers(a.params);
  Json report = {
      {"benchmark", "adam"}, {"params", a.params}, {"reps", a.reps}, {"runs", Json::array()}};
  const k::Isa saved_isa = k::KernelIsa();
  for (int threads : thread_counts) {
    report["runs"].push_back(RunAtThreads(a, buffers, isas, threads));
  }
  k::SetKernelIsa(saved_isa).IgnoreError();
  if (a.json) std::cout << report.dump(2) << "\n";
  return 0;
}

}  // namespace

void RegisterBenchAdam(CLI::App& bench) {
  auto args = std::make_shared<AdamBenchArgs>();
  CLI::App* cmd =
      bench.add_subcommand("adam", "CPU AdamW kernels vs the memory roofline and torch");
  cmd->add_option("--params", args->params, "number of fp32 params")->check(CLI::PositiveNumber);
  cmd->add_option("--threads", args->threads, "comma-separated thread counts");
  cmd->add_option("--isa", args->isas, "comma-separated ISAs (default: all this CPU has)");
  cmd->add_option("--reps", args->reps, "timed steps per measurement (median)")
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--json", args->json, "print JSON only");
  cmd->add_flag("--no-torch", args->no_torch, "skip the torch baseline");
  cmd->add_option("--torch-script", args->torch_script, "path of bench_adam_torch.py");
  cmd->callback([args] {
    const int rc = RunAdamBench(*args);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace tiermem::tools
