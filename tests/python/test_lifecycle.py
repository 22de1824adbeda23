"""A dropped model gives its memory back.

Nothing outside the model and its optimizer may keep a runtime alive: the hooks tiermem puts in
torch's C++ autograd metadata (which Python's garbage collector does not traverse) hold the
runtime weakly, so ``del model, opt`` and the collector close the session — its tiers' memory,
its NVMe files and its temporary timeline go with it. Before, every training runtime stayed
alive until the process ended: a sweep that built models in a loop kept every host budget, and
each run left a ``tiermem-*.tmt`` file in $TMPDIR.
"""
import copy
import gc
import glob
import os
import weakref

import pytest
import torch

import tiermem
from conftest import batches, make_pair, model_bytes
from test_training import train_ours

CONFIGS = {
    "default": {},
    "plan, offloaded activations, speculative steps": {
        "device_kind": "sim", "device": "1MiB", "plan": "always", "activations": "offload",
        "optimizer_overlap": "backward"},
    "host short: state on NVMe": {"host": "nvme"},
}


def _timelines(d):
    return glob.glob(os.path.join(d, "tiermem-*.tmt"))


@pytest.mark.parametrize("name", CONFIGS)
def test_a_dropped_training_model_is_collected_with_its_session(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the session's temporary timeline goes
    _, ours = make_pair()
    cfg = {"device_kind": "sim", "device": model_bytes(ours) // 4, "host": "1GiB", **CONFIGS[name]}  # 1/4 of the state
    if cfg["host"] == "nvme":  # the host below the training state: NVMe holds the rest
        mb = model_bytes(ours)
        cfg.update(host=mb // 2, nvme={"size": mb * 2, "path": str(tmp_path / "nvme")})
    model, opt = tiermem.initialize(ours, cfg)
    losses = train_ours(model, opt, batches(3))
    assert all(l == l for l in losses)  # trained (finite losses; exactness is tested elsewhere)
    session = tiermem.runtime_of(model).session
    if "nvme" in cfg:
        moved = tiermem.runtime_of(model).stats()["bytes_moved"]
        assert any(k.endswith("->nvme") for k in moved), moved  # the state did go to NVMe
        assert session.io_backend in ("io_uring", "posix")  # the NVMe tier's I/O backend
    else:
        assert session.io_backend == ""
    del session
    rt = weakref.ref(tiermem.runtime_of(model))
    assert len(_timelines(tmp_path)) == 1  # the session's temporary timeline, while it lives
    del model, opt, ours
    gc.collect()
    assert rt() is None, "the runtime outlived its model and optimizer"
    assert _timelines(tmp_path) == [], "the closed session left its temporary timeline behind"


def test_a_dropped_serving_model_is_collected_with_its_session(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    ref, _ = make_pair()
    model = tiermem.inference(copy.deepcopy(ref), {"device_kind": "sim", "device": model_bytes(ref) // 8,
                                                   "host": "256MiB"})
    x, _ = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    rt = weakref.ref(tiermem.runtime_of(model))
    del model
    gc.collect()
    assert rt() is None
    assert _timelines(tmp_path) == []


def test_a_parameter_kept_after_the_model_is_dropped_keeps_its_values(tmp_path, monkeypatch):
    """The other side of holding the runtime weakly in hooks: a tensor of the model the user
    still holds keeps the runtime (and its values) alive, as a torch parameter would."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    ref, ours = make_pair()
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ours) // 4, "host": "1GiB"})
    w = model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters())
    expected = dict(ref.named_parameters())
    name = next(n for n, p in model.named_parameters() if p is w)
    rt = weakref.ref(tiermem.runtime_of(model))
    del model, opt, ours
    gc.collect()
    assert rt() is not None
    torch.testing.assert_close(w.detach().clone(), expected[name].detach(), rtol=0, atol=0)
    del w
    gc.collect()
    assert rt() is None
    assert _timelines(tmp_path) == []


def test_a_gradient_kept_after_everything_else_is_dropped_raises_clearly(tmp_path, monkeypatch):
    """A gradient holds its runtime weakly (torch keeps ``p.grad`` where the collector cannot
    see it): once the model, optimizer and parameters are gone, using it is an error naming
    why — never values from freed memory."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ours) // 4, "host": "1GiB"})
    train_ours(model, opt, batches(1))
    g = next(model.parameters()).grad
    assert g is not None and float(g.abs().sum()) > 0
    del model, opt, ours
    gc.collect()
    with pytest.raises(RuntimeError, match="outlived its model"):
        g.sum()
    assert "collected" in repr(g)


# ---- graphs that never run backward ---------------------------------------------------------
# The saved-tensor hooks keep what a node saves; an output the node saves for itself (softmax,
# exp) has that node as its grad_fn, so keeping the tensor itself would be a cycle through
# autograd's C++ nodes that Python's collector cannot break. Backward frees saved tensors, so
# training hid it; a graph dropped without backward (an evaluation loss computed without
# no_grad) or cut short by an error stayed forever, with every activation it saved and the
# runtime its unpack hook is bound to (~880 MiB over 30 dropped forwards at batch 256 here).
class _Marker:
    pass


def _mark_graph(module):
    """Hangs a marker on the autograd node of `module`'s output (its metadata, owned by the
    node): the returned weakrefs die when the graph does."""
    refs = []

    def hook(m, i, out):
        marker = _Marker()
        out.grad_fn.metadata["lifecycle-probe"] = marker
        refs.append(weakref.ref(marker))
    module.register_forward_hook(hook)
    return refs


@pytest.mark.parametrize("activations", ["outside", "budget", "offload", "recompute", "auto"])
def test_a_forward_dropped_without_backward_frees_its_graph(activations, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": model_bytes(ours) // 4 + 200_000,
                                           "host": "256MiB", "activations": activations})
    outs = _mark_graph(model.blocks[0])
    x, y = batches(1, batch=2)[0]
    loss = model(x, y)  # with grad enabled, and no backward
    assert loss.grad_fn is not None and outs[0]() is not None  # the graph holds the marker
    del loss
    gc.collect()
    assert outs[0]() is None, "the dropped forward's graph (and its activations) stayed alive"
    # The model trains on as before, and is collected once dropped.
    assert all(l == l for l in train_ours(model, opt, batches(2, batch=2)))
    rt = weakref.ref(tiermem.runtime_of(model))
    del model, opt, ours
    gc.collect()
    assert rt() is None
    assert _timelines(tmp_path) == []


def test_a_step_that_raises_frees_its_graph_and_the_model_can_be_dropped(tmp_path, monkeypatch):
    """A MemoryError in the middle of a forward (activations that do not fit) leaves the
    partial graph to the caller's traceback only: once that is gone, so is the graph, and
    dropping the model frees its session."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    _, ours = make_pair()
    model, opt = tiermem.initialize(ours, {"device_kind": "sim", "device": 2_400_000, "host": "64MiB",
                                           "activations": "budget"})
    outs = _mark_graph(model.blocks[0])
    x, y = batches(1, batch=32, seed=9)[0]
    with pytest.raises(MemoryError, match="device budget"):
        model(x, y).backward()
    gc.collect()
    assert outs and outs[0]() is None, "the failed forward's partial graph stayed alive"
    rt = weakref.ref(tiermem.runtime_of(model))
    del model, opt, ours
    gc.collect()
    assert rt() is None
    assert _timelines(tmp_path) == []


@pytest.mark.parametrize("enabled", [True, False])
def test_set_up_gives_the_collector_back_as_it_found_it(enabled, tmp_path, monkeypatch):
    """Set-up and export run with Python's cyclic collector paused (shared.collector_paused: its
    passes over torch's objects cost a checkpoint load a sixth of its time); after initialize,
    inference, save_weights, and a set-up that raises, the collector is as the caller left
    it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        seen = []
        with torch.device("meta"):
            model = make_pair()[1]

        def init(module):  # runs inside set-up, module by module
            seen.append(gc.isenabled())
        model, opt = tiermem.initialize(model, {"device": "1MiB"}, init=init)
        assert seen and not any(seen)  # paused while set-up ran
        assert gc.isenabled() == enabled
        tiermem.save_weights(model, str(tmp_path / "w.safetensors"))
        assert gc.isenabled() == enabled
        served = tiermem.inference(make_pair()[0], {"device": "1MiB"})
        assert gc.isenabled() == enabled
        with pytest.raises(ValueError):
            tiermem.initialize(make_pair()[0], {"device": "1MiB", "chunk_size": -1})
        assert gc.isenabled() == enabled
        del model, opt, served
    finally:
        gc.enable() if was else gc.disable()
