"""torch.optim.AdamW(foreach=True) on CPU: the baseline of `tiermem bench adam`.

Prints one JSON object as its last line: params_per_s (median of --reps timed steps after one
warm-up), seconds, threads, torch_version. Params are split into tensors of --tensor-size
elements (a model's layers), fp32, grads fixed.
"""
import argparse
import json
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=67108864)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tensor-size", type=int, default=4 * 1024 * 1024)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    sizes = [a.tensor_size] * (a.params // a.tensor_size)
    if a.params % a.tensor_size:
        sizes.append(a.params % a.tensor_size)
    params = []
    for s in sizes:
        p = torch.nn.Parameter(torch.full((s,), 0.5))
        p.grad = torch.linspace(-1, 1, s)
        params.append(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    opt.step()  # warm-up; allocates the state
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    print(json.dumps({"params_per_s": a.params / med, "seconds": times, "threads": a.threads,
                      "torch_version": torch.__version__, "foreach": True}))


if __name__ == "__main__":
    main()
