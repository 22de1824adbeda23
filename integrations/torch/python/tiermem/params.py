"""The managed parameters: one record (shared._Param) per parameter object of the model, and
the optimizer's param groups over them, checked before anything changes.

Invariants: a parameter object shared by several modules (tied weights) is one record with
one slot per (module, attribute); records are in module order and their ``index`` is the
session's tensor index; every trainable parameter is in exactly one param group; a frozen one
(``requires_grad=False``) and every parameter of a served model are not trainable.

Owns nothing after it returns: the runtime keeps the records.
Threading: the thread calling tiermem.initialize / tiermem.inference.
"""
from __future__ import annotations

import torch

from . import _C
from .shared import _Param
from .tensor import ChunkTensor


def collect_params(model, cfg, param_groups, serving: bool):
    """(records, id(user's parameter) -> record, param groups holding records): the
    ValueError of the first thing tiermem cannot manage, the model left as it was."""
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    seen: dict[int, _Param] = {}
    params: list[_Param] = []
    for mname, m in model.named_modules(remove_duplicate=False):
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
                if p.device.type not in ("cpu", "meta"):
                    raise ValueError(f"parameter {name} is on {p.device}; pass a CPU model, "
                                     "or one built on the meta device (tiermem places it)")
                if p.numel() == 0:
                    raise ValueError(f"parameter {name} has no elements")
                r = _Param(len(params), name, p.shape, p.numel(),
                           p.requires_grad and not serving, p)
                seen[id(p)] = r
                params.append(r)
            r.slots.append((m, pname))
    if not params:
        raise ValueError("model has no parameters")
    by_orig = {id(r.orig): r for r in params}
    defaults = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                    weight_decay=cfg.weight_decay)
    if param_groups is None:  # serving: no optimizer groups (nothing trains)
        param_groups = [] if serving else [
            {"params": [r.orig for r in params if r.trainable]}]
    opt_groups = []
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
        members.append([by_orig[id(p)].index if id(p) in by_orig else -1 for p in plist])
        og["plist"] = plist
        opt_groups.append(og)
    # The session's rule (runtime/param_groups.h): ValueError naming the group and tensor.
    group_of = _C.assign_param_groups([(r.name, r.trainable) for r in params], members)
    for r, gi in zip(params, group_of):
        r.opt_group = gi
    for og in opt_groups:
        og["params"] = [by_orig[id(p)] for p in og.pop("plist")]  # _Param records for now
    return params, by_orig, opt_groups


def _placeholder(shape, dtype, device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _contiguous_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
