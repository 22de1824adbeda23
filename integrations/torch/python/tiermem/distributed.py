"""Sharded chunk groups across the ranks of a torch.distributed job (ZeRO-3 style,
docs/distributed.md).

Each rank's session holds only its shard of every chunk (params, grads, AdamW m and v, fp32
masters) in its own tiers and budgets (runtime/session.h, "Sharding"). This module is
the binding's side of it, and the only place bytes cross processes — always through
torch.distributed (Gloo on CPU, NCCL on GPUs), never a transport of tiermem's own:

- ``gather(group, kind)``: a unit about to compute gets the group's full chunk: this rank's
  shard is acquired and all-gathered into a scratch region of the session (counted in the
  device budget; chunks are evicted for it). Reference-counted per (group, kind) while held.
- ``release(...)``: when the last holder lets go, a chunk written in place (a parameter changed
  inside a forward, a gradient scaled by ``clip_grad_norm_``) first writes this rank's part
  back into its shard; the full chunk then stays in a small cache of recently released chunks
  (``recent``, a few units' worth) so the next unit sharing the group, or the backward of the
  last forward unit, needs no second all-gather. ``flush()`` drops the cache whenever shards
  change under it (the optimizer step, loads, the end of an iteration).
- ``prefetch(group, kind)``: starts the all-gather of a chunk the next unit needs
  (async_op), so communication overlaps the current unit's compute; ``gather`` then waits for
  it.
- ``grad_buffer(group)`` / ``scatter_grad(...)``: the backward accumulates a group's gradients
  into a full-size zeroed buffer; once the group is complete it is reduce-scattered (summed,
  then divided by the world size: the gradient of the global batch's mean loss) and added into
  this rank's grad shard.
- ``all_reduce_stats``: the global gradient norm and overflow for clipping / fp16.
- ``Collectives.all_gather``: what the C++ core calls to read whole tensors (state_dict,
  checkpoints, close()).

Layering: this module is one layer below the runtime's unit code, never beside it. Inside an
iteration only chunks.ChunkAccess calls it (``gather``/``held``/``release``/``mark_dirty``/
``prefetch``, ``grad_buffer``/``scatter_grad``): a unit, the backward, a recompute or a
ChunkTensor operation asks the chunk access for a gathered group and gives it back there,
and decides itself which groups (the unit order, the next unit's prefetch). The runtime
builds the shards before the session (``sharding()`` is part of the session's construction)
and ``attach``es the session once it exists; besides it, the shards know only the compute
dtype. Nothing here calls back into the runtime. Between iterations the optimizer's step,
the checkpoints and the gradient norm call ``flush``, ``all_reduce_stats`` and ``agree``.

Every rank makes the same calls in the same order (the same model, the same graph, every rank
calling state_dict/save_checkpoint) — as with DDP/FSDP. A rank that stops answering makes the
others fail after the process group's timeout (``torch.distributed.init_process_group(...,
timeout=...)``) instead of hanging. Collectives are recorded in the timeline (lane
"collective", docs/distributed.md).

Threading: the training thread (and autograd's, for the backward hooks), one at a time.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import _C

_K = _C.ChunkKind


class CollectiveError(RuntimeError):
    """A collective of a sharded session failed: another rank failed, exited or did not answer
    within the process group's timeout. The original error is the __cause__."""


def _collective(what, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise CollectiveError(
            f"tiermem: {what} across ranks failed — another rank failed, exited or did not "
            f"answer within the process group's timeout: {e}") from e


def process_group_for(process_group):
    """The process group to shard over: `process_group` when given; else the default group
    when torch.distributed is initialized with more than one rank; else None (one process)."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class Collectives:
    """session::Collectives for the C++ core (host buffers)."""

    def __init__(self, group, backend):
        self.group, self.backend = group, backend
        self.world = dist.get_world_size(group)

    def all_gather(self, shard, full):
        if self.backend == "nccl":  # NCCL moves device tensors only
            out = torch.empty(full.numel(), dtype=torch.uint8, device="cuda")
            _collective("all-gather of a chunk for a value read", dist.all_gather_into_tensor,
                        out, shard.cuda(), group=self.group)
            full.copy_(out.cpu())
        else:
            _collective("all-gather of a chunk for a value read", dist.all_gather_into_tensor,
                        full, shard, group=self.group)


class _Held:
    __slots__ = ("tensor", "region", "refs", "dirty", "work", "t0")

    def __init__(self, tensor, region, refs=1):
        self.tensor, self.region, self.refs, self.dirty = tensor, region, refs, False
        self.work, self.t0 = None, 0.0  # an async all-gather in flight (prefetch)


class Shards:
    """This rank's side of the sharded chunk groups (see the module docstring)."""

    def __init__(self, group, dtype):
        self.group = group
        self.dtype = dtype        # the compute dtype: full chunks and gradient buffers
        self.session = None       # attach(), once the session exists
        self.compute_kind = None
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self.collectives = Collectives(group, self.backend)
        self._held: dict = {}    # (group, kind) -> _Held, in use
        self._recent: dict = {}  # (group, kind) -> _Held, released, clean, kept for reuse
        self._pending: dict = {}  # (group, kind) -> _Held with an all-gather in flight
        self.recent_capacity = 0  # full chunks kept (the runtime sets a few units' worth)
        self.stats = {"all_gather_bytes": 0, "reduce_scatter_bytes": 0, "all_reduce_bytes": 0,
                      "all_gathers": 0, "reduce_scatters": 0, "seconds": 0.0,
                      "wait_seconds": 0.0, "reused": 0, "prefetched": 0}

    def sharding(self):
        """What the session is built with (``_C.Session(cfg, specs, sharding)``)."""
        return _C.Sharding(self.world, self.rank, self.collectives)

    def attach(self, session):
        """The session built with sharding(): the shards' home from now on."""
        self.session = session
        self.compute_kind = session.compute_kind

    # ---- set-up ----------------------------------------------------------------------------
    def check_layout(self):
        """Every rank must lay the model out alike (same tensors, same budgets): compared."""
        s = self.session
        mine = torch.tensor([s.chunk_elems, s.num_groups, s.num_tensors, s.total_chunk_bytes],
                            dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        _collective("comparing the model's layout", self._all_gather_list, every, mine)
        for r, other in enumerate(every):
            if not torch.equal(other, mine):
                raise ValueError(
                    f"tiermem: rank {r} lays the model out as (chunk elements, groups, tensors, "
                    f"chunk bytes) = {tuple(other.tolist())}, rank {self.rank} as "
                    f"{tuple(mine.tolist())}: every rank needs the same model and config "
                    "(device budget, chunk_size, precision)")

    def broadcast_(self, t):
        """Rank 0's value of `t` on every rank (the initial parameters, as DDP does)."""
        if self.backend == "nccl":
            d = t.cuda()
            _collective("broadcast of the initial parameters", dist.broadcast, d, 0,
                        group=self.group)
            t.copy_(d.cpu())
        else:
            _collective("broadcast of the initial parameters", dist.broadcast, t, 0,
                        group=self.group)

    def _all_gather_list(self, out, t):
        if self.backend == "nccl":
            outs = [o.cuda() for o in out]
            dist.all_gather(outs, t.cuda(), group=self.group)
            for o, d in zip(out, outs):
                o.copy_(d.cpu())
        else:
            dist.all_gather(out, t, group=self.group)

    # ---- full chunks -----------------------------------------------------------------------
    def _record(self, op, nbytes, t0, waited_since=None):
        """A collective issued at t0 has ended now: its span goes to the timeline; the time
        the training thread was blocked on it (since `waited_since` for a prefetch, else all
        of it) to wait_seconds."""
        now = time.perf_counter()
        self.stats["seconds"] += now - t0
        self.stats["wait_seconds"] += now - (t0 if waited_since is None else waited_since)
        self.session.record_collective(op, nbytes, int((now - t0) * 1e9))

    def _scratch(self, evict_recent=True):
        """A full-chunk scratch region of the compute dtype; when the budget is short, the
        cache of recently released chunks goes first (unless `evict_recent` is off: a
        prefetch never pushes out what is already there)."""
        s = self.session
        nbytes = s.chunk_elems * s.element_size(s.compute_kind)
        try:
            scratch = s.allocate_scratch(s.compute_tier, nbytes)
        except MemoryError:
            if not (evict_recent and self._recent):
                raise
            self.drop_recent()
            scratch = s.allocate_scratch(s.compute_tier, nbytes)
        return scratch.region, scratch.view.view(self.dtype), nbytes

    def gather(self, g, kind):
        key = (g, kind)
        h = self._held.get(key)
        if h is not None:
            h.refs += 1
            return h.tensor
        h = self._recent.pop(key, None)
        if h is not None:
            self.stats["reused"] += 1
        else:
            h = self._pending.pop(key, None)
            if h is not None:
                self._finish(g, h)
            else:
                h = self._start(g, kind)
                self._finish(g, h)
        h.refs = 1
        self._held[key] = h
        return h.tensor

    def prefetch(self, g, kind):
        """Starts gathering (g, kind) for a unit about to run; a no-op when it is held,
        cached or already on its way."""
        key = (g, kind)
        if key in self._held or key in self._recent or key in self._pending:
            return
        try:
            self._pending[key] = self._start(g, kind, async_op=True, evict_recent=False)
        except MemoryError:
            return  # no room now: gathered when needed
        self.stats["prefetched"] += 1

    def _start(self, g, kind, async_op=False, evict_recent=True):
        s = self.session
        region, full, nbytes = self._scratch(evict_recent)
        h = _Held(full, region, refs=0)
        try:
            try:
                shard = s.acquire(g, kind, s.compute_tier)
            except MemoryError:
                if not (evict_recent and self._recent):
                    raise
                self.drop_recent()  # the cache's room, for the shard
                shard = s.acquire(g, kind, s.compute_tier)
            try:
                h.t0 = time.perf_counter()
                # An async op keeps reading the shard: a copy of it, so the pin ends now.
                src = shard.clone() if async_op else shard
                h.work = _collective(f"all-gather of chunk group {g}",
                                     dist.all_gather_into_tensor, full, src, group=self.group,
                                     async_op=async_op)
            finally:
                s.release(g, kind, False)
        except BaseException:
            s.free_scratch(s.compute_tier, region)
            raise
        self.stats["all_gather_bytes"] += nbytes
        self.stats["all_gathers"] += 1
        return h

    def _finish(self, g, h):
        waited_since = time.perf_counter() if h.work is not None else None
        if h.work is not None and hasattr(h.work, "wait"):
            try:
                _collective(f"all-gather of chunk group {g}", h.work.wait)
            except BaseException:
                self.session.free_scratch(self.session.compute_tier, h.region)
                raise
        async_op = h.work is not None and hasattr(h.work, "wait")
        h.work = None
        self._record("all_gather", h.tensor.numel() * h.tensor.element_size(), h.t0,
                     waited_since if async_op else None)

    def held(self, g, kind):
        h = self._held.get((g, kind))
        return h.tensor if h is not None else None

    def mark_dirty(self, g, kind):
        h = self._held.get((g, kind))
        if h is not None:
            h.dirty = True

    def release(self, g, kind, modified=False):
        """True when this was the last holder (the full chunk is no longer in use)."""
        key = (g, kind)
        h = self._held[key]
        h.dirty = h.dirty or modified
        h.refs -= 1
        if h.refs > 0:
            return False
        del self._held[key]
        s = self.session
        try:
            if h.dirty:  # this rank's part back into its shard
                begin, n = s.shard_begin, s.shard_elems
                shard = s.acquire(g, kind, s.compute_tier)
                shard.copy_(h.tensor[begin:begin + n])
                s.release(g, kind, True)
                h.dirty = False
        except BaseException:
            s.free_scratch(s.compute_tier, h.region)
            raise
        if kind != self.compute_kind:  # gradients change with every scatter: not cached
            s.free_scratch(s.compute_tier, h.region)
            return True
        self._recent[key] = h  # most recent last
        while len(self._recent) > self.recent_capacity:
            old = next(iter(self._recent))
            s.free_scratch(s.compute_tier, self._recent.pop(old).region)
        return True

    def drop_recent(self):
        s = self.session
        for h in self._recent.values():
            s.free_scratch(s.compute_tier, h.region)
        self._recent.clear()

    def flush(self):
        """Shards may change now (the optimizer step, a load, user writes between iterations):
        no cached or prefetched full chunk survives."""
        self.drop_recent()
        for key, h in list(self._pending.items()):
            try:
                self._finish(key[0], h)
            finally:
                self.session.free_scratch(self.session.compute_tier, h.region)
        self._pending.clear()

    # ---- gradients ---------------------------------------------------------------------------
    def grad_buffer(self, g):
        """A zeroed full-size gradient buffer for group `g` (held until scatter_grad)."""
        s = self.session
        scratch = s.allocate_scratch(s.compute_tier, s.chunk_elems * s.element_size(_K.grad))
        full = scratch.view.view(self.dtype)
        full.zero_()
        self._held[(g, "grad-buffer")] = _Held(full, scratch.region)
        return full

    def scatter_grad(self, g, fresh):
        """Reduce-scatters group `g`'s full gradient buffer into this rank's grad shard: the
        mean over ranks is added to the shard, after zeroing the local spans of the pieces in
        `fresh` (their gradient started in this backward: torch's copy semantics)."""
        h = self._held.pop((g, "grad-buffer"))
        s = self.session
        try:
            n, begin = s.shard_elems, s.shard_begin
            part = torch.empty(n, dtype=h.tensor.dtype, device=h.tensor.device)
            t0 = time.perf_counter()
            _collective(f"reduce-scatter of chunk group {g}'s gradients",
                        dist.reduce_scatter_tensor, part, h.tensor, op=dist.ReduceOp.SUM,
                        group=self.group)
            self._record("reduce_scatter", h.tensor.numel() * h.tensor.element_size(), t0)
            self.stats["reduce_scatter_bytes"] += h.tensor.numel() * h.tensor.element_size()
            self.stats["reduce_scatters"] += 1
            part.div_(self.world)
            shard = s.acquire_for_write(g, _K.grad, s.compute_tier)
            try:
                for pc in fresh:  # pieces (shared._Piece)
                    lo, hi = max(pc.offset, begin), min(pc.offset + pc.numel, begin + n)
                    if lo < hi:
                        shard[lo - begin:hi - begin].zero_()
                shard.add_(part)
            finally:
                s.release(g, _K.grad, True)
        finally:
            s.free_scratch(s.compute_tier, h.region)

    def _sum_host(self, t, what):
        """The sum over ranks of a small CPU tensor (through the device for NCCL)."""
        if self.backend == "nccl":
            d = t.cuda()
            _collective(what, dist.all_reduce, d, group=self.group)
            return d.cpu()
        _collective(what, dist.all_reduce, t, group=self.group)
        return t

    def all_reduce_stats(self, local: _C.GradStats) -> _C.GradStats:
        """Every rank's gradient stats summed (the norm's squares) and or-ed (overflow)."""
        t0 = time.perf_counter()
        t = self._sum_host(torch.tensor([local.sq_norm, 1.0 if local.overflow else 0.0],
                                        dtype=torch.float64), "all-reduce of the gradient norm")
        self._record("all_reduce", 16, t0)
        self.stats["all_reduce_bytes"] += 16
        return _C.GradStats(float(t[0]), bool(t[1] > 0))

    def all_ok(self, ok: bool) -> bool:
        t = self._sum_host(torch.tensor([0 if ok else 1], dtype=torch.int64),
                           "agreeing on a result")
        return int(t[0]) == 0

    def agree(self, fn, elsewhere):
        """Runs `fn` on every rank and makes them agree: this rank's error if it failed, else
        `elsewhere()` (an exception) if another rank failed."""
        err = None
        try:
            fn()
        except (OSError, ValueError, RuntimeError) as e:
            err = e
        if not self.all_ok(err is None):
            raise err if err is not None else elsewhere()

    def close(self):
        s = self.session
        for h in list(self._held.values()) + list(self._recent.values()):
            s.free_scratch(s.compute_tier, h.region)
        for h in self._pending.values():
            if h.work is not None and hasattr(h.work, "wait"):
                try:
                    h.work.wait()
                except RuntimeError:
                    pass
            s.free_scratch(s.compute_tier, h.region)
        self._held.clear()
        self._recent.clear()
        self._pending.clear()
