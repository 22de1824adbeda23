"""NVMe inside a training step (CPU): the disk rate the engine achieves while it moves chunks
to and from NVMe during training, against fio's on the same file system in the same run.

The model and budgets are the main job's (GPT 12 x 768, 85 M params, 1.3 GiB of fp32 training
state; device 128 MiB, host 512 MiB, NVMe in `--dir`), so the optimizer state that does not
fit in host memory lives on NVMe and moves every step. Each round, alternating which goes
first: fio (sequential write then read, O_DIRECT, io_uring, `--fixedbufs --registerfiles`,
huge-page buffers when the kernel has hugetlb pages free; the tier's block of 1 MiB and queue
depth) and `--steps` training steps. The engine's rate comes from the session's timeline
(tiermem::prof): NVMe bytes read (written) over the time at least one NVMe read (write) was in
flight — the union of the copies' intervals, so overlapping copies count once. A bounced move
(NVMe <-> device through a staging slot) counts with its staging copy, which only lowers our
rate. Reads and writes overlap in the optimizer step and share the disk, so the headline is
the disk's efficiency while busy: the time fio would take for the same bytes (read bytes at
fio's read rate plus written bytes at its write rate) over the time at least one NVMe copy of
either kind was in flight (1.0 = the disk as busy as fio keeps it). Also printed: the share of
the step time the disk was busy.

`--threads` sets torch's threads: on a machine whose CPU also runs the model (this 2-vCPU VM),
compute threads on every core leave the I/O path's own CPU work (CRC32C, staging copies,
io_uring) waiting for time slices; on a GPU machine the cores are free for it.

    benchmarks/run.sh bench_nvme_step [--rounds 3] [--steps 4] [--threads N] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import tiermem
from benchmarks import add_tier_args, bench_gpt, tier_config
from benchmarks.fio import fio_rates


def nvme_io(rt):
    io = rt.session.timeline_report()["io"]["nvme"]
    return {k: io[k] for k in ("read_bytes", "read_active_ns", "write_bytes", "write_active_ns",
                               "active_ns")}


def io_seen(rows):
    return all(r["read GB/step"] > 0 and r["write GB/step"] > 0 for r in rows)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="training steps per round")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the first round")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    add_tier_args(ap)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dir", default=None, help="directory for the NVMe tier and fio's file")
    ap.add_argument("--nvme-size", default="4GiB")
    ap.add_argument("--fio-size", default="1G", help="bytes fio writes then reads per round")
    ap.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                    help="optimizer.state_dtype: how m and v are stored (int8 moves fewer bytes)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="tiermem-bench-nvme-step-", dir=a.dir)
    try:
        return run(a, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(a, workdir):
    if a.threads:
        torch.set_num_threads(a.threads)
    total = a.warmup + a.rounds * a.steps
    model, batches = bench_gpt(a.layers, a.width, 8, total)
    n = sum(p.numel() for p in model.parameters())
    config = {**tier_config(a.device_kind, a.device, a.host),
              "nvme": {"path": os.path.join(workdir, "nvme"), "size": a.nvme_size},
              "timeline": os.path.join(workdir, "t.tmt"),
              "optimizer": {"state_dtype": a.state_dtype}}
    os.makedirs(config["nvme"]["path"])
    model, opt = tiermem.initialize(model, config)
    rt = tiermem.runtime_of(model)
    data = iter(batches)

    def steps(k):
        t0 = time.perf_counter()
        for _ in range(k):
            x, y = next(data)
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
        return time.perf_counter() - t0

    print(f"model: GPT {a.layers} x {a.width} ({n / 1e6:.1f} M params), "
          f"{config.get('device', 'host mode, no')} device, "
          f"host {a.host}, NVMe in {workdir} ({rt.session.io_backend}); torch threads "
          f"{torch.get_num_threads()}", flush=True)
    steps(a.warmup)
    rows = []
    for r in range(a.rounds):
        def train():
            before = nvme_io(rt)
            wall = steps(a.steps)
            after = nvme_io(rt)
            return wall, {k: after[k] - before[k] for k in after}

        if r % 2 == 0:
            fio = fio_rates(workdir, a.fio_size)
            wall, io = train()
        else:
            wall, io = train()
            fio = fio_rates(workdir, a.fio_size)
        if fio is None:
            raise SystemExit("fio is needed for this benchmark (apt-get install fio)")
        rd = io["read_bytes"] / io["read_active_ns"] if io["read_active_ns"] else 0.0
        wr = io["write_bytes"] / io["write_active_ns"] if io["write_active_ns"] else 0.0
        fio_s = io["read_bytes"] / 1e9 / fio["read"] + io["write_bytes"] / 1e9 / fio["write"]
        row = {"round": r + 1, "s/step": wall / a.steps,
               "disk efficiency vs fio": fio_s / (io["active_ns"] / 1e9),
               "read GB/step": io["read_bytes"] / a.steps / 1e9,
               "write GB/step": io["write_bytes"] / a.steps / 1e9,
               "ours read GB/s": rd, "fio read GB/s": fio["read"], "read ours/fio": rd / fio["read"],
               "ours write GB/s": wr, "fio write GB/s": fio["write"],
               "write ours/fio": wr / fio["write"],
               "disk busy": io["active_ns"] / 1e9 / wall, "fio iomem": fio["iomem"]}
        rows.append(row)
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()), flush=True)
    if not io_seen(rows):
        raise SystemExit("no NVMe traffic in the timed steps: the state fits above NVMe at "
                         "these budgets")
    rt.close()
    med = {k: statistics.median(row[k] for row in rows)
           for k in ("disk efficiency vs fio", "read ours/fio", "write ours/fio", "ours read GB/s", "ours write GB/s",
                     "fio read GB/s", "fio write GB/s", "s/step")}
    print("median of rounds: " + "  ".join(f"{k}={v:.3f}" for k, v in med.items()))
    if a.json:
        print(json.dumps({"rows": rows, "median": med}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
