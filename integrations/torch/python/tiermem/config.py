"""Config parsing for tiermem.initialize: a dict or a JSON file path (DeepSpeed-like).

Every key is checked; an unknown key or a bad value raises ValueError naming the key and the
value (and, for unknown keys, the valid ones). Sizes are strings like "2GiB" or byte counts.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from . import _C

_TOP_KEYS = {
    "device", "host", "nvme", "precision", "optimizer", "gradient_accumulation_steps",
    "gradient_clipping", "chunk_size", "timeline", "prefetch_depth", "loss_scaling",
    "device_kind",
}
_SCALE_KEYS = {"initial_scale", "growth_interval", "growth_factor", "backoff_factor"}
_OPT_KEYS = {"type", "lr", "betas", "eps", "weight_decay"}


@dataclasses.dataclass
class Config:
    device_budget: int = 2 << 30
    host_budget: int = 8 << 30
    nvme_path: str | None = None
    nvme_size: int = 0
    precision: str = "fp32"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    chunk_size: int | None = None  # elements per chunk; None = automatic
    timeline: str | None = None
    prefetch_depth: int = 4
    # fp16 dynamic loss scaling (torch.amp.GradScaler's defaults and semantics).
    initial_scale: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    # "auto" (CUDA when built with it and a GPU is visible, else SimDevice), "cuda" or "sim";
    # the TIERMEM_DEVICE environment variable overrides the config.
    device_kind: str = "auto"


def _size(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"config '{key}': expected a size like '2GiB' or a byte count, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"config '{key}': size must be > 0, got {value}")
        return value
    if isinstance(value, str):
        try:
            n = _C.parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"config '{key}': {value!r} is not a size ({e})") from None
        if n <= 0:
            raise ValueError(f"config '{key}': size must be > 0, got {value!r}")
        return n
    raise ValueError(f"config '{key}': expected a size like '2GiB' or a byte count, got {value!r}")


def _number(key: str, value: Any, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config '{key}': expected a number, got {value!r}")
    v = float(value)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValueError(f"config '{key}': {value!r} out of range")
    if hi is not None and v > hi:
        raise ValueError(f"config '{key}': {value!r} out of range")
    return v


def _int(key: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"config '{key}': expected an integer >= {lo}, got {value!r}")
    return value


def _check_dir_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".tiermem-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"config 'nvme.path': {path!r} is not a writable directory ({e.strerror})") from None


# Environment variables that override config keys (docs/configuration.md), read once per
# parse. An error names the variable, not the key.
_ENV_SIZES = {"TIERMEM_DEVICE_BUDGET": "device", "TIERMEM_HOST_BUDGET": "host"}


def _apply_env(config: dict, env) -> dict:
    config = dict(config)
    for var, key in _ENV_SIZES.items():
        if env.get(var):
            config[key] = _size(var, env[var])
    if env.get("TIERMEM_NVME_SIZE") or env.get("TIERMEM_NVME_PATH"):
        nv = dict(config.get("nvme") or {})
        if env.get("TIERMEM_NVME_SIZE"):
            nv["size"] = _size("TIERMEM_NVME_SIZE", env["TIERMEM_NVME_SIZE"])
        if env.get("TIERMEM_NVME_PATH"):
            nv["path"] = env["TIERMEM_NVME_PATH"]
        if "size" not in nv:
            raise ValueError("TIERMEM_NVME_PATH is set but no NVMe size is (config 'nvme.size' "
                             "or TIERMEM_NVME_SIZE)")
        config["nvme"] = nv
    if env.get("TIERMEM_TIMELINE"):
        config["timeline"] = env["TIERMEM_TIMELINE"]
    return config


def parse_config(config: dict | str | os.PathLike | None, env=None) -> Config:
    """`env` (default: os.environ) supplies the TIERMEM_* overrides."""
    env = os.environ if env is None else env
    if config is None:
        config = {}
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except OSError as e:
            raise ValueError(f"config file {str(config)!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {str(config)!r}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or a JSON file path, got {type(config).__name__}")
    unknown = sorted(set(config) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown}; valid keys: {sorted(_TOP_KEYS)}")
    config = _apply_env(config, env)
    c = Config()
    if "device" in config:
        c.device_budget = _size("device", config["device"])
    if "host" in config:
        c.host_budget = _size("host", config["host"])
    if "nvme" in config and config["nvme"] is not None:
        nv = config["nvme"]
        if not isinstance(nv, dict):
            raise ValueError(f"config 'nvme': expected {{'path': ..., 'size': ...}}, got {nv!r}")
        bad = sorted(set(nv) - {"path", "size"})
        if bad:
            raise ValueError(f"config 'nvme': unknown key(s) {bad}; valid keys: ['path', 'size']")
        if "size" not in nv:
            raise ValueError("config 'nvme': 'size' is required")
        c.nvme_size = _size("nvme.size", nv["size"])
        path = nv.get("path")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"config 'nvme.path': expected a directory path, got {path!r}")
        if path is not None:
            _check_dir_writable(str(path))
            c.nvme_path = str(path)
    if "precision" in config:
        p = config["precision"]
        if p not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"config 'precision': expected 'fp32', 'bf16' or 'fp16', got {p!r}")
        c.precision = p
    if "optimizer" in config:
        o = config["optimizer"]
        if not isinstance(o, dict):
            raise ValueError(f"config 'optimizer': expected a dict, got {o!r}")
        bad = sorted(set(o) - _OPT_KEYS)
        if bad:
            raise ValueError(f"config 'optimizer': unknown key(s) {bad}; valid keys: {sorted(_OPT_KEYS)}")
        if o.get("type", "adamw") != "adamw":
            raise ValueError(f"config 'optimizer.type': expected 'adamw', got {o['type']!r}")
        if "lr" in o:
            c.lr = _number("optimizer.lr", o["lr"], 0.0)
        if "betas" in o:
            b = o["betas"]
            if not isinstance(b, (list, tuple)) or len(b) != 2:
                raise ValueError(f"config 'optimizer.betas': expected two numbers, got {b!r}")
            c.betas = (_number("optimizer.betas[0]", b[0], 0.0, 1.0),
                       _number("optimizer.betas[1]", b[1], 0.0, 1.0))
            if c.betas[0] >= 1.0 or c.betas[1] >= 1.0:
                raise ValueError(f"config 'optimizer.betas': each must be < 1, got {b!r}")
        if "eps" in o:
            c.eps = _number("optimizer.eps", o["eps"], 0.0)
        if "weight_decay" in o:
            c.weight_decay = _number("optimizer.weight_decay", o["weight_decay"], 0.0)
    if "gradient_accumulation_steps" in config:
        c.gradient_accumulation_steps = _int("gradient_accumulation_steps",
                                             config["gradient_accumulation_steps"], 1)
    if "gradient_clipping" in config:
        c.gradient_clipping = _number("gradient_clipping", config["gradient_clipping"], 0.0)
    if "chunk_size" in config and config["chunk_size"] is not None:
        c.chunk_size = _int("chunk_size", config["chunk_size"], 1)
    if "timeline" in config and config["timeline"] is not None:
        t = config["timeline"]
        if not isinstance(t, (str, os.PathLike)):
            raise ValueError(f"config 'timeline': expected a path, got {t!r}")
        c.timeline = str(t)
    if "loss_scaling" in config and config["loss_scaling"] is not None:
        ls = config["loss_scaling"]
        if not isinstance(ls, dict):
            raise ValueError(f"config 'loss_scaling': expected a dict, got {ls!r}")
        bad = sorted(set(ls) - _SCALE_KEYS)
        if bad:
            raise ValueError(f"config 'loss_scaling': unknown key(s) {bad}; valid keys: {sorted(_SCALE_KEYS)}")
        if "initial_scale" in ls:
            c.initial_scale = _number("loss_scaling.initial_scale", ls["initial_scale"], 0.0)
            if c.initial_scale <= 0:
                raise ValueError("config 'loss_scaling.initial_scale': must be > 0")
        if "growth_interval" in ls:
            c.growth_interval = _int("loss_scaling.growth_interval", ls["growth_interval"], 1)
        if "growth_factor" in ls:
            c.growth_factor = _number("loss_scaling.growth_factor", ls["growth_factor"], 1.0)
        if "backoff_factor" in ls:
            c.backoff_factor = _number("loss_scaling.backoff_factor", ls["backoff_factor"], 0.0, 1.0)
            if c.backoff_factor <= 0:
                raise ValueError("config 'loss_scaling.backoff_factor': must be > 0")
    kind = env.get("TIERMEM_DEVICE") or config.get("device_kind", "auto")
    if kind not in ("auto", "cuda", "sim"):
        raise ValueError(f"config 'device_kind' / TIERMEM_DEVICE: expected 'auto', 'cuda' or 'sim', got {kind!r}")
    c.device_kind = kind
    if "prefetch_depth" in config:
        c.prefetch_depth = _int("prefetch_depth", config["prefetch_depth"], 0)
    return c
