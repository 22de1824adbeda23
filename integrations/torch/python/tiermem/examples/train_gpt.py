"""The main job: train a GPT-style decoder whose training state is larger than the memory
budget it computes from, with NVMe in the loop, then show where the bytes went. Without a GPU
it runs in host mode (compute on the CPU against chunks in host memory: tiers host and NVMe;
docs/host-mode.md); `--device sim` runs the simulated three-tier stack (SimDevice with the
size's device budget: step times are then a simulation).

    python -m tiermem.examples.train_gpt [--size tiny|default|xl] [--steps N] ...

Sizes (byte-level vocabulary, context 64, batch 8):
  tiny     4 x 192, 1.8 M params: seconds (what CI runs);
  default  12 x 768, 85 M params (GPT-2-small class): params + grads + AdamW state 1.3 GiB =
           2.6x the 512 MiB host budget (10x the 128 MiB device budget with --device sim),
           more optimizer state than the host budget
           holds, so part of it lives on NVMe (a temporary directory, removed at exit);
           a few minutes on a 2-core machine;
  xl       d = 2304 with enough layers that the training state exceeds this machine's
           physical RAM (MemTotal in /proc/meminfo): 1 GiB device, 4 GiB host, the rest on
           NVMe; a few steps (tens of seconds each on 2 cores; needs the disk space, checked).
           Built on the meta device (--meta): tiermem makes each module's values in the
           chunks, so the model is never whole in memory.

The progress bar shows the loss, tokens/s and each tier's use. At the end it prints the
timeline report (tiermem prof report: peak per tier and category, bytes per tier pair, stalls
by cause), writes the HTML timeline next to the .tmt, and says how to reopen both. The second
and third iterations are recorded as a warm-up trace next to the timeline (.tmtrace: the
first is cold, and the optimizer updates of each step run in the next one's forward), and the
planner's simulated schedules over it are printed (tiermem plan compare). The run itself
executes a plan made from its warm-up (--plan auto, the default, unless the plan would move
more bytes than the reactive engine did over the recorded step; --plan always runs it anyway;
--plan off keeps the engine's reactive policy); the `plan:` line says what the plan did.
--activations budget|offload counts the saved activations in the device budget (offload: moves
them to host memory when the device is short; an `activations:` line says how much moved).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import tiermem
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches

PRESETS = {
    "tiny": dict(n_layer=4, n_embd=192, n_head=4, steps=40, device="7MiB", host="24MiB",
                 nvme="64MiB", lr=1e-3),
    "default": dict(n_layer=12, n_embd=768, n_head=12, steps=30, device="128MiB",
                    host="512MiB", nvme="4GiB", lr=1e-3),
    # xl: without warm-up, AdamW's first steps (each weight moves by ~lr, in the sign of its
    # gradient) throw a model this wide off: at 24 x 2304 the loss went 5.87 -> 16.4 -> 13.8
    # at 1e-3 and 5.87 -> 14.3 -> 7.9 at 1e-4 (plain torch at 4 x 2304 the same: 6.26 ->
    # 12.6 at 1e-4; 6.26 -> 5.00 -> 4.86 at 1e-5).
    "xl": dict(n_layer=None, n_embd=2304, n_head=16, steps=3, device="1GiB", host="4GiB",
               nvme=None, lr=1e-5),
}


def fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def cli_command() -> str:
    """How to run the `tiermem` CLI that came with this package (the console script next to
    this interpreter when installed, else `python -m tiermem`)."""
    script = os.path.join(os.path.dirname(sys.executable), "tiermem")
    if os.access(script, os.X_OK):
        return script
    return f"{sys.executable} -m tiermem"


def run_cli(*args) -> subprocess.CompletedProcess:
    from tiermem.__main__ import cli_path
    exe = cli_path()
    if not os.access(exe, os.X_OK):  # a source checkout without the installed CLI
        return subprocess.CompletedProcess(args, 127, "", f"the tiermem CLI is not at {exe} "
                                           "(pip install . installs it; or set TIERMEM_CLI)")
    return subprocess.run([exe, *args], capture_output=True, text=True)


def rt_peak_activation(trace: str) -> int:
    """The largest non-chunk (activation) bytes any recorded moment had live."""
    import json
    out = run_cli("plan", "show", trace, "--json")
    if out.returncode != 0:
        return 0
    return max((it["peak_activation_bytes"] for it in json.loads(out.stdout)["iterations"]),
               default=0)


def plan_line(mode, p) -> str:
    """One line on what the planner did in this run (stats()['plan'])."""
    if mode == "off":
        return "plan: off (the engine's reactive policy: farthest next use, lookahead prefetch)"
    if p["error"]:
        return f"plan: none ({p['error']}); the engine stayed reactive"
    if p["declined"] and not p["active"]:
        return f"plan: declined ({p['declined']}); the engine stayed reactive"
    if not p["plans"]:
        return "plan: none made (nothing moves, or too few steps to record one)"
    return (f"plan: made from a recorded warm-up iteration ({p['plans']} plan(s), "
            f"{p['actions']} actions per iteration); executed in {p['planned_iterations']} "
            f"iterations, {p['followed_iterations']} followed to the end, "
            f"{p['divergences']} diverged; {p['prefetches']} planned prefetches, "
            f"{p['evictions']} planned evictions ({p['deferred']} deferred for room); "
            f"predicted per iteration: {predicted_bytes(p)}{decision_note(p)}")


def decision_note(p) -> str:
    """plan: auto's bar on the plan, as it judged it (stats()['plan']['decision']): the plan's
    simulated bytes and stall per iteration against the engine's moves simulated on the same
    trace, and what the engine measured over the recorded iteration ("" when not judged)."""
    d = p.get("decision") or {}
    if not d.get("judged"):
        return ""
    mib = 2 ** 20
    verdict = "adopted" if d["adopted"] else "declined"
    engine = (f"the engine's {d['engine_bytes'] / mib:.1f} MiB / "
              f"{d['engine_stall_ns'] / 1e6:.1f} ms stall" if d["engine_simulated"]
              else "no simulated engine")
    measured = (f"; the engine measured {d['engine_measured_bytes'] / mib:.1f} MiB over the "
                f"recorded step" if d["measured"] else "")
    return (f"; auto {verdict} it: {d['plan_bytes'] / mib:.1f} MiB / "
            f"{d['plan_stall_ns'] / 1e6:.1f} ms stall (simulated) against {engine}{measured}")


def predicted_bytes(p) -> str:
    """The plan's modelled bytes per iteration: into the device, and to and from NVMe (host
    mode has no device: NVMe only)."""
    mib = 2 ** 20
    parts = []
    if p["predicted_device_in_bytes"]:
        parts.append(f"{p['predicted_device_in_bytes'] / mib:.1f} MiB into the device")
    if p["predicted_nvme_bytes"] or not parts:
        parts.append(f"{p['predicted_nvme_bytes'] / mib:.1f} MiB to and from NVMe")
    return ", ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(PRESETS), default="default")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--device", choices=["auto", "host", "sim", "sim-async", "cuda"],
                    default="auto",
                    help="where compute runs: auto (the GPU when there is one, else host), "
                         "host (the CPU against chunks in host memory: tiers host + NVMe), "
                         "sim (SimDevice: a simulated device of --device-budget in host "
                         "memory, for what a GPU of that budget would do; a simulation)")
    ap.add_argument("--device-budget", default=None,
                    help="device budget (default: the size's; not with --device host)")
    ap.add_argument("--host-budget", default=None)
    ap.add_argument("--nvme-path", default=None,
                    help="directory for the NVMe tier (default: a temporary one, removed)")
    ap.add_argument("--nvme-size", default=None)
    ap.add_argument("--lr", type=float, default=None,
                    help="AdamW learning rate (default: the size's: 1e-3, xl 1e-5)")
    ap.add_argument("--timeline", default="build/tiermem-timeline.tmt")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--plan", choices=["auto", "always", "off"], default="auto",
                    help="execute a plan made from a warm-up iteration unless it would move "
                         "more bytes than the reactive engine (auto, the default), execute it "
                         "anyway (always), or keep the engine's reactive policy (off)")
    ap.add_argument("--activations",
                    choices=["outside", "budget", "offload", "recompute", "auto"],
                    default="outside",
                    help="saved activations outside the device budget (default), counted in "
                         "it, counted and offloaded to host memory when the device is short, "
                         "counted and recomputed per unit in the backward, or counted with "
                         "the executed plan choosing per unit (docs/python.md)")
    ap.add_argument("--meta", action=argparse.BooleanOptionalAction, default=None,
                    help="build the model on the meta device and let tiermem give each "
                         "module its values in the chunks (the model is never whole in "
                         "memory: docs/python.md 'Models larger than RAM'); default: on for "
                         "--size xl")
    ap.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default=None,
                    help="how Adam's m and v are stored, in every tier (optimizer.state_dtype; "
                         "default fp32, or TIERMEM_STATE_DTYPE): int8 moves about a quarter of "
                         "the state's bytes (docs/python.md)")
    args = ap.parse_args(argv)
    preset = PRESETS[args.size]
    if args.threads:
        torch.set_num_threads(args.threads)
    n_embd = args.n_embd or preset["n_embd"]
    n_head = args.n_head or preset["n_head"]
    n_layer = args.n_layer or preset["n_layer"]
    block = args.block_size
    if n_layer is None:  # xl: enough layers that the training state exceeds physical RAM
        per_layer = 12 * n_embd * n_embd + 13 * n_embd
        n_layer = math.ceil(mem_total_bytes() * 1.05 / (16 * per_layer))
    steps = args.steps or preset["steps"]
    c = GPTConfig(vocab_size=256, block_size=block, n_layer=n_layer, n_head=n_head,
                  n_embd=n_embd)
    state_bytes_est = 16 * (n_layer * (12 * n_embd * n_embd + 13 * n_embd) +
                            (256 + block) * n_embd + 2 * n_embd)
    nvme_size = args.nvme_size or preset["nvme"] or str(int(state_bytes_est * 1.1))
    own_nvme = args.nvme_path is None
    nvme_dir = args.nvme_path or tempfile.mkdtemp(prefix="tiermem-nvme-")
    try:
        if args.size == "xl":
            free = shutil.disk_usage(nvme_dir).free
            need = tiermem.parse_config({"nvme": {"size": nvme_size}}, env={}).nvme_size
            if free < need:
                print(f"--size xl needs {fmt(need)} free for the NVMe tier in {nvme_dir}, "
                      f"which has {fmt(free)}; use --nvme-path on a bigger disk",
                      file=sys.stderr)
                return 2
            print(f"xl: {n_layer} x {n_embd} decoder, training state ~{fmt(state_bytes_est)} "
                  f"> physical RAM {fmt(mem_total_bytes())}")
        return train(args, c, steps, preset, nvme_dir, nvme_size)
    finally:
        if own_nvme:
            shutil.rmtree(nvme_dir, ignore_errors=True)


def train(args, c, steps, preset, nvme_dir, nvme_size) -> int:
    torch.manual_seed(0)
    t_build = time.perf_counter()
    meta = args.size == "xl" if args.meta is None else args.meta
    if meta:  # values made module by module into the chunks, by initialize below
        with torch.device("meta"):
            model = GPT(c)
    else:
        model = GPT(c)
    n_params = sum(p.numel() for p in model.parameters())
    # What runs (TIERMEM_DEVICE overrides --device, as it does every config).
    kind = tiermem._C.resolve_device_kind(
        tiermem.parse_config({"device_kind": args.device}).device_kind)
    if kind.host_compute and args.device_budget:
        print(f"--device-budget {args.device_budget}: there is no device in host mode "
              "(compute runs on the CPU against host memory, sized by --host-budget); use "
              "--device sim to simulate a device of that budget", file=sys.stderr)
        return 2
    config = {"device_kind": args.device,
              "host": args.host_budget or preset["host"],
              "nvme": {"path": nvme_dir, "size": nvme_size},
              "timeline": args.timeline or None,
              "optimizer": {"lr": args.lr or preset["lr"], "weight_decay": 0.01},
              "plan": args.plan, "activations": args.activations}
    if args.state_dtype:
        config["optimizer"]["state_dtype"] = args.state_dtype
    if not kind.host_compute:
        config["device"] = args.device_budget or preset["device"]
    model, opt = tiermem.initialize(model, config, init=GPT._init_weights if meta else None)
    rt = tiermem.runtime_of(model)
    host_mode = rt.session.host_compute
    # The budget of the tier compute runs from: the host's in host mode, else the device's.
    budget = rt.cfg.host_budget if host_mode else rt.cfg.device_budget
    # The warm-up trace of iterations 2 and 3, next to the timeline: what the planner (tiermem
    # plan) reads. Not the first: it is cold and has no deferred optimizer updates in its
    # forward (docs/python.md "When the optimizer runs"), so it would not look like the rest.
    # Nothing moves at all when everything fits (resident): no trace.
    trace = os.path.splitext(args.timeline)[0] + ".tmtrace" if args.timeline else None
    if not trace or rt._resident or steps < 3:
        trace = None
    if host_mode:
        print("mode: host — compute on the CPU against the chunks in host memory (tiers: "
              "host, NVMe); --device sim simulates a device instead")
        where = f"host budget of {fmt(budget)}"
    else:
        print(f"mode: {rt.session.device_kind} — "
              + ("a CUDA device" if rt.session.cuda else
                 "SimDevice, a simulated device in host memory: step times are a simulation")
              + " (tiers: device, host, NVMe)")
        where = f"device budget of {fmt(budget)}; host {fmt(rt.cfg.host_budget)}"
    print(f"model: {n_params / 1e6:.2f} M params ({c.n_layer} x {c.n_embd}); "
          f"params+grads+AdamW = {fmt(rt.model_bytes)} = {rt.model_bytes / budget:.1f}x the "
          f"{where}, NVMe "
          f"{fmt(rt.cfg.nvme_size)} in {nvme_dir} ({rt.session.io_backend}); chunk "
          f"{rt.chunk_elems} elements x {rt.session.num_groups} groups "
          f"(set up in {time.perf_counter() - t_build:.1f} s"
          f"{', built on the meta device: values made in the chunks' if meta else ''})")

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    data = synthetic_batches(c, args.batch, steps, seed=1)
    bar = tqdm(total=steps, unit="step", dynamic_ncols=True) if tqdm else None
    t0 = time.perf_counter()
    tokens = 0
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        if trace and not losses:
            rt.record_trace(trace, iterations=2)  # from the next iteration
        tokens += x.numel()
        losses.append(loss.item())
        if bar:
            st = rt.stats()["tiers"]
            dev = ("" if host_mode else
                   f"device {fmt(st['device']['used'])}/{fmt(st['device']['capacity'])} ")
            bar.set_postfix_str(
                f"loss {losses[-1]:.3f} | {tokens / (time.perf_counter() - t0):.0f} tok/s | "
                f"{dev}host {fmt(st['host']['used'])}/{fmt(st['host']['capacity'])} "
                f"nvme {fmt(st['nvme']['used'])}")
            bar.update(1)
    if bar:
        bar.close()
    wall = time.perf_counter() - t0
    plan = rt.stats()["plan"]
    acts = rt.stats().get("activations")
    peaks = rt.timeline_peaks()  # tiermem::prof's report of the binary timeline file
    timeline = rt.timeline_path
    if trace:
        try:
            rt.finish_trace()  # written at step 4 already; this raises if that write failed
        except RuntimeError as e:
            print(f"(the warm-up trace could not be written: {e})")
            trace = None
    # Completes the timeline; gives the params back as plain tensors unless the model was
    # built on meta (larger than RAM, maybe: its values are dropped, not all made at once).
    rt.close(keep_values=not meta)
    print(f"\n== {steps} steps in {wall:.1f} s ({wall / steps:.2f} s/step), "
          f"{tokens / wall:.0f} tokens/s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(plan_line(args.plan, plan))
    if acts is not None:
        spilled = (f" (of them {fmt(acts['spilled_bytes'] // steps)} spilled to NVMe: the host "
                   f"budget had no room)" if acts.get("spilled_bytes") else "")
        print(f"activations: {args.activations} — {fmt(acts['offloaded_bytes'] // steps)} per "
              f"step moved to host memory and back{spilled} ({acts['sync_fetches']} fetched on "
              f"demand), "
              f"{acts['recomputed_units'] / steps:g} units recomputed per step"
              f"{', ' + fmt(acts['dropped_bytes'] // steps) + ' dropped per step' if acts['dropped_bytes'] else ''}"
              f"; device activation peak {fmt(peaks['category_peak']['device']['activation'])}, "
              f"host {fmt(peaks['category_peak']['host']['activation'])}"
              f"{', NVMe ' + fmt(peaks['category_peak']['nvme']['activation']) if spilled else ''}")
    if args.timeline:
        rep = run_cli("prof", "report", timeline)
        print(rep.stdout if rep.returncode == 0 else rep.stderr)
        html = os.path.splitext(timeline)[0] + ".html"
        made = run_cli("prof", "html", timeline, "-o", html)
        print(f"timeline: {peaks['events']} events -> {timeline}")
        if made.returncode == 0:
            print(f"HTML timeline -> {html}")
        else:
            print(f"(the HTML timeline could not be written: {made.stderr.strip()})")
        print(f"reopen them with: {cli_command()} prof report {timeline}\n"
              f"                  {cli_command()} prof html {timeline} -o {html}  "
              f"(then open {html} in a browser)")
    if trace and host_mode:
        # Every schedule policy simulated over this run's own warm-up trace: the host tier
        # caching NVMe-homed chunks (activations are torch's, outside the host budget).
        cmp_ = run_cli("plan", "compare", trace)
        print(f"\nwarm-up trace (2 iterations) -> {trace}; schedules simulated over it "
              f"(tiermem plan compare, host mode: host {fmt(budget)} + NVMe):")
        print(cmp_.stdout if cmp_.returncode == 0 else cmp_.stderr)
        print(f"rerun with: {cli_command()} plan compare {trace}")
    elif trace:
        # Every schedule policy simulated over this run's own warm-up trace, with room for
        # the activations (on the SimDevice they live in CPU memory, outside the budget).
        room = f"{budget + rt_peak_activation(trace)}"
        cmp_ = run_cli("plan", "compare", trace, "--device", room)
        print(f"\nwarm-up trace (2 iterations) -> {trace}; schedules simulated over it "
              f"(tiermem plan compare, device {fmt(int(room))} = the budget + room for the "
              f"recorded activations):")
        print(cmp_.stdout if cmp_.returncode == 0 else cmp_.stderr)
        print(f"rerun with: {cli_command()} plan compare {trace} --device {room}")
    status = 0
    if peaks["over_budget"]:
        print("ERROR: a tier's budget was exceeded (see the report)")
        status = 1
    if not losses[-1] < losses[0]:
        print("ERROR: the loss did not go down")
        status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
