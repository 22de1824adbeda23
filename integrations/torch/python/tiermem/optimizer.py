"""ChunkedAdamW: the optimizer returned by tiermem.initialize.

It is a torch.optim.Optimizer (so LR schedulers work: they edit ``param_groups``, which the
runtime reads at every step) whose state lives in chunks. ``state_dict()`` has the exact
layout of ``torch.optim.AdamW.state_dict()`` and loads into it; ``load_state_dict`` accepts
either. With ``gradient_accumulation_steps = N`` in the config, only every N-th ``step()``
updates (and only the ``zero_grad()`` after it clears the gradients).
"""
from __future__ import annotations

import torch

_ADAMW_DEFAULTS = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).defaults.items()}


class ChunkedAdamW(torch.optim.Optimizer):
    def __init__(self, runtime):
        self._runtime = runtime
        defaults = dict(_ADAMW_DEFAULTS)
        defaults.update(lr=runtime.cfg.lr, betas=runtime.cfg.betas, eps=runtime.cfg.eps,
                        weight_decay=runtime.cfg.weight_decay)
        groups = []
        for og in runtime.opt_groups:
            g = dict(og)
            groups.append(g)
        super().__init__(groups, defaults)
        runtime.opt_groups = self.param_groups  # one set of dicts: schedulers edit these
        self._micro = 0
        self._stepped = True
        self.last_step_skipped = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._micro += 1
        if self._micro % self._runtime.cfg.gradient_accumulation_steps != 0:
            self._stepped = False
            return loss
        self.last_step_skipped = not self._runtime.step()
        self._stepped = True
        return loss

    def scale_loss(self, loss):
        """``loss * loss_scale`` (fp16 dynamic loss scaling; the identity in fp32/bf16). Call
        ``optimizer.scale_loss(loss).backward()``; step() unscales the grads."""
        return self._runtime.scale_loss(loss)

    @property
    def loss_scale(self) -> float:
        return self._runtime.loss_scale

    def zero_grad(self, set_to_none: bool = True):
        if self._stepped:
            self._runtime.zero_grad()

    def _ordered(self):
        out = []
        for g in self.param_groups:
            for p in g["params"]:
                out.append(self._runtime.by_param[id(p)])
        return out

    def state_dict(self):
        state = {}
        groups = []
        idx = 0
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                r = self._runtime.by_param[id(p)]
                if r.step > 0:
                    state[idx] = {
                        "step": torch.tensor(float(r.step)),
                        "exp_avg": self._runtime.chunk_slice_copy(r, "exp_avg"),
                        "exp_avg_sq": self._runtime.chunk_slice_copy(r, "exp_avg_sq"),
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
        ordered = self._ordered()
        index_of = {}
        for saved in groups:
            for pid in saved["params"]:
                index_of[pid] = len(index_of)
        for pid, st in state_dict["state"].items():
            r = ordered[index_of[pid]]
            for k in ("exp_avg", "exp_avg_sq"):
                if tuple(st[k].shape) != tuple(r.shape):
                    raise ValueError(f"optimizer state '{k}' of {r.name}: shape "
                                     f"{tuple(st[k].shape)} != {tuple(r.shape)}")
        for r in ordered:
            r.step = 0
        for g in self._runtime.groups:
            if g.trainable:
                self._runtime.rt.zero(g.chunks["exp_avg"])
                self._runtime.rt.zero(g.chunks["exp_avg_sq"])
        for pid, st in state_dict["state"].items():
            r = ordered[index_of[pid]]
            r.step = int(float(st["step"]))
            self._runtime.write_slice(r, "exp_avg", st["exp_avg"].float())
            self._runtime.write_slice(r, "exp_avg_sq", st["exp_avg_sq"].float())
        for mine, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
