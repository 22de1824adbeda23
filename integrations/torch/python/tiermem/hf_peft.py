"""PEFT adapters built on the meta device get PEFT's initialization (hf.py).

``peft.get_peft_model`` on a base built on the meta device (a base larger than RAM, loaded
by ``weights=``) moves each new adapter to its base layer's device — the meta device — so
the adapter's values are lost before tiermem sees them. They are made again as PEFT's
``LoraLayer.update_layer`` made them: each adapter module's own ``reset_parameters()``
(``nn.Linear``'s, as its constructor ran it), then the layer's
``reset_lora_parameters(adapter, init_lora_weights)`` with the adapter config's
``init_lora_weights`` (True: A as nn.Linear, B zero; "gaussian"). Under the same torch RNG
state this draws exactly what PEFT drew. An adapter whose initialization needs the base
weights (PiSSA, OLoRA, LoftQ, EVA, DoRA's magnitude) or a tuner other than LoRA is a
ValueError naming it: its values cannot be made without the base in memory. So is a meta
adapter of a model loaded for inference (`inference_mode`, what `PeftModel.from_pretrained`
sets): its trained values were lost on the meta device, and a fresh initialization would
silently stand in for them.

Owns nothing past the call: each adapter parameter gets CPU storage (NaN first, so a value
no initialization wrote is caught), is written into its chunks and left empty, as
initvalues.py leaves what it initializes (restore_meta puts it back on meta on failure).
Threading: the thread calling tiermem.initialize.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def init_meta_adapters(adapters, peft_config, session) -> set:
    """Initializes the meta adapter records `adapters` ([(record, (tuner layer, adapter
    name))]) into `session`; returns their record indices."""
    layers: dict[tuple, tuple] = {}
    for r, (layer, name) in adapters:
        layers.setdefault((id(layer), name), (layer, name, []))[2].append(r)
    for layer, name, records in layers.values():  # refused before any record changes
        config = peft_config.get(name)
        if config is not None and getattr(config, "inference_mode", False):
            raise ValueError(
                f"PEFT adapter '{name}' ({records[0].name}) is on the meta device in a model "
                "loaded for inference (PeftModel.from_pretrained on a base built on the meta "
                "device leaves the loaded adapter on its base layer's device, without its "
                "values): tiermem would give it a fresh initialization, not the trained "
                "values. Assign them first: model.load_state_dict(adapter_state, strict=False, "
                "assign=True), with the file's keys named as the model's (docs/pretrained.md)")
    done = set()
    for layer, name, records in layers.values():
        for r in records:
            torch.utils.swap_tensors(r.orig, nn.Parameter(
                torch.full(r.orig.shape, math.nan, dtype=r.orig.dtype),
                requires_grad=r.orig.requires_grad))
        _reset(layer, name, peft_config)
        for r in records:
            if torch.isnan(r.orig).any():
                raise ValueError(
                    f"PEFT adapter parameter {r.name} was built on the meta device and PEFT's "
                    f"initialization ({type(layer).__name__}.reset_lora_parameters) did not "
                    "write all of it: its initialization needs the base weights; create the "
                    "adapter on a base with values, or load it (PeftModel.from_pretrained)")
            session.write_param(r.index, r.orig.detach().reshape(-1).contiguous())
            r.orig.data = torch.empty(0, dtype=r.orig.dtype)  # its values are in the chunks
            done.add(r.index)
    return done


def _reset(layer, name, peft_config):
    """PEFT's update_layer initialization of adapter `name` of tuner `layer`."""
    reset = getattr(layer, "reset_lora_parameters", None)
    config = peft_config.get(name)
    if reset is None or config is None:
        raise ValueError(
            f"PEFT adapter '{name}' of a {type(layer).__name__} was built on the meta device: "
            "tiermem gives meta adapters LoRA's initialization only; create this adapter on a "
            "base with values")
    init = getattr(config, "init_lora_weights", True)
    with torch.no_grad():
        for attr in layer.adapter_layer_names:
            modules = getattr(layer, attr, None)
            if isinstance(modules, nn.ModuleDict) and name in modules:
                own = getattr(modules[name], "reset_parameters", None)
                if callable(own):
                    own()
        try:
            reset(name, init)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                f"PEFT adapter '{name}' was built on the meta device and its initialization "
                f"(init_lora_weights={init!r}) cannot run without the base weights in memory: "
                f"{e}") from e
