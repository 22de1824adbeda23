"""torch.compile on a tiermem-managed model (compiling.py, docs/python.md "torch.compile").

The three ways of compiling — ``torch.compile(model)`` after ``tiermem.initialize``,
``tiermem.initialize(torch.compile(model))`` and per-unit compile — train exactly as plain
torch compiled the same way, in host mode and on SimDevice, under every activations policy,
a plan, gradient accumulation with clipping, on Hugging Face models, ``nn.TransformerEncoder``
and a PEFT LoRA model. After the first step nothing recompiles: torch's own counters
(``unique_graphs``) stay put and ``error_on_recompile`` is on from the second step.

Most tests compile with the ``aot_eager`` backend: dynamo and AOT autograd exactly as under
inductor (the same graph breaks, guards, saved tensors and recomputes) without inductor's C++
code generation, which costs about a minute per model on two cores. One CI test compiles two
GPT blocks with inductor; the slow test trains every model of issue 35 under inductor for 10
steps (within 1e-5 of plain compiled torch; 2e-2 under bf16 autocast).
"""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

import tiermem
from conftest import (END_TO_END_PARAM_ATOL, END_TO_END_PARAM_RTOL, KernelAdamW, batches,
                      encoder_batches, encoder_lm, make_pair, model_bytes, small_config)
from tiermem.examples.gpt import Block

BACKEND = "aot_eager"
OPT = {"lr": 1e-3, "weight_decay": 0.01}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from nothing (dynamo's caches are per process and code object)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def cfg(mode, budget=None, **kw):
    """`mode`: 'host' (host mode, every chunk in the host budget) or 'sim' / 'sim-async'
    (SimDevice with `budget` bytes, chunks moving)."""
    c = {"device_kind": mode, "host": "256MiB", "optimizer": dict(OPT)}
    if mode != "host":
        c["device"] = budget
    c.update(kw)
    return c


def compile_as(model, how, blocks, backend=BACKEND):
    """`model` compiled `how` (on a plain and a managed model alike); returns what to call.
    `blocks(model)`: the ModuleList of its repeated blocks, for per-block compile."""
    if how == "torch.compile(model)":
        return torch.compile(model, backend=backend)
    if how == "model.compile()":
        model.compile(backend=backend)
        return model
    if how == "block.compile()":
        for b in blocks(model):
            b.compile(backend=backend)
        return model
    assert how == "torch.compile(block)", how
    seq = blocks(model)
    for i, b in enumerate(seq):
        seq[i] = torch.compile(b, backend=backend)
    return model


def managed(model, how, config, blocks, **kw):
    """(what to call, optimizer) of `model` initialized and compiled `how`: after
    tiermem.initialize ('torch.compile(model)', 'block.compile()', 'torch.compile(block)'), or
    before it ('initialize(...)' around one of those)."""
    if how.startswith("initialize("):
        inner = how[len("initialize("):-1]
        compiled = compile_as(model, inner, blocks)
        model, opt = tiermem.initialize(compiled, config, **kw)
        return model, opt
    model, opt = tiermem.initialize(model, config, **kw)
    return compile_as(model, how, blocks), opt


def plain_how(how):
    """How plain torch is compiled to compare with `how`."""
    return how[len("initialize("):-1] if how.startswith("initialize(") else how


def compiled_nodes(loss) -> int:
    """How many compiled graphs the loss's autograd graph went through."""
    seen, todo, n = set(), [loss.grad_fn], 0
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        n += "CompiledFunction" in type(f).__name__
        todo.extend(g for g, _ in f.next_functions)
    return n


def train(call, opt, data, loss_of, accumulate=1, clip=None, grads=None):
    """Trains over `data` and returns (losses, compiled graphs the first step's loss went
    through). From the second step on, dynamo may not recompile (error_on_recompile) nor
    compile anything new (unique_graphs). `grads`: (named parameters, a list that gets each
    step's gradients, name -> tensor, before the step)."""
    losses, first_compiled, graphs = [], None, None
    for i, batch in enumerate(data):
        if i == 1:
            graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            opt.zero_grad()
            for _ in range(accumulate):
                loss = loss_of(call, batch)
                if first_compiled is None:
                    first_compiled = compiled_nodes(loss)
                (loss / accumulate).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], clip)
            if grads is not None:
                grads[1].append({n: p.grad.clone() for n, p in grads[0] if p.grad is not None})
            opt.step()
        losses.append(loss.item())
    if graphs is not None:
        assert counters["stats"]["unique_graphs"] == graphs, "compiled again after step 1"
    return losses, first_compiled


def gpt_loss(call, batch):
    return call(*batch)


def blocks_of_gpt(model):
    return model.blocks


def assert_same_training(ours, ref, rel=0.0):
    (a, ca), (b, cb) = ours, ref
    assert ca > 0 and cb > 0, (ca, cb)  # both ran compiled graphs
    if rel == 0.0:
        assert a == b
    else:
        for x, y in zip(a, b):
            assert abs(x - y) <= rel * abs(y), (a, b)


def state_of(model) -> dict:
    """A copy of `model`'s state (of the module torch.compile(module) wrapped, if it did)."""
    return {k: v.clone() for k, v in getattr(model, "_orig_mod", model).state_dict().items()}


def assert_same_state(model, ref, rtol=0.0, atol=0.0):
    """The same parameters as `ref` (a model, or a state from state_of)."""
    got = state_of(model)
    for k, v in (ref if isinstance(ref, dict) else state_of(ref)).items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=atol, msg=k)


_PLAIN: dict = {}


def plain_gpt(how, steps, batch=4, **kw):
    """Plain torch training the conftest GPT compiled `how` over batches(steps, batch) with
    `train`'s options `kw`: ((losses, compiled graphs), its state after, its gradients per
    step). Deterministic, so each worker runs each once (the comparisons are many)."""
    key = (how, steps, batch, tuple(sorted(kw.items())))
    if key not in _PLAIN:
        torch._dynamo.reset()
        ref, _ = make_pair()
        grads = []
        got = train(compile_as(ref, how, blocks_of_gpt), KernelAdamW(ref.parameters(), **OPT),
                    batches(steps, batch=batch), gpt_loss,
                    grads=(list(ref.named_parameters()), grads), **kw)
        _PLAIN[key] = (got, state_of(ref), grads)
        torch._dynamo.reset()
    return _PLAIN[key]


# ---- the three ways of compiling -------------------------------------------------------------
HOWS = ["torch.compile(model)", "model.compile()", "block.compile()", "torch.compile(block)",
        "initialize(torch.compile(model))", "initialize(block.compile())",
        "initialize(torch.compile(block))"]


@pytest.mark.parametrize("how,mode", [(h, "host") for h in HOWS] + [
    (h, "sim") for h in ("torch.compile(model)", "block.compile()",
                         "initialize(torch.compile(model))")])
def test_the_three_ways_of_compiling_train_as_plain_torch_compiled_the_same_way(how, mode):
    ref, ours = make_pair()
    data = batches(3)
    budget = model_bytes(ref) // 3  # chunks move every step on SimDevice
    call, opt = managed(ours, how, cfg(mode, budget), blocks_of_gpt)
    assert tiermem.runtime_of(call)._resident == (mode == "host")
    got = train(call, opt, data, gpt_loss)
    # dynamo traced none of tiermem's own code: a graph break anywhere is a unit boundary.
    breaks = list(counters["graph_break"])
    assert all("tiermem: a tiermem unit's forward" in b for b in breaks), breaks
    want, state, _ = plain_gpt(plain_how(how), len(data))
    assert_same_training(got, want)
    assert got[1] >= len(ref.blocks)  # every block ran a compiled graph
    assert_same_state(call, state)


def test_compiled_eval_between_steps_gives_plain_outputs_and_changes_nothing():
    # A no_grad forward compiles once more (grad mode is in dynamo's guards, as for plain
    # torch); the training steps around it stay exact and compile nothing again.
    ref, ours = make_pair()
    data = batches(4)
    model, opt = tiermem.initialize(ours, cfg("sim", model_bytes(ref) // 3))
    call, rcall = torch.compile(model, backend=BACKEND), torch.compile(ref, backend=BACKEND)
    ropt = KernelAdamW(ref.parameters(), **OPT)
    x = data[0][0]
    for i in range(2):
        assert train(call, opt, data[2 * i:2 * i + 2], gpt_loss)[0] == \
            train(rcall, ropt, data[2 * i:2 * i + 2], gpt_loss)[0]
        with torch.no_grad():
            torch.testing.assert_close(call(x), rcall(x), rtol=0, atol=0)
    assert_same_state(model, ref)


def test_fullgraph_holds_per_unit_and_across_a_unit_boundary_is_a_clear_error():
    # torch.compile(model, fullgraph=True): each unit's forward is one graph (the model's own
    # code between units runs eagerly, outside every graph). A compiled function around the
    # model cannot be one graph: a unit boundary is a graph break, and dynamo's error says
    # so with tiermem's reason before anything is acquired; the model trains on.
    ref, ours = make_pair()
    data = batches(3)
    model, opt = tiermem.initialize(ours, cfg("sim", model_bytes(ref) // 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    @torch.compile(fullgraph=True, backend=BACKEND)
    def loss_of(x, y):
        return model(x, y)
    with pytest.raises(Exception, match=r"tiermem: a tiermem unit's forward .* fullgraph=True"):
        loss_of(*data[0])
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    rt = tiermem.runtime_of(model)
    assert rt._root_depth == 0 and not rt._in_iteration
    got = train(torch.compile(model, fullgraph=True, backend=BACKEND), opt, data, gpt_loss)
    want, _, _ = plain_gpt("torch.compile(model)", len(data))  # one graph: fullgraph holds
    assert_same_training(got, want)
    assert got[1] >= len(ref.blocks)


class _BrokenBlock(torch.nn.Module):
    """A block whose forward has a graph break in the middle: the code around it runs
    eagerly with the compile callback active, where autograd calls tiermem's hooks."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        torch._dynamo.graph_break()
        return x + self.b(h.tanh())


@pytest.mark.parametrize("acts", ["recompute"])
def test_a_unit_with_a_graph_break_inside_trains_exactly(acts):
    # A unit's forward compiled as two graphs and a resume: both save through tiermem's
    # hooks, and the recompute runs both again. The only graph breaks are the unit's own
    # and the boundaries; the training is plain compiled torch's.
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[_BrokenBlock() for _ in range(3)])
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 32, generator=g) for _ in range(3)]
    nbytes = sum(p.numel() for p in ref.parameters()) * 16
    model, opt = tiermem.initialize(ours, cfg("sim", nbytes // 2 + 200_000, activations=acts))
    loss_of = (lambda c, x: c(x).square().mean())
    got = train(torch.compile(model, backend=BACKEND), opt, data, loss_of)
    breaks = list(counters["graph_break"])
    assert breaks and all("graph_break" in b or "tiermem: a tiermem unit's forward" in b
                          for b in breaks), breaks
    torch._dynamo.reset()
    want = train(torch.compile(ref, backend=BACKEND), KernelAdamW(ref.parameters(), **OPT),
                 data, loss_of)
    assert_same_training(got, want)
    assert_same_state(model, ref)


class _Scaled(torch.nn.Module):
    """A module with parameters of its own around repeated blocks: a unit that holds units."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((32,), 0.5))
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(3))

    def forward(self, x):
        x = x * self.scale
        for b in self.blocks:
            x = x + b(x)
        return x.square().mean()


@pytest.mark.parametrize("acts", ["recompute"])
def test_a_compiled_training_step_runs_the_backward_hooks_eagerly(acts):
    # A compiled function doing the forward and the backward: dynamo breaks the graph at
    # the model's call and at backward(), and runs the backward with its callback active,
    # where autograd calls tiermem's unpack, gradient and end-of-backward hooks and the
    # recompute. They run eagerly: the only graph breaks are the model's call and backward.
    ref, ours = make_pair()
    data = batches(3)
    model, opt = tiermem.initialize(ours, cfg("sim", model_bytes(ref) // 3 + 1_000_000,
                                              activations=acts))

    def step_of(m):
        @torch.compile(backend=BACKEND)
        def step(x, y):
            loss = m(x, y)
            loss.backward()
            return loss.detach()
        return step

    def run(step, opt):
        losses = []
        for i, (x, y) in enumerate(data):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                opt.zero_grad()
                losses.append(step(x, y).item())
                opt.step()
        return losses

    got = run(step_of(model), opt)
    breaks = list(counters["graph_break"])
    assert all("tiermem: a tiermem unit's forward" in b or "backward" in b for b in breaks), \
        breaks
    if acts == "recompute":
        assert tiermem.runtime_of(model).stats()["activations"]["recomputed_units"] >= 3
    torch._dynamo.reset()
    assert got == run(step_of(ref), KernelAdamW(ref.parameters(), **OPT))
    assert_same_state(model, ref)


def test_a_unit_holding_units_runs_its_own_code_eagerly_and_compiles_them():
    # The root's own parameter makes it a unit that holds the blocks' units: its code runs
    # eagerly (as a model's forward does) and each block compiles, once for all three.
    torch.manual_seed(0)
    ref = _Scaled()
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 32, generator=g) for _ in range(3)]
    model, opt = tiermem.initialize(ours, cfg("host"))
    assert [u.direct_only for u in tiermem.runtime_of(model).units][0]
    got = train(torch.compile(model, backend=BACKEND), opt, data, lambda c, x: c(x))
    torch._dynamo.reset()
    want = train(torch.compile(ref, backend=BACKEND), KernelAdamW(ref.parameters(), **OPT),
                 data, lambda c, x: c(x))
    assert_same_training(got, want)
    assert got[1] == len(ref.blocks)
    assert_same_state(model, ref)


def test_a_served_model_compiles_and_gives_plain_outputs():
    # tiermem.inference: the same boundaries (weights streamed in per unit, eagerly), the
    # units' forwards compiled under no_grad, once.
    ref, ours = make_pair()
    model = tiermem.inference(ours, cfg("sim", model_bytes(ref) // 8))
    call, rcall = torch.compile(model, backend=BACKEND), torch.compile(ref, backend=BACKEND)
    xs = [x for x, _ in batches(3)]
    with torch.no_grad():
        for i, x in enumerate(xs):
            if i == 1:
                graphs = counters["stats"]["unique_graphs"]
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                torch.testing.assert_close(call(x), rcall(x), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == graphs > 0


# ---- activations, plan, accumulation, clipping, gradients -------------------------------------
@pytest.mark.parametrize("mode,acts", [("host", "budget"), ("host", "recompute"),
                                       ("sim", "budget"), ("sim", "offload"),
                                       ("sim", "recompute"), ("sim", "auto"),
                                       ("sim-async", "offload")])
def test_activations_policies_train_exactly_under_compile(mode, acts):
    # Saved tensors of a compiled unit come from its graph's save_for_backward, through
    # tiermem's hooks: counted, offloaded, or recomputed by running the same compiled graph
    # again (the recompute checks it saves the same tensors). Budgets as in
    # test_activations.py: below the activations for offload, recompute and auto.
    ref, ours = make_pair()
    data = batches(4, batch=32)
    host = 2_500_000 if acts == "auto" else "256MiB"
    budget = 2_400_000 if acts in ("offload", "recompute", "auto") else \
        model_bytes(ref) // 4 + 4_000_000
    model, opt = tiermem.initialize(ours, cfg(mode, budget, activations=acts, host=host))
    call = torch.compile(model, backend=BACKEND)
    got = train(call, opt, data, gpt_loss)
    rt = tiermem.runtime_of(model)
    st = rt.stats().get("activations", {})
    if acts in ("offload", "auto"):
        assert st["offloaded_bytes"] > 0, st
    if acts in ("recompute", "auto"):
        assert st["recomputed_units"] >= len(ref.blocks), st
    assert not rt.timeline_peaks()["over_budget"]
    want, state, _ = plain_gpt("torch.compile(model)", len(data), batch=32)
    assert_same_training(got, want)
    assert_same_state(model, state)


def test_plan_auto_is_followed_under_compile():
    ref, ours = make_pair()
    data = batches(7)
    model, opt = tiermem.initialize(ours, cfg("sim", model_bytes(ref) // 4, plan="auto"))
    got = train(torch.compile(model, backend=BACKEND), opt, data, gpt_loss)
    p = tiermem.runtime_of(model).stats()["plan"]
    assert p["active"] and p["divergences"] == 0 and p["followed_iterations"] >= 3, p
    want, state, _ = plain_gpt("torch.compile(model)", len(data))
    assert_same_training(got, want)
    assert_same_state(model, state)


@pytest.mark.parametrize("mode", ["host", "sim"])
def test_accumulation_clipping_and_p_grad_are_plain_torchs_under_compile(mode):
    ref, ours = make_pair()
    data = batches(3)
    model, opt = tiermem.initialize(ours, cfg(mode, model_bytes(ref) // 3))
    grads = []
    got = train(torch.compile(model, backend=BACKEND), opt, data, gpt_loss, accumulate=2,
                clip=0.05, grads=(list(model.named_parameters()), grads))
    want, state, ref_grads = plain_gpt("torch.compile(model)", len(data), accumulate=2,
                                       clip=0.05)
    assert_same_training(got, want)
    assert len(grads) == len(ref_grads) == len(data)
    for g, rg in zip(grads, ref_grads):
        assert g.keys() == rg.keys()
        for k in rg:
            assert torch.equal(g[k], rg[k]), k
    assert_same_state(model, state)


# ---- other models --------------------------------------------------------------------------
pytest.importorskip("transformers")
from test_hf import batches as hf_batches, gpt2 as hf_gpt2, llama as hf_llama  # noqa: E402


def hf_loss(call, ids):
    return call(input_ids=ids, labels=ids, use_cache=False).loss


def hf_blocks(model):
    base = getattr(model, "base_model", model)
    inner = getattr(base, "model", base)  # a PEFT model's LoraModel holds the HF model
    for path in ("transformer.h", "model.layers"):
        m = inner
        try:
            for a in path.split("."):
                m = getattr(m, a)
            return m
        except AttributeError:
            continue
    raise AssertionError(type(model))


def _compare_compiled(make, data, loss_of, blocks, mode, how="torch.compile(model)",
                      units=None, lr=2e-3, learns=True):
    """Trains `make()` managed and plain, both compiled `how`: losses within 1e-5 relative
    over the steps, parameters within conftest's end-to-end bounds. Not bit for bit: the
    plain model compiles as one graph where the managed one runs the code between its units
    eagerly (Hugging Face's rotary embeddings, masks and loss), and AOT autograd's
    decompositions round differently from eager kernels in the last bits."""
    torch.manual_seed(0)
    ref = make()
    ours = copy.deepcopy(ref)
    nbytes = sum(p.numel() for p in ref.parameters()) * 16
    opt_args = dict(OPT, lr=lr)
    call, opt = managed(ours, how, cfg(mode, nbytes // 3 + 1_000_000, optimizer=opt_args),
                        blocks, units=units)
    got = train(call, opt, data, loss_of)
    torch._dynamo.reset()
    rparams = [p for p in ref.parameters() if p.requires_grad]
    want = train(compile_as(ref, plain_how(how), blocks), KernelAdamW(rparams, **opt_args), data,
                 loss_of)
    assert_same_training(got, want, rel=1e-5)
    assert want[0][-1] < want[0][0] or not learns
    assert_same_state(call, ref, rtol=END_TO_END_PARAM_RTOL, atol=END_TO_END_PARAM_ATOL)
    return call, ref


def test_hugging_face_gpt2_trains_as_plain_compiled_torch():
    # (Llama: the LoRA test below, and the slow 10-step test.)
    _compare_compiled(hf_gpt2, hf_batches(6), hf_loss, hf_blocks, "sim")


def test_transformer_encoder_trains_exactly_under_compile():
    def loss_of(call, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(call(x).flatten(0, 1), y.flatten())
    _compare_compiled(lambda: encoder_lm(), encoder_batches(6, batch=4, seq=16), loss_of,
                      lambda m: m[0].layers, "host")


def test_peft_lora_model_trains_exactly_under_compile():
    peft = pytest.importorskip("peft")

    def make():
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               lora_dropout=0.0, init_lora_weights="gaussian")
        return peft.get_peft_model(hf_llama(), lora)

    torch.manual_seed(0)
    before = make().state_dict()
    model, ref = _compare_compiled(make, hf_batches(6), hf_loss, hf_blocks, "sim", lr=1e-2,
                                   learns=False)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    # The adapters trained (lora_B starts at zero) and the frozen base did not move.
    after = getattr(model, "_orig_mod", model).state_dict()
    moved = {k for k, v in before.items() if not torch.equal(after[k], v)}
    assert moved and all("lora_B" in k or "lora_A" in k for k in moved), sorted(moved)[:4]
    assert any("lora_B" in k for k in moved)


def test_bf16_autocast_under_compile_is_within_2e_2_of_plain_torch():
    def loss_of(call, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call(*batch)
    ref, ours = make_pair()
    data = batches(6)
    model, opt = tiermem.initialize(ours, cfg("host"))
    got = train(torch.compile(model, backend=BACKEND), opt, data, loss_of)
    torch._dynamo.reset()
    want = train(torch.compile(ref, backend=BACKEND), KernelAdamW(ref.parameters(), **OPT),
                 data, loss_of)
    assert_same_training(got, want, rel=2e-2)
    assert want[0][-1] < want[0][0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_under_compile_trains_as_tiermem_eager(precision):
    # The units compute on bf16 / fp16 chunk views, the fp32 masters step in the core (fp16:
    # with loss scaling); compiled, the same losses bit for bit as the same model eager.
    data = batches(3)
    runs = []
    for compiled in (False, True):
        ref, ours = make_pair()
        model, opt = tiermem.initialize(ours, cfg("sim", model_bytes(ref) // 3,
                                                  precision=precision))
        call = torch.compile(model, backend=BACKEND) if compiled else model
        runs.append(train(call, opt, data, gpt_loss))
    assert runs[0][1] == 0 and runs[1][1] >= len(ref.blocks)
    assert runs[0][0] == runs[1][0]


# ---- inductor --------------------------------------------------------------------------------
def test_inductor_compiled_units_train_as_plain_torch_within_1e_5():
    # Inductor's generated code reading the chunk views in place (host mode; a parameter's
    # view may start anywhere in its chunk: inductor copies misaligned inputs) and, the
    # blocks recomputed in the backward, run again. Two GPT blocks and nothing else, so one
    # graph compiles (about a minute of C++ on two cores; the other models under inductor
    # are the slow test below). The reference compiles the same blocks.
    def blocks():
        torch.manual_seed(0)
        return torch.nn.Sequential(Block(small_config()), Block(small_config()))
    ref = blocks()
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, 32, generator=g) for _ in range(3)]
    loss_of = (lambda c, x: c(x).square().mean())
    model, opt = tiermem.initialize(ours, cfg("host", activations="recompute"),
                                    units=[Block])
    got = train(torch.compile(model), opt, data, loss_of)
    st = tiermem.runtime_of(model).stats()["activations"]
    assert st["recomputed_units"] >= 2 * len(data), st
    torch._dynamo.reset()
    want = train(compile_as(ref, "block.compile()", lambda m: m, backend="inductor"),
                 KernelAdamW(ref.parameters(), **OPT), data, loss_of)
    assert_same_training(got, want, rel=1e-5)
    assert_same_state(model, ref, rtol=END_TO_END_PARAM_RTOL, atol=END_TO_END_PARAM_ATOL)


# ---- measured (slow): every model of the issue, inductor, 10 steps -------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "encoder", "gpt2", "llama", "lora", "gpt-bf16-autocast"])
def test_inductor_over_10_steps_is_within_the_issues_bounds_of_plain_compiled_torch(name):
    # docs/benchmarks.md "torch.compile": losses within 1e-5 relative of plain torch compiled the
    # same way (torch.compile(model), inductor) over 10 steps in fp32, within 2e-2 under bf16
    # autocast; host mode. Prints the largest relative difference.
    def gpt_autocast(call, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call(*batch)

    def encoder_loss(call, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(call(x).flatten(0, 1), y.flatten())

    def lora():
        peft = pytest.importorskip("peft")
        lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0, init_lora_weights="gaussian")
        return peft.get_peft_model(hf_llama(), lc)

    cases = {"gpt": (lambda: make_pair()[0], batches(10), gpt_loss, 1e-5),
             "gpt-bf16-autocast": (lambda: make_pair()[0], batches(10), gpt_autocast, 2e-2),
             "encoder": (encoder_lm, encoder_batches(10, batch=4, seq=16), encoder_loss, 1e-5),
             "gpt2": (hf_gpt2, hf_batches(10), hf_loss, 1e-5),
             "llama": (hf_llama, hf_batches(10), hf_loss, 1e-5),
             "lora": (lora, hf_batches(10), hf_loss, 1e-5)}
    make, data, loss_of, rel = cases[name]
    torch.manual_seed(0)
    ref = make()
    ours = copy.deepcopy(ref)
    model, opt = tiermem.initialize(ours, cfg("host", optimizer=dict(OPT, lr=2e-3)))
    got = train(torch.compile(model), opt, data, loss_of)
    torch._dynamo.reset()
    rparams = [p for p in ref.parameters() if p.requires_grad]
    want = train(torch.compile(ref), KernelAdamW(rparams, **dict(OPT, lr=2e-3)), data, loss_of)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0]))
    print(f"\n{name}: 10 steps, max relative loss difference {worst:.2e} (bound {rel:g}); "
          f"losses {want[0][0]:.4f} -> {want[0][-1]:.4f}")
    assert_same_training(got, want, rel=rel)
