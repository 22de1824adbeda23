"""The PyTorch adapter over the session core (``_C.Session``, runtime in C++).

The core owns the layout, the tiers, the optimizer step and checkpoints. This file only
translates torch events into core calls:

- Parameters. Each managed parameter ``p`` the model exposes is a ChunkTensor (tensor.py) —
  a stable object whose every use reads the chunk. Each also has a *compute* parameter, a
  plain ``nn.Parameter`` whose ``.data`` is a view of its chunk on the device tier while a
  unit containing it runs; unit hooks swap it into its modules' ``_parameters`` for the
  forward, so the model computes on plain tensors at full speed, and swap ``p`` back after.
- Units (units.py). A unit's pre-forward acquires (pins) its chunk groups on the device and
  materializes every parameter of its subtree; its post-forward releases them. Saved-tensor
  hooks pack any saved tensor that aliases chunk memory as a chunk reference and unpack it
  in backward as a view of the chunk's *current* device copy (re-acquired, and pinned until
  every parameter of the group used in the forward has its gradient).
- Gradients. Post-accumulate-grad hooks add each gradient into the grad chunk on the device
  (copy when ``p.grad`` is None — torch's semantics — add otherwise) and set ``p.grad`` to a
  grad ChunkTensor, so ``clip_grad_norm_``, GradScaler and logging see the true values, and
  ``zero_grad()`` / ``model.zero_grad()`` (``p.grad = None``) work as in torch. No grad is
  kept on the device beyond the chunks the engine caches.
- Inference. Forwards without grad use untraced acquires: they neither record into nor
  disturb the order the next training iteration replays.
- State. ``state_dict()`` of any module gives plain tensors (the fp32 masters);
  ``load_state_dict`` writes into the chunks through the ChunkTensors (and the fp32 master,
  exactly, in mixed precision).

Threading: one training thread (like the model itself).
"""
from __future__ import annotations

import copy
import functools
import math
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _C
from .recompute import Frame, _RecomputeRef, kv_cache_in
from .tensor import ChunkTensor, is_view_op, meta_mutating, mutated_args, unwrap
from .units import find_units, unit_modules

_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
_K = _C.ChunkKind
_DEVICE, _HOST = _C.Tier.device, _C.Tier.host


@dataclass(eq=False)
class _Param:
    index: int                 # tensor index in the session
    name: str
    shape: torch.Size
    numel: int
    trainable: bool
    orig: nn.Parameter         # the user's parameter object (given back by close())
    group: int = 0
    offset: int = 0
    opt_group: int = 0
    param: Any = None          # the ChunkTensor parameter the model exposes
    compute: Any = None        # plain Parameter: the chunk view inside a unit
    placeholder: Any = None    # compute.data while not materialized
    grad: Any = None           # the grad ChunkTensor (trainable only)
    mat: int = 0               # active units materializing it
    version: int = 0           # compute._version when materialized (detects in-place writes)
    slots: list = field(default_factory=list)  # (module, attribute name)
    post_hooks: OrderedDict = field(default_factory=OrderedDict)  # a user's post-accumulate hooks
    warned: bool = False
    unit: int = -1             # the first unit computing with it (trace moments)


def _guard(t):
    """torch checks that a saved tensor was not modified in place before the backward uses
    it, but not for tensors that go through saved-tensor hooks: the hooks keep the tensor's
    version counter (shared by its views and aliases; not the tensor nor its storage) and the
    version at save time, and check them themselves (_check)."""
    try:
        c = _C.version_counter(t)
        return c, c.version
    except RuntimeError:  # a tensor without a version counter (inference mode)
        return None, 0


def _check(guard):
    counter, version = guard
    if counter is not None and counter.version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a tensor saved for backward is at version {counter.version}; "
            f"expected version {version} instead (checked by tiermem's saved-tensor hooks, "
            f"as torch checks it without them)")


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


class _Saved:
    """One storage saved for backward by a unit (activations: offload / auto): on the device
    (``storage``), offloaded to host memory (``host``, a byte tensor), spilled to NVMe
    (``spill``, the session's region token) when the host budget has no room, or, auto,
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


def _load_copies(module, state_dict, prefix, local_metadata, *rest):
    """A load_state_dict pre-hook of every module holding managed parameters:
    ``load_state_dict(sd, assign=True)`` copies into the chunks as without ``assign``. Assigned,
    the state dict's tensors would replace the ChunkTensors in the module: the forward would
    compute with them while the optimizer stepped the chunks — silently no training."""
    if any(isinstance(p, ChunkTensor) for p in module._parameters.values()):
        local_metadata["assign_to_params_buffers"] = False


# What a pickled (torch.save(model)) or deep-copied managed module keeps of tiermem: nothing.
# The copy is an ordinary module holding the current values (ChunkTensor.__reduce_ex__); its
# forwards are its own class's, its tiermem hooks no-ops, its `_tiermem_runtime` None.
def _no_state_dict_hook(*args):
    return None


def _no_state_dict_hook_factory():
    return _no_state_dict_hook


def _no_runtime():
    return None


class _StateDictHook:
    """The state_dict post-hook of a module holding managed parameters (runtime held weakly).
    Pickled or deep-copied with the module, it becomes a no-op."""

    def __init__(self, runtime):
        self._rt = weakref.ref(runtime)

    def __call__(self, *args):
        rt = self._rt()
        if rt is not None:
            rt._state_dict_hook(*args)

    def __reduce__(self):
        return (_no_state_dict_hook_factory, ())


def _placeholder(shape, dtype, device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class TiermemRuntime:
    """Owns the session and the hooks of one initialized model."""

    _serving = False  # serve.ServingRuntime: inference only (every parameter frozen)
    _hyper_of_next_step = None  # the optimizer's hyper-parameters (optimizer_overlap backward)
    _in_user_hook = False  # running a user's post-accumulate-grad hook (_run_post_hooks)

    def __init__(self, model: nn.Module, cfg, param_groups, units=None, process_group=None):
        self.model = model
        self.cfg = cfg
        self._closed = True  # until everything is in place
        self.mixed = cfg.precision in _LOW
        self.dtype = _LOW.get(cfg.precision, torch.float32)
        self.fp16 = cfg.precision == "fp16"
        self.strict = cfg.unmaterialized_reads == "error"
        kind = _C.resolve_device_kind(cfg.device_kind)  # RuntimeError: no CUDA device
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device_kind 'cuda': tiermem sees a GPU but torch does not "
                               "(torch.cuda.is_available() is False)")
        if kind != "cuda" and cfg.device_kind == "auto" and torch.cuda.is_available():
            # Never train on the CPU in silence on a GPU machine.
            why = ("this tiermem build has no CUDA support (built without nvcc; reinstall with "
                   "the CUDA toolkit present)" if not _C.cuda_built() else
                   "tiermem's CUDA runtime finds no usable device (driver older than the CUDA "
                   f"{_C.cuda_runtime_version()} runtime tiermem was built with?)")
            raise RuntimeError(f"device_kind 'auto': torch sees a GPU but {why}. Set "
                               "device_kind 'sim' (or TIERMEM_DEVICE=sim) to train on the CPU "
                               "on purpose.")
        self.device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
        self._cuda = kind == "cuda"
        self._stream_handle = None  # the compute stream the session was last told
        self._collect_params(param_groups)
        self.units = find_units(model, units)
        specs = [(r.name, r.numel, r.trainable, r.opt_group, list(r.shape)) for r in self.params]
        # Sharded across the ranks of a torch.distributed job (distributed.py) when a process
        # group of more than one rank is given or initialized.
        from . import distributed
        pg = distributed.process_group_for(process_group)
        if pg is not None and self._serving:
            raise ValueError("tiermem.inference: serving is not sharded across ranks (run one "
                             "model per process, without a process group)")
        self._shards = distributed.Shards(self, pg) if pg is not None else None
        self.s = _C.Session(cfg, specs, self._shards.sharding() if self._shards else None)
        try:
            if self._shards:
                self._shards.check_layout(self.s)
            with torch.no_grad():
                for r in self.params:
                    r.group, r.offset, _ = self.s.place(r.index)
                    v = r.orig.detach().reshape(-1).contiguous()
                    if self._shards:  # every rank starts from rank 0's values (as DDP)
                        v = v.clone()
                        self._shards.broadcast_(v)
                    self.s.write_param(r.index, v)
        except BaseException:
            self.s.close()
            raise
        self._compute_kind = self.s.compute_kind
        self.groups = [self.s.group(g) for g in range(self.s.num_groups)]  # (trainable, used, tensors)
        # Holding a group's grad chunk across its backward saves an acquire per param but pins
        # it: worth it only when every compute and grad chunk fits on the device at once.
        esize = 2 if self.mixed else 4
        per_group = self.s.chunk_elems * esize * 2
        self._hold_grads = (cfg.device_budget >= per_group * len(self.groups)
                            or self._shards is not None)  # sharded: reduce-scatter whole groups
        self._fresh: dict[int, list] = {}  # sharded: group -> params whose grad began this backward
        # Resident training: when every chunk of every kind fits on the device at once (and
        # the device is CPU memory: SimDevice), the compute and grad chunks are pinned there
        # for the whole session — nothing ever moves, no unit acquires, no saved-tensor hooks
        # (saved views of chunk memory stay valid), and the optimizer steps in place.
        # Not with activations counted in the budget: they need the hooks that count them.
        self._resident = (not self._serving and not self.s.cuda and self._shards is None
                          and cfg.activations == "outside"
                          and cfg.device_budget >= self.s.total_chunk_bytes)
        self._device_budget = cfg.device_budget
        # State of the current iteration.
        self._live: dict[int, int] = {}          # device data_ptr -> group (compute chunks)
        self._bwd_hold: dict[int, torch.Tensor] = {}
        self._bwd_pending: dict[int, set] = {}
        self._fwd_used: dict[int, set] = {}
        self._grad_hold: dict[int, torch.Tensor] = {}
        self._grad_pending: dict[int, set] = {}
        self._in_iteration = False
        self._in_backward = False
        self._hook_task, self._hook_parts = None, {}  # _check_one_part: per backward
        self._tracing = True
        self._recording_trace = False  # the session records this iteration's warm-up trace
        self._trace_seen: set = set()  # storages whose saved bytes were counted this iteration
        self._bwd_unit = None          # the unit the backward's current moment belongs to
        # activations: budget — bytes of non-chunk tensors saved for backward, per unit (-1:
        # outside every unit), counted in the device budget (the session's external bytes).
        self._count_act = cfg.activations in ("budget", "offload", "recompute", "auto")
        self._act_units: dict[int, int] = {}
        self._open_graphs = []         # weakrefs to the open iteration's sentinels (_watch_graph)
        self._act_total = 0            # device + host bytes of the activations counted
        self._act_given = 0            # what the session was last told (device)
        self._act_seen: set = set()    # storages counted this iteration
        # activations: offload — a unit's saved storages (_Saved) move to host memory when the
        # device cannot hold them next to the chunks, oldest forward unit first (the last one
        # the backward needs), and come back at that unit's backward moment, the next unit's
        # one moment earlier when there is room. The device keeps `_act_cap` bytes at most:
        # its budget less room for the chunks of two units (a backward holds the current
        # unit's compute and grad chunks while the next one's arrive).
        self._offload_act = cfg.activations in ("offload", "auto")
        # activations: recompute — every unit that contains no other unit keeps only its inputs
        # and recomputes what its forward saved in its backward (recompute.py); auto — the
        # units an executed plan recomputes, the others as 'offload'.
        self._recompute_all = cfg.activations == "recompute"
        self._recompute_planned = cfg.activations == "auto"
        self._rc_frames: dict[int, list] = {}  # unit -> its frames holding recomputed values
        self._rc_inputs: set = set()           # storages kept as recomputed units' inputs
        self._recomputing = None               # the unit being recomputed now
        self._act_saved: dict[int, _Saved] = {}   # device data_ptr -> its _Saved (forward)
        self._act_by_unit: dict[int, list] = {}   # unit -> its _Saved, in save order
        self._act_order: list[int] = []           # units in the order they first saved
        self._act_host = 0                        # tracked bytes offloaded to the host now
        self._act_nvme = 0                        # tracked bytes spilled to NVMe now
        self._act_host_given = 0
        # Spilled to NVMe (the host budget had no room): every _Saved holding a region, freed
        # when it is fetched back or the iteration is reset.
        self._act_spilled: list = []
        self._spill_ok = cfg.nvme_size > 0
        self._spill_bufs: list = []            # host scratch bounces (token, uint8 tensor)
        self._spill_pending = [None, None]     # the copy in flight through each bounce
        self._act_stats = {"offloaded_bytes": 0, "fetched_bytes": 0, "sync_fetches": 0,
                           "recomputed_units": 0, "recomputed_bytes": 0, "dropped_bytes": 0,
                           "spilled_bytes": 0}
        self._active_units: list = []
        self._root_depth = 0
        self._handles: list = []
        self._wrapped: list = []  # modules whose forward we wrapped (undone at close)
        self._closed = False
        self._install()
        most = max((len(u.groups) for u in self.units), default=1)
        self._act_cap = max(0, cfg.device_budget - 2 * most * per_group)
        if self._shards is not None:
            # Full chunks kept after use: the next unit's shared groups and the backward's
            # first unit need no second all-gather. At most a quarter of the device budget.
            full = self.s.chunk_elems * esize
            self._shards.recent_capacity = min(2 * most + 1, cfg.device_budget // (4 * full))
        self._fwd_units: list = []   # units entered by the last training forward, in order
        self._fwd_pos: dict = {}     # unit index -> its position there
        self._fwd_seq: list = []     # this forward's, so far
        # The chunks hold the values now. The user's Parameter objects keep no copy (close()
        # gives them their data back), so the model is not in host RAM twice, and a stale
        # reference to one fails loudly (an empty tensor) instead of reading old values.
        for r in self.params:
            r.orig.data = torch.empty(0, dtype=r.orig.dtype)

    # ---- set-up ---------------------------------------------------------------------------
    def _collect_params(self, param_groups):
        names = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        seen: dict[int, _Param] = {}
        self.params: list[_Param] = []
        for mname, m in self.model.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                r = seen.get(id(p))
                if r is None:
                    name = names.get(id(p), f"{mname}.{pname}")
                    if isinstance(p, ChunkTensor):
                        raise ValueError(f"parameter {name} is already managed by tiermem")
                    if p.dtype != torch.float32:
                        raise ValueError(f"parameter {name} is {p.dtype}; tiermem expects an fp32 "
                                         "model (set 'precision' for bf16/fp16 training)")
                    if p.device.type != "cpu":
                        raise ValueError(f"parameter {name} is on {p.device}; pass a CPU model "
                                         "(tiermem places it)")
                    if p.numel() == 0:
                        raise ValueError(f"parameter {name} has no elements")
                    r = _Param(len(self.params), name, p.shape, p.numel(),
                               p.requires_grad and not self._serving, p)
                    seen[id(p)] = r
                    self.params.append(r)
                r.slots.append((m, pname))
        if not self.params:
            raise ValueError("model has no parameters")
        self.by_orig = {id(r.orig): r for r in self.params}
        defaults = dict(lr=self.cfg.lr, betas=tuple(self.cfg.betas), eps=self.cfg.eps,
                        weight_decay=self.cfg.weight_decay)
        if param_groups is None:  # serving: no optimizer groups (nothing trains)
            param_groups = [] if self._serving else [
                {"params": [r.orig for r in self.params if r.trainable]}]
        self.opt_groups = []
        members = []  # per group: its tensors' indices (-1: not a parameter of the model)
        for gi, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise ValueError(f"param_groups[{gi}] must be a dict with 'params'")
            bad = sorted(set(g) - {"params", "lr", "betas", "eps", "weight_decay"})
            if bad:
                raise ValueError(f"param_groups[{gi}]: unknown key(s) {bad}")
            og = dict(defaults)
            og.update({k: v for k, v in g.items() if k != "params"})
            plist = list(g["params"])
            members.append([self.by_orig[id(p)].index if id(p) in self.by_orig else -1
                            for p in plist])
            og["plist"] = plist
            self.opt_groups.append(og)
        # The session's rule (runtime/param_groups.h): ValueError naming the group and tensor.
        group_of = _C.assign_param_groups([(r.name, r.trainable) for r in self.params], members)
        for r, gi in zip(self.params, group_of):
            r.opt_group = gi
        for og in self.opt_groups:
            og["params"] = [self.by_orig[id(p)] for p in og.pop("plist")]  # _Param records for now

    def _install(self):
        """Takes over the model. Nothing here can fail on valid input."""
        for r in self.params:
            r.param = nn.Parameter(
                ChunkTensor(self, r, "param", r.shape, _contiguous_strides(r.shape), self.dtype,
                            self.device), requires_grad=r.trainable)
            r.compute = nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device),
                                     requires_grad=r.trainable)
            r.placeholder = _placeholder(r.shape, self.dtype, self.device)
            r.compute.data = r.placeholder
            if r.trainable:
                r.grad = ChunkTensor(self, r, "grad", r.shape, _contiguous_strides(r.shape),
                                     self.dtype, self.device)
                self._handles.append(r.compute.register_post_accumulate_grad_hook(
                    self._weak_grad_hook(r, TiermemRuntime._on_compute_grad)))
                with torch._C.DisableTorchFunctionSubclass():  # ours, not a user's (below)
                    self._handles.append(r.param.register_post_accumulate_grad_hook(
                        self._weak_grad_hook(r, TiermemRuntime._on_param_grad)))
            for m, name in r.slots:
                m._parameters[name] = r.param
        self.by_param = {id(r.param): r for r in self.params}
        for og in self.opt_groups:
            og["params"] = [r.param for r in og["params"]]
        # Units: the slots inside each, their groups, and their hooks.
        slot_of = {}
        for r in self.params:
            for m, name in r.slots:
                slot_of.setdefault(id(m), []).append((name, r))
        for index, u in enumerate(self.units):
            u.index = index
            u.bwd_label = f"{u.name or type(u.module).__name__}:pre-backward"
            seen, params = set(), []
            for _, m in unit_modules(u):
                for name, r in slot_of.get(id(m), ()):
                    u.slots.append((m, name, r))
                    if r.index not in seen:
                        seen.add(r.index)
                        params.append(r)
            u.params = params
            for r in params:
                if r.unit < 0:
                    r.unit = index  # the first unit that computes with it
            u.groups = sorted({r.group for r in params})
            u.depth = 0
            u.pins = []
            u.placed = []  # the slots this call put compute views in (_place)
            u.pushed = []
            u.frame = None  # the current call's Frame (recompute.py), if it has one
            u.frame_drops = False  # auto: its saves are kept/offloaded unless the host is full
            _wrap_forward(u.module, self._unit_enter(u), self._unit_exit(u), self._wrapped,
                          cls=_UnitForward)
            u.inner = u.module.__dict__["forward"].inner  # the forward a recompute runs again
        self._wrap_root()
        # state_dict of any module gives plain tensors; load_state_dict copies into the chunks.
        for m in {id(m): m for r in self.params for m, _ in r.slots}.values():
            self._handles.append(m.register_state_dict_post_hook(_StateDictHook(self)))
            self._handles.append(m.register_load_state_dict_pre_hook(_load_copies))
        if self._resident:
            self._pin_resident()
        # Buffers stay ordinary tensors, on the compute device and (like module.to(dtype))
        # in the compute dtype when floating point.
        if self.device.type != "cpu" or self.mixed:
            for m in self.model.modules():
                for k, b in m._buffers.items():
                    if b is not None:
                        dt = self.dtype if b.is_floating_point() else b.dtype
                        m._buffers[k] = b.to(device=self.device, dtype=dt)

    def _pin_resident(self):
        self._resident_pins = []
        for g in range(self.s.num_groups):
            base = self._acquire(g, self._compute_kind)
            self._resident_pins.append((g, self._compute_kind))
            for i in self.groups[g][2]:
                r = self.params[i]
                r.compute.data = self._slice(base, r)  # for good: units only swap slots
            if self.groups[g][0]:
                self._on_stream()
                self._grad_hold[g] = self.s.acquire_for_write(g, _K.grad, _DEVICE)
                self._resident_pins.append((g, _K.grad))

    # ---- chunk access --------------------------------------------------------------------
    def _wrap_root(self):
        # The root's forward: to tell "inside the model's forward" from "outside" in messages,
        # and to see its output (_root_exit).
        _wrap_forward(self.model, self._root_enter, self._root_exit, self._wrapped,
                      cls=_RootForward)

    def _traced(self) -> bool:
        """Whether acquires now are part of the order the engine records and follows:
        training forwards and backward, not eval / no_grad forwards."""
        return self._in_backward or torch.is_grad_enabled()

    def _set_tracing(self, on: bool):
        if on != self._tracing:
            self.s.set_tracing(on)
            self._tracing = on

    def _on_stream(self):
        """CUDA: the session orders its copies and kernels with the stream torch queues work on
        now (tiers/tier.h, "Ordering against compute"): releases record their use on it,
        prefetches it reads are waited for on it. Checked at every chunk access, since the
        backward (autograd's device thread) and user code may change the current stream."""
        if self._cuda:
            h = torch.cuda.current_stream(self.device).cuda_stream
            if h != self._stream_handle:
                self.s.set_compute_stream(h)
                self._stream_handle = h

    def _acquire(self, group: int, kind, tier=_DEVICE) -> torch.Tensor:
        self._set_tracing(self._traced())
        self._on_stream()
        if self._shards is not None and tier == _DEVICE:
            base = self._shards.gather(group, kind)  # the full chunk, from every rank's shard
            if kind == self._compute_kind:
                self._live[base.data_ptr()] = group
            return base
        base = self.s.acquire(group, kind, tier)
        if tier == _DEVICE and kind == self._compute_kind:
            self._live[base.data_ptr()] = group
        return base

    def _release(self, group: int, kind, modified: bool, base: torch.Tensor | None = None):
        self._on_stream()
        if self._shards is not None and self._shards.held(group, kind) is not None:
            ptr = self._shards.held(group, kind).data_ptr()
            if self._shards.release(group, kind, modified) and self._live.get(ptr) == group:
                del self._live[ptr]
            return
        self.s.release(group, kind, modified)
        if base is not None and kind == self._compute_kind and \
                self.s.pins(group, kind) == 0 and self._live.get(base.data_ptr()) == group:
            del self._live[base.data_ptr()]

    def _slice(self, base, r: _Param):
        return base[r.offset:r.offset + r.numel].view(r.shape)

    # ---- units -----------------------------------------------------------------------------
    def _root_enter(self):
        if self._root_depth == 0:
            self._refuse_ddp()
        self._root_depth += 1

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

    def _follow_requires_grad(self, r: _Param, want: bool):
        """Called by ``ChunkTensor.__torch_function__`` before the user's ``requires_grad_``
        or ``requires_grad = flag`` on parameter `r` takes effect. A forward computes with
        each unit's compute view, not with the parameter the user sees: a parameter frozen
        after initialize must freeze its view too, or it would still get a gradient and the
        optimizer would update it. One frozen at initialize has no gradient chunk nor
        optimizer state: unfreezing it is an error, raised before anything changes."""
        if want and not r.trainable and self._serving:
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

    def _root_exit(self, out=None):
        self._root_depth -= 1
        if self._root_depth == 0 and self._in_iteration and not self._in_backward:
            self._watch_graph(out)
            if self._count_act:
                # The whole forward's activations hold their room before the backward starts
                # (a MemoryError here leaves nothing pinned; the backward then only gives room
                # back).
                self._act_sync()

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

    def _unit_enter(self, u):
        label = f"{u.name or type(u.module).__name__}:pre-forward"

        def hook(args, kwargs):
            if self._closed or self._recomputing is not None:
                return None  # a recompute runs the unit's own forward, not these hooks
            grad = torch.is_grad_enabled()
            if grad and self._recompute_all and u.depth == 0 and self._recomputable(u) \
                    and not self._resident:
                cache = kv_cache_in(args, kwargs)
                if cache is not None:
                    raise ValueError(
                        f"tiermem: unit {label.split(':')[0]!r} was called with a "
                        f"{type(cache).__name__} (a KV cache its forward updates in place) "
                        f"while training with activations 'recompute', which runs the forward "
                        f"again in the backward and would update the cache twice. Pass "
                        f"use_cache=False when training (as Hugging Face does for gradient "
                        f"checkpointing), or use activations 'offload'; the model is unchanged.")
            if grad and self._in_iteration and not self._in_backward \
                    and self._open_graphs_dropped():
                self._act_abandon()  # _watch_graph: the open iteration's graphs are gone
            if grad and not self._in_iteration:
                self._act_reset()
                if self._shards is not None and self._fwd_seq:
                    self._fwd_units, self._fwd_seq = self._fwd_seq, []
                    self._fwd_pos = {u: i for i, u in enumerate(self._fwd_units)}
                self.s.begin_iteration()
                if self._hyper_of_next_step is not None:
                    # What step() will pass, unless the user changes it before (then the
                    # speculative updates are dropped at step(): session.h).
                    self.s.set_step_hyper(self._hyper_of_next_step())
                self._recording_trace = self.s.recording_trace
                self._trace_seen.clear()
                self._in_iteration = True
                self.s.phase("forward")
            u.depth += 1
            if u.depth == 1 and self._resident:
                for r in u.params:
                    r.mat += 1
                u.placed = self._place(u)
            elif u.depth == 1:
                self._set_tracing(self._traced())  # before the moment: eval isn't traced
                if self.s.pending_steps:
                    # The last step's deferred updates of this unit's groups (and, sharded, of
                    # the next unit's, which it prefetches), each its own optimizer moment,
                    # before the unit's (session.h, "deferred steps").
                    groups = list(u.groups)
                    if self._shards is not None and grad:
                        i = self._fwd_pos.get(u.index)
                        if i is not None and i + 1 < len(self._fwd_units):
                            groups += self.units[self._fwd_units[i + 1]].groups
                    self._on_stream()  # device-placed updates queue on torch's stream
                    self.s.finish_steps(groups)
                self.s.moment(label, 0, u.index)
                pins = []
                try:
                    if self._count_act and self._in_iteration:
                        # The activations saved so far take their room now, after this
                        # moment's planned evictions (a plan frees the room it foresaw).
                        self._act_sync()
                    views = {}
                    for g in u.groups:
                        views[g] = self._acquire(g, self._compute_kind)
                        pins.append((g, views[g]))
                except BaseException as e:
                    for g, b in pins:
                        self._release(g, self._compute_kind, False, b)
                    u.depth -= 1
                    held = self._act_given
                    if self._count_act:  # the device room went to activations: abandon it
                        self._act_abandon()
                    if isinstance(e, MemoryError) and held:
                        hint = ("'offload' moves them to the host" if not self._offload_act
                                else "the host has them all but the running units'")
                        raise MemoryError(
                            f"tiermem: the chunks of unit {label.split(':')[0]!r} do not fit "
                            f"the device budget next to the {held} bytes of activations "
                            f"saved for backward so far ({hint}): {e}. Use a larger device "
                            f"budget or a smaller batch; the model is unchanged.") from None
                    raise
                u.pins = pins
                if self._shards is not None and grad:
                    self._fwd_seq.append(u.index)
                    self._prefetch_after(u.index, +1)  # the next unit's chunks, meanwhile
                self._materialize(u, views)
                u.placed = self._place(u)
                if grad:
                    for _, _, r in u.placed:
                        if r.trainable:
                            self._fwd_used.setdefault(r.group, set()).add(r.index)
            self._active_units.append(u)
            pushed = grad and not self._resident
            if pushed:
                if u.depth == 1:
                    u.frame, u.frame_drops = self._recompute_frame(u, args, kwargs)
                if u.frame is not None and u.frame_drops:  # kept or offloaded, or dropped
                    pack = functools.partial(self._droppable_pack, u.frame)
                    torch._C._autograd._push_saved_tensors_default_hooks(pack, self._unpack)
                elif u.frame is not None:  # the unit's saves are recomputed in its backward
                    pack = functools.partial(self._recompute_pack, u.frame)
                    torch._C._autograd._push_saved_tensors_default_hooks(pack, self._rc_unpack)
                else:
                    torch._C._autograd._push_saved_tensors_default_hooks(self._pack,
                                                                         self._unpack)
            u.pushed.append(pushed)
            return None
        return hook

    def _materialize(self, u, views):
        """`u`'s parameters become views of their chunks (`views`: group -> the acquired
        chunk) for the module's forward; `mat` counts the units holding each one so. The
        caller then puts them in the unit's slots (_place)."""
        for r in u.params:
            if r.mat == 0:
                r.compute.data = self._slice(views[r.group], r)
                r.version = r.compute._version
            r.mat += 1

    @staticmethod
    def _place(u) -> list:
        """Puts `u`'s compute views in the slots that hold the managed parameter and returns
        those slots (the caller gives them back their parameter). A slot holding anything else
        was swapped by the caller — torch.func.functional_call, torch.nn.utils.stateless —
        and keeps the caller's tensor, as on the plain model: the forward computes with it."""
        placed = [(m, name, r) for m, name, r in u.slots if m._parameters.get(name) is r.param]
        for m, name, r in placed:
            m._parameters[name] = r.compute
        return placed

    def _unmaterialize(self, u) -> set:
        """Undoes _materialize for `u`'s parameters (the caller restores its slots); returns
        the groups of the parameters written in place meanwhile (their master synced)."""
        modified = set()
        for r in u.params:
            r.mat -= 1
            if r.mat == 0:
                if r.compute._version != r.version:  # written in place inside the forward
                    modified.add(r.group)
                    if self.mixed:
                        self._sync_master(r, (), r.compute.data, None)
                r.compute.data = r.placeholder
        return modified

    def _unit_exit(self, u):
        def hook(out=None):
            if self._closed or not u.pushed or self._recomputing is not None:
                return None
            if u.pushed.pop():
                torch._C._autograd._pop_saved_tensors_default_hooks()
            self._active_units.pop()
            u.depth -= 1
            if u.depth > 0:
                return None
            if out is not None and self._root_depth == 0 and not self._active_units \
                    and self._in_iteration and not self._in_backward:
                # A unit called on its own, outside the model's forward (features of one
                # block): its graph is watched as the root's is (_watch_graph), or the
                # activations of calls whose outputs were dropped would stay counted.
                self._watch_graph(out)
            for m, name, r in u.placed:
                m._parameters[name] = r.param
            u.placed = []
            if self._resident:
                for r in u.params:
                    r.mat -= 1
                return None
            modified = self._unmaterialize(u)
            for g, b in u.pins:
                self._release(g, self._compute_kind, g in modified, b)
            u.pins = []
            frame, u.frame = u.frame, None
            if frame is not None and u.frame_drops and modified:
                # A recompute would write the parameters again: its saves are never dropped.
                for h in frame.handles:
                    h.free_refs += 1
            elif frame is not None and modified:
                # Its recompute would write them a second time: refuse before the backward.
                self._act_abandon()
                raise RuntimeError(
                    f"tiermem: the forward of unit {frame.name()!r} writes its parameters in "
                    f"place, so it cannot be recomputed in the backward (activations: "
                    f"'recompute' would apply the write twice); use activations 'offload' or "
                    f"'budget'")
            return None
        return hook

    # ---- activations in the device budget (activations: budget) ---------------------------
    def _act_sync(self):
        if self._offload_act:
            self._act_make_room()
        while True:
            device = self._act_total - self._act_host - self._act_nvme
            if device == self._act_given:
                return
            try:
                self.s.set_external_device_bytes(device)
                break
            except MemoryError as e:
                # The chunks in use need more room than `_act_cap` foresaw (or a plan kept
                # more): offload one more unit if there is one the backward needs later.
                if self._offload_act and self._act_offload_oldest():
                    continue
                self._act_abandon()
                how = ("the activations of the units running now and those outside every unit "
                       "stay there (activations: 'offload')" if self._offload_act else
                       "activations: 'recompute' keeps the units' inputs, the activations "
                       "outside every unit and, in the backward, one unit's recomputed ones"
                       if self._recompute_all else
                       "activations: 'budget' counts them in it; 'offload' moves them to the "
                       "host")
                raise MemoryError(
                    f"tiermem: the activations saved for backward ({device} bytes on the "
                    f"device) do not fit the device budget next to the chunks in use ({how}): "
                    f"{e}. Use a larger device budget or a smaller batch; the model is "
                    f"unchanged.") from None
        self._act_given = device

    def _act_abandon(self):
        """The iteration is abandoned (the caller's forward raises): nothing of it stays."""
        self._act_reset()
        self._in_iteration = False
        self._fwd_used.clear()

    def _act_reset(self):
        self._open_graphs.clear()
        for frames in self._rc_frames.values():
            self._rc_drop(frames)
        self._rc_frames.clear()
        self._rc_inputs.clear()
        self._act_units.clear()
        self._act_seen.clear()
        self._act_total = 0
        self._act_saved.clear()
        self._act_by_unit.clear()
        self._act_order.clear()
        self._act_host = 0
        self._act_nvme = 0
        self._spill_free_all()
        if self._count_act and self._act_given:
            self.s.set_external_device_bytes(0)
            self._act_given = 0
        if self._act_host_given:
            self.s.set_external_host_bytes(0)
            self._act_host_given = 0

    def _act_done(self, unit):
        """The backward moved past `unit`: its saved activations are freed."""
        self._rc_drop(self._rc_frames.pop(unit, ()))
        n = self._act_units.pop(unit, 0)
        for h in self._act_by_unit.pop(unit, ()):
            # Autograd may still hold it (a node of a later unit that saved the same storage);
            # it stays usable, but no longer counts.
            h.tracked = False
            if h.host is not None:
                self._act_host -= h.nbytes
            elif h.spill is not None:
                self._act_nvme -= h.nbytes
        if n:
            self._act_total -= n
            self._act_sync()

    # ---- activation offload (activations: offload) ----------------------------------------
    def _act_make_room(self):
        """Fetches what an executed plan fetches now; offloads the units the plan offloads
        (once their forward is done), then whole units, oldest forward unit first, until the
        device's activation bytes fit `_act_cap`."""
        for unit in self.s.take_activation_fetches():
            # Like a planned chunk prefetch: into free room only (the backward moment of the
            # unit fetches whatever is still on the host).
            self._act_fetch(unit, only_if_room=True)
        if not self._in_backward and self.s.plan_followed:
            active = {u.index for u in self._active_units}
            for unit in self._act_order:
                if unit not in active and self.s.plan_offloads_unit(unit):
                    self._act_offload(unit)
        while self._act_total - self._act_host - self._act_nvme > self._act_cap \
                and self._act_offload_oldest():
            pass

    def _act_offload_oldest(self) -> bool:
        """Offloads the oldest forward unit still on the device that may go: not running
        (forward), not reached yet (backward: its activations are needed later than the
        current unit's). False when there is none."""
        active = {u.index for u in self._active_units}
        for unit in self._act_order:
            if self._in_backward and unit == self._bwd_unit:
                return False  # this and every later forward unit is needed now or was used
            if unit in active:
                continue
            if any(self._offloadable(h) for h in self._act_by_unit.get(unit, ())):
                self._act_offload(unit)
                return True
        return False

    def _act_offload(self, unit):
        todo = [h for h in self._act_by_unit.get(unit, ()) if self._offloadable(h)]
        n = sum(h.nbytes for h in todo)
        if not n:
            return
        host = self._act_host + n
        try:
            self.s.set_external_host_bytes(host)  # room first (evicts host caches)
        except MemoryError as e:
            if self._recompute_planned and all(h.free_refs == 0 for h in todo):
                self._act_drop(unit, todo, n)  # auto: recomputed in the backward instead
                return
            if self._spill_ok:
                self._act_spill(unit, todo, n, e)  # to NVMe, through a host bounce
                return
            self._act_abandon()
            raise MemoryError(
                f"tiermem: offloading the activations of unit {self.units[unit].name!r} "
                f"({n} bytes) does not fit the host budget: {e}. Use a larger host budget, an "
                f"NVMe tier (config 'nvme': spilled there) or a smaller batch; the model is "
                f"unchanged.") from None
        self._act_host_given = host
        cuda = self.device.type == "cuda"
        for h in todo:
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(h.storage)
            h.host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=cuda)
            h.host.copy_(src, non_blocking=cuda)
            self._act_leave_device(h)
        self._act_host = host
        self._act_stats["offloaded_bytes"] += n

    def _act_leave_device(self, h):
        """`h`'s bytes are elsewhere now (host, NVMe) or dropped: its device storage is
        forgotten."""
        ptr = h.storage.data_ptr()
        self._act_saved.pop(ptr, None)
        self._act_seen.discard(ptr)
        h.storage = None  # the device memory goes when autograd's views of it do

    def _act_drop(self, unit, todo, n):
        """auto: the host has no room for `unit`'s activations either: they are dropped and
        each ref to them recomputes from its frame when the backward unpacks it."""
        for h in todo:
            self._act_leave_device(h)
            h.dropped, h.tracked = True, False
        self._act_units[unit] = self._act_units.get(unit, 0) - n
        self._act_total -= n
        self._act_stats["dropped_bytes"] += n

    # ---- activations spilled to NVMe (offload / auto, the host budget short) ------------------
    def _act_spill(self, unit, todo, n, host_error):
        """The host budget has no room for `unit`'s activations: they go to NVMe regions (the
        NVMe budget), copied through two host scratch bounces (the host budget) with the
        device->bounce copy of one piece overlapping the NVMe write of the other. The writes
        may still be in flight when this returns (_spill_drain waits for them). Every region
        is allocated before anything moves, so a full NVMe tier leaves everything as it
        was."""
        regions = []
        try:
            for h in todo:
                regions.append(self.s.allocate_spill(h.nbytes))
        except MemoryError as e:
            for r in regions:
                self.s.free_spill(r)
            self._act_abandon()
            raise MemoryError(
                f"tiermem: offloading the activations of unit {self._unit_name(unit)!r} "
                f"({n} bytes) fits neither the host budget ({host_error}) nor the NVMe tier "
                f"({e}). Use a larger host or NVMe budget or a smaller batch; the model is "
                f"unchanged.") from None
        try:
            piece = 0
            for h, region in zip(todo, regions):
                src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(h.storage)
                for lo in range(0, h.nbytes, self._spill_piece()):
                    token, buf = self._spill_buffer(piece)  # its last write is done
                    k = min(buf.numel(), h.nbytes - lo)
                    buf[:k].copy_(src[lo:lo + k])  # synchronous (D2H waits for the kernels)
                    self._spill_pending[piece % 2] = self.s.start_spill_copy(
                        region, lo, token, 0, k, True)
                    piece += 1
        except BaseException:
            self._spill_drain(quiet=True)  # no copy may be in flight into a freed region
            for r in regions:
                self.s.free_spill(r)
            self._act_abandon()
            raise
        for h, region in zip(todo, regions):
            self._act_leave_device(h)
            h.spill = region
            self._act_spilled.append(h)
        self._act_nvme += n
        self._act_stats["offloaded_bytes"] += n
        self._act_stats["spilled_bytes"] += n

    def _spill_read(self, h, dev):
        """Reads `h`'s region into `dev` (the NVMe read of one piece overlapping the copy of
        the other to the device) and frees the region."""
        self._spill_drain(release=False)  # the writes first (this region's among them)
        step = self._spill_piece()
        los = list(range(0, h.nbytes, step))

        def start(i):
            token, buf = self._spill_buffer(i)
            k = min(buf.numel(), h.nbytes - los[i])
            self._spill_pending[i % 2] = self.s.start_spill_copy(h.spill, los[i], token, 0, k,
                                                                 False)
        start(0)
        for i, lo in enumerate(los):
            if i + 1 < len(los):
                start(i + 1)
            pending, self._spill_pending[i % 2] = self._spill_pending[i % 2], None
            self._spill_wait(pending)
            k = min(step, h.nbytes - lo)
            dev[lo:lo + k].copy_(self._spill_bufs[i % 2][1][:k])  # synchronous
        self.s.free_spill(h.spill)
        h.spill = None
        self._act_spilled.remove(h)
        if not self._act_spilled:
            self._spill_drain()  # and the bounces go back to the host budget

    def _spill_piece(self) -> int:
        # At most 4 MiB (a few of the NVMe tier's I/Os) and one fp32 chunk (the host reserve
        # keeps that much of the host budget for caches, which scratch evicts).
        return min(4 << 20, self.s.chunk_elems * 4) // 4096 * 4096 or 4096

    def _spill_buffer(self, i):
        """Bounce i % 2 as (token, uint8 tensor), allocated on first use (host scratch), once
        its previous copy is done."""
        j = i % 2
        pending = self._spill_pending[j]
        if pending is not None:
            self._spill_pending[j] = None
            self._spill_wait(pending)
        while len(self._spill_bufs) <= j:
            piece = self._spill_piece()
            try:
                self._spill_bufs.append(self.s.allocate_scratch(_HOST, piece))
            except MemoryError as e:
                raise MemoryError(
                    f"tiermem: activations spilled to NVMe go through two bounces of {piece} "
                    f"bytes of host memory, and the host budget has no room for them: {e}. Use "
                    f"a larger host budget; the model is unchanged.") from None
        return self._spill_bufs[j]

    def _spill_wait(self, pending):
        try:
            pending.wait()
        except (OSError, RuntimeError) as e:  # the I/O error's type (OSError) is kept
            raise type(e)(f"tiermem: an activation spill to or from NVMe failed: {e}") from None

    def _spill_drain(self, quiet=False, release=True):
        """Waits for the spill copies in flight and (`release`) gives the bounces back."""
        err = None
        for j, pending in enumerate(self._spill_pending):
            self._spill_pending[j] = None
            if pending is not None:
                try:
                    self._spill_wait(pending)
                except (OSError, RuntimeError) as e:
                    err = err or e
        if release:
            if not self.s.closed:
                for token, _ in self._spill_bufs:
                    self.s.free_scratch(_HOST, token)
            self._spill_bufs.clear()
        if err is not None and not quiet:
            raise err

    def _spill_free_all(self):
        self._spill_drain(quiet=True)  # the iteration is over or abandoned: its spills go
        for h in self._act_spilled:
            if not self.s.closed:
                self.s.free_spill(h.spill)
            h.spill = None
        self._act_spilled.clear()

    def _unit_name(self, unit) -> str:
        if 0 <= unit < len(self.units):
            u = self.units[unit]
            return u.name or type(u.module).__name__
        return "(outside every unit)"

    def _offloadable(self, h) -> bool:
        # Not a storage a recomputed unit keeps as its input: that one stays on the device.
        return h.storage is not None and h.tracked and h.storage.data_ptr() not in self._rc_inputs

    def _act_fetch(self, unit, only_if_room=False):
        todo = [h for h in self._act_by_unit.get(unit, ())
                if h.host is not None or h.spill is not None]
        n = sum(h.nbytes for h in todo)
        if only_if_room and self._act_total - self._act_host - self._act_nvme + n > self._act_cap:
            return
        for h in todo:
            self._act_fetch_one(h)

    def _act_fetch_one(self, h):
        cuda = self.device.type == "cuda"
        dev = torch.empty(h.nbytes, dtype=torch.uint8, device=self.device)
        if h.spill is not None:
            self._spill_read(h, dev)
            if h.tracked:
                self._act_nvme -= h.nbytes
        elif h.host is not None:
            dev.copy_(h.host, non_blocking=cuda)
            h.host = None
            if h.tracked:
                self._act_host -= h.nbytes
        else:
            raise RuntimeError(
                f"tiermem: an activation saved by unit {self._unit_name(h.unit)!r} was spilled "
                f"to NVMe and freed when a new iteration began; a backward through a graph of "
                f"an earlier iteration cannot read it (use activations 'budget' or 'outside' "
                f"for such graphs)")
        h.storage = dev.untyped_storage()
        self._act_stats["fetched_bytes"] += h.nbytes

    def _act_unpack(self, ref):
        # Like a saved chunk view: the backward reached the unit that saved it (whose
        # activations that moment fetches, and the next unit's when there is room).
        _check(ref.guard)
        self._begin_backward()
        self._bwd_moment(ref.unit)
        h = ref.saved
        if h.dropped:  # auto: the host had no room for it either: recomputed
            frame = ref.frame
            if frame.values is None:
                self._recompute(frame)
            return frame.values[ref.index]
        if h.storage is None:  # not fetched ahead: fetch it now (a stall)
            self._act_stats["sync_fetches"] += 1
            self._act_fetch_one(h)
            if h.tracked:
                self._act_sync()
        return torch.empty(0, dtype=ref.dtype, device=self.device).set_(
            h.storage, ref.offset, ref.size, ref.stride)

    # ---- recomputed activations (activations: recompute / auto; recompute.py) --------------
    def _recomputable(self, u) -> bool:
        # A unit holding other units would recompute them (their hooks, their moments) too.
        return not u.direct_only

    def _is_chunk_memory(self, t) -> bool:
        if isinstance(t, ChunkTensor) or t.layout != torch.strided:
            return True
        try:
            return t.untyped_storage().data_ptr() in self._live
        except (RuntimeError, NotImplementedError):
            return True

    def _recompute_frame(self, u, args, kwargs):
        """(Frame, drops) for this outermost training call of `u`: a Frame that recomputes
        every save (drops False: recompute, or the plan's choice under auto), or under auto one
        that keeps what it saves as 'offload' does and can recompute what the host budget
        leaves no room for (drops True); (None, False): no frame. A frame's inputs are kept
        until the unit's backward, counted as the unit's activations."""
        if not self._in_iteration or not self._recomputable(u):
            return None, False
        if len(u.placed) < len(u.slots):
            # The caller swapped some of its parameters for this call (_place) and swaps
            # them back before the backward: a recompute would run with the wrong ones, so
            # this call's saves are kept (or offloaded) instead.
            return None, False
        drops = False
        if self._recompute_planned:
            if kv_cache_in(args, kwargs) is not None:
                return None, False  # never recomputed: kept or offloaded as 'offload' does
            drops = not (self.s.plan_followed and self.s.plan_recomputes_unit(u.index))
        elif not self._recompute_all:
            return None, False
        frame = Frame(u, u.inner, args, kwargs, self.device, self._is_chunk_memory)
        for t, _ in frame.inputs:
            if t.device != self.device:
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            self._rc_inputs.add(ptr)
            frame.input_ptrs.add(ptr)
            if self._count_saved(u.index, ptr, st.nbytes()):  # else saved by an earlier unit
                self._trace_saved(ptr, st.nbytes())
        return frame, drops

    def _droppable_pack(self, frame, t: torch.Tensor):
        """auto, a unit the plan does not recompute: saved as 'offload' saves it, and the ref
        knows its position in the frame's saves, so it can be recomputed if dropped."""
        if not self._is_chunk_memory(t) and frame.holds_input(t):
            frame.n += 1
            return _Plain(t)  # an input: held by the frame anyway
        ref = self._pack(t)
        if isinstance(ref, _ActRef):
            ref.frame, ref.index = frame, frame.n
            frame.meta[frame.n] = (tuple(t.shape), t.dtype, t.device)
            ref.saved.free_refs -= 1  # _pack counted it as a ref without a frame
            frame.handles.append(ref.saved)
        frame.n += 1
        return ref

    def _recompute_pack(self, frame, t: torch.Tensor):
        if self._is_chunk_memory(t):
            frame.n += 1  # its position, kept by the recompute's saves
            return self._pack(t)  # a chunk view: re-acquired in the backward, not recomputed
        if frame.holds_input(t):
            frame.n += 1
            return _Plain(t)  # (a view of) an input: held anyway, nothing to recompute
        if self._recompute_planned:
            # What the unit saves, as if kept: the planner chooses its policy from it.
            st = t.untyped_storage()
            self._trace_saved(st.data_ptr(), st.nbytes())
        return frame.record(t)

    def _rc_unpack(self, ref):
        if not isinstance(ref, _RecomputeRef):
            return self._unpack(ref)
        frame = ref.frame
        self._begin_backward()
        self._bwd_moment(frame.unit.index)  # frees the previous unit's activations first
        if frame.values is None:
            self._recompute(frame)
        return frame.values[ref.index]

    def _recompute(self, frame):
        """Runs the unit's forward again with its chunks on the device (held as the
        backward's own, _bwd_base) and keeps what it saves, counted in the device budget until
        the backward leaves the unit."""
        u = frame.unit
        frame.check_inputs()
        self._materialize(u, {g: self._bwd_base(g) for g in u.groups})
        placed = self._place(u)
        saved = []

        def capture(t):
            # Detached (same storage and version counter): the recompute's graph holds this
            # hook, so a tensor with that graph's grad_fn here would make a reference cycle
            # through autograd that Python's collector cannot see (a leak per recompute).
            d = t.detach()
            saved.append((d, _guard(d)))
            return None

        self._recomputing = u
        self.s.phase("recompute")
        try:
            frame.run(capture)
        finally:
            self._recomputing = None
            self.s.phase("backward")
            for m, name, r in placed:
                m._parameters[name] = r.param
            self._unmaterialize(u)  # (its forward cannot write them: refused after the first)
        frame.take(saved, _check)
        n = 0
        for t in frame.values.values():
            if t.device != self.device or self._is_chunk_memory(t):
                continue
            st = t.untyped_storage()
            if self._count_saved(u.index, st.data_ptr(), st.nbytes()):  # else an input, or
                frame.counted.add(st.data_ptr())                        # counted already
                n += st.nbytes()
        self._rc_frames.setdefault(u.index, []).append(frame)
        self._act_stats["recomputed_units"] += 1
        self._act_stats["recomputed_bytes"] += n
        self._act_sync()

    def _rc_drop(self, frames):
        """The backward left the frames' unit: their recomputed tensors are no longer held
        (autograd keeps those it unpacked until their nodes run) nor counted."""
        for frame in frames:
            frame.values = None
            self._act_seen -= frame.counted
            frame.counted = set()

    # ---- saved tensors -----------------------------------------------------------------
    def _count_saved(self, unit, ptr, nbytes) -> bool:
        """Counts storage `ptr` once per iteration as `unit`'s activation bytes. False: it
        was counted already."""
        if ptr in self._act_seen:
            return False
        self._act_seen.add(ptr)
        self._act_units[unit] = self._act_units.get(unit, 0) + nbytes
        self._act_total += nbytes
        return True

    def _trace_saved(self, ptr, nbytes):
        """While recording: storage `ptr`'s bytes, once, as the current unit's saved bytes."""
        if self._recording_trace and ptr not in self._trace_seen:
            self._trace_seen.add(ptr)
            self.s.add_saved_bytes(nbytes)

    def _bwd_base(self, group):
        """The compute chunk of `group` held for the backward (acquired on first use; released
        when its gradients are in or the backward moves to a unit that does not use it)."""
        base = self._bwd_hold.get(group)
        if base is None:
            base = self._acquire(group, self._compute_kind)
            self._bwd_hold[group] = base
            self._bwd_pending[group] = set(self._fwd_used.get(group, ()))
        return base

    def _pack(self, t: torch.Tensor):
        if isinstance(t, ChunkTensor):
            return t  # a parameter: a leaf, no node to make a cycle with
        if t.layout != torch.strided:
            return t.detach()  # as _Plain: never the saving node's own output
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t.detach()
        g = self._live.get(ptr)
        if g is None and self._offload_act and self._active_units and t.device == self.device:
            unit = self._active_units[-1].index
            h = self._act_saved.get(ptr)
            if h is None and ptr not in self._act_seen:
                h = _Saved(unit, t.untyped_storage())
                self._act_saved[ptr] = h
                self._count_saved(unit, ptr, h.nbytes)
                if unit not in self._act_by_unit:
                    self._act_order.append(unit)
                self._act_by_unit.setdefault(unit, []).append(h)
                self._trace_saved(ptr, h.nbytes)
            if h is not None:
                h.free_refs += 1
                return _ActRef(h, t, unit)
            return _Plain(t)  # counted already, outside every unit: it stays
        if g is None:
            n = t.untyped_storage().nbytes()
            if self._count_act:
                self._count_saved(self._active_units[-1].index if self._active_units else -1,
                                  ptr, n)
            self._trace_saved(ptr, n)  # saved by the current unit: its bytes in the trace
            return _Plain(t)
        unit = self._active_units[-1].index if self._active_units else -1
        return _ChunkRef(g, t.storage_offset(), tuple(t.size()), tuple(t.stride()), unit,
                         _guard(t))

    def _unpack(self, ref):
        if isinstance(ref, _Plain):
            _check(ref.guard)
            return ref.t
        if not isinstance(ref, _ChunkRef):
            return self._act_unpack(ref) if isinstance(ref, _ActRef) else ref
        _check(ref.guard)
        self._begin_backward()
        self._bwd_moment(ref.unit)
        return self._bwd_base(ref.group).as_strided(ref.size, ref.stride, ref.offset)

    def _begin_backward(self):
        if not self._in_backward:
            self._in_backward = True
            self.s.phase("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        for g, base in list(self._bwd_hold.items()):
            self._release(g, self._compute_kind, False, base)
        self._bwd_hold.clear()
        self._bwd_pending.clear()
        for g in list(self._grad_hold):
            self._release_grad(g)
        self._grad_pending.clear()
        self._fwd_used.clear()
        self._bwd_unit = None
        self._in_backward = False
        self._in_iteration = False
        if self._count_act:
            self._act_reset()

    # ---- gradients -----------------------------------------------------------------------
    def _release_grad(self, group: int):
        if self._resident:
            return  # pinned for the whole session
        del self._grad_hold[group]
        self._grad_pending.pop(group, None)
        self._on_stream()
        if self._shards is not None:  # the group's full gradient, reduce-scattered into shards
            self._shards.scatter_grad(group, self._fresh.pop(group, ()))
            return
        self.s.release(group, _K.grad, True)

    def _grad_chunk(self, r: _Param) -> torch.Tensor:
        base = self._grad_hold.get(r.group)
        if base is None:
            tensors = self.groups[r.group][2]
            if all(self.params[i].param.grad is None for i in tensors):
                self.s.zero_chunk(r.group, _K.grad)  # nothing to keep: no fetch, a memset
            self._set_tracing(True)
            self._on_stream()
            if self._shards is not None:
                base = self._shards.grad_buffer(r.group)
            else:
                base = self.s.acquire_for_write(r.group, _K.grad, _DEVICE)
            self._grad_hold[r.group] = base
            self._grad_pending[r.group] = set(self._fwd_used.get(r.group, ()))
        return base

    def _accumulate(self, r: _Param, g: torch.Tensor, prev):
        """Adds `g` to r's gradient with torch's semantics (prev None: g becomes the grad)."""
        base = self._grad_chunk(r)
        dst = base[r.offset:r.offset + r.numel]
        if self._shards is not None and prev is not r.grad:
            self._fresh.setdefault(r.group, []).append(r)  # its shard span restarts from 0
        with torch.no_grad():
            if prev is None:
                dst.copy_(g.reshape(-1))
            elif prev is r.grad:
                dst.add_(g.reshape(-1))
            else:  # a plain tensor the user assigned to p.grad: keep its value too
                dst.copy_(prev.reshape(-1))
                dst.add_(g.reshape(-1))
        r.param.grad = r.grad
        pending = self._grad_pending.get(r.group)
        if pending is not None:
            pending.discard(r.index)
            if not pending or not self._hold_grads:
                self._release_grad(r.group)
        bwd = self._bwd_pending.get(r.group)
        if bwd is not None:
            bwd.discard(r.index)
            if not bwd and r.group in self._bwd_hold:
                self._release(r.group, self._compute_kind, False, self._bwd_hold.pop(r.group))
                del self._bwd_pending[r.group]

    def _prefetch_after(self, unit: int, step: int):
        """Sharded: starts gathering the chunks of the unit that ran after (`step` +1, the
        forward) or before (-1, the backward) `unit` in the last training forward."""
        i = self._fwd_pos.get(unit)
        if i is None or not 0 <= i + step < len(self._fwd_units):
            return
        nxt = self.units[self._fwd_units[i + step]]
        for g in nxt.groups:
            self._shards.prefetch(g, self._compute_kind)

    def _bwd_moment(self, unit: int):
        """The backward reached `unit` (its saved chunk views, or a gradient of one of its
        params): a timeline moment, and while recording a pre-backward trace moment."""
        if unit != self._bwd_unit:
            prev = self._bwd_unit
            self._bwd_unit = unit
            if self._shards is not None and unit >= 0:
                self._prefetch_after(unit, -1)
            if prev is not None:
                # The compute chunks the previous unit's saved views came from, unless this
                # unit uses them too: its nodes have run (autograd runs a unit's nodes before
                # it reaches the next unit's; one it comes back to acquires again), and the
                # device's queued work is ordered by the release (tiers/tier.h). Held longer —
                # until every gradient of the group is in — a tied embedding's chunk stayed
                # pinned from the head's backward to the embedding's, where a plan had
                # evicted it (the trace records acquires, not pins).
                keep = set(self.units[unit].groups) if unit >= 0 else set()
                for g in [g for g in self._bwd_hold if g not in keep]:
                    self._release(g, self._compute_kind, False, self._bwd_hold.pop(g))
                    self._bwd_pending.pop(g, None)
            if self._count_act and prev is not None:
                # The previous unit's activations are freed before this moment's planned
                # actions: a plan's span of them ends at that unit's moment, so this moment's
                # prefetches were planned into their room (planners/effective.h).
                self._act_done(prev)
            self.s.moment(self.units[unit].bwd_label if unit >= 0 else "pre-backward", 1, unit)
            if self._count_act:
                # After the moment's planned actions: the forward's last activations (not yet
                # counted) take their room.
                if self._offload_act and unit >= 0:
                    # This unit's offloaded activations now (the backward needs them next),
                    # the one before it in the forward when the device has room for it.
                    self._act_fetch(unit)
                    i = self._act_order.index(unit) if unit in self._act_by_unit else -1
                    if i > 0 and not self.s.plan_followed:  # a plan fetches them itself
                        self._act_fetch(self._act_order[i - 1], only_if_room=True)
                self._act_sync()

    # The two grad hooks live in torch's C++ autograd metadata of the parameters, which the
    # garbage collector does not traverse: a hook that referred to the runtime, or to anything
    # that leads to it (a _Param record refers to the modules, whose wrapped forwards refer to
    # the runtime), would keep the runtime, the model and the tiers' memory alive after the
    # model and optimizer are dropped. So they hold the runtime weakly and the record by index.
    def _weak_grad_hook(self, r: _Param, method):
        """A post-accumulate-grad hook calling ``method(runtime, record, p)``. torch keeps the
        hook in the parameter's C++ autograd metadata, out of the collector's sight, so it
        holds the runtime weakly and the record by index (test_lifecycle.py): a strong
        reference there would keep a dropped model's runtime alive for good."""
        rt_ref, index = weakref.ref(self), r.index

        def hook(p):
            rt = rt_ref()
            if rt is not None:
                method(rt, rt.params[index], p)
        return hook

    def _user_grad_hook(self, r: _Param, register, hook):
        """A user's ``p.register_hook(fn)`` / ``p.register_post_accumulate_grad_hook(fn)`` on
        a managed parameter. Its gradient is computed for the unit's compute view (and for
        the parameter itself where code outside every unit reads it), so a gradient hook goes
        on both leaves (it sees, and may replace, the gradient before it is accumulated), and
        a post-accumulate hook runs after tiermem has accumulated into the chunk, with the
        parameter (``p.grad`` then holds the total). Returns a handle whose ``remove()``
        undoes it, as torch's does."""
        if not r.param.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
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
        C++ autograd metadata: the runtime weakly (test_lifecycle.py)."""
        rt_ref, index = weakref.ref(self), r.index

        def part(g):
            rt = rt_ref()
            if rt is not None:
                rt._check_one_part(rt.params[index], key, leaf)
            return hook(g)
        return part

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
        do there: not an unmaterialized read to warn about or refuse."""
        if not r.post_hooks:
            return
        self._in_user_hook = True
        try:
            for hook in list(r.post_hooks.values()):
                hook(r.param)
        finally:
            self._in_user_hook = False

    def _on_compute_grad(self, r: _Param, p):
        self._begin_backward()
        # A unit whose backward saves no param view (an embedding) shows up here; always
        # (not only while recording), so executed iterations have the recorded moments.
        self._bwd_moment(r.unit)
        g = p.grad
        p.grad = None
        if g is not None:
            self._accumulate(r, g, r.param.grad)
        self._run_post_hooks(r)

    def _on_param_grad(self, r: _Param, p):
        # The ChunkTensor parameter itself was used (read outside its unit). AccumulateGrad
        # either set p.grad to a plain tensor (the new total) or added in place into r.grad.
        self._begin_backward()
        g = p.grad
        if g is None or g is r.grad:
            return
        p.grad = None
        self._accumulate(r, g, None)
        self._run_post_hooks(r)

    def sync_grads(self):
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
                for h in list(self._grad_hold):
                    self._release_grad(h)
            flags.append(g is not None)
        self.s.set_has_grad(flags)

    # ---- ChunkTensor dispatch ------------------------------------------------------------
    def _where(self) -> str:
        if self._active_units:
            u = self._active_units[-1]
            return f"inside the forward of unit '{u.name or type(u.module).__name__}'"
        if self._in_backward:
            return "during backward"
        if self._root_depth > 0:
            return f"inside the forward of {type(self.model).__name__}, outside every unit"
        return "outside any forward"

    def _view_base(self, ct: ChunkTensor, pins: list):
        """A real tensor viewing ct's chunk memory (acquired unless already pinned)."""
        r, kind = ct._tm_rec, ct._tm_kind
        if kind == "param":
            if r.mat > 0 or self._resident:
                v = r.compute.data
            else:
                base = self._acquire(r.group, self._compute_kind)
                pins.append((r.group, self._compute_kind, base))
                v = self._slice(base, r)
        else:
            base = self._grad_hold.get(r.group)
            if base is None:
                base = self._acquire(r.group, _K.grad)
                pins.append((r.group, _K.grad, base))
            v = self._slice(base, r)
        for f, a, kw, idx in ct._tm_views:
            v = f(v, *a, **kw)
            if idx is not None:
                v = v[idx]
        return v

    def _dispatch(self, func, args, kwargs):
        if self._closed:
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
        if self.fp16 and not self._in_backward:
            for ct in cts:
                if ct._tm_kind == "grad":
                    raise RuntimeError(
                        f"tiermem: the gradient of '{ct._tm_rec.name}' is held loss-scaled in "
                        f"fp16 (precision 'fp16', scale {self.s.loss_scale:g}), so {func} would "
                        "see scaled values. Clip with the config key 'gradient_clipping', read "
                        "the norm with optimizer.grad_norm(), or train in 'bf16'")
        for ct in cts:
            if ct._tm_kind == "param" and ct._tm_rec.mat == 0 and \
                    not any(ct is w for w in write_only):
                self._on_unmaterialized_read(ct._tm_rec, func)
        written_chunks = {(ct._tm_rec.group, ct._tm_kind) for ct in written}
        pins, real = [], {}
        try:
            try:
                for ct in cts:
                    if id(ct) not in real:
                        real[id(ct)] = self._view_base(ct, pins)
            except MemoryError:
                # More chunks than the device tier holds at once (torch.cat over every
                # parameter: parameters_to_vector, DDP's broadcast at construction). An op
                # that writes none of them runs on copies taken one chunk at a time.
                if written or len({(c._tm_rec.group, c._tm_kind) for c in cts}) < 2:
                    raise
                for g, k, b in pins:
                    self._release(g, k, False, b)
                pins, real = [], {}
                for ct in cts:
                    if id(ct) not in real:
                        real[id(ct)] = self._materialized_copy(ct)
            out = func(*unwrap(args, lambda c: real[id(c)]),
                       **unwrap(kwargs, lambda c: real[id(c)]))
            if self.mixed:
                exact = None
                if func.__name__.split(".")[0] == "copy_" and len(args) > 1 and \
                        isinstance(args[1], torch.Tensor) and \
                        not isinstance(args[1], ChunkTensor) and args[1].dtype == torch.float32:
                    exact = args[1]  # e.g. load_state_dict: the master gets the fp32 value
                for ct in written:
                    if ct._tm_kind == "param":
                        self._sync_master(ct._tm_rec, ct._tm_views, real[id(ct)], exact)
            out = self._wrap_out(out, written, real)
        finally:
            for g, k, b in pins:
                self._release(g, k, (g, "grad" if k == _K.grad else "param") in written_chunks, b)
        for g, kind in written_chunks:  # pinned by a unit or the grad hold: mark them too
            k = _K.grad if kind == "grad" else self._compute_kind
            if not any(p[0] == g and p[1] == k for p in pins):
                self._mark_modified(g, k)
        return out

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
        if isinstance(out, torch.Tensor):
            return ChunkTensor(self, r, ct._tm_kind, out.shape, out.stride(), out.dtype,
                               ct.device, ct._tm_views + ((func, rest, kwargs, None),))
        return type(out)(ChunkTensor(self, r, ct._tm_kind, o.shape, o.stride(), o.dtype,
                                     ct.device, ct._tm_views + ((func, rest, kwargs, i),))
                         for i, o in enumerate(out))

    def _on_unmaterialized_read(self, r: _Param, func):
        if self._in_user_hook:
            return  # _run_post_hooks
        where = self._where()
        if self.strict:
            raise RuntimeError(
                f"tiermem: parameter '{r.name}' was read by {func} {where}, but it is not "
                "materialized there (config unmaterialized_reads='error'). Read parameters "
                "inside the forward of a unit that contains them, or pass units=... to "
                "tiermem.initialize so that one unit covers the code that reads it")
        if where != "outside any forward" and not r.warned and not self._resident:
            r.warned = True
            import warnings
            warnings.warn(f"tiermem: parameter '{r.name}' was read by {func} {where}, outside "
                          "its unit: it is materialized on demand (correct, but a chunk "
                          "acquire per operation). Pass units=... to tiermem.initialize so "
                          "that one unit covers the code that reads it.", stacklevel=3)

    def _mark_modified(self, group, kind):
        # The chunk is pinned by someone else (a unit, the grad hold): take and drop one more
        # pin to mark it modified without moving it. Sharded: the held full chunk is written
        # back into this rank's shard when its last holder lets go (a held grad buffer is
        # reduce-scattered anyway).
        if self._shards is not None:
            self._shards.mark_dirty(group, kind)
            return
        self._on_stream()
        base = self.s.acquire(group, kind, _DEVICE)
        self.s.release(group, kind, True)
        del base

    def _sync_master(self, r: _Param, views, compute_view, exact_src):
        """Mixed precision: after (a view `views` of) r's compute copy changed, the same region
        of its fp32 master follows: from the fp32 source of a copy_ exactly, else from the
        compute value. (Read-modify-write of the master through the core, wherever it is.)"""
        master = self.s.read_tensor(r.index, _K.param_fp32).view(r.shape)
        mv = master
        for f, a, kw, idx in views:
            mv = f(mv, *a, **kw)
            if idx is not None:
                mv = mv[idx]
        with torch.no_grad():
            mv.copy_(exact_src if exact_src is not None else compute_view)
        self.s.write_tensor(r.index, _K.param_fp32, master.reshape(-1))

    def _materialized_copy(self, ct: ChunkTensor) -> torch.Tensor:
        """An ordinary tensor with ct's current value (a copy)."""
        if self._closed:
            raise RuntimeError(f"tiermem: {ct._tm_rec.name}: the tiermem runtime is closed")
        pins = []
        try:
            return self._view_base(ct, pins).clone()
        finally:
            for g, k, b in pins:
                self._release(g, k, False, b)

    # ---- state ---------------------------------------------------------------------------
    def param_value(self, r: _Param) -> torch.Tensor:
        """The fp32 value (the master in mixed precision) as an ordinary CPU tensor."""
        self._on_stream()
        return self.s.read_param(r.index).view(r.shape)

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        if self._closed or module._parameters is None:
            return
        memo = state_dict.__dict__.setdefault("_tiermem_values", {})
        for name, p in module._parameters.items():
            r = self.by_param.get(id(p))
            key = prefix + name
            if r is None or key not in state_dict or state_dict[key] is p:
                continue  # not ours, or keep_vars=True (the parameter itself)
            v = memo.get(r.index)
            if v is None:
                v = memo[r.index] = self.param_value(r)
            state_dict[key] = v

    # ---- optimizer glue --------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> bool:
        """Clears every gradient unless an accumulation window is open; True when it did."""
        if not self.s.zero_grad():
            return False
        for r in self.params:
            if r.trainable:
                r.param.grad = None if set_to_none else r.grad
        return True

    def grad_stats(self) -> tuple[float, bool]:
        """(sum of squares, overflow) of the unscaled gradients of the whole model — summed over
        ranks when sharded (collective)."""
        self.sync_grads()
        self._on_stream()
        sq, overflow = self.s.grad_stats()
        if self._shards is not None:
            sq, overflow = self._shards.all_reduce_stats(sq, overflow)
        return sq, overflow

    def grad_norm(self) -> torch.Tensor:
        return torch.tensor(math.sqrt(self.grad_stats()[0]), dtype=torch.float32)

    @property
    def loss_scale(self) -> float:
        return self.s.loss_scale

    def stats(self) -> dict:
        st = self.s.stats()
        if self._offload_act or self._recompute_all:
            st["activations"] = dict(self._act_stats)
        if self._shards is not None:
            st["distributed"] = dict(self._shards.stats, world=self._shards.world,
                                     rank=self._shards.rank, backend=self._shards.backend)
        return st

    def timeline_peaks(self) -> dict:
        """Peak and budget per tier, bytes per tier pair and stalls, computed by tiermem::prof
        from the binary timeline file (not from the engine's counters)."""
        return self.s.timeline_report()

    def timeline_events(self) -> list:
        self.s.timeline_report()  # waits for moves and flushes
        return _C.read_timeline(self.s.timeline_path)

    @property
    def timeline_path(self) -> str:
        return self.s.timeline_path

    @property
    def model_bytes(self) -> int:
        return self.s.model_bytes

    @property
    def chunk_elems(self) -> int:
        return self.s.chunk_elems

    # ---- warm-up trace --------------------------------------------------------------------
    def record_trace(self, path, iterations: int = 1):
        """Records the warm-up trace of the next ``iterations`` training iterations (from the
        next forward with grad enabled) to ``path``: every unit's pre-forward and
        pre-backward and every optimizer sub-step, with the chunks each accessed, the bytes
        each unit saved for backward, compute times, and the copy and optimizer rates measured
        meanwhile (docs/trace-format.md). The file is written when the iteration after the
        last begins, at :meth:`finish_trace` or at :meth:`close`; ``tiermem plan simulate``
        and ``tiermem plan compare`` read it. Recording changes nothing the model computes."""
        import os
        if self._closed:
            raise RuntimeError("tiermem: record_trace on a closed model")
        if self._resident:
            raise RuntimeError(
                "tiermem: record_trace: every chunk of this model fits in the device budget "
                f"({self._device_budget} bytes), so nothing moves and there is no schedule to "
                "plan; record with a device budget below the model's "
                f"{self.s.total_chunk_bytes} chunk bytes")
        self.s.record_trace(os.fspath(path), int(iterations))

    def finish_trace(self):
        """Writes the trace being recorded now (what was recorded so far). Returns its path,
        or None when no recording was armed; raises if writing failed."""
        if self._closed:
            return None
        path = self.s.written_trace if self.s.finish_trace() else None
        self._recording_trace = False
        return path

    @property
    def written_trace(self):
        """The path of the last warm-up trace written, or None."""
        p = self.s.written_trace
        return p or None

    def close(self):
        """Gives the model back as an ordinary model (plain Parameters with the current values
        and gradients), detaches the hooks and frees every chunk."""
        if self._closed:
            return
        self.s.finish_trace()  # a recording in progress ends before the values are read
        values = [self.param_value(r) for r in self.params]
        grads = [self._materialized_copy(r.grad) if r.trainable and r.param.grad is r.grad
                 else None for r in self.params]
        for h in self._handles:
            h.remove()
        for m in reversed(self._wrapped):
            _unwrap_forward(m)
        for r, v, g in zip(self.params, values, grads):
            r.orig.data = v.to(self.device)
            r.orig.grad = g
            for m, name in r.slots:
                m._parameters[name] = r.orig
        self._closed = True
        if self._shards is not None:
            self._shards.close()
        self._spill_free_all()  # no spill copy in flight when the tiers go
        self.s.close()
        self._shards = None  # nor does the runtime keep the process group alive
        if getattr(self.model, "_tiermem_runtime", None) is self:
            del self.model._tiermem_runtime

    def __deepcopy__(self, memo):
        return None  # a deep copy of a managed model is an ordinary model (see tensor.py)

    def __reduce__(self):
        return (_no_runtime, ())  # torch.save(model): likewise (_StateDictHook)


try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
except ImportError:  # a torch without dynamo: nothing can compile
    def _eval_frame_callback():
        return None


def _refuse_compile(inner):
    """torch.compile cannot run a managed forward: tiermem's wrappers swap each unit's
    parameters for views of chunks acquired just then and give them back after, and a compiled
    graph would bake in the tensors of one call (inductor then fails deep inside with a stride
    assertion, or a graph could read memory the budget has moved on from). Checked in the
    traced code (is_compiling) and in frames dynamo runs eagerly inside a compiled region (its
    frame callback is set, the test torch's own set_stance uses), so the user gets this error
    naming what to do instead."""
    if torch.compiler.is_compiling() or _eval_frame_callback() not in (None, False):
        what = getattr(inner, "__qualname__", None) or type(inner).__name__
        raise RuntimeError(
            f"tiermem: torch.compile cannot compile {what} of a tiermem-managed model: its "
            f"parameters are views of chunks that tiermem acquires and gives back around each "
            f"unit's forward, which a compiled graph would capture as fixed tensors. Run the "
            f"managed model without torch.compile; nothing was changed.")


class _Forward:
    """An instance-level ``forward`` that runs enter/exit around the module's own forward.

    Wrapping forward (as accelerate's hooks do) instead of registering forward hooks keeps
    ``module._forward_hooks`` empty, so torch's fast paths that refuse modules with hooks
    (nn.TransformerEncoderLayer in eval) run exactly as on the plain model. A deep copy of
    the module gets its own forward back (an ordinary module), never this wrapper.
    """

    def __init__(self, inner, enter, exit_):
        # Not inner's __dict__ (update_wrapper's default): when inner is itself a _Forward (a
        # module that is both a unit and the root), that would overwrite enter/exit/inner
        # with the unit's, and the root's hooks would never run.
        functools.update_wrapper(self, inner, updated=())
        self.inner, self.enter, self.exit = inner, enter, exit_

    def __call__(self, *args, **kwargs):
        _refuse_compile(self.inner)
        self.enter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.exit()

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.inner, memo)

    def __reduce_ex__(self, protocol):
        # torch.save(model): the module's own forward (a bound method pickles as getattr(module,
        # "forward"), which on load finds the class's).
        return self.inner.__reduce_ex__(protocol)


class _RootForward(_Forward):
    """The model's own forward: exit sees what it returned (None when it raised)."""

    def __call__(self, *args, **kwargs):
        _refuse_compile(self.inner)
        self.enter()
        out = None
        try:
            out = self.inner(*args, **kwargs)
            return out
        finally:
            self.exit(out)


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


class _GraphSentinel:
    """Owned by a no-op pre-hook on an output's autograd node: alive while the graph is."""


class _UnitForward(_Forward):
    """A unit's forward: enter sees the call's arguments (a recomputed unit keeps them), exit
    what it returned (None when it raised)."""

    def __call__(self, *args, **kwargs):
        _refuse_compile(self.inner)
        self.enter(args, kwargs)
        out = None
        try:
            out = self.inner(*args, **kwargs)
            return out
        finally:
            self.exit(out)


def _wrap_forward(module, enter, exit_, registry, cls=None):
    w = (cls or _Forward)(module.forward, enter, exit_)
    w.prev = module.__dict__.get("forward")  # an instance-level forward already there
    module.forward = w
    registry.append(module)


def _unwrap_forward(module):
    """Undoes the outermost _Forward of `module` (call in reverse order of wrapping)."""
    w = module.__dict__.get("forward")
    if isinstance(w, _Forward):
        if w.prev is not None:
            module.forward = w.prev
        else:
            del module.forward


def _contiguous_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _foreach_length(args) -> int:
    for x in args:
        if isinstance(x, (list, tuple)) and any(isinstance(e, ChunkTensor) for e in x):
            return len(x)
    return 0


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


def tree_leaves_ct(obj):
    from torch.utils._pytree import tree_flatten
    return [x for x in tree_flatten(obj)[0] if isinstance(x, ChunkTensor)]


def tree_map_tensors(obj, fn):
    from torch.utils._pytree import tree_map
    return tree_map(fn, obj)
