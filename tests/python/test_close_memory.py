"""close() gives memory back at once (issue 42's leftovers; docs/python.md "Dropping a model
frees its memory"), and nothing materializes more values than free memory holds.

- close() frees the session's tiers, and drops every reference that made a cycle through the
  runtime (its parts, the ChunkTensors, the hooks, the units' forward wrappers and a recursive
  closure of units.py): the runtime, its closed session and the model given back then go by
  reference counting. Before, `close(); del model, opt` kept the runtime and the values given
  back to the model until the cyclic collector ran (the pretrained demo had to call
  gc.collect() before its reload).
- `model.state_dict()` and `close()` keeping the values raise MemoryError naming the bytes
  when the values exceed the free memory, pointing to the streaming exports.

These tests run with the cyclic collector disabled: what they measure is freed by reference
counting alone.
"""
import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

import tiermem
import tiermem.runtime
from tiermem.shared import collector_paused

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@contextlib.contextmanager
def no_collector():
    gc.collect()
    with collector_paused():
        yield


def wide(n=3):
    """n Linear(4096, 4096): 64 MiB of fp32 values each, above glibc's largest mmap threshold
    (32 MiB), so a freed tensor's pages go back to the system and RSS shows it."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(n)])


def step(model, opt):
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_close_then_drop_frees_the_values_given_back_without_the_collector(tmp_path):
    with no_collector():
        base = rss()
        model, opt = tiermem.initialize(wide(), {
            "device_kind": "host", "host": "256MiB",
            "nvme": {"size": "1GiB", "path": str(tmp_path / "nvme")}})
        step(model, opt)
        rt = weakref.ref(tiermem.runtime_of(model))
        tiermem.close(model)
        closed = rss() - base
        # The model holds its 192 MiB of values again, as plain Parameters.
        assert closed >= 150 * MiB, closed
        assert all(type(p) is nn.Parameter for p in model.parameters())
        del model, opt
        # Gone by reference counting: the runtime, and the values (was: 192 MiB kept until
        # the collector ran).
        assert rt() is None
        assert rss() - base < 48 * MiB, (rss() - base) / MiB


def test_close_frees_the_host_budget_and_the_runtime_goes_with_its_last_reference():
    with no_collector():
        model, opt = tiermem.initialize(wide(1), {"device_kind": "sim", "device": "96MiB",
                                                  "host": "320MiB"})
        step(model, opt)
        runtime = tiermem.runtime_of(model)
        session = weakref.ref(runtime.session)
        before = rss()
        runtime.close(keep_values=False)
        # The 64 MiB params, grads, m and v: the host tier's memory, freed by close().
        assert before - rss() >= 200 * MiB, (before - rss()) / MiB
        del runtime
        assert session() is not None  # the optimizer still refers to the runtime
        del opt
        assert session() is None  # the C++ session object: freed with the runtime


def test_a_closed_model_is_plain_and_its_runtime_raises_clearly():
    ref = wide(1)
    ours = tiermem.inference(wide(1), {"device_kind": "sim", "device": "80MiB", "host": "256MiB"})
    rt = tiermem.runtime_of(ours)
    stale = next(iter(ours.parameters()))  # a ChunkTensor of the runtime
    x = torch.randn(2, 4096)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    tiermem.close(ours)
    assert not hasattr(ours, "_tiermem_runtime")
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))  # the plain model, its values given back
    with pytest.raises(RuntimeError, match="closed"):
        stale + 1
    with pytest.raises(RuntimeError, match="session is closed"):
        rt.stats()
    with pytest.raises(RuntimeError, match="the runtime is closed"):
        rt.grad_norm()
    with pytest.raises(ValueError, match="not managed by tiermem"):
        tiermem.close(ours)
    rt.close()  # closing twice does nothing


def test_state_dict_and_close_beyond_free_memory_raise_naming_the_bytes(monkeypatch):
    ref = wide(1)
    model, opt = tiermem.initialize(wide(1), {"device_kind": "sim", "device": "96MiB",
                                              "host": "320MiB"})
    need = 4096 * 4096 * 4
    monkeypatch.setattr(tiermem.runtime, "free_ram_bytes", lambda: need - 1)
    with pytest.raises(MemoryError, match=rf"state_dict\(\) would hold {need} bytes .*"
                                          rf"more than the {need - 1} bytes .*free now.*"
                                          r"tiermem\.save_pretrained"):
        model.state_dict()
    with pytest.raises(MemoryError, match=rf"state_dict\(\) would hold {need} bytes"):
        model[0].state_dict()  # a submodule holding it
    with pytest.raises(MemoryError, match=rf"close\(\) keeping the values would hold {need}"):
        tiermem.close(model)
    # Nothing changed: still managed, and with enough free memory both work.
    assert tiermem.runtime_of(model) is not None
    monkeypatch.setattr(tiermem.runtime, "free_ram_bytes", lambda: need)
    sd = model.state_dict()
    assert torch.equal(sd["0.weight"], ref.state_dict()["0.weight"])
    tiermem.close(model)
    assert torch.equal(model[0].weight, ref[0].weight)
    del opt
