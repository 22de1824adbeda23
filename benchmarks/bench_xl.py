"""A GPT larger than RAM, trained in host mode with NVMe, against its bound - both measured in
the same run (issue 32's 1.53 B and >= 3 B rows, issue 34's largest model with int8 state).

The bound of a step is max(compute, NVMe): compute = plain torch forward + backward of the same
model and batch plus `AdamW(fused=True)` over the same params; NVMe = the bytes the step moved
to and from NVMe at fio's rates on the same file system (reads at its read rate plus writes at
its write rate: one disk). Plain torch cannot hold the whole model (that is the point), so its
compute is measured on slices of the same width - 1 and 3 blocks - and extrapolated linearly in
the blocks (t(L) = a + b L: the embeddings and head in a, a block's matmuls and its AdamW in
b). The slices and fio run before and after the tiermem run; their means are used.

The model is built on the meta device and tiermem makes its values in the chunks, module by
module (docs/python.md "Models larger than RAM"): its params alone may exceed RAM.

    benchmarks/run.sh bench_xl --n-layer 24 --dir build/benchdir [--state-dtype int8]

Prints, per step: its time, NVMe bytes read and written, the bound and step / bound; then the
median over the steps after the first (cold: its deferred optimizer update runs in step 2)
and a JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import tiermem
from benchmarks.bench_nvme_step import nvme_io
from benchmarks.fio import fio_rates
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches
from tiermem.examples.train_gpt import mem_total_bytes

GB = 1e9
GiB = 2 ** 30


def state_bytes(n_params: int, dtype: str) -> float:
    """Training state per the session's layout: fp32 params and grads, then m and v (int8:
    a byte each plus one fp32 absmax per block of 256; bf16: two bytes each)."""
    mv = {"fp32": 8, "bf16": 4, "int8": 2 + 8 / 256}[dtype]
    return n_params * (8 + mv)


def plain_step_seconds(c: GPTConfig, batch: int, reps: int) -> float:
    """Median seconds of a plain torch step (forward, backward, AdamW(fused=True)) of `c`,
    after one warm-up step (the optimizer's state is made lazily in it)."""
    torch.manual_seed(0)
    m = GPT(c)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    times = []
    for i, (x, y) in enumerate(synthetic_batches(c, batch, reps + 1, seed=1)):
        t0 = time.perf_counter()
        opt.zero_grad()
        m(x, y).backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    del m, opt
    gc.collect()
    return statistics.median(times)


def compute_seconds(c: GPTConfig, batch: int, reps: int) -> dict:
    """Plain torch's step of `c` extrapolated from 1- and 3-block slices of it."""
    t1 = plain_step_seconds(GPTConfig(**{**c.__dict__, "n_layer": 1}), batch, reps)
    t3 = plain_step_seconds(GPTConfig(**{**c.__dict__, "n_layer": 3}), batch, reps)
    b = (t3 - t1) / 2
    return {"1 block": t1, "3 blocks": t3, "per block": b, "model": t1 + b * (c.n_layer - 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=2304)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--host", default="4GiB", help="host budget")
    ap.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32")
    ap.add_argument("--plan", choices=["auto", "always", "off"], default="auto")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--reps", type=int, default=3, help="timed plain steps per slice")
    ap.add_argument("--fio-size", default="2G")
    ap.add_argument("--nvme-size", type=int, default=None,
                    help="bytes of the NVMe tier (default: the state beyond the host budget, "
                         "+15%% + 4 GiB)")
    ap.add_argument("--dir", default=None, help="directory for the NVMe tier and fio's file")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--timeline", default=None,
                    help="keep tiermem's timeline here (tiermem prof report|html reads it)")
    a = ap.parse_args(argv)
    c = GPTConfig(vocab_size=256, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                  n_embd=a.n_embd)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(c).parameters())
    state = state_bytes(n_params, a.state_dtype)
    host = tiermem.parse_config({"host": a.host}, env={}).host_budget
    # Chunks hold whole tensors (some room in each is unused) and the host keeps room for the
    # NVMe-homed chunks in use: 15% and 4 GiB above the state beyond the host budget.
    nvme_size = a.nvme_size or int(max(state * 1.15 - host, 0)) + 4 * GiB
    workdir = tempfile.mkdtemp(prefix="tiermem-bench-xl-", dir=a.dir)
    try:
        free = shutil.disk_usage(workdir).free
        fio_bytes = tiermem.parse_config({"nvme": {"size": a.fio_size}}, env={}).nvme_size
        if free < nvme_size + fio_bytes:
            raise SystemExit(f"needs {(nvme_size + fio_bytes) / GiB:.1f} GiB free in {workdir} "
                             f"(NVMe tier + fio's file), which has {free / GiB:.1f} GiB")
        ram = mem_total_bytes()
        print(f"model: GPT {a.n_layer} x {a.n_embd}, {n_params / 1e9:.3f} B params; training "
              f"state ({a.state_dtype} m, v) {state / GiB:.1f} GiB = {state / ram:.2f}x RAM "
              f"({ram / GiB:.1f} GiB), params alone {4 * n_params / GiB:.1f} GiB; host "
              f"{a.host}, NVMe tier {nvme_size / GiB:.1f} GiB in {workdir}; batch "
              f"{a.batch} x {a.block_size}; torch threads {torch.get_num_threads()}", flush=True)
        return run(a, c, n_params, state, nvme_size, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure_baselines(a, c, workdir, when):
    fio = fio_rates(workdir, a.fio_size)
    if fio is None:
        raise SystemExit("fio is needed for this benchmark (apt-get install fio)")
    comp = compute_seconds(c, a.batch, a.reps)
    print(f"{when}: fio read {fio['read']:.2f} GB/s, write {fio['write']:.2f} GB/s "
          f"({fio['iomem']} buffers); plain torch step of 1 / 3 blocks "
          f"{comp['1 block']:.2f} / {comp['3 blocks']:.2f} s -> the model "
          f"{comp['model']:.1f} s", flush=True)
    return fio, comp


def run(a, c, n_params, state, nvme_size, workdir):
    before = measure_baselines(a, c, workdir, "before")
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(c)
    torch.manual_seed(0)
    cfg = {"device_kind": "host", "host": a.host,
           "nvme": {"path": os.path.join(workdir, "nvme"), "size": str(nvme_size)},
           "timeline": a.timeline or os.path.join(workdir, "xl.tmt"), "plan": a.plan,
           "optimizer": {"lr": a.lr, "weight_decay": 0.01, "state_dtype": a.state_dtype}}
    os.makedirs(cfg["nvme"]["path"])
    model, opt = tiermem.initialize(model, cfg, init=GPT._init_weights)
    rt = tiermem.runtime_of(model)
    print(f"tiermem: set up in {time.perf_counter() - t0:.1f} s (values made in the chunks); "
          f"{rt.session.num_groups} groups of {rt.chunk_elems} elements, "
          f"{rt.session.total_chunk_bytes / GiB:.2f} GiB of chunks, NVMe holding "
          f"{rt.stats()['tiers']['nvme']['used'] / GiB:.2f} GiB", flush=True)
    steps = []
    for i, (x, y) in enumerate(synthetic_batches(c, a.batch, a.steps, seed=1)):
        io0 = nvme_io(rt)
        t = time.perf_counter()
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        lv = loss.item()
        dt = time.perf_counter() - t
        io1 = nvme_io(rt)
        read, written = (io1[k] - io0[k] for k in ("read_bytes", "write_bytes"))
        steps.append({"step": i + 1, "s": dt, "loss": lv, "read": read, "write": written})
        print(f"  step {i + 1}: {dt:.1f} s, loss {lv:.4f}, NVMe read {read / GB:.2f} GB, "
              f"written {written / GB:.2f} GB", flush=True)
    plan = rt.stats()["plan"]
    rt.close(keep_values=False)  # the values may not fit in RAM: dropped, not made
    del model, opt
    gc.collect()
    after = measure_baselines(a, c, workdir, "after")
    rd = (before[0]["read"] + after[0]["read"]) / 2
    wr = (before[0]["write"] + after[0]["write"]) / 2
    compute = (before[1]["model"] + after[1]["model"]) / 2
    for s in steps:
        s["nvme s"] = s["read"] / GB / rd + s["write"] / GB / wr
        s["bound"] = max(compute, s["nvme s"])
        s["ratio"] = s["s"] / s["bound"]
    print(f"\nbound: compute {compute:.1f} s (plain torch, extrapolated from slices), NVMe at "
          f"fio's {rd:.2f} GB/s read, {wr:.2f} GB/s write")
    print("step   time(s)  read GB  write GB  NVMe at fio (s)  bound (s)  step/bound")
    for s in steps:
        print(f"{s['step']:>4}  {s['s']:8.1f}  {s['read'] / GB:7.2f}  {s['write'] / GB:8.2f}  "
              f"{s['nvme s']:15.1f}  {s['bound']:9.1f}  {s['ratio']:10.3f}")
    warm = steps[1:] or steps
    med = statistics.median(s["ratio"] for s in warm)
    falling = steps[-1]["loss"] < steps[0]["loss"]
    print(f"median step/bound over steps 2-{len(steps)}: {med:.3f}; plan: "
          f"{plan['plans']} made, {plan['planned_iterations']} iterations executed"
          f"{', declined: ' + plan['declined'] if plan['declined'] else ''}; loss "
          f"{steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f} ({'falling' if falling else 'NOT falling'})")
    out = {"n_params": n_params, "state_bytes": state, "state_dtype": a.state_dtype,
           "host": a.host, "compute_s": compute, "fio_read": rd, "fio_write": wr,
           "slices": [before[1], after[1]], "steps": steps, "median_ratio": med,
           "loss_falling": falling}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if falling else 1


if __name__ == "__main__":
    raise SystemExit(main())
