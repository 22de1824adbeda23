"""Deferred optimizer updates (config optimizer_overlap, docs/python.md "When the optimizer
runs"): with "next-forward" each chunk group's AdamW update runs when the next forward first
uses the group; everything a user can do between step() and that forward must see the same
values as with "off", and training must give the same losses and state bit for bit."""
import pytest
import torch
from torch import nn

import tiermem
from conftest import KernelAdamW, batches, make_pair, model_bytes


def _train(overlap, config, data, between=None, after_backward=None, **model):
    _, ours = make_pair(**model)
    model, opt = tiermem.initialize(ours, dict(config, optimizer_overlap=overlap))
    rt = tiermem.runtime_of(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses, pending, seen = [], [], []
    for i, (x, y) in enumerate(data):
        loss = model(x, y)
        loss.backward()
        if after_backward is not None:
            seen.append(after_backward(i, model, opt))
        opt.step()
        sched.step()
        pending.append(rt.session.pending_steps)
        if between is not None:
            seen.append(between(i, model, opt))
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ostate = opt.state_dict()["state"]
    _train.speculation = rt.session.speculation
    rt.close()
    return losses, state, ostate, pending, seen


def _same(a, b):
    la, sa, oa, _, seen_a = a
    lb, sb, ob, _, seen_b = b
    assert la == lb
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for i in oa:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa[i][k], ob[i][k]), (i, k)
    assert len(seen_a) == len(seen_b)
    for x, y in zip(seen_a, seen_b):
        for u, v in zip(x, y):
            assert torch.equal(u, v)


@pytest.mark.parametrize("overlap", ["next-forward", "backward"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deferred_updates_train_bit_for_bit_like_immediate_ones(precision, overlap, tmp_path):
    # Device for a fraction of the chunks; host too small for the optimizer state (NVMe).
    shape = dict(n_layer=4, n_embd=64)
    _, probe = make_pair(**shape)
    total = model_bytes(probe)  # 3.4 MB
    cfg = {"device_kind": "sim", "device": f"{total // 4}B", "host": f"{total // 3}B",
           "nvme": {"path": str(tmp_path), "size": "64MiB"}, "precision": precision,
           "gradient_clipping": 0.05}
    data = batches(6, **shape)
    off = _train("off", cfg, data, **shape)
    on = _train(overlap, cfg, data, **shape)
    _same(off, on)
    assert all(p == 0 for p in off[3])
    assert all(p > 0 for p in on[3]), on[3]  # the updates were deferred after every step


@pytest.mark.parametrize("overlap", ["next-forward", "backward"])
def test_what_user_code_sees_between_step_and_the_next_forward(overlap):
    # Reads of parameters, grads and optimizer state after step() (they run the update of
    # what they touch first), an eval forward, and zero_grad while updates are pending.
    _, probe = make_pair()
    cfg = {"device_kind": "sim", "device": f"{model_bytes(probe) // 4}B"}

    def between(i, model, opt):
        out = []
        if i % 3 == 0:
            p = next(iter(model.parameters()))
            out.append(p.detach().clone())
            out.append(p.grad.detach().clone())
        elif i % 3 == 1:
            st = opt.state_dict()["state"]
            out.append(st[len(st) - 1]["exp_avg"].clone())
        else:
            model.eval()
            with torch.no_grad():
                x, y = batches(1, seed=9)[0]
                out.append(model(x, y).detach().clone())
            model.train()
        return out

    data = batches(6)
    _same(_train("off", cfg, data, between), _train(overlap, cfg, data, between))


@pytest.mark.parametrize("overlap", ["next-forward", "backward"])
def test_deferred_updates_equal_the_kernel_reference_on_torch_modules(overlap):
    # nn.TransformerEncoder (nn.MultiheadAttention inside) with deferred (and speculative)
    # updates, against the plain module stepped by the same AdamW kernel, clipping on.
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0,
                                                           batch_first=True), 3)
    ours = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0,
                                                            batch_first=True), 3)
    ours.load_state_dict(ref.state_dict())
    total = sum(p.numel() for p in ref.parameters()) * 16
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": f"{total // 4}B", "gradient_clipping": 0.5,
                                           "optimizer": {"lr": 1e-2},
                                           "optimizer_overlap": overlap})
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-2, clip=0.5)
    rt = tiermem.runtime_of(model)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        x = torch.randn(4, 10, 32, generator=g)
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert losses[0] == losses[1]
        assert rt.session.pending_steps > 0 or overlap == "backward"
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    if overlap == "backward":
        assert rt.session.speculation["speculated"] > 0, rt.session.speculation
    rt.close()


def test_speculative_steps_are_bit_identical_whether_the_clip_factor_holds_or_not():
    # optimizer_overlap "backward" (session.h, "speculative steps"): groups are updated
    # speculatively in the backward with a clip factor of 1; step() keeps those updates when
    # the norm turns out at or below max_norm and redoes the others. The threshold sits
    # inside the range of this run's gradient norms, so both happen; an LR schedule moves the
    # hyper-parameters every step; parameters read between backward() and step() are the old
    # ones.
    shape = dict(n_layer=4, n_embd=64)
    _, probe = make_pair(**shape)
    total = model_bytes(probe)
    data = batches(8, **shape)
    base = {"device_kind": "sim", "device": f"{total // 3}B", "host": "256MiB"}
    norms = []

    def norm_of(i, model, opt):
        norms.append(opt.grad_norm().item())
        return []

    _train("off", dict(base, gradient_clipping=1e9), data, after_backward=norm_of, **shape)
    clip = sorted(norms)[len(norms) // 2]  # the median: about half the steps clip
    cfg = dict(base, gradient_clipping=clip)

    def params(i, model, opt):
        return [p.detach().clone() for p in model.parameters()]

    off = _train("off", cfg, data, after_backward=params, **shape)
    on = _train("backward", cfg, data, after_backward=params, **shape)
    spec = _train.speculation
    _same(off, on)
    assert spec["committed"] > 0 and spec["dropped"] > 0, (spec, norms, clip)
    assert spec["no_room"] == 0, spec


def test_resident_training_updates_inside_step():
    # Everything fits: the binding keeps the chunks pinned, so nothing can be deferred.
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": "64MiB"})
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    assert tiermem.runtime_of(model).session.pending_steps == 0
    tiermem.runtime_of(model).close()


def test_bad_overlap_value_is_refused_naming_the_key():
    _, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match="optimizer_overlap"):
        tiermem.initialize(ours, {"optimizer_overlap": "forward"})
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


def test_an_executed_plan_follows_speculative_steps_from_the_first_planned_iteration():
    # plan "always" records the third iteration and executes the plan made from it. With
    # speculative steps (optimizer_overlap "backward") the first iteration has none (no
    # earlier backward says which grads complete when), every later one has them in its
    # backward: the plan must come from one of those, and every planned iteration must
    # follow it — no divergence, no re-plan. (Recording the first iteration instead: two
    # divergences here.)
    shape = dict(n_layer=4, n_embd=64)
    _, probe = make_pair(**shape)
    total = model_bytes(probe)
    cfg = {"device_kind": "sim", "device": f"{total // 3}B", "host": "256MiB", "plan": "always",
           "optimizer_overlap": "backward"}
    _, ours = make_pair(**shape)
    model, opt = tiermem.initialize(ours, cfg)
    rt = tiermem.runtime_of(model)
    for x, y in batches(7, **shape):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    plan = rt.stats()["plan"]
    spec = rt.session.speculation
    rt.close()
    assert spec["committed"] > 0 and spec["dropped"] == 0, spec
    assert plan["planned_iterations"] >= 3, plan
    assert plan["divergences"] == 0 and plan["plans"] == 1, plan
