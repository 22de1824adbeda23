"""activations: 'budget' — the tensors torch saves for backward count in the device budget
(chunks are evicted to make room for them; the timeline shows them as device `activation`
bytes), plans account for them, and activations that cannot fit are a clear MemoryError that
leaves the model as it was."""
import copy

import pytest
import torch

import tiermem
from conftest import (KernelAdamW, batches, encoder_batches, encoder_lm, make_pair,
                      model_bytes, train_encoder, train_steps)


def config(budget, **kw):
    c = {"device_kind": "sim", "device": budget, "host": "64MiB", "activations": "budget",
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


@pytest.mark.parametrize("plan", ["off", "always"])
def test_activations_in_the_budget_train_exactly_and_the_budget_holds(plan):
    ref, ours = make_pair()
    data = batches(10)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    budget = model_bytes(ref) // 4 + 500_000  # a quarter of the model data + its activations
    model, opt = tiermem.initialize(ours, config(budget, plan=plan))
    rt, act, peak = trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget)
    assert 300_000 < act < budget and act < peak
    if plan == "always":
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


@pytest.mark.parametrize("plan", ["off", "always"])
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
    if plan == "always":
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


# ---- offload with the host budget short: spilled to NVMe -------------------------------------
def nvme_activation_peak(rt):
    return rt.timeline_peaks()["category_peak"]["nvme"].get("activation", 0)


@pytest.mark.parametrize("plan", ["off", "always"])
def test_offload_spills_to_nvme_what_the_host_cannot_hold_and_trains_exactly(plan, tmp_path):
    # The host budget of the test above that 'offload' without NVMe refuses
    # (test_offload_to_a_full_host_budget_raises...): with an NVMe tier the activations the
    # host cannot take go there through a host bounce, and come back in the backward. Bit for
    # bit the reference; every budget held (device over time, host and NVMe peaks).
    ref, ours = make_pair()
    data = batches(8, batch=32)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    budget, host = 2_400_000, 2_500_000
    model, opt = tiermem.initialize(ours, config(
        budget, plan=plan, activations="offload", host=host,
        nvme={"path": str(tmp_path), "size": "64MiB"}))
    rt, act, _ = trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget)
    st = rt.stats()["activations"]
    assert st["spilled_bytes"] > 8 * 1_000_000, st
    assert st["offloaded_bytes"] == st["fetched_bytes"] >= st["spilled_bytes"], st
    peaks = rt.timeline_peaks()
    assert nvme_activation_peak(rt) > 1_000_000, peaks["category_peak"]["nvme"]
    assert peaks["peak"]["host"] <= host and not peaks["over_budget"], peaks
    # Nothing stays behind on NVMe between steps: the spilled regions went back.
    assert tiermem.runtime_of(model)._act_spilled == []


def test_offload_to_full_host_and_nvme_budgets_raises_and_leaves_the_model_as_it_was(tmp_path):
    # An NVMe tier with room for the model's chunks only (its homes), none for activations.
    raises_and_leaves_the_model_as_it_was(
        lambda ref: config(2_400_000, activations="offload", host=2_500_000,
                           nvme={"path": str(tmp_path), "size": "4MiB"}), 64, 4,
        r"fits neither the host budget .* nor the NVMe tier")


def test_a_spill_that_reads_back_other_bytes_raises_instead_of_training_on_them(tmp_path):
    # The NVMe file overwritten between the forward and the backward (a failing disk, or
    # another process): the backward raises the tier's checksum error, never hands autograd
    # the wrong bytes. Params and grads all live on the host here (only some optimizer state
    # is on NVMe, read by the next step): the backward's NVMe reads are the spills'.
    import os
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, config(
        2_400_000, activations="offload", host=2_500_000,
        nvme={"path": str(tmp_path), "size": "64MiB"}))
    rt = tiermem.runtime_of(model)
    x, y = batches(1, batch=32)[0]
    loss = model(x, y)
    assert rt.stats()["activations"]["spilled_bytes"] > 0
    nvme = rt.timeline_peaks()["category_peak"]["nvme"]
    assert nvme["activation"] > 0 and nvme["param"] == nvme["grad"] == 0, nvme
    overwritten = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(tmp_path) + "/"):
            with open(f"/proc/self/fd/{fd}", "r+b") as f:  # its own descriptor: not O_DIRECT
                f.write(b"\x5a" * (64 << 20))
            overwritten += 1
    assert overwritten
    with pytest.raises(OSError, match=r"activation spill.*checksum mismatch"):
        loss.backward()


def test_offloaded_activations_of_torch_modules_match_plain_torch():
    ref = encoder_lm()
    ours = copy.deepcopy(ref)
    data = encoder_batches(5)
    want = train_encoder(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01), data)
    nbytes = sum(p.numel() for p in ref.parameters()) * 16
    model, opt = tiermem.initialize(ours, config(nbytes // 2 + 1_000_000, activations="offload",
                                                 host="256MiB"),
                                    units=[torch.nn.TransformerEncoderLayer, torch.nn.Linear])
    rt = tiermem.runtime_of(model)
    assert train_encoder(model, opt, data) == want
    assert rt.stats()["activations"]["offloaded_bytes"] > 0
    assert not rt.timeline_peaks()["over_budget"]


def test_the_activation_offload_benchmark_runs_and_holds_the_budget(capsys):
    from benchmarks import bench_activations
    budget = 3200 * 1024  # one block's recomputed activations (2.1 MB) next to the chunks
    assert bench_activations.main(["--layers", "2", "--width", "64", "--block", "64", "--batch",
                                   "8", "--steps", "5", "--device", "3200KiB", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["activation_bytes_per_step"] > budget  # more than the device budget
    assert out["budget_mode"].startswith("tiermem: the activations")
    for m in ("offload-auto", "offload-off", "recompute", "auto-auto"):
        d = out["device_peak"][m]
        assert not d["over_budget"] and d["chunks_and_activations"] <= budget, d
    for m in ("offload-auto", "offload-off"):
        assert out["offloaded_bytes_per_step"][m] > 0
    assert out["recomputed_units_per_step"]["recompute"] >= 2  # the blocks
    assert out["offloaded_bytes_per_step"]["recompute"] == 0
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
@pytest.mark.parametrize("acts", ["outside", "budget", "offload", "recompute"])
def test_in_place_changes_to_saved_tensors_raise_as_in_torch(acts, what):
    # torch skips its version check for tensors that pass through saved-tensor hooks; the
    # hooks check it instead, so tiermem raises where torch does instead of using the
    # modified values (a silently wrong gradient). Recomputed, the activation is checked
    # after its recompute (which modifies it again); a forward that writes its weights in
    # place cannot be recomputed at all (the write would happen twice): refused at once.
    torch.manual_seed(0)
    ref = _Stack(what)
    ours = copy.deepcopy(ref)
    x = torch.randn(32, 256)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref(x).backward()
    model, opt = tiermem.initialize(ours, config(3_000_000, activations=acts, host="64MiB"))
    assert not tiermem.runtime_of(model)._resident
    if acts == "recompute" and what == "weight":
        with pytest.raises(RuntimeError, match=r"unit 'blocks.2' writes its parameters in place"):
            model(x)
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).backward()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_offloaded_low_precision_activations_give_the_same_losses(precision):
    # Mixed precision saves bf16/fp16 tensors: offloaded and back, byte for byte, or
    # recomputed from the same bf16/fp16 chunks, so the run equals the same run with
    # activations outside the budget.
    data = batches(5, batch=32)
    runs = {}
    for acts in ("outside", "offload", "recompute"):
        _, ours = make_pair()
        model, opt = tiermem.initialize(ours, config(1_200_000, activations=acts, host="256MiB",
                                                     precision=precision))
        runs[acts] = train_steps(model, opt, data)
        st = tiermem.runtime_of(model).stats().get("activations")
        if acts == "offload":
            assert st["offloaded_bytes"] > 0, st
        if acts == "recompute":
            assert st["recomputed_units"] > 0 and st["offloaded_bytes"] == 0, st
    assert runs["offload"] == runs["outside"]
    assert runs["recompute"] == runs["outside"]


# ---- activations: recompute / auto ---------------------------------------------------------
def test_recomputed_activations_train_exactly_within_a_budget_below_them():
    # 3.5 MB of saved activations per step against a 2.4 MB device budget: kept, they cannot
    # fit; recomputed, the device holds the blocks' inputs and one unit's recomputed
    # activations at a time. Bit for bit the reference, and nothing goes to the host.
    ref, ours = make_pair()
    data = batches(8, batch=32)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    budget = 2_400_000
    model, opt = tiermem.initialize(ours, config(budget, activations="recompute",
                                                 host="256MiB"))
    rt, act, _ = trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget)
    st = rt.stats()["activations"]
    blocks = len(ref.blocks)  # the units that contain no other unit and save activations
    assert st["recomputed_units"] >= blocks * len(data), st
    assert st["recomputed_bytes"] > 8 * 1_000_000 and st["offloaded_bytes"] == 0, st
    assert 0 < act < budget and host_activation_peak(rt) == 0
    # The timeline shows where the time went: a 'recompute' phase inside the backward.
    phases = {e[8] for e in rt.timeline_events() if e[8]}
    assert "recompute" in phases, sorted(phases)
    # Kept (counted, not recomputed), the same budget cannot hold them.
    _, ours2 = make_pair()
    m2, o2 = tiermem.initialize(ours2, config(budget, host="256MiB"))
    with pytest.raises(MemoryError, match=r"activations"):
        train_steps(m2, o2, data[:1])


@pytest.mark.parametrize("plan", ["off", "always"])
def test_auto_offloads_what_the_host_holds_and_recomputes_the_rest_exactly(plan):
    # activations: auto. 3.5 MB of activations per step, a 2.4 MB device budget and a host
    # budget of 2.5 MB (the chunk homes take 0.7 MB of it): 'offload' cannot run here (below);
    # auto offloads while the host has room and drops the rest, which the units recompute in
    # the backward from their kept inputs. With a plan, the plan's per-unit choice (keep,
    # offload, recompute) runs, with the same fallback. Bit for bit the reference.
    ref, ours = make_pair()
    data = batches(8, batch=32)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    budget, host = 2_400_000, 2_500_000
    model, opt = tiermem.initialize(ours, config(budget, plan=plan, activations="auto",
                                                 host=host))
    rt, act, _ = trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget)
    st = rt.stats()["activations"]
    assert st["offloaded_bytes"] > 0 and st["recomputed_units"] > 0, st
    assert 0 < host_activation_peak(rt) and rt.timeline_peaks()["peak"]["host"] <= host
    if plan == "off":
        assert st["dropped_bytes"] > 0, st  # the reactive fallback: every step drops
    else:
        p = rt.stats()["plan"]
        assert p["active"] and p["divergences"] == 0 and p["followed_iterations"] >= 4, p
    _, ours2 = make_pair()
    m2, o2 = tiermem.initialize(ours2, config(budget, plan=plan, activations="offload",
                                              host=host))
    with pytest.raises(MemoryError, match=r"does not fit the host budget"):
        train_steps(m2, o2, data[:1])


def test_auto_with_room_on_the_host_is_offload():
    # With room for everything on the host, auto drops nothing (on SimDevice the plan counts a
    # recompute's compute against copies on the same cores, and copying is cheaper here).
    ref, ours = make_pair()
    data = batches(8, batch=32)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    model, opt = tiermem.initialize(ours, config(2_400_000, plan="always", activations="auto",
                                                 host="256MiB"))
    rt, _, _ = trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, 2_400_000)
    st = rt.stats()["activations"]
    assert st["offloaded_bytes"] > 0 and st["dropped_bytes"] == 0, st


def test_recompute_leaves_nothing_behind_after_a_step():
    # The recompute's own graph must not keep its saved tensors alive (a reference cycle
    # through autograd that Python's collector cannot break): the tensors alive after a step
    # are the same number every step.
    import gc
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, config(2_400_000, activations="recompute",
                                                 host="256MiB"))
    counts = []
    for x, y in batches(6, batch=32):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        gc.collect()
        counts.append(sum(type(o) is torch.Tensor for o in gc.get_objects()))
    assert tiermem.runtime_of(model).stats()["activations"]["recomputed_units"] > 0
    assert counts[2:] == [counts[2]] * 4, counts


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_models_recompute_exactly(name):
    # Llama (rotary embeddings passed to each layer as a tuple of tensors, the mask as a
    # kwarg) and GPT-2, with use_cache off in the config as for HF's gradient checkpointing.
    hf = pytest.importorskip("test_hf")
    torch.manual_seed(0)
    ref = getattr(hf, name)()
    ref.config.use_cache = False
    ours = copy.deepcopy(ref)
    data = hf.batches(6)
    want = hf.train(ref, KernelAdamW(ref.parameters(), lr=2e-3, weight_decay=0.01), data)
    model, opt = tiermem.initialize(ours, config(hf.budget(ours) + 2_000_000,
                                                 activations="recompute", host="256MiB",
                                                 optimizer={"lr": 2e-3, "weight_decay": 0.01}))
    assert hf.train(model, opt, data) == want
    assert tiermem.runtime_of(model).stats()["activations"]["recomputed_units"] >= 3 * 6


def test_a_retained_graph_recomputes_again_in_its_second_backward():
    # The recomputed tensors are dropped when the backward leaves a unit; a second backward
    # through the same graph (retain_graph) recomputes them: gradients equal plain torch's.
    ref, ours = make_pair()
    x, y = batches(1, batch=8)[0]
    loss = ref(x, y)
    loss.backward(retain_graph=True)
    loss.backward()
    model, _ = tiermem.initialize(ours, config(2_400_000, activations="recompute"))
    loss = model(x, y)
    loss.backward(retain_graph=True)
    once = tiermem.runtime_of(model).stats()["activations"]["recomputed_units"]
    loss.backward()
    assert tiermem.runtime_of(model).stats()["activations"]["recomputed_units"] == 2 * once > 0
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_recomputed_torch_modules_with_dropout_match_plain_torch():
    # The recompute replays the RNG of the first run: nn.TransformerEncoder with dropout
    # gives plain torch's losses and weights bit for bit (and leaves the RNG where torch's
    # run leaves it: the next step's dropout masks agree too).
    ref = encoder_lm(dropout=0.1)
    ours = copy.deepcopy(ref)
    data = encoder_batches(5)
    want = train_encoder(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01), data,
                         seed=11)
    nbytes = sum(p.numel() for p in ref.parameters()) * 16
    model, opt = tiermem.initialize(ours, config(nbytes // 2 + 4_000_000, activations="recompute",
                                                 host="256MiB"),
                                    units=[torch.nn.TransformerEncoderLayer, torch.nn.Linear])
    rt = tiermem.runtime_of(model)
    assert train_encoder(model, opt, data, seed=11) == want
    assert rt.stats()["activations"]["recomputed_units"] >= 4 * 5  # the encoder layers
    assert not rt.timeline_peaks()["over_budget"]
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


class _Moody(torch.nn.Module):
    """A forward that does not run the same way twice: every other call skips a sigmoid."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y.sigmoid() if self.calls % 2 else y


def test_a_forward_that_runs_differently_when_recomputed_raises():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Moody(), torch.nn.Linear(64, 1))
    model, opt = tiermem.initialize(model, config(3_000_000, activations="recompute"))
    loss = model(torch.randn(8, 64)).sum()
    # (x needs no grad: the Linear saves x only; the sigmoid its output, the one that goes.)
    with pytest.raises(RuntimeError, match=r"recomputing unit '0'.*saved 1 tensors for backward "
                                           r"where its forward saved 2"):
        loss.backward()


def test_an_input_changed_in_place_after_the_forward_raises_as_in_torch():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    ours = copy.deepcopy(ref)
    for m, acts in ((ref, None), (ours, "recompute")):
        if acts:
            m, _ = tiermem.initialize(m, config(3_000_000, activations=acts))
        x = torch.randn(8, 64)
        loss = m(x).sum()
        x.mul_(2)  # the first Linear saved x (for its weight's gradient)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x * 2).sigmoid()  # saves x * 2 and the sigmoid's output, not x


def test_an_input_changed_after_the_forward_that_torch_does_not_need_raises_when_recomputed():
    # Plain torch does not save x here, so changing it after the forward is harmless there;
    # a recompute would start from the changed x: tiermem refuses instead of computing with it.
    torch.manual_seed(0)
    model, opt = tiermem.initialize(torch.nn.Sequential(_Scaled(), torch.nn.Linear(64, 1)),
                                    config(3_000_000, activations="recompute"))
    x = torch.randn(8, 64)
    loss = model(x).sum()
    x.add_(1)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: an input of unit "
                                           r"'0' \(recomputed in the backward"):
        loss.backward()


def test_a_kv_cache_with_recompute_is_refused_before_anything_runs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=3, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ref = transformers.GPT2LMHeadModel(cfg)
    ours = copy.deepcopy(ref)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    budget = sum(p.numel() for p in ref.parameters()) * 16 // 3 + 1_000_000
    model, opt = tiermem.initialize(ours, config(budget, activations="recompute",
                                                 host="256MiB",
                                                 optimizer={"lr": 2e-3, "weight_decay": 0.01}))
    with pytest.raises(ValueError, match=r"use_cache=False"):
        model(input_ids=ids, labels=ids, use_cache=True)
    # Refused before it ran: training with use_cache=False equals the plain model's.
    ropt = KernelAdamW(ref.parameters(), lr=2e-3, weight_decay=0.01)
    for m, o in ((ref, ropt), (model, opt)):
        m.losses = []
        for _ in range(4):
            o.zero_grad()
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            o.step()
            m.losses.append(loss.item())
    assert model.losses == ref.losses
    assert tiermem.runtime_of(model).stats()["activations"]["recomputed_units"] >= 4 * 3
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("mode", ["budget", "offload"])
def test_units_called_on_their_own_without_backward_stop_counting(mode):
    """A unit called outside the model's forward (features of one block, with grad enabled,
    output dropped): its graph is watched as a whole forward's is. Before, every such call
    added its activations to the count: in 'budget' a MemoryError after a few calls that
    plain torch never raises. Units chained by hand still train exactly."""
    ref, ours = make_pair()
    budget = model_bytes(ours) // 4 + 400_000
    model, opt = tiermem.initialize(ours, config(budget, activations=mode, host="256MiB"))
    h = torch.randn(32, 16, 32, generator=torch.Generator().manual_seed(3))
    for _ in range(8):  # ~0.6 MB of saved activations per call
        out = model.blocks[0](h)
        assert torch.equal(out, ref.blocks[0](h))
        del out
    if mode == "offload":  # nothing was moved out for a dead graph
        assert tiermem.runtime_of(model).stats()["activations"]["offloaded_bytes"] == 0
    # Two units chained by hand, then backward: plain torch's gradients.
    for m in (ref, model):
        m.zero_grad()
        m.blocks[2](m.blocks[1](h[:2])).square().mean().backward()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is None:
            assert q.grad is None, n
        else:
            torch.testing.assert_close(q.grad.detach().clone(), p.grad, rtol=1e-6, atol=1e-7,
                                       msg=n)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             batches(2, batch=2))
    model.zero_grad()
    assert train_steps(model, opt, batches(2, batch=2)) == ref_losses


@pytest.mark.parametrize("mode", ["budget", "offload"])
def test_a_forward_whose_graph_is_dropped_without_backward_stops_counting(mode):
    """A forward with grad enabled and no backward (an evaluation loss computed without
    no_grad, then dropped) frees its activations in torch; tiermem must not keep counting
    them. Before, each such forward added its activations to the next one's: in 'budget' the
    second raised a MemoryError plain torch would not, in 'offload' the host took copies of
    activations nobody could use. While a forward's loss is kept, its activations still count
    (torch keeps them too)."""
    ref, ours = make_pair()
    data = batches(3, batch=32)  # 3.5 MB of saved activations per forward
    budget = 6_000_000  # one forward's activations and the chunks, not two forwards'
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = tiermem.initialize(ours, config(budget, activations=mode, host="256MiB"))
    rt = tiermem.runtime_of(model)
    for x, y in data:  # forward only, the loss dropped: plain torch frees the graph each time
        loss = model(x, y)
        assert loss.item() == ref(x, y).item()
        del loss
    if mode == "offload":
        st = rt.stats()["activations"]
        assert st["offloaded_bytes"] == 0, st  # nothing was moved out for a dead graph
    # Training afterwards: the same losses as plain torch, within the budget.
    ref_losses = train_steps(ref, ref_opt, data)
    trains_exactly_within_the_budget(model, opt, ref, ref_losses, data, budget)
    # A kept loss keeps its forward's activations counted: the next forward adds its own.
    kept = model(*data[0])
    if mode == "budget":
        with pytest.raises(MemoryError, match="activations saved for backward"):
            model(*data[1])
    else:
        before = rt.stats()["activations"]["offloaded_bytes"]
        model(*data[1])
        assert rt.stats()["activations"]["offloaded_bytes"] > before  # room made for both
    del kept
