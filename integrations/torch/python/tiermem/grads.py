"""Gradients: accumulation into the grad chunks, the gradient hooks, and the optimizer's view.

Post-accumulate-grad hooks on each trainable parameter's two leaves — the unit's compute view
and the ChunkTensor parameter itself (read outside every unit) — add each gradient into the
grad chunk on the device (copy when ``p.grad`` is None — torch's semantics — add otherwise)
and set ``p.grad`` to the grad ChunkTensor, so ``clip_grad_norm_``, GradScaler and logging see
the true values, and ``zero_grad()`` / ``model.zero_grad()`` (``p.grad = None``) work as in
torch. No grad is kept on the device beyond the chunks the engine caches. A user's gradient
hooks on a parameter go where its gradient is computed and accumulated (``user_hook``).
Before a step, ``sync`` writes gradients the user assigned as plain tensors into the chunks
and tells the core which tensors have one.

Invariants: a group's grad chunk is acquired (``hold``) at its first gradient of a backward
and released — marked modified; sharded: reduce-scattered into this rank's shard — once every
parameter of the group that the forward used has its gradient (or at once when the device
cannot hold every group's chunks, ``modes.hold_grads`` False), and at the latest at the backward's
end; resident, the grad chunks stay pinned for the session. Sharded, a parameter whose
gradient begins in this backward (``fresh``) has its shard span restarted from 0. A
gradient hook that would see a parameter's gradient in two parts raises instead of being
called with a part.

Owns: the held grad chunks and the params each still waits for, ``fresh``, what each
parameter's ``p.grad`` is and its ``post_hooks``, the run state's ``in_user_hook``.
Reads: the session, the chunk access, the backward (its moments; each gradient in releases
the compute chunk it waits for), the parameter records and groups.

Threading: the hooks run on autograd's backward thread; ``sync``, ``zero_grad`` and
``grad_stats`` on the training thread (the optimizer's step). They hold this object weakly
(torch keeps hooks in C++ autograd metadata, out of the collector's sight).
"""
from __future__ import annotations

import math
import weakref

import torch

from .compiling import eager
from .shared import _K, _Param
from .tensor import ChunkTensor


class _Handles:
    """Several hook handles removed as one (a user's hook on a parameter's two leaves)."""

    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        for h in self.handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class Grads:
    """The gradients of one runtime (see the module docstring)."""

    def __init__(self, session, chunks, state, backward, params, groups, modes):
        self.session = session
        self.chunks = chunks
        self.state = state
        self.backward = backward
        self.params = params
        self.groups = groups  # session.group(g): _C.ChunkGroup
        self.modes = modes
        self.hold: dict[int, torch.Tensor] = {}  # group -> its grad chunk, held
        self._pending: dict[int, set] = {}
        self._fresh: dict[int, list] = {}  # sharded: group -> pieces whose grad began now
        self._hook_task, self._hook_parts = None, {}  # _check_one_part: per backward
        self._handles_extra: list = []  # the expert leaves' hooks (experts.py)
        backward.on_end(self._end_of_backward)

    def install(self, r: _Param) -> list:
        """The two post-accumulate-grad hooks of trainable parameter `r`; their handles."""
        handles = [r.compute.register_post_accumulate_grad_hook(
            self._weak_grad_hook(r, Grads._on_compute_grad))]
        with torch._C.DisableTorchFunctionSubclass():  # ours, not a user's (user_hook)
            handles.append(r.param.register_post_accumulate_grad_hook(
                self._weak_grad_hook(r, Grads._on_param_grad)))
        return handles

    # ---- grad chunks ---------------------------------------------------------------------
    def release(self, group: int):
        if self.modes.resident:
            return  # pinned for the whole session
        del self.hold[group]
        self._pending.pop(group, None)
        self.chunks.release_grad(group, self._fresh.pop(group, ()))

    def _end_of_backward(self):
        for g in list(self.hold):
            self.release(g)
        self._pending.clear()

    def _grad_chunk(self, group: int) -> torch.Tensor:
        base = self.hold.get(group)
        if base is None:
            tensors = self.groups[group].tensors
            if all(self.params[i].param.grad is None for i in tensors):
                self.session.zero_chunk(group, _K.grad)  # nothing to keep: no fetch, a memset
            base = self.chunks.acquire_grad(group)
            self.hold[group] = base
            self._pending[group] = set(self.state.fwd_used.get(group, ()))
        return base

    def _accumulate(self, r: _Param, g: torch.Tensor, prev):
        """Adds `g` to r's gradient with torch's semantics (prev None: g becomes the grad),
        piece by piece for a split parameter."""
        flat = g.reshape(-1)
        old = prev.reshape(-1) if prev is not None and prev is not r.grad else None
        last = {pc.group: k for k, pc in enumerate(r.pieces)}
        for k, pc in enumerate(r.pieces):
            base = self._grad_chunk(pc.group)
            dst = self.chunks.piece(base, pc)
            src = flat[pc.begin:pc.begin + pc.numel]
            if self.chunks.sharded and prev is not r.grad:
                self._fresh.setdefault(pc.group, []).append(pc)  # its shard span restarts from 0
            with torch.no_grad():
                if prev is None:
                    dst.copy_(src)
                elif old is None:  # prev is r.grad
                    dst.add_(src)
                else:  # a plain tensor the user assigned to p.grad: keep its value too
                    dst.copy_(old[pc.begin:pc.begin + pc.numel])
                    dst.add_(src)
            if last[pc.group] == k:
                self._done_in(pc.group, r.index)
        r.param.grad = r.grad
        self.backward.grad_in(r)

    def _done_in(self, group: int, key):
        """`key` has its gradient in `group`: its grad chunk goes once every key the forward
        used has one (at once when the device cannot hold every group's chunks)."""
        pending = self._pending.get(group)
        if pending is not None:
            pending.discard(key)
            if not pending or not self.modes.hold_grads:
                self.release(group)

    # ---- pieces of experts that move alone (experts.py) ---------------------------------
    def install_piece(self, r: _Param, e: int, leaf):
        """The post-accumulate-grad hook of fused expert tensor `r`'s leaf for expert `e`."""
        ref, index = weakref.ref(self), r.index

        def hook(p):
            grads = ref()
            if grads is not None:
                grads._on_piece_grad(grads.params[index], e, p)
        self._handles_extra.append(leaf.register_post_accumulate_grad_hook(hook))

    def _on_piece_grad(self, r: _Param, e: int, leaf):
        """Expert `e`'s part of fused tensor r's gradient: added into its piece, or — the
        first part since ``p.grad`` was None — copied there, the other pieces made zeros
        (experts.py): ``p.grad`` is then the whole tensor, zero rows for experts no token
        reached, as torch gives it."""
        self.backward.begin()
        self.backward.moment(r.unit)
        g = leaf.grad
        leaf.grad = None
        if g is None:
            return
        prev = r.param.grad
        if prev is not None and prev is not r.grad:  # a plain tensor the user assigned
            r.param.grad = None
            self._accumulate(r, prev, None)
            prev = r.grad
        pc = next(p for p in r.pieces if p.expert == e)
        key = (r.index, e)
        if prev is None:
            self._zero_pieces(r, pc)
        base = self._grad_chunk(pc.group)
        with torch.no_grad():
            dst = self.chunks.piece(base, pc)
            if prev is None:
                dst.copy_(g.reshape(-1))
            else:
                dst.add_(g.reshape(-1))
        r.param.grad = r.grad
        self._done_in(pc.group, key)
        self.backward.key_in(pc.group, key)

    def _zero_pieces(self, r: _Param, keep):
        """r's gradient begins with piece `keep`: every other piece becomes zeros. A chunk
        that holds only r's pieces and gradients that do not exist (``p.grad`` None) is
        zeroed lazily — no bytes move — unless pinned; one already zero is left; otherwise the
        piece's span is zeroed in place."""
        for pc in r.pieces:
            if pc is keep:
                continue
            g = pc.group
            held = self.hold.get(g)
            others = [i for i in self.groups[g].tensors if i != r.index]
            if held is None and self.session.pins(g, _K.grad) == 0 and all(
                    self.params[i].param.grad is None for i in others):
                self.session.zero_chunk(g, _K.grad)
            elif held is None and self.session.lazily_zero(g, _K.grad):
                continue
            else:
                base = held if held is not None else self.chunks.acquire(g, _K.grad)
                with torch.no_grad():
                    self.chunks.piece(base, pc).zero_()
                if held is None:  # (a held chunk is released modified anyway)
                    self.chunks.release(g, _K.grad, True, base)

    # ---- hooks -------------------------------------------------------------------------
    # The two grad hooks live in torch's C++ autograd metadata of the parameters, which the
    # garbage collector does not traverse: a hook that referred to this object, or to anything
    # that leads to it (a _Param record refers to the modules, whose wrapped forwards refer to
    # the runtime's parts), would keep the runtime, the model and the tiers' memory alive
    # after the model and optimizer are dropped. So they hold it weakly and the record by
    # index.
    def _weak_grad_hook(self, r: _Param, method):
        """A post-accumulate-grad hook calling ``method(grads, record, p)``. torch keeps the
        hook in the parameter's C++ autograd metadata, out of the collector's sight, so it
        holds this object weakly and the record by index (test_lifecycle.py): a strong
        reference there would keep a dropped model's runtime alive for good."""
        ref, index = weakref.ref(self), r.index

        def hook(p):
            grads = ref()
            if grads is not None:
                method(grads, grads.params[index], p)
        return eager(hook)  # also when a compiled region runs the backward (compiling.py)

    def user_hook(self, r: _Param, register, hook):
        """A user's ``p.register_hook(fn)`` / ``p.register_post_accumulate_grad_hook(fn)`` on
        a managed parameter. Its gradient is computed for the unit's compute view (and for
        the parameter itself where code outside every unit reads it), so a gradient hook goes
        on both leaves (it sees, and may replace, the gradient before it is accumulated), and
        a post-accumulate hook runs after tiermem has accumulated into the chunk, with the
        parameter (``p.grad`` then holds the total). Returns a handle whose ``remove()``
        undoes it, as torch's does."""
        if not r.param.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if r.expert_set >= 0 and r.expert < 0:
            # Its gradient comes from per-expert leaves, piece by piece (experts.py): neither
            # leaf a hook would go on ever gets one, so the hook would silently never run.
            raise RuntimeError(
                f"tiermem: gradient hooks on the fused experts parameter {r.name!r} are not "
                f"supported: its experts move alone and its gradient is accumulated expert by "
                f"expert (docs/moe.md). Pass experts=False to tiermem.initialize to treat the "
                f"experts as any weights; nothing was changed.")
        if register is torch.Tensor.register_hook:
            key = object()  # this registration: its two parts are told apart per backward
            handles = [torch.Tensor.register_hook(r.compute,
                                                  self._one_part_hook(r, hook, key, 0))]
            with torch._C.DisableTorchFunctionSubclass():
                handles.append(torch.Tensor.register_hook(r.param,
                                                          self._one_part_hook(r, hook, key, 1)))
            return _Handles(handles)
        handle = torch.utils.hooks.RemovableHandle(r.post_hooks)
        r.post_hooks[handle.id] = hook
        return handle

    def _one_part_hook(self, r: _Param, hook, key, leaf: int):
        """The user's gradient hook `hook` on leaf `leaf` (0: the compute view, 1: the
        parameter). A backward that reaches both leaves (the parameter used inside its unit
        and by code outside every unit, such as a penalty on the parameters added to the
        loss) would call it once per part of the gradient, where torch calls it once with
        their sum: right for a linear hook (a mask), silently wrong for any other (a
        per-parameter norm clip, logging). That second call raises instead. Held by torch's
        C++ autograd metadata: this object weakly (test_lifecycle.py)."""
        ref, index = weakref.ref(self), r.index

        def part(g):
            grads = ref()
            if grads is not None:
                grads._check_one_part(grads.params[index], key, leaf)
            return hook(g)
        return eager(part)

    def _check_one_part(self, r: _Param, key, leaf: int):
        task = torch._C._current_graph_task_id()
        if task != self._hook_task:
            self._hook_task, self._hook_parts = task, {}
        if self._hook_parts.setdefault(key, leaf) != leaf:
            raise RuntimeError(
                f"tiermem: parameter {r.name!r} has a gradient hook (register_hook) and this "
                f"backward reaches it in two parts: from its unit's forward and from code "
                f"outside every unit (a penalty on the parameters added to the loss, or a read "
                f"outside its unit in the forward). torch would call the hook once with their "
                f"sum; tiermem can only call it per part, which is wrong unless the hook is "
                f"linear. Use register_post_accumulate_grad_hook (called once; p.grad holds the "
                f"total and may be changed in place), or compute that use inside the unit's "
                f"forward. This backward's gradients are incomplete: zero them before the next "
                f"step.")

    def _run_post_hooks(self, r: _Param):
        """The user's post-accumulate-grad hooks of `r`, with the parameter. What they read or
        write of it (an update in the backward, as optimizer-in-backward does) is theirs to
        do there: not an unmaterialized read to warn about or refuse (dispatch.py)."""
        if not r.post_hooks:
            return
        self.state.in_user_hook = True
        try:
            for hook in list(r.post_hooks.values()):
                hook(r.param)
        finally:
            self.state.in_user_hook = False

    def _on_compute_grad(self, r: _Param, p):
        self.backward.begin()
        # A unit whose backward saves no param view (an embedding) shows up here; always
        # (not only while recording), so executed iterations have the recorded moments.
        self.backward.moment(r.unit)
        g = p.grad
        p.grad = None
        if g is not None:
            self._accumulate(r, g, r.param.grad)
        self._run_post_hooks(r)

    def _on_param_grad(self, r: _Param, p):
        # The ChunkTensor parameter itself was used (read outside its unit). AccumulateGrad
        # either set p.grad to a plain tensor (the new total) or added in place into r.grad.
        self.backward.begin()
        g = p.grad
        if g is None or g is r.grad:
            return
        p.grad = None
        self._accumulate(r, g, None)
        self._run_post_hooks(r)

    # ---- the optimizer's view ------------------------------------------------------------
    def sync(self):
        """Before a step: tells the core which tensors have a gradient (``p.grad`` not None)
        and writes gradients the user assigned as plain tensors into the chunks."""
        flags = []
        for r in self.params:
            g = r.param.grad if r.trainable else None
            if g is not None and g is not r.grad:
                if isinstance(g, ChunkTensor):
                    raise ValueError(f"p.grad of {r.name} is another tensor's chunk view")
                if tuple(g.shape) != tuple(r.shape):
                    raise ValueError(f"p.grad of {r.name} has shape {tuple(g.shape)}")
                r.param.grad = None
                self._accumulate(r, g, None)
                for h in list(self.hold):
                    self.release(h)
            flags.append(g is not None)
        self.session.set_has_grad(flags)

    def zero_grad(self, set_to_none: bool = True) -> bool:
        """Clears every gradient unless an accumulation window is open; True when it did."""
        if not self.session.zero_grad():
            return False
        for r in self.params:
            if r.trainable:
                r.param.grad = None if set_to_none else r.grad
        return True

    def grad_stats(self) -> _C.GradStats:
        """The unscaled gradients' sum of squares and overflow over the whole model — summed
        over ranks when sharded (collective)."""
        self.sync()
        return self.chunks.grad_stats()

    def grad_norm(self) -> torch.Tensor:
        return torch.tensor(math.sqrt(self.grad_stats().sq_norm), dtype=torch.float32)
