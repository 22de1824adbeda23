"""Optimizer placement benchmark (CPU, SimDevice): tiermem with ``optimizer_placement: auto``
(the chunk groups whose optimizer state fits next to the training working set step on the
device, so their params and grads never cross to the host) against ``host`` (every group steps
on host copies) and against plain torch with ``torch.optim.AdamW(fused=True)``, on the same
model and data, alternating by round (ABBA). The device budget holds every param and grad
chunk plus a fraction of the optimizer state (``--state-fraction``).

On SimDevice the device is host memory, so what placement saves here is the copies (memcpys
on the same cores); on a GPU it saves PCIe traffic and runs the step on the GPU
(docs/gpu.md measures that).

    benchmarks/run.sh bench_placement [--rounds 5] [--steps 6] [--layers 6] [--width 384]
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch

import tiermem
from benchmarks.bench_engine import timed_steps
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--state-fraction", type=float, default=0.5,
                    help="share of the optimizer state the device budget has room for")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4,
                  n_embd=args.width)
    base = GPT(c)
    n = sum(p.numel() for p in base.parameters())
    data = list(synthetic_batches(c, 8, args.warmup + args.steps, seed=1))
    # The chunk bytes (padding included) from a probe: fp32 param, grad, m, v are alike.
    pm, _ = tiermem.initialize(copy.deepcopy(base), {"device_kind": "sim", "device": "4GiB", "host": "1GiB"})
    total = tiermem.runtime_of(pm).session.total_chunk_bytes
    tiermem.runtime_of(pm).close()
    budget = total // 2 + int(total // 2 * args.state_fraction)

    plain = copy.deepcopy(base)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    ours = {}
    for placement in ("auto", "host"):
        m, o = tiermem.initialize(copy.deepcopy(base), {
            "device_kind": "sim",  # the subject is the device budget: SimDevice
            "device": budget, "host": "1GiB", "optimizer": {"lr": 1e-3},
            "optimizer_placement": placement})
        ours[placement] = (m, o, tiermem.runtime_of(m))
    timed_steps(plain, popt, data[:args.warmup])
    for m, o, _ in ours.values():
        timed_steps(m, o, data[:args.warmup])
    before = {k: dict(rt.stats()["bytes_moved"]) for k, (_, _, rt) in ours.items()}

    configs = [None, "auto", "host"]
    med = {k: [] for k in configs}
    timed = data[args.warmup:]
    for rnd in range(args.rounds):
        for k in (configs if rnd % 2 == 0 else configs[::-1]):
            m, o = (plain, popt) if k is None else ours[k][:2]
            med[k].append(statistics.median(timed_steps(m, o, timed)))
    steps = args.rounds * len(timed)
    print(f"GPT {args.layers} x {args.width}, {n / 1e6:.2f} M params; device budget "
          f"{budget / 2**20:.1f} MiB = every param + grad chunk and {args.state_fraction:.0%} of "
          f"the optimizer state; torch threads {torch.get_num_threads()}; {args.rounds} rounds "
          f"(ABBA) of {len(timed)} steps")
    print("| config | groups on device | step (ms) | vs plain torch (per-round ratios: median, "
          "min-max) | host->device / step | device->host / step |")
    print("|---|---|---|---|---|---|")
    print(f"| plain torch, AdamW(fused=True) | | {statistics.median(med[None]) * 1e3:.1f} | 1.00 "
          "| | |")
    for k in ("auto", "host"):
        rt = ours[k][2]
        st = rt.stats()
        moved = st["bytes_moved"]
        h2d = (moved.get("host->device", 0) - before[k].get("host->device", 0)) / steps
        d2h = (moved.get("device->host", 0) - before[k].get("device->host", 0)) / steps
        r = [a / b for a, b in zip(med[k], med[None])]
        print(f"| tiermem, optimizer_placement {k} | {len(st['optimizer']['device_groups'])} of "
              f"{rt.session.num_groups} | {statistics.median(med[k]) * 1e3:.1f} | "
              f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) | {h2d / 2**20:.2f} MiB "
              f"| {d2h / 2**20:.2f} MiB |")
    ra = [a / b for a, b in zip(med["auto"], med["host"])]
    print(f"auto / host step time: {statistics.median(ra):.3f} ({min(ra):.3f}-{max(ra):.3f})")
    for _, _, rt in ours.values():
        rt.close()


if __name__ == "__main__":
    main()
