"""torch.compile on tiermem vs on plain torch (CPU inductor): the speed-up compile gives each.

Four systems train the same GPT on the same batches in one process, stepped in turn
(ABBA: the order reverses every step, since these machines are noisy):

  torch-eager       plain torch, torch.optim.AdamW(fused=True)
  torch-compiled    the same, compiled `--how` (default torch.compile(model))
  tiermem-eager     tiermem.initialize(model) (default device_kind auto: host mode without a
                    GPU — compute in place on the host's chunks; `--device-kind sim` for
                    SimDevice), its own AdamW
  tiermem-compiled  the same, compiled `--how` after initialize

Printed: seconds per step (median after the warm-up steps), the speed-up compile gives
plain torch and tiermem (medians of the per-step eager/compiled ratios) and their ratio
(tiermem's speed-up / torch's; the goal is >= 0.9), compile time beside (the first step's
seconds less a warm step's, for each compiled system), the graphs dynamo compiled and
whether any was compiled again after the first step (torch's own counters), and the
losses' largest relative difference between the two compiled systems.

    benchmarks/run.sh bench_compile [--layers 4] [--width 128] [--block 256]
        [--batch 8] [--steps 16] [--how model|blocks] [--device-kind auto|sim]
        [--backend inductor] [--json]

The default model is small and its context long (attention's elementwise work, which
inductor fuses, is a large part of the step): CPU inductor gives plain torch a speed-up
there; at 4 x 256, block 128, it gives none on the VM (matrix products dominate).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
from torch._dynamo.utils import counters

import tiermem
from benchmarks import bench_gpt, tier_config, timed_step

_SYSTEMS = ("torch-eager", "torch-compiled", "tiermem-eager", "tiermem-compiled")


def _compile(model, how, backend):
    if how == "model":
        return torch.compile(model, backend=backend)
    for b in model.blocks:
        b.compile(backend=backend)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="steps per system (2 are warm-up)")
    ap.add_argument("--how", choices=("model", "blocks"), default="model",
                    help="torch.compile(model), or block.compile() on each block")
    ap.add_argument("--device-kind", default="auto", help="tiermem's (auto: host mode here)")
    ap.add_argument("--device", default="64MiB", help="the device budget (sim only)")
    ap.add_argument("--host", default="4GiB")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.steps < 4:
        ap.error("--steps must be >= 4 (2 warm-up steps)")
    base, data = bench_gpt(a.layers, a.width, a.batch, a.steps, block=a.block)
    opt_args = dict(lr=1e-3, weight_decay=0.01)
    config = dict(tier_config(a.device_kind, a.device, a.host), optimizer=opt_args)
    mode = str(tiermem._C.resolve_device_kind(tiermem.parse_config(config).device_kind))

    systems = {}
    for name in _SYSTEMS:
        m = copy.deepcopy(base)
        if name.startswith("torch"):
            opt = torch.optim.AdamW(m.parameters(), fused=True, **opt_args)
        else:
            m, opt = tiermem.initialize(m, config)
        call = _compile(m, a.how, a.backend) if name.endswith("compiled") else m
        systems[name] = dict(model=m, call=call, opt=opt, times=[], losses=[])
    torch._dynamo.reset()
    counters.clear()
    graphs_after_first = {}
    for i, (x, y) in enumerate(data):
        order = _SYSTEMS if i % 2 == 0 else tuple(reversed(_SYSTEMS))
        for name in order:
            s = systems[name]
            loss, dt = timed_step(s["call"], s["opt"], x, y)
            s["losses"].append(loss)
            s["times"].append(dt)
        if i == 0:
            graphs_after_first = dict(counters["stats"])
    graphs_end = dict(counters["stats"])
    warm = 2
    med = {n: statistics.median(s["times"][warm:]) for n, s in systems.items()}

    def speedup(kind):
        e, c = systems[f"{kind}-eager"]["times"], systems[f"{kind}-compiled"]["times"]
        return statistics.median(p / q for p, q in zip(e[warm:], c[warm:]))

    sp_torch, sp_tm = speedup("torch"), speedup("tiermem")
    compile_s = {n: systems[n]["times"][0] - med[n] for n in ("torch-compiled",
                                                              "tiermem-compiled")}
    worst = max(abs(p - q) / abs(q) for p, q in zip(systems["tiermem-compiled"]["losses"],
                                                    systems["torch-compiled"]["losses"]))
    out = {
        "model": f"{a.layers} x {a.width}, block {a.block}, batch {a.batch}",
        "params_m": sum(p.numel() for p in base.parameters()) / 1e6,
        "tiermem_mode": mode, "how": a.how, "backend": a.backend,
        "threads": torch.get_num_threads(),
        "s_per_step": med,
        "speedup_torch": sp_torch, "speedup_tiermem": sp_tm,
        "speedup_ratio": sp_tm / sp_torch,
        "tiermem_compiled_over_torch_compiled": statistics.median(
            p / q for p, q in zip(systems["tiermem-compiled"]["times"][warm:],
                                  systems["torch-compiled"]["times"][warm:])),
        "compile_s": compile_s,
        "graphs_after_first_step": graphs_after_first.get("unique_graphs", 0),
        "graphs_compiled_later": graphs_end.get("unique_graphs", 0)
        - graphs_after_first.get("unique_graphs", 0),
        "loss_max_rel_diff_compiled": worst,
    }
    for s in systems.values():
        if not isinstance(s["opt"], torch.optim.AdamW):
            tiermem.runtime_of(s["model"]).close()
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"GPT {out['model']} ({out['params_m']:.1f} M params), {a.steps} steps each, "
          f"alternating, first {warm} not measured; tiermem in {mode} mode; "
          f"compile: {a.how} with {a.backend}; {out['threads']} threads")
    for n in _SYSTEMS:
        first = f" (first step {systems[n]['times'][0]:.1f} s)" if n in compile_s else ""
        print(f"  {n:17}: {med[n]:.3f} s/step{first}")
    print(f"  speed-up from compile: torch {sp_torch:.3f}x, tiermem {sp_tm:.3f}x; "
          f"tiermem's / torch's = {out['speedup_ratio']:.3f} (goal >= 0.9)")
    print(f"  tiermem-compiled / torch-compiled: "
          f"{out['tiermem_compiled_over_torch_compiled']:.3f} s/s")
    print(f"  compile time: torch {compile_s['torch-compiled']:.1f} s, tiermem "
          f"{compile_s['tiermem-compiled']:.1f} s")
    print(f"  graphs compiled: {out['graphs_after_first_step']} in the first step, "
          f"{out['graphs_compiled_later']} after it")
    print(f"  losses: tiermem-compiled vs torch-compiled, max relative difference {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
