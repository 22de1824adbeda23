"""The PyTorch adapter over the session core (``_C.Session``, runtime in C++).

The core owns the layout, the tiers, the optimizer step and checkpoints. The adapter only
translates torch events into core calls; TiermemRuntime builds it from one part per job and
holds the public API (stats, timeline, traces, close):

- Parameters (params.py). Each managed parameter ``p`` the model exposes is a ChunkTensor
  (tensor.py) — a stable object whose every use reads the chunk. Each also has a *compute*
  parameter, a plain ``nn.Parameter`` whose ``.data`` is a view of its chunk on the device
  tier while a unit containing it runs; unit hooks swap it into its modules' ``_parameters``
  for the forward, so the model computes on plain tensors at full speed, and swap ``p`` back
  after.
- Chunk access (chunks.py): every acquire and release of chunk memory, through the shards
  when the model is sharded across ranks (distributed.py).
- Units (units.py picks them; unit_hooks.py runs them). A unit's pre-forward acquires (pins)
  its chunk groups on the device and materializes every parameter of its subtree; its
  post-forward releases them.
- Saved tensors (saved.py). Saved-tensor hooks pack any saved tensor that aliases chunk
  memory as a chunk reference and unpack it in backward as a view of the chunk's *current*
  device copy (backward.py: re-acquired, and pinned until every parameter of the group used
  in the forward has its gradient). Other saved tensors are activations (activations.py:
  counted in the device budget, offloaded, spilled to NVMe) or recomputed in the backward
  (recompute.py).
- Gradients (grads.py). Post-accumulate-grad hooks add each gradient into the grad chunk on
  the device (copy when ``p.grad`` is None — torch's semantics — add otherwise) and set
  ``p.grad`` to a grad ChunkTensor, so ``clip_grad_norm_``, GradScaler and logging see the
  true values, and ``zero_grad()`` / ``model.zero_grad()`` (``p.grad = None``) work as in
  torch. No grad is kept on the device beyond the chunks the engine caches.
- Operations on ChunkTensors outside the units (dispatch.py).
- torch.compile (compiling.py): the wrappers (forwards.py) are graph breaks, the parts'
  hooks run eagerly, the model's own forward runs eagerly and each unit's forward is
  compiled, once per unit class.
- Mixture-of-experts layers (experts.py): their experts are no unit's; each is acquired when
  the router picks it (fused experts through transformers' experts-implementation hook, a
  ModuleList's at each expert's call), prefetched at the router, cached by pick frequency.
- Inference. Forwards without grad use untraced acquires: they neither record into nor
  disturb the order the next training iteration replays (``_traced``; serve.py: always).
- State. ``state_dict()`` of any module gives plain tensors (the fp32 masters);
  ``load_state_dict`` writes into the chunks through the ChunkTensors (and the fp32 master,
  exactly, in mixed precision).

Composition: each part's module docstring says what it owns and reads; the parts share
shared.RunState (``self.state``) and read one frozen shared.Modes (``self.modes``), built here
once from the config's modes and the session's answers. Who calls whom (never the other way round, except through
the ``on_reset`` / ``on_unit_done`` / ``on_end`` registrations their docstrings name):

    ChunkAccess (chunks.py)      the session, the shards (distributed.py)
    Materializer                 ChunkAccess
    Activations                  the session
    ForwardOrder                 ChunkAccess
    Backward                     ChunkAccess, Activations, ForwardOrder
    Recompute                    ChunkAccess, Materializer, Activations, Backward
    SavedTensors (saved.py)      ChunkAccess, Activations, Recompute, Backward
    Grads                        ChunkAccess, Backward
    ChunkOps (dispatch.py)       ChunkAccess, Grads
    UnitHooks (unit_hooks.py)    ChunkAccess, Materializer, Activations, Recompute,
                                 SavedTensors, ForwardOrder
    Experts (experts.py)         ChunkAccess, Materializer, Recompute, Backward, Grads

ChunkTensor (tensor.py) reaches its runtime's ``ops``, ``grads`` and ``materializer``.
forwards.py and every part whose callbacks torch may call from compiled code (saved.py,
grads.py, backward.py, recompute.py) use compiling.py, which uses nothing of the runtime.

Threading: one training thread (like the model itself); the backward's hooks run on
autograd's backward thread, one at a time.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from . import _C
from .activations import Activations
from .backward import Backward
from .chunks import ChunkAccess
from .dispatch import ChunkOps, tree_leaves_ct, tree_map_tensors
from .experts import Experts, find_expert_sets
from .forwards import _Forward, _RootForward, _UnitForward, _unwrap_forward, _wrap_forward
from .grads import Grads
from .hf import buffer_dtypes
from .initvalues import check_buffers, initial_values, is_meta, restore_meta
from .unit_hooks import ForwardOrder, Materializer, UnitHooks, tree_leaves_tensors
from .params import _contiguous_strides, _placeholder, collect_params
from .recompute import Recompute
from .saved import SavedTensors
from .shared import _K, Modes, _Param, _Piece, RunState
from .tensor import ChunkTensor
from .units import find_units, unit_modules
from .weights import LoadPlan

# Importable from here as before (serve.py, tests): the forward wrappers, the tree helpers.
__all__ = ["TiermemRuntime", "_Forward", "_RootForward", "_UnitForward", "_wrap_forward",
           "_unwrap_forward", "tree_leaves_tensors", "tree_leaves_ct", "tree_map_tensors"]


# safetensors' names of the compute dtypes (weights.values_in).
_FILE_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


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
# (Pickles name these functions by module: they stay here.)
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


class _StateDictSizeCheck:
    """The state_dict pre-hook of every module holding managed parameters (runtime held
    weakly): a ``state_dict()`` called on it (prefix "", not a parent's recursion) that would
    make more values than free memory holds raises first. Pickled or deep-copied with the
    module, it becomes a no-op."""

    def __init__(self, runtime):
        self._rt = weakref.ref(runtime)

    def __call__(self, module, prefix, keep_vars):
        rt = self._rt()
        if rt is not None and prefix == "" and not keep_vars:
            rt._check_materializable(module, "state_dict()")

    def __reduce__(self):
        return (_no_state_dict_hook_factory, ())


def _units_of(units, params) -> dict:
    """Tensor index -> the units whose modules hold it, ascending (TensorSpec.units: the session
    reads what each unit computes with from them, for the serving minimum and the host room)."""
    module_units: dict[int, set] = {}
    for i, u in enumerate(units):
        for _, m in unit_modules(u):
            module_units.setdefault(id(m), set()).add(i)
    out = {}
    for r in params:
        found = {i for m, _ in r.slots for i in module_units.get(id(m), ())}
        if found:
            out[r.index] = sorted(found)
    return out


class _ClosedPart:
    """What a closed runtime holds in place of each of its parts (close() drops them: they,
    the ChunkTensors and the hooks referred to the runtime and to each other, a cycle that kept
    the runtime, the session and the model given back alive until the cyclic collector ran).
    A tensor of the closed runtime used in an operation raises as the parts did."""

    __slots__ = ()

    def dispatch(self, func, args, kwargs):  # ChunkTensor.__torch_dispatch__
        raise RuntimeError(f"tiermem: {func} on a tensor of a closed tiermem runtime")

    def __getattr__(self, name):
        raise RuntimeError(f"tiermem: the runtime is closed (close() gave the model back): "
                           f"its '{name}' is gone")


_CLOSED_PART = _ClosedPart()
_PARTS = ("chunks", "materializer", "activations", "order", "backward", "recompute", "experts",
          "saved", "grads", "ops", "hooks")


def free_ram_bytes() -> int:
    """The host memory a new allocation can take now: MemAvailable of /proc/meminfo (the host
    budget's memory is in use already, so it is not counted)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


class TiermemRuntime:
    """Owns the session and the parts (the hooks) of one initialized model."""

    _serving = False  # serve.ServingRuntime: inference only (every parameter frozen)

    def __init__(self, model: nn.Module, cfg, param_groups, units=None, process_group=None,
                 experts=True, init=None, weights=None, strict=True):
        self.model = model
        self.cfg = cfg
        self.state = RunState()  # closed until everything is in place
        kind = _C.resolve_device_kind(cfg.device_kind)  # RuntimeError: no CUDA device
        if kind.is_cuda and not torch.cuda.is_available():
            raise RuntimeError("device_kind 'cuda': tiermem sees a GPU but torch does not "
                               "(torch.cuda.is_available() is False)")
        if not kind.is_cuda and cfg.device_kind == _C.DeviceKind.auto and torch.cuda.is_available():
            # Never train on the CPU in silence on a GPU machine.
            why = ("this tiermem build has no CUDA support (built without nvcc; reinstall with "
                   "the CUDA toolkit present)" if not _C.cuda_built() else
                   "tiermem's CUDA runtime finds no usable device (driver older than the CUDA "
                   f"{_C.cuda_runtime_version()} runtime tiermem was built with?)")
            raise RuntimeError(f"device_kind 'auto': torch sees a GPU but {why}. Set "
                               "device_kind 'sim' (or TIERMEM_DEVICE=sim) to train on the CPU "
                               "on purpose.")
        self.device = torch.device("cuda", 0) if kind.is_cuda else torch.device("cpu")
        self.params, self.by_orig, self.opt_groups = collect_params(model, cfg, param_groups,
                                                                    self._serving)
        # Pretrained weights (weights.py): the checkpoint's headers matched against the model's
        # names before anything changes; buffers it has may be on the meta device.
        self._weights = LoadPlan(model, weights, self.params, strict) if weights is not None \
            else None
        check_buffers(model, loaded=self._weights.buffer_keys if self._weights else ())
        if init is not None and not callable(init):
            raise ValueError(f"init must be a function of a module, got {type(init).__name__}")
        self._was_meta = {r.index for r in self.params if is_meta(r)}
        self.units = find_units(model, units)
        # Sharded across the ranks of a torch.distributed job (distributed.py) when a process
        # group of more than one rank is given or initialized.
        from . import distributed
        pg = distributed.process_group_for(process_group)
        # Mixture-of-experts layers whose experts move alone (experts.py); not when sharded.
        self.expert_sets = find_expert_sets(model, self.by_orig, bool(experts) and pg is None)
        unit_of = _units_of(self.units, self.params)
        # Tensors the checkpoint holds in the compute dtype (from the headers, before the
        # session lays out): frozen ones keep no fp32 master in mixed precision (their values
        # are exact in it), and served ones are likely read in place from the files, so the
        # session holds no NVMe room for their chunks (TensorSpec.read_in_place).
        dt = cfg.precision.torch_dtype
        stored = self._weights.values_in(self.params, _FILE_DTYPES[dt]) \
            if self._weights is not None and dt in _FILE_DTYPES else set()
        exact = stored if dt != torch.float32 else set()
        in_file = stored if self._serving and cfg.in_place.serves_in_place and pg is None \
            else set()
        specs = [_C.TensorSpec(name=r.name, numel=r.numel, trainable=r.trainable,
                               opt_group=r.opt_group, shape=list(r.shape),
                               expert_set=r.expert_set, expert=r.expert,
                               units=unit_of.get(r.index, []),
                               values_in_compute_dtype=not r.trainable and r.index in exact,
                               read_in_place=r.index in in_file)
                 for r in self.params]
        if pg is not None and self._serving:
            raise ValueError("tiermem.inference: serving is not sharded across ranks (run one "
                             "model per process, without a process group)")
        self._shards = (distributed.Shards(pg, cfg.precision.torch_dtype) if pg is not None
                        else None)
        self.session = _C.Session(cfg, specs, self._shards.sharding() if self._shards else None)
        try:
            if self._shards:
                self._shards.attach(self.session)
                self._shards.check_layout()
            with torch.no_grad():
                for r in self.params:
                    r.pieces = [_Piece.of(pc) for pc in self.session.place(r.index)]
                    r.group, r.offset = r.pieces[0].group, r.pieces[0].offset
                    r.compute_only = self.session.group(r.group).compute_only
                # From the checkpoint, straight into the chunks; the parameters it lacks
                # (strict=False) and all of them without one: their own values, or for those
                # built on the meta device their modules' initialization, module by module
                # (initvalues.py). The model is never whole in host memory.
                todo = (self._weights.load(self.session, self.params, self._serving)
                        if self._weights else self.params)
                for r, v in initial_values(model, todo, init):
                    if self._shards:  # every rank starts from rank 0's values (as DDP)
                        v = v.clone()
                        self._shards.broadcast_(v)
                    self.session.write_param(r.index, v)
                    del v  # (a meta parameter's values go when initial_values moves on)
                if self._weights is not None:
                    self._weights.load_buffers()  # last: the parameters hold their values
        except BaseException:
            self.session.close()
            restore_meta(self.params, self._was_meta)
            if self._weights is not None:
                self._weights.restore()
            raise
        self._compute_kind = self.session.compute_kind
        # per group: _C.ChunkGroup (trainable, used_elems, tensors, pieces)
        self.groups = [self.session.group(g) for g in range(self.session.num_groups)]
        self.modes = self._modes(cfg)
        # The parts, each over the state it needs (its module's docstring), lowest first.
        st, s, modes = self.state, self.session, self.modes
        self.chunks = ChunkAccess(s, self._shards, self.device, self._traced)
        self.materializer = Materializer(self.chunks, modes)
        self.activations = Activations(modes, s, st, self.units, self.device)
        self.order = ForwardOrder(self.units, self.chunks)
        self.backward = Backward(s, self.chunks, st, self.units, self.activations, self.order)
        self.recompute = Recompute(modes, s, self.chunks, st, self.materializer, self.activations,
                                   self.backward, self.device)
        self.experts = Experts(self.expert_sets, s, self.chunks, st, self.materializer,
                               self.recompute, self.units)
        self.experts.backward = self.backward
        self.experts.place(self.params)
        self.saved = SavedTensors(self.chunks, st, self.activations, self.recompute,
                                  self.backward, self.device)
        self.grads = Grads(s, self.chunks, st, self.backward, self.params, self.groups, modes)
        self.ops = ChunkOps(model, s, self.chunks, st, self.grads, modes)
        self.hooks = UnitHooks(model, self.units, s, self.chunks, st, self.materializer,
                               self.activations, self.recompute, self.saved, self.order, modes)
        self._handles: list = []
        self._wrapped: list = []  # modules whose forward we wrapped (undone at close)
        self.state.open()
        self._install()
        # The session's caps for the largest unit (its groups are known once installed).
        most = max((len(u.groups) for u in self.units), default=1)
        self.activations.cap = s.activation_cap(most)
        if self._shards is not None:
            self._shards.recent_capacity = s.recent_full_chunks(most)
        # The chunks hold the values now. The user's Parameter objects keep no copy (close()
        # gives them their data back), so the model is not in host RAM twice, and a stale
        # reference to one fails loudly (an empty tensor) instead of reading old values.
        if self._weights is not None:  # until set-up succeeds (abandon gives them back)
            self._weights.keep_originals(self.params, self._was_meta)
        for r in self.params:
            r.orig.data = torch.empty(0, dtype=r.orig.dtype)

    # ---- set-up ---------------------------------------------------------------------------
    def _modes(self, cfg) -> Modes:
        """The frozen modes of this runtime: the config's, and what the session answers."""
        s = self.session
        # Resident training: when every chunk of every kind fits the compute tier at once (and
        # it is CPU memory: SimDevice, or the host), the compute and grad chunks are pinned
        # there for the whole session — nothing ever moves, no unit acquires, no saved-tensor
        # hooks (saved views of chunk memory stay valid), and the optimizer steps in place.
        # Not with activations counted in the budget: they need the hooks that count them.
        # Not with split parameters: they compute with copies of their pieces, made per unit.
        # Serving is resident only in host mode with every chunk homed in host memory (host
        # homes never move; the KV cache still counts in the host budget): on a device, the
        # weights must stay evictable to make room for the KV cache as it grows.
        resident = ((not self._serving or s.host_compute)
                    and not s.cuda and self._shards is None
                    and not cfg.activations.counted
                    and s.compute_tier_holds_every_chunk
                    and not any(r.split for r in self.params) and not self.expert_sets)
        return Modes(dtype=s.compute_dtype, mixed=cfg.precision.mixed,
                     loss_scaled=cfg.precision.loss_scaled,
                     strict=cfg.unmaterialized_reads.raises, serving=self._serving,
                     resident=resident, hold_grads=s.holds_grad_chunks,
                     activations=cfg.activations, nvme=cfg.nvme_size > 0)

    @property
    def _resident(self) -> bool:
        return self.modes.resident

    def _install(self):
        """Takes over the model. Nothing here can fail on valid input."""
        for r in self.params:
            r.param = nn.Parameter(
                ChunkTensor(self, r, "param", r.shape, _contiguous_strides(r.shape), self.modes.dtype,
                            self.device), requires_grad=r.trainable)
            r.compute = nn.Parameter(torch.empty(0, dtype=self.modes.dtype, device=self.device),
                                     requires_grad=r.trainable)
            r.placeholder = _placeholder(r.shape, self.modes.dtype, self.device)
            r.compute.data = r.placeholder
            if r.trainable:
                r.grad = ChunkTensor(self, r, "grad", r.shape, _contiguous_strides(r.shape),
                                     self.modes.dtype, self.device)
                self._handles.extend(self.grads.install(r))
            for m, name in r.slots:
                m._parameters[name] = r.param
        self.by_param = {id(r.param): r for r in self.params}
        for og in self.opt_groups:
            og["params"] = [r.param for r in og["params"]]
        # Units: the slots inside each, their groups, and their hooks; the experts that move
        # alone are no unit's (experts.py).
        self.hooks.install(self.params, self._wrapped, self.experts.alone)
        self.experts.link(self.params)
        self.experts.install(self.units, self._wrapped,
                             lambda shape: _placeholder(shape, self.modes.dtype, self.device),
                             self.grads)
        self._handles.extend(self.grads._handles_extra)
        self._wrap_root()
        # state_dict of any module gives plain tensors; load_state_dict copies into the chunks.
        for m in {id(m): m for r in self.params for m, _ in r.slots}.values():
            self._handles.append(m.register_state_dict_post_hook(_StateDictHook(self)))
        # ... and never more than free memory holds (a model larger than RAM: the streaming
        # exports instead); checked where state_dict() is called, on the model or a submodule.
        for m in self.model.modules():
            self._handles.append(m.register_state_dict_pre_hook(_StateDictSizeCheck(self)))
            self._handles.append(m.register_load_state_dict_pre_hook(_load_copies))
        if self.modes.resident:
            self._pin_resident()
        # Buffers stay ordinary tensors, on the compute device and, when floating point, in
        # the compute dtype like module.to(dtype) — except a transformers model's, which get
        # the dtype its own from_pretrained(dtype=...) gives them (rotary frequencies stay
        # fp32, as in the plain bf16 model).
        if self.device.type != "cpu" or self.modes.mixed:
            kept = buffer_dtypes(self.model, self.modes.dtype) if self.modes.mixed else {}
            for m in self.model.modules():
                for k, b in m._buffers.items():
                    if b is not None:
                        dt = self.modes.dtype if b.is_floating_point() else b.dtype
                        dt = kept.get((id(m), k), dt)
                        m._buffers[k] = b.to(device=self.device, dtype=dt)

    def _pin_resident(self):
        self._resident_pins = []
        for g in range(self.session.num_groups):
            base = self.chunks.acquire(g, self._compute_kind)
            self._resident_pins.append((g, self._compute_kind))
            for i in self.groups[g].tensors:
                r = self.params[i]
                r.compute.data = self.chunks.slice(base, r)  # for good: units only swap slots
            if self.groups[g].trainable:
                self.chunks.on_stream()
                self.grads.hold[g] = self.session.acquire_for_write(g, _K.grad, self.session.compute_tier)
                self._resident_pins.append((g, _K.grad))

    def _wrap_root(self):
        # The root's forward: to tell "inside the model's forward" from "outside" in messages,
        # and to see its output (UnitHooks.root_exit).
        _wrap_forward(self.model, self.hooks.root_enter, self.hooks.root_exit, self._wrapped,
                      cls=_RootForward)

    def _traced(self) -> bool:
        """Whether acquires now are part of the order the engine records and follows:
        training forwards and backward, not eval / no_grad forwards."""
        return self.state.in_backward or torch.is_grad_enabled()

    # ---- what optimizer.py, checkpoint.py, serve.py and tensor.py use ----------------------
    @property
    def _closed(self) -> bool:
        return self.state.closed

    @property
    def _in_iteration(self) -> bool:
        return self.state.in_iteration

    @property
    def _in_backward(self) -> bool:
        return self.state.in_backward

    @property
    def _root_depth(self) -> int:
        return self.state.root_depth

    @_root_depth.setter
    def _root_depth(self, depth: int):
        self.state.root_depth = depth

    @property
    def _hyper_of_next_step(self):
        """The optimizer's hyper-parameters (optimizer_overlap backward), announced at each
        iteration's first forward; set by tiermem.initialize."""
        return self.hooks.hyper_of_next_step

    @_hyper_of_next_step.setter
    def _hyper_of_next_step(self, fn):
        self.hooks.hyper_of_next_step = fn

    @property
    def _act_spilled(self) -> list:
        return self.activations.spilled

    def _set_tracing(self, on: bool):
        self.chunks.set_tracing(on)

    def _on_stream(self):
        self.chunks.on_stream()

    # ---- state ---------------------------------------------------------------------------
    def param_value(self, r: _Param) -> torch.Tensor:
        """The fp32 value (the master in mixed precision) as an ordinary CPU tensor."""
        self.chunks.on_stream()
        return self.session.read_param(r.index).view(r.shape)

    def _check_materializable(self, module, what: str):
        """Raises MemoryError when the fp32 values of the managed parameters under `module`
        (each once) exceed the host memory free now, naming the bytes and the streaming ways
        out; `what` names the call."""
        if self.state.closed:
            return
        seen = {}
        for p in module.parameters():
            r = self.by_param.get(id(p))
            if r is not None:
                seen[r.index] = r.numel * 4
        need, free = sum(seen.values()), free_ram_bytes()
        if need > free:
            raise MemoryError(
                f"tiermem: {what} would hold {need} bytes ({need / 2**30:.2f} GiB) of fp32 "
                f"values in host memory, more than the {free} bytes ({free / 2**30:.2f} GiB) "
                "free now; stream them instead: tiermem.save_pretrained(model, DIR) or "
                "tiermem.save_weights(model, PATH) (safetensors, tensor by tensor), "
                "tiermem.save_checkpoint(model, optimizer, PATH) (the training state), or a "
                "submodule's state_dict()")

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        if self.state.closed or module._parameters is None:
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

    # ---- optimizer glue (grads.py) ------------------------------------------------------
    def sync_grads(self):
        """Before a step: tells the core which tensors have a gradient (``p.grad`` not None)
        and writes gradients the user assigned as plain tensors into the chunks."""
        self.grads.sync()

    def zero_grad(self, set_to_none: bool = True) -> bool:
        """Clears every gradient unless an accumulation window is open; True when it did."""
        return self.grads.zero_grad(set_to_none)

    def grad_stats(self) -> _C.GradStats:
        """The unscaled gradients' sum of squares and overflow over the whole model — summed
        over ranks when sharded (collective)."""
        return self.grads.grad_stats()

    def grad_norm(self) -> torch.Tensor:
        return self.grads.grad_norm()

    @property
    def loss_scale(self) -> float:
        return self.session.loss_scale

    def stats(self) -> dict:
        st = self.session.stats()
        # What no budget counts, to size the machine beside the budgets: the runtime's own host
        # buffers (the session's) and the most bytes the units' training forwards saved for
        # backward in one iteration under activations 'outside' (0 when a budget counts them;
        # None when resident training runs without the saved-tensor hooks that see them).
        st["outside_budget"]["saved_activation_bytes"] = (
            None if self._resident and not self._serving else self.activations.outside_peak)
        if self.activations.offload or self.recompute.all_units:
            st["activations"] = dict(self.activations.stats)
        # Split parameters' contiguous compute copies alive now and at most (bytes; within the
        # budget's compute room: one unit's copy at a time, none kept for the backward).
        st["split_copies"] = dict(self.chunks.copy_stats)
        if self._shards is not None:
            st["distributed"] = dict(self._shards.stats, world=self._shards.world,
                                     rank=self._shards.rank, backend=self._shards.backend)
        return st

    def timeline_peaks(self) -> dict:
        """Peak and budget per tier, bytes per tier pair and stalls, computed by tiermem::prof
        from the binary timeline file (not from the engine's counters)."""
        return self.session.timeline_report()

    def timeline_events(self) -> list:
        self.session.timeline_report()  # waits for moves and flushes
        return _C.read_timeline(self.session.timeline_path)

    @property
    def timeline_path(self) -> str:
        return self.session.timeline_path

    @property
    def model_bytes(self) -> int:
        return self.session.model_bytes

    @property
    def chunk_elems(self) -> int:
        return self.session.chunk_elems

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
        if self.state.closed:
            raise RuntimeError("tiermem: record_trace on a closed model")
        if self.modes.resident:
            where = "host" if self.session.host_compute else "device"
            raise RuntimeError(
                f"tiermem: record_trace: every chunk of this model fits in the {where} budget "
                f"({self.session.compute_budget} bytes), so nothing moves and there is no schedule to "
                f"plan; record with a {where} budget below the model's "
                f"{self.session.total_chunk_bytes} chunk bytes")
        self.session.record_trace(os.fspath(path), int(iterations))

    def finish_trace(self):
        """Writes the trace being recorded now (what was recorded so far). Returns its path,
        or None when no recording was armed; raises if writing failed."""
        if self.state.closed:
            return None
        path = self.session.written_trace if self.session.finish_trace() else None
        self.activations.recording_trace = False
        return path

    @property
    def written_trace(self):
        """The path of the last warm-up trace written, or None."""
        p = self.session.written_trace
        return p or None

    def abandon(self):
        """close() for a runtime whose set-up failed after it took the model: parameters built
        on the meta device go back there, so the model is as it was before."""
        params, weights = self.params, self._weights
        # A model built wholly on meta may be larger than RAM: its values are not made.
        self.close(keep_values=len(self._was_meta) < len(params))
        restore_meta(params, self._was_meta)
        if weights is not None:
            weights.restore()

    def close(self, keep_values: bool = True):
        """Gives the model back as an ordinary model (plain Parameters with the current values
        and gradients), detaches the hooks and frees every chunk. `keep_values=False` drops the
        values instead (the parameters are left empty): for a model larger than RAM, whose
        values could not all be in memory at once (save a checkpoint first to keep them)."""
        if self.state.closed:
            return
        if keep_values:  # MemoryError, before anything changes
            self._check_materializable(self.model, "close() keeping the values")
        self.session.finish_trace()  # a recording in progress ends before the values are read
        values = [self.param_value(r) if keep_values else None for r in self.params]
        grads = [self.ops.materialized_copy(r.grad)
                 if keep_values and r.trainable and r.param.grad is r.grad
                 else None for r in self.params]
        for h in self._handles:
            h.remove()
        for m in reversed(self._wrapped):
            _unwrap_forward(m)
        self.experts.close()
        for r, v, g in zip(self.params, values, grads):
            r.orig.data = (v.to(self.device) if v is not None
                           else torch.empty(0, dtype=r.orig.dtype, device=self.device))
            # Mixed precision: the values given back are the fp32 masters, and torch wants a
            # gradient of its parameter's dtype (the bf16/fp16 gradient, widened exactly).
            r.orig.grad = None if g is None else g.to(device=self.device, dtype=r.orig.dtype)
            for m, name in r.slots:
                m._parameters[name] = r.orig
        self.state.close()
        if self._shards is not None:
            self._shards.close()
        self.activations.spill_free_all()  # no spill copy in flight when the tiers go
        self.session.close()
        # Nor does the runtime keep the process group alive (the chunk access held it too).
        self._shards = self.chunks.shards = None
        if getattr(self.model, "_tiermem_runtime", None) is self:
            del self.model._tiermem_runtime
        self._drop_parts()

    def _drop_parts(self):
        """After close: drops every reference that made a cycle through the runtime (its parts
        and theirs, the ChunkTensors its records hold, the hooks' handles, the optimizer's
        groups, the units' forward wrappers), so the
        runtime, its closed session and the model given back go when their last reference
        does, without waiting for the cyclic collector (and a model dropped after close() takes
        its values with it). The session object stays: it answers what it was (sizes, paths)."""
        for name in _PARTS:
            # The parts' registrations with each other (on_reset, on_end...) are cycles too,
            # and they hold the session, the model and a bound method of the runtime: emptied.
            vars(getattr(self, name)).clear()
            setattr(self, name, _CLOSED_PART)
        for r in self.params:
            r.param = r.grad = r.compute = r.placeholder = None
            r.post_hooks.clear()
        for u in self.units:  # its forward wrapper and recompute frame held the hooks
            u.__dict__.pop("forward", None)
            u.__dict__.pop("frame", None)
        self._handles, self._wrapped, self.opt_groups = [], [], []
        self._weights = None
        self.__dict__.pop("_resident_pins", None)

    def __deepcopy__(self, memo):
        return None  # a deep copy of a managed model is an ordinary model (see tensor.py)

    def __reduce__(self):
        return (_no_runtime, ())  # torch.save(model): likewise (_StateDictHook)
