"""The PyTorch side of tiermem: module hooks, saved-tensor hooks and the chunked optimizer.

Parameters are packed (first-use order = module registration order) into chunk groups laid
out by the C++ engine: trainable params get param/grad/exp_avg/exp_avg_sq chunks, frozen ones
only a param chunk. Outside of use a param's ``.data`` is a zero-byte placeholder with its
shape; around a module's forward it is a view of its param chunk on the device tier.

Backward does not need ``.data``: autograd reads what it saved. A saved-tensors hook packs any
saved tensor that aliases chunk memory as (group, offset, shape, strides) and unpacks it as a
view of the chunk's *current* device copy, acquiring (pinning) the chunk for the backward; the
pin is dropped once every param of the group used in the forward has its gradient (or at the
end of backward). Gradients are added into grad chunks by post-accumulate-grad hooks, and
``p.grad`` is set back to None. ``optimizer.step()`` runs the fused CPU AdamW kernel
(tiermem::kernels_cpu, equal to ``torch.optim.AdamW``) on the host copies of the chunks:
grad -> m, v, fp32 master, and in mixed precision the bf16/fp16 copy the device computes with.
Global-norm clipping and fp16 overflow detection use the kernels' GradNormAndOverflow.

Precision: in fp32 the ``param`` chunk is both the compute copy and the master. In bf16/fp16
a group has a low-precision ``param`` chunk (device compute) and ``grad`` chunk, and fp32
``master``, ``exp_avg`` and ``exp_avg_sq`` chunks that only the optimizer touches (on host).
fp16 uses dynamic loss scaling (``optimizer.scale_loss(loss)``; an overflow skips the step and
halves the scale; ``growth_interval`` good steps double it), like torch.amp.GradScaler.

Threading: one training thread (like the model itself).
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from . import _C
from .config import Config

_CAT_PARAM, _CAT_GRAD, _CAT_OPTIM = 0, 1, 2
_MIN_RESIDENT_CHUNKS = 4
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _Param:
    index: int
    param: nn.Parameter
    name: str
    shape: torch.Size
    numel: int
    trainable: bool
    group: int = -1
    offset: int = 0
    opt_group: int = 0
    step: int = 0
    has_grad: bool = False
    placeholder: Any = None  # the zero-byte stand-in for .data, made once


@dataclass
class _Group:
    index: int
    trainable: bool
    used: int  # elements
    chunks: dict = field(default_factory=dict)  # kind -> chunk id
    params: list = field(default_factory=list)


class _ChunkRef:
    __slots__ = ("group", "offset", "size", "stride", "dtype")

    def __init__(self, group, offset, size, stride, dtype):
        self.group, self.offset, self.size, self.stride, self.dtype = (
            group, offset, size, stride, dtype)


def _placeholder(shape: torch.Size, dtype: torch.dtype, device=None) -> torch.Tensor:
    # Correct shape, no storage behind it: reads give zeros, never chunk memory.
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _device_kind(cfg: Config) -> str:
    kind = cfg.device_kind
    if kind == "sim":
        return "sim"
    has_gpu = torch.cuda.is_available()
    if kind == "cuda":
        if not has_gpu:
            raise RuntimeError("device 'cuda' requested (TIERMEM_DEVICE/device_kind) but there is "
                               "no CUDA device (torch.cuda.is_available() is False)")
        if not _C.cuda_built():
            raise RuntimeError("device 'cuda' requested but this tiermem build has no CUDA support")
        return "cuda"
    return "cuda" if has_gpu and _C.cuda_built() else "sim"


class TiermemRuntime:
    """Owns the engine and the hooks of one initialized model."""

    def __init__(self, model: nn.Module, cfg: Config, param_groups: list[dict] | None):
        self.model = model
        self.cfg = cfg
        self.mixed = cfg.precision in _LOW
        self.dtype = _LOW.get(cfg.precision, torch.float32)  # compute (param, grad) dtype
        self.kind_dtype = {"param": self.dtype, "grad": self.dtype, "master": torch.float32,
                           "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
        self.loss_scale = float(cfg.initial_scale) if cfg.precision == "fp16" else 1.0
        self._good_steps = 0
        self.skipped_steps = 0
        self._handles: list = []
        self._closed = False
        kind = _device_kind(cfg)
        self.device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
        self._collect_params(param_groups)
        self._plan_layout()
        self._own_timeline = cfg.timeline is None
        if self._own_timeline:
            fd, self.timeline_path = tempfile.mkstemp(prefix="tiermem-", suffix=".tmt")
            os.close(fd)
        else:
            self.timeline_path = cfg.timeline
            d = os.path.dirname(self.timeline_path)
            if d:
                os.makedirs(d, exist_ok=True)
        try:
            self.rt = _C.Runtime(cfg.device_budget, cfg.host_budget, cfg.nvme_path or "",
                                 cfg.nvme_size, cfg.prefetch_depth, self._host_reserve,
                                 self.chunk_bytes, self.timeline_path, kind)
        except BaseException:
            self._drop_timeline()
            raise
        try:
            self._create_chunks()
            self._load_initial_values()
        except BaseException:
            self.rt.close()  # frees every region
            self.rt = None
            self._drop_timeline()
            raise
        # From here on nothing can fail: take over the params.
        self._live: dict[int, int] = {}        # device data_ptr -> group (acquired chunks)
        self._fwd_pins: list[list] = []        # per active module forward: [(group, kind)]
        self._bwd_hold: dict[int, torch.Tensor] = {}  # group -> device base view
        self._bwd_pending: dict[int, set] = {}         # group -> params awaiting grads
        self._fwd_used: dict[int, set] = {}            # group -> params used with grad
        self._grad_hold: dict[int, torch.Tensor] = {}  # group -> device grad chunk view
        self._grad_pending: dict[int, set] = {}        # group -> params awaiting grads
        # Holding a grad chunk across its group's backward saves an acquire per param but pins
        # it: only worth it when every param and grad chunk fits on the device at once (below
        # that, the engine needs to evict grad chunks between hooks; holding them re-fetches
        # more params: 1.45x instead of 1.30x the minimum h2d at a 25% budget).
        compute_bytes = sum(self.kind_bytes["param"] + (self.kind_bytes["grad"] if g.trainable
                                                        else 0) for g in self.groups)
        self._hold_grads = cfg.device_budget >= compute_bytes
        self._callback_queued = False
        self._in_iteration = False
        for r in self.params:
            r.placeholder = _placeholder(r.shape, self.dtype, self.device)
            r.param.data = r.placeholder
        # Buffers stay ordinary tensors, on the compute device and (like module.to(dtype))
        # in the compute dtype when floating point.
        if self.device.type != "cpu" or self.mixed:
            for m in self.model.modules():
                for k, b in m._buffers.items():
                    if b is not None:
                        dt = self.dtype if b.is_floating_point() else b.dtype
                        m._buffers[k] = b.to(device=self.device, dtype=dt)
        self._install_hooks()

    def _drop_timeline(self):
        if self._own_timeline:
            try:
                os.unlink(self.timeline_path)
            except OSError:
                pass

    # ---- set-up ------------------------------------------------------------------------------
    def _collect_params(self, param_groups):
        seen: dict[int, _Param] = {}
        self.params: list[_Param] = []
        self.module_params: dict[nn.Module, list[_Param]] = {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for mname, m in self.model.named_modules():
            lst = []
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    if p.dtype != torch.float32:
                        raise ValueError(f"parameter {names.get(id(p), '?')} is {p.dtype}; "
                                         "tiermem expects an fp32 model")
                    if p.device.type != "cpu":
                        raise ValueError(f"parameter {names.get(id(p), '?')} is on {p.device}; "
                                         "pass a CPU model (tiermem places it)")
                    r = _Param(len(self.params), p, names.get(id(p), mname), p.shape,
                               p.numel(), p.requires_grad)
                    seen[id(p)] = r
                    self.params.append(r)
                if seen[id(p)] not in lst:
                    lst.append(seen[id(p)])
            if lst:
                self.module_params[m] = lst
        if not self.params:
            raise ValueError("model has no parameters")
        self.by_param = {id(r.param): r for r in self.params}
        # Optimizer param groups (torch-style: [{"params": [...], "lr": ...}, ...]).
        defaults = dict(lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.eps,
                        weight_decay=self.cfg.weight_decay)
        if param_groups is None:
            param_groups = [{"params": [r.param for r in self.params if r.trainable]}]
        self.opt_groups = []
        assigned = set()
        for gi, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise ValueError(f"param_groups[{gi}] must be a dict with 'params'")
            bad = sorted(set(g) - {"params", "lr", "betas", "eps", "weight_decay"})
            if bad:
                raise ValueError(f"param_groups[{gi}]: unknown key(s) {bad}")
            og = dict(defaults)
            og.update({k: v for k, v in g.items() if k != "params"})
            plist = list(g["params"])
            for p in plist:
                r = self.by_param.get(id(p))
                if r is None:
                    raise ValueError(f"param_groups[{gi}] holds a tensor that is not a parameter of the model")
                if id(p) in assigned:
                    raise ValueError(f"param_groups[{gi}]: parameter {r.name} appears in more than one group")
                assigned.add(id(p))
                r.opt_group = gi
            og["params"] = plist
            self.opt_groups.append(og)
        for r in self.params:
            if r.trainable and id(r.param) not in assigned:
                raise ValueError(f"trainable parameter {r.name} is in no param group")

    def _plan_layout(self):
        trainable = [r for r in self.params if r.trainable]
        frozen = [r for r in self.params if not r.trainable]
        numels = [r.numel for r in self.params]
        esize = 2 if self.mixed else 4
        # Device working set: param + grad chunks, MIN_RESIDENT of them.
        per_elem = esize + (esize if trainable else 0)
        if self.cfg.chunk_size is None:
            elems, waste, _ = _C.choose_chunk_elems(numels, self.cfg.device_budget, per_elem,
                                                    _MIN_RESIDENT_CHUNKS)
        else:
            elems = self.cfg.chunk_size
            need = elems * per_elem * _MIN_RESIDENT_CHUNKS
            if need > self.cfg.device_budget:
                raise MemoryError(f"device budget of {self.cfg.device_budget} bytes is below the "
                                  f"minimum of {need} bytes for chunk_size={elems}")
        self.chunk_elems = elems
        self.groups: list[_Group] = []
        for subset, is_trainable in ((trainable, True), (frozen, False)):
            if not subset:
                continue
            placements, ngroups, _ = _C.pack_tensors([r.numel for r in subset], elems)
            base = len(self.groups)
            for g in range(ngroups):
                self.groups.append(_Group(base + g, is_trainable, 0))
            for r, (g, off) in zip(subset, placements):
                r.group, r.offset = base + g, off
                grp = self.groups[base + g]
                grp.params.append(r)
                grp.used = max(grp.used, off + r.numel)
        self.chunk_bytes = elems * 4  # the largest (fp32) chunk of a group
        self.kind_bytes = {k: elems * d.itemsize for k, d in self.kind_dtype.items()}
        per_trainable = 16 + (4 if self.mixed else 0)
        self.model_bytes = (sum(r.numel for r in trainable) * per_trainable +
                            sum(r.numel for r in frozen) * esize)
        # Host room for caches of NVMe-homed chunks: every kind of one group at once.
        page = 4096
        self._host_reserve = (5 * ((self.chunk_bytes + page - 1) // page * page)
                              if self.cfg.nvme_size else 0)

    def _create_chunks(self):
        # Params and grads first so they get host homes; optimizer state spills to NVMe first.
        order = [("param", _CAT_PARAM), ("grad", _CAT_GRAD)]
        if self.mixed:
            order.append(("master", _CAT_PARAM))
        order += [("exp_avg", _CAT_OPTIM), ("exp_avg_sq", _CAT_OPTIM)]
        for kind, cat in order:
            for g in self.groups:
                if kind != "param" and not g.trainable:
                    continue
                if kind == "master" and not g.trainable:
                    continue
                g.chunks[kind] = self.rt.add_chunk(self.kind_bytes[kind], cat)

    def _load_initial_values(self):
        for g in self.groups:
            kinds = ["param"] + (["master"] if "master" in g.chunks else [])
            for kind in kinds:
                cid = g.chunks[kind]
                base = self.rt.acquire(cid, "host", self.kind_dtype[kind], g.used)
                try:
                    with torch.no_grad():
                        for r in g.params:
                            base[r.offset:r.offset + r.numel].copy_(r.param.data.reshape(-1))
                finally:
                    self.rt.release(cid, True)

    # ---- chunk access -----------------------------------------------------------------------
    def _acquire(self, group: int, kind: str, tier: str) -> torch.Tensor:
        g = self.groups[group]
        base = self.rt.acquire(g.chunks[kind], tier, self.kind_dtype[kind], g.used)
        if tier == "device" and kind == "param":
            self._live[base.data_ptr()] = group
        return base

    def _release(self, group: int, kind: str, modified: bool, base: torch.Tensor | None = None):
        g = self.groups[group]
        cid = g.chunks[kind]
        self.rt.release(cid, modified)
        if base is not None and kind == "param" and self.rt.pins(cid) == 0:
            if self._live.get(base.data_ptr()) == group:
                del self._live[base.data_ptr()]

    # ---- hooks ------------------------------------------------------------------------------
    def _install_hooks(self):
        for m, plist in self.module_params.items():
            self._handles.append(m.register_forward_pre_hook(self._make_pre_forward(m, plist)))
            self._handles.append(m.register_forward_hook(self._make_post_forward(m, plist),
                                                         always_call=True))
        for r in self.params:
            if r.trainable:
                self._handles.append(
                    r.param.register_post_accumulate_grad_hook(self._make_grad_hook(r)))
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(root._register_state_dict_hook(self._state_dict_hook))
        self._handles.append(root._register_load_state_dict_pre_hook(self._load_pre_hook,
                                                                     with_module=True))
        self._handles.append(root.register_load_state_dict_post_hook(self._load_post_hook))

    def _root_pre_forward(self, module, args):
        if torch.is_grad_enabled() and not self._in_iteration:
            self.rt.begin_iteration()
            self._in_iteration = True
        self.rt.phase("forward")

    def _make_pre_forward(self, m, plist):
        label = f"{type(m).__name__}:pre-forward"

        def hook(module, args):
            self.rt.moment(label)
            pins = []
            views = {}
            try:
                for r in plist:
                    if r.group not in views:
                        views[r.group] = self._acquire(r.group, "param", "device")
                        pins.append((r.group, views[r.group]))
                    base = views[r.group]
                    r.param.data = base[r.offset:r.offset + r.numel].view(r.shape)
                    if torch.is_grad_enabled() and r.trainable:
                        self._fwd_used.setdefault(r.group, set()).add(r.index)
            except BaseException:
                for g, b in pins:
                    self._release(g, "param", False, b)
                for r in plist:
                    r.param.data = r.placeholder
                raise
            self._fwd_pins.append(pins)
            if torch.is_grad_enabled():
                torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
                self._fwd_pins[-1] = (pins, True)
            else:
                self._fwd_pins[-1] = (pins, False)
        return hook

    def _make_post_forward(self, m, plist):
        def hook(module, args, output):
            pins, pushed = self._fwd_pins.pop()
            if pushed:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            for r in plist:
                r.param.data = r.placeholder
            for g, b in pins:
                self._release(g, "param", False, b)
            return None
        return hook

    def _pack(self, t: torch.Tensor):
        if t.device.type != "cpu" and t.device.type != "cuda":
            return t
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        g = self._live.get(ptr)
        if g is None:
            return t
        return _ChunkRef(g, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)

    def _unpack(self, ref):
        if not isinstance(ref, _ChunkRef):
            return ref
        self._queue_end_of_backward()
        base = self._bwd_hold.get(ref.group)
        if base is None:
            self.rt.moment("pre-backward")
            base = self._acquire(ref.group, "param", "device")
            self._bwd_hold[ref.group] = base
            self._bwd_pending[ref.group] = set(self._fwd_used.get(ref.group, ()))
            if not self._bwd_pending[ref.group]:
                pass  # released at the end of backward
        return base.as_strided(ref.size, ref.stride, ref.offset)

    def _queue_end_of_backward(self):
        if not self._callback_queued:
            self._callback_queued = True
            self.rt.phase("backward")  # the first hook of a backward pass marks its start
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        for g, base in list(self._bwd_hold.items()):
            self._release(g, "param", False, base)
        self._bwd_hold.clear()
        self._bwd_pending.clear()
        for g in list(self._grad_hold):
            self._release_grad(g)
        self._grad_pending.clear()
        self._fwd_used.clear()
        self._callback_queued = False
        self._in_iteration = False

    def _release_grad(self, group: int):
        del self._grad_hold[group]
        self._grad_pending.pop(group, None)
        self.rt.release(self.groups[group].chunks["grad"], True)

    def _make_grad_hook(self, r: _Param):
        # The grad chunk of a group stays acquired from its first gradient until every param
        # of the group used in the forward has its gradient (or the end of backward): one
        # acquire per group and backward instead of one per param (when _hold_grads; else one
        # acquire per param as before). It is acquired for write,
        # so a lazily zero chunk is zeroed on the device, not by a copy from a zeros buffer.
        g = self.groups[r.group]
        rng = slice(r.offset, r.offset + r.numel)

        def hook(p):
            self._queue_end_of_backward()
            grad = p.grad
            p.grad = None
            if grad is None:
                return
            base = self._grad_hold.get(r.group)
            if base is None:
                base = self.rt.acquire_for_write(g.chunks["grad"], "device", self.dtype, g.used)
                self._grad_hold[r.group] = base
                self._grad_pending[r.group] = set(self._fwd_used.get(r.group, ()))
            with torch.no_grad():
                base[rng].add_(grad.reshape(-1))
            r.has_grad = True
            gpending = self._grad_pending[r.group]
            gpending.discard(r.index)
            if not gpending or not self._hold_grads:
                self._release_grad(r.group)
            pending = self._bwd_pending.get(r.group)
            if pending is not None:
                pending.discard(r.index)
                if not pending and r.group in self._bwd_hold:
                    self._release(r.group, "param", False, self._bwd_hold.pop(r.group))
                    del self._bwd_pending[r.group]
        return hook

    # ---- optimizer --------------------------------------------------------------------------
    def zero_grad(self):
        for g in self.groups:
            if g.trainable:
                self.rt.zero(g.chunks["grad"])
        for r in self.params:
            r.has_grad = False

    def _host_views(self, g: _Group, kinds: Iterable[str]):
        return {k: self.rt.acquire(g.chunks[k], "host", self.kind_dtype[k], g.used) for k in kinds}

    def grad_stats(self) -> tuple[float, bool]:
        """(sum of squares of the unscaled grads, any NaN/Inf) over every grad chunk, by the
        kernels' GradNormAndOverflow (accumulated in double)."""
        sq, overflow = 0.0, False
        for g in self.groups:
            if not g.trainable:
                continue
            base = self.rt.acquire(g.chunks["grad"], "host", self.dtype, g.used)
            try:
                s, o = _C.grad_stats(base)
            finally:
                self.rt.release(g.chunks["grad"], False)
            sq += s
            overflow = overflow or o
        return sq / (self.loss_scale * self.loss_scale), overflow

    def grad_norm(self) -> torch.Tensor:
        return torch.tensor(math.sqrt(self.grad_stats()[0]), dtype=torch.float32)

    def scale_loss(self, loss):
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    @torch.no_grad()
    def step(self) -> bool:
        """One optimizer step over every chunk group; False when fp16 overflow skipped it."""
        self.rt.phase("optimizer")
        clip = 1.0
        if self.cfg.gradient_clipping > 0 or self.cfg.precision == "fp16":
            sq, overflow = self.grad_stats()
            if overflow and self.cfg.precision == "fp16":
                self.loss_scale *= self.cfg.backoff_factor
                self._good_steps = 0
                self.skipped_steps += 1
                return False
            if self.cfg.gradient_clipping > 0:
                # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1.
                total = torch.tensor(math.sqrt(sq), dtype=torch.float32)
                clip = float(torch.clamp(self.cfg.gradient_clipping / (total + 1e-6), max=1.0))
        inv_scale = 1.0 / self.loss_scale
        kinds = ["param", "grad", "exp_avg", "exp_avg_sq"] + (["master"] if self.mixed else [])
        for g in self.groups:
            if not g.trainable or not any(r.has_grad for r in g.params):
                continue
            self.rt.moment("optimizer-substep")
            v = self._host_views(g, kinds)
            try:
                master = v["master"] if self.mixed else v["param"]
                # Runs of adjacent params with the same group and step go in one kernel call.
                runs = []
                for r in g.params:
                    if not r.has_grad:
                        continue
                    r.step += 1
                    last = runs[-1] if runs else None
                    if (last and last[1] == r.offset and last[2] == r.opt_group and
                            last[3] == r.step):
                        last[1] = r.offset + r.numel
                    else:
                        runs.append([r.offset, r.offset + r.numel, r.opt_group, r.step])
                for lo, hi, gi, step in runs:
                    og = self.opt_groups[gi]
                    b1, b2 = og["betas"]
                    _C.adam_step(master[lo:hi], v["grad"][lo:hi], v["exp_avg"][lo:hi],
                                 v["exp_avg_sq"][lo:hi], v["param"][lo:hi] if self.mixed else None,
                                 float(og["lr"]), float(b1), float(b2), float(og["eps"]),
                                 float(og["weight_decay"]), int(step), inv_scale, clip)
            finally:
                for k in kinds:
                    self.rt.release(g.chunks[k], k != "grad")
        if self.cfg.precision == "fp16":
            self._good_steps += 1
            if self._good_steps >= self.cfg.growth_interval:
                self.loss_scale *= self.cfg.growth_factor
                self._good_steps = 0
        return True

    # ---- state ------------------------------------------------------------------------------
    def param_value(self, r: _Param) -> torch.Tensor:
        """A consolidated copy of the fp32 param (an ordinary tensor)."""
        g = self.groups[r.group]
        kind = "master" if "master" in g.chunks else "param"
        base = self.rt.acquire(g.chunks[kind], "host", self.kind_dtype[kind], g.used)
        try:
            return base[r.offset:r.offset + r.numel].clone().view(r.shape)
        finally:
            self.rt.release(g.chunks[kind], False)

    def chunk_slice_copy(self, r: _Param, kind: str) -> torch.Tensor:
        g = self.groups[r.group]
        base = self.rt.acquire(g.chunks[kind], "host", torch.float32, g.used)
        try:
            return base[r.offset:r.offset + r.numel].clone().view(r.shape)
        finally:
            self.rt.release(g.chunks[kind], False)

    def write_slice(self, r: _Param, kind: str, value: torch.Tensor):
        g = self.groups[r.group]
        if tuple(value.shape) != tuple(r.shape):
            raise ValueError(f"{kind} of {r.name}: shape {tuple(value.shape)} != {tuple(r.shape)}")
        base = self.rt.acquire(g.chunks[kind], "host", torch.float32, g.used)
        try:
            with torch.no_grad():
                base[r.offset:r.offset + r.numel].copy_(value.reshape(-1))
        finally:
            self.rt.release(g.chunks[kind], True)

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            key = name if not prefix else name
            r = self.by_param.get(id(p))
            if r is not None and key in state_dict:
                state_dict[key] = self.param_value(r)
        return state_dict

    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # Materialize every param as a view of its host master chunk (fp32: the param chunk)
        # so the default loader copies straight into the chunks.
        self._loading = []
        for g in self.groups:
            kind = "master" if "master" in g.chunks else "param"
            base = self.rt.acquire(g.chunks[kind], "host", self.kind_dtype[kind], g.used)
            self._loading.append((g, kind, base))
            for r in g.params:
                r.param.data = base[r.offset:r.offset + r.numel].view(r.shape)

    def _load_post_hook(self, module, incompatible):
        for g, kind, base in getattr(self, "_loading", []):
            if kind == "master":  # refresh the low-precision compute copy from the master
                low = self.rt.acquire(g.chunks["param"], "host", self.dtype, g.used)
                try:
                    with torch.no_grad():
                        low.copy_(base)
                finally:
                    self.rt.release(g.chunks["param"], True)
            self.rt.release(g.chunks[kind], True)
        self._loading = []
        for r in self.params:
            r.param.data = r.placeholder

    def stats(self) -> dict:
        return self.rt.stats()

    def timeline_peaks(self) -> dict:
        """Peak and budget per tier, bytes per tier pair and stalls, computed by tiermem::prof
        from the binary timeline file (not from the engine's counters)."""
        return self.rt.timeline_report()

    def timeline_events(self) -> list:
        """Every event of the timeline file so far, in time order: tuples (ts_ns, type, tier,
        tier2, bytes, chunk, category, flags, label, id) read by runtime/base's reader."""
        self.rt.synchronize()
        self.rt.timeline_report()  # flushes
        return _C.read_timeline(self.timeline_path)

    def close(self):
        """Detaches the hooks and gives the params back as ordinary tensors."""
        if self._closed:
            return
        values = [self.param_value(r) for r in self.params]
        for h in self._handles:
            h.remove()
        for r, v in zip(self.params, values):
            r.param.data = v
        self._closed = True
        self.rt.close()
        self.rt = None
        self._drop_timeline()

    def __del__(self):
        rt = getattr(self, "rt", None)
        if rt is not None:
            rt.close()
            self.rt = None
        if getattr(self, "_own_timeline", False):
            self._drop_timeline()
