"""The asynchronous SimDevice (device_kind 'sim-async', tiers/fake/sim_device.h): every copy to
and from the device lands after a random delay, on one of several threads, so copies complete
late and out of order. Training through it must still equal plain torch bit for bit: the engine
never lets the model read a chunk before its copy landed, and nothing relies on copies
completing in the order they were issued.

On a CPU, torch's work runs on the calling thread, so over the bindings this mode proves the
copy side of the ordering contract. The compute side (device work queued on a stream that runs
late: write-backs after torch's writes, reuse of freed memory after queued reads) is proven
where a stream can lag — engine_ordering_test and session_placement_test run a SimStream, and
each drops a wait to show that the tests notice (tests/tiers/sim_device_test.cc)."""
import pytest
import torch

import tiermem
from conftest import (KernelAdamW, assert_placement_changes_nothing, batches, chunk_total,
                      make_pair, model_bytes, placement_budget, train_each_placement,
                      train_steps)


def cfg(budget, **kw):
    c = {"device": budget, "host": "256MiB", "device_kind": "sim-async",
         "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    c.update(kw)
    return c


def reference(steps=10, **kw):
    ref, ours = make_pair(**kw)
    data = batches(steps, **kw)
    losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01), data)
    return ref, ours, data, losses


def assert_same(model, ref):
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


@pytest.mark.parametrize("plan", ["off", "always"])
def test_quarter_budget_with_nvme_homes_equals_plain_torch(plan, tmp_path):
    ref, ours, data, ref_losses = reference(12)
    budget = model_bytes(ref) // 4
    model, opt = tiermem.initialize(ours, cfg(budget, plan=plan, host=model_bytes(ref) * 3 // 4,
                                              nvme={"path": str(tmp_path), "size": "256MiB"}))
    rt = tiermem.runtime_of(model)
    assert rt.session.device_kind == tiermem.DeviceKind.sim_async
    assert train_steps(model, opt, data) == ref_losses
    assert_same(model, ref)
    st = rt.stats()
    assert st["prefetches"] + st["plan"]["prefetches"] > 0 and st["evictions"] > 0, st
    assert st["bytes_moved"].get("nvme->host", 0) > 0, st
    assert not rt.timeline_peaks()["over_budget"]


def test_device_placed_optimizer_groups_equal_host_placed_and_plain_torch():
    # Room for every compute and grad chunk and the optimizer state of some groups, not all.
    ref, _, data, ref_losses = reference(8)
    base = cfg(0, chunk_size=4096)
    runs = train_each_placement(base, data, placement_budget(chunk_total(base)))
    assert_placement_changes_nothing(runs)
    assert runs["auto"][0] == ref_losses
    for k, v in ref.state_dict().items():
        assert torch.equal(runs["auto"][1][k], v), k
    # Placed groups' params and grads never went down to the host.
    assert runs["auto"][4].get("device->host", 0) < runs["host"][4].get("device->host", 0)


@pytest.mark.parametrize("acts", ["offload", "recompute", "auto"])
def test_activation_offload_and_recompute_equal_plain_torch(acts):
    # test_activations.py's case: 3.5 MB of saved activations per step, a 2.4 MB device budget.
    # Recomputed units re-acquire their chunks in the backward while copies land late.
    ref, ours = make_pair()
    data = batches(8, batch=32)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    # auto: a host budget that holds only part of them (the rest is dropped and recomputed).
    host = 2_500_000 if acts == "auto" else "256MiB"
    model, opt = tiermem.initialize(ours, cfg(2_400_000, activations=acts, plan="always",
                                              host=host))
    rt = tiermem.runtime_of(model)
    assert train_steps(model, opt, data) == ref_losses
    assert_same(model, ref)
    st = rt.stats()["activations"]
    assert (st["offloaded_bytes"] > 0) == (acts != "recompute"), st
    assert (st["recomputed_units"] > 0) == (acts != "offload"), st


def test_torch_transformer_encoder_equals_plain_torch():
    from test_plan import EncoderLM, token_batches
    torch.manual_seed(0)
    ref = EncoderLM()
    import copy
    ours = copy.deepcopy(ref)
    data = token_batches(8)
    ref_losses = train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01),
                             data)
    model, opt = tiermem.initialize(ours, cfg(model_bytes(ref) // 3, plan="always"))
    assert train_steps(model, opt, data) == ref_losses
    assert_same(model, ref)


def test_hf_gpt2_equals_plain_torch():
    hf = pytest.importorskip("test_hf")
    torch.manual_seed(0)
    ref = hf.gpt2()
    import copy
    ours = copy.deepcopy(ref)
    data = hf.batches(6)
    ref_losses = hf.train(ref, KernelAdamW(ref.parameters(), lr=1e-3, weight_decay=0.01), data)
    model, opt = tiermem.initialize(ours, cfg(hf.budget(ref), plan="always"))
    assert hf.train(model, opt, data) == ref_losses
    assert_same(model, ref)
