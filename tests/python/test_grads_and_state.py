"""Gradients are visible to ordinary torch code, and state moves in and out exactly.

clip_grad_norm_ on model.parameters(), torch.amp.GradScaler, grad-norm logging, submodule
state_dict, torch.save/torch.load, load_state_dict into a plain model, and resuming training
across tiermem and plain torch.optim.AdamW in both directions.
"""
import copy
import io

import pytest
import torch

import tiermem
from test_training import train_ours as _train
from conftest import (END_TO_END_LOSS_REL, END_TO_END_PARAM_ATOL, END_TO_END_PARAM_RTOL,
                      KernelAdamW, assert_close_rel, batches, make_pair, model_bytes)

CFG = {"device_kind": "sim", "host": "1GiB", "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}


def init(model, frac=0.25, **kw):
    c = dict(CFG, device=int(model_bytes(model) * frac))
    c.update(kw)
    return tiermem.initialize(model, c)


def test_grads_are_visible_after_backward_and_equal_plain_torch():
    ref, ours = make_pair()
    model, opt = init(ours)
    x, y = batches(1)[0]
    ref(x, y).backward()
    model(x, y).backward()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert b.grad is not None, n
        assert b.grad.shape == a.grad.shape and b.grad.dtype == a.grad.dtype
        assert torch.equal(b.grad, a.grad), n
    # Logging the grad norm the usual way.
    norm = lambda m: torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters()))
    assert torch.equal(norm(model), norm(ref))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_clip_grad_norm_returns_the_true_norm_and_its_clipping_is_what_the_step_uses():
    ref, ours = make_pair()
    data = batches(10)
    ropt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = init(ours)
    ref_norms, norms, ref_losses, losses = [], [], [], []
    for x, y in data:
        for m, o, ns, ls in ((ref, ropt, ref_norms, ref_losses), (model, opt, norms, losses)):
            o.zero_grad()
            loss = m(x, y)
            loss.backward()
            ns.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).item())
            o.step()
            ls.append(loss.item())
    assert norms == ref_norms  # the same fp32 computation over the same gradients
    assert min(norms) > 0.05, "clipping must be active in every step for this test to bite"
    assert losses == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_clip_grad_norm_on_torch_adamw_matches_within_tolerance():
    """The same with torch.optim.AdamW as the reference (losses at the end-to-end tolerance)."""
    ref, ours = make_pair()
    data = batches(10)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    model, opt = init(ours)
    for x, y in data:
        for m, o in ((ref, ropt), (model, opt)):
            o.zero_grad()
            m.loss = m(x, y)
            m.loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
        assert_close_rel(model.loss.item(), ref.loss.item(), END_TO_END_LOSS_REL)


def test_grad_scaler_unscale_clip_step_update_equals_plain_torch():
    ref, ours = make_pair()
    data = batches(10)
    ropt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = init(ours)
    rs, s = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
             for _ in range(2))
    ref_losses, losses = [], []
    for i, (x, y) in enumerate(data):
        for m, o, sc, ls in ((ref, ropt, rs, ref_losses), (model, opt, s, losses)):
            o.zero_grad()
            loss = m(x, y)
            if i == 4:
                loss = loss * float("inf")  # an overflow: the scaler skips this step
            sc.scale(loss).backward()
            sc.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            sc.step(o)
            sc.update()
            ls.append(loss.item())
    assert s.get_scale() == rs.get_scale()
    assert losses[:4] == ref_losses[:4] and losses[5:] == ref_losses[5:]
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_grad_scaler_with_fp16_precision_is_a_clear_error():
    _, ours = make_pair()
    model, opt = init(ours, precision="fp16")
    x, y = batches(1)[0]
    sc = torch.amp.GradScaler("cpu")
    sc.scale(model(x, y)).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        sc.unscale_(opt)


def test_fp16_grads_are_scaled_and_clip_grad_norm_refuses_them():
    """In fp16 the chunks hold loss-scaled gradients; torch code reading p.grad must not get
    numbers that look unscaled. tiermem's own clipping (config gradient_clipping) and
    optimizer.grad_norm() unscale."""
    _, ours = make_pair()
    model, opt = init(ours, precision="fp16", gradient_clipping=1.0,
                      loss_scaling={"initial_scale": 1024})
    x, y = batches(1)[0]
    opt.scale_loss(model(x, y)).backward()
    with pytest.raises(RuntimeError, match="loss-scaled"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    n = opt.grad_norm().item()
    assert 0 < n < float("inf")
    # The unscaled norm: the scaled fp16 grads' norm divided by the scale.
    rt = tiermem.runtime_of(model)
    total = 0.0
    for r in rt.params:
        total += float((rt.session.read_tensor(r.index, tiermem._C.ChunkKind.grad).double() ** 2).sum())
    assert abs(n - total ** 0.5 / 1024) <= 1e-6 * n


def test_submodule_state_dict_and_torch_save_load_are_exact(tmp_path):
    ref, ours = make_pair()
    model, opt = init(ours)
    data = batches(3)
    ropt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in data:
        for m, o in ((ref, ropt), (model, opt)):
            o.zero_grad()
            m(x, y).backward()
            o.step()
    for name in ("blocks.1", "blocks.0.attn", "ln_f", "wte"):
        sub, rsub = model.get_submodule(name), ref.get_submodule(name)
        sd, rsd = sub.state_dict(), rsub.state_dict()
        assert sd.keys() == rsd.keys(), name
        for k in rsd:
            assert type(sd[k]) is torch.Tensor and torch.equal(sd[k], rsd[k]), f"{name}.{k}"
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    plain = copy.deepcopy(ref)
    for p in plain.parameters():
        p.data.zero_()
    plain.load_state_dict(loaded)
    x, _ = data[0]
    assert torch.equal(plain(x), ref(x))
    # Tied weights stay one tensor in the state dict (like plain torch).
    sd = model.state_dict()
    assert sd["wte.weight"] is sd["lm_head.weight"]
    # And the other way: a plain state dict loaded into the managed model.
    ref2, ours2 = make_pair(seed=5)
    m2, _ = init(ours2)
    m2.load_state_dict(ref.state_dict())
    assert torch.equal(m2(x)[0] if isinstance(m2(x), tuple) else m2(x), ref(x))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_from_tiermem_into_plain_adamw_and_back(precision):
    """Train 5 steps with tiermem, continue 5 with plain torch.optim.AdamW from tiermem's
    model + optimizer state dicts; and the reverse. Next losses equal continuing in place."""
    ref, ours = make_pair()
    data = batches(10)
    model, opt = init(ours, precision=precision)
    first = _train(model, opt, data[:5])
    # Continue in tiermem...
    sd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    cont = _train(model, opt, data[5:])
    # ... vs continue in plain torch from the state dicts.
    plain = copy.deepcopy(ref)
    plain.load_state_dict(sd)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    popt.load_state_dict(copy.deepcopy(osd))  # torch adopts (and then updates) its tensors
    if precision == "fp32":
        resumed = _train(plain, popt, data[5:])
        for a, b in zip(resumed, cont):
            assert_close_rel(a, b, END_TO_END_LOSS_REL)
    # And back: plain state into a fresh tiermem model, continuing from the same point.
    ref2, ours2 = make_pair(seed=3)
    m2, o2 = init(ours2, precision=precision)
    m2.load_state_dict(sd)
    o2.load_state_dict(osd)
    again = _train(m2, o2, data[5:])
    assert again == cont, "tiermem -> state dicts -> tiermem continues bit for bit"
    assert first[0] > cont[-1]


def test_plain_adamw_state_resumes_in_tiermem():
    ref, ours = make_pair()
    data = batches(8)
    popt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    _train(ref, popt, data[:4])
    model, opt = init(ours)
    model.load_state_dict(ref.state_dict())
    opt.load_state_dict(popt.state_dict())
    cont_ref = _train(ref, popt, data[4:])
    cont = _train(model, opt, data[4:])
    for a, b in zip(cont, cont_ref):
        assert_close_rel(a, b, END_TO_END_LOSS_REL)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=END_TO_END_PARAM_RTOL,
                                   atol=END_TO_END_PARAM_ATOL, msg=k)


@pytest.mark.parametrize("overlap", ["off", "next-forward"])
def test_eval_and_no_grad_between_iterations_do_not_disturb_the_recorded_order(overlap):
    ref, ours = make_pair()
    data = batches(6)
    ropt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = init(ours, optimizer_overlap=overlap)
    rt = tiermem.runtime_of(model)
    ref_losses = _train(ref, ropt, data[:3])
    assert _train(model, opt, data[:3]) == ref_losses
    before = rt.stats()["diverged"]
    x, _ = data[0]
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
        assert torch.equal(model(x[:, :5]), ref(x[:, :5]))  # another shape, another order
    model.train()
    ref.train()
    assert _train(model, opt, data[3:]) == _train(ref, ropt, data[3:])
    # With deferred updates (docs/python.md "When the optimizer runs") the eval forward ran the
    # last step's updates, so the next training forward has none: the engine skips them in
    # the recorded order (resynced), keeps the order, and the one after has them again.
    assert rt.stats()["diverged"] == before
    assert (rt.stats()["resynced"] > 0) == (overlap == "next-forward")


# ---- torch.autograd.grad and backward(inputs=...) with respect to the parameters -----------
# The forward computes with each unit's compute view of a parameter, not with the ChunkTensor
# the user holds: before, autograd.grad(loss, model.parameters()) raised torch's "appears to
# not have been used in the graph", with allow_unused=True returned None for every parameter,
# and backward(inputs=params) silently left every .grad None.
@pytest.mark.parametrize("activations", ["outside", "offload", "recompute"])
def test_autograd_grad_with_respect_to_the_parameters_equals_plain_torch(activations):
    ref, ours = make_pair()
    model, opt = init(ours, activations=activations, device=model_bytes(ours) // 4 + 400_000)
    x, y = batches(1, batch=2)[0]
    for kw in ({}, {"allow_unused": True}):
        g0 = torch.autograd.grad(ref(x, y), list(ref.parameters()), **kw)
        g1 = torch.autograd.grad(model(x, y), list(model.parameters()), **kw)
        for (n, _), a, b in zip(ref.named_parameters(), g0, g1):
            assert b is not None and type(b) is torch.Tensor, n
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=n)
    assert all(p.grad is None for p in model.parameters())  # grad() accumulates nothing
    # One parameter, as a lone tensor (not a list), like torch.
    (g,) = torch.autograd.grad(model(x, y), model.wte.weight)
    (g_ref,) = torch.autograd.grad(ref(x, y), ref.wte.weight)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-7)


def test_backward_with_inputs_accumulates_into_those_parameters_only():
    ref, ours = make_pair()
    model, opt = init(ours)
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    x, y = batches(1, batch=2)[0]
    picked = ["wte.weight", "blocks.0.fc.weight"]  # wte: tied with the head, two units

    def pick(m):
        d = dict(m.named_parameters())
        return [d[n] for n in picked]
    for _ in range(2):  # the second backward adds to the first, as torch's does
        ref(x, y).backward(inputs=pick(ref))
        model(x, y).backward(inputs=pick(model))
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        if n in picked:
            torch.testing.assert_close(q.grad.detach().clone(), p.grad, rtol=1e-6, atol=1e-7,
                                       msg=n)
        else:
            assert p.grad is None and q.grad is None, n
    ref_opt.step()
    opt.step()  # updates the two parameters with a gradient, as torch's AdamW does
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach().clone(), p.detach(), rtol=1e-6, atol=1e-7, msg=n)


def test_autograd_grad_of_a_parameter_also_read_outside_its_unit_sums_both_uses():
    from test_torch_modules import RootReads, VOCAB, budget_for
    torch.manual_seed(0)
    ref = RootReads()
    ours = copy.deepcopy(ref)
    model, _ = tiermem.initialize(ours, {"device_kind": "sim", "device": budget_for(ours, 0.5), "host": "64MiB"})
    assert not tiermem.runtime_of(model)._resident  # the read goes through the ChunkTensor
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="was read by aten"):
        g1 = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    g0 = torch.autograd.grad(ref(x).square().mean(), list(ref.parameters()))
    for (n, _), a, b in zip(ref.named_parameters(), g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=n)
    model(x).square().mean().backward(inputs=[model.emb.weight])  # (warned once already)
    ref(x).square().mean().backward(inputs=[ref.emb.weight])
    torch.testing.assert_close(model.emb.weight.grad.detach().clone(), ref.emb.weight.grad,
                               rtol=1e-6, atol=1e-7)


def test_autograd_grad_of_a_view_of_a_parameter_is_a_clear_error():
    _, ours = make_pair()
    model, _ = init(ours)
    x, y = batches(1, batch=2)[0]
    with pytest.raises(RuntimeError, match=r"view or a gradient of managed parameter "
                                           r"'blocks\.0\.fc\.weight'.*pass the parameter"):
        torch.autograd.grad(model(x, y), [model.blocks[0].fc.weight.view(-1)])


def test_a_gradient_penalty_through_autograd_grad_with_create_graph_equals_plain_torch():
    """loss + |d loss / d params|^2 (create_graph=True, then backward through the gradients):
    the double backward goes through the units' saved views again, as torch's does."""
    ref, ours = make_pair()
    model, _ = init(ours, device=model_bytes(ours) // 4 + 400_000)
    x, y = batches(1, batch=2)[0]
    grads = []
    for m in (ref, model):
        loss = m(x, y)
        gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        (loss + sum(g.square().sum() for g in gs)).backward()
        grads.append([p.grad.detach().clone() for p in m.parameters()])
    for (n, _), a, b in zip(ref.named_parameters(), *grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=n)


# ---- gradient hooks on parameters ------------------------------------------------------------
# Before, p.register_hook(fn) and p.register_post_accumulate_grad_hook(fn) on a managed
# parameter registered on a tensor autograd never reaches (the forward computes with the
# unit's compute view): the hooks silently never ran.
def test_gradient_hooks_on_parameters_run_as_in_torch_and_can_be_removed():
    ref, ours = make_pair()
    model, opt = init(ours)
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    data = batches(4, batch=2)
    seen = {"ref": [], "ours": []}
    handles = {}
    for m, k in ((ref, "ref"), (model, "ours")):
        handles[k] = [
            m.blocks[0].fc.weight.register_hook(lambda g: g * 0),   # a mask
            m.wte.weight.register_hook(lambda g: g * 0.5),          # tied: the total, once
            m.blocks[1].out.bias.register_post_accumulate_grad_hook(
                lambda p, k=k: seen[k].append(float(p.grad.norm()))),
        ]
    for step, (x, y) in enumerate(data):
        if step == 2:
            for k in handles:
                for h in handles[k]:
                    h.remove()
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x, y).backward()
            if step < 2:
                assert float(m.blocks[0].fc.weight.grad.abs().sum()) == 0
            o.step()
        for (n, p), q in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(q.detach().clone(), p.detach()), (step, n)
    assert len(seen["ours"]) == len(seen["ref"]) == 2
    assert seen["ours"] == seen["ref"]


@pytest.mark.filterwarnings("error::UserWarning")  # the hook's update is no stray read
def test_an_update_in_a_post_accumulate_grad_hook_equals_plain_torch():
    """The optimizer-in-backward pattern (torchtune's optimizer_in_bwd): each parameter is
    updated by its own hook as soon as its gradient is in, and its gradient freed — also in
    strict mode (unmaterialized_reads 'error'), which refuses stray reads of parameters."""
    ref, ours = make_pair()
    model, _ = init(ours, unmaterialized_reads="error")
    x, y = batches(1, batch=2)[0]

    def sgd(p):
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)
        p.grad = None
    for m in (ref, model):
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(sgd)
        m(x, y).backward()
        assert all(p.grad is None for p in m.parameters())
    ours_sd = model.state_dict()  # plain tensors (strict mode refuses reads of parameters)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(ours_sd[n], p.detach(), rtol=1e-6, atol=1e-7, msg=n)
    assert not torch.equal(ours_sd["blocks.0.fc.weight"],
                           make_pair()[0].blocks[0].fc.weight)  # the hooks did update


def test_a_hook_on_a_frozen_parameter_is_torchs_error():
    _, ours = make_pair()
    ours.wpe.weight.requires_grad_(False)
    model, _ = init(ours)
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        model.wpe.weight.register_hook(lambda g: g)


def test_a_hook_registered_on_a_parameter_unfrozen_since_the_last_forward():
    _, ours = make_pair()
    model, opt = init(ours)
    x, y = batches(1, batch=2)[0]
    w = model.blocks[0].fc.weight
    w.requires_grad_(False)
    model(x, y).backward()  # a forward with it frozen: its compute view follows
    assert w.grad is None
    w.requires_grad_(True)
    calls = []
    w.register_hook(lambda g: calls.append(1))
    model(x, y).backward()
    assert calls == [1] and w.grad is not None


def test_load_state_dict_with_assign_copies_into_the_chunks_and_trains_exactly():
    """load_state_dict(sd, assign=True) on a managed model loads the values into the chunks
    as without assign. Before, the state dict's tensors replaced the managed parameters in
    the modules: the forward computed with them while the optimizer stepped the chunks, so
    training silently went nowhere."""
    ref, ours = make_pair()
    model, opt = init(ours)
    sd = {k: v * 0.5 for k, v in ref.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    ref.load_state_dict(sd)  # (assign on the plain model would untie its tied weights)
    assert all(type(p) is tiermem.ChunkTensor for p in model.parameters())
    data = batches(3, batch=2)
    ref_losses = _train_plain(ref, data)
    assert _train(model, opt, data) == ref_losses
    ours_sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(ours_sd[k], v), k


def _train_plain(model, data):
    opt = KernelAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return _train(model, opt, data)


def test_cat_over_more_chunks_than_the_device_holds_reads_them_one_at_a_time():
    """parameters_to_vector, torch.cat / torch.stack over every parameter or gradient: more
    chunks than the device budget (1/4 of the model) holds at once. A read-only op runs on
    copies taken one chunk at a time; before, a MemoryError ("nothing is evictable")."""
    ref, ours = make_pair()
    model, opt = init(ours)
    x, y = batches(1)[0]
    ref(x, y).backward()
    model(x, y).backward()
    vec = torch.nn.utils.parameters_to_vector
    assert torch.equal(vec(model.parameters()), vec(ref.parameters()))
    assert torch.equal(torch.cat([p.grad.flatten() for p in model.parameters()]),
                       torch.cat([p.grad.flatten() for p in ref.parameters()]))
    ws = lambda m: [b.fc.weight for b in m.blocks]
    assert torch.equal(torch.stack(ws(model)), torch.stack(ws(ref)))
    # A write over them all still goes chunk by chunk through torch's own loop: exact.
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(vec(ref.parameters()) * 0.5, model.parameters())
        torch.nn.utils.vector_to_parameters(vec(ref.parameters()) * 0.5, ref.parameters())
    assert torch.equal(vec(model.parameters()), vec(ref.parameters()))


def test_a_gradient_hook_reached_in_two_parts_raises_and_post_accumulate_gives_the_total():
    """A per-parameter norm clip in a register_hook, with an L2 penalty on the parameters
    added to the loss outside the forward: the gradient reaches the parameter in two parts
    (its unit's compute view and the parameter itself). torch calls the hook once with their
    sum; tiermem called it once per part — a silently different clip. Now the second part
    raises, naming the parameter and the fix; the same clip as a post-accumulate hook equals
    torch, and training goes on exactly after the error."""
    ref, ours = make_pair()
    model, opt = init(ours)
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    data = batches(3, batch=2)

    def clip(g):
        return g * min(1.0, 0.01 / float(g.norm()))

    def loss_of(m, x, y):
        return m(x, y) + 1e-3 * m.blocks[0].fc.weight.pow(2).sum()

    h = model.blocks[0].fc.weight.register_hook(clip)
    x, y = data[0]
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.fc\.weight' has a gradient hook .* two "
                                           r"parts.*register_post_accumulate_grad_hook"):
        loss_of(model, x, y).backward()
    h.remove()
    opt.zero_grad()

    def clip_in_place(p):
        with torch.no_grad():
            p.grad.mul_(min(1.0, 0.01 / float(p.grad.norm())))
    for m in (ref, model):
        m.blocks[0].fc.weight.register_post_accumulate_grad_hook(clip_in_place)
    for x, y in data:
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss_of(m, x, y).backward()
            o.step()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach().clone(), p.detach(), rtol=END_TO_END_PARAM_RTOL,
                                   atol=END_TO_END_PARAM_ATOL, msg=n)
    # A hook reached in one part only (no penalty) runs as in torch, with the total.
    model.blocks[1].fc.weight.register_hook(clip)
    ref.blocks[1].fc.weight.register_hook(clip)
    x, y = data[0]
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        m(x, y).backward()
    torch.testing.assert_close(model.blocks[1].fc.weight.grad.clone(),
                               ref.blocks[1].fc.weight.grad, rtol=0, atol=0)


def test_torch_save_of_the_whole_managed_model_loads_as_an_ordinary_module():
    """torch.save(model) (the module, not its state_dict) raised "Can't pickle local object"
    (a hook lambda), and the runtime itself was not picklable. Now it saves an ordinary
    module with the current values, as copy.deepcopy gives: plain Parameters (requires_grad
    kept), its class's forward, no tiermem hooks — load_state_dict(assign=True) assigns
    there — and the managed model trains on exactly."""
    ref, ours = make_pair()
    model, opt = init(ours)
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    data = batches(3, batch=2)
    model.ln_f.weight.requires_grad_(False)
    ref.ln_f.weight.requires_grad_(False)
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        m(*data[0]).backward()
        o.step()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    plain = torch.load(buf, weights_only=False)
    assert type(plain) is type(model) and getattr(plain, "_tiermem_runtime", None) is None
    for (n, p), q in zip(ref.named_parameters(), plain.parameters()):
        assert type(q) is torch.nn.Parameter and q.requires_grad == p.requires_grad, n
        assert torch.equal(q.detach(), p.detach()), n
    with torch.no_grad():
        assert torch.equal(plain(*data[1]), ref(*data[1]))
    sd = {k: v.clone() + 1 for k, v in plain.state_dict().items()}
    plain.load_state_dict(sd, assign=True)
    # Assigned (the same storage), as torch does: no tiermem pre-hook left there.
    assert plain.ln_f.bias.data_ptr() == sd["ln_f.bias"].data_ptr()
    assert tiermem.initialize(plain, dict(CFG, device=model_bytes(plain)))[0] is plain
    for x, y in data[1:]:
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x, y).backward()
            o.step()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(q.detach().clone(), p.detach()), n
