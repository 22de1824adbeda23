"""What the parts of the runtime share: the parameter record, the modes, the run state,
version guards.

runtime.TiermemRuntime composes one object per job (chunks.py, unit_hooks.py,
activations.py, recompute.py, saved.py, backward.py, grads.py, dispatch.py); they import the
types they share from here, and nothing here imports them, so the imports stay acyclic.

- ``_Param``: one managed parameter — the user's object, its place in the session's chunks
  (one ``_Piece``, or several for a parameter larger than a chunk or of an expert set),
  the ChunkTensor the model exposes and the compute view the units swap in. Created by
  params.collect_params, completed by the runtime's install; the parts read it and update
  only the fields their docstrings name (``mat``, ``version`` and ``compute.data``:
  unit_hooks.py; ``param.grad`` and ``post_hooks``: grads.py; ``warned``: dispatch.py).
- ``Modes``: how the runtime runs, decided once when it is built (from the config's modes and
  the session's answers) and frozen: the parts ask its fields and the predicates of its
  enums (``modes.activations.offloaded``), never a configuration spelling.
- ``RunState``: where the runtime is now — its ``Phase`` (closed, idle, in an iteration's
  forward, in a backward), the units running, which unit the backward is at. One object,
  shared by reference: each field, and each phase transition, has its writers named next to
  it; everyone else reads it.
- ``collector_paused``: Python's cyclic collector off for the length of a set-up or an export.
- ``_guard`` / ``_check``: torch's in-place check for saved tensors, which tiermem's
  saved-tensor hooks do themselves.

Threading: the training thread, and autograd's backward thread where hooks run (one at a
time: a backward blocks the thread that started it).
"""
from __future__ import annotations

import contextlib
import enum
import gc
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _C

_K = _C.ChunkKind
_DEVICE, _HOST = _C.Tier.device, _C.Tier.host


@dataclass(eq=False)
class _Piece:
    """Elements [begin, begin + numel) of a parameter (whole rows of its first dimension) at
    `offset` in every chunk of `group` (the session's TensorPlace)."""
    group: int
    offset: int
    numel: int
    begin: int
    expert: int = -1           # the expert these rows belong to (an expert set's), else -1

    @classmethod
    def of(cls, piece) -> "_Piece":
        """From the session's record (``_C.Piece``, ``Session.place``)."""
        return cls(group=piece.group, offset=piece.offset, numel=piece.numel, begin=piece.begin,
                   expert=piece.expert)


@dataclass(eq=False)
class _Param:
    index: int                 # tensor index in the session
    name: str
    shape: torch.Size
    numel: int
    trainable: bool
    orig: nn.Parameter         # the user's parameter object (given back by close())
    group: int = 0             # its first piece's group and offset (its only one unless split)
    offset: int = 0
    pieces: list = field(default_factory=list)  # _Piece, in element order (one unless split)
    opt_group: int = 0
    param: Any = None          # the ChunkTensor parameter the model exposes
    compute: Any = None        # plain Parameter: the chunk view inside a unit
    placeholder: Any = None    # compute.data while not materialized
    grad: Any = None           # the grad ChunkTensor (trainable only)
    mat: int = 0               # active units materializing it
    version: int = 0           # compute._version when materialized (detects in-place writes)
    slots: list = field(default_factory=list)  # (module, attribute name)
    post_hooks: OrderedDict = field(default_factory=OrderedDict)  # a user's post-accumulate hooks
    warned: bool = False
    unit: int = -1             # the first unit computing with it (trace moments)
    expert_set: int = -1       # experts.py: the expert set it belongs to (-1: none)
    expert: int = -1           # -1: fused (dim 0 indexes the experts), else that expert's

    @property
    def split(self) -> bool:
        """Larger than a chunk or in an expert set: its pieces are in several places, so it
        computes with a contiguous copy (or, moving alone, expert by expert: experts.py)."""
        return len(self.pieces) > 1

    @property
    def groups(self) -> list:
        """The chunk groups holding its pieces, ascending."""
        return sorted({pc.group for pc in self.pieces})


@dataclass(frozen=True)
class Modes:
    """How one runtime runs: built once by TiermemRuntime.__init__, read by every part, never
    changed (FSDP2's frozen policies). Each field is a fact the parts ask; where it comes from
    is said next to it."""
    dtype: torch.dtype   # of the compute copy: the session's compute_dtype (dtypes.h's map)
    mixed: bool          # bf16/fp16 compute copies of fp32 masters (config precision)
    loss_scaled: bool    # fp16: gradients are held loss-scaled (config precision)
    strict: bool         # a read of an unmaterialized parameter raises (unmaterialized_reads)
    serving: bool        # tiermem.inference: every parameter frozen, no optimizer
    # Every compute and grad chunk pinned on the compute tier for the whole session: nothing
    # moves, no unit acquires, no saved-tensor hooks (TiermemRuntime.__init__ says when).
    resident: bool
    hold_grads: bool     # a group's grad chunk is held through the backward (the session's
    #                      holds_grad_chunks)
    activations: Any     # _C.ActivationMode: ask .counted, .offloaded, .recompute_every_unit,
    #                      .planned
    nvme: bool           # the session has an NVMe tier (activations may spill there)


class Phase(enum.Enum):
    """Where the runtime is (RunState.phase). Transitions, each by the writers named:

        CLOSED   -> IDLE      open()            runtime, once installed
        IDLE     -> FORWARD   begin_forward()   unit_hooks.UnitHooks: the first training
                                                forward of an iteration
        any open -> BACKWARD  begin_backward()  backward.Backward: the first hook of a backward
        BACKWARD -> IDLE      end_backward()    backward.Backward: the backward's end
        FORWARD  -> IDLE      abandon_forward() activations.Activations.abandon: the forward
                                                raised (a backward stays one until its end)
        any      -> CLOSED    close()           runtime.close
    """
    CLOSED = "closed"      # not installed yet, or closed: the hooks do nothing
    IDLE = "idle"          # between iterations (eval and no-grad forwards run here)
    FORWARD = "forward"    # an iteration's training forwards, before its backward
    BACKWARD = "backward"  # a backward runs


class RunState:
    """Where the runtime is now. Each field names its writer; the other parts only read it."""

    def __init__(self):
        self.phase = Phase.CLOSED   # written only by the transitions below (Phase says who)
        self.root_depth = 0         # unit_hooks.UnitHooks (serve.py's root forward too):
        #                             nesting of the model's own forward
        self.active_units: list = []  # unit_hooks.UnitHooks: units whose forward runs now,
        #                               innermost last
        self.fwd_used: dict[int, set] = {}  # unit_hooks.UnitHooks: group -> trainable params
        #                                     this forward computed with (cleared by the
        #                                     backward's end and by an abandoned iteration)
        self.bwd_unit = None        # backward.Backward: the unit the backward's current moment
        #                             belongs to
        self.in_user_hook = False   # grads.Grads: running a user's post-accumulate-grad hook

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def in_iteration(self) -> bool:
        """An iteration's training forward or its backward (the session's iteration is open)."""
        return self.phase is Phase.FORWARD or self.phase is Phase.BACKWARD

    @property
    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD

    @property
    def in_forward(self) -> bool:
        """An iteration's training forward, before its backward."""
        return self.phase is Phase.FORWARD

    # ---- transitions (Phase: who calls each) ---------------------------------------------
    def open(self):
        self.phase = Phase.IDLE

    def close(self):
        self.phase = Phase.CLOSED

    def begin_forward(self):
        self.phase = Phase.FORWARD

    def begin_backward(self):
        self.phase = Phase.BACKWARD

    def end_backward(self):
        self.phase = Phase.IDLE

    def abandon_forward(self):
        if self.phase is Phase.FORWARD:
            self.phase = Phase.IDLE


def _guard(t):
    """torch checks that a saved tensor was not modified in place before the backward uses
    it, but not for tensors that go through saved-tensor hooks: the hooks keep the tensor's
    version counter (shared by its views and aliases; not the tensor nor its storage) and the
    version at save time, and check them themselves (_check)."""
    try:
        c = _C.version_counter(t)
        return c, c.version
    except RuntimeError:  # a tensor without a version counter (inference mode)
        return None, 0


def _check(guard):
    counter, version = guard
    if counter is not None and counter.version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a tensor saved for backward is at version {counter.version}; "
            f"expected version {version} instead (checked by tiermem's saved-tensor hooks, "
            f"as torch checks it without them)")


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic collector off while a runtime is set up or its weights exported, as it
    was found after (a context manager, or a decorator). Both allocate many short-lived objects
    (the model's parameter tables, transformers' key conversions): each allocation threshold
    reached starts a collection, and the oldest generation's pass walks every object of torch
    and transformers (360 K): 0.33 to 0.42 s of a 2 to 3 s checkpoint load, a fifth of an
    export's CPU samples (gc.callbacks and perf, 2026-12-07, a 279 M-param Llama). Reference
    counting still frees what they drop; cycles wait for the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
