"""ChunkTensor: a torch tensor whose values live in a tiermem chunk.

Every managed parameter, as the model exposes it (``model.parameters()``, ``state_dict``,
the optimizer's param groups), is a ChunkTensor, and so is ``p.grad`` after a backward. It has
the shape, dtype and device of the real thing but no storage of its own: any torch operation
on it (``__torch_dispatch__``) acquires the chunk on the device tier, runs on a view of the
chunk memory, and releases it — marked modified when the operation wrote to it. So ordinary
torch code reads and writes the true values wherever they are (device, host or NVMe), one
chunk at a time, never a stale copy or a zero placeholder:
``clip_grad_norm_(model.parameters(), c)``, ``GradScaler.unscale_``, EMA updates,
``parameters_to_vector``, ``load_state_dict``, logging.

Views (``p.view(-1)``, ``p.t()``, ``p[0]``, ``p.detach()``) are ChunkTensors too: they record
the view operations and re-apply them to the chunk memory at each use, so an in-place write
through a view lands in the chunk. Results of other operations are ordinary tensors (never
aliases of chunk memory). Operations that would change a ChunkTensor's metadata in place
(``t_()``, ``resize_``, ``set_``) raise.

Inside a unit's forward and backward the model computes on plain tensors (views of the pinned
chunks), not on ChunkTensors: the dispatch path is for code outside the units.
``torch.autograd.grad`` and ``backward(inputs=...)`` given parameters differentiate with
respect to what the forward used in their place (``_autograd_with_params``).
Gradient hooks a user registers on a parameter (``register_hook``,
``register_post_accumulate_grad_hook``) go where its gradient is computed and accumulated
(``grads.Grads.user_hook``), and freezing or unfreezing one (``requires_grad_``, the
``requires_grad`` setter, ``module.requires_grad_``) freezes or unfreezes what the units compute
with (``unit_hooks.Materializer.follow_requires_grad``). The operations themselves are
dispatch.py's (``ChunkOps``).

Lifetime: a parameter (and its views) holds its runtime, as a torch parameter holds its
storage: a tensor the user keeps after dropping the model keeps the runtime, and its values,
alive. A gradient (``p.grad`` and its views) holds it weakly: torch keeps ``p.grad`` in the
parameter's C++ autograd metadata, where Python's garbage collector cannot see it, so a strong
reference there would keep the runtime, the model and the tiers' memory alive forever. A
gradient used after its model, optimizer and parameters are gone raises.

Threading: like the model (one training thread).
"""
from __future__ import annotations

import inspect
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map

# Ops that overwrite `self` without reading it (a write-only access of the destination).
_WRITE_ONLY_SELF = {"copy_", "zero_", "fill_", "normal_", "uniform_"}
# In-place metadata changes: the wrapper's size/stride would no longer describe the chunk.
_META_MUTATING = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_",
                  "resize_as_", "set_", "swapdims_", "swapaxes_", "detach_"}


_REGISTER_HOOK = torch.Tensor.register_hook
_REGISTER_POST_ACCUMULATE = torch.Tensor.register_post_accumulate_grad_hook
_REQUIRES_GRAD_ = torch.Tensor.requires_grad_
_SET_REQUIRES_GRAD = torch.Tensor.requires_grad.__set__  # `p.requires_grad = flag`


class ChunkTensor(torch.Tensor):
    """A view onto `kind` chunk memory of one managed tensor (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch.autograd.grad / backward consult __torch_function__ on their `inputs`: a
        # parameter there must mean the tensors the units computed with.
        if func is torch.autograd.grad or func is torch.autograd.backward:
            return _autograd_with_params(func, args, kwargs or {})
        if func is _REGISTER_HOOK or func is _REGISTER_POST_ACCUMULATE:
            self = args[0]
            if self._tm_kind == "param" and self is self._tm_rec.param:
                return self._tm_runtime.grads.user_hook(self._tm_rec, func, *args[1:],
                                                       **(kwargs or {}))
        elif func is _REQUIRES_GRAD_ or func == _SET_REQUIRES_GRAD:
            self = args[0]
            if self._tm_kind == "param" and self is self._tm_rec.param:
                want = args[1] if len(args) > 1 else (kwargs or {}).get("requires_grad", True)
                self._tm_runtime.materializer.follow_requires_grad(self._tm_rec, bool(want))
        # Everything else as torch's _disabled_torch_function_impl: straight to dispatch,
        # the result never converted to this class.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @staticmethod
    def __new__(cls, runtime, rec, kind, size, stride, dtype, device, views=(),
                requires_grad=False):
        t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=dtype,
                                                device=device, requires_grad=requires_grad)
        t._tm_refs = (weakref.ref(runtime), weakref.ref(rec))
        t._tm_keep = (runtime, rec) if kind != "grad" else None  # the file's "Lifetime"
        t._tm_kind = kind
        t._tm_views = tuple(views)
        return t

    @property
    def _tm_runtime(self):
        rt = self._tm_refs[0]()
        if rt is None:
            raise RuntimeError(
                f"tiermem: this {self._tm_kind} tensor outlived its model: the tiermem runtime "
                "it belonged to was collected after its model, optimizer and parameters were "
                "dropped (keep a parameter or the model to keep its gradients usable)")
        return rt

    @property
    def _tm_rec(self):
        rec = self._tm_refs[1]()
        if rec is None:
            self._tm_runtime  # noqa: B018 — raises the message above
        return rec

    # ---- what plain tensors do by themselves --------------------------------------------
    def __repr__(self, *, tensor_contents=None):
        rt = self._tm_refs[0]()
        what = "grad of " if self._tm_kind == "grad" else ""
        if rt is None:
            return f"ChunkTensor({what}a collected tiermem runtime's tensor)"
        if rt._closed:
            return f"ChunkTensor({what}{self._tm_rec.name}: the tiermem runtime is closed)"
        value = rt.ops.materialized_copy(self)
        return f"ChunkTensor({what}{self._tm_rec.name}, {value!r})"

    def __reduce_ex__(self, protocol):
        # torch.save / pickle: the value, as an ordinary tensor (a parameter as a Parameter, so
        # torch.save(model) loads as an ordinary module).
        value = self._tm_runtime.ops.materialized_copy(self)
        if isinstance(self, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=self.requires_grad)
        return value.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        value = self._tm_runtime.ops.materialized_copy(self)
        if isinstance(self, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=self.requires_grad)
        memo[id(self)] = value
        return value

    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, value):
        # ``p.data = x`` (vector_to_parameters, hand-written loaders): the values of x are
        # copied into the chunk; the shape and dtype of a managed tensor cannot change.
        if value is self:
            return
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise RuntimeError(
                f"tiermem: cannot set .data of {self._tm_rec.name} to a {value.dtype} tensor of "
                f"shape {tuple(value.shape)}: a managed tensor keeps its {self.dtype} shape "
                f"{tuple(self.shape)} (call tiermem.runtime_of(model).close() first to change it)")
        with torch.no_grad():
            self.detach().copy_(value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        owner = next(x for x in flat if isinstance(x, ChunkTensor))._tm_runtime
        return owner.ops.dispatch(func, args, kwargs)


def is_view_op(func) -> bool:
    """A non-mutating op whose output aliases its first input (view, detach, t, select...)."""
    sch = func._schema
    if sch.is_mutable or not sch.returns:
        return False
    a = sch.returns[0].alias_info
    return a is not None and not a.is_write


def mutated_args(func, args, kwargs):
    """The ChunkTensors the op writes (per its schema), and those it only writes (not reads)."""
    written, write_only = [], []
    sch = func._schema
    name = func.__name__.split(".")[0]
    for i, a in enumerate(sch.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        for x in tree_flatten(v)[0]:
            if isinstance(x, ChunkTensor):
                written.append(x)
                if i == 0 and name in _WRITE_ONLY_SELF:
                    write_only.append(x)
    return written, write_only


def meta_mutating(func) -> bool:
    return func.__name__.split(".")[0] in _META_MUTATING


def unwrap(obj, fn):
    return tree_map(lambda x: fn(x) if isinstance(x, ChunkTensor) else x, obj)


_SIGNATURES: dict = {}  # torch.autograd.grad / backward -> inspect.Signature (built once)


def _autograd_with_params(func, args, kwargs):
    """``torch.autograd.grad(outputs, inputs=params)`` and ``backward(inputs=params)`` with
    managed parameters among the inputs. A forward computes with each unit's compute view of
    the parameter (a leaf of its own), and with the ChunkTensor parameter itself only where
    code outside every unit reads it; neither is the tensor the user passes, so torch alone
    would find the parameters "not used in the graph" — an error, or with ``allow_unused``
    (and in ``backward(inputs=...)``, always) silently no gradient. Each parameter is asked
    for as both leaves and its gradient is their sum, as torch's is for a parameter used in
    several places; ``backward`` accumulates into ``p.grad`` through the usual hooks."""
    sig = _SIGNATURES.get(func)
    if sig is None:
        sig = _SIGNATURES[func] = inspect.signature(func)
    bound = sig.bind(*args, **kwargs)
    a = bound.arguments
    inputs = a.get("inputs")
    single = isinstance(inputs, torch.Tensor)
    given = (inputs,) if single else tuple(inputs or ())
    expanded, spans = [], []
    for t in given:
        if isinstance(t, ChunkTensor):
            if t._tm_kind != "param" or t is not t._tm_rec.param:
                raise RuntimeError(
                    f"tiermem: {func.__module__}.{func.__name__} was given a view or a gradient "
                    f"of managed parameter {t._tm_rec.name!r} as an input; pass the parameter "
                    f"itself (model.parameters() holds them)")
            rec = t._tm_rec
            spans.append((len(expanded), 2))
            expanded += [rec.compute, rec.param]
        else:
            spans.append((len(expanded), 1))
            expanded.append(t)
    with torch._C.DisableTorchFunctionSubclass():
        if func is torch.autograd.backward:
            # Unused inputs are no error in backward(inputs=...): each leaf gets what reaches
            # it, through the grad hooks that write managed gradients into their chunks.
            a["inputs"] = expanded
            return func(*bound.args, **bound.kwargs)
        allow_unused = a.get("allow_unused") or a.get("materialize_grads", False)
        materialize = a.get("materialize_grads", False)
        a["inputs"] = expanded
        a["allow_unused"] = True
        a["materialize_grads"] = False
        grads = func(*bound.args, **bound.kwargs)
    out = []
    for (start, n), t in zip(spans, given):
        parts = [g for g in grads[start:start + n] if g is not None]
        if not parts:
            if not allow_unused:
                raise RuntimeError(
                    "One of the differentiated Tensors appears to not have been used in the "
                    "graph. Set allow_unused=True if this is the desired behavior.")
            out.append(torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                       if materialize else None)
            continue
        g = parts[0]
        for extra in parts[1:]:
            g = g + extra
        out.append(g)
    return tuple(out)

