"""Saved-tensor hooks: what a unit's training forward saves for backward, and how the backward
gets it back. Every pack/unpack pair a unit pushes (unit_hooks.UnitHooks, through ``push``) is here,
each run eagerly even when autograd calls it from compiled code (compiling.py):

- ``pack`` / ``unpack``: a saved tensor that aliases chunk memory is packed as a chunk
  reference (``_ChunkRef``) and unpacked in backward as a view of the chunk's *current* device
  copy (Backward.base: re-acquired, and held until every parameter of the group used in the
  forward has its gradient). A saved view of a split parameter's contiguous compute copy
  (chunks.split_copies) is packed as a reference to its pieces (``_SplitRef``), so the copy is
  freed at its unit's exit, and assembled again, one piece's chunk pinned at a time, when the
  backward unpacks it. Any other tensor stays as it is (``_Plain``), counted in the
  activation ledger — or, under offload / auto, is handed to activations.py (``_ActRef``:
  offloaded, spilled, fetched back at its unit's backward moment).
- ``recompute_pack`` / ``rc_unpack``: a recomputed unit's saves become refs into its frame
  (recompute.py), recomputed at the first unpack; chunk views and the unit's own inputs stay
  as above.
- ``droppable_pack``: auto, a unit the plan does not recompute: saved as offload saves, each
  ref knowing its position in the frame's saves, so that what the host budget had no room for
  (dropped) is recomputed instead.

Invariants: a saved tensor is checked for in-place modification at unpack as torch checks it
without hooks (shared._guard/_check); nothing packed keeps the saving node's own output (a
cycle through C++ the collector cannot see: ``_Plain`` keeps ``t.detach()``); every unpack
first begins the backward and marks the moment of the unit whose forward saved the tensor.

Owns nothing but the ref types: the state is the chunk access's (live chunk memory), the
activation ledger's, the recompute frames' and the backward's. Reads the run state (the
innermost running unit saves).

Threading: pack on the training thread (the forward); unpack on autograd's backward thread.
"""
from __future__ import annotations

import functools

import torch

from .activations import _ActRef
from .compiling import eager
from .recompute import _RecomputeRef
from .shared import _check, _guard
from .tensor import ChunkTensor


class _Plain:
    """A saved non-chunk tensor that stays as it is (with its version guard).

    It keeps ``t.detach()`` (same storage and version counter), never ``t``: the autograd
    node that saves it owns this object, and an output a node saves for itself (exp, tanh,
    softmax) has that node as its grad_fn — keeping ``t`` would be a cycle through C++ that
    Python's collector cannot see, so a graph dropped without backward (or cut short by an
    error) would never be freed, nor the runtime its unpack hook is bound to. torch saves
    such outputs without their grad_fn for the same reason and gives the unpacked tensor its
    grad_fn back itself."""
    __slots__ = ("t", "guard")

    def __init__(self, t):
        self.t, self.guard = t.detach(), _guard(t)


class _ChunkRef:
    __slots__ = ("group", "offset", "size", "stride", "unit", "guard")

    def __init__(self, group, offset, size, stride, unit, guard):
        self.group, self.offset, self.size, self.stride = group, offset, size, stride
        self.unit = unit  # index of the innermost unit whose forward saved it (-1: none)
        self.guard = guard


class _SplitRef:
    """A saved view of split parameter `r`'s compute copy: its strides into the copy, which
    the backward assembles again from the pieces (holding no copy between the two)."""
    __slots__ = ("r", "offset", "size", "stride", "unit", "guard")

    def __init__(self, r, offset, size, stride, unit, guard):
        self.r, self.offset, self.size, self.stride = r, offset, size, stride
        self.unit = unit  # index of the innermost unit whose forward saved it (-1: none)
        self.guard = guard


class SavedTensors:
    """The saved-tensor hooks of one runtime's units (see the module docstring)."""

    def __init__(self, chunks, state, activations, recompute, backward, device: torch.device):
        self.chunks = chunks
        self.state = state
        self.activations = activations
        self.recompute = recompute
        self.backward = backward
        self.device = device
        # What autograd calls, eager even from inside a compiled unit's forward (its
        # save_for_backward) or a compiled backward (compiling.py).
        self._pack, self._unpack = eager(self.pack), eager(self.unpack)
        self._droppable_pack = eager(self.droppable_pack)
        self._recompute_pack, self._rc_unpack = eager(self.recompute_pack), eager(self.rc_unpack)

    def push(self, frame, drops: bool):
        """Pushes the saved-tensor hooks of one call of a unit's training forward (the unit
        hooks pop them at its exit): `frame` None — kept as they are, chunk views as refs;
        `drops` — auto, a unit the plan does not recompute; else recomputed in the
        backward."""
        if frame is not None and drops:  # kept or offloaded, or dropped and recomputed
            pack, unpack = functools.partial(self._droppable_pack, frame), self._unpack
        elif frame is not None:  # the unit's saves are recomputed in its backward
            pack, unpack = functools.partial(self._recompute_pack, frame), self._rc_unpack
        else:
            pack, unpack = self._pack, self._unpack
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)

    def pack(self, t: torch.Tensor):
        if isinstance(t, ChunkTensor):
            return t  # a parameter: a leaf, no node to make a cycle with
        if t.layout != torch.strided:
            return t.detach()  # as _Plain: never the saving node's own output
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t.detach()
        g = self.chunks.live.get(ptr)
        acts, active = self.activations, self.state.active_units
        split = self.chunks.split_copies.get(ptr) if g is None else None
        if split is not None:
            return _SplitRef(split, t.storage_offset(), tuple(t.size()), tuple(t.stride()),
                             active[-1].index if active else -1, _guard(t))
        if g is None and acts.offload and active and t.device == self.device:
            ref = acts.save(t, ptr)
            if ref is not None:
                return ref
            return _Plain(t)  # counted already, outside every unit: it stays
        if g is None:
            n = t.untyped_storage().nbytes()
            if acts.count:
                acts.count_saved(active[-1].index if active else -1, ptr, n)
            else:
                acts.count_outside(ptr, n)
            acts.trace_saved(ptr, n)  # saved by the current unit: its bytes in the trace
            return _Plain(t)
        unit = active[-1].index if active else -1
        return _ChunkRef(g, t.storage_offset(), tuple(t.size()), tuple(t.stride()), unit,
                         _guard(t))

    def unpack(self, ref):
        if isinstance(ref, _Plain):
            _check(ref.guard)
            return ref.t
        if isinstance(ref, _SplitRef):
            return self._split_unpack(ref)
        if not isinstance(ref, _ChunkRef):
            return self._act_unpack(ref) if isinstance(ref, _ActRef) else ref
        _check(ref.guard)
        self.backward.begin()
        self.backward.moment(ref.unit)
        return self.backward.base(ref.group).as_strided(ref.size, ref.stride, ref.offset)

    def _split_unpack(self, ref):
        # The copy again, assembled one piece's chunk at a time (a unit computing with the
        # parameter now — a recompute — has one already); autograd frees it once the node
        # that saved it has run.
        _check(ref.guard)
        self.backward.begin()
        self.backward.moment(ref.unit)
        r = ref.r
        v = r.compute.data if r.mat > 0 else self.chunks.copy_of(r, self.chunks.compute_kind)
        return v.as_strided(ref.size, ref.stride, ref.offset)

    def _act_unpack(self, ref):
        # Like a saved chunk view: the backward reached the unit that saved it (whose
        # activations that moment fetches, and the next unit's when there is room).
        _check(ref.guard)
        self.backward.begin()
        self.backward.moment(ref.unit)
        if ref.saved.dropped:  # auto: the host had no room for it either: recomputed
            return self.recompute.values(ref.frame)[ref.index]
        return self.activations.fetched(ref)

    # ---- recomputed units (recompute.py) ----------------------------------------------------
    def droppable_pack(self, frame, t: torch.Tensor):
        """auto, a unit the plan does not recompute: saved as 'offload' saves it, and the ref
        knows its position in the frame's saves, so it can be recomputed if dropped."""
        if not self.chunks.is_chunk_memory(t) and frame.holds_input(t):
            frame.n += 1
            return _Plain(t)  # an input: held by the frame anyway
        ref = self.pack(t)
        if isinstance(ref, _ActRef):
            ref.frame, ref.index = frame, frame.n
            frame.meta[frame.n] = (tuple(t.shape), t.dtype, t.device)
            ref.saved.free_refs -= 1  # pack counted it as a ref without a frame
            frame.handles.append(ref.saved)
        frame.n += 1
        return ref

    def recompute_pack(self, frame, t: torch.Tensor):
        if self.chunks.is_chunk_memory(t):
            frame.n += 1  # its position, kept by the recompute's saves
            return self.pack(t)  # a chunk view: re-acquired in the backward, not recomputed
        if frame.holds_input(t):
            frame.n += 1
            return _Plain(t)  # (a view of) an input: held anyway, nothing to recompute
        if self.recompute.planned:
            # What the unit saves, as if kept: the planner chooses its policy from it.
            st = t.untyped_storage()
            self.activations.trace_saved(st.data_ptr(), st.nbytes())
        return frame.record(t)

    def rc_unpack(self, ref):
        if not isinstance(ref, _RecomputeRef):
            return self.unpack(ref)
        frame = ref.frame
        self.backward.begin()
        self.backward.moment(frame.unit.index)  # frees the previous unit's activations first
        return self.recompute.values(frame)[ref.index]
