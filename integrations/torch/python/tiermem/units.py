"""Materialization units: which module subtrees have their parameters made real together.

A unit is a module whose whole subtree's parameters are materialized (views of chunk memory
on the device tier) from its pre-forward to its post-forward, and again for its backward. So
any code inside the unit's forward may read any parameter of the subtree — a parent reading a
child's weight (``nn.MultiheadAttention`` reads ``self.out_proj.weight``), parametrizations
(``weight_norm``), a module called twice — and computes exactly.

Default choice (like FSDP2's ``fully_shard`` per block): every child of an ``nn.ModuleList`` /
``nn.Sequential`` that has parameters is a unit (the repeated blocks of a transformer). Then,
walking down from the root, a module whose subtree contains no unit but has parameters becomes
a unit of its own (embeddings, final norm, head; or the whole model when it has no repeated
blocks), and a module that contains units gets a unit for its *direct* parameters only.

Override with ``units=``: a list of module classes (``[GPT2Block, nn.Embedding]``) or a
predicate ``fn(qualified_name, module) -> bool``. Matching is outermost-first (a match inside a
match is part of the outer unit); the rest is covered by the same walk as above.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from torch import nn


@dataclass
class Unit:
    name: str                  # qualified module name ("" = the root)
    module: nn.Module
    direct_only: bool          # True: only the module's own parameters (it contains units)
    # (module, attribute) slots of managed parameters inside this unit, filled by the runtime
    slots: list = field(default_factory=list)


# Containers are never called, so they cannot be units: module containers are walked into;
# parameter containers belong to the module that holds them (its forward reads them).
_MODULE_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_PARAM_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _own_modules(name: str, m: nn.Module):
    """`m` and its parameter containers (recursively): the modules whose parameters are m's."""
    yield name, m
    for cname, child in m.named_children():
        if isinstance(child, _PARAM_CONTAINERS):
            yield from _own_modules(f"{name}.{cname}" if name else cname, child)


def _has_own_params(m: nn.Module) -> bool:
    return any(next(x.parameters(recurse=False), None) is not None for _, x in _own_modules("", m))


def _matcher(units) -> Callable[[str, nn.Module], bool]:
    if units is None:
        return None
    if callable(units) and not isinstance(units, type):
        return units
    if isinstance(units, type):
        units = [units]
    classes = tuple(units)
    for c in classes:
        if not isinstance(c, type) or not issubclass(c, nn.Module):
            raise ValueError(f"units: expected nn.Module classes or a predicate, got {c!r}")
    return lambda name, m: isinstance(m, classes)


def find_units(model: nn.Module, units=None) -> list[Unit]:
    """The units of `model` (see the module docstring), in module order."""
    match = _matcher(units)
    chosen: dict[int, str] = {}  # id(module) -> name, the block units

    def pick(name: str, m: nn.Module):
        for cname, child in m.named_children():
            full = f"{name}.{cname}" if name else cname
            if match is not None:
                is_unit = bool(match(full, child))
            else:
                is_unit = isinstance(m, (nn.ModuleList, nn.Sequential)) and _has_params(child)
            if is_unit and _has_params(child) and not isinstance(
                    child, _MODULE_CONTAINERS + _PARAM_CONTAINERS):
                chosen[id(child)] = full
            elif not isinstance(child, _PARAM_CONTAINERS):
                pick(full, child)

    if isinstance(model, _MODULE_CONTAINERS + _PARAM_CONTAINERS):
        raise ValueError(f"the model is a {type(model).__name__}, which is never called; "
                         "pass the module whose forward runs")
    if match is not None and match("", model) and _has_params(model):
        chosen[id(model)] = ""
    else:
        pick("", model)

    def contains_unit(m: nn.Module) -> bool:
        return any(id(x) in chosen for x in m.modules())

    out: list[Unit] = []

    def walk(name: str, m: nn.Module):
        if id(m) in chosen:
            out.append(Unit(name, m, direct_only=False))
            return
        if not _has_params(m):
            return
        if isinstance(m, _MODULE_CONTAINERS):
            for cname, child in m.named_children():
                walk(f"{name}.{cname}" if name else cname, child)
            return
        if not contains_unit(m):
            out.append(Unit(name, m, direct_only=False))
            return
        if _has_own_params(m):
            out.append(Unit(name, m, direct_only=True))
        for cname, child in m.named_children():
            if not isinstance(child, _PARAM_CONTAINERS):
                walk(f"{name}.{cname}" if name else cname, child)

    walk("", model)
    # A recursive closure is a reference cycle (its cell holds it): emptied, so the units it
    # captured (and the modules and parameters they reach) go by reference counting.
    walk = pick = None  # noqa: F841
    return out


def unit_modules(unit: Unit) -> Iterable[tuple[str, nn.Module]]:
    """(qualified name, module) of every module whose parameters the unit materializes."""
    if unit.direct_only:
        yield from _own_modules(unit.name, unit.module)
        return
    for sub, m in unit.module.named_modules(remove_duplicate=False):
        yield (f"{unit.name}.{sub}" if unit.name and sub else (sub or unit.name)), m
