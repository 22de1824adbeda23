"""tiermem vs DeepSpeed vs plain torch on the same GPT and data, in the same run (CPU).

Each system trains in its own process (DeepSpeed owns process-wide state), round after round
in alternating order (ABBA), on the main job's model (GPT 12 x 768, 85 M params, batch 8 x
64) with gradient clipping off (DeepSpeed clips at 1.0 by default) and the same AdamW:

  plain torch             torch.optim.AdamW(fused=True), everything in RAM
  tiermem main-job        host 512 MiB, NVMe (a temp dir) for the rest
  tiermem host            host 8 GiB, no NVMe (DeepSpeed's CPU-offload terms)
  (both in host mode without a GPU, what `auto` picks: compute on the CPU against the chunks
  in host memory; with a GPU, a device budget of 128 MiB)
  DeepSpeed ZeRO-3 CPU    stage 3, params and optimizer state offloaded to CPU RAM (unbounded)
  DeepSpeed ZeRO-Inf      stage 3, params in CPU RAM, optimizer state on NVMe (libaio; the
                          row is skipped when DeepSpeed's async_io op cannot be built)

DeepSpeed is not a dependency of tiermem: point --deepspeed at a directory holding it
(``pip install --no-deps --target DIR deepspeed==0.19.8 hjson py-cpuinfo msgpack
nvidia-ml-py einops``; ZeRO-Inf also needs Debian's libaio-dev), or its rows are skipped. Its
CPU ops build the first time (minutes, cached in ~/.cache/torch_extensions).

    benchmarks/run.sh bench_deepspeed --deepspeed ~/.cache/tiermem/deepspeed
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks import child_env

SYSTEMS = ["plain", "tiermem-main-job", "tiermem-host", "ds-zero3-cpu", "ds-zero-inf"]


def _worker(system, steps, warmup, layers, width, nvme_dir, port):
    import time
    import torch
    from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches
    torch.manual_seed(0)
    c = GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=max(1, width // 64),
                  n_embd=width)
    model = GPT(c)
    data = list(synthetic_batches(c, 8, warmup + steps, seed=1))
    if system == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        fwd = lambda x, y: model(x, y)  # noqa: E731
        bwd = lambda loss: loss.backward()  # noqa: E731

        def step():
            opt.step()
            opt.zero_grad()
    elif system.startswith("tiermem"):
        import tiermem
        from benchmarks import tier_config
        # Without a GPU, auto runs host mode (compute on the CPU against host memory; no device
        # budget); with one, the device budget is 128 MiB.
        cfg = tier_config("auto", "128MiB", "512MiB" if system == "tiermem-main-job" else "8GiB")
        cfg["optimizer"] = {"lr": 1e-4, "weight_decay": 0.01}
        if system == "tiermem-main-job":
            cfg["nvme"] = {"path": nvme_dir, "size": "4GiB"}
        model, opt = tiermem.initialize(model, cfg)
        fwd = lambda x, y: model(x, y)  # noqa: E731
        bwd = lambda loss: loss.backward()  # noqa: E731

        def step():
            opt.step()
            opt.zero_grad()
    else:
        os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import deepspeed
        zero = {"stage": 3, "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"}}
        if system == "ds-zero-inf":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
        cfg = {"train_batch_size": 8, "gradient_clipping": 0, "zero_optimization": zero,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
        if system == "ds-zero-inf":
            cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                          "overlap_events": True}
        deepspeed.init_distributed(dist_backend="gloo")
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=cfg)
        fwd = lambda x, y: eng(x, y)  # noqa: E731
        bwd = lambda loss: eng.backward(loss)  # noqa: E731
        step = eng.step
    times, losses = [], []
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        loss = fwd(x, y)
        bwd(loss)
        step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(dt)
    import resource
    return {"times": times, "losses": losses,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run(system, args, nvme_dir, port):
    code = ("import json, sys; from benchmarks.bench_deepspeed import _worker; "
            f"print('RESULT ' + json.dumps(_worker({system!r}, {args.steps}, {args.warmup}, "
            f"{args.layers}, {args.width}, {nvme_dir!r}, {port})))")
    env = child_env()
    if system.startswith("ds-"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.deepspeed,
                                                          env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{system} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def available(args):
    systems = list(SYSTEMS)
    if not args.deepspeed or not os.path.isdir(os.path.join(args.deepspeed, "deepspeed")):
        print("bench_deepspeed: no DeepSpeed (--deepspeed DIR): its rows are skipped")
        return [s for s in systems if not s.startswith("ds-")]
    probe = subprocess.run(
        [sys.executable, "-c", "import os; os.environ['DS_ACCELERATOR']='cpu'; "
         "from deepspeed.ops.op_builder import AsyncIOBuilder; "
         "print(AsyncIOBuilder().is_compatible(verbose=False))"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=args.deepspeed))
    if "True" not in probe.stdout:
        print("bench_deepspeed: DeepSpeed's async_io op cannot be built here (libaio-dev?): "
              "the ZeRO-Infinity row is skipped")
        systems.remove("ds-zero-inf")
    return systems


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed", default=os.path.expanduser("~/.cache/tiermem/deepspeed"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--systems", default=None, help="comma-separated subset of " + ",".join(SYSTEMS))
    args = ap.parse_args(argv)
    systems = available(args)
    if args.systems:
        systems = [s for s in systems if s in args.systems.split(",")]
    med = {s: [] for s in systems}
    last = {}
    for rnd in range(args.rounds):
        for i, s in enumerate(systems if rnd % 2 == 0 else systems[::-1]):
            nvme_dir = tempfile.mkdtemp(prefix="tiermem-bench-ds-")
            try:
                r = run(s, args, nvme_dir, 29800 + rnd * 10 + i)
            finally:
                shutil.rmtree(nvme_dir, ignore_errors=True)
            med[s].append(statistics.median(r["times"]))
            last[s] = r
    base = "plain" if "plain" in systems else systems[0]
    print(f"GPT {args.layers} x {args.width}, batch 8 x 64, {args.rounds} rounds (ABBA) of "
          f"{args.steps} steps after {args.warmup} warm-up; clipping off; AdamW lr 1e-4")
    print("| system | step (s, median of rounds) | vs plain torch (per-round ratio: median, "
          "min-max) | max RSS | losses (first, last) |")
    print("|---|---|---|---|---|")
    for s in systems:
        ratios = [a / b for a, b in zip(med[s], med[base])]
        ls = last[s]["losses"]
        print(f"| {s} | {statistics.median(med[s]):.2f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {last[s]['max_rss_gib']:.1f} GiB | "
              f"{ls[0]:.4f}, {ls[-1]:.4f} |")
    # Issue 32's goals: tiermem against DeepSpeed at the matching budgets, per round.
    for ours, theirs in (("tiermem-host", "ds-zero3-cpu"), ("tiermem-main-job", "ds-zero-inf")):
        if ours in med and theirs in med:
            r = [a / b for a, b in zip(med[ours], med[theirs])]
            print(f"{ours} / {theirs}: {statistics.median(r):.3f} (per round: "
                  + ", ".join(f"{x:.3f}" for x in r) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
