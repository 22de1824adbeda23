"""Executed plan vs the reactive engine on the CPU (host mode by default; SimDevice with
--device-kind sim): the main job's GPT trained twice in one process, `plan: always` (the plan
runs even where `plan: auto` would decline it; --plan auto applies that bar) and `plan: off`,
same model, same data, the two stepped alternately (these machines are noisy: each step's pair
is measured in the same seconds), then per-step ratios and their median. Also per planned step: bytes into the device measured by the engine
vs the plan's prediction (PlanEstimate::steady_device_in_bytes; in host mode the NVMe bytes
read and written vs steady_nvme_bytes).

    benchmarks/run.sh bench_plan [--layers 12] [--width 768] [--steps 9]
        [--device-kind auto|host|sim] [--device 128MiB] [--host 512MiB] [--nvme 4GiB]
        [--plan always|auto] [--dir DIR] [--activations] [--json]

`--activations` counts the saved activations in the device budget (activations: budget; the
device budget should then be raised by the activation peak, e.g. --device 600MiB).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile


import tiermem
from benchmarks import add_tier_args, bench_gpt, objective_bytes, tier_config, timed_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--steps", type=int, default=9, help="steps per system (3 are warm-up)")
    ap.add_argument("--batch", type=int, default=8)
    add_tier_args(ap)
    ap.add_argument("--nvme", default="4GiB")
    ap.add_argument("--dir", default=None, help="NVMe directory (default: a temporary one)")
    ap.add_argument("--activations", action="store_true")
    ap.add_argument("--plan", choices=["always", "auto"], default="always",
                    help="the planned system: always (the plan runs even where auto's bar "
                         "would decline it) or auto (the default's bar applies)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.steps < 5:
        ap.error("--steps must be >= 5 (2 warm-up, 1 recorded, then planned steps)")
    base, data = bench_gpt(a.layers, a.width, a.batch, a.steps)
    P = a.plan
    host_mode = "device" not in tier_config(a.device_kind, a.device, a.host)
    what = "NVMe bytes" if host_mode else "device-in"
    root = a.dir or tempfile.mkdtemp(prefix="tiermem-bench-plan-")
    systems = {}
    try:
        for mode in (P, "off"):
            cfg = {**tier_config(a.device_kind, a.device, a.host),
                   "nvme": {"path": f"{root}/{mode}", "size": a.nvme},
                   "plan": mode, "activations": "budget" if a.activations else "outside",
                   "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
            os.makedirs(f"{root}/{mode}", exist_ok=True)
            model, opt = tiermem.initialize(copy.deepcopy(base), cfg)
            systems[mode] = dict(model=model, opt=opt, rt=tiermem.runtime_of(model),
                                 times=[], losses=[], dev_in=[])
        for i, (x, y) in enumerate(data):
            order = (P, "off") if i % 2 == 0 else ("off", P)
            for mode in order:
                s = systems[mode]
                before = objective_bytes(s["rt"].stats(), host_mode)
                loss, dt = timed_step(s["model"], s["opt"], x, y)
                s["losses"].append(loss)
                s["times"].append(dt)
                s["dev_in"].append(objective_bytes(s["rt"].stats(), host_mode) - before)
        if systems[P]["losses"] != systems["off"]["losses"]:
            print(f"ERROR: the losses differ between plan {P} and off")
            return 1
        warm = 3
        ratios = [p / r for p, r in zip(systems[P]["times"][warm:],
                                        systems["off"]["times"][warm:])]
        plan = systems[P]["rt"].stats()["plan"]
        predicted = plan["predicted_nvme_bytes" if host_mode else "predicted_device_in_bytes"]
        measured = systems[P]["dev_in"][warm:]
        out = {
            "model": f"{a.layers} x {a.width}",
            "params_m": sum(p.numel() for p in base.parameters()) / 1e6,
            "budgets": {"device": a.device, "host": a.host, "nvme": a.nvme},
            "activations": "budget" if a.activations else "outside",
            "s_per_step": {m: statistics.median(s["times"][warm:]) for m, s in systems.items()},
            "ratio_plan_over_off_median": statistics.median(ratios),
            "ratios": ratios,
            "plan": plan,
            "bytes_measured_per_step": measured,
            "bytes_predicted": predicted,
            "bytes_off_per_step": systems["off"]["dev_in"][warm:],
            "prediction_error_median": statistics.median(
                [abs(m - predicted) / predicted for m in measured]) if predicted else None,
        }
        for s in systems.values():
            s["rt"].close()
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"GPT {out['model']} ({out['params_m']:.1f} M params), "
          f"{tier_config(a.device_kind, a.device, a.host).get('device', 'host mode, no')} device, host "
          f"{a.host}, NVMe {a.nvme}, activations {out['activations']}; {a.steps} steps each, "
          f"alternating, first {warm} not measured")
    for m in (P, "off"):
        print(f"  plan {m:6}: {out['s_per_step'][m]:.3f} s/step (median)")
    print(f"  {P}/off per step: {', '.join(f'{r:.3f}' for r in ratios)}; median "
          f"{out['ratio_plan_over_off_median']:.3f}")
    mib = 2 ** 20
    if plan["plans"] == 0:  # no prediction to compare: say why instead of a 0% error
        why = plan["error"] or plan["declined"] or "nothing to plan"
        prediction = f"no plan ran ({why})"
    else:
        prediction = (f"predicted {predicted / mib:.1f} MiB (median error "
                      f"{100 * out['prediction_error_median']:.2f}%)"
                      if out["prediction_error_median"] is not None else "predicted 0 B")
    print(f"  {what} per step with plan {P}: measured "
          f"{', '.join(f'{m / mib:.1f}' for m in measured)} MiB, {prediction}; plan off: "
          f"{', '.join(f'{m / mib:.1f}' for m in out['bytes_off_per_step'])} MiB")
    print(f"  plan: {plan['followed_iterations']} of {plan['planned_iterations']} planned steps "
          f"followed, {plan['divergences']} diverged, {plan['prefetches']} prefetches, "
          f"{plan['deferred']} deferred, {plan['skipped']} skipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
