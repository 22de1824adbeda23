// `tiermem plan simulate|compare|show|synth|bench-builder`: a thin CLI over tiermem::planners.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "planners/machine.h"
#include "planners/model_traces.h"
#include "planners/planner.h"
#include "planners/simulator.h"
#include "planners/trace.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

using namespace tiermem::planners;  // NOLINT: a CLI over one library
using nlohmann::json;

struct PlanArgs {
  std::string trace, output, policy = "planned", device, host, nvme, bw, ds_bucket, model;
  std::string lookahead = "depth";  // engine policy: depth | room
  uint32_t depth = 4, iterations = 0, moments = 0;
  std::string state_dtype = "fp32";  // synth: the optimizer-state format
  uint64_t seed = 0, accesses = 10'000'000;
  bool json = false, no_place = false, no_overlap = false, no_activations = false,
       keep_homes = false;
  bool list_moments = false;
  bool no_expert_sets = false;  // synth: do not mark the experts' chunks
};

[[noreturn]] void Fail(const Status& s) {
  std::cerr << "tiermem plan: " << s.ToString() << "\n";
  throw CLI::RuntimeError(s.code() == StatusCode::kInvalidArgument ? 2 : 1);
}

// "16GiB", "512MiB", or "N%" of the trace's chunk bytes (model data).
StatusOr<Bytes> ParseBudget(const std::string& text, const Trace& t, const char* what) {
  if (!text.empty() && text.back() == '%') {
    char* end = nullptr;
    const double pct = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() - 1 || !(pct > 0)) {
      return InvalidArgumentError(std::string(what) + ": bad percentage '" + text + "'");
    }
    return static_cast<Bytes>(static_cast<double>(t.TotalChunkBytes()) * pct / 100.0);
  }
  auto b = ParseBytes(text);
  if (!b.ok()) return b.status().WithContext(what);
  return b;
}

struct Loaded {
  Trace trace;
  MachineModel machine;
  SimOptions sim;
};

Loaded Load(const PlanArgs& a) {
  auto t = ReadTraceFile(a.trace);
  if (!t.ok()) Fail(t.status());
  Loaded l{std::move(*t), {}, {}};
  l.machine = MachineModel::FromTrace(l.trace);
  auto set = [&](const std::string& text, TierKind tier, const char* what) {
    if (text.empty()) return;
    auto b = ParseBudget(text, l.trace, what);
    if (!b.ok()) Fail(b.status());
    l.machine.budget[static_cast<int>(tier)] = *b;
  };
  set(a.device, TierKind::kDevice, "--device");
  set(a.host, TierKind::kHost, "--host");
  set(a.nvme, TierKind::kNvme, "--nvme");
  if (!a.bw.empty()) {
    Status s = ApplyLinkSpec(a.bw, &l.machine);
    if (!s.ok()) Fail(s);
  }
  l.machine.DeriveNvmeLinks();
  if (l.machine.Budget(TierKind::kDevice) > 0 && l.machine.Budget(TierKind::kHost) > 0) {
    // A trace has rates only for the directions that moved bytes while it was recorded.
    const bool nvme = l.machine.Budget(TierKind::kNvme) > 0;
    for (const std::string& f : l.machine.FillMissingLinks()) {
      if (!nvme && f.find('n') < 3) continue;  // no NVMe here: those links are never used
      std::cerr << "note: no copy rate in the trace for " << f << " (nothing moved that way "
                << "while it was recorded; set it with --bw " << f.substr(0, 3) << "=RATE)\n";
    }
  }
  Status s = l.machine.Validate();
  if (!s.ok()) Fail(s);
  l.sim.engine_prefetch_depth = a.depth;
  {
    auto la = ParseEngineLookahead(a.lookahead);
    if (!la.ok()) Fail(la.status().WithContext("--lookahead"));
    l.sim.engine_lookahead = *la;
  }
  if (!a.ds_bucket.empty()) {
    auto b = ParseBudget(a.ds_bucket, l.trace, "--ds-bucket");
    if (!b.ok()) Fail(b.status());
    l.sim.deepspeed_bucket_bytes = *b;
  }
  l.sim.plan.place_optimizer = !a.no_place;
  l.sim.plan.overlap_optimizer = !a.no_overlap;
  l.sim.plan.activation_policy = !a.no_activations;
  l.sim.keep_recorded_homes = a.keep_homes;
  l.sim.record_moments = a.list_moments;
  return l;
}

const char* kPairs[kNumTierKinds][kNumTierKinds] = {
    {"", "d2h", "d2n"}, {"h2d", "", "h2n"}, {"n2d", "n2h", ""}};

json ResultJson(const SimResult& r) {
  json j;
  j["policy"] = std::string(PolicyName(r.policy));
  if (!r.status.ok()) {
    j["error"] = r.status.ToString();
    return j;
  }
  const double n = r.measured_iterations;
  j["measured_iterations"] = r.measured_iterations;
  j["device_in_bytes_per_iteration"] = r.MeanDeviceInBytes();
  json bytes;
  for (int a = 0; a < kNumTierKinds; ++a) {
    for (int b = 0; b < kNumTierKinds; ++b) {
      if (a != b) bytes[kPairs[a][b]] = r.total.bytes[a][b] / n;
    }
  }
  j["bytes_per_iteration"] = bytes;
  j["activation_bytes_in_per_iteration"] = r.total.activation_bytes_in / n;
  j["iteration_ns"] = r.MeanIterationNs();
  j["compute_ns"] = r.total.compute_ns / n;
  j["recompute_ns"] = r.total.recompute_ns / n;
  j["cpu_overlap_ns"] = r.total.cpu_overlap_ns / n;
  j["stall_ns"] = r.MeanStallNs();
  json stalls;
  for (int c = 0; c < kNumStallCauses; ++c) {
    stalls[std::string(StallCauseName(static_cast<StallCause>(c)))] = r.total.stall_by_cause[c] / n;
  }
  j["stall_ns_by_cause"] = stalls;
  j["peak_bytes"] = {{"device", r.peak[0]}, {"host", r.peak[1]}, {"nvme", r.peak[2]}};
  j["divergences"] = r.divergences;
  j["fetches_per_iteration"] = r.total.fetches / n;
  j["writebacks_per_iteration"] = r.total.writebacks / n;
  if (r.policy == PolicyKind::kPlanned) j["repairs"] = r.repairs;
  if (r.policy == PolicyKind::kOpt || r.policy == PolicyKind::kOptRecorded) {
    j["bound_exact"] = r.bound_exact;
  }
  if (!r.plans.empty()) {
    const Plan& p = r.plans.back();
    size_t dev = 0, ov = 0, nvme = 0;
    for (const GroupPlan& g : p.groups) {
      dev += g.update_on == TierKind::kDevice;
      ov += g.overlap;
    }
    for (TierKind h : p.home) nvme += h == TierKind::kNvme;
    std::array<size_t, 3> pol{};
    for (const UnitPlan& u : p.units) ++pol[static_cast<int>(u.policy)];
    j["plan"] = {{"optimizer_groups_on_device", dev},
                 {"optimizer_groups_overlapped", ov},
                 {"groups", p.groups.size()},
                 {"nvme_homed_chunks", nvme},
                 {"units_keep", pol[0]},
                 {"units_offload", pol[1]},
                 {"units_recompute", pol[2]},
                 {"candidates_evaluated", p.candidates_evaluated}};
  }
  return j;
}

std::string Ms(double ns) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f", ns / 1e6);
  return b;
}

std::string Size(double bytes) { return FormatBytes(static_cast<Bytes>(bytes + 0.5)); }

void PrintHeader(const Loaded& l, const std::string& path) {
  std::printf("trace %s: %zu chunks (%s model data), %zu iterations\n", path.c_str(),
              l.trace.chunks.size(), FormatBytes(l.trace.TotalChunkBytes()).c_str(),
              l.trace.iterations.size());
  std::printf("budgets: device %s, host %s, nvme %s\n",
              FormatBytes(l.machine.Budget(TierKind::kDevice)).c_str(),
              FormatBytes(l.machine.Budget(TierKind::kHost)).c_str(),
              FormatBytes(l.machine.Budget(TierKind::kNvme)).c_str());
  std::printf("engine policy: %s lookahead, depth %u\n",
              std::string(EngineLookaheadName(l.sim.engine_lookahead)).c_str(),
              l.sim.engine_prefetch_depth);
}

void PrintTable(const std::vector<SimResult>& rs) {
  std::printf("%-13s %11s %11s %11s %11s %10s %10s %10s  %s\n", "policy", "dev-in/it", "d2h/it",
              "nvme/it", "stall ms", "iter ms", "peak dev", "peak host", "stall by cause / notes");
  for (const SimResult& r : rs) {
    if (!r.status.ok()) {
      std::printf("%-13s %s\n", std::string(PolicyName(r.policy)).c_str(),
                  ("cannot run: " + r.status.message()).c_str());
      continue;
    }
    const double n = r.measured_iterations;
    const double d2h = r.total.bytes[0][1] / n;
    const double nvme =
        (r.total.bytes[1][2] + r.total.bytes[2][1] + r.total.bytes[0][2] + r.total.bytes[2][0]) / n;
    std::string causes;
    for (int c = 0; c < kNumStallCauses; ++c) {
      if (r.total.stall_by_cause[c] == 0) continue;
      if (!causes.empty()) causes += " ";
      causes += std::string(StallCauseName(static_cast<StallCause>(c))) + " " +
                Ms(r.total.stall_by_cause[c] / n);
    }
    const bool opt = r.policy == PolicyKind::kOpt || r.policy == PolicyKind::kOptRecorded;
    if (opt)
      causes = r.bound_exact ? "bound on dev-in (exact: equal chunks)"
                             : "Belady on bytes (heuristic: mixed chunk sizes)";
    if (r.divergences > 0) causes += " [" + std::to_string(r.divergences) + " diverged]";
    std::printf("%-13s %11s %11s %11s %11s %10s %10s %10s  %s\n",
                std::string(PolicyName(r.policy)).c_str(), Size(r.MeanDeviceInBytes()).c_str(),
                Size(d2h).c_str(), Size(nvme).c_str(), opt ? "-" : Ms(r.MeanStallNs()).c_str(),
                opt ? "-" : Ms(r.MeanIterationNs()).c_str(), Size(r.peak[0]).c_str(),
                Size(r.peak[1]).c_str(), causes.c_str());
  }
}

void Simulate(const PlanArgs& a) {
  Loaded l = Load(a);
  auto p = ParsePolicy(a.policy);
  if (!p.ok()) Fail(p.status());
  auto r = planners::Simulate(l.trace, l.machine, *p, l.sim);
  if (!r.ok()) Fail(r.status());
  if (a.json) {
    std::cout << ResultJson(*r).dump(2) << "\n";
    return;
  }
  PrintHeader(l, a.trace);
  PrintTable({*r});
  if (!r->plans.empty()) std::cout << DescribePlan(r->plans.back(), l.trace);
  if (a.list_moments && !r->per_iteration.empty()) {
    std::printf("last measured iteration, moment by moment (ms from its start):\n");
    std::printf("%4s %-20s %9s %9s %9s %8s %-10s %4s %4s %10s\n", "#", "moment", "issue", "start",
                "end", "stall", "cause", "in", "out", "dev used");
    const auto& ms = r->per_iteration.back().moments;
    for (size_t i = 0; i < ms.size(); ++i) {
      const MomentTiming& m = ms[i];
      std::printf("%4zu %-20s %9s %9s %9s %8s %-10s %4u %4u %10s%s\n", i, m.label.c_str(),
                  Ms(m.issue_ns).c_str(), Ms(m.start_ns).c_str(), Ms(m.end_ns).c_str(),
                  Ms(m.stall_ns).c_str(),
                  m.stall_ns ? std::string(StallCauseName(m.cause)).c_str() : "", m.fetches,
                  m.evictions, FormatBytes(m.device_bytes).c_str(), m.async ? "  (CPU lane)" : "");
    }
  }
}

void Compare(const PlanArgs& a) {
  Loaded l = Load(a);
  auto rs = planners::Compare(l.trace, l.machine, l.sim);
  if (!rs.ok()) Fail(rs.status());
  if (a.json) {
    json j = json::array();
    for (const SimResult& r : *rs) j.push_back(ResultJson(r));
    std::cout << j.dump(2) << "\n";
    return;
  }
  PrintHeader(l, a.trace);
  PrintTable(*rs);
  const SimResult& planned = (*rs)[static_cast<int>(PolicyKind::kPlanned)];
  if (planned.status.ok() && !planned.plans.empty()) {
    std::cout << "planned: " << DescribePlan(planned.plans.back(), l.trace);
  }
}

void Show(const PlanArgs& a) {
  auto t = ReadTraceFile(a.trace);
  if (!t.ok()) Fail(t.status());
  if (a.json) {
    json j;
    j["source"] = t->source;
    j["version"] = t->version;
    j["chunks"] = t->chunks.size();
    j["groups"] = t->NumGroups();
    j["chunk_bytes"] = t->TotalChunkBytes();
    j["kinds"] = t->kind_names;
    json sets = json::array();
    for (const TraceChunk& c : t->chunks) {
      sets.push_back(c.expert_set == kNoExpertSet ? json(nullptr) : json(c.expert_set));
    }
    j["expert_sets"] = sets;  // per chunk: its expert set, null for a dense chunk
    j["budgets"] = {
        {"device", t->budgets.device}, {"host", t->budgets.host}, {"nvme", t->budgets.nvme}};
    const char* tiers[] = {"d", "h", "n"};
    json links = json::object();
    for (int x = 0; x < kNumTierKinds; ++x) {
      for (int y = 0; y < kNumTierKinds; ++y) {
        if (t->rates.link[x][y].bytes_per_s > 0) {
          links[std::string(tiers[x]) + "2" + tiers[y]] = t->rates.link[x][y].bytes_per_s;
        }
      }
    }
    j["rates"] = {{"link_bytes_per_s", links},
                  {"cpu_optim_elems_per_s", t->rates.cpu_optim_elems_per_s},
                  {"device_optim_elems_per_s", t->rates.device_optim_elems_per_s},
                  {"cpu_cores", t->rates.cpu_cores}};
    json its = json::array();
    for (const TraceIteration& it : t->iterations) {
      uint64_t compute = 0;
      Bytes act = 0;
      for (const Moment& m : it.moments) {
        compute += m.compute_ns;
        act = std::max(act, m.activation_bytes);
      }
      its.push_back({{"moments", it.moments.size()},
                     {"accesses", it.accesses.size()},
                     {"compute_ns", compute},
                     {"peak_activation_bytes", act}});
    }
    j["iterations"] = its;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("source: %s\nversion %u, %zu chunks in %u groups (%s), kinds:", t->source.c_str(),
              t->version, t->chunks.size(), t->NumGroups(),
              FormatBytes(t->TotalChunkBytes()).c_str());
  for (const std::string& k : t->kind_names) std::printf(" %s", k.c_str());
  std::printf("\n");
  {
    std::set<uint32_t> sets;
    size_t members = 0;
    for (const TraceChunk& c : t->chunks) {
      if (c.expert_set == kNoExpertSet) continue;
      sets.insert(c.expert_set);
      ++members;
    }
    if (members > 0) {
      std::printf("expert sets: %zu, %zu member chunks (planned as classes)\n", sets.size(),
                  members);
    }
  }
  for (size_t i = 0; i < t->iterations.size(); ++i) {
    const TraceIteration& it = t->iterations[i];
    uint64_t compute = 0;
    Bytes act = 0;
    for (const Moment& m : it.moments) {
      compute += m.compute_ns;
      act = std::max(act, m.activation_bytes);
    }
    std::printf("iteration %zu: %zu moments, %zu accesses, compute %s ms, peak non-chunk %s\n", i,
                it.moments.size(), it.accesses.size(), Ms(compute).c_str(),
                FormatBytes(act).c_str());
    for (size_t m = 0; m < it.moments.size() && m < a.moments; ++m) {
      const Moment& mo = it.moments[m];
      std::printf("  %4zu %-18s %-17s %3u accesses %9s ms  live %s saved %s\n", m, mo.label.c_str(),
                  std::string(MomentKindName(mo.kind)).c_str(), mo.num_accesses,
                  Ms(mo.compute_ns).c_str(), FormatBytes(mo.activation_bytes).c_str(),
                  FormatBytes(mo.saved_bytes).c_str());
    }
  }
}

void Synth(const PlanArgs& a) {
  auto shape = CanonicalShape(a.model);
  if (!shape.ok()) Fail(shape.status());
  if (a.iterations > 0) shape->iterations = a.iterations;
  if (a.seed > 0) shape->seed = a.seed;
  if (a.no_expert_sets) shape->mark_experts = false;
  // The optimizer-state format's bytes per element of m and of v (optimizer.state_dtype).
  if (a.state_dtype == "bf16") shape->state_bytes_per_elem = 2;
  if (a.state_dtype == "int8") shape->state_bytes_per_elem = 1 + 4.0 / 256;
  auto t = ModelTrace(*shape);
  if (!t.ok()) Fail(t.status());
  Status s = WriteTraceFile(*t, a.output);
  if (!s.ok()) Fail(s);
  std::printf("wrote %s: %zu chunks (%s), %zu iterations, %zu bytes\n", a.output.c_str(),
              t->chunks.size(), FormatBytes(t->TotalChunkBytes()).c_str(), t->iterations.size(),
              EncodeTrace(*t).size());
}

// Times TraceBuilder as the runtime drives it: (1) accesses alone, in one long moment;
// (2) moments of 8 accesses, BeginMoment (a label) and EndMoment included. The second
// iteration of each is timed (the first grows the vectors).
void BenchBuilder(const PlanArgs& a) {
  const uint64_t n = a.accesses;
  auto run = [n](bool one_moment) {
    TraceBuilder b;
    for (ChunkId c = 0; c < 1024; ++c) b.DeclareChunk(c, TraceChunk{4096, Category::kParam, 0, 0});
    b.KindIndex("param");
    double ns = 0;
    for (int it = 0; it < 2; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      b.BeginIteration();
      if (one_moment) b.BeginMoment("m", MomentKind::kPreForward, 0);
      for (uint64_t i = 0; i < n; i += 8) {
        if (!one_moment) b.BeginMoment("fwd:blocks.12", MomentKind::kPreForward, 0);
        for (uint64_t k = 0; k < 8; ++k) {
          b.Access(static_cast<ChunkId>((i + k) & 1023), AccessMode::kRead, TierKind::kDevice);
        }
        if (!one_moment) b.EndMoment(1000);
      }
      if (one_moment) b.EndMoment(1000);
      const auto t1 = std::chrono::steady_clock::now();
      ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
    }
    auto t = b.Finish();
    if (!t.ok()) Fail(t.status());
    return ns / static_cast<double>(n);
  };
  const double access = run(true), moments = run(false);
  std::printf(
      "TraceBuilder, %llu accesses per iteration (second iteration timed):\n"
      "  Access() alone:                          %.2f ns per access\n"
      "  with a moment (label, begin/end) per 8:  %.2f ns per access\n",
      static_cast<unsigned long long>(n), access, moments);
}

void AddBudgetOptions(CLI::App* c, PlanArgs* a) {
  c->add_option("trace", a->trace, "trace file (.tmtrace)")->required();
  c->add_option("--device", a->device, "device budget: SIZE or N% of the model data");
  c->add_option("--host", a->host, "host budget (default: the recorded one)");
  c->add_option("--nvme", a->nvme, "NVMe budget (default: the recorded one)");
  c->add_option("--bw", a->bw,
                "copy rates, e.g. h2d=24GB,d2h=24GB@10us (pairs h2d d2h h2n n2h d2n n2d hd hn dn)");
  c->add_option("--depth", a->depth, "engine policy: prefetch lookahead in acquires");
  c->add_option("--lookahead", a->lookahead,
                "engine policy: depth (the default) or room (EngineConfig::lookahead)");
  c->add_option("--ds-bucket", a->ds_bucket, "deepspeed policy: prefetch bucket (SIZE or N%)");
  c->add_flag("--no-optimizer-placement", a->no_place,
              "planned: keep optimizer steps where recorded");
  c->add_flag("--no-overlap", a->no_overlap, "planned: no CPU step overlapped with the backward");
  c->add_flag("--no-activation-policy", a->no_activations, "planned: keep every activation");
  c->add_flag("--keep-homes", a->keep_homes,
              "planned: keep the homes the trace was recorded with (what the runtime executes)");
  c->add_flag("--json", a->json, "print JSON");
}

}  // namespace

void RegisterPlan(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* plan = app.add_subcommand("plan", "plan and simulate schedules over a warm-up trace");
  plan->require_subcommand(1);

  CLI::App* sim = plan->add_subcommand("simulate", "simulate one policy over a trace");
  AddBudgetOptions(sim, args.get());
  sim->add_option("--policy", args->policy,
                  "lru|patrickstar|deepspeed|engine|planned|opt|opt-recorded");
  sim->add_flag("--moments", args->list_moments,
                "list the last measured iteration moment by moment");
  sim->callback([args] { Simulate(*args); });

  CLI::App* cmp = plan->add_subcommand("compare", "every policy in one table, with the OPT bound");
  AddBudgetOptions(cmp, args.get());
  cmp->callback([args] { Compare(*args); });

  CLI::App* show = plan->add_subcommand("show", "summarize a trace");
  show->add_option("trace", args->trace, "trace file")->required();
  show->add_option("--moments", args->moments, "list the first N moments of each iteration");
  show->add_flag("--json", args->json,
                 "print a JSON summary (sizes, budgets, rates, per-iteration totals)");
  show->callback([args] { Show(*args); });

  CLI::App* synth = plan->add_subcommand("synth", "write a canonical synthetic trace");
  synth->add_option("model", args->model, "gpt | gpt-ckpt | gpt-tied | moe")->required();
  synth->add_option("-o,--output", args->output, "output .tmtrace")->required();
  synth->add_option("--iterations", args->iterations, "iterations (default: the shape's)");
  synth->add_option("--seed", args->seed, "routing seed (moe)");
  synth->add_flag("--no-expert-sets", args->no_expert_sets,
                  "moe: do not mark the experts' chunks (a version-1 trace: experts planned as "
                  "dense chunks)");
  synth
      ->add_option("--state-dtype", args->state_dtype,
                   "optimizer-state format: fp32 (default) | bf16 | int8 (block 256)")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  synth->callback([args] { Synth(*args); });

  CLI::App* bench = plan->add_subcommand("bench-builder", "time TraceBuilder's hot path");
  bench->add_option("--accesses", args->accesses, "accesses to record");
  bench->callback([args] { BenchBuilder(*args); });
}

}  // namespace tiermem::tools
