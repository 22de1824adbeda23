"""Writes the two version-2 checkpoints of tests/data/ (README.md): files as the bindings
wrote them before the checkpoint metadata had one format. Run once with the Python package
of commit 3f93540 (the last build that wrote version 2) on PYTHONPATH; the files are kept,
not regenerated (a build of today writes version 3).

    PYTHONPATH=<that build>/python-tree python tests/data/make_legacy_checkpoints.py
"""
import json
import os

import torch

import tiermem
from tiermem import _C

HERE = os.path.dirname(os.path.abspath(__file__))


def python_file():
    """tiermem.save_checkpoint's own file: {"tiermem.python": {param_groups, torch_rng,
    extra}} in the `binding` entry. A Linear(3, 2) + Linear(2, 1), 2 AdamW steps at lr 2e-3."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model, opt = tiermem.initialize(model, {"device": "1MiB", "host": "16MiB",
                                            "optimizer": {"lr": 2e-3}})
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 3, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    torch.manual_seed(5)  # the RNG state the file holds: what manual_seed(5) leaves
    tiermem.save_checkpoint(model, opt, os.path.join(HERE, "legacy-python.safetensors"),
                            extra={"epoch": 7})
    tiermem.runtime_of(model).close()


def libtorch_file():
    """What ChunkedModel::Save wrote: {"param_groups": [...]} in the `binding` entry (its own
    nlohmann dump), here through the same session call. A LibTorch Linear(3, 2)'s tensors
    ("weight", "bias") with set values, Adam state and step count 3."""
    cfg = tiermem.parse_config({"device": "1MiB", "host": "16MiB"})
    s = _C.Session(cfg, [("weight", 6, True, 0, [2, 3]), ("bias", 2, True, 0, [2])], None)
    for t, n in ((0, 6), (1, 2)):
        base = torch.arange(n, dtype=torch.float32) + 10 * t
        s.write_param(t, base / 8)
        s.write_tensor(t, _C.ChunkKind.exp_avg, base / 64)
        s.write_tensor(t, _C.ChunkKind.exp_avg_sq, base / 512)
        s.set_step_count(t, 3)
    meta = '{"param_groups":[{"betas":[0.9,0.999],"eps":1e-08,"lr":0.0005,"weight_decay":0.01}]}'
    s.save_checkpoint(os.path.join(HERE, "legacy-libtorch.safetensors"), meta)
    s.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    python_file()
    libtorch_file()
