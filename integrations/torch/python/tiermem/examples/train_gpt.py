"""The main job: train the repo's GPT-style decoder with tiermem on a device budget far below
the model's data (params + grads + AdamW state), then print where the bytes went.

    python -m tiermem.examples.train_gpt [--steps N] [--device-budget 12MiB] ...
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import tiermem
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches

def fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=192)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--device-budget", default="7MiB")
    ap.add_argument("--host-budget", default="1GiB")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--nvme-size", default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeline", default="build/tiermem-timeline.tmt")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    c = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer,
                  n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(c)
    n_params = sum(p.numel() for p in model.parameters())
    config = {"device": args.device_budget, "host": args.host_budget, "timeline": args.timeline or None,
              "optimizer": {"lr": args.lr, "weight_decay": 0.01}}
    if args.nvme_size:
        config["nvme"] = {"path": args.nvme_path or "/tmp/tiermem-nvme", "size": args.nvme_size}
    model, opt = tiermem.initialize(model, config)
    rt = tiermem.runtime_of(model)
    budget = rt.cfg.device_budget
    print(f"model: {n_params / 1e6:.2f} M params; params+grads+AdamW = {fmt(rt.model_bytes)} "
          f"= {rt.model_bytes / budget:.1f}x the device budget of {fmt(budget)}; "
          f"chunk {rt.chunk_elems} elements x {len(rt.groups)} groups")

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    data = synthetic_batches(c, args.batch, args.steps, seed=1)
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True) if tqdm else None
    t0 = time.perf_counter()
    tokens = 0
    first_loss = last_loss = None
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        tokens += x.numel()
        last_loss = loss.item()
        first_loss = first_loss if first_loss is not None else last_loss
        if bar:
            st = rt.stats()["tiers"]
            bar.set_postfix_str(
                f"loss {last_loss:.3f} | {tokens / (time.perf_counter() - t0):.0f} tok/s | "
                f"dev peak {fmt(st['device']['peak'])}/{fmt(st['device']['capacity'])} "
                f"host {fmt(st['host']['used'])}"
                + (f" nvme {fmt(st['nvme']['used'])}" if st['nvme']['capacity'] else ""))
            bar.update(1)
    if bar:
        bar.close()
    wall = time.perf_counter() - t0

    s = rt.stats()
    peaks = rt.timeline_peaks()  # tiermem::prof's report of the binary timeline file
    print(f"\n== tiermem summary: {args.steps} steps in {wall:.1f} s, "
          f"{tokens / wall:.0f} tokens/s, loss {first_loss:.3f} -> {last_loss:.3f}")
    print("peak per tier (from the timeline):")
    for t in ("device", "host", "nvme"):
        if peaks["budget"][t]:
            print(f"  {t:6s} {fmt(peaks['peak'][t]):>12s} of {fmt(peaks['budget'][t])}")
    print("bytes moved per tier pair (from the timeline):")
    for pair, n in sorted(peaks["copied"].items()):
        print(f"  {pair:14s} {fmt(n):>12s}  ({fmt(n / args.steps)}/step)")
    print(f"stall time (from the timeline): {peaks['stall_ns'] / 1e6:.1f} ms in "
          f"{peaks['stalls']} stalls; {s['prefetches']} prefetches, {s['evictions']} evictions "
          f"({s['clean_evictions']} clean)")
    for cause, ns in sorted(peaks["stall_causes"].items(), key=lambda kv: -kv[1])[:4]:
        print(f"  {cause:24s} {ns / 1e6:8.1f} ms")
    # Detach: gives the params back as plain tensors and closes the timeline (end record).
    rt.close()
    if peaks["over_budget"]:
        print("ERROR: the device budget was exceeded")
        return 1
    if args.timeline:
        print(f"timeline: {peaks['events']} events -> {args.timeline}")
        print(f"  inspect it with: {cli_command()} prof report {args.timeline}")
        print(f"  HTML timeline:   {cli_command()} prof html {args.timeline} -o "
              f"{os.path.splitext(args.timeline)[0]}.html")
    return 0


def cli_command() -> str:
    """How to run the `tiermem` CLI that came with this package (the console script next to
    this interpreter when installed, else `python -m tiermem`)."""
    script = os.path.join(os.path.dirname(sys.executable), "tiermem")
    if os.access(script, os.X_OK):
        return script
    return f"{sys.executable} -m tiermem"


if __name__ == "__main__":
    raise SystemExit(main())
