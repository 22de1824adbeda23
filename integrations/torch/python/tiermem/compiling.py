"""tiermem under torch.compile: where compiled code meets the runtime's eager work.

A managed model compiles the way FSDP2's per-block compile runs: every unit boundary is a
graph break, and the runtime's work there — acquiring and releasing chunks, materializing
the unit's parameters as views of them, pushing the saved-tensor hooks — runs eagerly around
compiled code. The three ways of compiling all come to the same: ``torch.compile(model)``
after ``tiermem.initialize``, ``tiermem.initialize(torch.compile(model))``, and per-unit
compile (``block.compile()``, ``torch.compile(block)``) each leave a torch.compile callback
active while a unit's wrapped forward (forwards.py) runs, and:

- a wrapper's own frame is never traced nor compiled (``boundary``): where compiled code
  calls it, dynamo breaks the graph;
- the runtime's hooks run with dynamo off for them and all they call (``eager``): the unit's
  enter and exit, and every callback torch makes into the runtime while a compiled region
  runs — saved-tensor pack and unpack hooks, gradient hooks, the backward's final callback
  (a compiled training step runs the backward under dynamo's callback);
- the model's own forward runs eagerly (``run_root``; also a unit's that holds other units):
  dynamo never traces the model's frame, so its code between units runs as in eager mode,
  and a plain model of the same class compiled in the same process keeps its compiled graph
  (dynamo marks a frame with a graph break inside a loop as skipped, for every caller). The
  callback active at the model's call is remembered for the units it calls;
- a unit's own forward is called through its class's *trampoline* (``trampoline``), a
  one-line frame that the active compile compiles, inlining the forward — also where dynamo
  would not compile the forward's own frame (torch.nn's modules: an ``nn.Linear`` unit, an
  ``nn.TransformerEncoderLayer``). One code object per module class, as a forward's own
  frame is: all the blocks of a class share one compiled graph. Inside it the graph takes
  the unit's parameters as inputs: each is the same ``nn.Parameter`` object at every call
  (its compute parameter, shared.py), and its ``.data`` is a view of its chunk with the same
  shape, contiguous stride and dtype every time, so dynamo's guards hold from step to step
  and a unit class compiles once (once more per new input shape, grad mode or autocast
  state, as for plain torch). Guards do not look at data pointers: a chunk that moved
  between steps (another device region, NVMe and back) changes nothing.
- a unit recomputed in the backward (activations ``recompute``, ``auto``) runs its forward
  again through the same trampoline under the callback its first run had (``compiler_now``
  at the call, ``run_compiled`` in the recompute): the same compiled graph, so the same
  tensors are saved in the same order, which the recompute checks (recompute.py).

Not supported, with a clear error (dynamo's own, carrying ``BOUNDARY``'s text): compiling a
function that calls the model (or a unit) with ``fullgraph=True``, since the call is a
graph break. ``torch.compile(model, fullgraph=True)`` holds per unit.

Owns nothing. Threading: whatever thread calls; dynamo's callback is per thread.
"""
from __future__ import annotations

import threading
import types

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_eval_frame
from torch._dynamo.decorators import skip as _dynamo_skip

BOUNDARY = ("tiermem: a tiermem unit's forward begins and ends with chunk acquires and "
            "releases that run eagerly, so a graph breaks at every unit boundary: compile "
            "the managed model itself (torch.compile(model, fullgraph=True) makes each unit "
            "one graph), not a function calling it with fullgraph=True")


def eager(fn):
    """`fn`, run with dynamo off for it and everything it calls (the runtime's hooks)."""
    return torch.compiler.disable(fn, reason=BOUNDARY)


def boundary(fn):
    """`fn`'s own frame is never compiled, and compiled code calling it breaks the graph
    there (with BOUNDARY as the reason under fullgraph=True); the frames it calls are
    compiled by the torch.compile active, if any. `fn` itself must call nothing of the
    runtime but ``eager`` functions and trampolines."""
    fn = _dynamo_skip(fn)
    fn._torchdynamo_disable_msg = BOUNDARY
    return fn


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


_TRAMPOLINES: dict = {}  # module class -> its trampoline (written under the GIL; a race
#                          makes two equal ones, one of which is kept)


def trampoline(cls):
    """``f(forward, *args, **kwargs)`` calling forward: the frame torch.compile compiles for
    a managed module of class `cls` (a code object of its own per class, as a forward's own
    frame has; named after the class in dynamo's logs)."""
    f = _TRAMPOLINES.get(cls)
    if f is None:
        name = f"tiermem_{cls.__name__}_forward"
        code = _call.__code__.replace(co_name=name, co_qualname=name)
        f = _TRAMPOLINES[cls] = types.FunctionType(code, _call.__globals__, name)
    return f


_root = threading.local()  # .callback: that of the managed model's forward running here


@boundary  # calls only C and reads a thread-local: never worth a frame of dynamo's
def compiler_now():
    """The torch.compile callback a unit's forward called from here runs under: the one
    active on this thread now, or else the one that was active when the managed model's own
    forward running now was called (run_root); None: none (eager)."""
    cb = get_eval_frame_callback()
    if cb is None or cb is False:
        return getattr(_root, "callback", None)
    return cb


@boundary
def run_root(fn, *args, **kwargs):
    """Runs a managed model's own forward ``fn``: eagerly (dynamo never traces the model's
    frame, so its code between units runs as in eager mode, and a plain model of the same
    class compiled in the same process keeps its own compiled graphs), remembering for the
    units it calls the torch.compile callback active at this call."""
    cb = get_eval_frame_callback()
    before = getattr(_root, "callback", None)
    if cb is not None and cb is not False:
        _root.callback = cb
    prior = set_eval_frame(None)
    try:
        return fn(*args, **kwargs)
    finally:
        set_eval_frame(prior)
        _root.callback = before


@boundary
def run_compiled(callback, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under `callback` (from compiler_now; None: as things are), as
    a frame called where the callback was active runs."""
    if callback is None:
        return fn(*args, **kwargs)
    prior = set_eval_frame(callback)
    try:
        return fn(*args, **kwargs)
    finally:
        set_eval_frame(prior)
