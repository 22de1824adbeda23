"""Executed plans (config plan: always, and auto where its bar is under test): the session
records a warm-up iteration, plans it and executes the plan; the values are exactly those of
plain torch (a plan moves copies, never values), the plan really runs (planned prefetches and
evictions, iterations followed), budgets hold, and dynamic control flow leaves the plan for
that iteration only, warned once."""
import copy

import pytest
import torch
from torch import nn

import tiermem
from benchmarks import objective_bytes
from conftest import KernelAdamW, batches, make_pair, model_bytes, train_steps

pytest.importorskip("transformers")
import test_hf as hf_models  # noqa: E402  (the same HF models, data and loop as test_hf.py)


def config(budget, plan="always", nvme_dir=None, host="256MiB"):
    c = {"device_kind": "sim", "device": budget, "host": host, "plan": plan,
         "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    if nvme_dir is not None:
        c["nvme"] = {"path": str(nvme_dir), "size": "256MiB"}
    return c


def device_in(stats):
    """Bytes copied into the device so far (from the host and from NVMe)."""
    return objective_bytes(stats, host_mode=False)


def check_plan_ran(rt, steps, divergences=0):
    p = rt.stats()["plan"]
    assert p["error"] == "" and p["active"], p
    assert p["plans"] == 1, p
    assert p["divergences"] == divergences, p
    # Recorded at step 3, executed from step 4: steps - 3 iterations, the last still open.
    assert p["planned_iterations"] == steps - 3, p
    assert p["followed_iterations"] == steps - 4 - divergences, p
    assert p["prefetches"] >= steps - 3 and p["evictions"] > 0, p
    assert not rt.timeline_peaks()["over_budget"]
    return p


@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_gpt_with_a_plan_equals_plain_torch_bit_for_bit(nvme, tmp_path):
    ref, ours = make_pair()
    data = batches(12)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    budget = model_bytes(ref) // 4
    # With NVMe, a host budget that holds the params and grads but not all of m and v.
    host = model_bytes(ref) * 3 // 4 if nvme else "256MiB"
    model, opt = tiermem.initialize(ours, config(budget, nvme_dir=tmp_path if nvme else None,
                                                 host=host))
    rt = tiermem.runtime_of(model)
    assert train_steps(model, opt, data) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    check_plan_ran(rt, len(data))
    if nvme:
        assert rt.stats()["bytes_moved"].get("nvme->host", 0) > 0


@pytest.mark.parametrize("device", ["52MiB", "60MiB"])
def test_executed_plan_moves_the_bytes_it_predicted_with_activations_in_the_budget(device):
    # The 2%: a GPT with tied embeddings, six large chunk groups and its activations
    # counted in a device budget that holds the chunks only with evictions in the backward.
    # The bytes into the device per planned step equal the plan's prediction. (Before the
    # backward released a unit's chunks when it moved on, the tied embedding's chunk stayed
    # pinned from the head's backward to the embedding's: the plan evicted it there, the
    # engine evicted another chunk instead and fetched it back — 10-12% over the prediction.)
    from benchmarks import bench_gpt
    base, data = bench_gpt(12, 256, 2, 7, block=64)
    model, opt = tiermem.initialize(base, {"device_kind": "sim", "device": device, "host": "1GiB",
                                           "activations": "budget", "plan": "always",
                                           "chunk_size": 1_600_000,
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    rt = tiermem.runtime_of(model)

    measured = []
    for x, y in data:
        before = device_in(rt.stats())
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        measured.append(device_in(rt.stats()) - before)
    p = rt.stats()["plan"]
    assert p["active"] and p["divergences"] == 0 and p["followed_iterations"] >= 3, p
    predicted = p["predicted_device_in_bytes"]
    assert predicted > 0
    for m in measured[-3:]:  # planned steps
        assert abs(m - predicted) <= 0.02 * predicted, (measured, predicted)


class EncoderLM(nn.Module):
    """torch's own nn.TransformerEncoder (nn.MultiheadAttention inside) as a tiny LM."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, x, y):
        h = self.head(self.enc(self.emb(x)))
        return nn.functional.cross_entropy(h.reshape(-1, h.shape[-1]), y.reshape(-1))


def token_batches(steps, vocab=64, seq=12, batch=4):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((x, (x + 1) % vocab))
    return out


def test_torch_transformer_encoder_with_a_plan_equals_plain_torch():
    torch.manual_seed(0)
    ref = EncoderLM()
    ours = copy.deepcopy(ref)
    data = token_batches(10)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    model, opt = tiermem.initialize(ours, config(model_bytes(ref) // 3))
    assert train_steps(model, opt, data) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    check_plan_ran(tiermem.runtime_of(model), len(data))


@pytest.mark.parametrize("make", [hf_models.gpt2, hf_models.llama], ids=["gpt2", "llama"])
def test_hf_models_with_a_plan_equal_plain_torch(make):
    torch.manual_seed(0)
    ref = make()
    ours = copy.deepcopy(ref)
    data = hf_models.batches(10)
    ref_losses = hf_models.train(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                                 data)
    model, opt = tiermem.initialize(ours, config(hf_models.budget(ours)))
    assert hf_models.train(model, opt, data) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    check_plan_ran(tiermem.runtime_of(model), len(data))


class Branchy(nn.Module):
    """Dynamic control flow: every third call skips the middle block."""

    def __init__(self, width=48):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(4))
        self.out = nn.Linear(width, 1)
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i == 2 and self.calls % 3 == 1:
                continue
            h = h + b(h)
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def train_branching(cls, steps, capfd=None):
    """Trains `cls` under tiermem at a third of its bytes (plan: always) beside plain torch:
    the losses and the final state equal torch's. Returns the runtime."""
    torch.manual_seed(0)
    ref = cls()
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, generator=g))
            for _ in range(steps)]
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    largest = max(p.numel() for p in ours.parameters())
    model, opt = tiermem.initialize(ours, config(max(model_bytes(ref) // 3, 36 * largest)))
    if capfd is not None:
        capfd.readouterr()
    assert train_steps(model, opt, data) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    return tiermem.runtime_of(model)


def test_dynamic_control_flow_leaves_the_plan_for_that_iteration_only(capfd):
    rt = train_branching(Branchy, 11, capfd)
    # Steps 1, 4, 7 and 10 branch; the plan recorded at step 3 runs from step 4 on, and
    # steps 4, 7 and 10 leave it.
    p = check_plan_ran(rt, 11, divergences=3)
    assert "blocks.2" in p["last_divergence"], p
    err = capfd.readouterr().err
    assert err.count("left the plan") == 1, err  # warned once


class Wandering(Branchy):
    """Skips a different block every step (a cycle of 4): every iteration leaves a plan made
    from another one."""

    def forward(self, x, y):
        self.calls += 1
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i == self.calls % 4:
                continue
            h = h + b(h)
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def test_iterations_that_keep_leaving_their_plans_stop_the_planning():
    p = train_branching(Wandering, 16).stats()["plan"]
    assert p["plans"] == 4 and not p["active"], p  # PlanRunner::kMaxPlans
    assert "keep leaving their plans (4 plans made" in p["declined"], p
    assert p["error"] == "", p


def test_auto_declines_a_plan_that_would_move_more_than_the_reactive_engine():
    # At a quarter of this model's bytes on SimDevice the planner's plan moves 239616 bytes
    # into the device per step where the reactive engine moves 221184: plan: auto (the
    # default) measures the engine over the recorded third step and keeps it; "always" runs
    # the plan anyway. The values are the same in all three.
    ref, _ = make_pair()
    data = batches(9)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    per_step = {}
    for plan in ("off", "auto", "always"):
        _, ours = make_pair()
        model, opt = tiermem.initialize(ours, config(model_bytes(ours) // 4, plan=plan))
        rt = tiermem.runtime_of(model)
        assert train_steps(model, opt, data[:6]) == ref_losses[:6]
        steps = []
        for k in range(6, 9):
            before = device_in(rt.stats())
            assert train_steps(model, opt, data[k:k + 1]) == ref_losses[k:k + 1]
            steps.append(device_in(rt.stats()) - before)
        # The fewest of three steps: SimDevice's copies complete on their lane's thread, so
        # which chunks are still in flight when the reactive engine picks what to move depends
        # on timing, and now and then a step moves one chunk more (CI saw 227328 for 221184,
        # about once in a hundred steps); the steady step is the least.
        per_step[plan] = min(steps)
        p = rt.stats()["plan"]
        if plan == "auto":
            assert not p["active"] and p["plans"] == 0 and p["error"] == "", p
            assert p["declined"].startswith("the plan would move "), p
            assert "bytes per iteration into the device, the reactive engine moved" in \
                p["declined"], p
        elif plan == "always":
            assert p["active"] and p["declined"] == "" and p["followed_iterations"] >= 4, p
    assert per_step["auto"] == per_step["off"] < per_step["always"], per_step


def test_plan_off_executes_nothing_and_bad_values_are_refused():
    ref, ours = make_pair()
    with pytest.raises(ValueError, match="plan"):
        tiermem.initialize(copy.deepcopy(ours), config(model_bytes(ref) // 4, plan="yes"))
    model, opt = tiermem.initialize(ours, config(model_bytes(ref) // 4, plan="off"))
    train_steps(model, opt, batches(6))
    p = tiermem.runtime_of(model).stats()["plan"]
    assert p["plans"] == 0 and p["prefetches"] == 0 and not p["active"], p
