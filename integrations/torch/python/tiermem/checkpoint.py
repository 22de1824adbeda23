"""Streaming checkpoints of the whole training state (docs/checkpoints.md).

``save_checkpoint(model, optimizer, path)`` writes one safetensors file, tensor by tensor from
the chunks (the model is never materialized in host RAM, so a model larger than RAM can be
saved with a small host budget): every parameter's fp32 value under its own name and shape
(``model.state_dict()`` names), Adam's ``exp_avg/<name>`` and ``exp_avg_sq/<name>``, and in
the file's metadata the step counts, the micro-step counter, the fp16 loss-scaling state, the
optimizer's param groups (lr, betas, eps, weight_decay — an LR schedule's current values) and
torch's CPU RNG state. It is written to ``path.tmp``, fsync'ed and renamed over ``path``: a
killed save leaves the previous checkpoint intact. Each tensor carries a CRC32C.

``load_checkpoint(model, optimizer, path)`` verifies the whole file (checksums, names, shapes)
before it changes anything, then loads it — at any budget, chunk size or precision (values
are fp32). The file loads without tiermem too::

    from safetensors.torch import load_file
    sd = load_file(path)
    model.load_state_dict({k: v for k, v in sd.items() if "/" not in k})

The metadata (param groups, RNG state, extra) is in the one format both bindings write and
the session core defines (runtime/checkpoint_meta.h): a checkpoint saved by the LibTorch API's
``ChunkedModel::Save`` resumes here, and one saved here resumes there. A param group's
hyper-parameters are the core's; its other keys (torch's own, a scheduler's ``initial_lr``)
are kept as given. Files of earlier builds load too.

Sharded across ranks (docs/distributed.md): every rank calls both. ``save_checkpoint``
gathers every chunk from the ranks and rank 0 writes the same single file (with rank 0's RNG
state); ``load_checkpoint`` verifies the file on every rank before any rank loads, then each
rank keeps its part — so a checkpoint saved at N ranks loads at M ranks, or in one process.

Threading: the training thread, between iterations.
"""
from __future__ import annotations

import json

import torch

from . import _C

def _runtime(model):
    rt = getattr(model, "_tiermem_runtime", None)
    if rt is None:
        raise ValueError("checkpoint: the model is not managed by tiermem (tiermem.initialize)")
    if rt._in_iteration or rt._in_backward:
        raise RuntimeError("checkpoint: save or load between iterations (after optimizer.step()), "
                           "not inside a forward or backward")
    return rt


def _session(rt):
    return rt.session  # the runtime's session (_C.Session)


def _groups(optimizer):
    if optimizer is None:
        return []
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def save_checkpoint(model, optimizer, path, extra=None):
    """Saves the training state of a model from tiermem.initialize (see the module docstring).
    `extra`: any JSON-serializable value (epoch, data position), returned by load_checkpoint.
    Raises ValueError inside a gradient accumulation window (the accumulated gradients are
    not saved) and OSError for disk trouble; the previous file at `path` is then intact."""
    rt = _runtime(model)
    try:
        extra_text = json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: extra is not JSON-serializable: {e}") from None
    try:
        groups_text = json.dumps(_groups(optimizer), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint: an optimizer param group is not JSON-serializable: "
                         f"{e}") from None
    rng = torch.get_rng_state().numpy().tobytes()
    s = _session(rt)
    rt._set_tracing(False)  # its reads are not part of the order the next iteration follows
    rt._on_stream()  # reads wait for the work queued on the chunks

    def save():
        s.save_checkpoint(str(path), groups_text, rng, extra_text)

    if rt._shards is None:
        save()
        return
    # Sharded: collective gathers, rank 0 writes; every rank learns whether it worked.
    rt._shards.agree(save, lambda: OSError(
        f"save_checkpoint: {path}: another rank failed (see its error); the previous file, if "
        "any, is intact"))


def load_checkpoint(model, optimizer, path):
    """Loads a checkpoint written by save_checkpoint or the LibTorch API's ChunkedModel::Save
    into a model from tiermem.initialize (and its optimizer: param group hyper-parameters) and
    restores torch's CPU RNG state (when the file has one). Returns the saved `extra`. A torn,
    corrupt or foreign file raises (ValueError, or OSError for a checksum mismatch) and changes
    nothing."""
    rt = _runtime(model)
    s = _session(rt)
    # The session checks the groups and the RNG state's size before it changes anything.
    check = dict(num_groups=None if optimizer is None else len(optimizer.param_groups),
                 rng_state_bytes=torch.get_rng_state().numel())
    rt._set_tracing(False)
    rt._on_stream()
    if rt._shards is not None:
        rt._shards.flush()
        # Every rank verifies the whole file before any rank changes anything.
        rt._shards.agree(lambda: s.load_checkpoint(str(path), verify_only=True, **check),
                         lambda: ValueError(f"load_checkpoint: {path}: another rank could not "
                                            "verify it (see its error); nothing was loaded"))
    meta = s.load_checkpoint(str(path), **check)  # verifies everything, then loads
    for r in rt.params:
        if r.trainable:
            r.param.grad = None  # gradients are not part of a checkpoint
    if optimizer is not None:
        for mine, saved in zip(optimizer.param_groups, json.loads(meta["param_groups"])):
            for k, v in saved.items():
                mine[k] = tuple(v) if k == "betas" else v
    if meta["rng_state"]:
        torch.set_rng_state(torch.frombuffer(bytearray(meta["rng_state"]), dtype=torch.uint8))
    return json.loads(meta["extra"])
