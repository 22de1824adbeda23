"""bf16 and fp16 (dynamic loss scaling) training vs plain torch with an fp32 master.

The reference is autocast-free: a torch model whose params are bf16/fp16 copies of fp32
master params, the masters updated by torch.optim.AdamW from the low-precision grads (fp16:
scaled loss, overflow -> step skipped and scale halved, growth every `growth_interval` good
steps), then copied back (round to nearest even). tiermem keeps the low-precision params and
grads in chunks on the device tier and the master + m + v on host, updated by the fused kernel.
Tolerances (docs/python.md): losses within 1e-2 relative, masters within rtol 1e-3 / atol 1e-4
after 20 steps: the kernel and torch's AdamW differ in the last ulp, and one flipped rounding
of a bf16/fp16 param changes the next forward by that format's resolution (2^-8 / 2^-11).
"""
import copy

import pytest
import torch

import tiermem
from conftest import batches, make_pair, model_bytes

LOSS_REL = 1e-2
MASTER_RTOL, MASTER_ATOL = 1e-3, 2e-4
N_EMBD = 32  # conftest.small_config


def key_bias(name):
    # The attention key bias has an exactly zero true gradient (softmax is shift-invariant);
    # its low-precision grad is rounding noise that Adam normalises into ~lr-sized steps of
    # random sign, so it is not comparable between two implementations. Checked separately.
    return slice(N_EMBD, 2 * N_EMBD) if name.endswith("attn.qkv.bias") else None


def train_ref_mixed(model, data, dtype, lr=1e-3, wd=0.01, scale=None, growth_interval=2000):
    names = [n for n, _ in model.named_parameters()]
    master = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    low = copy.deepcopy(model).to(dtype)
    lp = dict(low.named_parameters())
    opt = torch.optim.AdamW([master[n] for n in names], lr=lr, weight_decay=wd)
    losses, skipped, good = [], 0, 0
    for x, y in data:
        for p in low.parameters():
            p.grad = None
        loss = low(x, y)
        (loss * scale if scale else loss).backward()
        grads = [lp[n].grad for n in names]
        if scale and any(not torch.isfinite(g).all() for g in grads if g is not None):
            scale *= 0.5
            good = 0
            skipped += 1
        else:
            for n in names:
                g = lp[n].grad
                master[n].grad = None if g is None else g.float() * (1.0 / scale if scale else 1.0)
            opt.step()
            with torch.no_grad():
                for n in names:
                    lp[n].copy_(master[n])
            if scale:
                good += 1
                if good >= growth_interval:
                    scale *= 2.0
                    good = 0
        losses.append(loss.item())
    return losses, {n: master[n].detach() for n in names}, skipped, scale


def train_ours_mixed(model, opt, data, scaled):
    losses, skipped = [], 0
    for x, y in data:
        opt.zero_grad()
        loss = model(x, y)
        (opt.scale_loss(loss) if scaled else loss).backward()
        opt.step()
        skipped += opt.last_step_skipped
        losses.append(loss.item())
    return losses, skipped


def check(losses, ref_losses, model, ref_master):
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= LOSS_REL * abs(b), f"loss at step {i}: {a} vs {b}"
    sd = model.state_dict()  # the fp32 masters
    for k, v in ref_master.items():
        assert sd[k].dtype == torch.float32
        got = sd[k].clone()
        kb = key_bias(k)
        if kb is not None:
            # Bounded by Adam's step size: |update| <= ~lr per step, 20 steps.
            assert (got[kb] - v[kb]).abs().max() <= 2 * 20 * 1e-3
            got[kb] = v[kb]
        torch.testing.assert_close(got, v, rtol=MASTER_RTOL, atol=MASTER_ATOL, msg=k)


def test_bf16_20_steps_quarter_budget_matches_fp32_master_reference():
    ref, ours = make_pair()
    data = batches(20)
    ref_losses, ref_master, _, _ = train_ref_mixed(ref, data, torch.bfloat16)
    budget = model_bytes(ref) // 4
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": budget, "host": "1GiB", "precision": "bf16",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    rt = tiermem.runtime_of(model)
    losses, _ = train_ours_mixed(model, opt, data, scaled=False)
    check(losses, ref_losses, model, ref_master)
    assert losses[-1] < losses[0]
    # Device chunks hold bf16: half the bytes of fp32 per element.
    K = tiermem._C.ChunkKind
    assert rt.session.chunk_bytes(0, K.param_lowp) * 2 == rt.session.chunk_bytes(0, K.param_fp32)
    # The session says each kind's element size (the binding never re-derives it).
    sizes = {k: rt.session.element_size(k) for k in (K.param_lowp, K.grad, K.param_fp32,
                                                     K.exp_avg, K.exp_avg_sq)}
    assert sizes == {K.param_lowp: 2, K.grad: 2, K.param_fp32: 4, K.exp_avg: 4, K.exp_avg_sq: 4}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    peaks = rt.timeline_peaks()
    assert not peaks["over_budget"] and 0 < peaks["peak"]["device"] <= budget


def test_fp16_dynamic_loss_scaling_skips_overflow_steps_like_the_reference():
    ref, ours = make_pair()
    data = batches(20)
    # 2^20 overflows fp16 (max 65504) at first: steps are skipped and the scale halves until
    # the scaled loss fits; growth_interval 4 then doubles it again (and overflows again).
    ref_losses, ref_master, ref_skipped, ref_scale = train_ref_mixed(
        ref, data, torch.float16, scale=float(2 ** 20), growth_interval=4)
    model, opt = tiermem.initialize(ours, {
        "device_kind": "sim", "device": model_bytes(ref) // 4, "host": "1GiB", "precision": "fp16",
        "loss_scaling": {"initial_scale": 2 ** 20, "growth_interval": 4},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    losses, skipped = train_ours_mixed(model, opt, data, scaled=True)
    assert ref_skipped >= 5  # the test exercises skipping
    assert skipped == ref_skipped
    assert opt.loss_scale == ref_scale
    check(losses, ref_losses, model, ref_master)


def test_bad_precision_is_a_clear_error():
    _, ours = make_pair()
    with pytest.raises(ValueError, match="precision"):
        tiermem.initialize(ours, {"precision": "fp8"})
