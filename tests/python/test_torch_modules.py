"""Standard torch modules and tricky access patterns train exactly like plain torch.

Each test trains three copies of one model on the same data for >= 10 steps, tiermem's at a
device budget below the model's data:
- plain torch with torch.optim.AdamW: tiermem's losses agree within 1e-5 relative;
- plain torch with KernelAdamW (torch.optim.AdamW's math computed by tiermem's fused kernel,
  conftest.py): tiermem's losses and final parameters are *bit-identical* — everything the
  engine does (chunks, units, hooks, moves, p.grad views) is exact. (Against torch's AdamW the
  parameters differ by the kernels' last-ulp rounding, which Adam turns into lr-sized steps
  on parameters whose true gradient is zero, like the attention key bias: no tolerance on
  those would be meaningful.)
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import tiermem
from conftest import (END_TO_END_PARAM_ATOL, END_TO_END_PARAM_RTOL, KernelAdamW,
                      assert_close_rel)

LOSS_REL = 1e-5
STEPS = 10
VOCAB, SEQ, WIDTH = 64, 12, 32


def data(steps=STEPS, batch=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((x, (x + 1) % VOCAB))  # learnable: predict the next token id
    return out


def lm_loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def data_bytes(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * 16


def budget_for(model, frac):
    """`frac` of the model's data, but at least the minimum device budget (4 chunks holding
    the largest tensor, params + grads)."""
    largest = max(p.numel() for p in model.parameters())
    return max(int(data_bytes(model) * frac), 4 * 8 * largest)


def train(model, opt, batches, clip=None):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


def check_equal_training(make_model, budget_frac=0.5, units=None, steps=STEPS, clip=None,
                         **cfg):
    torch.manual_seed(0)
    ref = make_model()
    exact = copy.deepcopy(ref)
    ours = copy.deepcopy(ref)
    batches = data(steps)
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01),
                       batches, clip)
    exact_losses = train(exact, KernelAdamW(exact.parameters(), lr=3e-3, weight_decay=0.01),
                         batches, clip)
    config = {"device_kind": "sim", "device": budget_for(ours, budget_frac), "host": "256MiB",
              "optimizer": {"lr": 3e-3, "weight_decay": 0.01}}
    config.update(cfg)
    model, opt = tiermem.initialize(ours, config, units=units)
    losses = train(model, opt, batches, clip)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, LOSS_REL, f"loss at step {i} vs torch.optim.AdamW")
    assert losses == exact_losses, "losses must equal the same AdamW math on plain torch"
    assert losses[-1] < losses[0], "the model must learn"
    exact_sd, sd = exact.state_dict(), model.state_dict()
    assert set(exact_sd) == set(sd)
    for k in exact_sd:
        torch.testing.assert_close(sd[k], exact_sd[k], rtol=0, atol=0, msg=k)
    rt = tiermem.runtime_of(model)
    assert not rt.timeline_peaks()["over_budget"]
    return model, rt


class MhaLM(nn.Module):
    """nn.MultiheadAttention reads self.out_proj.weight inside its own forward."""

    def __init__(self, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.attn = nn.ModuleList(nn.MultiheadAttention(WIDTH, 4, batch_first=True)
                                  for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for a in self.attn:
            h = h + a(h, h, h, attn_mask=mask, need_weights=False)[0]
        return self.head(self.norm(h))


@pytest.mark.parametrize("frac", [0.5, 4.0], ids=["moving", "resident"])
def test_multihead_attention_trains_exactly(frac):
    model, rt = check_equal_training(MhaLM, budget_frac=frac)
    assert rt._resident == (frac > 1)


def test_everything_fits_means_nothing_moves_after_the_first_step():
    """Resident training: once the optimizer state has joined the params and grads on the
    device, a training step moves no bytes between tiers (per the engine's counters and the
    timeline)."""
    torch.manual_seed(0)
    model, opt = tiermem.initialize(MhaLM(), {"device_kind": "sim", "device": "64MiB", "host": "256MiB"})
    rt = tiermem.runtime_of(model)
    assert rt._resident
    batches = data(4)
    train(model, opt, batches[:1])
    before = dict(rt.stats()["bytes_moved"])
    copied = dict(rt.timeline_peaks()["copied"])
    train(model, opt, batches[1:])
    assert rt.stats()["bytes_moved"] == before
    assert rt.timeline_peaks()["copied"] == copied


class EncoderLM(nn.Module):
    def __init__(self, layers=4, norm_first=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # enable_nested_tensor with norm_first
            self.enc = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.enc(self.emb(x), mask=mask, is_causal=True))


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_trains_exactly(norm_first):
    model, rt = check_equal_training(lambda: EncoderLM(4, norm_first), budget_frac=0.4)
    # Each encoder layer is a unit (the default: blocks of a repeated ModuleList).
    names = [u.name for u in rt.units]
    assert [f"enc.layers.{i}" for i in range(4)] == [n for n in names if n.startswith("enc.")]


def test_transformer_encoder_eval_fast_path_equals_plain():
    """In eval under no_grad nn.TransformerEncoderLayer takes torch's fused fast path, which
    reads every weight of the layer at once."""
    torch.manual_seed(0)
    ref = EncoderLM(3).eval()
    model, _ = tiermem.initialize(copy.deepcopy(ref), {"device_kind": "sim", "device": budget_for(ref, 0.5),
                                                       "host": "256MiB"})
    model.eval()
    x = data(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(model.enc(model.emb(x)), ref.enc(ref.emb(x)), rtol=0, atol=0)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH),
                                                  nn.GELU()) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter in two modules

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def test_tied_embeddings_train_exactly_as_one_parameter():
    model, rt = check_equal_training(TiedLM)
    assert model.head.weight is model.emb.weight
    assert len(rt.params) == len(list(model.parameters()))


class WeightNormLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH)) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.head(h)


def test_weight_norm_parametrization_trains_exactly():
    model, _ = check_equal_training(WeightNormLM)
    # The parametrization's originals are the managed parameters.
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.0.parametrizations.weight.original0" in names


class ParentReads(nn.Module):
    """Reads its child's parameters directly instead of calling the child."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, h):
        return h + torch.relu(h @ self.child.weight.t() + self.child.bias) * self.scale


class ParentLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(ParentReads() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_parameter_read_in_its_parents_forward_trains_exactly():
    check_equal_training(ParentLM)


class RootReads(nn.Module):
    """The root reads a leaf module's weight outside any unit (a hand-written tied head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return h @ self.emb.weight.t()


def test_read_outside_every_unit_is_materialized_on_demand_exactly_with_a_warning():
    with pytest.warns(UserWarning, match=r"parameter 'emb.weight' was read by aten"):
        check_equal_training(RootReads)


@pytest.mark.parametrize("resident", [False, True], ids=["moving", "resident"])
def test_read_outside_every_unit_is_a_clear_error_in_strict_mode(resident):
    torch.manual_seed(0)
    model = RootReads()
    before = copy.deepcopy(model.state_dict())
    budget = "64MiB" if resident else budget_for(model, 0.5)
    model, opt = tiermem.initialize(model, {"device_kind": "sim", "device": budget, "host": "64MiB",
                                            "unmaterialized_reads": "error"})
    rt = tiermem.runtime_of(model)
    assert rt._resident == resident
    pins = [rt.session.pins(g, rt._compute_kind) for g in range(rt.session.num_groups)]
    x, y = data(1)[0]
    with pytest.raises(RuntimeError, match=r"parameter 'emb.weight' was read by aten\.\w+.* "
                                           r"inside the forward of RootReads, outside every "
                                           r"unit.*units="):
        model(x)
    # The failed forward left nothing pinned and nothing changed.
    assert [rt.session.pins(g, rt._compute_kind) for g in range(rt.session.num_groups)] == pins
    assert all(p == (1 if resident else 0) for p in pins)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_units_override_by_class_covers_the_reader():
    """units=[RootReads]: the whole model is one unit, so the root's read is materialized."""
    model, rt = check_equal_training(RootReads, units=[RootReads], budget_frac=1.0,
                                     unmaterialized_reads="error")
    assert [u.name for u in rt.units] == [""]


class UsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.shared = nn.ModuleList([nn.Linear(WIDTH, WIDTH)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        h = h + torch.tanh(self.shared[0](h))
        h = h + torch.tanh(self.shared[0](h))  # the same module (and unit) twice
        return self.head(h)


def test_module_used_twice_per_forward_trains_exactly():
    check_equal_training(UsedTwice, budget_frac=0.3)


def test_frozen_layer_and_bf16_buffers():
    def make():
        m = MhaLM()
        m.emb.weight.requires_grad_(False)
        return m
    model, rt = check_equal_training(make)
    assert model.emb.weight.grad is None
    assert not model.emb.weight.requires_grad


def test_reading_a_parameter_outside_forward_gives_its_true_value():
    """EMA, logging, parameters_to_vector: plain torch code on model.parameters()."""
    torch.manual_seed(0)
    ref = ParentLM()
    model, opt = tiermem.initialize(copy.deepcopy(ref), {"device_kind": "sim", "device": budget_for(ref, 0.5),
                                                         "host": "256MiB"})
    ema = [p.detach().clone() for p in ref.parameters()]
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    for g in opt.param_groups:
        g["lr"] = 3e-3
    ours_ema = [p.detach().clone() for p in model.parameters()]
    for x, y in data(4):
        for m, o in ((ref, ropt), (model, opt)):
            o.zero_grad()
            lm_loss(m(x), y).backward()
            o.step()
        with torch.no_grad():
            for e, p in zip(ema, ref.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            for e, p in zip(ours_ema, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
    for a, b in zip(ours_ema, ema):
        torch.testing.assert_close(a, b, rtol=END_TO_END_PARAM_RTOL, atol=END_TO_END_PARAM_ATOL)
    v = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.testing.assert_close(v, torch.nn.utils.parameters_to_vector(ref.parameters()),
                               rtol=END_TO_END_PARAM_RTOL, atol=END_TO_END_PARAM_ATOL)
    # Never a zero placeholder: every parameter reads non-zero.
    assert all(p.abs().sum().item() > 0 for p in model.parameters())
    # A write outside forward lands in the chunk and is what the next forward computes with.
    with torch.no_grad():
        model.head.bias.fill_(0.5)
        ref.head.bias.fill_(0.5)
    x = data(1, seed=7)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-5)
    assert torch.equal(model.head.bias, torch.full((VOCAB,), 0.5))


def test_deepcopy_data_copy_and_close_give_ordinary_tensors():
    torch.manual_seed(0)
    orig = ParentLM()
    params_before = list(orig.parameters())
    model, opt = tiermem.initialize(orig, {"device_kind": "sim", "device": budget_for(orig, 0.5), "host": "256MiB"})
    x, y = data(1)[0]
    opt.zero_grad()
    lm_loss(model(x), y).backward()
    opt.step()
    # A deep copy is an ordinary module holding the current values (an EMA snapshot).
    snap = copy.deepcopy(model)
    assert all(type(p) is nn.Parameter for p in snap.parameters())
    from tiermem.runtime import _Forward
    assert not any(isinstance(m.__dict__.get("forward"), _Forward) for m in snap.modules())
    assert getattr(snap, "_tiermem_runtime", None) is None
    with torch.no_grad():
        assert torch.equal(snap(x), model(x))
        for p in snap.parameters():
            p.zero_()  # the copy is independent
        assert not torch.equal(snap(x), model(x))
    # p.data.copy_ writes through to the chunk.
    with torch.no_grad():
        model.head.weight.data.copy_(torch.full_like(model.head.weight, 0.01))
    assert torch.equal(model.head.weight, torch.full((VOCAB, WIDTH), 0.01))
    with pytest.raises(RuntimeError, match="keeps its torch.float32 shape"):
        model.head.weight.data = torch.zeros(3)
    # close(): the user's own Parameter objects come back, with the trained values.
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    tiermem.runtime_of(model).close()
    assert list(model.parameters()) == params_before
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, values[n]), n
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
