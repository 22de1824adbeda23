"""The forward wrappers: a module's instance-level ``forward`` that runs the runtime's enter and
exit around the module's own forward (unit_hooks.UnitHooks for units and the root,
serve.py's for a served root). Under torch.compile a wrapper is a graph break and its enter
and exit run eagerly; the model's own forward runs eagerly and each unit's is compiled
(compiling.py).

Invariants: wrapping leaves ``module._forward_hooks`` empty (torch's fast paths that refuse
hooked modules run as on the plain model); ``_unwrap_forward`` in reverse order of wrapping
gives every module its own forward back; a deep copy or a pickle of a wrapped module has its
class's forward, never a wrapper; dynamo never traces a wrapper nor its enter and exit.

Owns nothing: the registry of wrapped modules is the caller's.
Threading: the thread that calls the model (the training thread).
"""
from __future__ import annotations

import copy
import functools

from .compiling import boundary, compiler_now, eager, run_compiled, run_root, trampoline


class _Forward:
    """An instance-level ``forward`` that runs enter/exit around the module's own forward.

    Wrapping forward (as accelerate's hooks do) instead of registering forward hooks keeps
    ``module._forward_hooks`` empty, so torch's fast paths that refuse modules with hooks
    (nn.TransformerEncoderLayer in eval) run exactly as on the plain model. A deep copy of
    the module gets its own forward back (an ordinary module), never this wrapper.

    This base class wraps a model's own forward: the model's code runs eagerly, and the
    units it calls compile under the torch.compile active at this call (compiling.run_root).
    """

    def __init__(self, inner, enter, exit_):
        # Not inner's __dict__ (update_wrapper's default): when inner is itself a _Forward (a
        # module that is both a unit and the root), that would overwrite enter/exit/inner
        # with the unit's, and the root's hooks would never run.
        functools.update_wrapper(self, inner, updated=())
        self.inner, self.enter, self.exit = inner, eager(enter), eager(exit_)

    @boundary
    def __call__(self, *args, **kwargs):
        self.enter()
        try:
            return run_root(self.inner, *args, **kwargs)
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

    @boundary
    def __call__(self, *args, **kwargs):
        self.enter()
        out = None
        try:
            out = run_root(self.inner, *args, **kwargs)
            return out
        finally:
            self.exit(out)


class _UnitForward(_Forward):
    """A unit's forward: enter sees the call's arguments (a recomputed unit keeps them) and
    the torch.compile callback its forward runs under (a recompute runs it so again), exit
    what it returned (None when it raised). The module's own forward runs through ``call``
    (compiling.py): its class's trampoline; eagerly as a model's forward runs when the unit
    holds other units (`holds_units`: its code between them is not one graph); directly when
    it is another wrapper."""

    def __init__(self, inner, enter, exit_, owner: type, holds_units: bool):
        super().__init__(inner, enter, exit_)
        if isinstance(inner, _Forward):
            self.call = _direct
        else:
            self.call = run_root if holds_units else trampoline(owner)

    @boundary
    def __call__(self, *args, **kwargs):
        compiler = compiler_now()
        self.enter(args, kwargs, compiler)
        out = None
        try:
            out = run_compiled(compiler, self.call, self.inner, *args, **kwargs)
            return out
        finally:
            self.exit(out)


@boundary
def _direct(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _wrap_forward(module, enter, exit_, registry, cls=None, **kw):
    """Wraps `module`'s forward in `cls` (default _Forward; `kw`: its further arguments) and
    adds `module` to `registry`."""
    w = (cls or _Forward)(module.forward, enter, exit_, **kw)
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
