"""``tiermem export CKPT DIR [--config-from SRC] [--dtype bf16] [--max-shard-size 5GB]``:
a tiermem training checkpoint (``tiermem.save_checkpoint``'s safetensors file,
docs/checkpoints.md) to Hugging Face's layout, without building the model in memory.

The checkpoint's parameter values (the keys without a ``/``: ``exp_avg/<name>`` and the other
optimizer state are left out) are streamed into shards by the core's writer
(``_C.copy_weights``: weights/shard_writer.h — temporary names renamed when complete, the
index last), converted to ``--dtype`` as torch's ``.to`` rounds. Without ``--config-from`` the
keys are the checkpoint's own names. With it, SRC's ``config.json`` says which transformers
model the values belong to: the model is built on the meta device (no memory) to learn its
names, its ties and its conversions, and the keys are what its ``save_pretrained`` writes
(hf.checkpoint_entries: tied names once, fused experts cut back into per-expert keys); SRC's
``config.json`` (its ``dtype`` set to the one written) and ``generation_config.json`` are
copied, so ``AutoModelForCausalLM.from_pretrained(DIR)`` loads the result.

Threading: the calling thread; the copy runs without the GIL.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from . import _C
from .hf import _unpublish, checkpoint_entries, write_config
from .weights import _DTYPE_NAMES, _persistent_buffers, shard_bytes

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_on_meta(src):
    """The transformers model SRC's config.json describes, built on the meta device."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(src)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        return cls(config) if cls is not None else \
            transformers.AutoModelForCausalLM.from_config(config)


def model_entries(model, values, ckpt, src) -> list:
    """The copy entries of `values` (the checkpoint's {key: header entry}) as `model`'s
    save_pretrained would write them; ValueError when the checkpoint is not this model's."""
    what = f"the {type(model).__name__} of {src}'s config"
    objects: dict[int, list] = {}
    shapes = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        objects.setdefault(id(p), []).append(n)
        shapes[n] = list(p.shape)
    key_of = {}
    for names in objects.values():
        have = [n for n in names if n in values]
        if not have:
            raise ValueError(f"export: {ckpt} has no value of parameter '{names[0]}' of {what}")
        if list(values[have[0]]["shape"]) != shapes[have[0]]:
            raise ValueError(f"export: '{have[0]}' in {ckpt} has shape "
                             f"{list(values[have[0]]['shape'])}, {what} {shapes[have[0]]}")
        key_of.update(dict.fromkeys(names, have[0]))
    extra = sorted(set(values) - set(key_of.values()))
    if extra:
        raise ValueError(f"export: {ckpt} holds '{extra[0]}', which {what} has no parameter "
                         "of")
    buffers = [key for _, _, key, _ in _persistent_buffers(model)]
    if buffers:
        raise ValueError(f"export: {what} has persistent buffers ({buffers[0]}, ...), which a "
                         "training checkpoint does not hold: export the live model with "
                         "tiermem.save_pretrained")
    return [(key, shape, [(p.src, p.src_off, p.numel, bool(p.rows)) for p in parts])
            for key, shape, parts in checkpoint_entries(
                model, lambda n: (key_of[n], shapes[n]), {})]


def export_checkpoint(ckpt, out, config_from=None, dtype=None, max_shard_size="5GB") -> int:
    """Writes the parameter values of tiermem training checkpoint `ckpt` to directory `out`
    (see the module docstring); returns the number of tensors written."""
    ckpt, out = os.fspath(ckpt), os.fspath(out)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export: dtype must be None, torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {dtype}")
    _C.checkpoint_metadata(ckpt)  # a tiermem checkpoint (its header checked), else an error
    values = {k: v for k, v in _C.weights_inspect(ckpt)["tensors"].items() if "/" not in k}
    if config_from is None:
        entries = [(k, list(v["shape"]), [(k, 0, math.prod(v["shape"]), False)])
                   for k, v in values.items()]
    else:
        entries = model_entries(model_on_meta(config_from), values, ckpt, config_from)
        os.makedirs(out, exist_ok=True)
        _unpublish(out)
        write_config(config_from, out, dtype)
    _C.copy_weights(ckpt, out, entries, dtype=_DTYPE_NAMES[dtype],
                    max_shard_bytes=shard_bytes(max_shard_size))
    return len(entries)


def main(argv) -> int:
    p = argparse.ArgumentParser(
        prog="tiermem export",
        description="A tiermem training checkpoint (tiermem.save_checkpoint) to Hugging "
                    "Face's layout (sharded safetensors + index), streamed, without building "
                    "the model (docs/pretrained.md).")
    p.add_argument("checkpoint", help="the training checkpoint (.safetensors)")
    p.add_argument("out", help="the directory to write")
    p.add_argument("--config-from", metavar="SRC",
                   help="a Hugging Face checkpoint directory whose config.json describes the "
                        "model: its config and generation config are copied and the keys are "
                        "what transformers' save_pretrained writes for it")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                   help="the dtype written (rounded as torch's .to rounds); default fp32")
    p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 2GiB (default 5GB)")
    args = p.parse_args(argv)
    try:
        n = export_checkpoint(args.checkpoint, args.out, args.config_from,
                              _DTYPES[args.dtype], args.max_shard_size)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"tiermem export: {e}", file=sys.stderr)
        return 1
    print(f"tiermem export: {n} tensors written to {args.out}")
    return 0
