"""Pretrained weights in and out by the model's own names (docs/pretrained.md):
``tiermem.initialize(model, config, weights=PATH)`` and ``tiermem.inference(...)`` load a
safetensors file or a Hugging Face checkpoint directory straight into the chunks, and
``tiermem.save_weights(model, PATH)`` writes the model back in the same layout. A transformers
model gets transformers' conventions on top (hf.py: LoadPlan is then an HFLoadPlan).

The core does the work (runtime/weights.h, through ``_C.load_weights`` / ``_C.save_weights``):
reading every header and checking it against the model before anything changes, converting
(bf16 / fp16 / fp32 files into fp32 chunks, rounded like ``write_param`` into bf16 / fp16 ones;
a frozen tensor whose file dtype is the compute dtype straight into its compute chunk, with no
fp32 master: ``values_in``),
writing each chunk in its home tier, streaming out. This module maps names: a parameter loads
from the key of its name or, when the checkpoint lacks it, of another name of the same (tied)
parameter object; a persistent buffer from its key (buffers are small: read whole, into new
tensors); any other key in the checkpoint is a ValueError. hf.py adds transformers' conventions
(prefixes, ties, fused-expert conversions) through the core's explicit targets.

Owns: a LoadPlan, from its creation (headers read, names matched, buffers checked) until the
runtime drops it; the buffer tensors it replaced and, until set-up succeeds, the real
parameters' own data (``restore`` puts both back).
Reads: the runtime's parameter records (index, name, shape, the user's parameter object).
Invariants: nothing of the model changes until every check passed; the buffers change last,
after the session holds every value, and ``restore`` undoes them (a failed initialize leaves
the model exactly as it was: the runtime closes the session and puts meta parameters back).
Threading: the thread calling tiermem.initialize / tiermem.inference / tiermem.save_weights.
"""
from __future__ import annotations

import os
import warnings

import torch

from . import _C
from .shared import collector_paused

_DTYPE_NAMES = {None: "F32", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def inspect(path) -> dict:
    """The checkpoint's tensors as ``{key: {"dtype", "shape", "file"}}`` with its files and
    index, from its headers only (every header validated: ValueError naming the file)."""
    return _C.weights_inspect(os.fspath(path))


def _persistent_buffers(model):
    """(module, attribute, state_dict key, buffer) of every persistent buffer, once each."""
    out = []
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out.append((m, bname, f"{mname}.{bname}" if mname else bname, b))
    return out


class LoadPlan:
    """The checkpoint at `path` matched against the model's names (see the module docstring).
    Raises ValueError (OSError for a path that does not exist) before anything changes. For a
    transformers model (or a PEFT model around one) it is an hf.HFLoadPlan: the checkpoint
    read through transformers' conventions (prefixes, ties, key conversions)."""

    def __new__(cls, model, *args, **kwargs):
        if cls is LoadPlan:
            from .hf import HFLoadPlan, transformers_model
            if transformers_model(model) is not None:
                cls = HFLoadPlan
        return super().__new__(cls)

    def __init__(self, model, path, params, strict: bool):
        self.path = os.fspath(path)
        self.strict = bool(strict)
        tensors = inspect(self.path)["tensors"]
        self.tensors = tensors
        names: dict[int, list] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        # Per record (the session's tensor order): the other names of its parameter object.
        self.aliases = [[n for n in names.get(id(r.orig), []) if n != r.name] for r in params]
        self.buffers = []        # (module, attribute, key, buffer) that the checkpoint has
        self.missing_buffers = []
        for m, bname, key, b in _persistent_buffers(model):
            t = tensors.get(key)
            if t is None:
                self.missing_buffers.append(key)
                continue
            if list(t["shape"]) != list(b.shape):
                raise ValueError(f"weights: buffer {key}: key '{key}' in {t['file']} has shape "
                                 f"{list(t['shape'])}, the buffer {list(b.shape)}")
            if not t["buffer"]:
                raise ValueError(f"weights: buffer {key}: key '{key}' in {t['file']} is "
                                 f"{t['dtype']}, which no torch tensor holds")
            self.buffers.append((m, bname, key, b))
        if self.strict and self.missing_buffers:
            raise ValueError(f"weights: buffer {self.missing_buffers[0]} has no key in "
                             f"{self.path} ({len(self.missing_buffers)} buffers missing); pass "
                             "strict=False to keep their modules' values")
        self.replaced = []       # (module, attribute, the buffer it held before)
        self.originals = []      # (parameter, its own data) until set-up succeeds

    def _keys_of(self, r) -> list:
        """The checkpoint keys record `r` loads from (the core's TargetsByName: its own name,
        else the first of its aliases the checkpoint has); empty when it has none."""
        for n in [r.name] + self.aliases[r.index]:
            if n in self.tensors:
                return [n]
        return []

    def values_in(self, params, dtype: str) -> set:
        """The indices of the records whose every checkpoint key is stored as `dtype` ("F32",
        "BF16", "F16"): their values are exact in it, so a frozen one computed in it needs no fp32
        master (the session's TensorSpec.values_in_compute_dtype), and a served one may be
        read in place from the files (TensorSpec.read_in_place). Headers only."""
        out = set()
        for r in params:
            keys = self._keys_of(r)
            if keys and all(self.tensors[k]["dtype"] == dtype for k in keys):
                out.add(r.index)
        return out

    @property
    def buffer_keys(self) -> list:
        return [key for _, _, key, _ in self.buffers]

    def load(self, session, params, serving: bool = False) -> list:
        """Streams the parameters into `session` (the core validates everything first) and
        returns the records the checkpoint has no key for (strict=False; said in one
        warning), which keep their own initialization. `serving`: the session only serves
        (tiermem.inference), so the core may read NVMe-homed chunks from the files in place
        (config ``in_place``; its report's ``chunks_in_place``)."""
        report = _C.load_weights(session, self.path, strict=self.strict, aliases=self.aliases,
                                 ignore=self.buffer_keys, serving=serving)
        missing = [params[i] for i in report["missing"]]
        self._empty_loaded(params, missing)
        self._warn_missing([r.name for r in missing] + self.missing_buffers)
        self.report = report
        return missing

    @staticmethod
    def _empty_loaded(params, missing):
        """The loaded parameters' values are in the chunks: those built on the meta device get
        empty CPU storage, like the ones initvalues.py initializes (restore_meta undoes it)."""
        lacking = {r.index for r in missing}
        for r in params:
            if r.index not in lacking and r.orig.device.type == "meta":
                torch.utils.swap_tensors(r.orig, torch.nn.Parameter(
                    torch.empty(0, dtype=r.orig.dtype), requires_grad=r.orig.requires_grad))

    def _warn_missing(self, names):
        if names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8
                                            else "")
            warnings.warn(f"tiermem: {len(names)} parameters and buffers are not in "
                          f"{self.path} and keep their module's initialization: {shown}",
                          stacklevel=5)

    def load_buffers(self):
        """Gives the buffers the checkpoint's values (new tensors of their dtype). Last: after
        the parameters, when nothing else can fail."""
        values = _C.read_weight_tensors(self.path, self.buffer_keys)
        for m, bname, key, b in self.buffers:
            m._buffers[bname] = values[key].to(dtype=b.dtype)
            self.replaced.append((m, bname, b))

    def keep_originals(self, params, was_meta):
        """Holds the real parameters' own data while the runtime takes them over, so that a
        set-up failing after that (abandon) gives them back rather than the checkpoint's
        values; settle() once set-up succeeded (the model held them before anyway)."""
        self.originals = [(r.orig, r.orig.data) for r in params if r.index not in was_meta]

    def settle(self):
        """Set-up succeeded: drops what restore would put back."""
        self.originals = []
        self.replaced = []

    def restore(self):
        """Puts back the buffers load_buffers replaced and the parameters' own data."""
        for m, bname, old in reversed(self.replaced):
            m._buffers[bname] = old
        self.replaced = []
        for p, data in self.originals:
            p.data = data
        self.originals = []


@collector_paused()
def save_weights(model, path, max_shard_size="5GB", dtype=None):
    """Writes a tiermem-managed model's parameters (the fp32 values: masters in mixed
    precision) and persistent buffers to `path`, keyed by their ``state_dict`` names, streamed
    from the chunks — never the whole model in memory. `path` ending in ``.safetensors`` is one
    file; anything else a directory in Hugging Face's layout (``model.safetensors``, or
    ``model-0000k-of-0000n.safetensors`` shards of at most `max_shard_size` plus
    ``model.safetensors.index.json``), replacing an earlier export there. `dtype`
    (``torch.bfloat16`` / ``torch.float16``) rounds the values as ``.to(dtype)`` does; floating
    buffers are converted too. A tied parameter is written once, under its first name. With a
    model sharded across ranks every rank must call it (rank 0 writes)."""
    check_export_dtype(dtype, "save_weights")
    rt = managed_runtime(model, "save_weights")
    entries = [(r.name, list(r.shape), [(r.index, 0, r.numel, False)]) for r in rt.params]
    for _, _, key, b in _persistent_buffers(rt.model):
        entries.append((key, list(b.shape), b))
    path = os.fspath(path)
    export(rt, path, entries, max_shard_size, dtype, path.endswith(".safetensors"),
           "save_weights")


def managed_runtime(model, what):
    """The open runtime of a tiermem-managed `model` (compiled or not); ValueError else."""
    from . import _compiled_root, runtime_of
    rt = runtime_of(_compiled_root(model))
    if rt._closed:
        raise ValueError(f"{what}: the model's tiermem runtime is closed")
    return rt


def check_export_dtype(dtype, what):
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"{what}: dtype must be None, torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {dtype}")


def shard_bytes(max_shard_size) -> int:
    """`max_shard_size` ("5GB", "2GiB" or an int) in bytes."""
    return int(max_shard_size if isinstance(max_shard_size, int) else
               _C.parse_bytes(str(max_shard_size)))


def export(rt, path, entries, max_shard_size, dtype, single_file, what, before=None):
    """Streams `entries` — (key, shape, segments [(tensor, offset, numel, transposed)] or a
    buffer tensor) — out of `rt`'s session to `path` (runtime/weights.h ExportWeights), the
    values in fp32 or rounded to `dtype`, floating buffers converted to it. `before()` runs
    once the arguments are checked, before the first byte is written."""
    check_export_dtype(dtype, what)
    limit = shard_bytes(max_shard_size)
    out = []
    for key, shape, values in entries:
        if isinstance(values, torch.Tensor):
            b = values.to(dtype) if dtype is not None and values.is_floating_point() else values
            values = b.detach().cpu()
        out.append((key, shape, values))
    rt._on_stream()  # the values the device computed so far
    if before is not None:
        before()
    _C.save_weights(rt.session, os.fspath(path), out, dtype=_DTYPE_NAMES[dtype],
                    max_shard_bytes=limit, single_file=single_file)
