"""What each change inside DeepSpeed needs from the installed DeepSpeed, asked of it (ds_core.compat.changes).

Each `missing` check returns what the installed release lacks for a change in words (None: it has everything the
change uses: the attribute, the method's parameters); each `fixed` check returns why the installed release does not
need a change that makes an older release's behaviour right (None: the fault is there), asked of the behaviour
itself through a probe (ds_core.compat.deepspeed_behaviour), never of the source text. Whether a replaced body is
one a change was verified against is the fingerprint's question (ds_core.compat.fingerprint).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any

# DeepSpeed's Muon optimizer module: imported by ZeRO's optimizer check in releases that have it (ds_core.compat.
# lazy_compile imports it with its torch.compile decorations deferred)
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _params(fn: Any) -> list[str] | None:
    try:
        return [p for p in inspect.signature(fn).parameters if p != "self"]
    except (TypeError, ValueError):
        return None


def signature_differs(owner: str, name: str, expected: list[str], allowed: tuple[str, ...] = ()) -> str | None:
    """None where `owner` ("module" or "module:Class") has `name` with exactly the `expected` parameters (plus any of
    `allowed`); else what differs, in words."""
    module, _, cls = owner.partition(":")
    try:
        holder = _attr(module, cls) if cls else importlib.import_module(module)
    except ImportError:
        holder = None
    fn = getattr(holder, name, None) if holder is not None else None
    where = f"{module}.{cls + '.' if cls else ''}{name}"
    if fn is None:
        return f"this DeepSpeed has no {where}"
    got = _params(fn)
    if got is None or [p for p in got if p not in allowed] != expected:
        return f"{where} takes ({', '.join(got or ['?'])}), not ({', '.join(expected)})"
    return None


def bf16_norm() -> str | None:
    return (signature_differs("deepspeed.runtime.bf16_optimizer:BF16_Optimizer", "get_grads_for_norm",
                              ["for_clipping"])
            or (None if _attr("deepspeed.runtime.bf16_optimizer", "get_global_norm_of_tensors") else
                "this DeepSpeed's bf16_optimizer has no get_global_norm_of_tensors"))


def zero_norm() -> str | None:
    return signature_differs("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "get_grad_norm_direct",
                             ["gradients", "params", "norm_type"])


def device_clip() -> str | None:
    # use_graph (HPU graph capture, Habana's fork) is passed on: a captured clip goes to DeepSpeed's own function
    return signature_differs("deepspeed.runtime.bf16_optimizer", "clip_tensors_by_global_norm",
                             ["input_tensors", "max_norm", "global_norm", "mpu", "eps"], allowed=("use_graph",))


def grad_hook() -> str | None:
    return signature_differs("deepspeed.runtime.bf16_optimizer:BF16_Optimizer", "_update_hp_grad",
                             ["lp", "group_idx", "param_idx", "clear_lp_grads"])


def muon() -> str | None:
    try:
        found = importlib.util.find_spec(MUON_MODULE) is not None
    except ImportError:
        found = False
    return None if found else f"this DeepSpeed has no {MUON_MODULE} (nothing compiles when ZeRO checks the optimizer)"


def cpuinfo() -> str | None:
    return None if _attr("cpuinfo", "get_cpu_info") else "py-cpuinfo is not installed (DeepSpeed then asks lscpu)"


def comm_backend() -> str | None:
    try:
        comm = importlib.import_module("deepspeed.comm.comm")
    except ImportError:
        return "this DeepSpeed has no deepspeed.comm.comm"
    return None if hasattr(comm, "cdb") else "deepspeed.comm.comm has no backend object `cdb` to time"


def group_norms() -> str | None:
    return signature_differs("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "scaled_global_norm",
                             ["norm_type"])


def group_norms_fixed() -> str | None:
    if _attr("deepspeed.runtime.utils", "combine_grad_norm_groups") is not None:
        return "this DeepSpeed combines group norms keeping a non-finite one (combine_grad_norm_groups)"
    return None


def relink() -> str | None:
    for owner in ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer",
                  "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"):
        for name in ("_link_all_hp_params", "_lazy_init_hp_params_optimizer_state"):
            if why := signature_differs(owner, name, []):
                return why
    return None


def relink_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import universal_load_repoints_fp32

    if universal_load_repoints_fp32():
        return None
    return "this DeepSpeed's universal load leaves each parameter's fp32 fragment where it was"


def buckets() -> str | None:
    return signature_differs("deepspeed.runtime.zero.stage_1_and_2", "split_half_float_double", ["tensors"])


def buckets_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import zero_buckets_drop_cpu

    if zero_buckets_drop_cpu():
        return None
    return "this DeepSpeed groups ZeRO's gradients by dtype, on any device"


def zero3_gather() -> str | None:
    return signature_differs("deepspeed.runtime.zero.partition_parameters:Init", "_allgather_params_coalesced",
                             ["param_list", "hierarchy", "quantize"])


def zero3_gather_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import zero3_gather_waits_last_only

    if zero3_gather_waits_last_only():
        return None
    return "this DeepSpeed's ZeRO-3 coalesced all-gather waits for every parameter's collective"


def exports() -> str | None:
    return signature_differs("deepspeed.launcher.multinode_runner:MultiNodeRunner", "add_export", ["key", "var"])


def pdsh() -> str | None:
    owner = "deepspeed.launcher.multinode_runner:PDSHRunner"
    return (signature_differs(owner, "get_cmd", ["environment", "active_resources"])
            or signature_differs(owner, "parse_user_args", [])
            or signature_differs("deepspeed.launcher.multinode_runner:MultiNodeRunner", "add_export", ["key", "var"]))


def exports_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import quotes_plain_exports

    if quotes_plain_exports():
        return None
    return "this DeepSpeed's launcher quotes only the exported values a shell would split"


def baton() -> str | None:
    return signature_differs("torch.utils.cpp_extension:FileBaton", "__init__", ["lock_file_path", "wait_seconds"],
                             allowed=("warn_after_seconds",))


def engine_norm() -> str | None:
    # both releases keep the optimizer's norm in engine._global_grad_norm after each step (_take_model_step) and
    # return it from get_global_grad_norm; the loop reads the attribute where the engine instance has it
    engine = _attr("deepspeed.runtime.engine", "DeepSpeedEngine")
    lacks = [n for n in ("get_global_grad_norm", "_take_model_step") if not hasattr(engine, n)]
    return f"this DeepSpeed's DeepSpeedEngine has no {', '.join(lacks)}" if lacks else None


def zero_layout() -> str | None:
    """The classes' half of the check: every wrapper whose layout is read exists; the attributes are read per wrapper
    instance when the engine is built (ds_core.compat.zero_layout.missing_attributes)."""
    lacks = [f"{m}.{c}" for m, c in (("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
                                     ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
                                     ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"))
             if _attr(m, c) is None]
    return f"this DeepSpeed has no {', '.join(lacks)}" if lacks else None


__all__ = ["MUON_MODULE", "signature_differs"]
