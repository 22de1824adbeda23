"""activations: 'budget' — the tensors torch saves for backward count in the device budget
(chunks are evicted to make room for them; the timeline shows them as device `activation`
bytes), plans account for them, and activations that cannot fit are a clear MemoryError that
leaves the model as it was."""
import copy

import pytest
import torch

import tiermem
from conftest import KernelAdamW, batches, make_pair, model_bytes, train_steps


def config(budget, **kw):
    c = {"device": budget, "host": "64MiB", "activations": "budget",
         "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    c.update(kw)
    return c


def device_use_over_time(rt):
    """Replays the binary timeline: device bytes in use (chunks and activations) after every
    allocation, and the budget."""
    ALLOC, FREE, BUDGET, DEVICE = 1, 2, 7, 0
    used, cap, live, peak, act_peak = 0, None, {}, 0, 0
    ACTIVATION = None
    for ts, typ, tier, tier2, nbytes, chunk, cat, flags, label, rid in rt.timeline_events():
        if tier != DEVICE:
            continue
        if typ == BUDGET:
            cap = nbytes
        elif typ == ALLOC:
            used += nbytes - live.get(rid, 0)  # the activation region is re-allocated
            live[rid] = nbytes
            peak = max(peak, used)
            assert used <= cap, f"device use {used} > budget {cap} at t={ts}"
        elif typ == FREE:
            used -= live.pop(rid, 0)
    return peak, cap


def trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget):
    """Same losses and parameters as the reference, bit for bit, and the device budget held
    (report peak and at every allocation of the timeline). Returns (runtime, device activation
    peak, device peak over time)."""
    rt = tiermem.runtime_of(model)
    assert train_steps(model, opt, data) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    rep = rt.timeline_peaks()
    assert rep["peak"]["device"] <= budget and not rep["over_budget"], rep
    peak, cap = device_use_over_time(rt)  # chunks + activations at every allocation
    assert cap == budget and peak <= budget
    return rt, rep["category_peak"]["device"]["activation"], peak


@pytest.mark.parametrize("plan", ["off", "auto"])
def test_activations_in_the_budget_train_exactly_and_the_budget_holds(plan):
    ref, ours = make_pair()
    data = batches(10)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    budget = model_bytes(ref) // 4 + 500_000  # a quarter of the model data + its activations
    model, opt = tiermem.initialize(ours, config(budget, plan=plan))
    rt, act, peak = trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget)
    assert 300_000 < act < budget and act < peak
    if plan == "auto":
        p = rt.stats()["plan"]
        assert p["active"] and p["divergences"] == 0 and p["prefetches"] > 0, p
    # Without counting them the same budget leaves the chunks more room: fewer evictions.
    ref2, ours2 = make_pair()
    m2, o2 = tiermem.initialize(ours2, config(budget, plan=plan, activations="outside"))
    train_steps(m2, o2, data)
    assert tiermem.runtime_of(m2).stats()["evictions"] < rt.stats()["evictions"]


def raises_and_leaves_the_model_as_it_was(cfg, big_batch, steps, match):
    """A batch whose activations cannot fit raises MemoryError matching `match`; the model is
    unchanged, and training goes on with batches that fit, exactly as if the failed one never
    happened."""
    ref, ours = make_pair()
    small = batches(steps, batch=2)
    x, y = batches(1, batch=big_batch, seed=9)[0]
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             small)
    model, opt = tiermem.initialize(ours, cfg(ref))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    with pytest.raises(MemoryError, match=match):
        model(x, y).backward()
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert train_steps(model, opt, small) == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_activations_that_do_not_fit_raise_and_leave_the_model_as_it_was():
    raises_and_leaves_the_model_as_it_was(
        lambda ref: config(model_bytes(ref) // 4 + 200_000), 64, 6, r"device budget")


# ---- activations: 'offload' ----------------------------------------------------------------
def host_activation_peak(rt):
    return rt.timeline_peaks()["category_peak"]["host"]["activation"]


@pytest.mark.parametrize("plan", ["off", "auto"])
def test_activations_larger_than_the_device_budget_are_offloaded_and_train_exactly(plan):
    ref, ours = make_pair()
    data = batches(8, batch=32)  # 3.5 MB of saved activations per step
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    budget = 2_400_000  # below the activations alone (and than chunks + activations)
    model, opt = tiermem.initialize(ours, config(budget, plan=plan, activations="offload",
                                                 host="256MiB"))
    rt, act, _ = trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget)
    assert 0 < act < budget
    assert host_activation_peak(rt) > 1_000_000
    st = rt.stats()["activations"]
    assert st["offloaded_bytes"] == st["fetched_bytes"] > 8 * 1_000_000, st
    if plan == "auto":
        p = rt.stats()["plan"]
        assert p["active"] and p["divergences"] == 0 and p["followed_iterations"] >= 4, p
    # Counted but not offloaded, the same budget cannot hold them.
    ref2, ours2 = make_pair()
    m2, o2 = tiermem.initialize(ours2, config(budget, plan=plan, host="256MiB"))
    with pytest.raises(MemoryError, match=r"activations.*'offload' moves them to the host"):
        train_steps(m2, o2, data[:1])


def test_offload_to_a_full_host_budget_raises_and_leaves_the_model_as_it_was():
    raises_and_leaves_the_model_as_it_was(
        lambda ref: config(2_400_000, activations="offload", host=2_000_000), 32, 4,
        r"does not fit the host budget")


def test_offloaded_activations_of_torch_modules_match_plain_torch():
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    ref = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
                              torch.nn.Linear(64, 8))
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(16, 32, 64, generator=g), torch.randint(0, 8, (16, 32), generator=g))
            for _ in range(5)]

    def loop(model, opt):
        out = []
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    want = loop(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01))
    nbytes = sum(p.numel() for p in ref.parameters()) * 16
    model, opt = tiermem.initialize(ours, config(nbytes // 2 + 1_000_000, activations="offload",
                                                 host="256MiB"),
                                    units=[torch.nn.TransformerEncoderLayer, torch.nn.Linear])
    rt = tiermem.runtime_of(model)
    assert loop(model, opt) == want
    assert rt.stats()["activations"]["offloaded_bytes"] > 0
    assert not rt.timeline_peaks()["over_budget"]


def test_the_activation_offload_benchmark_runs_and_holds_the_budget(capsys):
    from tiermem.examples import bench_activations
    assert bench_activations.main(["--layers", "2", "--width", "64", "--block", "64", "--batch",
                                   "8", "--steps", "5", "--device", "3MiB", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["activation_bytes_per_step"] > 3 * 2 ** 20  # more than the device budget
    assert out["budget_mode"].startswith("tiermem: the activations")
    for m in ("offload-auto", "offload-off"):
        d = out["device_peak"][m]
        assert not d["over_budget"] and d["chunks_and_activations"] <= 3 * 2 ** 20, d
        assert out["offloaded_bytes_per_step"][m] > 0
    assert out["loss_max_rel_diff_vs_torch"] < 1e-5


class _Block(torch.nn.Module):
    def __init__(self, what):
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)
        self.what = what

    def forward(self, x):
        y = self.lin(x).sigmoid()  # sigmoid saves its output, linear its input and weight
        if self.what == "activation":
            y.mul_(2)
        elif self.what == "weight":
            with torch.no_grad():
                self.lin.weight.mul_(0.5)
        return y


class _Stack(torch.nn.Module):
    def __init__(self, what):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(what if i == 2 else "") for i in range(6)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


@pytest.mark.parametrize("what", ["activation", "weight"])
@pytest.mark.parametrize("acts", ["outside", "budget", "offload"])
def test_in_place_changes_to_saved_tensors_raise_as_in_torch(acts, what):
    # torch skips its version check for tensors that pass through saved-tensor hooks; the
    # hooks check it instead, so tiermem raises where torch does instead of using the
    # modified values (a silently wrong gradient).
    torch.manual_seed(0)
    ref = _Stack(what)
    ours = copy.deepcopy(ref)
    x = torch.randn(32, 256)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(x).backward()
    model, opt = tiermem.initialize(ours, config(3_000_000, activations=acts, host="64MiB"))
    assert not tiermem.runtime_of(model)._resident
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).backward()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_offloaded_low_precision_activations_give_the_same_losses(precision):
    # Mixed precision saves bf16/fp16 tensors: offloaded and back, byte for byte, so the run
    # equals the same run with activations outside the budget.
    data = batches(5, batch=32)
    runs = {}
    for acts, budget in (("outside", 1_200_000), ("offload", 1_200_000)):
        _, ours = make_pair()
        model, opt = tiermem.initialize(ours, config(budget, activations=acts, host="256MiB",
                                                     precision=precision))
        runs[acts] = train_steps(model, opt, data)
        if acts == "offload":
            st = tiermem.runtime_of(model).stats()["activations"]
            assert st["offloaded_bytes"] > 0, st
    assert runs["offload"] == runs["outside"]
