"""The values the chunks start with: each parameter's own, or - for a parameter built on the
meta device (``with torch.device("meta")`` or accelerate's ``init_empty_weights()``: a model
larger than RAM) - the values its module's initialization gives it, made one module at a
time, so the model is never whole in host memory.

A meta parameter gets a CPU tensor filled with NaN; then its owning module's own
``reset_parameters()`` (or torch's private ``_reset_parameters()``, nn.MultiheadAttention's)
runs, then the user's ``init(module)`` when given (e.g. a model's ``_init_weights``, as
``model.apply`` would call it). A value still NaN after both was written by neither: that is a
ValueError naming the parameter and module, never a silently uninitialized weight. A parent's
initialization that reaches into its children (``nn.Transformer._reset_parameters``) is not
run: each module initializes its own parameters; pass ``init`` for anything else.

Invariants: values are yielded in module order (that of ``named_modules``, which is the
records' index order), each record once; a meta parameter shared by several modules (tied
weights) stays materialized until the last module holding it has run, and is yielded then.

Memory: at most one module's values (and what its initialization allocates) are live at a
time, and the C heap gives freed values back to the system before the next module's are made
(``_give_back``): glibc keeps the freed blocks of tensors below its mmap threshold (32 MiB) in
its heap, and the small blocks that the chunk writes' I/O threads free there meanwhile keep
them from being reused, so without it a meta initialize grew the process by about the size
of every layer's values (600 MiB for a 24-layer 370 M-param Llama: docs/host-mode.md).
Ownership: a yielded tensor is the caller's until the next one is asked for; the user's
Parameter objects of meta parameters are swapped (``torch.utils.swap_tensors``) onto CPU
storage; ``restore_meta`` puts them back on the meta device, as they were.

Threading: the thread calling tiermem.initialize / tiermem.inference.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn


def is_meta(r) -> bool:
    return r.orig.device.type == "meta"


def check_buffers(model: nn.Module, loaded=()) -> None:
    """ValueError for a buffer on the meta device: tiermem materializes parameters only (a
    buffer's value - a mask, rotary frequencies - is computed by its module's constructor),
    but for those named in `loaded`, whose values a checkpoint gives (weights.py)."""
    loaded = set(loaded)
    for name, b in model.named_buffers():
        if b is not None and b.device.type == "meta" and name not in loaded:
            raise ValueError(
                f"buffer {name} is on the meta device: tiermem gives values to meta parameters "
                "only (their modules' reset_parameters and your init), not to buffers. Build "
                "the model under accelerate's init_empty_weights() (parameters on meta, "
                "buffers real), or give the buffers their values before initialize")


def initial_values(model: nn.Module, params: list,
                   init: Callable[[nn.Module], None] | None) -> Iterator[tuple]:
    """(record, flat fp32 CPU tensor of its initial values) for every record, in index order
    but for a tied meta parameter, which comes at its last module (see the module docstring).
    Raises ValueError for a meta parameter no initialization wrote."""
    by_id = {id(r.orig): r for r in params}
    meta = [r for r in params if is_meta(r)]
    if not meta:
        for r in params:
            yield r, r.orig.detach().reshape(-1).contiguous()
        return
    # (module, attribute) slots still to run over each (a module reached twice is one slot)
    left = {id(r.orig): len({(id(m), n) for m, n in r.slots}) for r in meta}
    done: set[int] = set()
    for m in _modules_in_order(model):
        own = [p for p in m._parameters.values() if p is not None and id(p) in by_id]
        if not own:
            continue
        for p in own:  # plain parameters come in index order, as they are reached
            r = by_id[id(p)]
            if r.index not in done and id(p) not in left:
                done.add(r.index)
                yield r, p.detach().reshape(-1).contiguous()
        opened = [p for p in own if id(p) in left]
        if not opened:
            continue
        _give_back()  # the values of the modules before (written and freed) leave the heap
        if len(opened) != len(own):  # its initialization would overwrite the real ones
            name = next(by_id[id(p)].name for p in own if id(p) not in left)
            raise ValueError(
                f"{type(m).__name__} holds parameters on the meta device and real ones "
                f"({name}): tiermem initializes a module's meta parameters by running its "
                "reset_parameters() and init, which would overwrite the real ones; build the "
                "module wholly on the meta device or wholly real")
        for p in opened:
            if p.device.type == "meta":
                torch.utils.swap_tensors(p, nn.Parameter(
                    torch.full(p.shape, math.nan, dtype=p.dtype), requires_grad=p.requires_grad))
        with torch.no_grad():
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if callable(reset):
                reset()
            if init is not None:
                init(m)
        for p in dict.fromkeys(opened):  # a parameter in two slots of one module: once
            left[id(p)] -= sum(1 for q in own if q is p)
            if left[id(p)] == 0:
                r = by_id[id(p)]
                v = p.detach().reshape(-1).contiguous()
                if torch.isnan(v).any():
                    who = type(m).__name__
                    fn = f"{who}.{reset.__name__}()" if callable(reset) else None
                    by = (f"neither {fn} nor init wrote all of it" if fn and init else
                          f"{fn} did not write all of it and no init was given" if fn else
                          f"{who} has no reset_parameters() and init did not write all of it"
                          if init else f"{who} has no reset_parameters() and no init was given")
                    raise ValueError(
                        f"parameter {r.name} was built on the meta device and {by}: pass "
                        f"tiermem.initialize(..., init=fn) with fn(module) giving the "
                        f"{who}'s parameters their values (e.g. the model's _init_weights)")
                done.add(r.index)
                yield r, v
                p.data = torch.empty(0, dtype=p.dtype)  # its values are in the chunks now
    if len(done) != len(params):  # every record is some module's: cannot happen
        raise RuntimeError(f"initialize: {len(params) - len(done)} parameters got no values")


def _load_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to give back this way
        return None


_malloc_trim = _load_trim()


def _give_back() -> None:
    """Returns the free pages of the C heap to the system (glibc's malloc_trim: free memory
    inside the heap, not only at its top; a few milliseconds)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def restore_meta(params: list, was_meta: set[int]) -> None:
    """Puts the parameters that were on the meta device back there (a failed initialize leaves
    the model as it was)."""
    for r in params:
        if r.index in was_meta and r.orig.device.type != "meta":
            torch.utils.swap_tensors(r.orig, nn.Parameter(
                torch.empty(r.shape, dtype=r.orig.dtype, device="meta"),
                requires_grad=r.orig.requires_grad))


def _modules_in_order(model: nn.Module):
    """Every module once, in named_modules order."""
    return [m for _, m in model.named_modules()]
