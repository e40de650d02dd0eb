"""The gradient accumulation dtype of a bf16 DeepSpeed config, settled before any rank starts: fp32 where gradients
accumulate over micro-steps, what the installed DeepSpeed runs at ZeRO-0 (it differs between releases:
ds_core.compat.deepspeed_behaviour), and a refusal naming the key for a dtype it refuses."""
from __future__ import annotations

from typing import Any

from ds_core import log
from ds_core.errors import ConfigError

# Measured with a synthetic check: relative error of a gradient summed over 128 micro-steps.
BF16_ACCUM_ERROR = "1.15 % relative error at 128 micro-steps in bf16 vs 0.07 % with fp32 accumulation"


def notice(msg: str) -> None:
    """Once per job: every rank resolves the config, only global rank 0 (or a lone process) speaks."""
    log.say(msg, stderr=True)


def settle_grad_accum_dtype(cfg: dict, source: str = "DeepSpeed config") -> None:
    """bf16 with accumulation > 1: accumulate gradients in fp32 (fills data_types.grad_accum_dtype when absent, warns
    when the config asks for bf16 accumulation). Modifies cfg in place.

    DeepSpeed accumulates in the model dtype unless data_types.grad_accum_dtype says otherwise (engine.get_data_types).
    With "fp32": ZeRO-1 switches to BF16_Optimizer (fp32 gradient buffers), ZeRO-2 and ZeRO-3 keep fp32 partition
    buffers (stage_1_and_2.py / stage3.py gradient_accumulation_dtype). ZeRO-0 differs by release, so it is asked of the
    installed DeepSpeed (ds_core.compat.deepspeed_behaviour.optimizer_wrapper): 0.19 runs bf16 ZeRO-0 only with bf16
    accumulation, Habana's fork (0.16.1) only with fp32 accumulation (BF16_Optimizer); a dtype the installed one refuses
    is a ConfigError, one it needs is filled in with a notice."""
    bf16 = (cfg.get("bf16") or {}).get("enabled") or (cfg.get("bfloat16") or {}).get("enabled")
    ga = cfg.get("gradient_accumulation_steps") or 1
    data_types = cfg.get("data_types") or {}
    asked = data_types.get("grad_accum_dtype")
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if asked not in (None, "fp32", "fp16", "bf16"):
        raise ConfigError(f"{source}: data_types.grad_accum_dtype = {asked!r}: expected \"fp32\", \"bf16\" or \"fp16\"")
    if not bf16:
        return
    ok = _accum_dtypes(stage)  # the accumulation dtypes this DeepSpeed runs bf16 with at this stage
    if asked in ok and ok[asked] is not True:
        raise ConfigError(f"{source}: data_types.grad_accum_dtype = \"{asked}\" with bf16 and zero_optimization.stage "
                          f"{stage}: {ok[asked]} at deepspeed.initialize; use {_accum_advice(ok, stage)}")
    want = asked or ("fp32" if ga > 1 and stage > 0 else None)
    if want is None and isinstance(ok.get("bf16"), str):  # this DeepSpeed has no bf16 accumulation at ZeRO-0
        cfg["data_types"] = dict(data_types, grad_accum_dtype="fp32")
        notice(f"{source}: bf16 at zero_optimization.stage 0: gradients accumulate in fp32 (data_types."
                f"grad_accum_dtype added; bf16 accumulation at this stage: {ok['bf16']})")
        return
    if ga <= 1:
        return
    if asked is None and want == "fp32":
        cfg["data_types"] = dict(data_types, grad_accum_dtype="fp32")
        notice(f"{source}: bf16 with gradient_accumulation_steps {ga}: gradients accumulate in fp32 "
                f"(data_types.grad_accum_dtype added; DeepSpeed's default would accumulate in bf16)")
    elif (want or "bf16") != "fp32":
        why = ("this DeepSpeed cannot accumulate bf16 gradients in fp32 at ZeRO stage 0" if asked is None else
               f"data_types.grad_accum_dtype is {asked!r}")
        notice(f"warning: {source}: bf16 with gradient_accumulation_steps {ga} accumulates gradients in bf16 "
                f"({why}); measured: {BF16_ACCUM_ERROR}. Use ZeRO >= 1 with data_types.grad_accum_dtype \"fp32\".")


def _accum_dtypes(stage: int) -> dict[str, Any]:
    """{"fp32": True | DeepSpeed's refusal, "bf16": ...} for bf16 weights at ZeRO `stage`. Stages >= 1 run both on
    every supported DeepSpeed (no import); ZeRO-0 is asked of the installed one."""
    if stage > 0:
        return {"fp32": True, "bf16": True}
    from ds_core.compat.deepspeed_behaviour import WrapperRefused, deepspeed_version, optimizer_wrapper

    out: dict[str, Any] = {}
    for acc in ("fp32", "bf16"):
        try:
            optimizer_wrapper(0, "bf16", acc)
            out[acc] = True
        except WrapperRefused as e:
            out[acc] = f"DeepSpeed {deepspeed_version()} refuses it ({e})"
    return out


def _accum_advice(ok: dict[str, Any], stage: int) -> str:
    works = [f"data_types.grad_accum_dtype \"{acc}\"" for acc, v in ok.items() if v is True]
    return " or ".join(works) + (" at this stage" if works else "") + ", or ZeRO stage >= 1" * (stage == 0)


__all__ = ["settle_grad_accum_dtype", "notice", "BF16_ACCUM_ERROR"]
