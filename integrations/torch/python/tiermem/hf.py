"""Hugging Face checkpoints (docs/pretrained.md "Hugging Face models"): what ``weights=DIR``
means for a transformers model, and ``tiermem.save_pretrained``.

A transformers model (``transformers.PreTrainedModel``, or a PEFT ``PeftModel`` around one)
loads a checkpoint the way ``from_pretrained`` would, with transformers' own conventions taken
from the installed transformers, never from a table kept here:

- keys are routed as ``convert_and_load_state_dict_in_model`` routes them: its renamings, at
  most one converter per key (``conversion_mapping.get_model_conversion_mapping`` of the model:
  every model type transformers converts), the base-model prefix added or stripped
  (``rename_source_key``), keys sorted by ``dot_natural_key``;
- each converter (e.g. Qwen3-MoE's per-expert ``gate_proj``/``up_proj`` stacked and joined
  into the fused ``experts.gate_up_proj`` [E, 2I, H]) runs transformers' own code on symbolic
  tensors (symbolic.py): the result says which key fills which elements of the parameter —
  the core's segments (runtime/weights.h), assembled in the chunks from keys in any shards. A
  conversion segments cannot express (anything but renames, stacks, concatenations and 2-D
  transposes, or one taking part of a key) is a ValueError naming the model type and the op;
- ties: a tied parameter is one parameter object under several names (what
  ``tie_word_embeddings`` makes; every tie transformers declares —
  ``get_expanded_tied_weights_keys`` — is checked to be one, else a ValueError: accelerate's
  ``init_empty_weights()`` unties, ``model.tie_weights()`` ties again); it loads from any of
  its names' keys, so a tied head the file lacks takes the embedding's values. Any other
  parameter the file lacks — an untied head included — is a ValueError naming the key and
  the file, unless ``_keys_to_ignore_on_load_missing`` allows it or ``strict=False``;
- keys no parameter or buffer takes are a ValueError unless transformers ignores them
  (``_adjust_missing_and_unexpected_keys``: ``_keys_to_ignore_on_load_unexpected``, old
  rotary / position-id buffers) or they are the head of the model a base model's checkpoint
  was saved from (``lm_head.weight`` into a ``LlamaModel``: left, with a warning);
- non-persistent buffers built on the meta device (rotary frequencies, under
  ``torch.device("meta")``) get their values from the model's own ``_init_weights``;
- PEFT: names are the base model's (``base_model.model.`` and the tuner layers'
  ``base_layer`` left out); adapter parameters are not in a base checkpoint: real ones keep
  their values, meta ones get PEFT's initialization (each adapter module's own, then the LoRA
  layer's ``reset_lora_parameters``, as PEFT's ``update_layer`` makes them).

``save_pretrained`` mirrors it: the model's state-dict names, tied names once
(``remove_tied_weights_from_state_dict``), transformers' reverse conversions
(``revert_weight_conversion``, run on symbolic tensors: fused experts back to per-expert keys)
streamed out of the chunks, plus ``config.json`` and ``generation_config.json``.

transformers is never imported here for a model that is not one (``sys.modules``).

Owns: an HFLoadPlan (as weights.LoadPlan: from its creation until the runtime drops it) and
what it replaced — buffers and, until set-up succeeds, the real parameters' own data.
Reads: the model, transformers' conversions and tie declarations, the checkpoint's headers.
Invariants: nothing of the model changes until every check passed (the plan is made from
headers and names only); after a successful set-up the model remembers the conversions it
used (``_weight_conversions``, as ``from_pretrained`` leaves it), so saving reverts them.
Threading: the thread calling tiermem.initialize / inference / save_pretrained.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import warnings
from types import SimpleNamespace

import torch

from . import _C
from .shared import collector_paused
from .symbolic import Sym, Unsupported
from .weights import (LoadPlan, _persistent_buffers, check_export_dtype, export,
                      managed_runtime)

_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"


def transformers_model(model):
    """The ``transformers.PreTrainedModel`` that `model` is, or that a PEFT ``PeftModel``
    wraps; None for anything else (without importing transformers or peft)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    if isinstance(model, modeling.PreTrainedModel):
        return model
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        inner = model.get_base_model()
        return inner if isinstance(inner, modeling.PreTrainedModel) else None
    return None


def buffer_dtypes(model, dtype) -> dict:
    """For a transformers model computing in `dtype`: the dtype that transformers' own
    ``from_pretrained(..., dtype=dtype)`` gives each of its buffers, keyed ``(id(module),
    name)``; empty for any other model. Found by building the model's class from its config on
    the meta device (no memory) with transformers' ``_from_config``: a module that computes a
    buffer in fp32 on purpose keeps it fp32 there — Llama's rotary ``inv_freq``, which
    ``module.to(bf16)`` would round by up to 2e-3 relative (RoPE phases drift with the
    position). A class that cannot be built that way keeps ``module.to(dtype)``'s rule, said in
    one warning."""
    inner = transformers_model(model)
    if inner is None:
        return {}
    try:
        with torch.device("meta"):
            built = type(inner)._from_config(copy.deepcopy(inner.config), dtype=dtype)
    except Exception as e:  # a class transformers cannot build from its config alone
        warnings.warn(f"tiermem: could not build {type(inner).__name__} from its config to "
                      f"learn its buffers' dtypes ({type(e).__name__}: {e}); floating buffers "
                      f"are cast to {dtype} like module.to(dtype)")
        return {}
    kinds = {n: b.dtype for n, b in built.named_buffers()}
    out = {}
    for mname, m in inner.named_modules():
        for k, b in m._buffers.items():
            full = f"{mname}.{k}" if mname else k
            if b is not None and full in kinds:
                out[(id(m), k)] = kinds[full]
    return out


class HFNames:
    """The checkpoint-side name of every parameter and buffer of `model`: its name in the
    transformers model `inner` with PEFT's tuner layers left out (``q_proj.base_layer.weight``
    is ``q_proj.weight``); PEFT adapter parameters have none (``adapters``: name -> (tuner
    layer, adapter name))."""

    def __init__(self, model, inner):
        self.inner = inner
        self.prefix = prefix = next(n for n, m in model.named_modules() if m is inner)
        tuners = sys.modules.get("peft.tuners.tuners_utils")
        self._tuner = tuners.BaseTunerLayer if tuners is not None else ()
        self.hf: dict[str, str] = {}  # model name -> checkpoint-side name
        self.adapters: dict[str, tuple] = {}
        named = list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False))
        for name, _ in named:
            rel = name[len(prefix) + 1:] if prefix else name
            if prefix and not name.startswith(prefix + "."):
                raise ValueError(f"weights: {name} is outside the transformers model "
                                 f"({prefix}): tiermem loads a PEFT model's base model only")
            hf, adapter = self._walk(rel)
            if adapter is not None:
                self.adapters[name] = adapter
            else:
                self.hf[name] = hf
        # What a checkpoint holds (transformers' state dict): parameters, persistent buffers.
        self.state = {self.hf[n]: list(p.shape)
                      for n, p in model.named_parameters(remove_duplicate=False) if n in self.hf}
        self.state.update({self.hf[key]: list(b.shape) for _, _, key, b in
                           _persistent_buffers(model)})

    def _walk(self, rel):
        parts, out, m = rel.split("."), [], self.inner
        for i, part in enumerate(parts[:-1]):
            if self._tuner and isinstance(m, self._tuner):
                if part == "base_layer":
                    m = m.base_layer
                    continue
                if part in m.adapter_layer_names or part in m.other_param_names:
                    return None, (m, parts[i + 1])
            out.append(part)
            m = getattr(m, part)
        return ".".join(out + parts[-1:]), None


def _conversion_error(inner, target, e) -> ValueError:
    """A ValueError naming the model type and transformers' op that `e` came out of."""
    ops = sys.modules["transformers.core_model_loading"].ConversionOps
    op, tb = None, e.__traceback__
    while tb is not None:
        s = tb.tb_frame.f_locals.get("self")
        if isinstance(s, ops):
            op = type(s).__name__
        tb = tb.tb_next
    what = e.what if isinstance(e, Unsupported) else f"{type(e).__name__}: {e}"
    return ValueError(
        f"weights: transformers' conversion for model type '{inner.config.model_type}' "
        f"({op or 'a conversion'}) of '{target}' does {what}, which tiermem cannot express as "
        "segments of whole keys (renames, stacks, concatenations and 2-D transposes only)")


def _convert(transform, target, inner) -> dict:
    """transformers' converter `transform` on its collected symbolic tensors: {name: Sym}."""
    try:
        out = transform.convert(target, model=inner, config=inner.config, hf_quantizer=None,
                                loading_info=None)
    except Exception as e:  # noqa: BLE001 — any failure of an op on a Sym says "cannot"
        raise _conversion_error(inner, target, e) from e
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def route(inner, shapes, tensors, path):
    """Every checkpoint key (`tensors`: the headers' {key: {"shape", ...}}) routed as
    transformers routes it into a model whose checkpoint-side names are `shapes`' ({name:
    shape}): returns ({name: Sym over keys}, [keys no name takes], [the conversions used])."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 dot_natural_key, rename_source_key)
    conversions = get_model_conversion_mapping(inner)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = dict.fromkeys(shapes, True)  # rename_source_key asks `.get(name) is not None`
    prefix = inner.base_model_prefix
    out, pending, unused = {}, {}, []
    for key in sorted(tensors, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if target not in known and key in known:  # as transformers: only the prefix
            target, pattern = rename_source_key(key, [], [], prefix, known)
        if target not in known:
            unused.append(key)
        elif pattern is None:
            if target in out:
                first = out[target].parts[0].src
                raise ValueError(f"weights: keys '{first}' and '{key}' in {path} both load "
                                 f"'{target}'")
            out[target] = Sym.source(key, tensors[key]["shape"])
        else:
            t = pending.setdefault(target, copy.deepcopy(by_pattern[pattern]))
            t.add_tensor(target, key, pattern, Sym.source(key, tensors[key]["shape"]))
    for target, t in pending.items():
        try:
            out.update(_convert(t, target, inner))
        except ValueError as e:  # a key of the assembly missing is the better message
            try:
                lacking = lacking_key(inner, target, shapes[target], tensors, path)
            except ValueError:  # the reverse conversion cannot run either
                lacking = None
            if lacking:
                raise ValueError(lacking) from None
            raise e
    return out, unused, [c for c in conversions if c.was_used()]


def lacking_key(inner, name, shape, tensors, path):
    """The message naming the first key transformers would assemble parameter `name` (of
    `shape`) from that `tensors` lack (with or without the base-model prefix); None when
    none is lacking."""
    want = revert(inner, {name: Sym.source(name, shape)})
    pre = inner.base_model_prefix + "."
    lost = [k for k in want if not any(v in tensors for v in (k, pre + k, k.removeprefix(pre)))]
    if not lost:
        return None
    return (f"weights: parameter '{name}' {list(shape)}, which transformers assembles from "
            f"{len(want)} keys: the checkpoint {path} has no key '{lost[0]}'")


def revert(inner, syms: dict) -> dict:
    """transformers' reverse conversions (save_pretrained's ``revert_weight_conversion``) of
    the model-named symbolic tensors `syms`: {checkpoint key: Sym}."""
    from transformers.core_model_loading import revert_weight_conversion
    try:
        out = revert_weight_conversion(inner, syms)
    except Exception as e:  # noqa: BLE001
        what = next(iter(syms)) if len(syms) == 1 else "the model's parameters"
        raise _conversion_error(inner, what, e) from e
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def _allowed(inner, missing, unexpected):
    """transformers' own exceptions (``_adjust_missing_and_unexpected_keys``): the missing
    names and unexpected keys left after them."""
    info = SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
    inner._adjust_missing_and_unexpected_keys(info)
    return info.missing_keys, info.unexpected_keys


class HFLoadPlan(LoadPlan):
    """LoadPlan for a transformers model (see the module docstring): the checkpoint at `path`
    matched against the model through transformers' conventions. Raises ValueError (OSError
    for a path that does not exist) before anything changes."""

    def __init__(self, model, path, params, strict: bool):
        self.path = os.fspath(path)
        self.strict = bool(strict)
        self.inner = transformers_model(model)
        self.names = HFNames(model, self.inner)
        self.tensors = _C.weights_inspect(self.path)["tensors"]
        self.syms, unused, self.conversions = route(self.inner, self.names.state,
                                                    self.tensors, self.path)
        self.replaced, self.originals = [], []
        self.peft_config = getattr(model, "peft_config", {})
        self._missing: dict[str, list] = {}  # checkpoint-side names the file lacks: shape
        self._match_params(model, params)
        self._match_buffers(model)
        missing, unexpected = _allowed(self.inner, self._missing, unused)
        self.head_keys = self._head_keys(unexpected)
        unexpected -= set(self.head_keys)
        self.ignored = sorted(set(unused) - unexpected) + self._alias_keys
        if unexpected:
            key = sorted(unexpected)[0]
            more = f" ({len(unexpected)} unexpected keys)" if len(unexpected) > 1 else ""
            raise ValueError(f"weights: {self._file(key)} holds key '{key}', which no parameter "
                             f"or buffer of the model uses{more}")
        lacking = [n for n in self._missing if n in missing]
        if self.strict and lacking:
            raise ValueError(self._missing_message(lacking))
        self.missing_buffers = [n for n in self._missing_buffer_names if n in missing]

    # ---- matching ------------------------------------------------------------------------
    def _head_keys(self, unexpected) -> list:
        """A base model (``LlamaModel``) loading the checkpoint of a model with a head
        (``LlamaForCausalLM``: keys under the base-model prefix): the keys outside the prefix
        are the head's, expected to be left (said in a warning, as transformers says it)."""
        pre = self.inner.base_model_prefix
        if not pre or hasattr(self.inner, pre) or not any(
                k.startswith(pre + ".") for k in self.tensors):
            return []
        return sorted(k for k in unexpected if not k.startswith(pre + "."))

    def _file(self, key) -> str:
        return self.tensors[key]["file"]

    def _match_params(self, model, params):
        """self.targets (the core's (tensor, segments)), the keys of tied names not read
        (_alias_keys), the meta adapter records, the checkpoint-side names lacking."""
        objects: dict[int, list] = {}
        by_hf = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            objects.setdefault(id(p), []).append(n)
            by_hf[self.names.hf.get(n)] = p
        self._check_ties(by_hf)
        self.targets, self._alias_keys, self.adapters = [], [], []
        self._adapter_records = set()
        for r in params:
            own = [r.name] + [n for n in objects[id(r.orig)] if n != r.name]
            if own[0] in self.names.adapters:
                self._adapter_records.add(r.index)
                if r.orig.device.type == "meta":
                    self.adapters.append((r, self.names.adapters[own[0]]))
                continue
            hf = [self.names.hf[n] for n in own]
            have = [n for n in hf if n in self.syms]
            if not have:
                self._missing[hf[0]] = list(r.shape)
                continue
            self._alias_keys += [p.src for n in have[1:] for p in self.syms[n].parts]
            self.targets.append((r.index, self._segments(hf[0], have[0], r.shape)))

    def _check_ties(self, by_hf):
        """Every tie transformers declares (``get_expanded_tied_weights_keys``: from
        ``_tied_weights_keys`` and ``tie_word_embeddings``) is one parameter object here, so a
        tied parameter the file lacks loads from its tie's key and stays tied in training."""
        declared = self.inner.get_expanded_tied_weights_keys(all_submodels=True)
        for target, source in declared.items():
            if target in by_hf and source in by_hf and by_hf[target] is not by_hf[source]:
                raise ValueError(
                    f"weights: '{target}' is tied to '{source}' (config tie_word_embeddings="
                    f"{getattr(self.inner.config, 'tie_word_embeddings', None)}) but they are "
                    "two parameters in this model (accelerate's init_empty_weights() unties "
                    "them): call model.tie_weights() before tiermem")

    def _segments(self, name, source, shape) -> list:
        """The core's segments of parameter `name` (of `shape`) from the Sym of `source`."""
        sym = self.syms[source]
        if list(sym.shape) != list(shape):
            raise ValueError(self._shape_message(name, sym, shape))
        segs = []
        for p in sym.parts:
            file_shape = list(self.tensors[p.src]["shape"])
            whole = p.src_off == 0 and (
                [p.rows, p.cols] == file_shape if p.rows else p.numel == math.prod(file_shape))
            if not whole:
                raise ValueError(
                    f"weights: transformers' conversion for model type "
                    f"'{self.inner.config.model_type}' fills '{name}' from part of key "
                    f"'{p.src}' in {self._file(p.src)}: tiermem loads whole keys")
            segs.append((p.src, p.dst, file_shape, bool(p.rows)))
        return segs

    def _shape_message(self, name, sym, shape) -> str:
        keys = [p.src for p in sym.parts]
        if len(keys) == 1:
            return (f"weights: parameter '{name}': key '{keys[0]}' in {self._file(keys[0])} "
                    f"has shape {list(self.tensors[keys[0]]['shape'])}, expected {list(shape)}")
        return lacking_key(self.inner, name, shape, self.tensors, self.path) or (
            f"weights: parameter '{name}' {list(shape)}: transformers assembles "
            f"{list(sym.shape)} from its {len(keys)} keys")

    def _missing_message(self, lacking) -> str:
        name = lacking[0]
        keys = list(revert(self.inner, {name: Sym.source(name, self._missing[name])}))
        tie = ""
        if name in getattr(self.inner, "_tied_weights_keys", None) or ():
            tie = (" (the model does not tie it: config tie_word_embeddings="
                   f"{getattr(self.inner.config, 'tie_word_embeddings', None)})")
        more = f"; {len(lacking)} parameters are missing" if len(lacking) > 1 else ""
        return (f"weights: '{name}' has no key '{keys[0]}' in {self.path}{tie}"
                f"{more}; pass strict=False to keep their own initialization")

    def _match_buffers(self, model):
        """Persistent buffers from their keys (whole, as they are); non-persistent ones on
        the meta device from transformers' _init_weights of their module (checked here)."""
        self.buffers, self.computed, self._missing_buffer_names = [], [], []
        for m, bname, key, b in _persistent_buffers(model):
            hf = self.names.hf[key]
            sym = self.syms.get(hf)
            if sym is None:
                self._missing[hf] = list(b.shape)
                self._missing_buffer_names.append(hf)
                continue
            src = sym.parts[0].src if len(sym.parts) == 1 else None
            t = self.tensors.get(src)
            if t is None or sym.parts[0].rows or list(t["shape"]) != list(b.shape):
                raise ValueError(f"weights: buffer {key}: its key in the checkpoint is not one "
                                 f"tensor of shape {list(b.shape)} ({sym!r})")
            if not t["buffer"]:
                raise ValueError(f"weights: buffer {key}: key '{src}' in {t['file']} is "
                                 f"{t['dtype']}, which no torch tensor holds")
            self.buffers.append((m, bname, src, b, key))
        for mname, m in self.inner.named_modules():
            meta = [n for n, b in m._buffers.items() if b is not None and b.is_meta
                    and n in m._non_persistent_buffers_set]
            if not meta:
                continue
            if any(True for _ in m.parameters(recurse=False)):
                raise ValueError(
                    f"buffer {mname}.{meta[0]} is on the meta device in a module with "
                    "parameters: tiermem computes a transformers model's meta buffers with its "
                    "_init_weights only for modules without parameters; build the model under "
                    "accelerate's init_empty_weights() (buffers real)")
            self.computed.append((mname, m, meta))

    @property
    def buffer_keys(self) -> list:
        """The model's names of the buffers this plan gives values (check_buffers)."""
        pre = self.names.prefix + "." if self.names.prefix else ""
        return [b[4] for b in self.buffers] + [pre + (f"{p}.{n}" if p else n)
                                               for p, _, ms in self.computed for n in ms]

    # ---- loading ---------------------------------------------------------------------------
    def load(self, session, params, serving: bool = False) -> list:
        """Streams the parameters into `session`, gives meta PEFT adapters their
        initialization, and returns the records left to their own values: adapters with
        values, and what the file lacks (strict=False, named in one warning). `serving`: as
        LoadPlan.load (the core may read NVMe-homed chunks from the files in place)."""
        report = _C.load_weights(session, self.path, strict=False, targets=self.targets,
                                 ignore=self.ignored, serving=serving)
        missing = [params[i] for i in report["missing"]]
        self._empty_loaded(params, missing)
        from .hf_peft import init_meta_adapters
        done = init_meta_adapters(self.adapters, self.peft_config, session)
        missing = [r for r in missing if r.index not in done]
        self._warn_missing([r.name for r in missing if r.index not in self._adapter_records]
                           + self.missing_buffers)
        if self.head_keys:
            warnings.warn(f"tiermem: {len(self.head_keys)} keys of {self.path} belong to the "
                          f"head of the model it was saved from, not to this "
                          f"{type(self.inner).__name__}, and are left: "
                          f"{', '.join(self.head_keys[:8])}", stacklevel=4)
        self.report = report
        return missing

    def load_buffers(self):
        """Gives the buffers their values (the checkpoint's, or computed); last."""
        values = _C.read_weight_tensors(self.path, [b[2] for b in self.buffers])
        for m, bname, key, b, _ in self.buffers:
            m._buffers[bname] = values[key].to(dtype=b.dtype)
            self.replaced.append((m, bname, b))
        for mname, m, names in self.computed:
            for n in names:
                old = m._buffers[n]
                m._buffers[n] = torch.full(old.shape, math.nan, dtype=old.dtype) \
                    if old.is_floating_point() else torch.zeros(old.shape, dtype=old.dtype)
                self.replaced.append((m, n, old))
            with torch.no_grad():
                _owner(self.inner, mname)._init_weights(m)
            for n in names:
                if m._buffers[n].is_floating_point() and torch.isnan(m._buffers[n]).any():
                    raise ValueError(f"buffer {mname}.{n} is on the meta device and "
                                     "transformers' _init_weights did not give it values")

    def settle(self):
        """Set-up succeeded: the model remembers the conversions it was loaded with, as
        ``from_pretrained`` leaves it (saving reverts exactly those)."""
        self.inner._weight_conversions = self.conversions
        super().settle()


def _owner(inner, mname):
    """The innermost PreTrainedModel holding module `mname` (its _init_weights applies)."""
    owner = inner
    modeling = sys.modules["transformers.modeling_utils"]
    for n, m in inner.named_modules():
        if isinstance(m, modeling.PreTrainedModel) and (not n or mname == n or
                                                         mname.startswith(n + ".")):
            owner = m
    return owner


# ---- export ------------------------------------------------------------------------------
def checkpoint_entries(inner, source_of, buffers) -> list:
    """The export of transformers model `inner` as save_pretrained writes it: (key, shape,
    parts) for every key, parts over `source_of(name)` (the source of each parameter name:
    a hashable, with its shape) and the given `buffers` ({name: tensor}, source ("buffer",
    name)). Tied names once, as transformers keeps them; its reverse conversions applied."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    syms, state = {}, {}
    for name, p in inner.named_parameters(remove_duplicate=False):
        src, shape = source_of(name)
        syms[name] = Sym.source(src, shape)
        state[name] = torch.empty(shape, device="meta")
    for name, b in buffers.items():
        syms[name] = Sym.source(("buffer", name), b.shape)
        state[name] = torch.empty(b.shape, device="meta")
    for k in inner._keys_to_ignore_on_save or ():
        state.pop(k, None)
    kept = remove_tied_weights_from_state_dict(state, inner)
    return [(key, list(sym.shape), sym.parts)
            for key, sym in revert(inner, {k: syms[k] for k in kept}).items()]


def _unpublish(path):
    """Removes what makes `path` a loadable checkpoint (its index, its model.safetensors)
    before anything new is written there: an export interrupted later leaves no mixture of
    new configs and old weights that loads."""
    for f in (_INDEX, _SINGLE):
        try:
            os.remove(os.path.join(path, f))
        except FileNotFoundError:
            pass


def config_dtype(dtype) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


@collector_paused()
def save_pretrained(model, path, max_shard_size="5GB", dtype=None):
    """Writes a tiermem-managed transformers model to directory `path` as its
    ``save_pretrained`` would (docs/pretrained.md): sharded safetensors in Hugging Face's
    layout with keys as transformers writes them (tied names once, fused experts back to
    per-expert keys by its reverse conversions), streamed from the chunks — never the whole
    model in memory — plus ``config.json`` (its ``dtype`` the one written) and
    ``generation_config.json``, so ``AutoModelForCausalLM.from_pretrained(path)`` loads it.
    Values are the fp32 ones (masters in mixed precision) or, with `dtype`
    (``torch.bfloat16`` / ``torch.float16``), rounded as ``.to(dtype)`` rounds. Crash-safe: the
    old index goes first, each shard is written under a temporary name and renamed, the index
    last. With a model sharded across ranks every rank must call it (rank 0 writes)."""
    from . import _compiled_root
    check_export_dtype(dtype, "save_pretrained")
    root = _compiled_root(model)
    inner = transformers_model(root)
    if inner is not root:
        raise ValueError(
            "save_pretrained: expected a transformers PreTrainedModel managed by tiermem, got "
            f"{type(root).__name__}" + (" (for a PEFT model, its own model.save_pretrained(dir) "
                                        "saves the adapter)" if inner is not None else ""))
    rt = managed_runtime(model, "save_pretrained")
    by_name = {n: rt.by_param[id(p)] for n, p in inner.named_parameters(remove_duplicate=False)}
    buffers = {key: b for _, _, key, b in _persistent_buffers(inner)}
    entries = []
    for key, shape, parts in checkpoint_entries(
            inner, lambda n: (("param", by_name[n].index), by_name[n].shape), buffers):
        if all(p.src[0] == "param" for p in parts):
            entries.append((key, shape, [(p.src[1], p.src_off, p.numel, bool(p.rows))
                                         for p in parts]))
        elif len(parts) == 1 and parts[0].src_off == 0 and not parts[0].rows:
            entries.append((key, shape, buffers[parts[0].src[1]]))
        else:
            raise ValueError(f"save_pretrained: '{key}' is made of parts of buffers")
    path = os.fspath(path)

    def configs():
        if rt._shards is not None and rt._shards.rank != 0:
            return
        os.makedirs(path, exist_ok=True)
        _unpublish(path)
        config = copy.deepcopy(inner.config)
        config.dtype = config_dtype(dtype)
        config.architectures = [type(inner).__name__]
        config.save_pretrained(path)
        if inner.can_generate() and inner.generation_config is not None:
            inner.generation_config.save_pretrained(path)

    export(rt, path, entries, max_shard_size, dtype, False, "save_pretrained", before=configs)


def write_config(src, path, dtype):
    """`src`'s config.json into directory `path` with its dtype set to `dtype`'s, and its
    generation_config.json when it has one (``tiermem export --config-from``)."""
    import shutil
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["dtype"] = config_dtype(dtype)
    config.pop("torch_dtype", None)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    gen = os.path.join(src, "generation_config.json")
    if os.path.exists(gen):
        shutil.copyfile(gen, os.path.join(path, "generation_config.json"))
