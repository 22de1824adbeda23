"""Sharded training benchmark (CPU, Gloo): the same GPT and global batch at 1, 2 and 4 ranks,
in rounds that alternate the world sizes, each rank a process of this machine with one torch
thread. Reports the median step time per world size (global batch per step) and, per rank and
iteration, the bytes moved by collectives against the ZeRO-3 ideal — every parameter
all-gathered twice (forward and backward) and every gradient reduce-scattered once, counted as
the full buffers' bytes (both sides of the ratio carry the same (N-1)/N factor of a ring).

    benchmarks/run.sh bench_distributed [--worlds 1,2,4] [--rounds 3] [--steps 6]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, args, out):
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    import tiermem
    from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=256, block_size=64, n_layer=args["layers"], n_head=4,
                  n_embd=args["width"])
    model = GPT(c)
    n_params = sum(p.numel() for p in model.parameters())
    m, opt = tiermem.initialize(model, {"device": max(n_params * 16 // 4, 4 << 20), "host": "1GiB",
                                        "device_kind": "sim", "optimizer": {"lr": 1e-3}})
    rt = tiermem.runtime_of(m)
    b = args["batch"] // world
    data = list(synthetic_batches(c, args["batch"], args["warmup"] + args["steps"], seed=1))
    times, losses = [], []
    before = None
    for i, (x, y) in enumerate(data):
        if i == args["warmup"]:
            before = dict(rt.stats().get("distributed", {}))
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = m(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        loss.backward()
        opt.step()
        if world > 1:
            dist.barrier()
        if i >= args["warmup"]:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    st = rt.stats().get("distributed", {})
    res = {"times": times, "params": n_params, "losses": losses,
           "chunk_bytes": rt.session.total_chunk_bytes}
    if world > 1:
        res["gather_bytes"] = (st["all_gather_bytes"] - before["all_gather_bytes"]) / args["steps"]
        res["scatter_bytes"] = ((st["reduce_scatter_bytes"] - before["reduce_scatter_bytes"])
                                / args["steps"])
        res["comm_s"] = (st["wait_seconds"] - before["wait_seconds"]) / args["steps"]
        dist.destroy_process_group()
    torch.save(res, os.path.join(out, f"{rank}.pt"))


def run_world(world, args):
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        # Forked from a forkserver that imported torch and tiermem once, as the tests' harness
        # (tests/python/dist_harness.py) does: a rank starts in well under a second instead of
        # a fresh interpreter importing torch for seconds (the times measured start after
        # init_process_group either way).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tiermem"])
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"bench_distributed: a rank of world {world} failed")
        return [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by each world)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    args = dict(steps=a.steps, warmup=a.warmup, layers=a.layers, width=a.width, batch=a.batch)
    worlds = [int(w) for w in a.worlds.split(",")]
    med = {w: [] for w in worlds}
    last = {}
    for rnd in range(a.rounds):
        for w in (worlds if rnd % 2 == 0 else worlds[::-1]):
            res = run_world(w, args)
            med[w].append(statistics.median(max(r["times"][i] for r in res)
                                            for i in range(len(res[0]["times"]))))
            last[w] = res
    n = last[worlds[0]][0]["params"]
    esize = 4
    ideal = 3 * n * esize  # params gathered twice, grads reduce-scattered once (full bytes)
    rows = []
    for w in worlds:
        row = {"world": w, "step_s": statistics.median(med[w]), "rounds": med[w],
               "chunk_bytes_per_rank": last[w][0]["chunk_bytes"],
               "losses_equal_rank0": last[w][0]["losses"]}
        if w > 1:
            r0 = last[w][0]
            row.update(gather_bytes=r0["gather_bytes"], scatter_bytes=r0["scatter_bytes"],
                       comm_s=r0["comm_s"],
                       vs_zero3_ideal=(r0["gather_bytes"] + r0["scatter_bytes"]) / ideal)
        rows.append(row)
    if a.json:
        print(json.dumps({"params": n, "rows": rows}))
        return 0
    print(f"GPT {a.layers} x {a.width}, {n / 1e6:.2f} M params, global batch {a.batch}, "
          f"device budget 1/4 of the model per rank, Gloo on this machine "
          f"({os.cpu_count()} cores), {a.rounds} rounds alternating world sizes, "
          f"{a.steps} steps after {a.warmup} warm-up")
    print("| ranks | step (s, median) | vs 1 rank | chunk bytes per rank | collective bytes per "
          "rank and iteration (gather + scatter) | vs ZeRO-3 ideal | waited on collectives / "
          "step |")
    print("|---|---|---|---|---|---|---|")
    base = rows[0]["step_s"]
    for r in rows:
        comm = (f"{(r['gather_bytes'] + r['scatter_bytes']) / 2**20:.1f} MiB "
                f"({r['gather_bytes'] / 2**20:.1f} + {r['scatter_bytes'] / 2**20:.1f})"
                if r["world"] > 1 else "")
        ratio = f"{r['vs_zero3_ideal']:.2f}" if r["world"] > 1 else ""
        ct = f"{r['comm_s'] * 1e3:.0f} ms" if r["world"] > 1 else ""
        print(f"| {r['world']} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | "
              f"{r['chunk_bytes_per_rank'] / 2**20:.1f} MiB | {comm} | {ratio} | {ct} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
