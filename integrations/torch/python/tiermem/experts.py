"""Mixture-of-experts layers whose experts move alone (docs/moe.md).

An *expert set* is one MoE layer's experts, found in the model at initialize:

- fused: a transformers 5.x experts module (``@use_experts_implementation``: Qwen3-MoE,
  Mixtral, OLMoE, DeepSeek-V3, GPT-OSS), whose experts are 3-D parameters
  (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], optional 2-D biases [E, X]);
- a list: an ``nn.ModuleList`` attribute named ``experts`` of modules of one class and
  parameter layout, each called only for the tokens routed to it.

The session packs each set expert by expert, each expert in chunks of its own
(runtime/session.h, "expert set"). Their parameters are not part of their unit's materialization
(units.py): the unit's pre-forward acquires only its dense chunks, and an expert's chunks are
acquired when the router has picked it and released when it has computed:

- fused: transformers' experts-implementation hook calls ``tiermem`` (registered in its
  ``ExpertsInterface``; the model's config names it while tiermem manages the model, and
  names the implementation it had again at close). It reads the routing, and for each picked
  expert acquires its chunks, computes with per-expert leaves whose ``.data`` views the
  expert's slice of each fused tensor, and releases them. The arithmetic is the
  implementation the model had: ``grouped_mm`` and the other batched ones (a token's top-k
  outputs summed in routing order) or ``eager`` (index_add in expert order), each expert's
  rows computed as they compute them — equal to the plain model bit for bit on the CPU.
- list: each expert module's forward is wrapped: it acquires and materializes that expert's
  parameters (as a unit does) and releases them after.

In training, what the experts save for backward are views of chunk memory: re-acquired in the
backward (saved.py, backward.py) for the experts that computed, never the others. Gradients:
a fused tensor's gradient is accumulated piece by piece from its per-expert leaves (grads.py,
``piece_grad``); when it begins (``p.grad`` was None) its other pieces become zeros — lazily,
moving no bytes, where the chunk holds nothing else with a gradient — so ``p.grad`` is the
whole tensor with zero rows for the experts no token reached, as torch gives it, and AdamW
steps every row as torch's does. A list expert no token reached has no gradient (``p.grad``
None) and is not stepped, as in torch.

Not moved alone (their parameters stay in their unit, split into pieces like any tensor
larger than a chunk): models sharded across ranks, experts modules in expert-parallel mode,
and ``experts=False``.

Invariants: an expert's chunks are pinned exactly while it computes (forward), or while the
backward holds them (Backward.base) — and during a recompute of its unit, as the unit's own;
a fused leaf's ``.data`` views chunk memory exactly while its expert computes; a training
forward of an expert set outside its unit is refused before anything is acquired.

Owns: the expert sets, their per-expert leaves (fused), the config's implementation name while
managed, the routing statistics (``stats``). Reads: the session, the chunk access, the run
state, the materializer (list experts), the backward (held chunks) and recompute.

Threading: the training thread (forwards); a recompute runs them on autograd's thread.
"""
from __future__ import annotations

import types
import weakref

import torch
from torch import nn

from .forwards import _Forward, _wrap_forward
from .shared import _Param

_IMPL = "tiermem"
_ORIGINAL_IMPL: dict[int, str] = {}  # id(config) -> the implementation it had (while managed)


def _fused_layout(m: nn.Module):
    """The fused experts parameters of `m` by attribute name ({name: expert-dim param}), or None
    when `m` is not a transformers experts module tiermem runs."""
    cfg = getattr(m, "config", None)
    e = getattr(m, "num_experts", None)
    if cfg is None or not isinstance(e, int) or e < 1 or not all(
            hasattr(m, a) for a in ("has_gate", "has_bias", "is_transposed",
                                    "has_post_expert_norm", "_apply_gate")):
        return None
    if getattr(cfg, "_experts_implementation", None) is None:
        return None
    names = ["gate_up_proj" if m.has_gate else "up_proj", "down_proj"]
    if m.has_bias:
        names += [n + "_bias" for n in names]
    params = {}
    for n in names:
        p = m._parameters.get(n)
        if p is None or p.dim() < 2 or p.shape[0] != e:
            return None
        params[n] = p
    return params


def _list_layout(m: nn.Module):
    """[(expert index, {name: param})] of an ``nn.ModuleList`` of like expert modules, or None."""
    if not isinstance(m, nn.ModuleList) or len(m) < 2:
        return None
    first = list(m[0].named_parameters())
    if not first or any(type(c) is not type(m[0]) for c in m):
        return None
    shapes = [(n, p.shape) for n, p in first]
    out = []
    for e, c in enumerate(m):
        ps = list(c.named_parameters())
        if [(n, p.shape) for n, p in ps] != shapes:
            return None
        out.append((e, dict(ps)))
    return out


class ExpertSet:
    """One MoE layer's experts (see the module docstring)."""

    def __init__(self, index: int, kind: str, module: nn.Module, num_experts: int):
        self.index = index
        self.kind = kind              # "fused" or "list"
        self.module = module          # the experts module, or the ModuleList
        self.num_experts = num_experts
        self.params: list[_Param] = []
        self.names: dict[int, str] = {}  # fused: param index -> attribute name
        self.members: list[list] = [[] for _ in range(num_experts)]  # per expert: (r, piece)
        self.groups: list[list[int]] = []  # per expert: its chunk groups
        self.unit = None              # the unit computing it
        self.impl = None              # fused: the implementation the model had
        self.leaves: dict = {}        # fused: (param index, expert) -> per-expert leaf
        self.holders: dict = {}       # fused: param index -> a leaf's data while not computing
        self.calls: list = []         # list: per expert, its call stack (bases, pseudo-unit)
        self.router = None            # fused: a copy of its router's weight (predictions)
        self.next = None              # fused: the next layer's set
        self.predicted: set = set()   # fused: its experts predicted by the layer before

    def __deepcopy__(self, memo):
        return None  # a deep copy of a managed model is an ordinary model (runtime.py)

    def __reduce__(self):
        return (_none, ())


def _none():
    return None


def find_expert_sets(model: nn.Module, by_orig: dict, enabled: bool) -> list[ExpertSet]:
    """The expert sets of `model` (records `by_orig`: id(user's parameter) -> _Param), each
    member's ``expert_set`` / ``expert`` set for the session's layout. A parameter shared with
    anything outside its set keeps the set out (it is not an expert's alone)."""
    if not enabled:
        return []
    owners: dict[int, int] = {}  # id(param) -> number of slots holding it
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    sets: list[ExpertSet] = []
    taken: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in taken:
            continue
        fused = _fused_layout(m)
        if fused is not None:
            if getattr(m, "_is_expert_parallel", False):
                continue
            if any(owners[id(p)] != 1 or id(p) not in by_orig for p in fused.values()):
                continue
            s = ExpertSet(len(sets), "fused", m, m.num_experts)
            for name, p in fused.items():
                r = by_orig[id(p)]
                r.expert_set, r.expert = s.index, -1
                s.params.append(r)
                s.names[r.index] = name
            sets.append(s)
            continue
        listed = _list_layout(m) if name.rsplit(".", 1)[-1] == "experts" else None
        if listed is not None:
            ps = [p for _, d in listed for p in d.values()]
            if any(owners[id(p)] != 1 or id(p) not in by_orig for p in ps):
                continue
            s = ExpertSet(len(sets), "list", m, len(m))
            for e, d in listed:
                for p in d.values():
                    r = by_orig[id(p)]
                    r.expert_set, r.expert = s.index, e
                    s.params.append(r)
            taken.update(id(c) for c in m.modules())
            sets.append(s)
    return sets


class Experts:
    """The expert sets of one runtime at run time (see the module docstring)."""

    def __init__(self, sets, session, chunks, state, materializer, recompute, units):
        self.sets = sets
        self.session = session
        self.chunks = chunks
        self.state = state
        self.materializer = materializer
        self.recompute = recompute
        self.backward = None  # set by the runtime (the backward is built after)
        self.grads = None
        self.units = units
        self._configs: list = []  # fused: configs whose implementation we named
        # Routing statistics (benchmarks, tests): expert calls, and per (set, expert) calls.
        self.stats = {"expert_calls": 0, "tokens": 0, "hints": 0, "predicted": 0,
                      "predicted_used": 0, "predicted_fetches": 0}
        self.predict_evicts = False  # see _prefetch
        self.routed: dict[tuple, int] = {}

    @property
    def alone(self) -> set:
        """Indices of the parameters that move with their expert, not their unit."""
        return {r.index for s in self.sets for r in s.params}

    # ---- set-up -------------------------------------------------------------------------------
    def place(self, params):
        """After the session placed the tensors: each expert's pieces and chunk groups, which
        the chunk access acquires as members of the set's class."""
        for s in self.sets:
            for r in s.params:
                for pc in r.pieces:
                    e = pc.expert if r.expert < 0 else r.expert
                    s.members[e].append((r, pc))
            s.groups = [sorted({pc.group for _, pc in mem}) for mem in s.members]
            for gs in s.groups:
                for g in gs:
                    self.chunks.classes[g] = s.index

    def install(self, units, registry, placeholder, grads):
        """Binds every set to the unit computing it, and hooks its forwards: the fused sets'
        implementation, the list sets' expert modules (`registry`: the runtime's list of
        wrapped modules, undone at close)."""
        self.grads = grads
        where = {}
        from .units import unit_modules
        for u in units:
            u.experts = []
            for _, m in unit_modules(u):
                where.setdefault(id(m), u)
        for s in self.sets:
            s.unit = where.get(id(s.module))
            if s.unit is None:
                raise ValueError(f"tiermem: the experts module {type(s.module).__name__} is in "
                                 f"no unit; pass units=... covering the layer that calls it")
            s.unit.experts.append(s)
            for r in s.params:
                if r.unit < 0:
                    r.unit = s.unit.index
            if s.kind == "fused":
                self._router_of(s)
                register()
                self._take_config(s)
                s.module.__dict__["_tiermem_experts"] = s
                s.module.__dict__["_tiermem_experts_rt"] = weakref.ref(self)
                for r in s.params:
                    rows = r.shape[1:]
                    s.holders[r.index] = placeholder(rows)
                    for e in range(s.num_experts):
                        leaf = nn.Parameter(s.holders[r.index], requires_grad=r.trainable)
                        s.leaves[(r.index, e)] = leaf
                        if r.trainable:
                            grads.install_piece(r, e, leaf)
            else:
                s.calls = [[] for _ in range(s.num_experts)]
                for e, m in enumerate(s.module):
                    # The expert's parameters, as a unit of its own for the materializer.
                    mine = list({r.index: r for r, _ in s.members[e]}.values())
                    pseudo = types.SimpleNamespace(
                        params=mine, slots=[(mm, name, r) for r in mine for mm, name in r.slots])
                    _wrap_forward(m, self._list_enter(s, e, pseudo),
                                  self._list_exit(s, e, pseudo), registry, cls=_Forward)
        # Each fused set's successor (the next layer's), whose experts it predicts.
        fused = sorted((s for s in self.sets if s.kind == "fused"), key=lambda s: s.unit.index)
        for a, b in zip(fused, fused[1:]):
            a.next = b

    def _router_of(self, s):
        """The router of a fused set — a sibling module of the experts module whose weight is
        [experts, hidden] — kept as a plain copy to predict the set's experts from the layer
        before (Pre-gated MoE): a prediction only moves copies, never values, so the copy
        taken now serves (a trained router's drift costs bytes, not correctness)."""
        hidden = s.params[0].shape[-1] if not s.module.is_transposed else s.params[0].shape[1]
        for parent in self.units[s.unit.index].module.modules():
            if any(c is s.module for c in parent.children()):
                for c in parent.children():
                    w = c._parameters.get("weight") if c is not s.module else None
                    r = self._record_of(w)
                    if r is not None and tuple(r.shape) == (s.num_experts, hidden):
                        s.router = self.session.read_param(r.index).view(r.shape)
                        return

    def _record_of(self, p):
        if p is None:
            return None
        return next((r for r in self._params if r.param is p), None)

    def link(self, params):
        """The parameter records (routers are found among them at install)."""
        self._params = params

    def _take_config(self, s):
        cfg = s.module.config
        if id(cfg) not in _ORIGINAL_IMPL:
            _ORIGINAL_IMPL[id(cfg)] = cfg._experts_implementation
            cfg._experts_implementation_internal = _IMPL
            self._configs.append(cfg)
        s.impl = _ORIGINAL_IMPL[id(cfg)]

    def close(self):
        """The configs name their implementation again; the modules forget tiermem."""
        for cfg in self._configs:
            cfg._experts_implementation_internal = _ORIGINAL_IMPL.pop(id(cfg))
        self._configs = []
        for s in self.sets:
            s.module.__dict__.pop("_tiermem_experts", None)
            s.module.__dict__.pop("_tiermem_experts_rt", None)

    # ---- chunks -------------------------------------------------------------------------------
    def _acquire(self, s, e) -> dict:
        """Expert `e`'s chunks (group -> chunk): pinned now, or — in a recompute of its unit —
        the backward's held ones."""
        if self.recompute.recomputing is not None:
            return {g: self.backward.base(g) for g in s.groups[e]}
        ck = self.chunks.compute_kind
        bases = {}
        try:
            for g in s.groups[e]:
                bases[g] = self.chunks.acquire(g, ck)
        except BaseException:
            for g, b in bases.items():
                self.chunks.release(g, ck, False, b)
            raise
        return bases

    def _release(self, bases, modified: bool):
        if self.recompute.recomputing is not None:
            return  # the backward's (Backward.base)
        ck = self.chunks.compute_kind
        for g, b in bases.items():
            self.chunks.release(g, ck, modified, b)

    def _check_in_unit(self, s):
        st = self.state
        if torch.is_grad_enabled() and self.recompute.recomputing is None and \
                not any(u is s.unit for u in st.active_units):
            raise RuntimeError(
                f"tiermem: the experts of {type(s.module).__name__} ran a training forward "
                f"outside the forward of their unit {s.unit.name or type(s.unit.module).__name__!r}"
                f"; their chunks are acquired per expert inside it. Call the layer, or pass "
                f"units=... so that one unit covers the code that calls the experts; nothing "
                f"was changed.")

    def _count(self, s, e, tokens: int):
        self.stats["expert_calls"] += 1
        self.stats["tokens"] += tokens
        self.routed[(s.index, e)] = self.routed.get((s.index, e), 0) + 1

    # ---- fused experts ------------------------------------------------------------------------
    def fused_forward(self, s, module, hidden, top_k_index, top_k_weights):
        if getattr(module, "_is_expert_parallel", False):
            raise RuntimeError("tiermem: expert-parallel experts modules are not moved by "
                               "tiermem; run the model without expert parallelism")
        self._check_in_unit(s)
        st = self.state
        track = torch.is_grad_enabled() and self.recompute.recomputing is None
        k = top_k_index.size(-1)
        flat = top_k_index.reshape(-1)
        hit = torch.unique(flat).tolist()
        if hit and (hit[0] < 0 or hit[-1] >= s.num_experts):
            raise ValueError(f"tiermem: routing picks expert {hit[0] if hit[0] < 0 else hit[-1]} "
                             f"of a layer of {s.num_experts} experts")
        if self.recompute.recomputing is None and not self.chunks.sharded:
            self._prefetch(s, hit, hidden, k)
        eager = s.impl == "eager"
        if eager:
            final = torch.zeros_like(hidden)
            with torch.no_grad():
                mask = torch.nn.functional.one_hot(top_k_index, num_classes=s.num_experts + 1)
                mask = mask.permute(2, 1, 0)
        else:
            # Rows in grouped_mm's order (sorted by expert, as torch.sort orders them): the
            # weight gradients sum the rows in the same order.
            weights = top_k_weights.reshape(-1)
            _, perm = torch.sort(flat)
            ends = torch.cumsum(torch.bincount(flat, minlength=s.num_experts), 0).tolist()
            rows = None
        for e in hit:
            bases = self._acquire(s, e)
            modified = False
            try:
                w = {}
                for r, pc in s.members[e]:
                    leaf = s.leaves[(r.index, e)]
                    leaf.data = self.chunks.piece(bases[pc.group], pc).view(r.shape[1:])
                    w[s.names[r.index]] = (leaf, leaf._version)
                    if track and r.trainable:
                        st.fwd_used.setdefault(pc.group, set()).add((r.index, e))
                if eager:
                    top_k_pos, token_idx = torch.where(mask[e])
                    y = _expert_rows(module, w, hidden[token_idx], cast=False)
                    y = y * top_k_weights[token_idx, top_k_pos, None]
                    final.index_add_(0, token_idx, y.to(final.dtype))
                    self._count(s, e, token_idx.numel())
                else:
                    pos = perm[(ends[e - 1] if e else 0):ends[e]]
                    y = _expert_rows(module, w, hidden[pos // k], cast=True)
                    y = y * weights[pos].unsqueeze(-1)
                    if rows is None:
                        rows = y.new_empty((flat.numel(), y.shape[-1]))
                    rows[pos] = y
                    self._count(s, e, pos.numel())
                modified = any(leaf._version != v for leaf, v in w.values())
            finally:
                for r, _ in s.members[e]:
                    s.leaves[(r.index, e)].data = s.holders[r.index]
                self._release(bases, False)
            if modified:
                raise RuntimeError(f"tiermem: the forward of {type(module).__name__} wrote "
                                   f"expert {e}'s weights in place; experts are read-only in "
                                   f"their forward")
        if eager:
            return final
        return rows.view(-1, k, rows.shape[-1]).sum(dim=1).to(hidden.dtype)

    def _prefetch(self, s, hit, hidden, k):
        """At the router: the picked experts' chunks start coming now, all of them, before the
        first computes; then the next layer's experts are predicted from this layer's input
        through the next layer's router and start coming too (the real routing corrects what
        was mispredicted: those are acquired when picked, the others just leave)."""
        if s.predicted:
            self.stats["predicted_used"] += len(s.predicted & set(hit))
            s.predicted = set()
        for e in hit:
            for g in s.groups[e]:
                self.stats["hints"] += self.chunks.hint(g)
        n = s.next
        if n is None or n.router is None:
            return
        with torch.no_grad():
            w = n.router
            if w.device != hidden.device or w.dtype != hidden.dtype:
                w = n.router = w.to(device=hidden.device, dtype=hidden.dtype)
            guess = torch.topk(hidden @ w.t(), min(k, n.num_experts), dim=-1).indices
            guess = guess.unique().tolist()
        # How often predictions came true so far (a prior of one in two at first). A prefetch
        # moves a predicted expert early, never saves its fetch; a wrong one costs its bytes
        # and those of what it displaced. So by default a prediction only takes room nothing
        # is expected to need (a likelihood so small that only chunks never used again may
        # leave); `predict_evicts` lets it displace experts expected later than it
        # (benchmarks measure both).
        q = (self.stats["predicted_used"] + 1) / (self.stats["predicted"] + 2)
        if not self.predict_evicts:
            q = 1e-9
        n.predicted = set(guess)
        self.stats["predicted"] += len(guess)
        for e in guess:
            for g in n.groups[e]:
                self.stats["predicted_fetches"] += self.chunks.hint(g, min(max(q, 1e-9), 0.99))

    # ---- list experts --------------------------------------------------------------------------
    def _list_enter(self, s, e, pseudo):
        def enter():
            if self.state.closed:
                return
            self._check_in_unit(s)
            bases = self._acquire(s, e)
            try:
                self.materializer.materialize(pseudo, bases)
            except BaseException:
                self._release(bases, False)
                raise
            placed = self.materializer.place(pseudo)
            if torch.is_grad_enabled() and self.recompute.recomputing is None:
                for r in pseudo.params:
                    if r.trainable:
                        for g in r.groups:
                            self.state.fwd_used.setdefault(g, set()).add(r.index)
            s.calls[e].append((bases, placed))
            self._count(s, e, 0)
        return enter

    def _list_exit(self, s, e, pseudo):
        def exit_():
            if self.state.closed or not s.calls[e]:
                return
            bases, placed = s.calls[e].pop()
            for m, name, r in placed:
                m._parameters[name] = r.param
            modified = self.materializer.unmaterialize(pseudo, bases)
            self._release(bases, bool(modified))
        return exit_


def _expert_rows(module, w, x, cast: bool):
    """One expert's output rows for inputs `x`, as transformers' implementations compute them:
    the batched ones (`cast`: the input in the weights' dtype, a bias added after the matmul)
    and eager (F.linear, as the models' own forwards)."""
    gate_up = "gate_up_proj" if module.has_gate else "up_proj"
    w1, w2 = w[gate_up][0], w["down_proj"][0]
    b1 = w[gate_up + "_bias"][0] if module.has_bias else None
    b2 = w["down_proj_bias"][0] if module.has_bias else None

    def linear(h, wt, b):
        if cast:
            h = h.to(wt.dtype)
        if module.is_transposed:
            out = h @ wt
        elif cast:  # grouped_mm's input @ weight^T: its backward's grad_weight = input^T @ grad
            out = h @ wt.transpose(0, 1)
        else:
            out = torch.nn.functional.linear(h, wt)
        if b is None:
            return out
        if cast:
            # The batched implementations add a bias gathered row by row (bias[expert_ids]):
            # its gradient is an indexing backward that adds the rows one after another.
            # Gathered the same way, the expert's bias gradient has the same sums, bit for bit
            # (a broadcast add's gradient would be a reduction, summing in another order).
            rows = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
            return out + b.unsqueeze(0)[rows]
        return out + b

    h = linear(x, w1, b1)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = linear(h, w2, b2)
    if module.has_post_expert_norm:
        y = module.post_expert_norm(y)
    return y


def tiermem_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The ``tiermem`` experts implementation (transformers' ExpertsInterface): the picked
    experts' chunks acquired one expert at a time (see the module docstring). A module tiermem
    does not manage (another model sharing the config) runs the implementation the config had."""
    s = module.__dict__.get("_tiermem_experts")
    ref = module.__dict__.get("_tiermem_experts_rt")
    rt = ref() if ref is not None else None
    if s is None or rt is None or rt.state.closed:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        impl = _ORIGINAL_IMPL.get(id(module.config), "grouped_mm")
        fn = ALL_EXPERTS_FUNCTIONS.get(impl) if impl != "eager" else None
        if fn is None:
            return type(module).forward.__wrapped__(module, hidden_states, top_k_index,
                                                    top_k_weights)
        return fn(module, hidden_states, top_k_index, top_k_weights)
    return rt.fused_forward(s, module, hidden_states, top_k_index, top_k_weights)


_registered = False


def register():
    """Registers ``tiermem`` in transformers' experts implementations (once)."""
    global _registered
    if not _registered:
        from transformers.integrations.moe import ExpertsInterface
        ExpertsInterface.register(_IMPL, tiermem_experts_forward)
        _registered = True
