"""ChunkTensor operations: what ``ChunkTensor.__torch_dispatch__`` (tensor.py) runs.

Any torch operation on a managed tensor outside the units' forwards — a parameter or its
view, a ``p.grad`` — acquires the chunks it touches on the device, runs on views of the chunk
memory, and releases them, marked modified when the operation wrote to them (tensor.py says
what users see). View operations return ChunkTensors recording the view (re-applied at each
use); other results never alias chunk memory (copied when they would); a foreach op runs one
index at a time, so one chunk is acquired at a time; an op over more chunks than the device
holds at once that writes none of them runs on copies taken one chunk at a time.

Invariants: every chunk acquired for an op is released before it returns, modified exactly
when the op wrote it (a chunk pinned by someone else — a unit, the grad hold — is marked
modified through one more pin); in mixed precision a write to a parameter's compute copy is
followed by the same write into its fp32 master (exactly, from an fp32 copy_ source); a read
of a parameter outside its unit warns once (or raises, ``unmaterialized_reads: error``),
except inside a user's post-accumulate-grad hook; fp16 gradients (loss-scaled) are not
readable outside the backward; nothing runs after close.

Owns nothing but each parameter's ``warned`` flag. Reads: the run state (where the op runs:
inside a unit, the backward, the model's forward; closed), the chunk access, the held grad
chunks (grads.py), the session's loss scale, the modes (loss-scaled, strict, resident).

Threading: whichever thread runs the op — the training thread, or autograd's backward thread
(a hook, a read outside a unit during backward); one at a time.
"""
from __future__ import annotations

import torch

from .shared import _K, _Param
from .tensor import ChunkTensor, is_view_op, meta_mutating, mutated_args, unwrap


class ChunkOps:
    """The ChunkTensor operations of one runtime (see the module docstring)."""

    def __init__(self, model, session, chunks, state, grads, modes):
        self._model = model  # its class name, in messages
        self.session = session
        self.chunks = chunks
        self.state = state
        self.grads = grads
        self.modes = modes

    def _where(self) -> str:
        if self.state.active_units:
            u = self.state.active_units[-1]
            return f"inside the forward of unit '{u.name or type(u.module).__name__}'"
        if self.state.in_backward:
            return "during backward"
        if self.state.root_depth > 0:
            return f"inside the forward of {type(self._model).__name__}, outside every unit"
        return "outside any forward"

    def _view_base(self, ct: ChunkTensor, pins: list, copies: dict | None = None):
        """A real tensor viewing ct's chunk memory (acquired unless already pinned). A split
        parameter (pieces in several chunks) gives a view of a copy of its value instead,
        read piece by piece; `copies` gets it (id(ct) -> (record, kind, copy)) so that a
        write can go back into the pieces."""
        r, kind = ct._tm_rec, ct._tm_kind
        if r.split:
            ck = self.chunks.compute_kind if kind == "param" else _K.grad
            v = r.compute.data if kind == "param" and r.mat > 0 else None
            v = self.chunks.copy_of(r, ck) if v is None else v.clone()
            if copies is not None:
                copies[id(ct)] = (r, ck, v)
        elif kind == "param":
            if r.mat > 0 or self.modes.resident:
                v = r.compute.data
            else:
                base = self.chunks.acquire(r.group, self.chunks.compute_kind)
                pins.append((r.group, self.chunks.compute_kind, base))
                v = self.chunks.slice(base, r)
        else:
            base = self.grads.hold.get(r.group)
            if base is None:
                base = self.chunks.acquire(r.group, _K.grad)
                pins.append((r.group, _K.grad, base))
            v = self.chunks.slice(base, r)
        for f, a, kw, idx in ct._tm_views:
            v = f(v, *a, **kw)
            if idx is not None:
                v = v[idx]
        return v

    def dispatch(self, func, args, kwargs):
        if self.state.closed:
            raise RuntimeError(f"tiermem: {func} on a tensor of a closed tiermem runtime")
        if meta_mutating(func):
            raise RuntimeError(f"tiermem: {func} would change the shape or storage of a managed "
                               "tensor in place; this is not supported")
        if is_view_op(func) and isinstance(args[0], ChunkTensor):
            return self._view(func, args, kwargs)
        if "foreach" in func.__name__:
            n = _foreach_length(args)
            if n > 1:
                return self._split_foreach(func, args, kwargs, n)
        written, write_only = mutated_args(func, args, kwargs)
        cts = tree_leaves_ct((args, kwargs))
        if self.modes.loss_scaled and not self.state.in_backward:
            for ct in cts:
                if ct._tm_kind == "grad":
                    raise RuntimeError(
                        f"tiermem: the gradient of '{ct._tm_rec.name}' is held loss-scaled in "
                        f"fp16 (precision 'fp16', scale {self.session.loss_scale:g}), so {func} "
                        "would see scaled values. Clip with the config key 'gradient_clipping', "
                        "read the norm with optimizer.grad_norm(), or train in 'bf16'")
        for ct in cts:
            if ct._tm_kind == "param" and ct._tm_rec.mat == 0 and \
                    not any(ct is w for w in write_only):
                self._on_unmaterialized_read(ct._tm_rec, func)
        written_chunks = {(ct._tm_rec.group, ct._tm_kind) for ct in written
                          if not ct._tm_rec.split}
        exact = self._exact_source(func, args, written)  # may refuse: before any acquire
        pins, real, copies = [], {}, {}
        try:
            try:
                for ct in cts:
                    if id(ct) not in real:
                        real[id(ct)] = self._view_base(ct, pins, copies)
            except MemoryError:
                # More chunks than the device tier holds at once (torch.cat over every
                # parameter: parameters_to_vector, DDP's broadcast at construction). An op
                # that writes none of them runs on copies taken one chunk at a time.
                if written or len({(c._tm_rec.group, c._tm_kind) for c in cts}) < 2:
                    raise
                for g, k, b in pins:
                    self.chunks.release(g, k, False, b)
                pins, real = [], {}
                for ct in cts:
                    if id(ct) not in real:
                        real[id(ct)] = self.materialized_copy(ct)
            out = func(*unwrap(args, lambda c: real[id(c)]),
                       **unwrap(kwargs, lambda c: real[id(c)]))
            for ct in written:
                if id(ct) in copies:  # a split parameter: its copy goes back into the pieces
                    r, ck, v = copies[id(ct)]
                    self.chunks.write_back(r, ck, v)
                    if ck != _K.grad and r.mat > 0:
                        r.compute.data.copy_(v)  # the unit computing with it sees the write
            if self.modes.mixed:
                for ct in written:
                    if ct._tm_kind == "param" and not ct._tm_rec.compute_only:
                        self.chunks.sync_master(ct._tm_rec, ct._tm_views, real[id(ct)], exact)
            out = self._wrap_out(out, written, real)
        finally:
            for g, k, b in pins:
                self.chunks.release(g, k, (g, "grad" if k == _K.grad else "param")
                                    in written_chunks, b)
        for g, kind in written_chunks:  # pinned by a unit or the grad hold: mark them too
            k = _K.grad if kind == "grad" else self.chunks.compute_kind
            if not any(p[0] == g and p[1] == k for p in pins):
                self.chunks.mark_modified(g, k)
        return out

    def _exact_source(self, func, args, written):
        """Mixed precision, a ``copy_`` from a plain fp32 tensor (e.g. load_state_dict): that
        source, which a master takes exactly; else None. A parameter keeping no master
        (compute_only: its values exact in the compute dtype) takes only values the compute
        dtype holds exactly: anything else is a ValueError naming it, raised before the write."""
        if not self.modes.mixed or func.__name__.split(".")[0] != "copy_" or len(args) < 2 or \
                not isinstance(args[1], torch.Tensor) or isinstance(args[1], ChunkTensor) or \
                args[1].dtype != torch.float32:
            return None
        src = args[1]
        for ct in written:
            r = ct._tm_rec
            if ct._tm_kind != "param" or not r.compute_only:
                continue
            low = src.detach().to(self.modes.dtype).float()
            same = low.view(torch.int32) == src.detach().contiguous().view(torch.int32)
            if not bool(same.all()):
                at = int((~same).reshape(-1).nonzero()[0])
                raise ValueError(
                    f"tiermem: parameter '{r.name}' keeps its values in "
                    f"{self.modes.dtype} only (frozen, loaded from a checkpoint in the "
                    f"compute dtype: no fp32 master), and the value copied into it is not exact "
                    f"in it (element {at}: {src.reshape(-1)[at].item()!r}); nothing was written")
        return src

    def _split_foreach(self, func, args, kwargs, n):
        # A foreach op is elementwise over its lists: run it one index at a time, so that
        # one chunk is acquired at a time however many tensors the list holds (GradScaler's
        # unscale_ over every p.grad, _foreach_norm, _foreach_mul_, ...).
        outs = None
        for i in range(n):
            a = tuple(x[i:i + 1] if isinstance(x, (list, tuple)) and len(x) == n else x
                      for x in args)
            o = func(*a, **kwargs)
            if o is not None:
                outs = (outs or []) + list(o)
        return outs

    def _wrap_out(self, out, written, real):
        """Results never alias chunk memory; in-place ops return their ChunkTensor argument."""
        inplace = {id(real[id(ct)]): ct for ct in written}
        ranges = []
        for t in real.values():
            st = t.untyped_storage()
            ranges.append((st.data_ptr(), st.nbytes()))

        def fix(x):
            if not isinstance(x, torch.Tensor):
                return x
            ct = inplace.get(id(x))
            if ct is not None:
                return ct
            try:
                p = x.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                return x
            if any(lo <= p < lo + n for lo, n in ranges):
                return x.clone()
            return x
        return tree_map_tensors(out, fix)

    def _view(self, func, args, kwargs):
        ct = args[0]
        meta = torch.empty_strided(ct.shape, ct.stride(), dtype=ct.dtype, device="meta")
        rest = args[1:]
        out = func(meta, *rest, **kwargs)
        r = ct._tm_rec
        rt = ct._tm_runtime  # the runtime whose ops run this (its first ChunkTensor's)
        if isinstance(out, torch.Tensor):
            return ChunkTensor(rt, r, ct._tm_kind, out.shape, out.stride(), out.dtype,
                               ct.device, ct._tm_views + ((func, rest, kwargs, None),))
        return type(out)(ChunkTensor(rt, r, ct._tm_kind, o.shape, o.stride(), o.dtype,
                                     ct.device, ct._tm_views + ((func, rest, kwargs, i),))
                         for i, o in enumerate(out))

    def _on_unmaterialized_read(self, r: _Param, func):
        if self.state.in_user_hook:
            return  # Grads._run_post_hooks
        where = self._where()
        if self.modes.strict:
            raise RuntimeError(
                f"tiermem: parameter '{r.name}' was read by {func} {where}, but it is not "
                "materialized there (config unmaterialized_reads='error'). Read parameters "
                "inside the forward of a unit that contains them, or pass units=... to "
                "tiermem.initialize so that one unit covers the code that reads it")
        if where != "outside any forward" and not r.warned and not self.modes.resident:
            r.warned = True
            import warnings
            warnings.warn(f"tiermem: parameter '{r.name}' was read by {func} {where}, outside "
                          "its unit: it is materialized on demand (correct, but a chunk "
                          "acquire per operation). Pass units=... to tiermem.initialize so "
                          "that one unit covers the code that reads it.", stacklevel=3)

    def materialized_copy(self, ct: ChunkTensor) -> torch.Tensor:
        """An ordinary tensor with ct's current value (a copy)."""
        if self.state.closed:
            raise RuntimeError(f"tiermem: {ct._tm_rec.name}: the tiermem runtime is closed")
        pins = []
        try:
            return self._view_base(ct, pins).clone()
        finally:
            for g, k, b in pins:
                self.chunks.release(g, k, False, b)


def _foreach_length(args) -> int:
    for x in args:
        if isinstance(x, (list, tuple)) and any(isinstance(e, ChunkTensor) for e in x):
            return len(x)
    return 0


def tree_leaves_ct(obj):
    from torch.utils._pytree import tree_flatten
    return [x for x in tree_flatten(obj)[0] if isinstance(x, ChunkTensor)]


def tree_map_tensors(obj, fn):
    from torch.utils._pytree import tree_map
    return tree_map(fn, obj)
