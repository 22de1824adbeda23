"""Activations saved for backward: counted in the device budget, offloaded to host memory,
spilled to NVMe (``activations``: budget, offload, recompute, auto; docs/python.md,
"Activations in the device budget").

The ledger. Every storage that is not chunk memory and that a training forward saves for
backward is counted once per iteration (``count_saved``) as the bytes of the innermost unit
whose forward saved it (-1: outside every unit); ``sync`` tells the session the bytes on the
device (its external device bytes, so the chunks make room for them). While a warm-up trace
is recorded, each storage's bytes go to the trace once too (``trace_saved``), whatever the
activations mode. When the backward leaves a unit, its bytes stop counting (``unit_done``);
when the iteration ends or is abandoned, nothing of it stays (``reset``, ``abandon``).

Offload (offload / auto). A unit's saved storages (``_Saved``) move to host memory when the
device cannot hold them next to the chunks, oldest forward unit first (the last one the
backward needs), and come back at that unit's backward moment — the next unit's one moment
earlier when there is room. The device keeps ``cap`` bytes at most (the session's
``activation_cap``): its budget less room for the chunks of two units (a backward holds the
current unit's compute and grad chunks while the next one's arrive). When the host budget has no room either, they are spilled to NVMe regions
through two host bounces, or, under auto, dropped when every ref to them can be recomputed by
its frame (recompute.py).

Invariants: a storage is counted at most once per iteration, whichever units save it; the
session's external device bytes are ``total - host - nvme`` after every ``sync`` (or the
iteration is abandoned and they are 0); a _Saved is in exactly one place (device, host, NVMe,
dropped); every NVMe region is freed when its bytes are fetched back or the iteration is reset,
and no spill copy is in flight into a freed region; a MemoryError leaves the model unchanged:
the iteration is abandoned first (``abandon``).

Owns: the ledger (bytes per unit, the storages counted), every _Saved, the host and NVMe bytes
they hold, the spill bounces, the activation stats, ``kept`` (the storages recomputed units
keep as their inputs: recompute.py adds them; they stay on the device), and the trace's
saved-bytes bookkeeping. Parts whose state lives as long as the activations' register with
``on_reset`` / ``on_unit_done`` (recompute.py's frames, the graph watch of unit_hooks.py):
they are dropped first whenever this ledger is.
Reads: the session, the run state (the running units, backward, the backward's unit), the
units (names), the modes (shared.Modes: the activations mode's predicates, NVMe). Writes the
run state's phase once: ``abandon`` ends a forward that raised (shared.Phase).

Threading: the training thread (forward: saving, offloading) and autograd's backward thread
(fetching, freeing), one at a time.
"""
from __future__ import annotations

import torch

from .shared import _HOST, _guard


class _Saved:
    """One storage saved for backward by a unit (activations: offload / auto): on the device
    (``storage``), offloaded to host memory (``host``, a byte tensor), spilled to NVMe
    (``spill``, the session's NVMe ``_C.Region``) when the host budget has no room, or, auto,
    dropped (to be recomputed by the frames of the refs to it) — one of the four."""
    __slots__ = ("unit", "nbytes", "storage", "host", "spill", "tracked", "dropped",
                 "free_refs")

    def __init__(self, unit, storage):
        self.unit, self.storage, self.host, self.spill = unit, storage, None, None
        self.nbytes = storage.nbytes()
        self.tracked = True  # counted in the activation bytes (until its unit's backward ends)
        self.dropped = False
        self.free_refs = 0   # refs to it without a frame that could recompute them


class _ActRef:
    __slots__ = ("saved", "dtype", "offset", "size", "stride", "unit", "guard", "frame", "index")

    def __init__(self, saved, t, unit):
        self.saved, self.dtype, self.unit = saved, t.dtype, unit  # unit: the one saving it
        self.guard = _guard(t)
        self.offset, self.size, self.stride = t.storage_offset(), tuple(t.size()), tuple(t.stride())
        self.frame, self.index = None, 0  # auto: the Frame that can recompute it, its position


class Activations:
    """The activation ledger, offload and NVMe spill of one runtime (see the module
    docstring)."""

    def __init__(self, modes, session, state, units, device: torch.device):
        self.session = session
        self.state = state
        self.units = units
        self.device = device
        # activations: budget — bytes of non-chunk tensors saved for backward, per unit (-1:
        # outside every unit), counted in the device budget (the session's external bytes).
        mode = modes.activations
        self.count = mode.counted
        self.offload = mode.offloaded
        self._recompute_all = mode.recompute_every_unit  # (for the messages)
        self._recompute_planned = mode.planned
        self.unit_bytes: dict[int, int] = {}
        self.total = 0            # device + host bytes of the activations counted
        self.given = 0            # what the session was last told (device)
        self.seen: set = set()    # storages counted this iteration
        self.kept: set = set()    # storages kept as recomputed units' inputs (recompute.py)
        self.saved: dict[int, _Saved] = {}  # device data_ptr -> its _Saved (forward)
        self.by_unit: dict[int, list] = {}  # unit -> its _Saved, in save order
        self.order: list[int] = []          # units in the order they first saved
        self.host = 0                       # tracked bytes offloaded to the host now
        self.nvme = 0                       # tracked bytes spilled to NVMe now
        self._host_given = 0
        self.cap = 0  # device bytes of activations kept at most (the runtime sets it from
        #               the session's activation_cap)
        # Spilled to NVMe (the host budget had no room): every _Saved holding a region, freed
        # when it is fetched back or the iteration is reset.
        self.spilled: list = []
        self._spill_ok = modes.nvme
        self._spill_bufs: list = []            # host scratch bounces (_C.Scratch)
        self._spill_pending = [None, None]     # the copy in flight through each bounce
        self.stats = {"offloaded_bytes": 0, "fetched_bytes": 0, "sync_fetches": 0,
                      "recomputed_units": 0, "recomputed_bytes": 0, "dropped_bytes": 0,
                      "spilled_bytes": 0}
        # activations: outside — bytes of the storages the units' training forwards saved for
        # backward this iteration, in no budget (once each), and the most of any iteration.
        self._outside_seen: set = set()
        self.outside_bytes = 0
        self.outside_peak = 0
        self.recording_trace = False  # the session records this iteration's warm-up trace
        self._trace_seen: set = set()  # storages whose saved bytes were counted this iteration
        self._resets: list = []       # on_reset
        self._unit_dones: list = []   # on_unit_done

    def on_reset(self, fn):
        """`fn()` runs first whenever the ledger is reset (the iteration ends or is
        abandoned)."""
        self._resets.append(fn)

    def on_unit_done(self, fn):
        """`fn(unit)` runs first whenever the backward leaves `unit` (unit_done)."""
        self._unit_dones.append(fn)

    def start_trace(self, recording: bool):
        """A training iteration begins: whether the session records its trace."""
        self.recording_trace = recording
        self._trace_seen.clear()

    # ---- the ledger (activations in the device budget) --------------------------------------
    def count_saved(self, unit, ptr, nbytes) -> bool:
        """Counts storage `ptr` once per iteration as `unit`'s activation bytes. False: it
        was counted already."""
        if ptr in self.seen:
            return False
        self.seen.add(ptr)
        self.unit_bytes[unit] = self.unit_bytes.get(unit, 0) + nbytes
        self.total += nbytes
        return True

    def count_outside(self, ptr, nbytes):
        """activations: outside — storage `ptr`, saved for backward, once per iteration in the
        bytes no budget counts (stats()'s outside_budget)."""
        if ptr not in self._outside_seen:
            self._outside_seen.add(ptr)
            self.outside_bytes += nbytes
            self.outside_peak = max(self.outside_peak, self.outside_bytes)

    def trace_saved(self, ptr, nbytes):
        """While recording: storage `ptr`'s bytes, once, as the current unit's saved bytes."""
        if self.recording_trace and ptr not in self._trace_seen:
            self._trace_seen.add(ptr)
            self.session.add_saved_bytes(nbytes)

    def sync(self):
        if self.offload:
            self.make_room()
        while True:
            device = self.total - self.host - self.nvme
            if device == self.given:
                return
            try:
                self.session.set_external_compute_bytes(device)
                break
            except MemoryError as e:
                # The chunks in use need more room than `cap` foresaw (or a plan kept
                # more): offload one more unit if there is one the backward needs later.
                if self.offload and self.offload_oldest():
                    continue
                self.abandon()
                # Host mode: the compute tier is the host; there is no device to offload from.
                host_mode = self.session.host_compute
                tier = "host" if host_mode else "device"
                how = ("the activations of the units running now and those outside every unit "
                       "stay there (activations: 'offload')" if self.offload else
                       "activations: 'recompute' keeps the units' inputs, the activations "
                       "outside every unit and, in the backward, one unit's recomputed ones"
                       if self._recompute_all else
                       "activations: 'budget' counts them in it, next to the chunks' homes; "
                       "'recompute' keeps only the units' inputs, 'outside' leaves them "
                       "uncounted" if host_mode else
                       "activations: 'budget' counts them in it; 'offload' moves them to the "
                       "host")
                raise MemoryError(
                    f"tiermem: the activations saved for backward ({device} bytes on the "
                    f"{tier}) do not fit the {tier} budget next to the chunks in use ({how}): "
                    f"{e}. Use a larger {tier} budget or a smaller batch; the model is "
                    f"unchanged.") from None
        self.given = device

    def abandon(self):
        """The iteration is abandoned (the caller's forward raises): nothing of it stays."""
        self.reset()
        was_forward = self.state.in_forward
        self.state.abandon_forward()
        if was_forward:  # the session's iteration ends with it (a backward stays one)
            self.session.units.end_iteration()
        self.state.fwd_used.clear()

    def reset(self):
        for fn in self._resets:
            fn()
        self.kept.clear()
        self.unit_bytes.clear()
        self.seen.clear()
        self._outside_seen.clear()
        self.outside_bytes = 0
        self.total = 0
        self.saved.clear()
        self.by_unit.clear()
        self.order.clear()
        self.host = 0
        self.nvme = 0
        self.spill_free_all()
        if self.count and self.given:
            self.session.set_external_compute_bytes(0)
            self.given = 0
        if self._host_given:
            self.session.set_external_host_bytes(0)
            self._host_given = 0

    def unit_done(self, unit):
        """The backward moved past `unit`: its saved activations are freed."""
        for fn in self._unit_dones:
            fn(unit)
        n = self.unit_bytes.pop(unit, 0)
        for h in self.by_unit.pop(unit, ()):
            # Autograd may still hold it (a node of a later unit that saved the same storage);
            # it stays usable, but no longer counts.
            h.tracked = False
            if h.host is not None:
                self.host -= h.nbytes
            elif h.spill is not None:
                self.nvme -= h.nbytes
        if n:
            self.total -= n
            self.sync()

    def backward_reached(self, unit):
        """After the backward's moment for `unit` (its planned actions done): the forward's
        last activations (not yet counted) take their room."""
        if self.offload and unit >= 0:
            # This unit's offloaded activations now (the backward needs them next),
            # the one before it in the forward when the device has room for it.
            self.fetch(unit)
            i = self.order.index(unit) if unit in self.by_unit else -1
            if i > 0 and not self.session.plan_followed:  # a plan fetches them itself
                self.fetch(self.order[i - 1], only_if_room=True)
        self.sync()

    # ---- saving (activations: offload) ------------------------------------------------------
    def save(self, t: torch.Tensor, ptr: int):
        """A training forward inside a unit saves `t` (storage `ptr`, on the device, not chunk
        memory): an _ActRef to its _Saved, or None when the storage was counted already
        outside every unit (it stays as it is)."""
        unit = self.state.active_units[-1].index
        h = self.saved.get(ptr)
        if h is None and ptr not in self.seen:
            h = _Saved(unit, t.untyped_storage())
            self.saved[ptr] = h
            self.count_saved(unit, ptr, h.nbytes)
            if unit not in self.by_unit:
                self.order.append(unit)
            self.by_unit.setdefault(unit, []).append(h)
            self.trace_saved(ptr, h.nbytes)
        if h is not None:
            h.free_refs += 1
            return _ActRef(h, t, unit)
        return None

    def fetched(self, ref: _ActRef) -> torch.Tensor:
        """The tensor `ref` stands for, on the device (fetched now if it was not fetched
        ahead: a stall). Not for a dropped one (the caller recomputes it)."""
        h = ref.saved
        if h.storage is None:  # not fetched ahead: fetch it now (a stall)
            self.stats["sync_fetches"] += 1
            self.fetch_one(h)
            if h.tracked:
                self.sync()
        return torch.empty(0, dtype=ref.dtype, device=self.device).set_(
            h.storage, ref.offset, ref.size, ref.stride)

    # ---- offload ----------------------------------------------------------------------------
    def make_room(self):
        """Fetches what an executed plan fetches now; offloads the units the plan offloads
        (once their forward is done), then whole units, oldest forward unit first, until the
        device's activation bytes fit `cap`."""
        for unit in self.session.take_activation_fetches():
            # Like a planned chunk prefetch: into free room only (the backward moment of the
            # unit fetches whatever is still on the host).
            self.fetch(unit, only_if_room=True)
        if not self.state.in_backward and self.session.plan_followed:
            active = {u.index for u in self.state.active_units}
            for unit in self.order:
                if unit not in active and self.session.plan_offloads_unit(unit):
                    self.offload_unit(unit)
        while self.total - self.host - self.nvme > self.cap \
                and self.offload_oldest():
            pass

    def offload_oldest(self) -> bool:
        """Offloads the oldest forward unit still on the device that may go: not running
        (forward), not reached yet (backward: its activations are needed later than the
        current unit's). False when there is none."""
        active = {u.index for u in self.state.active_units}
        for unit in self.order:
            if self.state.in_backward and unit == self.state.bwd_unit:
                return False  # this and every later forward unit is needed now or was used
            if unit in active:
                continue
            if any(self.offloadable(h) for h in self.by_unit.get(unit, ())):
                self.offload_unit(unit)
                return True
        return False

    def offload_unit(self, unit):
        todo = [h for h in self.by_unit.get(unit, ()) if self.offloadable(h)]
        n = sum(h.nbytes for h in todo)
        if not n:
            return
        host = self.host + n
        try:
            self.session.set_external_host_bytes(host)  # room first (evicts host caches)
        except MemoryError as e:
            if self._recompute_planned and all(h.free_refs == 0 for h in todo):
                self.drop(unit, todo, n)  # auto: recomputed in the backward instead
                return
            if self._spill_ok:
                self.spill(unit, todo, n, e)  # to NVMe, through a host bounce
                return
            self.abandon()
            raise MemoryError(
                f"tiermem: offloading the activations of unit {self.units[unit].name!r} "
                f"({n} bytes) does not fit the host budget: {e}. Use a larger host budget, an "
                f"NVMe tier (config 'nvme': spilled there) or a smaller batch; the model is "
                f"unchanged.") from None
        self._host_given = host
        cuda = self.device.type == "cuda"
        for h in todo:
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(h.storage)
            h.host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=cuda)
            h.host.copy_(src, non_blocking=cuda)
            self.leave_device(h)
        self.host = host
        self.stats["offloaded_bytes"] += n

    def leave_device(self, h):
        """`h`'s bytes are elsewhere now (host, NVMe) or dropped: its device storage is
        forgotten."""
        ptr = h.storage.data_ptr()
        self.saved.pop(ptr, None)
        self.seen.discard(ptr)
        h.storage = None  # the device memory goes when autograd's views of it do

    def drop(self, unit, todo, n):
        """auto: the host has no room for `unit`'s activations either: they are dropped and
        each ref to them recomputes from its frame when the backward unpacks it."""
        for h in todo:
            self.leave_device(h)
            h.dropped, h.tracked = True, False
        self.unit_bytes[unit] = self.unit_bytes.get(unit, 0) - n
        self.total -= n
        self.stats["dropped_bytes"] += n

    def unit_name(self, unit) -> str:
        if 0 <= unit < len(self.units):
            u = self.units[unit]
            return u.name or type(u.module).__name__
        return "(outside every unit)"

    def offloadable(self, h) -> bool:
        # Not a storage a recomputed unit keeps as its input: that one stays on the device.
        return h.storage is not None and h.tracked and h.storage.data_ptr() not in self.kept

    def fetch(self, unit, only_if_room=False):
        todo = [h for h in self.by_unit.get(unit, ())
                if h.host is not None or h.spill is not None]
        n = sum(h.nbytes for h in todo)
        if only_if_room and self.total - self.host - self.nvme + n > self.cap:
            return
        for h in todo:
            self.fetch_one(h)

    def fetch_one(self, h):
        cuda = self.device.type == "cuda"
        dev = torch.empty(h.nbytes, dtype=torch.uint8, device=self.device)
        if h.spill is not None:
            self.spill_read(h, dev)
            if h.tracked:
                self.nvme -= h.nbytes
        elif h.host is not None:
            dev.copy_(h.host, non_blocking=cuda)
            h.host = None
            if h.tracked:
                self.host -= h.nbytes
        else:
            raise RuntimeError(
                f"tiermem: an activation saved by unit {self.unit_name(h.unit)!r} was spilled "
                f"to NVMe and freed when a new iteration began; a backward through a graph of "
                f"an earlier iteration cannot read it (use activations 'budget' or 'outside' "
                f"for such graphs)")
        h.storage = dev.untyped_storage()
        self.stats["fetched_bytes"] += h.nbytes

    # ---- activations spilled to NVMe (offload / auto, the host budget short) ------------------
    def spill(self, unit, todo, n, host_error):
        """The host budget has no room for `unit`'s activations: they go to NVMe regions (the
        NVMe budget), copied through two host scratch bounces (the host budget) with the
        device->bounce copy of one piece overlapping the NVMe write of the other. The writes
        may still be in flight when this returns (spill_drain waits for them). Every region
        is allocated before anything moves, so a full NVMe tier leaves everything as it
        was."""
        regions = []
        try:
            for h in todo:
                regions.append(self.session.allocate_spill(h.nbytes))
        except MemoryError as e:
            for r in regions:
                self.session.free_spill(r)
            self.abandon()
            raise MemoryError(
                f"tiermem: offloading the activations of unit {self.unit_name(unit)!r} "
                f"({n} bytes) fits neither the host budget ({host_error}) nor the NVMe tier "
                f"({e}). Use a larger host or NVMe budget or a smaller batch; the model is "
                f"unchanged.") from None
        try:
            piece = 0
            for h, region in zip(todo, regions):
                src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(h.storage)
                for lo in range(0, h.nbytes, self.spill_piece()):
                    bounce = self.spill_buffer(piece)  # its last write is done
                    k = min(bounce.view.numel(), h.nbytes - lo)
                    # synchronous (D2H waits for the kernels)
                    bounce.view[:k].copy_(src[lo:lo + k])
                    self._spill_pending[piece % 2] = self.session.start_spill_copy(
                        region, lo, bounce.region, 0, k, True)
                    piece += 1
        except BaseException:
            self.spill_drain(quiet=True)  # no copy may be in flight into a freed region
            for r in regions:
                self.session.free_spill(r)
            self.abandon()
            raise
        for h, region in zip(todo, regions):
            self.leave_device(h)
            h.spill = region
            self.spilled.append(h)
        self.nvme += n
        self.stats["offloaded_bytes"] += n
        self.stats["spilled_bytes"] += n

    def spill_read(self, h, dev):
        """Reads `h`'s region into `dev` (the NVMe read of one piece overlapping the copy of
        the other to the device) and frees the region."""
        self.spill_drain(release=False)  # the writes first (this region's among them)
        step = self.spill_piece()
        los = list(range(0, h.nbytes, step))

        def start(i):
            bounce = self.spill_buffer(i)
            k = min(bounce.view.numel(), h.nbytes - los[i])
            self._spill_pending[i % 2] = self.session.start_spill_copy(
                h.spill, los[i], bounce.region, 0, k, False)
        start(0)
        for i, lo in enumerate(los):
            if i + 1 < len(los):
                start(i + 1)
            pending, self._spill_pending[i % 2] = self._spill_pending[i % 2], None
            self.spill_wait(pending)
            k = min(step, h.nbytes - lo)
            dev[lo:lo + k].copy_(self._spill_bufs[i % 2].view[:k])  # synchronous
        self.session.free_spill(h.spill)
        h.spill = None
        self.spilled.remove(h)
        if not self.spilled:
            self.spill_drain()  # and the bounces go back to the host budget

    def spill_piece(self) -> int:
        # At most 4 MiB (a few of the NVMe tier's I/Os) and one fp32 chunk (the host reserve
        # keeps that much of the host budget for caches, which scratch evicts).
        return min(4 << 20, self.session.chunk_elems * 4) // 4096 * 4096 or 4096

    def spill_buffer(self, i):
        """Bounce i % 2 (a host ``_C.Scratch``: its region and uint8 view), allocated on first
        use, once its previous copy is done."""
        j = i % 2
        pending = self._spill_pending[j]
        if pending is not None:
            self._spill_pending[j] = None
            self.spill_wait(pending)
        while len(self._spill_bufs) <= j:
            piece = self.spill_piece()
            try:
                self._spill_bufs.append(self.session.allocate_scratch(_HOST, piece))
            except MemoryError as e:
                raise MemoryError(
                    f"tiermem: activations spilled to NVMe go through two bounces of {piece} "
                    f"bytes of host memory, and the host budget has no room for them: {e}. Use "
                    f"a larger host budget; the model is unchanged.") from None
        return self._spill_bufs[j]

    def spill_wait(self, pending):
        try:
            pending.wait()
        except (OSError, RuntimeError) as e:  # the I/O error's type (OSError) is kept
            raise type(e)(f"tiermem: an activation spill to or from NVMe failed: {e}") from None

    def spill_drain(self, quiet=False, release=True):
        """Waits for the spill copies in flight and (`release`) gives the bounces back."""
        err = None
        for j, pending in enumerate(self._spill_pending):
            self._spill_pending[j] = None
            if pending is not None:
                try:
                    self.spill_wait(pending)
                except (OSError, RuntimeError) as e:
                    err = err or e
        if release:
            if not self.session.closed:
                for bounce in self._spill_bufs:
                    self.session.free_scratch(_HOST, bounce.region)
            self._spill_bufs.clear()
        if err is not None and not quiet:
            raise err

    def spill_free_all(self):
        self.spill_drain(quiet=True)  # the iteration is over or abandoned: its spills go
        for h in self.spilled:
            if not self.session.closed:
                self.session.free_spill(h.spill)
            h.spill = None
        self.spilled.clear()
