"""Sharded training launched with torchrun (docs/distributed.md): every rank holds 1/N of the
GPT's chunks; the global batch is split across ranks; rank 0 prints the global loss.

    torchrun --nproc_per_node 2 -m tiermem.examples.train_distributed --steps 20
    # several nodes: torchrun's usual --nnodes / --node_rank / --rdzv_endpoint options

Gloo on CPU-only machines (SimDevice), NCCL when there is a GPU per rank. tiermem picks up
the default process group; pass process_group= to tiermem.initialize for another.
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import tiermem
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--device-budget", default=None,
                    help="per rank (default: 1/4 of the model, at least 4 MiB)")
    ap.add_argument("--host-budget", default="1GiB", help="per rank")
    ap.add_argument("--checkpoint", default=None, help="save the training state here at the end")
    ap.add_argument("--timeout", type=int, default=300, help="collective timeout, seconds")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by {world} ranks")
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4,
                  n_embd=args.width)
    model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    model, opt = tiermem.initialize(model, {
        "device": args.device_budget or max(n * 16 // 4, 4 << 20), "host": args.host_budget,
        "optimizer": {"lr": 1e-3}})
    rt = tiermem.runtime_of(model)
    b = args.batch // world
    if rank == 0:
        print(f"tiermem: {world} ranks ({dist.get_backend()}), GPT {args.layers} x {args.width} "
              f"({n / 1e6:.2f} M params), {rt.session.total_chunk_bytes / 2**20:.1f} MiB of chunks "
              f"per rank, device {rt.session.device_kind}", flush=True)
    dev = "cuda" if cuda else "cpu"
    for step, (x, y) in enumerate(synthetic_batches(c, args.batch, args.steps, seed=1)):
        opt.zero_grad()
        loss = model(x[rank * b:(rank + 1) * b].to(dev), y[rank * b:(rank + 1) * b].to(dev))
        loss.backward()
        opt.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {t.item() / world:.4f}", flush=True)
    if args.checkpoint:
        tiermem.save_checkpoint(model, opt, args.checkpoint)
        if rank == 0:
            print(f"saved {args.checkpoint}", flush=True)
    st = rt.stats()["distributed"]
    if rank == 0:
        print(f"collectives per rank: {st['all_gathers']} all-gathers "
              f"({st['all_gather_bytes'] / 2**20:.1f} MiB), {st['reduce_scatters']} "
              f"reduce-scatters ({st['reduce_scatter_bytes'] / 2**20:.1f} MiB)", flush=True)
    rt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
