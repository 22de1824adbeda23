"""Optimizer placement (config optimizer_placement, docs/python.md "Where the optimizer runs"):
groups whose optimizer state fits next to the training working set step on the device (on a
CPU: the CPU kernel on SimDevice's memory, the twin of the CUDA kernels), the others on the
host; values are the same as all-host placement and as plain torch with the same AdamW math,
bit for bit, in fp32 and bf16; placed groups' grads never go down to the host."""
import pytest
import torch

import tiermem
from conftest import (KernelAdamW, assert_placement_changes_nothing, batches, chunk_total,
                      make_pair, placement_budget, train_each_placement, train_steps)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_placement_auto_equals_host_placement_and_moves_less(precision):
    data = batches(8)
    base = {"host": "256MiB", "chunk_size": 4096, "precision": precision,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    runs = train_each_placement(base, data, placement_budget(chunk_total(base), precision))
    assert_placement_changes_nothing(runs)
    # Placed groups' grads never went down to the host.
    assert runs["auto"][4].get("device->host", 0) < runs["host"][4].get("device->host", 0)
    losses = runs["auto"][0]
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
    from benchmarks import bench_placement
    bench_placement.main(["--rounds", "2", "--steps", "1", "--warmup", "1", "--layers", "2",
                          "--width", "64"])
    out = capsys.readouterr().out
    assert "optimizer_placement auto" in out and "auto / host step time" in out
    row = next(line for line in out.splitlines() if "placement auto" in line)
    placed = int(row.split("|")[2].split("of")[0])
    assert placed > 0, row
