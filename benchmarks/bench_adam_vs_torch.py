"""CPU AdamW: tiermem's fused kernels against torch's strongest CPU AdamW in one process,
alternating rep by rep (ours, torch, torch, ours, ...) so both see the same memory bandwidth
(these machines are noisy: the per-pair ratios' median is the result).

  fp32   ours: one AdamStep per tensor (_C.adam_step)  vs  torch.optim.AdamW(fused=True)
  mixed  the whole mixed-precision step on fp32 masters with a bf16 model copy:
         ours: the overflow/norm pass (_C.grad_stats) over the loss-scaled grads, then one
         AdamStep per tensor that unscales, clips to a global norm of 1, updates and writes
         the bf16 copy; torch: GradScaler's unscale-and-check
         (torch._amp_foreach_non_finite_check_and_unscale_), clip_grad_norm_(1.0,
         foreach=True), AdamW(fused=True), torch._foreach_copy_ to the bf16 weights.

Same params (--params, split into --tensor-size tensors), same hyper-parameters, same thread
count for both (torch.set_num_threads and the kernels' threads). Ours runs once per --pools
entry per round (torch = our tiles on torch's intra-op threads, the default when called from
torch's thread; own = the kernels' oneTBB pool), rotating the order with torch's run.

    benchmarks/run.sh bench_adam_vs_torch [--params 67108864] [--threads 1,2]
        [--reps 7] [--pools torch,own]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiermem import _C

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
SCALE = 1024.0


def tensors(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.rand(s, generator=g) - 0.5) for s in sizes]
    for p in ps:
        p.grad = (torch.rand(p.numel(), generator=g) - 0.5) * 1e-2
    return ps


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--tensor-size", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pools", default="torch,own",
                    help="where our kernels run their tiles, each measured alternating with "
                         "torch: torch = torch's intra-op threads (the default), own = oneTBB")
    a = ap.parse_args(argv)
    sizes = [a.tensor_size] * (a.params // a.tensor_size)
    print(f"{a.params / 2**20:.0f} Mi params in {len(sizes)} tensors; torch {torch.__version__}; "
          f"kernel isa {_C.kernel_isa()}")
    for threads in [int(t) for t in a.threads.split(",")]:
        torch.set_num_threads(threads)
        _C.set_kernel_threads(threads)
        # fp32
        ours_p = tensors(sizes, 1)
        ours_m = [torch.zeros_like(p) for p in ours_p]
        ours_v = [torch.zeros_like(p) for p in ours_p]
        step = [0]

        def ours_fp32():
            step[0] += 1
            for p, m, v in zip(ours_p, ours_m, ours_v):
                _C.adam_step(p.data, p.grad, m, v, None, LR, B1, B2, EPS, WD, step[0])

        tp = tensors(sizes, 1)
        topt = torch.optim.AdamW(tp, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)
        # mixed
        mp = tensors(sizes, 2)
        for p in mp:
            p.grad.mul_(SCALE)  # as a loss-scaled backward leaves them
        mm = [torch.zeros_like(p) for p in mp]
        mv = [torch.zeros_like(p) for p in mp]
        mlow = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in mp]
        mstep = [0]

        def ours_mixed():
            mstep[0] += 1
            sq, overflow = 0.0, False
            for p in mp:
                s, o = _C.grad_stats(p.grad)
                sq += s
                overflow |= o
            if overflow:
                return
            norm = sq ** 0.5 / SCALE
            clip = min(1.0, 1.0 / (norm + 1e-6))
            for p, m, v, low in zip(mp, mm, mv, mlow):
                _C.adam_step(p.data, p.grad, m, v, low, LR, B1, B2, EPS, WD, mstep[0],
                             1.0 / SCALE, clip)

        tq = tensors(sizes, 2)
        tgrads = [p.grad for p in tq]
        for g in tgrads:
            g.mul_(SCALE)
        tlow = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in tq]
        qopt = torch.optim.AdamW(tq, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)
        found = torch.zeros(())
        # Alternate the unscale factor so the grads stay bounded over the reps (the same work).
        inv = [torch.full((), 1.0 / SCALE), torch.full((), SCALE)]
        flip = [0]

        def torch_mixed():
            flip[0] ^= 1
            torch._amp_foreach_non_finite_check_and_unscale_(tgrads, found, inv[flip[0] ^ 1])
            torch.nn.utils.clip_grad_norm_(tq, 1.0, foreach=True)
            qopt.step()
            torch._foreach_copy_(tlow, [p.detach() for p in tq])

        pools = a.pools.split(",")
        for name, ours, theirs in (("fp32 AdamW", ours_fp32, topt.step),
                                   ("mixed step", ours_mixed, torch_mixed)):
            ours(), theirs()  # warm-up (torch allocates its state)
            runs = {p: [] for p in pools}
            tt = []
            fns = [(p, ours) for p in pools] + [(None, theirs)]
            for r in range(a.reps):
                # Rotate which goes first; each of ours is paired with the torch run of its round.
                for pool, fn in fns[r % len(fns):] + fns[:r % len(fns)]:
                    if pool is not None:
                        _C.set_kernel_pool(pool)
                    t0 = time.perf_counter()
                    fn()
                    (runs[pool] if pool is not None else tt).append(time.perf_counter() - t0)
            _C.set_kernel_pool("torch")
            n = a.params
            for pool in pools:
                to = runs[pool]
                ratio = statistics.median(b / o for o, b in zip(to, tt))
                print(f"threads {threads} {name} [{pool} pool]: ours "
                      f"{n / statistics.median(to) / 1e6:7.1f} Mparams/s, torch "
                      f"{n / statistics.median(tt) / 1e6:7.1f} Mparams/s, ours/torch (paired "
                      f"median) {ratio:.3f}x", flush=True)


if __name__ == "__main__":
    main()
