"""Chunk-engine benchmark (CPU): step time of plain torch AdamW vs tiermem with the device
budget at 200% (everything fits), 50% and 25% of params + grads + AdamW state, all measured in
this run; and bytes moved per iteration vs the minimum any schedule needs (every trainable
param host->device once and every grad device->host once per step, since the optimizer runs on
the host copies).

    python -m tiermem.examples.bench_engine [--steps 8] [--layers 4] [--width 128]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import tiermem
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches


def run(model, opt, data, warmup):
    times = []
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--width", type=int, default=128, help="embedding width (multiple of 4)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4,
                  n_embd=args.width)
    base = GPT(c)
    n = sum(p.numel() for p in base.parameters())
    data = list(synthetic_batches(c, 8, args.steps + args.warmup, seed=1))
    plain = copy.deepcopy(base)
    t_plain = run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), data, args.warmup)
    print(f"GPT {args.layers} layers x {args.width}, {n / 1e6:.2f} M params, data "
          f"{16 * n / 2**20:.1f} MiB; median step over "
          f"{args.steps} steps after {args.warmup} warm-up")
    print(f"| config | step (ms) | vs plain torch | h2d / step | d2h / step | h2d / min | d2h / min |")
    print(f"|---|---|---|---|---|---|---|")
    print(f"| plain torch AdamW | {t_plain * 1e3:.1f} | 1.00 | | | | |")
    for frac in (2.0, 0.5, 0.25):
        m, opt = tiermem.initialize(copy.deepcopy(base), {
            "device": int(16 * n * frac), "host": "1GiB", "optimizer": {"lr": 1e-3}})
        rt = tiermem.runtime_of(m)
        t = run(m, opt, data, args.warmup)
        s = rt.stats()["bytes_moved"]
        steps = len(data)
        h2d = s.get("host->device", 0) / steps
        d2h = s.get("device->host", 0) / steps
        print(f"| tiermem, device budget {int(frac * 100)}% | {t * 1e3:.1f} | {t / t_plain:.2f} | "
              f"{h2d / 2**20:.2f} MiB | {d2h / 2**20:.2f} MiB | {h2d / (4 * n):.2f} | "
              f"{d2h / (4 * n):.2f} |")
        rt.close()


if __name__ == "__main__":
    main()
