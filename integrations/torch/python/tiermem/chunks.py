"""Chunk access: the one layer between the runtime's parts and the session's chunks.

Every part that needs chunk memory on the device — a unit's forward, a saved chunk view in
the backward, a gradient accumulation, a ChunkTensor operation, a recompute — asks this layer
for it and gives it back here. Sharded across ranks (distributed.py), the layer asks the
shards for the group's gathered full chunk instead of the session's shard, gives it back to
them, and reduce-scatters a group's full gradient into this rank's shard; the parts above do
not know which. The shards never call back: they only see (group, kind) requests.

Invariants:

- ``live`` maps the data pointer of every compute chunk acquired on the device (or gathered)
  and still pinned to its group: saved-tensor hooks tell a view of chunk memory from an
  activation by it. An entry goes when the chunk's last pin does.
- The session is told the stream torch queues work on now before every chunk access
  (``on_stream``), and whether the access is part of the order the engine records and follows
  (``traced``: the runtime's rule, serve.py's for serving) before every acquire.
- ``split_copies`` maps the data pointer of every split parameter's contiguous compute copy
  that a unit materializes now to the parameter: a saved tensor viewing it is packed as a
  reference to the pieces (saved.py ``_SplitRef``) and assembled again in the backward, so no
  copy stays alive from the forward to the backward. ``copy_stats`` counts the bytes of the
  split copies alive (assembled here, not yet freed by torch) and their peak.
- ``sync_master``: in mixed precision, a write to a parameter's compute copy is followed by
  the same write into its fp32 master.

Owns: ``live``, ``split_copies``, ``copy_stats``, the tracing flag the session was last told,
the stream it was last told.
Reads: the session, the shards (None: one process), the compute kind, the device.

Threading: the training thread, and autograd's backward thread where hooks run (one at a
time). CUDA: the backward may run on another stream; hence ``on_stream`` at every access.
"""
from __future__ import annotations

import weakref

import torch

from .shared import _K, _Param
from .tensor import ChunkTensor


class ChunkAccess:
    """Acquires and releases chunk groups on the device, through the shards when sharded (see
    the module docstring)."""

    def __init__(self, session, shards, device: torch.device, traced):
        self.session = session
        self.shards = shards        # distributed.Shards, or None (close() drops it)
        self.compute_kind = session.compute_kind
        # Where compute acquires chunks: the device, or the host in host mode (session.h).
        self.tier = session.compute_tier
        self._cuda = device.type == "cuda"
        self.device = device
        self._traced = traced       # () -> bool: whether acquires now are part of the order
        self._tracing = True
        self._stream_handle = None  # the compute stream the session was last told
        self.live: dict[int, int] = {}  # device data_ptr -> group (compute chunks)
        self.split_copies: dict[int, _Param] = {}  # data_ptr -> r: its materialized copy
        # Split copies alive now and at most (bytes): counted at assembly, uncounted when torch
        # frees their storage (a finalizer on it; it may run on autograd's thread).
        self.copy_stats = {"live_bytes": 0, "peak_bytes": 0}
        # Groups of experts that move alone (experts.py) -> their expert set: their compute and
        # grad chunks are acquired as class members (chunks/expert_cache.h), outside the order.
        self.classes: dict[int, int] = {}

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    def set_tracing(self, on: bool):
        if on != self._tracing:
            self.session.set_tracing(on)
            self._tracing = on

    def follow_tracing(self):
        """Tells the session whether what comes now is traced (training forwards and
        backward, not eval / no_grad forwards)."""
        self.set_tracing(self._traced())

    def on_stream(self):
        """CUDA: the session orders its copies and kernels with the stream torch queues work on
        now (tiers/tier.h, "Ordering against compute"): releases record their use on it,
        prefetches it reads are waited for on it. Checked at every chunk access, since the
        backward (autograd's device thread) and user code may change the current stream."""
        if self._cuda:
            h = torch.cuda.current_stream(self.device).cuda_stream
            if h != self._stream_handle:
                self.session.set_compute_stream(h)
                self._stream_handle = h

    def acquire(self, group: int, kind, tier=None) -> torch.Tensor:
        tier = self.tier if tier is None else tier
        self.set_tracing(self._traced())
        self.on_stream()
        if self.shards is not None and tier == self.tier:
            base = self.shards.gather(group, kind)  # the full chunk, from every rank's shard
            if kind == self.compute_kind:
                self.live[base.data_ptr()] = group
            return base
        cls = self.classes.get(group, -1) if kind in (self.compute_kind, _K.grad) else -1
        base = self.session.acquire(group, kind, tier, cls)
        if tier == self.tier and kind == self.compute_kind:
            self.live[base.data_ptr()] = group
        return base

    def release(self, group: int, kind, modified: bool, base: torch.Tensor | None = None):
        self.on_stream()
        if self.shards is not None and self.shards.held(group, kind) is not None:
            ptr = self.shards.held(group, kind).data_ptr()
            if self.shards.release(group, kind, modified) and self.live.get(ptr) == group:
                del self.live[ptr]
            return
        self.session.release(group, kind, modified)
        if base is not None and kind == self.compute_kind and \
                self.session.pins(group, kind) == 0 and self.live.get(base.data_ptr()) == group:
            del self.live[base.data_ptr()]

    @staticmethod
    def slice(base, r: _Param):
        """r's view of its (only) chunk `base`."""
        return base[r.offset:r.offset + r.numel].view(r.shape)

    @staticmethod
    def piece(base, pc) -> torch.Tensor:
        """The flat view of piece `pc` in its chunk `base`."""
        return base[pc.offset:pc.offset + pc.numel]

    def view(self, bases, r: _Param) -> torch.Tensor:
        """r as one tensor from its acquired chunks (`bases`: group -> chunk): a view of its
        chunk, or, split across chunks, a contiguous copy of its pieces."""
        if not r.split:
            return self.slice(bases[r.group], r)
        out = torch.cat([self.piece(bases[pc.group], pc) for pc in r.pieces]).view(r.shape)
        self._count_copy(out)
        return out

    def _count_copy(self, t: torch.Tensor):
        """Counts split copy `t` in ``copy_stats`` until torch frees its storage (a storage's
        Python object lives as long as the storage: torch preserves it)."""
        st = t.untyped_storage()
        stats, n = self.copy_stats, st.nbytes()
        stats["live_bytes"] += n
        stats["peak_bytes"] = max(stats["peak_bytes"], stats["live_bytes"])
        weakref.finalize(st, _uncount, stats, n)

    def scatter(self, bases, r: _Param, value: torch.Tensor):
        """Writes `value` (r's shape) into r's pieces in the acquired chunks `bases`."""
        flat = value.reshape(-1)
        with torch.no_grad():
            for pc in r.pieces:
                self.piece(bases[pc.group], pc).copy_(flat[pc.begin:pc.begin + pc.numel])

    def copy_of(self, r: _Param, kind) -> torch.Tensor:
        """r's `kind` values as a new tensor, read piece by piece (one chunk pinned at a time;
        chunks pinned by others are read where they are)."""
        out = None
        for pc in r.pieces:
            base = self.acquire(pc.group, kind)
            try:
                if out is None:
                    out = torch.empty(r.numel, dtype=base.dtype, device=base.device)
                    self._count_copy(out)
                out[pc.begin:pc.begin + pc.numel].copy_(self.piece(base, pc))
            finally:
                self.release(pc.group, kind, False, base)
        return out.view(r.shape)

    def write_back(self, r: _Param, kind, value: torch.Tensor):
        """Writes `value` into r's `kind` pieces, one chunk at a time, each released modified."""
        flat = value.reshape(-1)
        for pc in r.pieces:
            base = self.acquire(pc.group, kind)
            try:
                with torch.no_grad():
                    self.piece(base, pc).copy_(flat[pc.begin:pc.begin + pc.numel])
            finally:
                self.release(pc.group, kind, True, base)

    def hint(self, group: int, probability: float = 1.0) -> bool:
        """Starts bringing `group`'s compute chunk to the compute tier for an acquire expected
        soon with `probability`: 1 for a routed expert, less for a predicted one
        (chunks::Engine::PrefetchHint); True if it started a copy."""
        self.on_stream()
        return self.session.prefetch(group, self.compute_kind, self.tier, probability)

    def prefetch(self, group: int):
        """Sharded: starts gathering `group`'s compute chunk for a unit about to run."""
        self.shards.prefetch(group, self.compute_kind)

    def mark_modified(self, group, kind):
        # The chunk is pinned by someone else (a unit, the grad hold): take and drop one more
        # pin to mark it modified without moving it. Sharded: the held full chunk is written
        # back into this rank's shard when its last holder lets go (a held grad buffer is
        # reduce-scattered anyway).
        if self.shards is not None:
            self.shards.mark_dirty(group, kind)
            return
        self.on_stream()
        base = self.session.acquire(group, kind, self.tier)
        self.session.release(group, kind, True)
        del base

    def is_chunk_memory(self, t) -> bool:
        """A parameter, a view of chunk memory or of a materialized split copy: what the saved-
        tensor hooks re-read in the backward rather than keep or recompute."""
        if isinstance(t, ChunkTensor) or t.layout != torch.strided:
            return True
        try:
            ptr = t.untyped_storage().data_ptr()
            return ptr in self.live or ptr in self.split_copies
        except (RuntimeError, NotImplementedError):
            return True

    # ---- gradient chunks -------------------------------------------------------------------
    def acquire_grad(self, group: int) -> torch.Tensor:
        """`group`'s gradient chunk on the device to accumulate into (traced): the grad chunk,
        or sharded a zeroed full-size buffer, reduce-scattered at release_grad."""
        self.set_tracing(True)
        self.on_stream()
        if self.shards is not None:
            return self.shards.grad_buffer(group)
        return self.session.acquire_for_write(group, _K.grad, self.tier,
                                              self.classes.get(group, -1))

    def release_grad(self, group: int, fresh):
        """Gives back what acquire_grad gave, modified. Sharded: the group's full gradient,
        reduce-scattered into the shards (`fresh`: the pieces whose gradient began in this
        backward, their shard spans restarted from 0)."""
        self.on_stream()
        if self.shards is not None:  # the group's full gradient, reduce-scattered into shards
            self.shards.scatter_grad(group, fresh)
            return
        self.session.release(group, _K.grad, True)

    def grad_stats(self) -> _C.GradStats:
        """The unscaled gradients' sum of squares and overflow — over every rank when sharded
        (collective)."""
        self.on_stream()
        stats = self.session.grad_stats()
        if self.shards is not None:
            stats = self.shards.all_reduce_stats(stats)
        return stats

    # ---- mixed precision -------------------------------------------------------------------
    def sync_master(self, r: _Param, views, compute_view, exact_src):
        """Mixed precision: after (a view `views` of) r's compute copy changed, the same region
        of its fp32 master follows: from the fp32 source of a copy_ exactly, else from the
        compute value. (Read-modify-write of the master through the core, wherever it is.) A
        compute_only parameter has no master: its compute copy is its value."""
        if r.compute_only:
            return
        master = self.session.read_tensor(r.index, _K.param_fp32).view(r.shape)
        mv = master
        for f, a, kw, idx in views:
            mv = f(mv, *a, **kw)
            if idx is not None:
                mv = mv[idx]
        with torch.no_grad():
            mv.copy_(exact_src if exact_src is not None else compute_view)
        self.session.write_tensor(r.index, _K.param_fp32, master.reshape(-1))


def _uncount(stats: dict, n: int):
    stats["live_bytes"] -= n
