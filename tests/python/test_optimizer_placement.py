"""Optimizer placement (config optimizer_placement, docs/python.md "Where the optimizer runs"):
groups whose optimizer state fits next to the training working set step on the device (on a
CPU: the CPU kernel on SimDevice's memory, the twin of the CUDA kernels), the others on the
host; values are the same as all-host placement and as plain torch with the same AdamW math,
bit for bit, in fp32 and bf16; placed groups' grads never go down to the host."""
import json

import pytest
import torch

import tiermem
from conftest import KernelAdamW, batches, make_pair, train_steps


def chunk_total(**cfg):
    _, probe = make_pair()
    m, _ = tiermem.initialize(probe, dict({"device": "64MiB", "host": "256MiB",
                                           "chunk_size": 4096}, **cfg))
    rt = tiermem.runtime_of(m)
    total = rt.s.total_chunk_bytes
    rt.close()
    return total


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_placement_auto_equals_host_placement_and_moves_less(precision):
    data = batches(8)
    total = chunk_total(precision=precision)
    # Chunk bytes per element — fp32: param 4, grad 4 | m 4, v 4; bf16: 2, 2 | 4, 4, master 4.
    working = total // 2 if precision == "fp32" else total // 4
    runs = {}
    for placement in ("auto", "host"):
        _, ours = make_pair()
        model, opt = tiermem.initialize(ours, {
            "device": working + (total - working) // 2, "host": "256MiB", "chunk_size": 4096,
            "precision": precision, "optimizer_placement": placement,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01}})
        rt = tiermem.runtime_of(model)
        losses = train_steps(model, opt, data)
        runs[placement] = (losses, model.state_dict(), rt.stats(), rt.s.num_groups)
    losses, sd, st, groups = runs["auto"]
    assert 0 < len(st["optimizer"]["device_groups"]) < groups, st["optimizer"]
    assert runs["host"][2]["optimizer"]["device_groups"] == []
    assert losses == runs["host"][0]
    for k, v in runs["host"][1].items():
        assert torch.equal(sd[k], v), k
    assert st["bytes_moved"].get("device->host", 0) < \
        runs["host"][2]["bytes_moved"].get("device->host", 0)
    if precision == "fp32":
        ref, _ = make_pair()
        assert losses == train_steps(ref, KernelAdamW(ref.parameters(), lr=1e-3,
                                                      weight_decay=0.01), data)


def test_bad_placement_is_a_clear_error_and_leaves_the_model():
    ref, ours = make_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match="optimizer_placement"):
        tiermem.initialize(ours, {"optimizer_placement": "gpu"})
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


def test_the_placement_benchmark_runs(capsys):
    from tiermem.examples import bench_placement
    bench_placement.main(["--rounds", "2", "--steps", "1", "--warmup", "1", "--layers", "2",
                          "--width", "64"])
    out = capsys.readouterr().out
    assert "optimizer_placement auto" in out and "auto / host step time" in out
    row = next(line for line in out.splitlines() if "placement auto" in line)
    placed = int(row.split("|")[2].split("of")[0])
    assert placed > 0, row
