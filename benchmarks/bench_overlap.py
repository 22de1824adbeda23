"""Speculative and deferred optimizer updates (config optimizer_overlap) vs updates inside
step() vs plain torch (CPU, SimDevice): the main job's GPT trained four times in one process —
tiermem with `optimizer_overlap: backward` (speculative updates in the backward, the rest
deferred), `next-forward` (deferred), `off`, and plain torch with
`torch.optim.AdamW(fused=True)` — same model, same data, stepped in turn (the order rotates
every step; these machines are noisy, so each step's four are measured in the same seconds),
then per-step ratios and their medians. A whole step is timed: zero_grad, forward, backward,
step (the deferred updates run in the next step's forward, so they are inside the timing).
The three tiermem systems must give equal losses (checked); `--clip` turns global-norm
clipping on for all of them (plain torch too, with clip_grad_norm_), so speculative updates
are kept or redone as the norm falls.

    benchmarks/run.sh bench_overlap [--layers 12] [--width 768] [--steps 10]
        [--device 128MiB] [--host 512MiB] [--nvme 4GiB | --nvme 0] [--plan off|auto|always] [--dir DIR]
        [--clip 0] [--modes backward,next-forward,off] [--json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile

import torch

import tiermem
from benchmarks import add_tier_args, bench_gpt, tier_config, timed_step

MODES = ("backward", "next-forward", "off")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--steps", type=int, default=10, help="steps per system (3 are warm-up)")
    ap.add_argument("--batch", type=int, default=8)
    add_tier_args(ap)
    ap.add_argument("--nvme", default="4GiB", help="0: no NVMe tier")
    ap.add_argument("--plan", choices=["off", "auto", "always"], default="off",
                    help="both tiermem systems: the engine's reactive policy or an executed plan")
    ap.add_argument("--dir", default=None, help="NVMe directory (default: a temporary one)")
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="the optimizer_overlap values to run (comma-separated)")
    ap.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                    help="optimizer.state_dtype: how m and v are stored (int8 moves fewer bytes)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: a comma-separated subset of {','.join(MODES)}")
    if a.steps < 5:
        ap.error("--steps must be >= 5 (3 are warm-up)")
    base, data = bench_gpt(a.layers, a.width, a.batch, a.steps)
    root = a.dir or tempfile.mkdtemp(prefix="tiermem-bench-overlap-")
    systems = {}
    try:
        for mode in modes:
            cfg = {**tier_config(a.device_kind, a.device, a.host), "optimizer_overlap": mode, "plan": a.plan,
                   "gradient_clipping": a.clip,
                   "optimizer": {"lr": 1e-4, "weight_decay": 0.01,
                                 "state_dtype": a.state_dtype}}
            if a.nvme != "0":
                os.makedirs(f"{root}/{mode}", exist_ok=True)
                cfg["nvme"] = {"path": f"{root}/{mode}", "size": a.nvme}
            model, opt = tiermem.initialize(copy.deepcopy(base), cfg)
            systems[mode] = dict(model=model, opt=opt, times=[], losses=[])
        plain = copy.deepcopy(base)
        systems["torch"] = dict(model=plain, times=[], losses=[],
                                opt=torch.optim.AdamW(plain.parameters(), lr=1e-4,
                                                      weight_decay=0.01, fused=True))
        names = list(systems)
        for i, (x, y) in enumerate(data):
            for k in range(len(names)):
                s = systems[names[(i + k) % len(names)]]
                clip = a.clip if s["model"] is plain else 0.0
                loss, dt = timed_step(s["model"], s["opt"], x, y, clip=clip)
                s["losses"].append(loss)
                s["times"].append(dt)
        for mode in modes[1:]:
            if systems[mode]["losses"] != systems[modes[0]]["losses"]:
                print(f"ERROR: the losses differ between optimizer_overlap {modes[0]} and {mode}")
                return 1
        warm = 3
        t = {n: s["times"][warm:] for n, s in systems.items()}

        def ratios(p, q):
            return [x / y for x, y in zip(t[p], t[q])]

        pairs = {f"{p}/{q}": ratios(p, q) for i, p in enumerate(modes) for q in modes[i + 1:]}
        pairs.update({f"{p}/torch": ratios(p, "torch") for p in modes})
        out = {
            "model": f"{a.layers} x {a.width}",
            "params_m": sum(p.numel() for p in base.parameters()) / 1e6,
            "budgets": {"device": a.device, "host": a.host, "nvme": a.nvme},
            "plan": a.plan,
            "s_per_step": {n: statistics.median(v) for n, v in t.items()},
            "ratio_medians": {k: statistics.median(v) for k, v in pairs.items()},
            "ratios": pairs,
            "clip": a.clip,
            "losses_first_last": (systems[modes[0]]["losses"][0],
                                  systems[modes[0]]["losses"][-1]),
            "torch_losses_first_last": (systems["torch"]["losses"][0],
                                        systems["torch"]["losses"][-1]),
            "stalls_s": {m: tiermem.runtime_of(systems[m]["model"]).stats()["stall_ns"] / 1e9
                         for m in modes},
            "speculation": (tiermem.runtime_of(systems["backward"]["model"]).session.speculation
                            if "backward" in modes else None),
        }
        for mode in modes:
            tiermem.runtime_of(systems[mode]["model"]).close()
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"GPT {out['model']} ({out['params_m']:.1f} M params), "
          f"{tier_config(a.device_kind, a.device, a.host).get('device', 'host mode, no')} device, host "
          f"{a.host}, NVMe {a.nvme}, plan {a.plan}, clipping {a.clip or 'off'}; {a.steps} steps "
          f"each, rotating, first {warm} not measured")
    for n in names:
        print(f"  {n:13}: {out['s_per_step'][n]:.3f} s/step (median)")
    for k, v in pairs.items():
        print(f"  {k:19}: median {out['ratio_medians'][k]:.3f} "
              f"({min(v):.3f}-{max(v):.3f}) per step: {', '.join(f'{r:.3f}' for r in v)}")
    print(f"  stalls (s, whole run): "
          + ", ".join(f"{m} {v:.2f}" for m, v in out["stalls_s"].items()))
    if out["speculation"] is not None:
        print(f"  speculative updates (backward): {out['speculation']}")
    print(f"  losses (tiermem, equal in every mode): {out['losses_first_last'][0]:.4f} -> "
          f"{out['losses_first_last'][1]:.4f}; plain torch {out['torch_losses_first_last'][0]:.4f}"
          f" -> {out['torch_losses_first_last'][1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
