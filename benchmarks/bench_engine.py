"""Engine benchmark (CPU): step time of tiermem vs plain torch with its strongest CPU optimizer,
``torch.optim.AdamW(fused=True)``, on the same model and data, measured in the same run in
alternating rounds (these machines are noisy: the ratio of each round's medians is reported,
then the median of those ratios).

Configs: the device budget at 200% of params + grads + AdamW state (everything fits), 50% and
25%. Also bytes moved per step against the minimum any schedule with the optimizer on the
host needs (every trainable param host->device once and every grad device->host once).

    benchmarks/run.sh bench_engine [--rounds 5] [--steps 6] [--layers 4] [--width 256]
        [--kernel-pool torch|own|both]

--kernel-pool both measures each budget twice: the optimizer kernels on torch's intra-op
threads (the default, docs/kernels.md "On torch's threads") and on their own oneTBB pool.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import tiermem
from tiermem import _C
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches


def timed_steps(model, opt, data):
    times = []
    for x, y in data:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--width", type=int, default=256, help="embedding width (multiple of 4)")
    ap.add_argument("--fractions", default="2.0,0.5,0.25")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--write-behind", choices=["on", "off", "both"], default="on",
                    help="the engine's background write-back; both: each budget twice")
    ap.add_argument("--kernel-pool", choices=["torch", "own", "both"], default="torch",
                    help="where the CPU optimizer kernels run; both: each budget twice")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4,
                  n_embd=args.width)
    base = GPT(c)
    n = sum(p.numel() for p in base.parameters())
    data = list(synthetic_batches(c, 8, args.warmup + args.steps, seed=1))
    fracs = [float(f) for f in args.fractions.split(",")]
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.write_behind]
    pools = ["torch", "own"] if args.kernel_pool == "both" else [args.kernel_pool]
    # A configuration: (budget fraction, write-behind, kernel pool); write-behind never acts
    # when everything fits, so a fraction >= 1 is measured once per pool.
    fractions = [(f, wb, pool) for f in fracs for wb in (modes if f < 1 else modes[:1])
                 for pool in pools]

    plain = copy.deepcopy(base)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    ours = {}
    for frac, wb, pool in fractions:
        m, o = tiermem.initialize(copy.deepcopy(base), {
            "device_kind": "sim",  # the subject is the device budget: SimDevice
            "device": int(16 * n * frac), "host": "1GiB", "optimizer": {"lr": 1e-3},
            "write_behind": wb})
        ours[(frac, wb, pool)] = (m, o, tiermem.runtime_of(m))
    # Warm up everything once (first-touch page faults, the recorded order).
    timed_steps(plain, popt, data[:args.warmup])
    for f, (m, o, _) in ours.items():
        _C.set_kernel_pool(f[2])
        timed_steps(m, o, data[:args.warmup])
    bytes_before = {f: dict(rt.stats()["bytes_moved"]) for f, (_, _, rt) in ours.items()}

    plain_med, our_med, ratios = [], {f: [] for f in fractions}, {f: [] for f in fractions}
    timed = data[args.warmup:]
    for rnd in range(args.rounds):
        # Plain first in even rounds, last in odd ones (ABBA), so a drift of the machine's
        # speed during a round does not favour either side.
        order = [None] + fractions if rnd % 2 == 0 else fractions[::-1] + [None]
        times = {}
        for f in order:
            m, o = (plain, popt) if f is None else ours[f][:2]
            if f is not None:
                _C.set_kernel_pool(f[2])
            times[f] = statistics.median(timed_steps(m, o, timed))
        plain_med.append(times[None])
        for f in fractions:
            our_med[f].append(times[f])
            ratios[f].append(times[f] / times[None])

    print(f"GPT {args.layers} layers x {args.width}, {n / 1e6:.2f} M params, data "
          f"{16 * n / 2**20:.1f} MiB, torch threads {torch.get_num_threads()}; "
          f"{args.rounds} rounds (ABBA order) of {args.steps} steps after {args.warmup} warm-up")
    print("| config | step (ms, median of rounds) | vs plain torch (median of per-round ratios; "
          "min-max) | h2d / step | d2h / step | h2d / min | d2h / min |")
    print("|---|---|---|---|---|---|---|")
    print(f"| plain torch, AdamW(fused=True) | {statistics.median(plain_med) * 1e3:.1f} | 1.00 "
          "| | | | |")
    steps = args.rounds * len(timed)
    for f, (m, o, rt) in ours.items():
        moved = rt.stats()["bytes_moved"]
        h2d = (moved.get("host->device", 0) - bytes_before[f].get("host->device", 0)) / steps
        d2h = (moved.get("device->host", 0) - bytes_before[f].get("device->host", 0)) / steps
        r = ratios[f]
        label = f"{int(f[0] * 100)}%" + ("" if args.write_behind == "on" or f[0] >= 1 else
                                          (", write-behind" if f[1] else ", no write-behind"))
        if args.kernel_pool == "both":
            label += f", {f[2]} pool"
        print(f"| tiermem, device budget {label} | {statistics.median(our_med[f]) * 1e3:.1f}"
              f" | {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) | "
              f"{h2d / 2**20:.2f} MiB | {d2h / 2**20:.2f} MiB | {h2d / (4 * n):.2f} | "
              f"{d2h / (4 * n):.2f} |")
    for _, _, rt in ours.values():
        rt.close()
    _C.set_kernel_pool("torch")


if __name__ == "__main__":
    main()
