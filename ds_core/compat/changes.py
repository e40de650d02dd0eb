"""Every place the toolkit replaces or reads a DeepSpeed internal (and the one torch internal its op loads go
through), in one list, each applied by feature.

DeepSpeed has no setting for these (docs/benchmarks.md measures each speed-up), so they reach into its classes. The
installed DeepSpeed may be upstream's newest or Habana's fork on a Gaudi image (stacks/, docs/gaudi.md), whose
classes are older: each change first checks that the installed DeepSpeed has what it replaces (the attribute, the
method's parameters), and where it does not, DeepSpeed's own path stays and one line says which change is off and
why. `CHANGES` is the list: what each replaces, the DeepSpeed versions it was checked against (stacks/latest.txt,
stacks/gaudi.txt) and its test; tests/test_flat_norm.py states, per stack, which are on, and that each one on gives
DeepSpeed's own result.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Any, Callable

# DeepSpeed's Muon optimizer module: imported by ZeRO's optimizer check in releases that have it (ds_core.compat.
# lazy_compile imports it with its torch.compile decorations deferred)
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
CHECKED = "DeepSpeed 0.19.8 (stacks/latest.txt) and Habana's fork 0.16.1, release 1.21.0 (stacks/gaudi.txt)"


@dataclass(frozen=True)
class Change:
    name: str
    does: str  # what it does instead, in a few words
    replaces: str  # the DeepSpeed internal it replaces or reads
    module: str  # where the toolkit does it
    test: str
    missing: Callable[[], str | None]  # what the installed DeepSpeed lacks for it (None: it has everything)
    checked: str = CHECKED
    # why the installed DeepSpeed does not need it (a fix of an older release's behaviour), or None: needed
    not_needed: Callable[[], str | None] = lambda: None


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
    holder = _attr(module, cls) if cls else importlib.import_module(module)
    fn = getattr(holder, name, None) if holder is not None else None
    where = f"{module}.{cls + '.' if cls else ''}{name}"
    if fn is None:
        return f"this DeepSpeed has no {where}"
    got = _params(fn)
    if got is None or [p for p in got if p not in allowed] != expected:
        return f"{where} takes ({', '.join(got or ['?'])}), not ({', '.join(expected)})"
    return None


def _bf16_norm() -> str | None:
    return (signature_differs("deepspeed.runtime.bf16_optimizer:BF16_Optimizer", "get_grads_for_norm",
                              ["for_clipping"])
            or (None if _attr("deepspeed.runtime.bf16_optimizer", "get_global_norm_of_tensors") else
                "this DeepSpeed's bf16_optimizer has no get_global_norm_of_tensors"))


def _zero_norm() -> str | None:
    return signature_differs("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "get_grad_norm_direct",
                             ["gradients", "params", "norm_type"])


def _device_clip() -> str | None:
    # use_graph (HPU graph capture, Habana's fork) is passed on: a captured clip goes to DeepSpeed's own function
    return signature_differs("deepspeed.runtime.bf16_optimizer", "clip_tensors_by_global_norm",
                             ["input_tensors", "max_norm", "global_norm", "mpu", "eps"], allowed=("use_graph",))


def _grad_hook() -> str | None:
    return signature_differs("deepspeed.runtime.bf16_optimizer:BF16_Optimizer", "_update_hp_grad",
                             ["lp", "group_idx", "param_idx", "clear_lp_grads"])


def _muon() -> str | None:
    try:
        found = importlib.util.find_spec(MUON_MODULE) is not None
    except ImportError:
        found = False
    return None if found else f"this DeepSpeed has no {MUON_MODULE} (nothing compiles when ZeRO checks the optimizer)"


def _cpuinfo() -> str | None:
    return None if _attr("cpuinfo", "get_cpu_info") else "py-cpuinfo is not installed (DeepSpeed then asks lscpu)"


def _comm_backend() -> str | None:
    try:
        comm = importlib.import_module("deepspeed.comm.comm")
    except ImportError:
        return "this DeepSpeed has no deepspeed.comm.comm"
    return None if hasattr(comm, "cdb") else "deepspeed.comm.comm has no backend object `cdb` to time"


def _group_norms() -> str | None:
    return signature_differs("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "scaled_global_norm",
                             ["norm_type"])


def _group_norms_fixed() -> str | None:
    if _attr("deepspeed.runtime.utils", "combine_grad_norm_groups") is not None:
        return "this DeepSpeed combines group norms keeping a non-finite one (combine_grad_norm_groups)"
    return None


def _relink() -> str | None:
    for owner in ("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer",
                  "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"):
        for name in ("_link_all_hp_params", "_lazy_init_hp_params_optimizer_state"):
            if why := signature_differs(owner, name, []):
                return why
    return None


def _relink_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import universal_load_repoints_fp32

    if universal_load_repoints_fp32():
        return None
    return "this DeepSpeed's universal load leaves each parameter's fp32 fragment where it was"


def _buckets() -> str | None:
    return signature_differs("deepspeed.runtime.zero.stage_1_and_2", "split_half_float_double", ["tensors"])


def _buckets_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import zero_buckets_drop_cpu

    if zero_buckets_drop_cpu():
        return None
    return "this DeepSpeed groups ZeRO's gradients by dtype, on any device"


def _zero3_gather() -> str | None:
    return signature_differs("deepspeed.runtime.zero.partition_parameters:Init", "_allgather_params_coalesced",
                             ["param_list", "hierarchy", "quantize"])


def _zero3_gather_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import zero3_gather_waits_last_only

    if zero3_gather_waits_last_only():
        return None
    return "this DeepSpeed's ZeRO-3 coalesced all-gather waits for every parameter's collective"


def _exports() -> str | None:
    return signature_differs("deepspeed.launcher.multinode_runner:MultiNodeRunner", "add_export", ["key", "var"])


def _exports_fixed() -> str | None:
    from ds_core.compat.deepspeed_behaviour import quotes_plain_exports

    if quotes_plain_exports():
        return None
    return "this DeepSpeed's launcher quotes only the exported values a shell would split"


def _baton() -> str | None:
    return signature_differs("torch.utils.cpp_extension:FileBaton", "__init__", ["lock_file_path", "wait_seconds"],
                             allowed=("warn_after_seconds",))


def _engine_norm() -> str | None:
    # both releases keep the optimizer's norm in engine._global_grad_norm after each step (_take_model_step) and
    # return it from get_global_grad_norm; the loop reads the attribute where the engine instance has it
    engine = _attr("deepspeed.runtime.engine", "DeepSpeedEngine")
    lacks = [n for n in ("get_global_grad_norm", "_take_model_step") if not hasattr(engine, n)]
    return f"this DeepSpeed's DeepSpeedEngine has no {', '.join(lacks)}" if lacks else None


def _zero_layout() -> str | None:
    return None  # read per wrapper instance when the optimizer attaches (ds_core.compat.zero_layout.missing_attributes)


CHANGES: tuple[Change, ...] = (
    Change("flat_grad_norm_bf16", "the global gradient norm over the flat fp32 gradient buffer, in a few ops",
           "BF16_Optimizer.get_grads_for_norm (one norm per parameter tensor)", "ds_core.compat.flat_norm",
           "tests/test_flat_norm.py", _bf16_norm),
    Change("flat_grad_norm_zero", "ZeRO-1/2's global gradient norm over its flat partition, or one multi-tensor norm",
           "DeepSpeedZeroOptimizer.get_grad_norm_direct (one float64 norm per tensor)", "ds_core.compat.flat_norm",
           "tests/test_flat_norm.py", _zero_norm),
    Change("nonfinite_group_norm", "a non-finite group norm makes ZeRO-1/2's global norm inf, as DeepSpeed 0.19 does",
           "DeepSpeedZeroOptimizer.scaled_global_norm, whose vector norm of the groups' norms turns their -1 mark of "
           "inf/NaN into a finite norm (DeepSpeed before combine_grad_norm_groups)", "ds_core.compat.flat_norm",
           "tests/test_ckpt_verify.py", _group_norms, not_needed=_group_norms_fixed),
    Change("device_clip", "the clip coefficient kept on the device (no host read of the norm)",
           "deepspeed.runtime.bf16_optimizer.clip_tensors_by_global_norm", "ds_core.compat.flat_norm",
           "tests/test_device_clip.py", _device_clip),
    Change("one_op_grad_hook", "the per-parameter fp32 gradient accumulation in one in-place add (2 ops, not 5)",
           "BF16_Optimizer._update_hp_grad", "ds_core.compat.grad_hook", "tests/test_flat_norm.py", _grad_hook),
    Change("lazy_muon_import", "DeepSpeed's Muon module imported with its torch.compile decorations deferred",
           "the import of deepspeed.runtime.zero.muon.muon_optimizer in ZeRO's optimizer check",
           "ds_core.compat.lazy_compile", "tests/test_lazy_compile.py", _muon),
    Change("cached_cpu_info", "py-cpuinfo asked once per machine for DeepSpeed's op loads",
           "cpuinfo.get_cpu_info, as DeepSpeed's op builder calls it", "ds_core.device.cpu_info",
           "tests/test_cpu_info.py", _cpuinfo),
    Change("cpu_gradient_buckets", "ZeRO-1/2's gradient buckets grouped by dtype, so every gradient is all-reduced",
           "deepspeed.runtime.zero.stage_1_and_2.split_half_float_double (0.16: matched CPU tensors to no bucket, "
           "and buffered_reduce_fallback all-reduced nothing)", "ds_core.compat.zero_buckets",
           "tests/test_study_comms.py", _buckets, not_needed=_buckets_fixed),
    Change("universal_load_links", "after a universal (resize) load, each parameter's fp32 view is its master weights",
           "the links deepspeed.utils.tensor_fragment.map_to_flat_opt_states leaves (0.16: every fp32 view pointed "
           "at the exp_avg_sq buffer)", "ds_core.compat.universal_load", "tests/test_resize.py", _relink,
           not_needed=_relink_fixed),
    Change("zero3_gather_waits", "ZeRO-3's coalesced all-gather on the CPU accelerator one parameter at a time, each "
           "waited for", "deepspeed.runtime.zero.partition_parameters.Init._allgather_params_coalesced (0.16 waits "
           "for the last parameter's all-gather only: over gloo an earlier gathered weight could be read before it "
           "arrived)", "ds_core.compat.zero3_gather", "tests/test_zero3_gather.py", _zero3_gather,
           not_needed=_zero3_gather_fixed),
    Change("mpi_exports_as_given", "the launcher's exported variables reach MPI ranks as given (quoted only where a "
           "shell would split them)", "deepspeed.launcher.multinode_runner.MultiNodeRunner.add_export (0.16 wraps "
           "every value in double quotes, which mpirun's -x hands to every rank)", "launch.ds_runner",
           "tests/test_launch_ssh.py", _exports, not_needed=_exports_fixed),
    Change("op_build_lock_holder", "the JIT build lock of DeepSpeed's ops names its holder; a dead holder's is cleared",
           "torch.utils.cpp_extension.FileBaton, the lock every load of a DeepSpeed op takes (torch's own, not "
           "DeepSpeed's)", "ds_core.compat.op_baton", "tests/test_ds_core_engine.py", _baton),
    Change("engine_grad_norm", "the step's global gradient norm read where the engine keeps it, as a device tensor",
           "DeepSpeedEngine.get_global_grad_norm (reads, changes none; Habana's fork's calls .item() on the norm: "
           "a device sync every step)", "ds_core.run.loop", "tests/test_step_syncs.py", _engine_norm),
    Change("zero_partition_layout", "NVLAMB / LANS trust ratios per parameter tensor under ZeRO (reads, changes none)",
           "the flat-partition attributes of BF16_Optimizer, DeepSpeedZeroOptimizer and ZeRO-3's optimizer",
           "ds_core.compat.zero_layout", "tests/test_bert_optim_zero.py", _zero_layout),
    Change("comm_phase_timing", "each collective timed inside sampled steps (wraps, changes no result)",
           "the methods of deepspeed.comm.comm.cdb", "ds_core.outputs.phases", "tests/test_ds_core_phases.py",
           _comm_backend),
)
BY_NAME = {c.name: c for c in CHANGES}


def missing(name: str) -> str | None:
    """What the installed DeepSpeed lacks for change `name`; None where it has everything the change replaces."""
    return BY_NAME[name].missing()


def replace_attr(name: str, owner: Any, attr: str, marker: str, make: Callable[[Any], Any],
                 say: Callable[[str], None] | None = None) -> bool:
    """Change `name` as a replacement of `owner.attr` by `make(owner.attr)`, whose result carries the attribute
    `marker` (idempotent: a marked one stays); True where the replacement is in place. Off, with `say`'s line, where
    the installed DeepSpeed lacks what it replaces."""
    if getattr(getattr(owner, attr), marker, False):
        return True
    if why := missing(name):
        say_off(name, why, say)
        return False
    setattr(owner, attr, make(getattr(owner, attr)))
    return True


def status() -> dict[str, str]:
    """{change: "on" | "off: <why>" | "not needed: <why>"} for the installed DeepSpeed (its classes; engine-specific
    conditions such as the optimizer wrapper a run gets are decided when the engine is built)."""
    out = {}
    for c in CHANGES:
        if (fixed := c.not_needed()) is not None:
            out[c.name] = f"not needed: {fixed}"
        else:
            out[c.name] = "on" if (why := c.missing()) is None else f"off: {why}"
    return out


def say_off(name: str, why: str, say: Callable[[str], None] | None) -> None:
    """The one line for a change left off because the installed DeepSpeed lacks what it replaces."""
    if say is not None:
        c = BY_NAME[name]
        say(f"[ds_core] {name} off: {why}; DeepSpeed's own path runs instead ({c.does}: {c.module})")


__all__ = ["Change", "CHANGES", "BY_NAME", "CHECKED", "MUON_MODULE", "missing", "replace_attr", "status", "say_off",
           "signature_differs"]
