"""tiermem training equals plain torch (same seed, same data)."""
import torch

import tiermem
from conftest import assert_close_rel, batches, make_pair, model_bytes


def train_ref(model, data, lr=1e-3, wd=0.01, clip=0.0, accum=1, groups=None):
    opt = torch.optim.AdamW(groups if groups is not None else model.parameters(), lr=lr,
                            weight_decay=wd)
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
    ref, ours = make_pair()
    budget = model_bytes(ref) // 4
    data = batches(20)
    ref_losses = train_ref(ref, data)
    model, opt = tiermem.initialize(ours, {"device": budget, "host": "1GiB",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    losses = train_ours(model, opt, data)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, 1e-6, f"loss at step {i}")
    ref_sd = final_params(ref)
    ours_sd = final_params(model)
    assert ref_sd.keys() == ours_sd.keys()
    for k in ref_sd:
        assert_close_rel(ours_sd[k], ref_sd[k], 1e-6, k)
    rt = tiermem.runtime_of(model)
    peaks = rt.timeline_peaks()
    assert not peaks["over_budget"]
    assert 0 < peaks["peak"]["device"] <= budget
    # The budget forced traffic: params were fetched more than once.
    assert rt.stats()["bytes_moved"].get("host->device", 0) > 2 * sum(
        p.numel() * 4 for p in ref.parameters())
