"""torch's CPU AdamW: the baselines of `tiermem bench adam`.

Measures, over --params fp32 params split into tensors of --tensor-size elements (a model's
layers), with the same thread count:
  fused     torch.optim.AdamW(fused=True): torch's strongest CPU AdamW (the headline baseline)
  foreach   torch.optim.AdamW(foreach=True), for reference
  mixed     torch's sequence for one mixed-precision step, the same work as tiermem's one-pass
            step: GradScaler's unscale (torch._amp_foreach_non_finite_check_and_unscale_, which
            also checks for inf/NaN), clip_grad_norm_(1.0, foreach=True), fused AdamW on the
            fp32 masters, and the copy of the updated masters to the bf16 model weights
            (torch._foreach_copy_)
Each: the median of --reps timed steps after one warm-up. Prints one JSON object as its last
line: {"fused": params/s, "foreach": ..., "mixed": ..., "threads", "torch_version"}.
"""
import argparse
import json
import time

import torch


def make(sizes, lowp=False):
    params, low = [], []
    for s in sizes:
        p = torch.nn.Parameter(torch.full((s,), 0.5))
        p.grad = torch.linspace(-1, 1, s)
        params.append(p)
        if lowp:
            low.append(torch.empty(s, dtype=torch.bfloat16))
    return params, low


def timed(step, reps):
    step()  # warm-up; allocates the state
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=67108864)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tensor-size", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--impls", default="fused,foreach,mixed")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    sizes = [a.tensor_size] * (a.params // a.tensor_size)
    if a.params % a.tensor_size:
        sizes.append(a.params % a.tensor_size)
    out = {"threads": a.threads, "torch_version": torch.__version__, "params": a.params}
    for impl in a.impls.split(","):
        params, low = make(sizes, lowp=impl == "mixed")
        if impl == "foreach":
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
            step = opt.step
        elif impl == "fused":
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
            step = opt.step
        elif impl == "mixed":
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
            grads = [p.grad for p in params]
            found_inf = torch.zeros(())
            scales = [torch.full((), 0.5), torch.full((), 2.0)]  # alternate: grads stay bounded
            state = {"i": 0}

            def step():
                state["i"] ^= 1
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                                 scales[state["i"]])
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                opt.step()
                torch._foreach_copy_(low, [p.detach() for p in params])
        else:
            raise SystemExit(f"unknown impl {impl}")
        out[impl] = a.params / timed(step, a.reps)
        del params, low
    print(json.dumps(out))


if __name__ == "__main__":
    main()
