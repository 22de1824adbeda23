"""ChunkedAdamW: the optimizer returned by tiermem.initialize.

A torch.optim.Optimizer (so LR schedulers work: they edit ``param_groups``, which are read at
every step) over the model's managed parameters, whose state lives in chunks. ``step()`` hands
the per-group hyper-parameters to the session core, which runs AdamW (clipping, accumulation
and fp16 loss scaling from the config) on the fused CPU kernels. Parameters whose ``p.grad`` is
None are not stepped, as in torch. ``state_dict()`` has the exact layout of
``torch.optim.AdamW.state_dict()`` and loads into it; ``load_state_dict`` accepts either.
"""
from __future__ import annotations

import torch

from . import _C

_ADAMW_DEFAULTS = dict(torch.optim.AdamW([torch.zeros(1)]).defaults)
# Keys of a torch AdamW param group that must keep these values (tiermem runs plain AdamW).
_FIXED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


class ChunkedAdamW(torch.optim.Optimizer):
    def __init__(self, runtime):
        self._runtime = runtime
        defaults = dict(_ADAMW_DEFAULTS)
        defaults.update(lr=runtime.cfg.lr, betas=tuple(runtime.cfg.betas), eps=runtime.cfg.eps,
                        weight_decay=runtime.cfg.weight_decay)
        self._init_done = False
        super().__init__([dict(og) for og in runtime.opt_groups], defaults)
        self._init_done = True
        self.last_step_skipped = False
        self.last_grad_norm = None

    def add_param_group(self, param_group):
        if getattr(self, "_init_done", False):
            raise ValueError("tiermem: parameter groups are fixed at tiermem.initialize "
                             "(pass param_groups= there)")
        super().add_param_group(param_group)

    def _hyper(self):
        out = []
        for i, g in enumerate(self.param_groups):
            for k, want in _FIXED.items():
                if g.get(k, want) != want:
                    raise ValueError(f"tiermem: param group {i} sets {k}={g[k]!r}, which "
                                     "tiermem's AdamW does not support")
            b1, b2 = g["betas"]
            out.append(_C.GroupHyper(lr=float(g["lr"]), beta1=float(b1), beta2=float(b2),
                                     eps=float(g["eps"]), weight_decay=float(g["weight_decay"])))
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rt = self._runtime
        hyper = self._hyper()
        rt.sync_grads()
        rt._set_tracing(True)
        rt._on_stream()  # device-placed groups step on torch's current stream
        if rt._shards is not None:
            rt._shards.flush()  # the shards change: no cached full chunk outlives the step
        stats = None
        if rt._shards is not None and (rt.cfg.gradient_clipping > 0 or rt.modes.loss_scaled) and \
                rt.session.next_step_applies:
            # Sharded: the norm and overflow of the whole model, summed over ranks.
            stats = rt._shards.all_reduce_stats(rt.session.grad_stats())
        res = rt.session.step(hyper, stats)
        self.last_step_skipped = res.skipped
        self.last_grad_norm = res.grad_norm if res.grad_norm >= 0 else None
        return loss

    def scale_loss(self, loss):
        """``loss * loss_scale`` (fp16 dynamic loss scaling; the identity in fp32/bf16). Call
        ``optimizer.scale_loss(loss).backward()``; step() unscales the grads."""
        s = self._runtime.loss_scale
        return loss * s if s != 1.0 else loss

    @property
    def loss_scale(self) -> float:
        return self._runtime.loss_scale

    def grad_norm(self) -> torch.Tensor:
        """The total (unscaled) gradient norm, computed by the kernels over the grad chunks."""
        return self._runtime.grad_norm()

    def zero_grad(self, set_to_none: bool = True):
        self._runtime.zero_grad(set_to_none)

    def _records(self):
        return [self._runtime.by_param[id(p)] for g in self.param_groups for p in g["params"]]

    def state_dict(self):
        s = self._runtime.session
        state, groups, idx = {}, [], 0
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                r = self._runtime.by_param[id(p)]
                n = s.step_count(r.index)
                if n > 0:
                    state[idx] = {
                        "step": torch.tensor(float(n)),
                        "exp_avg": s.read_tensor(r.index, _C.ChunkKind.exp_avg).view(r.shape),
                        "exp_avg_sq": s.read_tensor(r.index, _C.ChunkKind.exp_avg_sq).view(r.shape),
                    }
                ids.append(idx)
                idx += 1
            gd = {k: v for k, v in g.items() if k != "params"}
            gd["params"] = ids
            groups.append(gd)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} param groups, expected "
                             f"{len(self.param_groups)}")
        for i, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(f"param group {i}: {len(saved['params'])} params in the state, "
                                 f"{len(mine['params'])} here")
        records = self._records()
        index_of = {}
        for saved in groups:
            for pid in saved["params"]:
                index_of[pid] = len(index_of)
        todo = {}
        for pid, st in state_dict["state"].items():
            if pid not in index_of:
                raise ValueError(f"optimizer state for unknown parameter index {pid}")
            r = records[index_of[pid]]
            for k in ("exp_avg", "exp_avg_sq"):
                if tuple(st[k].shape) != tuple(r.shape):
                    raise ValueError(f"optimizer state '{k}' of {r.name}: shape "
                                     f"{tuple(st[k].shape)} != {tuple(r.shape)}")
            todo[r.index] = (r, st)
        # Validated: now write (zero first, so parameters without state start fresh).
        s = self._runtime.session
        for g in range(s.num_groups):
            if self._runtime.groups[g].trainable:
                s.zero_chunk(g, _C.ChunkKind.exp_avg)
                s.zero_chunk(g, _C.ChunkKind.exp_avg_sq)
        for r in records:
            r_state = todo.get(r.index)
            s.set_step_count(r.index, int(float(r_state[1]["step"])) if r_state else 0)
            if r_state:
                for k, kind in (("exp_avg", _C.ChunkKind.exp_avg),
                                ("exp_avg_sq", _C.ChunkKind.exp_avg_sq)):
                    s.write_tensor(r.index, kind,
                                   r_state[1][k].detach().to("cpu", torch.float32)
                                   .reshape(-1).contiguous())
        for mine, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
