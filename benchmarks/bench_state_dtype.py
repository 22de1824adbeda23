"""Optimizer state in 8 bits (optimizer.state_dtype int8; docs/benchmarks.md, "Optimizer state in 8 bits"):
the kernel against our fp32 AdamW and bitsandbytes' CPU AdamW8bit, the training numerics
against AdamW8bit and fp32 AdamW, and the NVMe bytes per step of the main job.

    benchmarks/run.sh bench_state_dtype kernel   [--params N] [--threads 1,2] [--reps 3]
    benchmarks/run.sh bench_state_dtype numerics [--steps 50] [--long-steps 300]
    benchmarks/run.sh bench_state_dtype nvme     [--layers 12 --width 768] [--rounds 2]
        [--dtypes fp32,int8]

kernel: one process per thread count (OMP_NUM_THREADS and torch's threads set before torch and
bitsandbytes load): --params fp32 params in tensors of 4 Mi, stepped by (a) our fused AdamW with
fp32 state, (b) ours with int8 state (_C.adam_step on uint8 codes, block 256), (c)
bitsandbytes' AdamW8bit.step() (CPU backend, blockwise 256) — the same grads, timed in rounds
of a, b, c then c, b, a (median of each); params/s and the ratios. The roofline fraction of
our kernels (bytes they touch over the bandwidth probe's rate) is `tiermem bench adam`'s.

numerics: the repo's GPT (4 x 256, byte vocabulary, synthetic text) and a Hugging Face Llama
from a config (4 x 256, random init), --steps steps with the same seed, data and
hyper-parameters under tiermem int8 state (host mode), bitsandbytes' AdamW8bit, tiermem fp32
state and torch's AdamW: the largest relative loss difference per pair. Then --long-steps
steps of the GPT with tiermem int8 vs tiermem fp32 state: the final losses (mean of the last
10) and the curve every 25 steps.

nvme: the main job's model and budgets (GPT --layers x --width, host mode, --host of host
memory, NVMe for the rest) with fp32 and int8 state side by side, rounds alternating which
goes first; per round --steps steps each. Reported per system: NVMe bytes read and written per
step (the engine's counters), optimizer-state bytes among them, seconds per step; and the
int8 / fp32 ratios.

Prints a table, or JSON with --json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import child_env

HP = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# ---- kernel ---------------------------------------------------------------------------------

def kernel_one(params: int, threads: int, reps: int, tensor: int) -> dict:
    """One thread count, in this process (OMP_NUM_THREADS already set by the parent)."""
    import torch
    torch.set_num_threads(threads)
    import bitsandbytes as bnb
    from tiermem import _C
    sizes = [tensor] * (params // tensor) + ([params % tensor] if params % tensor else [])
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) * 1e-3 for s in sizes]

    # (a) ours, fp32 state; (b) ours, int8 state: per tensor, as the session steps its runs.
    def ours_state(int8):
        st = []
        for s in sizes:
            p = torch.full((s,), 0.5)
            if int8:
                blocks = -(-s // 256)
                st.append((p, torch.zeros(s, dtype=torch.uint8), torch.zeros(s, dtype=torch.uint8),
                           torch.zeros(blocks), torch.zeros(blocks)))
            else:
                st.append((p, torch.zeros(s), torch.zeros(s), None, None))
        return st

    state = {"fp32": ours_state(False), "int8": ours_state(True)}
    steps = {"fp32": 0, "int8": 0, "bnb8": 0}

    def ours(kind):
        steps[kind] += 1
        for (p, m, v, ma, va), gr in zip(state[kind], grads):
            kw = {} if ma is None else dict(exp_avg_absmax=ma, exp_avg_sq_absmax=va, state_block=256)
            _C.adam_step(p, gr, m, v, None, HP["lr"], 0.9, 0.999, HP["eps"], HP["weight_decay"],
                         steps[kind], **kw)

    bparams = [torch.nn.Parameter(torch.full((s,), 0.5)) for s in sizes]
    for p, gr in zip(bparams, grads):
        p.grad = gr
    bopt = bnb.optim.AdamW8bit(bparams, lr=HP["lr"], weight_decay=HP["weight_decay"],
                               min_8bit_size=0)
    assert all(torch.is_tensor(p.grad) for p in bparams)

    fns = {"fp32": lambda: ours("fp32"), "int8": lambda: ours("int8"), "bnb8": bopt.step}
    for f in fns.values():  # warm-up (allocates bnb's state)
        f()
    times = {k: [] for k in fns}
    order = ["fp32", "int8", "bnb8"]
    for r in range(reps):
        for k in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    state0 = bopt.state[bparams[0]]
    out = {"threads": threads, "params": params,
           "bnb_state": {"dtype": str(state0["state1"].dtype), "absmax": int(state0["absmax1"].numel())},
           "torch": torch.__version__, "bitsandbytes": bnb.__version__}
    for k, ts in times.items():
        out[k] = {"median_s": statistics.median(ts), "params_per_s": params / statistics.median(ts),
                  "times_s": ts}
    out["int8_over_fp32"] = out["int8"]["params_per_s"] / out["fp32"]["params_per_s"]
    out["int8_over_bnb8"] = out["int8"]["params_per_s"] / out["bnb8"]["params_per_s"]
    return out


def kernel(a) -> dict:
    runs = []
    for t in [int(x) for x in a.threads.split(",")]:
        env = child_env(dict(os.environ, OMP_NUM_THREADS=str(t), TIERMEM_CPU_THREADS=str(t)))
        cmd = [sys.executable, "-m", "benchmarks.bench_state_dtype", "_kernel_one",
               "--params", str(a.params), "--threads", str(t), "--reps", str(a.reps),
               "--tensor", str(a.tensor)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"kernel run failed:\n{r.stderr[-2000:]}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {"benchmark": "state_dtype kernel", "runs": runs}


# ---- numerics -------------------------------------------------------------------------------

def gpt_case(steps):
    import torch
    from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches
    c = GPTConfig()  # 4 x 256, vocabulary 256, context 64
    torch.manual_seed(0)
    model = GPT(c)
    data = list(synthetic_batches(c, 8, steps, seed=1))
    return model, data, lambda m, x, y: m(x, y)


def llama_case(steps):
    import torch
    import transformers
    from tiermem.examples.gpt import GPTConfig, synthetic_batches
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    data = list(synthetic_batches(GPTConfig(block_size=64), 8, steps, seed=1))
    return model, data, lambda m, x, y: m(input_ids=x, labels=y).loss


def train(model, opt, data, loss_fn):
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def run_system(name, make, steps, tmp):
    import torch
    import tiermem
    model, data, loss_fn = make(steps)
    if name.startswith("tiermem"):
        dtype = name.split("-")[1]
        cfg = {"device_kind": "host", "host": "1GiB", "optimizer": {
            "lr": HP["lr"], "betas": list(HP["betas"]), "eps": HP["eps"],
            "weight_decay": HP["weight_decay"], "state_dtype": dtype}}
        model, opt = tiermem.initialize(model, cfg)
    elif name == "bnb-adamw8bit":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(model.parameters(), **HP)
    else:
        opt = torch.optim.AdamW(model.parameters(), **HP)
    t0 = time.perf_counter()
    losses = train(model, opt, data, loss_fn)
    return losses, time.perf_counter() - t0


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def numerics(a) -> dict:
    import torch
    torch.set_num_threads(a.threads or torch.get_num_threads())
    out = {"benchmark": "state_dtype numerics", "steps": a.steps, "hyper": HP, "models": {}}
    tmp = tempfile.mkdtemp(prefix="tiermem-bench-state-")
    try:
        cases = {"gpt": gpt_case, "llama": llama_case}
        for mname in a.models.split(","):
            res = {}
            for sys_name in ("tiermem-int8", "bnb-adamw8bit", "tiermem-fp32", "torch-adamw"):
                losses, secs = run_system(sys_name, cases[mname], a.steps, tmp)
                res[sys_name] = {"losses": losses, "seconds": secs}
            L = {k: v["losses"] for k, v in res.items()}
            res["max_rel_diff"] = {
                "int8_vs_bnb8": max_rel(L["tiermem-int8"], L["bnb-adamw8bit"]),
                "fp32_vs_bnb8": max_rel(L["tiermem-fp32"], L["bnb-adamw8bit"]),
                "int8_vs_fp32": max_rel(L["tiermem-int8"], L["tiermem-fp32"]),
                "fp32_vs_torch": max_rel(L["tiermem-fp32"], L["torch-adamw"]),
            }
            out["models"][mname] = res
        if a.long_steps:
            long = {}
            for sys_name in ("tiermem-int8", "tiermem-fp32"):
                losses, secs = run_system(sys_name, gpt_case, a.long_steps, tmp)
                long[sys_name] = {"curve": {i: losses[i] for i in range(0, len(losses), 25)},
                                  "final": statistics.mean(losses[-10:]), "first": losses[0],
                                  "seconds": secs}
            long["final_rel_diff"] = (abs(long["tiermem-int8"]["final"] - long["tiermem-fp32"]["final"])
                                      / long["tiermem-fp32"]["final"])
            out["long"] = long
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---- nvme -----------------------------------------------------------------------------------

def nvme(a) -> dict:
    import torch
    import tiermem
    from benchmarks import bench_gpt
    if a.threads:
        torch.set_num_threads(a.threads)
    total = a.warmup + a.rounds * a.steps
    base, batches = bench_gpt(a.layers, a.width, 8, total)
    n = sum(p.numel() for p in base.parameters())
    root = a.dir or tempfile.mkdtemp(prefix="tiermem-bench-state-nvme-")
    systems = {}
    try:
        for dtype in a.dtypes.split(","):
            os.makedirs(f"{root}/{dtype}", exist_ok=True)
            cfg = {"device_kind": "host", "host": a.host,
                   "nvme": {"path": f"{root}/{dtype}", "size": a.nvme_size},
                   "optimizer": {"lr": 1e-4, "weight_decay": 0.01, "state_dtype": dtype}}
            model, opt = tiermem.initialize(copy.deepcopy(base), cfg)
            systems[dtype] = dict(model=model, opt=opt, rt=tiermem.runtime_of(model), data=iter(batches),
                                  times=[], nvme=[], state=[])
        del base

        def nvme_bytes(rt):
            st = rt.stats()
            moved = st["bytes_moved"]
            return (moved.get("host->nvme", 0) + moved.get("nvme->host", 0),
                    st["optimizer"]["nvme_state_bytes"])

        def steps(s, k, record):
            for _ in range(k):
                x, y = next(s["data"])
                b0, st0 = nvme_bytes(s["rt"])
                t0 = time.perf_counter()
                s["opt"].zero_grad()
                loss = s["model"](x, y)
                loss.backward()
                s["opt"].step()
                loss.item()
                dt = time.perf_counter() - t0
                b1, st1 = nvme_bytes(s["rt"])
                if record:
                    s["times"].append(dt)
                    s["nvme"].append(b1 - b0)
                    s["state"].append(st1 - st0)

        for s in systems.values():
            steps(s, a.warmup, False)
        order = list(systems)
        for r in range(a.rounds):
            for d in (order if r % 2 == 0 else order[::-1]):
                steps(systems[d], a.steps, True)
        out = {"benchmark": "state_dtype nvme", "params": n, "host": a.host,
               "layers": a.layers, "width": a.width, "steps_measured": a.rounds * a.steps}
        for d, s in systems.items():
            st = s["rt"].stats()["optimizer"]
            out[d] = {"nvme_bytes_per_step": statistics.median(s["nvme"]),
                      "nvme_state_bytes_per_step": statistics.median(s["state"]),
                      "seconds_per_step": statistics.median(s["times"]),
                      "state_bytes": st["state_bytes"], "state_bytes_fp32": st["state_bytes_fp32"],
                      "nvme_used": s["rt"].stats()["tiers"]["nvme"]["used"]}
        if "int8" in out and "fp32" in out:
            out["int8_over_fp32_nvme_bytes"] = (out["int8"]["nvme_bytes_per_step"] /
                                                out["fp32"]["nvme_bytes_per_step"])
            out["int8_over_fp32_step_time"] = (out["int8"]["seconds_per_step"] /
                                               out["fp32"]["seconds_per_step"])
        for s in systems.values():
            s["rt"].close()
        return out
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)


# ---- output ---------------------------------------------------------------------------------

def show(r):
    b = r["benchmark"]
    if b.endswith("kernel"):
        for run in r["runs"]:
            print(f"threads {run['threads']}, {run['params'] / 2**20:.0f} Mi params "
                  f"(torch {run['torch']}, bitsandbytes {run['bitsandbytes']}):")
            for k, label in (("fp32", "ours, fp32 state"), ("int8", "ours, int8 state"),
                             ("bnb8", "bitsandbytes AdamW8bit")):
                print(f"  {label:26s} {run[k]['params_per_s'] / 1e6:9.1f} Mparams/s")
            print(f"  int8 / fp32 = {run['int8_over_fp32']:.2f}x, "
                  f"int8 / bitsandbytes = {run['int8_over_bnb8']:.1f}x")
    elif b.endswith("numerics"):
        for m, res in r["models"].items():
            d = res["max_rel_diff"]
            print(f"{m} ({r['steps']} steps): final losses " +
                  ", ".join(f"{k} {v['losses'][-1]:.4f}" for k, v in res.items() if k != "max_rel_diff"))
            print("  max relative loss difference: " +
                  ", ".join(f"{k} {v:.2e}" for k, v in d.items()))
        if "long" in r:
            L = r["long"]
            print(f"gpt, {len(L['tiermem-int8']['curve']) * 25} steps: final (mean of last 10) "
                  f"int8 {L['tiermem-int8']['final']:.4f}, fp32 {L['tiermem-fp32']['final']:.4f}, "
                  f"relative difference {L['final_rel_diff']:.2e}")
            for i in L["tiermem-int8"]["curve"]:
                print(f"  step {i:4d}: int8 {L['tiermem-int8']['curve'][i]:.4f}  "
                      f"fp32 {L['tiermem-fp32']['curve'][i]:.4f}")
    else:
        print(f"GPT {r['layers']} x {r['width']} ({r['params'] / 1e6:.1f} M params), host "
              f"{r['host']}, {r['steps_measured']} steps measured per system:")
        for d in [d for d in ("fp32", "bf16", "int8") if d in r]:
            x = r[d]
            print(f"  {d}: NVMe {x['nvme_bytes_per_step'] / 1e9:.3f} GB/step (optimizer state "
                  f"{x['nvme_state_bytes_per_step'] / 1e9:.3f}), {x['seconds_per_step']:.2f} s/step, "
                  f"NVMe used {x['nvme_used'] / 2**30:.2f} GiB")
        if "int8_over_fp32_nvme_bytes" in r:
            print(f"  int8 / fp32: NVMe bytes {r['int8_over_fp32_nvme_bytes']:.3f}x, step time "
                  f"{r['int8_over_fp32_step_time']:.3f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel")
    k1 = sub.add_parser("_kernel_one")
    for p in (k, k1):
        p.add_argument("--params", type=int, default=32 * 2**20)
        p.add_argument("--reps", type=int, default=3)
        p.add_argument("--tensor", type=int, default=4 * 2**20)
    k.add_argument("--threads", default="1,2")
    k1.add_argument("--threads", type=int, default=1)
    n = sub.add_parser("numerics")
    n.add_argument("--steps", type=int, default=50)
    n.add_argument("--long-steps", type=int, default=300)
    n.add_argument("--models", default="gpt,llama")
    n.add_argument("--threads", type=int, default=0)
    v = sub.add_parser("nvme")
    v.add_argument("--layers", type=int, default=12)
    v.add_argument("--width", type=int, default=768)
    v.add_argument("--host", default="512MiB")
    v.add_argument("--nvme-size", default="4GiB")
    v.add_argument("--warmup", type=int, default=2)
    v.add_argument("--rounds", type=int, default=2)
    v.add_argument("--steps", type=int, default=2)
    v.add_argument("--threads", type=int, default=0)
    v.add_argument("--dir", default=None)
    v.add_argument("--dtypes", default="fp32,int8",
                   help="the systems, side by side (one: its own process, for models whose "
                        "two copies do not fit in RAM; NVMe bytes are deterministic)")
    for p in (k, n, v):
        p.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.what == "_kernel_one":
        print(json.dumps(kernel_one(a.params, a.threads, a.reps, a.tensor)))
        return 0
    r = {"kernel": kernel, "numerics": numerics, "nvme": nvme}[a.what](a)
    r["date"] = time.strftime("%Y-%m-%d")
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        show(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
