"""The config's modes as enums (runtime/modes.h through csrc/config.cc), the runtime's one
frozen Modes (shared.py) built from them and from the session's answers, the run state's
phases (shared.Phase), and an NVMe directory that does not exist."""
import copy
import dataclasses
import re

import pytest
import torch

import tiermem
from conftest import batches, make_pair, model_bytes
from tiermem.config import parse_config
from tiermem.shared import Phase

# (config key, Config attribute, enum) of every mode.
MODES = [("precision", "precision", tiermem.Precision),
         ("device_kind", "device_kind", tiermem.DeviceKind),
         ("kernel_isa", "kernel_isa", tiermem.KernelIsa),
         ("plan", "plan", tiermem.PlanMode),
         ("activations", "activations", tiermem.ActivationMode),
         ("optimizer_placement", "optimizer_placement", tiermem.OptimizerPlacement),
         ("optimizer_overlap", "optimizer_overlap", tiermem.OptimizerOverlap),
         ("checkpoint_io", "checkpoint_io", tiermem.CheckpointIo),
         ("unmaterialized_reads", "unmaterialized_reads", tiermem.UnmaterializedReads)]


def _choices(key, config):
    """The spellings the parser's error lists for `key` (in its table's order)."""
    with pytest.raises(ValueError) as e:
        parse_config(config, env={})
    m = re.search(rf"config '{re.escape(key)}': expected one of (.*), got", str(e.value))
    assert m, str(e.value)
    return [c.strip("'") for c in m.group(1).split(", ")]


@pytest.mark.parametrize("key,attr,enum", MODES, ids=[m[0] for m in MODES])
def test_each_mode_is_an_enum_spelled_by_the_parsers_table(key, attr, enum):
    """The Python enum has one value per spelling the parser accepts, str() is the spelling,
    and parsing any spelling gives that value: one table serves both."""
    spellings = _choices(key, {key: "no-such-value"})
    assert sorted(str(v) for v in enum.__members__.values()) == sorted(spellings)
    for name in spellings:
        got = getattr(parse_config({key: name}, env={}), attr)
        assert isinstance(got, enum)
        assert got == getattr(enum, name.replace("-", "_"))
        assert str(got) == name and f"{got}" == name


def test_comparing_a_mode_with_a_string_raises_instead_of_being_false():
    """`cfg.precision == "bf16"` was how code asked before the modes were types; it would now
    be False whatever the precision, so it raises."""
    cfg = parse_config({"precision": "bf16", "device_kind": "sim"}, env={})
    with pytest.raises(TypeError, match=r"tiermem.Precision.bf16 compared with the string 'bf16'"):
        cfg.precision == "bf16"  # noqa: B015
    with pytest.raises(TypeError, match="compared with the string 'sim'"):
        cfg.device_kind != "sim"  # noqa: B015
    assert cfg.precision == tiermem.Precision.bf16 and cfg.precision != tiermem.Precision.fp16
    assert cfg.device_kind != 3 and cfg.device_kind != tiermem.PlanMode.auto
    assert {cfg.precision: 1}[tiermem.Precision.bf16] == 1  # still hashable


def test_nvme_engine_is_an_enum_too():
    spellings = _choices("nvme.engine", {"nvme": {"size": "1MiB", "engine": "spdk"}})
    assert sorted(str(v) for v in tiermem.NvmeEngine.__members__.values()) == sorted(spellings)
    c = parse_config({"nvme": {"size": "1MiB", "engine": "posix"}}, env={})
    assert c.nvme_engine == tiermem.NvmeEngine.posix


def test_the_predicates_code_asks():
    A = tiermem.ActivationMode
    rows = {A.outside: (False, False, False, False), A.budget: (True, False, False, False),
            A.offload: (True, True, False, False), A.recompute: (True, False, True, False),
            A.auto: (True, True, False, True)}
    assert set(rows) == set(A.__members__.values())
    for mode, want in rows.items():
        assert (mode.counted, mode.offloaded, mode.recompute_every_unit, mode.planned) == want, mode
    D = tiermem.DeviceKind
    assert [k.is_cuda for k in (D.auto, D.cuda, D.host)] == [False, True, False]
    assert D.host.host_compute and not D.sim.host_compute
    assert D.sim.simulated and D.sim_async.simulated and not D.cuda.simulated
    assert D.sim_async.async_sim and not D.sim.async_sim
    P = tiermem.Precision
    assert [p.mixed for p in (P.fp32, P.bf16, P.fp16)] == [False, True, True]
    assert [p.loss_scaled for p in (P.fp32, P.bf16, P.fp16)] == [False, False, True]
    assert [p.torch_dtype for p in (P.fp32, P.bf16, P.fp16)] == [torch.float32, torch.bfloat16,
                                                                   torch.float16]
    O = tiermem.OptimizerOverlap
    assert [o.deferred for o in (O.next_forward, O.backward, O.off)] == [True, True, False]
    assert [o.speculative for o in (O.next_forward, O.backward, O.off)] == [False, True, False]
    assert [p.plans for p in (tiermem.PlanMode.off, tiermem.PlanMode.auto)] == [False, True]
    assert tiermem.UnmaterializedReads.error.raises
    assert not tiermem.UnmaterializedReads.materialize.raises


@pytest.mark.parametrize("precision,dtype,esize", [("fp32", torch.float32, 4),
                                                   ("bf16", torch.bfloat16, 2)])
def test_runtime_modes_are_frozen_and_answered_by_the_session(precision, dtype, esize):
    _, ours = make_pair()
    model, _ = tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ours) // 4,
                                         "host": "1GiB", "precision": precision,
                                         "activations": "budget"})
    rt = tiermem.runtime_of(model)
    s = rt.session
    assert s.compute_dtype == dtype and rt.modes.dtype == dtype
    assert s.compute_element_size == esize
    assert rt.modes.mixed == (precision != "fp32") and not rt.modes.loss_scaled
    assert rt.modes.activations == tiermem.ActivationMode.budget and not rt.modes.resident
    assert rt.modes.hold_grads == s.holds_grad_chunks and not rt.modes.nvme
    assert rt.modes.serving is False and rt.modes.strict is False
    # The parts hold the one object, and nothing can change it.
    assert rt.ops.modes is rt.modes and rt.grads.modes is rt.modes
    assert rt.materializer.modes is rt.modes
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.modes.resident = True
    # The caps the runtime used are the session's, for its largest unit.
    most = max(len(u.groups) for u in rt.units)
    assert rt.activations.cap == s.activation_cap(most)
    per_group = s.chunk_elems * esize * 2
    assert s.activation_cap(most) == max(0, s.compute_budget - 2 * most * per_group)
    assert s.compute_budget == model_bytes(ours) // 4
    assert s.compute_tier_holds_every_chunk == (s.compute_budget >= s.total_chunk_bytes)
    rt.close()


def test_the_run_state_walks_its_phases():
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ours) // 4,
                                           "host": "1GiB"})
    rt = tiermem.runtime_of(model)
    seen = []
    model.blocks[1].register_forward_hook(lambda *a: seen.append(("fwd", rt.state.phase)))
    # The gradient of block 0's output is computed once block 1's backward ran (tiermem's
    # hooks began the backward by then).
    def watch(m, i, out):
        if out.requires_grad:
            out.register_hook(lambda g: seen.append(("bwd", rt.state.phase)))
    model.blocks[0].register_forward_hook(watch)
    (x, y) = batches(1)[0]
    assert rt.state.phase is Phase.IDLE and not rt.state.in_iteration
    loss = model(x, y)
    assert rt.state.phase is Phase.FORWARD and rt.state.in_iteration and rt.state.in_forward
    loss.backward()
    assert seen == [("fwd", Phase.FORWARD), ("bwd", Phase.BACKWARD)]
    assert rt.state.phase is Phase.IDLE and not rt.state.in_backward
    opt.step()
    with torch.no_grad():
        model(x, y)  # an eval forward begins no iteration
    assert rt.state.phase is Phase.IDLE
    rt.close()
    assert rt.state.phase is Phase.CLOSED and rt.state.closed


def test_an_nvme_directory_that_does_not_exist_is_an_error(tmp_path):
    """Configured, it is refused before the model is touched, even when nothing would spill
    (a 4 MiB host budget holds this model); nothing of the path is created."""
    _, ours = make_pair()
    before = copy.deepcopy(ours.state_dict())
    path = tmp_path / "none" / "x"
    with pytest.raises(ValueError, match=re.escape(f"config 'nvme.path': '{path}' is not a "
                                                   "writable directory (it does not exist")):
        tiermem.initialize(ours, {"host": "4MiB", "nvme": {"size": "64MiB", "path": str(path)}})
    assert not (tmp_path / "none").exists()
    for k, v in ours.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert getattr(ours, "_tiermem_runtime", None) is None


def test_the_run_phase_is_an_enum_and_the_protocol_doors_are_gone():
    """Session.phase takes a RunPhase (runtime/phase.h), never a string; the calls the unit
    protocol owns (Session.units) are not on the Session any more."""
    from tiermem import _C
    assert [str(p) for p in _C.RunPhase.__members__.values()] == [
        "none", "forward", "backward", "eval", "optimizer", "recompute"]
    model, opt = tiermem.initialize(make_pair()[1], {"device_kind": "sim"})
    s = tiermem.runtime_of(model).session
    s.phase(_C.RunPhase.recompute)
    with pytest.raises(TypeError):
        s.phase("recompute")
    for gone in ("begin_iteration", "finish_steps", "moment"):
        assert not hasattr(s, gone), gone
    assert hasattr(s.units, "begin_iteration")
    tiermem.runtime_of(model).close()
