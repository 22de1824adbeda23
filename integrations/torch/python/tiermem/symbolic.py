"""Symbolic tensors: transformers' weight conversions run on tensors that hold no values, only
where each of their elements comes from, so that a conversion becomes the core's *segments*
(runtime/weights.h) — for loading, which checkpoint key fills which elements of a parameter;
for exporting, which elements of a session tensor make which checkpoint key.

transformers 5 converts checkpoint keys with ``WeightConverter`` operations
(core_model_loading.py: ``MergeModulelist`` stacks per-expert tensors, ``Concatenate`` joins
gate and up, ``Chunk`` / ``SplitModulelist`` undo them on save, ``Transpose``...). hf.py runs
transformers' own converters — their code decides the order and the names — on ``Sym``
tensors instead of real ones: ``torch.stack``, ``torch.cat``, ``torch.chunk``,
``torch.split``, ``torch.transpose`` and the shape-only methods (``view``, ``reshape``,
``squeeze``, ``contiguous``...) are computed on the element layout; any other torch function
raises ``Unsupported`` naming it (hf.py names the transformers op it came from). Nothing here
allocates a tensor: a conversion of any size costs only its list of parts.

A Sym's elements (row-major, like a contiguous tensor of its shape) are covered, in order and
exactly once, by its parts: a part fills elements [dst, dst + numel) from its source's elements
[src_off, src_off + numel) or, transposed, from a [rows, cols] block of the source starting at
src_off, laid out as its [cols, rows] transpose (the core's 2-D transposed segment). A
transposed part is never cut: an op that would cut one raises Unsupported.

Threading: none (pure functions of their arguments).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Hashable

import torch

# A conversion scattering a tensor into more parts than this (a transpose of a large
# non-2-D block, a cut along the last dimension) is not something segments express usefully.
_MAX_PARTS = 1 << 20


class Unsupported(Exception):
    """A torch operation that a symbolic tensor cannot express as parts (``.what`` names it)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@dataclass(frozen=True)
class Part:
    dst: int  # first element of the tensor it fills
    numel: int
    src: Hashable  # the source: a checkpoint key (loading) or a session tensor (exporting)
    src_off: int  # first element of the source it takes
    rows: int = 0  # transposed: the source's [rows, cols] block lands as [cols, rows]; 0: not
    cols: int = 0


def _numel(shape) -> int:
    return math.prod(shape)


def _dim(d: int, ndim: int) -> int:
    if not -ndim <= d < max(ndim, 1):
        raise Unsupported(f"dimension {d} of a {ndim}-D tensor")
    return d % ndim if ndim else 0


class Sym:
    """A symbolic tensor (see the module docstring): a shape and the parts covering it."""

    __slots__ = ("shape", "parts", "_starts")

    def __init__(self, shape, parts: list[Part]):
        self.shape = torch.Size(shape)
        self.parts = parts
        self._starts = [p.dst for p in parts]

    @classmethod
    def source(cls, src: Hashable, shape) -> Sym:
        """The whole of `src`, of `shape`, as it is."""
        n = _numel(shape)
        return cls(shape, [Part(0, n, src, 0)] if n else [])

    # ---- what transformers' ops read -------------------------------------------------------
    def numel(self) -> int:
        return _numel(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, d=None):
        return self.shape if d is None else self.shape[_dim(d, self.ndim)]

    def __repr__(self):
        return f"Sym({list(self.shape)}, {len(self.parts)} parts)"

    # ---- layout-preserving methods -----------------------------------------------------------
    def _as(self, shape) -> Sym:
        shape = list(shape)
        if -1 in shape:
            known = _numel([s for s in shape if s != -1])
            shape[shape.index(-1)] = self.numel() // known if known else 0
        if _numel(shape) != self.numel():
            raise Unsupported(f"a view of {list(self.shape)} as {shape}")
        return Sym(shape, self.parts)

    def contiguous(self, *args, **kwargs) -> Sym:
        return self

    clone = detach = contiguous

    def view(self, *shape) -> Sym:
        return self._as(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    reshape = view

    def squeeze(self, d=None) -> Sym:
        if d is None:
            return self._as([s for s in self.shape if s != 1])
        d = _dim(d, self.ndim)
        return self._as([s for i, s in enumerate(self.shape) if i != d or s != 1])

    def unsqueeze(self, d) -> Sym:
        shape = list(self.shape)
        shape.insert(d % (len(shape) + 1), 1)
        return self._as(shape)

    def flatten(self, start_dim=0, end_dim=-1) -> Sym:
        if not self.ndim:
            return self._as([1])
        a, b = _dim(start_dim, self.ndim), _dim(end_dim, self.ndim)
        return self._as(list(self.shape[:a]) + [_numel(self.shape[a:b + 1])]
                        + list(self.shape[b + 1:]))

    # ---- element moves -------------------------------------------------------------------------
    def transpose(self, dim0, dim1) -> Sym:
        return _transpose(self, dim0, dim1)

    def t(self) -> Sym:
        return _transpose(self, 0, 1)

    def chunk(self, chunks, dim=0):
        return _chunk(self, chunks, dim)

    def split(self, split_size_or_sections, dim=0):
        return _split(self, split_size_or_sections, dim)

    def _parts_in(self, a: int, b: int):
        """The parts overlapping elements [a, b)."""
        i = max(bisect.bisect_right(self._starts, a) - 1, 0)
        while i < len(self.parts) and self.parts[i].dst < b:
            p = self.parts[i]
            if p.dst + p.numel > a:
                yield p
            i += 1

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _TORCH.get(func)
        if op is None:
            raise Unsupported(f"torch.{getattr(func, '__name__', func)}")
        return op(*args, **kwargs)


def _gather(pieces, shape) -> Sym:
    """The Sym of `shape` whose elements are elements [a, b) of each (Sym, a, b), in order."""
    out: list[Part] = []
    at = 0
    for t, a, b in pieces:
        for p in t._parts_in(a, b):
            lo, hi = max(a, p.dst), min(b, p.dst + p.numel)
            if p.rows and (lo, hi) != (p.dst, p.dst + p.numel):
                raise Unsupported("a cut through a transposed block")
            q = Part(at + (lo - a), hi - lo, p.src, p.src_off + (0 if p.rows else lo - p.dst),
                     p.rows, p.cols)
            last = out[-1] if out else None
            if (last is not None and not q.rows and not last.rows and last.src == q.src
                    and last.src_off + last.numel == q.src_off):
                out[-1] = Part(last.dst, last.numel + q.numel, q.src, last.src_off)
            else:
                out.append(q)
            if len(out) > _MAX_PARTS:
                raise Unsupported(f"a layout of more than {_MAX_PARTS} parts")
        at += b - a
    return Sym(shape, out)


def _cat(tensors, dim=0) -> Sym:
    tensors = list(tensors)
    if not tensors:
        raise Unsupported("torch.cat of no tensors")
    nd = tensors[0].ndim
    d = _dim(dim, nd)
    for t in tensors:
        if t.ndim != nd or any(t.shape[i] != tensors[0].shape[i] for i in range(nd) if i != d):
            raise Unsupported(f"torch.cat of shapes {[list(x.shape) for x in tensors]}")
    outer = _numel(tensors[0].shape[:d])
    inner = [t.shape[d] * _numel(t.shape[d + 1:]) for t in tensors]
    shape = list(tensors[0].shape)
    shape[d] = sum(t.shape[d] for t in tensors)
    return _gather([(t, o * n, (o + 1) * n) for o in range(outer)
                    for t, n in zip(tensors, inner)], shape)


def _stack(tensors, dim=0) -> Sym:
    tensors = list(tensors)
    if not tensors or any(t.shape != tensors[0].shape for t in tensors):
        raise Unsupported(f"torch.stack of shapes {[list(x.shape) for x in tensors]}")
    d = dim % (tensors[0].ndim + 1)
    return _cat([t.unsqueeze(d) for t in tensors], d)


def _narrow(t: Sym, d: int, a: int, b: int) -> Sym:
    """Elements a..b-1 along dimension d."""
    outer = _numel(t.shape[:d])
    inner = _numel(t.shape[d + 1:])
    row = t.shape[d] * inner
    shape = list(t.shape)
    shape[d] = b - a
    return _gather([(t, o * row + a * inner, o * row + b * inner) for o in range(outer)], shape)


def _split(t: Sym, split_size_or_sections, dim=0):
    d = _dim(dim, t.ndim)
    size = t.shape[d]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        sizes = [min(step, size - a) for a in range(0, size, step)] if step > 0 else []
    else:
        sizes = list(split_size_or_sections)
    if sum(sizes) != size:
        raise Unsupported(f"torch.split of {size} into {sizes}")
    out, a = [], 0
    for s in sizes:
        out.append(_narrow(t, d, a, a + s))
        a += s
    return tuple(out)


def _chunk(t: Sym, chunks, dim=0):
    d = _dim(dim, t.ndim)
    step = -(-t.shape[d] // chunks) if chunks > 0 else 0
    if step <= 0:
        raise Unsupported(f"torch.chunk into {chunks}")
    return _split(t, step, d)


def _transpose(t: Sym, dim0, dim1) -> Sym:
    """Swapping the last two dimensions: each part must be one whole [R, C] block (a source
    block of its own, which becomes transposed, or a transposed one, which becomes plain)."""
    nd = t.ndim
    d0, d1 = _dim(dim0, nd), _dim(dim1, nd)
    if d0 == d1:
        return t
    if nd < 2 or {d0, d1} != {nd - 2, nd - 1}:
        raise Unsupported(f"torch.transpose of dimensions {dim0}, {dim1} of a {nd}-D tensor")
    rows, cols = t.shape[-2], t.shape[-1]
    block = rows * cols
    out = []
    for p in t.parts:
        for b in range(p.dst, p.dst + p.numel, block) if not p.rows else [p.dst]:
            if b % block or (p.rows and p.numel != block):
                raise Unsupported("torch.transpose of a part that is not a whole 2-D block")
            off = p.src_off + (b - p.dst)
            out.append(Part(b, block, p.src, p.src_off) if p.rows else
                       Part(b, block, p.src, off, rows, cols))
            if len(out) > _MAX_PARTS:
                raise Unsupported(f"a layout of more than {_MAX_PARTS} parts")
    shape = list(t.shape)
    shape[-2], shape[-1] = cols, rows
    return Sym(shape, out)


def _same(t, *args, **kwargs):
    return t


_TORCH = {
    torch.stack: _stack,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.concatenate: _cat,
    torch.chunk: _chunk,
    torch.split: _split,
    torch.transpose: _transpose,
    torch.swapaxes: _transpose,
    torch.t: lambda t: _transpose(t, 0, 1),
    torch.squeeze: Sym.squeeze,
    torch.unsqueeze: Sym.unsqueeze,
    torch.reshape: lambda t, shape: t.view(shape),
    torch.flatten: Sym.flatten,
    torch.Tensor.contiguous: _same,
}
