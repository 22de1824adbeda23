"""tiermem: train models larger than device memory by keeping params, grads and optimizer
state in chunks that move between the device, host DRAM and NVMe.

    model, optimizer = tiermem.initialize(model, {"device": "2GiB", "host": "8GiB"})
    model = tiermem.inference(model, {"device": "512MiB", "host": "8GiB"})  # serving

See docs/python.md and docs/inference.md.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from . import _C
from .checkpoint import load_checkpoint, save_checkpoint
from .config import (ActivationMode, CheckpointIo, Config, DeviceKind, InPlace, KernelIsa,
                     NvmeEngine, OptimizerOverlap, OptimizerPlacement, PlanMode, Precision,
                     UnmaterializedReads, parse_config)
from .hf import save_pretrained
from .optimizer import ChunkedAdamW
from .runtime import TiermemRuntime
from .serve import ServingRuntime
from .shared import collector_paused
from .tensor import ChunkTensor
from .weights import save_weights

__all__ = ["initialize", "inference", "runtime_of", "close", "save_checkpoint", "load_checkpoint",
           "save_weights", "save_pretrained", "Config", "parse_config", "ChunkedAdamW",
           "ChunkTensor",
           # the config's modes (config.py)
           "Precision", "DeviceKind", "NvmeEngine", "KernelIsa", "PlanMode", "ActivationMode",
           "OptimizerPlacement", "OptimizerOverlap", "CheckpointIo", "UnmaterializedReads",
           "InPlace"]


def initialize(model, config=None, param_groups=None, units=None, process_group=None,
               experts=True, init=None, weights=None, strict=True):
    """Places `model`'s parameters in chunks and returns (model, optimizer).

    `config`: a dict or a JSON file path (docs/python.md, docs/configuration.md).
    `param_groups`: torch-style groups of the trainable parameters with their own
    lr/betas/eps/weight_decay. `units`: which module subtrees are materialized together
    (module classes or a predicate ``fn(name, module)``; default: each block of a repeated
    ModuleList/Sequential, see tiermem.units). `process_group`: shard the chunks across the
    ranks of this torch.distributed group (default: the default group when torch.distributed
    is initialized with more than one rank; docs/distributed.md). `experts`: mixture-of-experts
    layers move each expert's weights alone, when the router picks it (docs/moe.md); False
    treats them as any other parameters. `model` may be compiled already
    (``torch.compile(model)``): tiermem then manages the module inside and returns `model`;
    compiling after works too (docs/python.md "torch.compile"). A model built on the meta
    device (``with torch.device("meta")``, accelerate's ``init_empty_weights()``) gets its
    values in its chunks, module by module, from each module's ``reset_parameters()`` and then
    ``init(module)`` when given: a model larger than RAM never exists whole in memory
    (docs/python.md "Models larger than RAM"). `weights`: a ``.safetensors`` file or a
    Hugging Face checkpoint directory whose keys are the model's parameter (and persistent
    buffer) names — or, for a transformers model (a PEFT model around one too), the keys its
    ``from_pretrained`` reads: prefixes, ties and key conversions as transformers resolves
    them — streamed into the chunks instead — every header checked first; with
    ``strict=False`` parameters it lacks keep their own initialization, named in one warning
    (docs/pretrained.md). On error (ValueError for bad input, a bad checkpoint included,
    MemoryError for budgets too small, RuntimeError for a missing GPU) the model is left
    exactly as it was.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"initialize: expected an nn.Module, got {type(model).__name__}")
    if getattr(model, "_tiermem_runtime", None) is not None:
        raise ValueError("initialize: this model is already managed by tiermem")
    cfg = parse_config(config)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("initialize: the model has no trainable parameters")
    root = _compiled_root(model)
    with collector_paused():
        runtime = TiermemRuntime(root, cfg, param_groups, units, process_group, experts=experts,
                                 init=init, weights=weights, strict=strict)
    try:
        optimizer = ChunkedAdamW(runtime)
    except BaseException:
        runtime.abandon()
        raise
    if runtime._weights is not None:
        runtime._weights.settle()  # set-up succeeded
    # Speculative steps (optimizer_overlap: backward) announce the next step's
    # hyper-parameters at each iteration's first forward.
    if cfg.optimizer_overlap.speculative:
        runtime._hyper_of_next_step = optimizer._hyper
    root._tiermem_runtime = runtime  # (a compiled model finds it on the module it wraps)
    return model, optimizer


def inference(model, config=None, units=None, experts=True, init=None, weights=None,
              strict=True):
    """Places `model`'s parameters in chunks for inference only and returns the model.

    Weights stream from their home (host DRAM, or NVMe when the host budget is short) into
    the device budget, the next units' weights prefetched while a unit computes; forwards run
    under no_grad; a returned KV cache counts against the device budget (docs/inference.md).
    `config`, `units`, `experts`, `init`, `weights` and `strict` as for initialize (optimizer
    keys are ignored); a mixture-of-experts layer moves only the experts its router picks. On error (ValueError,
    MemoryError naming the bytes needed, RuntimeError for a missing GPU) the model is left
    exactly as it was. ``tiermem.runtime_of(model).close()`` gives it back.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"inference: expected an nn.Module, got {type(model).__name__}")
    if getattr(model, "_tiermem_runtime", None) is not None:
        raise ValueError("inference: this model is already managed by tiermem")
    cfg = parse_config(config)
    root = _compiled_root(model)
    with collector_paused():
        root._tiermem_runtime = ServingRuntime(root, cfg, units, experts=experts, init=init,
                                               weights=weights, strict=strict)
    return model


def _compiled_root(model):
    """The module tiermem manages: `model`, or the module a ``torch.compile(module)`` wraps
    (an OptimizedModule). Managing the module inside, the compiled wrapper calls the managed
    forward, which runs the model's own code eagerly and compiles its units (compiling.py);
    parameter names and checkpoints are the plain module's."""
    from torch._dynamo.eval_frame import OptimizedModule
    return model._orig_mod if isinstance(model, OptimizedModule) else model


def close(model, keep_values: bool = True):
    """Gives a managed `model` back as an ordinary model: ``runtime_of(model).close()``. The
    session's memory (its host budget, device memory, NVMe files) is freed now, and the
    runtime goes when the last reference to it (the model's optimizer's) does, with no garbage
    collection needed. `keep_values=False` leaves the parameters empty instead of materializing
    the model's values (a model larger than RAM: save it first); with `keep_values` and values
    larger than the free memory, MemoryError naming the bytes, the model still managed."""
    runtime_of(model).close(keep_values)


def runtime_of(model) -> TiermemRuntime:
    rt = getattr(model, "_tiermem_runtime", None)
    if rt is None:
        raise ValueError("model is not managed by tiermem")
    return rt

