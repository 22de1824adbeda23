"""GPU benchmarks (run by scripts/gpu_check.sh on a GPU machine; exits 77 without a GPU).
Every comparison is measured in the same run, alternating, and reported as medians and ratios.

1. optimizer: tiermem's fused CUDA AdamW (the kernel device-placed chunk groups step with,
   ``_C.adam_step`` on CUDA tensors) against ``torch.optim.AdamW(fused=True)`` on the same 16 fp32
   tensors, and both against the device-to-device copy bandwidth (``copy_``, counted as read
   + write; AdamW moves 28 bytes per fp32 param: p, m, v, g read, p, m, v written).
2. training: the repo's GPT on CUDA with tiermem at a device budget of 25% of its training
   state (params + grads + AdamW m, v) against plain torch with ``AdamW(fused=True)`` with
   everything on the GPU; step times alternating by round, losses compared.

    benchmarks/run.sh bench_gpu [--json] [--params 268435456] [--layers 12 --width 768]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch


def _events_ms(fn, reps):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    out = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def bench_optimizer(params, tensors=16, rounds=5, reps=5):
    from tiermem import _C
    n = params // tensors
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda: [torch.randn(n, device=dev, generator=g) for _ in range(tensors)]  # noqa: E731
    p_t, p_o = mk(), None
    p_o = [t.clone() for t in p_t]
    grads = mk()
    m_o, v_o = [torch.zeros_like(t) for t in p_o], [torch.zeros_like(t) for t in p_o]
    torch_params = [torch.nn.Parameter(t) for t in p_t]
    for p, gr in zip(torch_params, grads):
        p.grad = gr
    topt = torch.optim.AdamW(torch_params, lr=1e-3, weight_decay=0.01, fused=True)
    step = [0]

    def ours():
        step[0] += 1
        s = torch.cuda.current_stream().cuda_stream
        for p, gr, m, v in zip(p_o, grads, m_o, v_o):
            _C.adam_step(p, gr, m, v, None, 1e-3, 0.9, 0.999, 1e-8, 0.01, step[0], stream=s)

    src = torch.empty(params, device=dev)
    dst = torch.empty_like(src)
    rows = []
    for _ in range(rounds):
        t_torch = _events_ms(topt.step, reps)
        t_ours = _events_ms(ours, reps)
        t_copy = _events_ms(lambda: dst.copy_(src), reps)
        rows.append((t_torch, t_ours, t_copy))
    t_torch = statistics.median(r[0] for r in rows)
    t_ours = statistics.median(r[1] for r in rows)
    t_copy = statistics.median(r[2] for r in rows)
    adam_bytes = 28 * params
    copy_bytes = 8 * params
    # Same inputs, same math: after the same number of steps the values agree closely.
    topt_step_err = max(((a - b).abs().max() / (b.abs().max() + 1e-12)).item()
                        for a, b in zip(p_o, [p.detach() for p in torch_params]))
    return {
        "params": params, "tensors": tensors, "rounds": rounds,
        "torch_fused_ms": t_torch, "tiermem_cuda_ms": t_ours,
        "tiermem_vs_torch_fused": t_torch / t_ours,
        "tiermem_GBps": adam_bytes / t_ours / 1e6, "torch_fused_GBps": adam_bytes / t_torch / 1e6,
        "d2d_copy_GBps": copy_bytes / t_copy / 1e6,
        "tiermem_fraction_of_d2d": (adam_bytes / t_ours) / (copy_bytes / t_copy),
        "max_rel_param_diff_vs_torch": topt_step_err,
    }


def bench_training(layers, width, batch, seq, steps, rounds):
    import tiermem
    from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8192, block_size=seq, n_layer=layers, n_head=max(1, width // 64),
                    n_embd=width)
    base = GPT(cfg)
    state = sum(p.numel() for p in base.parameters()) * 16
    data = [(x.cuda(), y.cuda()) for x, y in synthetic_batches(cfg, batch, steps * rounds + 2, 1)]
    ref = copy.deepcopy(base).cuda()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    model, opt = tiermem.initialize(copy.deepcopy(base), {
        "device": state // 4, "host": max(4 * state, 1 << 30), "device_kind": "cuda",
        "plan": "auto", "optimizer": {"lr": 1e-4, "weight_decay": 0.01}})
    rt = tiermem.runtime_of(model)

    def step(m, o, x, y):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o.zero_grad()
        loss = m(x, y)
        loss.backward()
        o.step()
        val = loss.item()
        torch.cuda.synchronize()
        return val, time.perf_counter() - t0

    for x, y in data[:2]:  # warm-up (and the plan's recorded iteration)
        step(ref, ropt, x, y)
        step(model, opt, x, y)
    ratios, t_ref, t_ours, rel = [], [], [], 0.0
    k = 2
    for r in range(rounds):
        a, b = [], []
        for _ in range(steps):
            x, y = data[k]
            k += 1
            lr_, tr = step(ref, ropt, x, y)
            lo, to = step(model, opt, x, y)
            a.append(tr)
            b.append(to)
            rel = max(rel, abs(lo - lr_) / max(abs(lr_), 1e-6))
        t_ref.append(statistics.median(a))
        t_ours.append(statistics.median(b))
        ratios.append(t_ours[-1] / t_ref[-1])
    st = rt.stats()
    return {
        "model": f"GPT {layers}x{width}, {sum(p.numel() for p in base.parameters())/1e6:.1f} M params",
        "training_state_bytes": state, "device_budget_bytes": state // 4,
        "plain_torch_step_s": statistics.median(t_ref), "tiermem_step_s": statistics.median(t_ours),
        "tiermem_vs_plain_torch": statistics.median(ratios), "round_ratios": ratios,
        "max_rel_loss_diff": rel, "device_groups": len(st["optimizer"]["device_groups"]),
        "groups": rt.session.num_groups, "stall_s_total": st["stall_ns"] / 1e9,
        "bytes_moved": st["bytes_moved"], "over_budget": rt.timeline_peaks()["over_budget"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--params", type=int, default=1 << 28)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["optimizer", "training"], default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no GPU (skipped)", file=sys.stderr)
        return 77
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.only in (None, "optimizer"):
        out["optimizer"] = bench_optimizer(args.params)
    if args.only in (None, "training"):
        out["training"] = bench_training(args.layers, args.width, args.batch, args.seq,
                                         args.steps, args.rounds)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
