"""Configuration for tiermem.initialize: a thin shim over the C++ parser.

The one parser is ``session::ParseConfig`` (runtime/config.h), reached through the
extension: a dict is sent as JSON, a path is read by C++. The keys, defaults and error
messages are therefore exactly those of the LibTorch API, and the TIERMEM_* environment
variables override keys the same way in both (docs/configuration.md). An unknown key or a
bad value raises ValueError naming the key (or the variable) and the value.

A Config's modes are enums (runtime/modes.h, bound in csrc/config.cc): one value per spelling
('-' read as '_': ``DeviceKind.sim_async``), ``str()`` the spelling, and the predicates the
package asks of them (``cfg.activations.offloaded``, ``cfg.precision.torch_dtype``) — code
asks those, never compares spellings.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

from . import _C

Config = _C.Config
Precision, DeviceKind, NvmeEngine, KernelIsa = (_C.Precision, _C.DeviceKind, _C.NvmeEngine,
                                                _C.KernelIsa)
PlanMode, ActivationMode, OptimizerPlacement, OptimizerOverlap = (
    _C.PlanMode, _C.ActivationMode, _C.OptimizerPlacement, _C.OptimizerOverlap)
CheckpointIo, UnmaterializedReads, InPlace = _C.CheckpointIo, _C.UnmaterializedReads, _C.InPlace


def parse_config(config=None, env: Mapping[str, str] | None = None) -> Config:
    """`config`: a dict, a JSON file path, or None (defaults). `env`: the TIERMEM_* variables
    to apply (default: the process environment)."""
    env_map = None if env is None else {str(k): str(v) for k, v in env.items()}
    if config is None:
        config = {}
    if isinstance(config, (str, os.PathLike)):
        return _C.parse_config_file(os.fspath(config), env_map)
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or a JSON file path, got {type(config).__name__}")
    try:
        text = json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config is not JSON-serializable: {e}") from None
    return _C.parse_config(text, env_map)
