"""Units at run time: what a unit's forward makes real, and the hooks around it (units.py picks
the units).

- ``Materializer``: a unit's parameters become views of their chunks for its forward
  (``materialize``) and are put in its modules' slots (``place``); after it, the slots get
  their ChunkTensor back and the views their placeholder (``unmaterialize``: a parameter
  written in place inside the forward marks its group modified, and in mixed precision its
  fp32 master follows).
- ``UnitHooks``: the enter/exit of every unit's forward and of the model's (forwards.py wraps
  them). The units are declared to the session's unit protocol (runtime/unit_protocol.h,
  ``session.units``), which does the protocol's part: a unit's pre-forward begins the
  iteration at the first training forward and enters the unit there (the optimizer's
  deferred updates of its groups, then its moment); the hook then acquires (pins) its chunk
  groups on the device (not those only split parameters' pieces are in: their contiguous
  copies are assembled one piece's chunk pinned at a time) — through chunks.ChunkAccess, which gathers them when sharded —
  materializes and places its parameters, and pushes the saved-tensor hooks of its forward
  (saved.py: plain, offloaded or recomputed). Its post-forward undoes all of it in reverse.
- ``ForwardOrder``: sharded, the order in which the last training forward entered its units,
  so the chunks of the unit after (forward) or before (backward) the current one are gathered
  meanwhile.

Invariants: ``r.mat`` counts the units materializing parameter ``r`` now, and ``r.compute``
views chunk memory exactly while it is > 0 (always, resident: pinned for the session);
``u.depth`` counts the calls of unit ``u`` in progress and only the outermost acquires,
materializes and releases; every push of saved-tensor hooks is popped by the same call's
exit (``u.pushed``); a pre-forward that raises leaves nothing pinned and the model unchanged;
nothing runs while a recompute runs a unit's forward again (``Recompute.recomputing``), nor
after close.

Owns: the per-call state of each unit (``depth``, ``pins``, ``placed``, ``pushed``,
``frame``), the run state's ``root_depth``, ``active_units``, ``fwd_used`` and the start of
an iteration (its phase into FORWARD: shared.Phase), the watched graphs of the open iteration,
the forward order,
the hyper-parameters announced for the next step (``optimizer_overlap: backward``).
Reads: the session, the chunk access, the activations, recompute and saved-tensor parts.

Threading: the training thread (the thread calling the model). A recompute runs a unit's
forward on autograd's backward thread, and these hooks then do nothing.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from .forwards import _UnitForward, _wrap_forward
from .recompute import kv_cache_in
from .shared import _Param
from .units import unit_modules


def piecewise(r: _Param) -> bool:
    """A split parameter whose compute copy is assembled one piece's chunk pinned at a time,
    its unit pinning none of them (docs/host-mode.md): not an expert set's fused tensor, whose
    experts view their pieces in the unit's pinned chunks (experts.py)."""
    return r.split and r.expert_set < 0


class Materializer:
    """Parameters as views of their chunks while a unit computes (see the module docstring).
    Reads the chunk access (slices, the fp32 master in mixed precision)."""

    def __init__(self, chunks, modes):
        self.chunks = chunks
        self.modes = modes

    def materialize(self, u, views):
        """`u`'s parameters become views of their chunks (`views`: group -> the acquired
        chunk) for the module's forward; `mat` counts the units holding each one so. The
        caller then puts them in the unit's slots (place)."""
        for r in u.params:
            if r.mat == 0:
                # Split: a copy of its pieces, assembled one piece's chunk pinned at a time
                # (piecewise), or from the unit's pinned chunks (an expert set's).
                r.compute.data = self.chunks.copy_of(r, self.chunks.compute_kind) \
                    if piecewise(r) else self.chunks.view(views, r)
                r.version = r.compute._version
                if r.split:  # saved in the forward: a reference to its pieces (saved.py)
                    self.chunks.split_copies[r.compute.data_ptr()] = r
            r.mat += 1

    @staticmethod
    def place(u) -> list:
        """Puts `u`'s compute views in the slots that hold the managed parameter and returns
        those slots (the caller gives them back their parameter). A slot holding anything else
        was swapped by the caller — torch.func.functional_call, torch.nn.utils.stateless —
        and keeps the caller's tensor, as on the plain model: the forward computes with it."""
        placed = [(m, name, r) for m, name, r in u.slots if m._parameters.get(name) is r.param]
        for m, name, r in placed:
            m._parameters[name] = r.compute
        return placed

    def unmaterialize(self, u, views) -> set:
        """Undoes materialize for `u`'s parameters (the caller restores its slots; `views`:
        group -> the acquired chunk, still pinned); returns the groups of the parameters
        written in place meanwhile (their master synced; a split one's copy written back into
        its pieces)."""
        modified = set()
        for r in u.params:
            r.mat -= 1
            if r.mat == 0:
                if r.compute._version != r.version:  # written in place inside the forward
                    modified.update(r.groups)
                    if piecewise(r):
                        self.chunks.write_back(r, self.chunks.compute_kind, r.compute.data)
                    elif r.split:
                        self.chunks.scatter(views, r, r.compute.data)
                    if self.modes.mixed:
                        self.chunks.sync_master(r, (), r.compute.data, None)
                if r.split:  # by value: an in-place op may have moved the data
                    copies = self.chunks.split_copies
                    for ptr in [p for p, c in copies.items() if c is r]:
                        del copies[ptr]
                r.compute.data = r.placeholder  # a split copy is freed: nothing saved keeps it
        return modified

    def follow_requires_grad(self, r: _Param, want: bool):
        """Called by ``ChunkTensor.__torch_function__`` before the user's ``requires_grad_``
        or ``requires_grad = flag`` on parameter `r` takes effect. A forward computes with
        each unit's compute view, not with the parameter the user sees: a parameter frozen
        after initialize must freeze its view too, or it would still get a gradient and the
        optimizer would update it. One frozen at initialize has no gradient chunk nor
        optimizer state: unfreezing it is an error, raised before anything changes."""
        if want and not r.trainable and self.modes.serving:
            raise RuntimeError(
                f"tiermem: parameter {r.name!r} belongs to a served model (tiermem.inference keeps "
                f"no gradients nor optimizer state); it cannot require grad. Use "
                f"tiermem.initialize to train; nothing was changed.")
        if want and not r.trainable:
            raise RuntimeError(
                f"tiermem: parameter {r.name!r} was frozen (requires_grad=False) when the "
                f"model was initialized, so it has no gradient nor optimizer state; it "
                f"cannot be unfrozen afterwards. Unfreeze it before tiermem.initialize "
                f"(a parameter may be frozen later); nothing was changed.")
        if r.compute is not None:
            r.compute.requires_grad_(want)


class ForwardOrder:
    """Sharded: the units the last training forward entered, in order (``units``), and this
    forward's so far (``seq``; it becomes the order at the next iteration's start)."""

    def __init__(self, units, chunks):
        self.units = units
        self.chunks = chunks
        self._last: list = []  # units entered by the last training forward, in order
        self._pos: dict = {}   # unit index -> its position there
        self.seq: list = []    # this forward's, so far

    def begin_iteration(self):
        if self.seq:
            self._last, self.seq = self.seq, []
            self._pos = {u: i for i, u in enumerate(self._last)}

    def neighbour(self, unit: int, step: int):
        """The unit that ran after (`step` +1) or before (-1) `unit` in the last training
        forward, or None."""
        i = self._pos.get(unit)
        if i is None or not 0 <= i + step < len(self._last):
            return None
        return self.units[self._last[i + step]]

    def prefetch_after(self, unit: int, step: int):
        """Sharded: starts gathering the chunks of the unit that ran after (`step` +1, the
        forward) or before (-1, the backward) `unit` in the last training forward."""
        nxt = self.neighbour(unit, step)
        if nxt is None:
            return
        for g in nxt.groups:
            self.chunks.prefetch(g)


class _GraphSentinel:
    """Owned by a no-op pre-hook on an output's autograd node: alive while the graph is."""


def tree_leaves_tensors(obj):
    """The tensors in a forward's output (nested tuples, lists, dicts, Hugging Face
    ModelOutputs)."""
    from torch.utils._pytree import tree_flatten
    found = []
    for x in tree_flatten(obj)[0]:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, Mapping):  # a mapping pytree does not know (a ModelOutput)
            found.extend(tree_leaves_tensors(list(x.values())))
    return found


class UnitHooks:
    """The enter/exit hooks of the units' and the model's forwards (see the module
    docstring)."""

    def __init__(self, model, units, session, chunks, state, materializer, activations,
                 recompute, saved, order, modes):
        self.model = model
        self.units = units
        self.session = session
        self.chunks = chunks
        self.state = state
        self.materializer = materializer
        self.activations = activations
        self.recompute = recompute
        self.saved = saved
        self.order = order
        self.resident = modes.resident  # pinned for the session: no acquires, no hooks
        self.hyper_of_next_step = None  # the optimizer's hyper-parameters (overlap backward)
        self._open_graphs = []  # weakrefs to the open iteration's sentinels (_watch_graph)
        activations.on_reset(self._open_graphs.clear)

    def install(self, params, registry, alone=frozenset()):
        """The units' slots, parameters and groups, and their forwards wrapped (`registry`:
        the runtime's list of wrapped modules, undone at close). Parameters in `alone` (indices:
        experts that move alone, experts.py) are no unit's."""
        parent_of = {}  # unit index -> the innermost (direct-only) unit holding it
        unit_of = {id(u.module): i for i, u in enumerate(self.units)}
        for i, u in enumerate(self.units):
            if u.direct_only:
                for m in u.module.modules():
                    if m is not u.module and id(m) in unit_of:
                        parent_of[unit_of[id(m)]] = i
        slot_of = {}
        for r in params:
            if r.index in alone:
                continue
            for m, name in r.slots:
                slot_of.setdefault(id(m), []).append((name, r))
        for index, u in enumerate(self.units):
            u.index = index
            seen, uparams = set(), []
            for _, m in unit_modules(u):
                for name, r in slot_of.get(id(m), ()):
                    u.slots.append((m, name, r))
                    if r.index not in seen:
                        seen.add(r.index)
                        uparams.append(r)
            u.params = uparams
            for r in uparams:
                if r.unit < 0:
                    r.unit = index  # the first unit that computes with it
            u.groups = sorted({g for r in uparams for g in r.groups})
            # What its forward pins: not the groups only split parameters' pieces are in (their
            # copy is assembled one piece's chunk at a time: Materializer.materialize).
            u.pin_groups = sorted({g for r in uparams if not piecewise(r) for g in r.groups})
            # Declared to the session's unit protocol (runtime/unit_protocol.h), in order: its
            # index there is u.index; nested in the unit holding it, if any.
            declared = self.session.units.declare(u.name or type(u.module).__name__, u.groups,
                                                  parent_of.get(index, -1))
            assert declared == index, (declared, index)
            u.depth = 0
            u.pins = []
            u.placed = []  # the slots this call put compute views in (Materializer.place)
            u.pushed = []
            u.frame = None  # the current call's Frame (recompute.py), if it has one
            u.frame_drops = False  # auto: its saves are kept/offloaded unless the host is full
            _wrap_forward(u.module, self._unit_enter(u), self._unit_exit(u), registry,
                          cls=_UnitForward, owner=type(u.module), holds_units=u.direct_only)
            u.forward = u.module.__dict__["forward"]  # its wrapper: what a recompute runs again

    # ---- the model's forward ------------------------------------------------------------
    def root_enter(self):
        if self.state.root_depth == 0:
            self._refuse_ddp()
        self.state.root_depth += 1

    def _refuse_ddp(self):
        """A managed model inside ``DistributedDataParallel``: DDP's reducer hooks the
        parameters' gradient accumulators, which autograd never reaches (the units compute
        with their own views), so DDP would never all-reduce — and tiermem already averages
        gradients across the process group itself (docs/distributed.md). Refused at the
        forward, before anything changes. DDP marks its forward on the class (torch >= 2.0;
        its Python-reducer mode does not, and is not caught)."""
        ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
        if ddp is None or not any(m is self.model for m in ddp.module.modules()):
            return
        raise RuntimeError(
            f"tiermem: {type(self.model).__name__} is managed by tiermem and wrapped in "
            f"DistributedDataParallel; DDP never sees its gradients (tiermem computes them in "
            f"its chunks), and tiermem already shards and averages across its process group "
            f"by itself. Call the model tiermem.initialize returned directly, without "
            f"DDP (docs/distributed.md); nothing was changed.")

    def root_exit(self, out=None):
        st = self.state
        st.root_depth -= 1
        if st.root_depth == 0 and st.in_forward:
            self._watch_graph(out)
            if self.activations.count:
                # The whole forward's activations hold their room before the backward starts
                # (a MemoryError here leaves nothing pinned; the backward then only gives room
                # back).
                self.activations.sync()

    # A forward with grad enabled that no backward follows (an evaluation loss computed
    # without no_grad, then dropped) leaves its iteration open: its saved activations would
    # stay counted, and the next forward would count its own on top (a MemoryError that
    # plain torch would not raise, or offloads of activations nobody can use). So each
    # completed forward of the open iteration hangs a sentinel on the autograd nodes of its
    # outputs (a no-op pre-hook owns it; the nodes own their hooks); when every sentinel is
    # gone, no graph of the iteration can run backward any more, and the next forward
    # abandons it. Outputs without a node (nothing differentiable) leave it open, as before.
    def _watch_graph(self, out):
        nodes = {id(t.grad_fn): t.grad_fn for t in tree_leaves_tensors(out)
                 if t.grad_fn is not None}
        for node in nodes.values():
            sentinel = _GraphSentinel()
            node.register_prehook(lambda grad_outputs, _keep=sentinel: None)
            self._open_graphs.append(weakref.ref(sentinel))

    def _open_graphs_dropped(self) -> bool:
        return bool(self._open_graphs) and all(r() is None for r in self._open_graphs)

    # ---- a unit's forward ---------------------------------------------------------------
    def _unit_enter(self, u):
        name = u.name or type(u.module).__name__
        st, s, chunks, acts, rc = self.state, self.session, self.chunks, self.activations, \
            self.recompute

        def hook(args, kwargs, compiler=None):
            if st.closed or rc.recomputing is not None:
                return None  # a recompute runs the unit's own forward, not these hooks
            grad = torch.is_grad_enabled()
            if grad and rc.all_units and u.depth == 0 and rc.recomputable(u) \
                    and not self.resident:
                cache = kv_cache_in(args, kwargs)
                if cache is not None:
                    raise ValueError(
                        f"tiermem: unit {name!r} was called with a "
                        f"{type(cache).__name__} (a KV cache its forward updates in place) "
                        f"while training with activations 'recompute', which runs the forward "
                        f"again in the backward and would update the cache twice. Pass "
                        f"use_cache=False when training (as Hugging Face does for gradient "
                        f"checkpointing), or use activations 'offload'; the model is unchanged.")
            if grad and st.in_forward and self._open_graphs_dropped():
                acts.abandon()  # _watch_graph: the open iteration's graphs are gone
            if grad and not st.in_iteration:
                acts.reset()
                if chunks.sharded:
                    self.order.begin_iteration()
                s.units.begin_iteration()  # the session's iteration, phase "forward"
                if self.hyper_of_next_step is not None:
                    # What step() will pass, unless the user changes it before (then the
                    # speculative updates are dropped at step(): session.h).
                    s.set_step_hyper(self.hyper_of_next_step())
                acts.start_trace(s.recording_trace)
                st.begin_forward()
            u.depth += 1
            if u.depth == 1 and self.resident:
                for r in u.params:
                    r.mat += 1
                u.placed = self.materializer.place(u)
            elif u.depth == 1:
                chunks.follow_tracing()  # before the moment: eval isn't traced
                also = []  # sharded: the next unit's deferred updates too (it prefetches them)
                if chunks.sharded and grad:
                    nxt = self.order.neighbour(u.index, +1)
                    if nxt is not None:
                        also = nxt.groups
                if s.pending_steps:
                    chunks.on_stream()  # device-placed updates queue on torch's stream
                try:
                    # The deferred updates of its groups, then its pre-forward moment
                    # (runtime/unit_protocol.h).
                    s.units.enter_unit(u.index, grad, also)
                except BaseException:
                    u.depth -= 1
                    raise
                pins = []
                try:
                    if acts.count and st.in_iteration:
                        # The activations saved so far take their room now, after this
                        # moment's planned evictions (a plan frees the room it foresaw).
                        acts.sync()
                    views = {}
                    for g in u.pin_groups:
                        views[g] = chunks.acquire(g, chunks.compute_kind)
                        pins.append((g, views[g]))
                except BaseException as e:
                    for g, b in pins:
                        chunks.release(g, chunks.compute_kind, False, b)
                    s.units.exit_unit(u.index)
                    u.depth -= 1
                    held = acts.given
                    if acts.count:  # the device room went to activations: abandon it
                        acts.abandon()
                    if isinstance(e, MemoryError) and held:
                        hint = ("'offload' moves them to the host" if not acts.offload
                                else "the host has them all but the running units'")
                        raise MemoryError(
                            f"tiermem: the chunks of unit {name!r} do not fit "
                            f"the device budget next to the {held} bytes of activations "
                            f"saved for backward so far ({hint}): {e}. Use a larger device "
                            f"budget or a smaller batch; the model is unchanged.") from None
                    raise
                u.pins = pins
                if chunks.sharded and grad:
                    self.order.seq.append(u.index)
                    self.order.prefetch_after(u.index, +1)  # the next unit's chunks, meanwhile
                self.materializer.materialize(u, views)
                u.placed = self.materializer.place(u)
                if grad:
                    for _, _, r in u.placed:
                        if r.trainable:
                            for g in r.groups:
                                st.fwd_used.setdefault(g, set()).add(r.index)
            st.active_units.append(u)
            pushed = grad and not self.resident
            if pushed:
                if u.depth == 1:
                    u.frame, u.frame_drops = rc.frame_for(u, args, kwargs, compiler)
                self.saved.push(u.frame, u.frame_drops)
            u.pushed.append(pushed)
            return None
        return hook

    def _unit_exit(self, u):
        st, chunks, acts = self.state, self.chunks, self.activations

        def hook(out=None):
            if st.closed or not u.pushed or self.recompute.recomputing is not None:
                return None
            if u.pushed.pop():
                torch._C._autograd._pop_saved_tensors_default_hooks()
            st.active_units.pop()
            u.depth -= 1
            if u.depth > 0:
                return None
            if out is not None and st.root_depth == 0 and not st.active_units \
                    and st.in_forward:
                # A unit called on its own, outside the model's forward (features of one
                # block): its graph is watched as the root's is (_watch_graph), or the
                # activations of calls whose outputs were dropped would stay counted.
                self._watch_graph(out)
            for m, name, r in u.placed:
                m._parameters[name] = r.param
            u.placed = []
            if self.resident:
                for r in u.params:
                    r.mat -= 1
                return None
            modified = self.materializer.unmaterialize(u, dict(u.pins))
            for g, b in u.pins:
                chunks.release(g, chunks.compute_kind, g in modified, b)
            u.pins = []
            self.session.units.exit_unit(u.index)
            frame, u.frame = u.frame, None
            if frame is not None and u.frame_drops and modified:
                # A recompute would write the parameters again: its saves are never dropped.
                for h in frame.handles:
                    h.free_refs += 1
            elif frame is not None and modified:
                # Its recompute would write them a second time: refuse before the backward.
                acts.abandon()
                raise RuntimeError(
                    f"tiermem: the forward of unit {frame.name()!r} writes its parameters in "
                    f"place, so it cannot be recomputed in the backward (activations: "
                    f"'recompute' would apply the write twice); use activations 'offload' or "
                    f"'budget'")
            return None
        return hook
