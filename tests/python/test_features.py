"""Each feature of tiermem.initialize against plain torch (same seed, same data)."""
import copy
import os
import re
import stat

import pytest
import torch
from torch import nn

import tiermem
from conftest import (KernelAdamW, assert_close_rel, batches, make_pair, model_bytes, small_config,
                      train_steps)
from test_training import final_params, train_ours, train_ref
from tiermem.examples.gpt import GPT


def init(model, budget_frac=0.25, **cfg):
    c = {"device_kind": "sim", "device": model_bytes(model) // 4 if budget_frac == 0.25 else int(model_bytes(model) * budget_frac),
         "host": "1GiB", "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    c.update(cfg)
    return tiermem.initialize(model, c)


def compare(ref, model, ref_losses, losses, rel=1e-6):
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, rel, f"loss {i}")
    r, o = final_params(ref), final_params(model)
    for k in r:
        assert_close_rel(o[k], r[k], rel, k)


def test_gradient_accumulation_4_micro_batches_equals_torch():
    ref, ours = make_pair()
    data = batches(12, batch=2)
    ref_losses = train_ref(ref, data, accum=4)
    model, opt = init(ours, gradient_accumulation_steps=4)
    compare(ref, model, ref_losses, train_ours(model, opt, data, accum=4))


def test_gradient_clipping_equals_torch():
    ref, ours = make_pair()
    data = batches(6)
    ref_losses = train_ref(ref, data, clip=0.05)
    model, opt = init(ours, gradient_clipping=0.05)
    compare(ref, model, ref_losses, train_ours(model, opt, data))


def test_frozen_params_get_no_optimizer_state_and_match_torch():
    ref, ours = make_pair()
    for m in (ref, ours):
        m.wpe.weight.requires_grad_(False)
        m.blocks[0].ln1.weight.requires_grad_(False)
    data = batches(5)
    ref_opt_params = [p for p in ref.parameters() if p.requires_grad]
    ref_losses = train_ref(ref, data, groups=ref_opt_params)
    model, opt = init(ours)
    losses = train_ours(model, opt, data)
    compare(ref, model, ref_losses, losses)
    rt = tiermem.runtime_of(model)
    K = tiermem._C.ChunkKind
    frozen_groups = [g for g in range(rt.session.num_groups) if not rt.session.group(g).trainable]
    assert frozen_groups
    for g in frozen_groups:
        assert rt.session.has_kind(g, K.param_fp32)
        assert not any(rt.session.has_kind(g, k) for k in (K.grad, K.exp_avg, K.exp_avg_sq))
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_a_parameter_frozen_after_initialize_gets_no_gradient_and_can_be_unfrozen():
    """requires_grad_(False) on the model after initialize: the unit's compute views follow,
    so the frozen parameters get no gradient and AdamW leaves them alone, as in torch; they
    can be unfrozen again. Before, the views kept requires_grad=True and the "frozen" block
    still trained (silently)."""
    ref, ours = make_pair()
    data = batches(6, batch=2)
    model, opt = init(ours)
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    phases = [(0, 3, False), (3, 6, True)]
    for a, b, trainable in phases:
        for m in (ref, model):
            m.blocks[0].requires_grad_(trainable)
        ref_losses = train_steps(ref, ref_opt, data[a:b])
        losses = train_ours(model, opt, data[a:b])
        assert losses == ref_losses
        for n, p in model.named_parameters():
            frozen = n.startswith("blocks.0.") and not trainable
            assert (p.grad is None) == frozen, n
        r, o = final_params(ref), final_params(model)
        for k in r:
            assert torch.equal(o[k], r[k]), k


def test_unfreezing_a_parameter_frozen_at_initialize_is_a_clear_error():
    """requires_grad_(True) (or the setter) on a parameter frozen at initialize raises at that
    call, before its flag or anything else changes; it stays frozen and training goes on as
    in torch."""
    ref, ours = make_pair()
    for m in (ref, ours):
        m.blocks[1].ln1.weight.requires_grad_(False)
    model, opt = init(ours)
    data = batches(2, batch=2)
    before = final_params(model)
    w = model.blocks[1].ln1.weight
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.ln1\.weight' was frozen .* initialized"):
        w.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.ln1\.weight' was frozen .* initialized"):
        w.requires_grad = True
    assert not w.requires_grad
    r = final_params(model)
    for k in before:
        assert torch.equal(r[k], before[k]), k
    w.requires_grad_(False)  # freezing it again is no change
    ref_losses = train_ref(ref, data, groups=[p for p in ref.parameters() if p.requires_grad])
    compare(ref, model, ref_losses, train_ours(model, opt, data), rel=0)


def test_freezing_with_the_requires_grad_setter_freezes_the_units_views():
    """`p.requires_grad = False` (the attribute setter, not requires_grad_) on every
    parameter of a block after initialize: it gets no gradient and is not updated, as in
    torch."""
    ref, ours = make_pair()
    data = batches(4, batch=2)
    model, opt = init(ours)
    ref_opt = KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for m in (ref, model):
        for p in m.blocks[0].parameters():
            p.requires_grad = False
    assert train_ours(model, opt, data) == train_steps(ref, ref_opt, data)
    for n, p in model.named_parameters():
        assert (p.grad is None) == n.startswith("blocks.0."), n
    r, o = final_params(ref), final_params(model)
    for k in r:
        assert torch.equal(o[k], r[k]), k


def test_two_param_groups_no_decay_for_norms_and_biases():
    ref, ours = make_pair()

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                                         "lr": 3e-3}]
    data = batches(5)
    ref_losses = train_ref(ref, data, groups=groups(ref))
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ours) // 4, "host": "1GiB",
                                           "optimizer": {"lr": 1e-3}}, param_groups=groups(ours))
    compare(ref, model, ref_losses, train_ours(model, opt, data))


class Twice(nn.Module):
    """A module called twice in one forward, and buffers that stay ordinary tensors."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x, y):
        h = self.emb(x)
        h = torch.tanh(self.mix(h))
        h = torch.tanh(self.mix(h)) * self.scale  # same module again
        return nn.functional.cross_entropy(self.head(h).view(-1, 50), y.view(-1))


def test_module_called_twice_and_buffers_match_torch():
    torch.manual_seed(3)
    ref = Twice()
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g))
            for _ in range(6)]
    ref_losses = train_ref(ref, data)
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": 32768, "host": "64MiB",
                                           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
    losses = train_ours(model, opt, data)
    compare(ref, model, ref_losses, losses)
    assert isinstance(model.scale, torch.Tensor) and model.scale.item() == 0.5


def test_no_grad_eval_forward_matches_and_changes_nothing():
    ref, ours = make_pair()
    model, opt = init(ours)
    x, y = batches(1)[0]
    with torch.no_grad():
        ref.eval(), model.eval()
        a, b = ref(x, y), model(x, y)
    assert_close_rel(b, a, 1e-6, "eval loss")
    # Training after an eval forward still matches.
    ref.train(), model.train()
    data = batches(3, seed=5)
    compare(ref, model, train_ref(ref, data), train_ours(model, opt, data))


def test_weight_tying_is_stored_once():
    _, ours = make_pair()
    model, _ = init(ours)
    rt = tiermem.runtime_of(model)
    assert len(rt.params) == len(list(ours.parameters()))  # deduplicated
    assert model.lm_head.weight is model.wte.weight


def test_state_dict_round_trip_and_resume():
    ref, ours = make_pair()
    data = batches(8)
    model, opt = init(ours)
    train_ours(model, opt, data[:4])
    sd = model.state_dict()
    osd = opt.state_dict()
    # Loads into a plain torch model: identical outputs.
    plain = GPT(small_config())
    plain.load_state_dict(sd)
    x, y = data[4]
    with torch.no_grad():
        assert_close_rel(model(x, y), plain(x, y), 0, "loss after load into plain torch")
    # The optimizer state loads into torch.optim.AdamW (same layout) ...
    topt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    topt.load_state_dict(copy.deepcopy(osd))  # torch aliases loaded state tensors
    assert len(topt.state) == len(list(plain.parameters()))
    # ... and into the kernel-math reference: both continue identically.
    popt = KernelAdamW(plain.parameters(), lr=1e-3, weight_decay=0.01)
    popt.load_state_dict(copy.deepcopy(osd))
    cont_ref = train_steps(plain, popt, data[4:])
    # Resume a fresh tiermem model from the saved state.
    torch.manual_seed(123)
    fresh = GPT(small_config())
    m2, o2 = init(fresh)
    m2.load_state_dict(sd)
    o2.load_state_dict(osd)
    cont = train_ours(m2, o2, data[4:])
    compare(plain, m2, cont_ref, cont)




def test_host_too_small_puts_state_on_nvme_same_losses(tmp_path):
    ref, ours = make_pair()
    data = batches(5)
    ref_losses = train_ref(ref, data)
    mb = model_bytes(ours)
    model, opt = init(ours, host=mb // 2, nvme={"path": str(tmp_path), "size": mb * 2})
    compare(ref, model, ref_losses, train_ours(model, opt, data))
    rt = tiermem.runtime_of(model)
    K, T = tiermem._C.ChunkKind, tiermem._C.Tier
    homes = [rt.session.home(g, k) for g in range(rt.session.num_groups)
             for k in (K.param_fp32, K.grad, K.exp_avg, K.exp_avg_sq) if rt.session.has_kind(g, k)]
    assert T.nvme in homes and T.host in homes
    # Optimizer state spills first: every Adam v chunk (created last) is on NVMe.
    assert all(rt.session.home(g, K.exp_avg_sq) == T.nvme for g in range(rt.session.num_groups)
               if rt.session.group(g).trainable)
    moved = rt.stats()["bytes_moved"]
    assert any(k.startswith("nvme->") for k in moved) and any(k.endswith("->nvme") for k in moved)


def _untouched(model, before):
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert getattr(model, "_tiermem_runtime", None) is None
    assert not model._forward_pre_hooks


def test_budget_below_minimum_names_minimum_bytes():
    _, ours = make_pair()
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(MemoryError, match=r"minimum of \d+ bytes"):
        tiermem.initialize(ours, {"device_kind": "sim", "device": 1000})
    _untouched(ours, before)


@pytest.mark.parametrize("cfg,match", [
    ({"devise": "1GiB"}, "unknown key"),
    ({"device_kind": "sim", "device": "lots"}, "'device'"),
    ({"device_kind": "sim", "device": -5}, "'device'"),
    ({"precision": "fp8"}, "'precision'"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"nvme": {"path": "/tmp"}}, "'size' is required"),
])
def test_invalid_config_is_a_clear_error(cfg, match):
    _, ours = make_pair()
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError, match=match):
        tiermem.initialize(ours, cfg)
    _untouched(ours, before)


@pytest.mark.parametrize("case,message", [
    ("twice", "param_groups[1]: parameter blocks.0.fc.weight appears in more than one group"),
    ("frozen", "param_groups[0]: parameter blocks.0.fc.bias is frozen (requires_grad=False)"),
    ("foreign", "param_groups[1] holds a tensor that is not a parameter of the model"),
    ("missing", "trainable parameter wte.weight is in no param group"),
])
def test_bad_param_groups_are_the_cores_errors(case, message):
    """The rule and its words are the session's (runtime/param_groups.h), as in LibTorch."""
    _, ours = make_pair()
    before = copy.deepcopy(ours.state_dict())
    rest = [p for n, p in ours.named_parameters() if n != "blocks.0.fc.weight"]
    w = ours.blocks[0].fc.weight
    groups = {"twice": [{"params": [w]}, {"params": [w] + rest}],
              "frozen": [{"params": [w] + rest}],
              "foreign": [{"params": [w] + rest}, {"params": [torch.zeros(3)]}],
              "missing": [{"params": [p for n, p in ours.named_parameters()
                                      if n != "wte.weight"]}]}[case]
    if case == "frozen":
        ours.blocks[0].fc.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        tiermem.initialize(ours, {"device_kind": "sim", "device": "4MiB"}, param_groups=groups)
    _untouched(ours, before)


def test_unwritable_nvme_path_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    target = ro / "sub" if os.geteuid() == 0 else ro
    if os.geteuid() == 0:
        # root ignores permissions: use a path under a regular file instead.
        f = tmp_path / "file"
        f.write_text("x")
        target = f / "sub"
    _, ours = make_pair()
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError, match="not a writable directory"):
        tiermem.initialize(ours, {"nvme": {"path": str(target), "size": "1MiB"}})
    _untouched(ours, before)


def test_config_from_json_file(tmp_path):
    import json
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"device_kind": "sim", "device": "4MiB", "host": "64MiB"}))
    _, ours = make_pair()
    model, _ = tiermem.initialize(ours, str(p))
    assert tiermem.runtime_of(model).cfg.device_budget == 4 << 20


def served_pair():
    """A plain model, the same served by tiermem with 1/8 of it on the device, and a batch."""
    ref, _ = make_pair()
    model = tiermem.inference(copy.deepcopy(ref), {"device_kind": "sim", "device": model_bytes(ref) // 8,
                                                   "host": "256MiB"})
    return ref, model, batches(1)[0][0]


def test_requires_grad_on_a_served_models_parameter_is_a_clear_error():
    ref, model, x = served_pair()
    w = next(model.parameters())
    with pytest.raises(RuntimeError, match=r"belongs to a served model"):
        w.requires_grad_(True)
    assert not w.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


# torch.func.functional_call puts the caller's tensors in a module's parameter slots for one
# call. Before, a unit's forward overwrote those slots with its own chunk views: the call
# silently computed with the model's parameters instead of the ones passed.
@pytest.mark.parametrize("activations", ["outside", "budget", "offload", "recompute", "auto"])
def test_functional_call_computes_with_the_tensors_passed(activations):
    from torch.func import functional_call
    ref, ours = make_pair()
    data = batches(3, batch=2)
    model, opt = init(ours, activations=activations, host="256MiB",
                      device=model_bytes(ours) // 4 + 400_000)
    x, y = data[0]
    names = [n for n, _ in ref.named_parameters()]
    torch.manual_seed(5)
    full = {n: (p.detach() * 0.5 + 0.01 * torch.randn_like(p)) for n, p in ref.named_parameters()}
    with torch.no_grad():
        expected = functional_call(ref, full, (x, y))
        assert not torch.equal(expected, ref(x, y))  # the tensors passed do change the result
        torch.testing.assert_close(functional_call(model, full, (x, y)), expected, rtol=0, atol=0)
    # With grad, a part of the model swapped: the loss and every gradient as on the plain model
    # (the tensors passed get theirs; the model's other parameters get theirs in .grad).
    part = [n for n in names if n.startswith("blocks.1.")]
    results = []
    for m in (ref, model):
        m.zero_grad()
        mine = {n: full[n].clone().requires_grad_() for n in part}
        loss = functional_call(m, mine, (x, y))
        loss.backward()
        results.append((loss.detach(), {n: t.grad for n, t in mine.items()},
                        {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0, p0), (l1, g1, p1) = results
    if activations == "recompute":  # the other units were recomputed; blocks.1 kept its saves
        assert tiermem.runtime_of(model).stats()["activations"]["recomputed_units"] > 0
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for n in part:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-7, msg=n)
    assert p1.keys() == p0.keys() and not any(n in p0 for n in part)
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], rtol=1e-6, atol=1e-7, msg=n)
    # The model's own parameters are as they were, and it trains on exactly.
    ref_losses = train_ref(ref, data)
    compare(ref, model, ref_losses, train_ours(model, opt, data), rel=0)


def test_functional_call_on_a_served_model_computes_with_the_tensors_passed():
    from torch.func import functional_call
    ref, model, x = served_pair()
    half = {n: p.detach() * 0.5 for n, p in ref.named_parameters() if n.startswith("blocks.0.")}
    with torch.no_grad():
        expected = functional_call(ref, half, (x,))
        assert not torch.equal(expected, ref(x))
        torch.testing.assert_close(functional_call(model, half, (x,)), expected, rtol=0, atol=0)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_the_cpu_optimizer_on_torchs_threads_equals_its_own_pool_bit_for_bit():
    """Optimizer calls from torch's thread run their tiles on torch's intra-op pool
    (at::parallel_for) when both pools have the same thread count: on both threads (the
    extension is built with OpenMP; without it the loop silently ran on one), with the same
    results bit for bit as the kernels' own oneTBB pool — the direct kernel calls and a whole
    training run."""
    from tiermem import _C
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    _C.set_kernel_threads(2)
    try:
        assert _C.kernel_pool() == "torch"
        assert _C._torch_pool_width() == 2
        with pytest.raises(ValueError, match="'torch' .* or 'own'"):
            _C.set_kernel_pool("omp")
        g = torch.Generator().manual_seed(3)
        n = 5 * 32768 + 11
        p0, gr = torch.randn(n, generator=g), torch.randn(n, generator=g)
        out = {}
        for pool in ("torch", "own"):
            _C.set_kernel_pool(pool)
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            low = torch.empty(n, dtype=torch.bfloat16)
            for step in (1, 2, 3):
                _C.adam_step(p, gr, m, v, low, 1e-2, 0.9, 0.999, 1e-8, 0.01, step, 0.5, 0.7)
            st = _C.grad_stats(gr)
            out[pool] = (p, m, v, low, (st.sq_norm, st.overflow))
        for a, b in zip(out["torch"], out["own"]):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        losses = {}
        for pool in ("torch", "own"):
            _C.set_kernel_pool(pool)
            _, ours = make_pair()
            model, opt = init(ours, gradient_clipping=1.0)
            losses[pool] = (train_ours(model, opt, batches(4)), final_params(model))
        assert losses["torch"][0] == losses["own"][0]
        for k, t in losses["torch"][1].items():
            assert torch.equal(t, losses["own"][1][k]), k
    finally:
        _C.set_kernel_pool("torch")
        _C.set_kernel_threads(0)
        torch.set_num_threads(saved)


def test_adam_step_runs_where_the_tensors_live():
    """One binding for the fused AdamW step: CPU tensors run the CPU kernels, CUDA tensors
    the CUDA kernel (equal bit for bit, where a GPU is present); anything else — another
    device, tensors on two devices, a stream for CPU tensors, non-fp32 state — is a
    ValueError that changes nothing."""
    from tiermem import _C
    g = torch.Generator().manual_seed(5)
    n = 4099
    p0, gr = torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16()

    def run(dev):
        p, m, v = p0.clone().to(dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        low = torch.empty(n, dtype=torch.float16, device=dev)
        g_ = gr.to(dev)
        stream = torch.cuda.current_stream().cuda_stream if dev == "cuda" else 0
        for step in (1, 2):
            _C.adam_step(p, g_, m, v, low, 1e-2, 0.9, 0.999, 1e-8, 0.01, step, 0.5, 0.7,
                         stream=stream)
        return [t.cpu() for t in (p, m, v, low)]

    cpu = run("cpu")
    assert not torch.equal(cpu[0], p0) and torch.equal(cpu[3], cpu[0].half())
    if torch.cuda.is_available():
        for a, b in zip(cpu, run("cuda")):
            assert torch.equal(a, b)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    args = (1e-2, 0.9, 0.999, 1e-8, 0.01, 1)
    with pytest.raises(ValueError, match="stream is for CUDA tensors"):
        _C.adam_step(p, gr, m, v, None, *args, stream=1)
    with pytest.raises(ValueError, match="CPU or CUDA tensors"):
        _C.adam_step(*(t.to("meta") for t in (p, gr, m, v)), None, *args)
    with pytest.raises(ValueError, match="grad must be a contiguous tensor"):
        _C.adam_step(p, gr.to("meta"), m, v, None, *args)
    with pytest.raises(ValueError, match="exp_avg must be float32"):
        _C.adam_step(p, gr, m.double(), v, None, *args)
    assert torch.equal(p, p0) and not m.any() and not v.any()
