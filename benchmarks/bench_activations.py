"""Activation offload and recompute (CPU, SimDevice): a GPT whose saved activations alone
exceed the device budget, trained by tiermem with `activations: offload` (plan auto and off),
`activations: recompute` and `activations: auto` (the plan picks per unit) in one process
next to plain torch (`torch.optim.AdamW(fused=True)`, no budget at all) and tiermem with
activations outside the budget (the same device budget bounding the chunks only: what a user
gets without offload, on a real GPU an out-of-memory). All systems get the same model and
data and are stepped alternately (each step's set is measured in the same seconds: these
machines are noisy); per-step ratios and their medians are printed. `activations: budget`
(counted, never offloaded) is tried at the same budget and reported as cannot-run when it
raises.

Also per system: the device peak of chunks + activations from the timeline (must be within
the budget for the counted modes), activation bytes saved per step, bytes offloaded (of them
spilled to NVMe) and units recomputed per step.

`--nvme DIR` gives every tiermem system an NVMe tier there (a temporary directory inside it,
removed at the end): with a host budget too small for the activations, `offload` then spills
what the host cannot hold to NVMe instead of raising.

    benchmarks/run.sh bench_activations [--layers 6] [--width 384] [--block 128]
        [--batch 8] [--steps 7] [--device 96MiB] [--host 2GiB] [--nvme DIR] [--json]
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import tempfile

import torch

import tiermem
from benchmarks import bench_gpt, timed_step

_MODES = ("torch", "offload-auto", "offload-off", "recompute", "auto-auto", "outside")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=7, help="steps per system (3 are warm-up)")
    ap.add_argument("--device", default="96MiB")
    ap.add_argument("--host", default="2GiB")
    ap.add_argument("--nvme", default=None, help="directory for an NVMe tier (default: none)")
    ap.add_argument("--nvme-size", default="8GiB")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.steps < 5:
        ap.error("--steps must be >= 5 (2 warm-up, 1 recorded, then planned steps)")
    base, data = bench_gpt(a.layers, a.width, a.batch, a.steps, block=a.block)
    opt_args = dict(lr=1e-3, weight_decay=0.01)

    nvme_dir = tempfile.mkdtemp(prefix="tiermem-bench-act-", dir=a.nvme) if a.nvme else None
    try:
        return _run(a, base, data, opt_args, nvme_dir)
    finally:
        if nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)


def _run(a, base, data, opt_args, nvme_dir) -> int:
    def cfg(activations, plan):
        c = {"device_kind": "sim", "device": a.device, "host": a.host, "plan": plan, "activations": activations,
             "optimizer": opt_args}
        if nvme_dir:
            c["nvme"] = {"path": nvme_dir, "size": a.nvme_size}
        return c

    # Saved-activation bytes per step, from plain torch's own saved-tensor hooks.
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    probe = copy.deepcopy(base)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        probe(*data[0]).backward()
    act_bytes = sum(saved.values())
    del probe

    budget_error, m = None, None
    try:
        m, o = tiermem.initialize(copy.deepcopy(base), cfg("budget", "off"))
        o.zero_grad()
        m(*data[0]).backward()
        o.step()
    except MemoryError as e:
        budget_error = str(e)
    finally:
        if m is not None:
            tiermem.runtime_of(m).close()

    systems = {}
    ref = copy.deepcopy(base)
    systems["torch"] = dict(model=ref, opt=torch.optim.AdamW(ref.parameters(), fused=True,
                                                              **opt_args), rt=None)
    for mode, (acts, plan) in {"offload-auto": ("offload", "auto"),
                               "offload-off": ("offload", "off"),
                               "recompute": ("recompute", "auto"),
                               "auto-auto": ("auto", "auto"),
                               "outside": ("outside", "auto")}.items():
        model, opt = tiermem.initialize(copy.deepcopy(base), cfg(acts, plan))
        systems[mode] = dict(model=model, opt=opt, rt=tiermem.runtime_of(model))
    for s in systems.values():
        s.update(times=[], losses=[], off=[], rc=[], spill=[])
    failed = {}  # a mode that cannot run at these budgets (MemoryError at its first step)
    for i, (x, y) in enumerate(data):
        order = _MODES if i % 2 == 0 else tuple(reversed(_MODES))
        for mode in order:
            if mode in failed:
                continue
            s = systems[mode]
            st = s["rt"].stats().get("activations") if s["rt"] else None
            before = (st["offloaded_bytes"], st["recomputed_units"], st["spilled_bytes"]) \
                if st else (0, 0, 0)
            try:
                loss, dt = timed_step(s["model"], s["opt"], x, y)
            except MemoryError as e:
                if i:
                    raise
                failed[mode] = str(e)
                s["rt"].close()
                del systems[mode]
                continue
            s["losses"].append(loss)
            s["times"].append(dt)
            st = s["rt"].stats().get("activations") if s["rt"] else None
            after = (st["offloaded_bytes"], st["recomputed_units"], st["spilled_bytes"]) \
                if st else (0, 0, 0)
            s["off"].append(after[0] - before[0])
            s["rc"].append(after[1] - before[1])
            s["spill"].append(after[2] - before[2])
    a_losses = systems["auto-auto"]["losses"]
    if any(s["losses"] != a_losses for m, s in systems.items() if m != "torch"):
        print("ERROR: the losses differ between tiermem's modes")
        return 1
    worst = max(abs(p - q) / abs(q) for p, q in zip(a_losses, systems["torch"]["losses"]))
    warm = 3
    med = {m: statistics.median(s["times"][warm:]) for m, s in systems.items()}

    def ratios(num, den):
        return [p / q for p, q in zip(systems[num]["times"][warm:],
                                      systems[den]["times"][warm:])]

    out = {
        "model": f"{a.layers} x {a.width}, block {a.block}, batch {a.batch}",
        "params_m": sum(p.numel() for p in base.parameters()) / 1e6,
        "training_state_bytes": sum(p.numel() for p in base.parameters()) * 16,
        "activation_bytes_per_step": act_bytes,
        "budgets": {"device": a.device, "host": a.host,
                    "nvme": a.nvme_size if nvme_dir else None},
        "budget_mode": budget_error or "ran",
        "s_per_step": med,
        "cannot_run": failed,
        "ratio_median": {f"{n}/{d}": statistics.median(ratios(n, d))
                         for n, d in (("offload-auto", "torch"), ("offload-off", "torch"),
                                      ("recompute", "torch"), ("auto-auto", "torch"),
                                      ("offload-auto", "outside"), ("recompute", "outside"),
                                      ("outside", "torch"), ("offload-auto", "offload-off"),
                                      ("recompute", "offload-auto"),
                                      ("auto-auto", "offload-auto"),
                                      ("auto-auto", "recompute"))
                         if n in systems and d in systems},
        "loss_max_rel_diff_vs_torch": worst,
        "offloaded_bytes_per_step": {m: statistics.median(s["off"][warm:])
                                     for m, s in systems.items() if s["rt"]},
        "recomputed_units_per_step": {m: statistics.median(s["rc"][warm:])
                                      for m, s in systems.items() if s["rt"]},
        "spilled_bytes_per_step": {m: statistics.median(s["spill"][warm:])
                                   for m, s in systems.items() if s["rt"]},
        "device_peak": {},
        "plan": {m: systems[m]["rt"].stats()["plan"] for m in ("offload-auto", "auto-auto")
                 if m in systems},
    }
    for m, s in systems.items():
        if s["rt"]:
            rep = s["rt"].timeline_peaks()
            out["device_peak"][m] = {"chunks_and_activations": rep["peak"]["device"],
                                     "activation": rep["category_peak"]["device"]["activation"],
                                     "host_activation": rep["category_peak"]["host"]["activation"],
                                     "nvme_activation":
                                         rep["category_peak"]["nvme"].get("activation", 0),
                                     "host": rep["peak"]["host"],
                                     "over_budget": rep["over_budget"]}
            s["rt"].close()
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    mib = 2 ** 20
    print(f"GPT {out['model']} ({out['params_m']:.1f} M params, training state "
          f"{out['training_state_bytes'] / mib:.0f} MiB), saved activations "
          f"{act_bytes / mib:.0f} MiB per step; device {a.device}, host {a.host}"
          f"{', NVMe ' + a.nvme_size if nvme_dir else ''}; {a.steps} "
          f"steps each, alternating, first {warm} not measured")
    print(f"  activations: budget at this budget: "
          f"{'cannot run (MemoryError: ' + budget_error[:110] + '...)' if budget_error else 'ran'}")
    for m in _MODES:
        if m in failed:
            print(f"  {m:12}: cannot run (MemoryError: {failed[m][:100]}...)")
            continue
        extra = ""
        if m in out["device_peak"]:
            d = out["device_peak"][m]
            extra = (f"; device peak {d['chunks_and_activations'] / mib:.1f} MiB (activations "
                     f"{d['activation'] / mib:.1f}), host activations "
                     f"{d['host_activation'] / mib:.1f} MiB, offloaded "
                     f"{out['offloaded_bytes_per_step'][m] / mib:.0f} MiB/step (to NVMe "
                     f"{out['spilled_bytes_per_step'][m] / mib:.0f}), recomputed "
                     f"{out['recomputed_units_per_step'][m]:g} units/step, host peak "
                     f"{d['host'] / mib:.1f} MiB")
        print(f"  {m:12}: {med[m]:.3f} s/step{extra}")
    for k, v in out["ratio_median"].items():
        print(f"  {k}: {v:.3f} (median of per-step ratios)")
    print(f"  losses: tiermem modes equal; max relative difference vs torch fused AdamW {worst:.2e}")
    for name, p in out["plan"].items():
        print(f"  plan ({name}): {p['followed_iterations']} of {p['planned_iterations']} "
              f"planned steps followed, {p['divergences']} diverged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
