import copy
import os
import sys

import pytest

# Inductor compiles in this process, not in a pool of worker processes that each import torch
# first: on two cores shared with the other pytest worker the pool only adds its start-up (the
# one inductor test took ~170 s with it, ~45 s without). Set before torch is imported, so the
# processes the tests start inherit it too.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from tiermem.examples.gpt import GPT, GPTConfig, synthetic_batches

# The repository root, so the tests that run a benchmark (benchmarks/, outside the package)
# import it as `benchmarks.NAME` whatever directory pytest started in.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

torch.set_num_threads(1)


def encoder_lm(dropout=0.0):
    """torch's own nn.TransformerEncoder (4 layers of 64) with a Linear head, seed 3."""
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=dropout, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
                               torch.nn.Linear(64, 8))


class Encoder(torch.nn.Module):
    """torch's own nn.TransformerEncoder (2 layers of 64) with a Linear head and the loss;
    initialized from the caller's seed."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.enc(x)).flatten(0, 1),
                                                 y.flatten())


def encoder_batches(steps, batch=16, seq=32, device="cpu"):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(batch, seq, 64, generator=g).to(device),
             torch.randint(0, 8, (batch, seq), generator=g).to(device)) for _ in range(steps)]


def train_encoder(model, opt, data, seed=None):
    """encoder_lm's training loop; `seed` (dropout) is set first. Returns the losses."""
    if seed is not None:
        torch.manual_seed(seed)
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


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


class KernelAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's semantics computed by tiermem's fused CPU kernel (_C.adam_step), and
    global-norm clipping by its GradNormAndOverflow: the reference for tests of the *engine*
    (chunking, hooks, moves), which must then match bit for bit. The kernel itself equals
    torch.optim.AdamW per step within rtol 1e-6 (test_kernels_vs_torch.py and
    test_training.py::test_each_step_equals_torch_adamw_on_the_same_state); over 20 training
    steps those last-ulp differences grow (Adam normalises tiny gradients), so end-to-end
    comparisons with torch.optim.AdamW use the documented END_TO_END tolerances below."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 clip=0.0, state_dtype="fp32", min_elems=4096, block=256):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=False, maximize=False, foreach=None,
                                      capturable=False, differentiable=False, fused=None))
        self.clip = clip
        # state_dtype "int8": m and v of tensors from `min_elems` elements on as uint8 codes with
        # one absmax per `block` (the session's optimizer.state_dtype int8), the rest fp32.
        self.int8, self.min_elems, self.block = state_dtype == "int8", min_elems, block

    @torch.no_grad()
    def step(self, closure=None):
        from tiermem import _C
        clip = 1.0
        if self.clip:
            sq = 0.0
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        sq += _C.grad_stats(p.grad.contiguous().view(-1)).sq_norm
            total = torch.tensor(sq ** 0.5, dtype=torch.float32)
            clip = float(torch.clamp(self.clip / (total + 1e-6), max=1.0))
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                kw = {}
                if not st:
                    st["step"] = torch.tensor(0.0)
                    if self.int8 and p.numel() >= self.min_elems:
                        blocks = -(-p.numel() // self.block)
                        st["exp_avg"] = torch.zeros(p.numel(), dtype=torch.uint8)
                        st["exp_avg_sq"] = torch.zeros(p.numel(), dtype=torch.uint8)
                        st["absmax"] = (torch.zeros(blocks), torch.zeros(blocks))
                    else:
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                        st["exp_avg_sq"] = torch.zeros_like(p,
                                                            memory_format=torch.contiguous_format)
                if "absmax" in st:
                    kw = dict(exp_avg_absmax=st["absmax"][0], exp_avg_sq_absmax=st["absmax"][1],
                              state_block=self.block)
                st["step"] += 1
                _C.adam_step(p.data.view(-1), p.grad.contiguous().view(-1),
                             st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1), None,
                             float(g["lr"]), float(b1), float(b2), float(g["eps"]),
                             float(g["weight_decay"]), int(st["step"].item()), 1.0, clip, **kw)


# End-to-end (20 steps) vs torch.optim.AdamW itself: see KernelAdamW.
END_TO_END_LOSS_REL = 1e-6
END_TO_END_PARAM_RTOL, END_TO_END_PARAM_ATOL = 2e-5, 1e-5


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skips without one)")
    config.addinivalue_line("markers", "slow: benchmark-sized; run by scripts/test.sh --all "
                            "(before every update of docs/benchmarks.md), not by default")


def train_steps(model, opt, data):
    """Plain training loop over (x, y) batches of the repo's GPT (its forward returns the loss);
    returns the losses. Works for plain torch and tiermem models alike."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def chunk_total(config):
    """Every chunk byte (padding included) tiermem lays out for the conftest GPT under
    `config` (a probe session): budgets for optimizer-placement tests derive from it."""
    import tiermem
    _, probe = make_pair()
    m, _ = tiermem.initialize(probe, dict(config, device_kind="sim", device="64MiB"))
    rt = tiermem.runtime_of(m)
    total = rt.session.total_chunk_bytes
    rt.close()
    return total


def placement_budget(total, precision="fp32"):
    """A device budget holding every param and grad chunk and about half of the optimizer
    state. Chunk bytes per element — fp32: param 4, grad 4 | m 4, v 4; bf16/fp16: 2, 2 | m 4,
    v 4, master 4."""
    working = total // 2 if precision == "fp32" else total // 4
    return working + (total - working) // 2


def train_each_placement(config, data, budget):
    """Trains a fresh conftest GPT under `config` at `budget` once per optimizer_placement
    ('auto', 'host'); {placement: (losses, CPU state_dict, stats()['optimizer'] device groups,
    number of chunk groups, bytes_moved)}."""
    import tiermem
    runs = {}
    for placement in ("auto", "host"):
        _, ours = make_pair()
        model, opt = tiermem.initialize(ours, dict(config, device_kind="sim", device=budget,
                                                   optimizer_placement=placement))
        rt = tiermem.runtime_of(model)
        losses = train_steps(model, opt, data)
        st = rt.stats()
        assert not rt.timeline_peaks()["over_budget"]
        runs[placement] = (losses, {k: v.cpu() for k, v in model.state_dict().items()},
                           st["optimizer"]["device_groups"], rt.session.num_groups, st["bytes_moved"])
    return runs


def assert_placement_changes_nothing(runs):
    """Some groups but not all on the device with 'auto', none with 'host', and the same
    losses and parameters bit for bit."""
    losses, sd, placed, groups, _ = runs["auto"]
    assert 0 < len(placed) < groups, placed
    assert runs["host"][2] == []
    assert losses == runs["host"][0]
    for k, v in runs["host"][1].items():
        assert torch.equal(sd[k], v), k
