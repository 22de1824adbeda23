"""The forward wrappers: a module's instance-level ``forward`` that runs the runtime's enter and
exit around the module's own forward (materialize.UnitHooks for units and the root,
serve.py's for a served root).

Invariants: wrapping leaves ``module._forward_hooks`` empty (torch's fast paths that refuse
hooked modules run as on the plain model); ``_unwrap_forward`` in reverse order of wrapping
gives every module its own forward back; a deep copy or a pickle of a wrapped module has its
class's forward, never a wrapper; a wrapped forward refuses to run under torch.compile
(``_refuse_compile``) before anything changes.

Owns nothing: the registry of wrapped modules is the caller's.
Threading: the thread that calls the model (the training thread).
"""
from __future__ import annotations

import copy
import functools

import torch

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

