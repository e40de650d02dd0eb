"""DeepSpeed JSON values that DeepSpeed itself accepts silently (or refuses only after distributed init and
model build), refused before any rank starts."""
from __future__ import annotations

import math
from typing import Any

from ds_core.config.accumulation import settle_grad_accum_dtype  # noqa: F401 - part of ds_core.config's API
from ds_core.errors import ConfigError

# DeepSpeed values that DeepSpeed itself accepts silently (or refuses only after distributed init and model build)

# Sizes in elements. DeepSpeed 0.19's ZeroConfig allows 0 for most (ge=0) but a 0 bucket makes no progress, so
# bucket sizes must be positive; thresholds and distances may be 0 (0 = persist/reuse nothing).
_ZERO_POSITIVE = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size")
_ZERO_NON_NEGATIVE = ("stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                      "stage3_max_live_parameters", "stage3_max_reuse_distance")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_optimizer_params(params: dict, source: str) -> None:
    """eps > 0, weight_decay >= 0 and betas two numbers in [0, 1), all finite (NaN and inf included: JSON has
    neither, but Python's json module reads NaN and Infinity); "auto" is left to the Trainer-style filling."""
    for key, low, closed in (("eps", 0, False), ("weight_decay", 0, True)):
        v = params.get(key, "auto")
        if v != "auto" and not (_is_number(v) and (v >= low if closed else v > low)):
            raise ConfigError(f"{source}: optimizer.params.{key} = {v!r}: expected a number {'>=' if closed else '>'} "
                              f"{low}")
    betas = params.get("betas", "auto")
    if betas != "auto" and not (isinstance(betas, list) and len(betas) == 2
                                and all(b == "auto" or (_is_number(b) and 0 <= b < 1) for b in betas)):
        raise ConfigError(f"{source}: optimizer.params.betas = {betas!r}: expected two numbers in [0, 1)")


def check_ds_values(cfg: dict, source: str = "DeepSpeed config") -> None:
    """Refuse values DeepSpeed would train with silently (a negative lr or clipping) or reject only after distributed
    init (bucket sizes), naming the key."""
    opt = cfg.get("optimizer")
    if opt is not None:
        params = opt.get("params", {}) if isinstance(opt, dict) else None
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: optimizer must be an object with a \"params\" object, got {opt!r}")
        if "lr" in params and not (_is_number(params["lr"]) and params["lr"] > 0):
            raise ConfigError(f"{source}: optimizer.params.lr = {params['lr']!r}: expected a number > 0")
        _check_optimizer_params(params, source)
    if "gradient_clipping" in cfg and not (_is_number(cfg["gradient_clipping"]) and cfg["gradient_clipping"] >= 0):
        raise ConfigError(f"{source}: gradient_clipping = {cfg['gradient_clipping']!r}: expected a number >= 0 "
                          f"(0 turns clipping off)")
    zero = cfg.get("zero_optimization") or {}
    for key in _ZERO_POSITIVE + _ZERO_NON_NEGATIVE:
        if key not in zero:
            continue
        v, low = zero[key], (1 if key in _ZERO_POSITIVE else 0)
        if not (_is_number(v) and float(v).is_integer() and v >= low):
            raise ConfigError(f"{source}: zero_optimization.{key} = {v!r}: expected a whole number of elements "
                              f">= {low}")
