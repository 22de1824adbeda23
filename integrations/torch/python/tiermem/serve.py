"""Offloaded inference: a model whose weights do not fit the device budget, served from host
DRAM or NVMe (docs/inference.md).

``tiermem.inference(model, config)`` places every parameter in chunks, as for training, but
frozen: no gradient or optimizer chunks, no saved-tensor hooks, no optimizer. Each call of the
model's forward is one engine iteration, run under ``torch.no_grad()``; its acquires (one per
unit and chunk group) are recorded and, because every forward of a served model walks the
same units in the same order, the engine treats the order as cyclic (engine.h): while a unit
computes, the next units' weights are prefetched into the device budget — across the end of
one forward into the start of the next — and eviction keeps what is needed soonest.

The KV cache (the ``cache`` / ``past_key_values`` a Hugging Face model returns, any ``Cache`` or legacy
tuple of tensors) stays wherever the model keeps it — on the device — and its bytes count
against the device budget: after each forward the runtime sets the session's external device
bytes to the cache's size, which evicts weights to make room, or raises MemoryError naming
the bytes when the weights in use leave too little (nothing is lost: the next forward with a
shorter cache runs).

Threading: one thread calls the model (like the model itself).
"""
from __future__ import annotations

import torch

from .compiling import boundary, eager, run_root
from .runtime import TiermemRuntime, _Forward, _wrap_forward


class _ServeForward(_Forward):
    """The root's forward when serving: one engine iteration per outermost call, under
    no_grad, and the KV cache of its output accounted after it."""

    @boundary
    def __call__(self, *args, **kwargs):
        rt = self.enter()
        if rt is None:  # closed: the plain forward
            return run_root(self.inner, *args, **kwargs)
        try:
            with torch.no_grad():
                out = run_root(self.inner, *args, **kwargs)
        finally:
            self.exit()
        rt._account_cache(out)
        return out


class ServingRuntime(TiermemRuntime):
    """A TiermemRuntime for inference only (see the module docstring)."""

    _serving = True

    def __init__(self, model, cfg, units=None, experts=True, init=None, weights=None,
                 strict=True):
        super().__init__(model, cfg, None, units, experts=experts, init=init, weights=weights,
                         strict=strict)
        # Each unit pins all its chunk groups at once, and with them one expert's at a time
        # (experts.py): the device budget must hold the largest unit's (the session's answer).
        need = self.session.serving_minimum
        if not self.session.host_compute and need.bytes > cfg.device_budget:
            unit = self.units[need.unit]
            self.abandon()
            raise MemoryError(
                f"inference: the device budget of {cfg.device_budget} bytes is below the "
                f"{need.bytes} bytes the chunks of unit "
                f"'{unit.name or type(unit.module).__name__}' need at once; set 'device' to at "
                f"least {need.bytes} bytes (more leaves room for prefetch and the KV cache)")
        if self._weights is not None:
            self._weights.settle()  # set-up succeeded
        self.session.set_cyclic(True)
        self.cache_bytes = 0   # the KV cache's bytes after the last forward
        self.forwards = 0

    def _wrap_root(self):
        _wrap_forward(self.model, self._serve_enter, self._root_exit, self._wrapped,
                      cls=_ServeForward)

    def _traced(self) -> bool:
        return True  # every forward is an iteration the next one repeats

    def _serve_enter(self):
        if self._closed:
            return None
        if self._root_depth == 0:
            self.session.units.begin_iteration()  # the session's iteration, phase "forward"
            self.forwards += 1
        self._root_depth += 1
        return self

    def _root_exit(self):
        if not self._closed:
            self._root_depth -= 1

    @eager  # called by the served forward's wrapper, where compiled code may call it
    def _account_cache(self, out):
        if self._closed or self._root_depth != 0:
            return
        n = cache_bytes(out)
        if n != self.cache_bytes:
            self.session.set_external_compute_bytes(n)  # MemoryError: budget too small for it
            self.cache_bytes = n


def cache_bytes(out) -> int:
    """Bytes of the KV cache a forward returned: the storages of every tensor reachable from
    its ``cache`` / ``past_key_values`` (a transformers Cache, or tuples of tensors), each
    counted once. A plain tuple output (``return_dict=False``) is not looked into."""
    pkv = None
    if isinstance(out, dict):  # ModelOutput is a dict: no deprecated attribute is touched
        pkv = next((out[k] for k in ("cache", "past_key_values") if out.get(k) is not None), None)
    else:
        pkv = getattr(out, "cache", None)
    if pkv is None:
        return 0
    seen: dict[int, int] = {}

    def visit(x, depth=0):
        if depth > 6 or x is None:
            return
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(x, (list, tuple)):
            for e in x:
                visit(e, depth + 1)
        elif isinstance(x, dict):
            for e in x.values():
                visit(e, depth + 1)
        else:  # a Cache: layers with keys/values (transformers 5), or the 4.x attributes
            for name in ("layers", "self_attention_cache", "cross_attention_cache",
                         "key_cache", "value_cache", "keys", "values"):
                if hasattr(x, name):
                    visit(getattr(x, name), depth + 1)

    visit(pkv)
    return sum(seen.values())
