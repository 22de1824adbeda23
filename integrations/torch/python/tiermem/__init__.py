"""tiermem: train models larger than device memory by keeping params, grads and optimizer
state in chunks that move between the device, host DRAM and NVMe.

    model, optimizer = tiermem.initialize(model, {"device": "2GiB", "host": "8GiB"})

See docs/python.md.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from . import _C
from .config import Config, parse_config
from .optimizer import ChunkedAdamW
from .runtime import TiermemRuntime

__all__ = ["initialize", "runtime_of", "Config", "parse_config", "ChunkedAdamW"]


def initialize(model, config=None, param_groups=None):
    """Places `model`'s parameters in chunks and returns (model, optimizer).

    `config` is a dict or a JSON file path (see docs/python.md); `param_groups` optionally
    splits the trainable parameters into torch-style groups with their own lr/weight_decay.
    On error (ValueError for bad input, MemoryError for budgets too small) the model is left
    exactly as it was.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"initialize: expected an nn.Module, got {type(model).__name__}")
    if getattr(model, "_tiermem_runtime", None) is not None:
        raise ValueError("initialize: this model is already managed by tiermem")
    cfg = parse_config(config)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("initialize: the model has no trainable parameters")
    runtime = TiermemRuntime(model, cfg, param_groups)
    try:
        optimizer = ChunkedAdamW(runtime)
    except BaseException:
        runtime.close()
        raise
    model._tiermem_runtime = runtime
    return model, optimizer


def runtime_of(model) -> TiermemRuntime:
    rt = getattr(model, "_tiermem_runtime", None)
    if rt is None:
        raise ValueError("model is not managed by tiermem")
    return rt
