import copy

import pytest
import torch

from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches

torch.set_num_threads(1)


def small_config(**kw):
    c = dict(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32)
    c.update(kw)
    return GPTConfig(**c)


def model_bytes(model):
    # params + grads + AdamW m and v, fp32
    return sum(p.numel() for p in model.parameters()) * 16


def make_pair(seed=0, **kw):
    torch.manual_seed(seed)
    ref = GPT(small_config(**kw))
    ours = copy.deepcopy(ref)
    return ref, ours


def batches(steps, batch=4, seed=1, **kw):
    return list(synthetic_batches(small_config(**kw), batch, steps, seed))


def assert_close_rel(a, b, rel=1e-6, what=""):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    denom = torch.clamp(b.abs(), min=1e-12)
    err = ((a - b).abs() / torch.maximum(denom, torch.full_like(denom, 1e-3))).max().item()
    assert err <= rel, f"{what}: max relative error {err:.3g} > {rel}"
