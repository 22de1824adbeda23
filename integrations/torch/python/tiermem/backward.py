"""The backward's walk through the units: its moments and the compute chunks it holds.

A backward begins at the first tiermem hook it runs (a saved tensor unpacked, a gradient
accumulated) and ends in autograd's final callback. In between, each time it reaches another
unit (a saved tensor of that unit's forward, a gradient of one of its parameters) the
session's unit protocol marks that unit's pre-backward moment (``moment``;
runtime/unit_protocol.h): the timeline's and, while recording, the warm-up trace's; the
moment a plan's actions are tied to. At that moment the previous unit's
activations are freed (activations.py), this unit's come back from the host or NVMe, and,
sharded, the chunks of the unit before it in the forward start gathering.

Invariants: a compute chunk a saved view of chunk memory needs is acquired once per backward
(``base``) and held until every parameter of its group that the forward used has its
gradient (``grad_in``) or the backward moves to a unit that does not use the group, whichever
comes first; nothing of a backward is held after its end (``end``): the held compute chunks,
the parts registered with ``on_end`` (grads.py's held grad chunks), the iteration's activations.

Owns: the compute chunks held for the backward and the params each still waits for; the run
state's ``bwd_unit`` and its phase's backward transitions (``Phase``: into BACKWARD, and back
to IDLE at the end, which ends the iteration).
Reads: the session (phases, moments, plan), the chunk access, the units, the activation
ledger, the forward order (sharded prefetch).

Threading: autograd's backward thread (the hooks), one backward at a time.
"""
from __future__ import annotations

import torch

from .compiling import eager


class Backward:
    """The current backward of one runtime (see the module docstring)."""

    def __init__(self, session, chunks, state, units, activations, order):
        self.session = session
        self.chunks = chunks
        self.state = state
        self.units = units
        self.activations = activations
        self.order = order
        self._hold: dict[int, torch.Tensor] = {}  # group -> its compute chunk, held
        self._pending: dict[int, set] = {}        # group -> params still without a gradient
        self._at_end: list = []
        self._end = eager(self.end)  # autograd's final callback, eager (compiling.py)

    def on_end(self, fn):
        """`fn()` runs at the end of every backward, after the held compute chunks are
        released and before the iteration's state is cleared."""
        self._at_end.append(fn)

    def begin(self):
        st = self.state
        if not st.in_backward:
            st.begin_backward()
            self.session.units.enter_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def end(self):
        ck = self.chunks.compute_kind
        for g, base in list(self._hold.items()):
            self.chunks.release(g, ck, False, base)
        self._hold.clear()
        self._pending.clear()
        for fn in self._at_end:
            fn()
        st = self.state
        st.fwd_used.clear()
        st.bwd_unit = None
        st.end_backward()
        self.session.units.end_iteration()
        if self.activations.count:
            self.activations.reset()

    def base(self, group):
        """The compute chunk of `group` held for the backward (acquired on first use; released
        when its gradients are in or the backward moves to a unit that does not use it)."""
        base = self._hold.get(group)
        if base is None:
            base = self.chunks.acquire(group, self.chunks.compute_kind)
            self._hold[group] = base
            self._pending[group] = set(self.state.fwd_used.get(group, ()))
        return base

    def grad_in(self, r):
        """Parameter `r`'s gradient is accumulated: its group's compute chunk goes once every
        parameter the forward used has its gradient."""
        for g in r.groups:
            self.key_in(g, r.index)

    def key_in(self, group: int, key):
        """`key` (a parameter's index, or an expert's: experts.py) has its gradient in
        `group`: the group's compute chunk goes once every key the forward used has one."""
        bwd = self._pending.get(group)
        if bwd is not None:
            bwd.discard(key)
            if not bwd and group in self._hold:
                self.chunks.release(group, self.chunks.compute_kind, False,
                                    self._hold.pop(group))
                del self._pending[group]

    def moment(self, unit: int):
        """The backward reached `unit` (its saved chunk views, or a gradient of one of its
        params): a timeline moment, and while recording a pre-backward trace moment."""
        st = self.state
        if unit != st.bwd_unit:
            prev = st.bwd_unit
            st.bwd_unit = unit
            if self.chunks.sharded and unit >= 0:
                self.order.prefetch_after(unit, -1)
            if prev is not None:
                # The compute chunks the previous unit's saved views came from, unless this
                # unit uses them too: its nodes have run (autograd runs a unit's nodes before
                # it reaches the next unit's; one it comes back to acquires again), and the
                # device's queued work is ordered by the release (tiers/tier.h). Held longer —
                # until every gradient of the group is in — a tied embedding's chunk stayed
                # pinned from the head's backward to the embedding's, where a plan had
                # evicted it (the trace records acquires, not pins).
                keep = set(self.units[unit].groups) if unit >= 0 else set()
                for g in [g for g in self._hold if g not in keep]:
                    self.chunks.release(g, self.chunks.compute_kind, False, self._hold.pop(g))
                    self._pending.pop(g, None)
            acts = self.activations
            if acts.count and prev is not None:
                # The previous unit's activations are freed before this moment's planned
                # actions: a plan's span of them ends at that unit's moment, so this moment's
                # prefetches were planned into their room (planners/effective.h).
                acts.unit_done(prev)
            self.session.units.backward_reached(unit)  # its pre-backward moment
            if acts.count:
                # After the moment's planned actions: the forward's last activations (not yet
                # counted) take their room.
                acts.backward_reached(unit)
