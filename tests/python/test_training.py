"""tiermem training equals plain torch (same seed, same data)."""
import torch

import tiermem
from conftest import (END_TO_END_LOSS_REL, END_TO_END_PARAM_ATOL, END_TO_END_PARAM_RTOL,
                      KernelAdamW, assert_close_rel, batches, make_pair, model_bytes)


def train_ref(model, data, lr=1e-3, wd=0.01, clip=0.0, accum=1, groups=None, torch_adamw=False):
    """Plain torch training; the optimizer is KernelAdamW (torch.optim.AdamW's math in the
    tiermem kernel: engine tests then match bit for bit) or, with torch_adamw, torch's own."""
    params = groups if groups is not None else model.parameters()
    if torch_adamw:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    else:
        opt = KernelAdamW(params, lr=lr, weight_decay=wd, clip=clip)
        clip = 0.0
    losses = []
    for i in range(0, len(data), accum):
        opt.zero_grad()
        total = 0.0
        for x, y in data[i:i + accum]:
            loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses


def train_ours(model, opt, data, accum=1):
    losses = []
    for i in range(0, len(data), accum):
        opt.zero_grad()
        total = 0.0
        for x, y in data[i:i + accum]:
            loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
            opt.step()
        losses.append(total)
    return losses


def final_params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fp32_20_steps_quarter_budget_matches_torch_adamw():
    """Against torch.optim.AdamW itself: losses within 1e-6 relative at every step, final
    params within the documented end-to-end tolerance (see conftest.KernelAdamW)."""
    ref, ours = make_pair()
    budget = model_bytes(ref) // 4
    data = batches(20)
    ref_losses = train_ref(ref, data, torch_adamw=True)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget, "host": "1GiB",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    losses = train_ours(model, opt, data)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, END_TO_END_LOSS_REL, f"loss at step {i}")
    ref_sd, ours_sd = final_params(ref), final_params(model)
    for k in ref_sd:
        torch.testing.assert_close(ours_sd[k], ref_sd[k], rtol=END_TO_END_PARAM_RTOL,
                                   atol=END_TO_END_PARAM_ATOL, msg=k)


def test_each_step_equals_torch_adamw_on_the_same_state():
    """Every one of 20 steps: tiermem's update (fused kernel on chunks) equals
    torch.optim.AdamW applied to a copy of the same params, grads and moments, within the
    kernels' verified tolerance (rtol 1e-6, atol 1e-7, as test_kernels_vs_torch.py)."""
    ref, ours = make_pair()
    data = batches(20)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ref) // 4, "host": "1GiB",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    rt = tiermem.runtime_of(model)
    names = [r.name for r in rt.params]
    for x, y in data:
        opt.zero_grad()
        model(x, y).backward()
        before = {r.name: rt.param_value(r) for r in rt.params}
        grads = {r.name: r.param.grad.clone() for r in rt.params}  # p.grad: the chunk's values
        plain = [torch.nn.Parameter(before[n].clone()) for n in names]
        popt = torch.optim.AdamW(plain, lr=1e-3, weight_decay=0.01)
        popt.load_state_dict(opt.state_dict()) if opt.state_dict()["state"] else None
        for p, n in zip(plain, names):
            p.grad = grads[n]
        popt.step()
        opt.step()
        for p, r in zip(plain, rt.params):
            torch.testing.assert_close(rt.param_value(r), p.detach(), rtol=1e-6, atol=1e-7,
                                       msg=r.name)


def test_fp32_20_steps_quarter_budget_matches_plain_torch_exactly():
    ref, ours = make_pair()
    budget = model_bytes(ref) // 4
    data = batches(20)
    ref_losses = train_ref(ref, data)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget, "host": "1GiB",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    losses = train_ours(model, opt, data)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, 0, f"loss at step {i}")
    ref_sd = final_params(ref)
    ours_sd = final_params(model)
    assert ref_sd.keys() == ours_sd.keys()
    for k in ref_sd:
        assert_close_rel(ours_sd[k], ref_sd[k], 0, k)
    rt = tiermem.runtime_of(model)
    # Device use at every moment, replayed here from the binary timeline file's events.
    events = rt.timeline_events()
    ALLOC, FREE, BUDGET, DEVICE = 1, 2, 7, 0
    used, peak, cap, live = 0, 0, None, {}
    for ts, typ, tier, tier2, nbytes, chunk, cat, flags, label, rid in events:
        if tier != DEVICE:
            continue
        if typ == BUDGET:
            cap = nbytes
        elif typ == ALLOC:
            live[rid] = nbytes
            used += nbytes
            peak = max(peak, used)
            assert used <= cap, f"device use {used} > budget {cap} at t={ts}"
        elif typ == FREE:
            used -= live.pop(rid)
    assert cap == budget and 0 < peak <= budget and peak > budget // 2
    peaks = rt.timeline_peaks()  # tiermem::prof's report of the same file
    assert not peaks["over_budget"]
    assert peaks["peak"]["device"] == peak
    # The budget forced traffic: params were fetched more than once.
    assert rt.stats()["bytes_moved"].get("host->device", 0) > 2 * sum(
        p.numel() * 4 for p in ref.parameters())
