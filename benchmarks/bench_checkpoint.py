"""Checkpoint benchmark (CPU): tiermem.save_checkpoint / load_checkpoint of the main job's
model (GPT 12 x 768, 85 M params, 1.3 GiB of fp32 params + AdamW state) trained with a host
budget far below that (NVMe holds the rest), against the plain-torch way of saving the same
state (torch.save of model.state_dict() and optimizer.state_dict(), which materializes it all
in RAM), same run. Reports seconds, GB/s of checkpoint bytes and the RSS growth of each: the
highest VmRSS sampled every 5 ms during the operation minus VmRSS just before it (each
measurement runs in its own fresh process).

    benchmarks/run.sh bench_checkpoint [--dir DIR] [--layers 12] [--width 768]

`--xl`: the main job's `--size xl` model instead (width 2304, enough layers that params + grads
+ AdamW state exceed this machine's RAM; device 1 GiB, host 4 GiB, the rest on NVMe in
`--dir`), one round of save and load only: `torch.save` of its state dicts would need the whole
fp32 state in RAM at once, more than the machine has.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, threading, time, torch, tiermem
from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches
mode, d, layers, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
budgets = json.loads(sys.argv[5])
cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=width // 64, n_embd=width)
torch.manual_seed(0)
model, opt = tiermem.initialize(GPT(cfg), {"device": budgets["device"], "host": budgets["host"],
                                           "nvme": {"size": budgets["nvme"], "path": d + "/nvme"}})
for x, y in synthetic_batches(cfg, 2, 1, 1):
    opt.zero_grad(); model(x, y).backward(); opt.step()
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
base = rss()
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
th = threading.Thread(target=sample, daemon=True)
th.start()
path = d + "/ckpt.safetensors"
t0 = time.perf_counter()
if mode == "save":
    tiermem.save_checkpoint(model, opt, path)
elif mode == "load":
    tiermem.load_checkpoint(model, opt, path)
elif mode == "torch_save":
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, d + "/ckpt.pt")
    os.sync()
dt = time.perf_counter() - t0
done.set(); th.join()
size = os.path.getsize(path if mode != "torch_save" else d + "/ckpt.pt")
print(json.dumps({"mode": mode, "s": dt, "bytes": size, "rss_growth": peak[0] - base,
                  "rss_before": base}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--xl", action="store_true", help="the main job's --size xl model")
    a = ap.parse_args(argv)
    budgets = {"device": "128MiB", "host": "512MiB", "nvme": "4GiB"}
    if a.xl:
        import math

        from tiermem.examples.train_gpt import mem_total_bytes
        a.width = 2304
        per_layer = 12 * a.width * a.width + 13 * a.width
        a.layers = math.ceil(mem_total_bytes() * 1.05 / (16 * per_layer))
        state = 16 * (a.layers * per_layer + (256 + 64) * a.width + 2 * a.width)
        budgets = {"device": "1GiB", "host": "4GiB", "nvme": str(int(state * 1.1))}
        a.rounds = 1
        print(f"xl: GPT {a.layers} x {a.width}, params + grads + AdamW {state / 2**30:.1f} GiB, "
              f"RAM {mem_total_bytes() / 2**30:.1f} GiB, host budget 4 GiB", flush=True)
    d = tempfile.mkdtemp(prefix="tiermem-bench-ckpt-", dir=a.dir)
    rows = []
    try:
        for r in range(a.rounds):
            modes = ["save", "load", "torch_save"] if r % 2 == 0 else ["torch_save", "save", "load"]
            if a.xl:
                modes = ["save", "load"]
            for mode in modes:
                out = subprocess.run([sys.executable, "-c", CHILD, mode, d, str(a.layers),
                                      str(a.width), json.dumps(budgets)],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"round {r + 1} {mode:10s}: {row['s']:.2f} s, "
                      f"{row['bytes'] / row['s'] / 1e9:.2f} GB/s of {row['bytes'] / 2**30:.2f} GiB,"
                      f" RSS +{row['rss_growth'] / 2**20:.0f} MiB "
                      f"(process at {row['rss_before'] / 2**20:.0f} MiB before)", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
