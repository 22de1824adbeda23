"""Recomputed activations (``activations: recompute``, or a plan's choice under ``auto``).

A unit whose activations are recomputed keeps nothing its forward saves for backward but its
inputs: the saved-tensor hooks of that forward (saved.SavedTensors.recompute_pack) hand
autograd a _RecomputeRef per saved tensor instead of the tensor. When the backward first
unpacks one, Recompute.run runs the unit's forward again on the same inputs, with the RNG and
autocast state of the first run and the unit's chunks on the device, captures what that run
saves in the same order, and gives autograd the tensor at the same position — the same values,
so gradients are bit for bit those of keeping them (torch.utils.checkpoint's non-reentrant
scheme, per unit, with tiermem's chunks and budget).

Checked, never silently wrong: the recompute must save as many tensors, of the same shapes,
dtypes and devices, as the forward did; the inputs must not have been modified in place since
the forward; a tensor the recompute saves and then modifies in place raises as torch does; a
unit called with a KV cache (an object it updates in place: it would be updated twice) is
refused before anything runs.

Ownership: a _Recompute belongs to the _RecomputeRef objects autograd keeps in the graph, so
its inputs live as long as the graph (as torch.utils.checkpoint's do); the recomputed tensors
are held from the recompute until the backward leaves the unit (Recompute drops them then,
and a later unpack — retain_graph, a revisited unit — recomputes again).

Recompute is the runtime's side: which calls get a Frame (``frame_for``: every unit that
contains no other unit under ``recompute``; under ``auto`` the units an executed plan
recomputes, and the others a frame that can recompute what the host budget leaves no room
for), running one (``run``), and dropping the recomputed values when the backward leaves the
unit or the iteration ends. Owns: the frames holding recomputed values, per unit; which unit
is being recomputed now (the unit hooks do nothing meanwhile). Reads: the session (phase,
plan), the chunk access (what is chunk memory), the materializer (the unit's parameters in
place), the backward's held compute chunks, the activation ledger (a frame's inputs and
recomputed values are counted there as the unit's activations; the inputs are ``kept`` on the
device).

Threading: frames are made on the training thread (a unit's pre-forward) and run on
autograd's backward thread (the first unpack of one of their refs), one at a time.
"""
from __future__ import annotations

import torch

from . import _C
from .compiling import eager, run_compiled
from .shared import _check, _guard


def _map(x, fn):
    """fn over the leaves of tuples, lists and dicts (not torch's pytree: that also flattens
    registered objects such as Hugging Face caches, which must stay the same object)."""
    if type(x) in (tuple, list):
        return type(x)(_map(e, fn) for e in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_map(e, fn) for e in x))
    if type(x) is dict:
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x)


def _leaves(x):
    out = []
    _map(x, lambda e: out.append(e))
    return out


class _RecomputeRef:
    """What autograd holds for a tensor a recomputed unit saved: its position in the unit's
    saves, and the frame that can produce it again."""
    __slots__ = ("frame", "index")

    def __init__(self, frame, index):
        self.frame, self.index = frame, index


def _autocast_state(device_type: str):
    if not torch.is_autocast_enabled(device_type):
        return None
    return dict(device_type=device_type, dtype=torch.get_autocast_dtype(device_type),
                cache_enabled=torch.is_autocast_cache_enabled())


def kv_cache_in(args, kwargs):
    """The first argument that looks like a Hugging Face KV cache (an object the forward
    updates in place), or None."""
    for x in _leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) or x is None:
            continue
        names = [c.__name__ for c in type(x).__mro__]
        if any(n.endswith("Cache") for n in names) and callable(getattr(x, "update", None)):
            return x
    return None


class Frame:
    """One outermost call of a recomputed unit (see the module docstring)."""

    def __init__(self, unit, args, kwargs, device: torch.device, is_chunk, compiler=None):
        self.unit = unit
        self.forward = unit.forward  # its wrapper (forwards._UnitForward): call, inner
        self.compiler = compiler  # the torch.compile callback the forward ran under (or None)
        self.inputs = []  # (tensor, version at the call)

        def keep(x):
            if not isinstance(x, torch.Tensor) or is_chunk(x):
                return x
            d = x.detach().requires_grad_(x.requires_grad)  # same storage and version counter
            self.inputs.append((d, d._version))
            return d

        self.args, self.kwargs = _map((tuple(args), dict(kwargs)), keep)
        self.rng = torch.get_rng_state()
        self.cuda = device if device.type == "cuda" else None
        self.cuda_rng = torch.cuda.get_rng_state(device) if self.cuda is not None else None
        self.autocast = [s for s in (_autocast_state("cpu"), _autocast_state(device.type)
                                     if device.type != "cpu" else None) if s is not None]
        self.n = 0         # tensors the forward saved so far (the next one's index)
        self.meta = {}     # index -> (shape, dtype, device) of each save to recompute
        self.values = None  # index -> recomputed tensor, from the recompute until it is dropped
        self.counted = set()  # storages of `values` counted in the device budget
        self.input_ptrs = set()  # storages of the inputs on the device (set by the runtime)
        self.handles = []  # auto: the runtime's _Saved its refs point to (kept, maybe dropped)

    def name(self) -> str:
        u = self.unit
        return u.name or type(u.module).__name__

    def holds_input(self, t: torch.Tensor) -> bool:
        """`t` is (a view of) one of the inputs the frame keeps anyway: saved as it is."""
        return t.untyped_storage().data_ptr() in self.input_ptrs

    def record(self, t: torch.Tensor) -> _RecomputeRef:
        i = self.n
        self.n += 1
        self.meta[i] = (tuple(t.shape), t.dtype, t.device)
        return _RecomputeRef(self, i)

    def check_inputs(self):
        for t, v in self.inputs:
            if t._version != v:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: an input of unit {self.name()!r} (recomputed in the "
                    f"backward, activations: recompute) is at version {t._version}; expected "
                    f"version {v} instead")

    def run(self, capture):
        """Runs the unit's forward again as the first run did; `capture` is the saved-tensor
        pack hook collecting what it saves. The caller has the unit's parameters in place."""
        devices = [self.cuda] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, enabled=True):
            torch.set_rng_state(self.rng)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.cuda)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(capture, _unused):
                ctx = [torch.autocast(**s) for s in self.autocast]
                for c in ctx:
                    c.__enter__()
                try:
                    # As the first run called it: the same compiled graph saves the same.
                    w = self.forward
                    run_compiled(self.compiler, w.call, w.inner, *self.args, **self.kwargs)
                finally:
                    for c in reversed(ctx):
                        c.__exit__(None, None, None)

    def take(self, saved, check):
        """Checks the recompute's saves (tensor, version guard) against the forward's — `check`
        raises for a guard whose tensor was modified in place since it was saved — and keeps
        those autograd will ask for."""
        if len(saved) != self.n:
            raise RuntimeError(
                f"tiermem: recomputing unit {self.name()!r} in the backward (activations: "
                f"recompute) saved {len(saved)} tensors for backward where its forward saved "
                f"{self.n}: its forward does not run the same way twice (data-dependent "
                f"control flow, state it changes, a KV cache) — use activations 'offload' or "
                f"'budget' for it")
        values = {}
        for i, (shape, dtype, device) in self.meta.items():
            t, guard = saved[i]
            if (tuple(t.shape), t.dtype, t.device) != (shape, dtype, device):
                raise RuntimeError(
                    f"tiermem: recomputing unit {self.name()!r} in the backward (activations: "
                    f"recompute) gave saved tensor {i} shape {tuple(t.shape)}, {t.dtype} on "
                    f"{t.device} where its forward saved {shape}, {dtype} on {device}: its "
                    f"forward does not run the same way twice — use activations 'offload' or "
                    f"'budget' for it")
            check(guard)
            values[i] = t
        self.values = values


def _unused(_):
    raise RuntimeError("tiermem: a recompute's own graph is never differentiated")


class Recompute:
    """Recomputed activations of one runtime (see the module docstring)."""

    def __init__(self, modes, session, chunks, state, materializer, activations, backward,
                 device: torch.device):
        self.session = session
        self.chunks = chunks
        self.state = state
        self.materializer = materializer
        self.activations = activations
        self.backward = backward
        self.device = device
        # activations: recompute — every unit that contains no other unit keeps only its inputs
        # and recomputes what its forward saved in its backward; auto — the units an executed
        # plan recomputes, the others as 'offload'.
        self.all_units = modes.activations.recompute_every_unit
        self.planned = modes.activations.planned
        self._frames: dict[int, list] = {}  # unit -> its frames holding recomputed values
        self.recomputing = None             # the unit being recomputed now
        activations.on_reset(self.reset)
        activations.on_unit_done(self.unit_done)

    @staticmethod
    def recomputable(u) -> bool:
        # A unit holding other units would recompute them (their hooks, their moments) too.
        return not u.direct_only

    def frame_for(self, u, args, kwargs, compiler=None):
        """(Frame, drops) for this outermost training call of `u`: a Frame that recomputes
        every save (drops False: recompute, or the plan's choice under auto), or under auto one
        that keeps what it saves as 'offload' does and can recompute what the host budget
        leaves no room for (drops True); (None, False): no frame. A frame's inputs are kept
        until the unit's backward, counted as the unit's activations; `compiler`: the
        torch.compile callback the call runs under (compiling.py), its recompute's too."""
        if not self.state.in_iteration or not self.recomputable(u):
            return None, False
        if len(u.placed) < len(u.slots):
            # The caller swapped some of its parameters for this call (Materializer.place) and
            # swaps them back before the backward: a recompute would run with the wrong ones,
            # so this call's saves are kept (or offloaded) instead.
            return None, False
        drops = False
        if self.planned:
            if kv_cache_in(args, kwargs) is not None:
                return None, False  # never recomputed: kept or offloaded as 'offload' does
            drops = not (self.session.plan_followed and self.session.plan_recomputes_unit(u.index))
        elif not self.all_units:
            return None, False
        frame = Frame(u, args, kwargs, self.device, self.chunks.is_chunk_memory, compiler)
        acts = self.activations
        for t, _ in frame.inputs:
            if t.device != self.device:
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            acts.kept.add(ptr)
            frame.input_ptrs.add(ptr)
            if acts.count_saved(u.index, ptr, st.nbytes()):  # else saved by an earlier unit
                acts.trace_saved(ptr, st.nbytes())
        return frame, drops

    def values(self, frame) -> dict:
        """index -> tensor of what `frame`'s unit saved, recomputed now unless it is held."""
        if frame.values is None:
            self.run(frame)
        return frame.values

    def run(self, frame):
        """Runs the unit's forward again with its chunks on the device (held as the
        backward's own, Backward.base) and keeps what it saves, counted in the device budget
        until the backward leaves the unit."""
        u = frame.unit
        frame.check_inputs()
        mat = self.materializer
        bases = {g: self.backward.base(g) for g in u.pin_groups}
        mat.materialize(u, bases)
        placed = mat.place(u)
        saved = []

        @eager  # called from a compiled forward's save_for_backward too (compiling.py)
        def capture(t):
            # Detached (same storage and version counter): the recompute's graph holds this
            # hook, so a tensor with that graph's grad_fn here would make a reference cycle
            # through autograd that Python's collector cannot see (a leak per recompute).
            d = t.detach()
            saved.append((d, _guard(d)))
            return None

        self.recomputing = u
        self.session.phase(_C.RunPhase.recompute)
        try:
            frame.run(capture)
        finally:
            self.recomputing = None
            self.session.phase(_C.RunPhase.backward)
            for m, name, r in placed:
                m._parameters[name] = r.param
            mat.unmaterialize(u, bases)  # (its forward cannot write them: refused before)
        frame.take(saved, _check)
        n = 0
        acts = self.activations
        for t in frame.values.values():
            if t.device != self.device or self.chunks.is_chunk_memory(t):
                continue
            st = t.untyped_storage()
            if acts.count_saved(u.index, st.data_ptr(), st.nbytes()):  # else an input, or
                frame.counted.add(st.data_ptr())                       # counted already
                n += st.nbytes()
        self._frames.setdefault(u.index, []).append(frame)
        acts.stats["recomputed_units"] += 1
        acts.stats["recomputed_bytes"] += n
        acts.sync()

    def unit_done(self, unit):
        """The backward left `unit` (Activations.unit_done): its recomputed values go."""
        self._drop(self._frames.pop(unit, ()))

    def reset(self):
        """The iteration ended or was abandoned (Activations.reset)."""
        for frames in self._frames.values():
            self._drop(frames)
        self._frames.clear()

    def _drop(self, frames):
        """The backward left the frames' unit: their recomputed tensors are no longer held
        (autograd keeps those it unpacked until their nodes run) nor counted."""
        for frame in frames:
            frame.values = None
            self.activations.seen -= frame.counted
            frame.counted = set()
