"""The session's records cross the binding by name (csrc/records.cc): what Session takes
(TensorSpec, GroupHyper, ScalerState, GradStats, Sharding, Region) and returns (ChunkGroup,
Piece, PieceRef, StateFormat, GradStats, StepResult, Scratch, Region) are classes with named,
read-only fields; a tuple where a record is expected is refused."""
import json

import pytest
import torch

from tiermem import _C


def _session(specs):
    cfg = _C.parse_config(json.dumps({"device_kind": "sim", "device": "16MiB", "host": "64MiB",
                                      "chunk_size": 4096}))
    return _C.Session(cfg, specs)


def _specs():
    return [_C.TensorSpec(name="w", numel=12, trainable=True, opt_group=0, shape=[3, 4]),
            _C.TensorSpec(name="frozen", numel=5, trainable=False, opt_group=0)]


def test_tensor_spec_fields_and_defaults():
    t = _C.TensorSpec(name="w", numel=12, trainable=True, opt_group=1, shape=[3, 4])
    assert (t.name, t.numel, t.trainable, t.opt_group, t.shape) == ("w", 12, True, 1, [3, 4])
    assert (t.expert_set, t.expert) == (-1, -1)
    assert "numel=12" in repr(t) and "name='w'" in repr(t)
    with pytest.raises(AttributeError):
        t.numel = 3  # read-only


def test_groups_and_pieces_are_named():
    s = _session(_specs())
    try:
        trainable = [g for g in range(s.num_groups) if s.group(g).trainable]
        frozen = [g for g in range(s.num_groups) if not s.group(g).trainable]
        assert len(trainable) == 1 and len(frozen) == 1
        g = s.group(trainable[0])
        assert g.tensors == [0] and g.used_elems >= 12
        assert [(r.tensor, r.piece) for r in g.pieces] == [(0, 0)]
        (pc,) = s.place(0)
        assert (pc.group, pc.offset, pc.numel, pc.begin, pc.expert) == (trainable[0], 0, 12, 0, -1)
        f = s.state_format(trainable[0])
        assert (f.dtype, f.stochastic) == ("fp32", False)
        with pytest.raises(ValueError):
            s.group(s.num_groups)
    finally:
        s.close()


def test_a_tuple_spec_is_refused():
    with pytest.raises(TypeError):
        _session([("w", 12, True, 0)])


def test_scaler_and_hyper_round_trip():
    s = _session(_specs())
    try:
        s.scaler = _C.ScalerState(scale=8.0, good_steps=2, skipped_steps=1)
        st = s.scaler
        assert (st.scale, st.good_steps, st.skipped_steps) == (8.0, 2, 1)
        with pytest.raises(TypeError):
            s.scaler = (8.0, 2, 1)
        s.write_param(0, torch.ones(12))
        s.set_has_grad([True, False])
        h = _C.GroupHyper(lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        assert (h.lr, h.beta1, h.weight_decay) == (0.5, 0.9, 0.0)
        with pytest.raises(TypeError):
            s.step([(0.5, 0.9, 0.999, 1e-8, 0.0)])
        res = s.step([h])
        assert isinstance(res, _C.StepResult)
        assert (res.applied, res.skipped, res.clip_coef) == (True, False, 1.0)
    finally:
        s.close()


def test_grad_stats_and_a_global_step_are_records():
    s = _session(_specs())
    try:
        s.write_param(0, torch.zeros(12))
        s.set_has_grad([True, False])
        g = s.acquire_for_write(0, _C.ChunkKind.grad, s.compute_tier)
        g[:12] = torch.arange(12, dtype=torch.float32)
        s.release(0, _C.ChunkKind.grad, True)
        st = s.grad_stats()
        assert (st.sq_norm, st.overflow) == (float(sum(i * i for i in range(12))), False)
        with pytest.raises(AttributeError):
            st.sq_norm = 0.0  # read-only
        h = _C.GroupHyper(lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        with pytest.raises(TypeError):
            s.step([h], (st.sq_norm, st.overflow))  # a tuple is refused
        res = s.step([h], _C.GradStats(st.sq_norm, False))  # as a sharded all-reduce gives
        assert res.applied and not res.skipped
    finally:
        s.close()
    assert _C.GradStats(4.0, True).overflow and _C.GradStats(4.0, True).sq_norm == 4.0
    st = _C.grad_stats(torch.tensor([3.0, 4.0]))
    assert (st.sq_norm, st.overflow) == (25.0, False)
    assert _C.grad_stats(torch.tensor([1.0, float("inf")])).overflow


def test_scratch_and_spill_regions_are_records():
    s = _session(_specs())
    try:
        sc = s.allocate_scratch(_C.Tier.host, 8192)
        assert isinstance(sc.region, _C.Region) and sc.region.bytes >= 8192
        assert sc.region.addr == sc.view.data_ptr() and sc.view.dtype == torch.uint8
        with pytest.raises(TypeError):
            s.free_scratch(_C.Tier.host, (sc.region.id, sc.region.bytes, sc.region.addr))
        s.free_scratch(_C.Tier.host, sc.region)
    finally:
        s.close()


def test_a_tuple_sharding_is_refused():
    with pytest.raises(TypeError):
        _C.Session(_C.parse_config(json.dumps({"device_kind": "sim", "device": "16MiB",
                                               "host": "64MiB", "chunk_size": 4096})),
                   _specs(), (2, 0, None))
    sh = _C.Sharding(world=2, rank=1, collectives=None)
    assert (sh.world, sh.rank, sh.collectives) == (2, 1, None)
