"""Every change the toolkit makes inside DeepSpeed (and the two outside it its op loads go through), in one list,
applied from one call per stage, recorded, and switchable.

API (what a run, a tool and a test harness call):
- apply_stage(stage, **context) -> {name: state}: applies every change of `stage` (STAGES) that the switch leaves
  on, that the installed DeepSpeed needs, whose replaced bodies are ones it was verified against and whose feature
  check passes; idempotent. Context keywords: device_type ("cpu" | "cuda" | "hpu"; default: DeepSpeed's
  accelerator), engine (after_initialize, checkpoint_load), universal (checkpoint_load: the load went through the
  universal format), say (where the one-line notices go; None: nowhere). The stages, in a run's order:
    process_start      before deepspeed.init_distributed (ds_core.rank.dist)
    before_initialize  just before deepspeed.initialize (ds_core.rank.engine.build_engine)
    after_initialize   just after it, with the engine
    checkpoint_load    after engine.load_checkpoint (ds_core.checkpoint)
    launcher           in DeepSpeed's launcher process (launch.ds_runner)
  apply_change(name, **context) applies one entry the same way (a tool that needs one: ds_tools.build_ops).
- The switch: the environment variable DS_TOOLKIT_CHANGES (read at every apply) is unset / "on" (every change as
  gated), "off" (none: DeepSpeed's own path) or "off:name1,name2" (those off); every entry point takes the same
  value as --ds_changes and calls configure(value), which checks it and sets the variable for the processes it
  starts. switched_off() says what the switch turns off. A change switched off after it was applied in the process is
  undone where it replaced a module or class attribute (DeepSpeed's own put back).
- states() -> {name: "on" | "off: <why>" | "not needed: <why>"}: what this process applied where the stage ran, else
  what the installed DeepSpeed would get; start_line() is the one line a run prints, and the run's summary record
  holds states() (ds_core.run.trainer).
- One marker (ds_core.compat.marks): mark(new, original, name) sets new.__wrapped__ = original (DeepSpeed's own stays
  reachable, as functools.wraps does) and new.ds_core_change = name; original(obj) is DeepSpeed's own behind our
  marks, applied(obj) the change that put obj there (None: DeepSpeed's own). replace(owner, attr, make, name) is the
  one way an attribute is replaced.
- install_initialize_hooks(): deepspeed.initialize and DeepSpeedEngine.load_checkpoint of this process apply the
  before_initialize / after_initialize / checkpoint_load stages themselves, as a run applies them: for running
  DeepSpeed's own unit tests with the changes on (process_start is applied by the call itself).

Gating (ds_core.compat.checks, ds_core.compat.fingerprint): each change checks that the installed DeepSpeed has what
it uses; a fix of an older release's behaviour is "not needed" where a behaviour probe finds the fault absent; a
change that replaces a method body is on only where that body's fingerprint is one of VERIFIED's, recorded per tested
release (stacks/latest.txt: DeepSpeed 0.19.8; stacks/gaudi-1.21.txt and gaudi-1.23.txt: Habana's fork 0.16.1,
release 1.21.0). Otherwise DeepSpeed's own path runs and one line names the change and the DeepSpeed version.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from ds_core.compat import checks
from ds_core.compat.checks import MUON_MODULE, signature_differs
from ds_core.compat.marks import NotNeeded, applied, mark, original, replace, undo
from ds_core.compat.verified import VERIFIED
from ds_core.errors import ConfigError

STAGES = ("process_start", "before_initialize", "after_initialize", "checkpoint_load", "launcher")
ENV = "DS_TOOLKIT_CHANGES"
FLAG = "--ds_changes"


@dataclass(frozen=True)
class Change:
    name: str
    does: str  # what it does instead, the arithmetic included
    replaces: str  # the internal it replaces or reads
    module: str  # where its code is
    test: str
    stage: str
    apply: str  # "module:function" taking a Context: None (on), NotNeeded(why) or why it is off
    missing: Callable[[], str | None]  # what the installed DeepSpeed lacks for it (None: it has everything)
    not_needed: Callable[[], str | None] = lambda: None  # why this DeepSpeed needs no fix (None: it has the fault)
    bodies: tuple[str, ...] = ()  # "module:qualname" of each body it replaces: gated by fingerprint (VERIFIED)


@dataclass(frozen=True)
class Context:
    device_type: str
    engine: Any = None
    universal: bool = False
    say: Callable[[str], None] | None = None


_BF16 = "deepspeed.runtime.bf16_optimizer"
_ZERO = "deepspeed.runtime.zero.stage_1_and_2"
CHANGES: tuple[Change, ...] = (
    Change("op_build_lock_holder", "the JIT build lock of DeepSpeed's ops names its holder; a dead holder's is cleared",
           "torch.utils.cpp_extension.FileBaton, the lock every load of a DeepSpeed op takes (torch's own, not "
           "DeepSpeed's)", "ds_core.compat.op_baton", "tests/test_ds_core_engine.py", "process_start",
           "ds_core.compat.op_baton:apply", checks.baton),
    Change("cached_cpu_info", "py-cpuinfo asked once per machine for DeepSpeed's op loads (CPU accelerator)",
           "cpuinfo.get_cpu_info, as DeepSpeed's op builder calls it", "ds_core.compat.cpu_info",
           "tests/test_cpu_info.py", "process_start", "ds_core.compat.cpu_info:apply", checks.cpuinfo),
    Change("lazy_muon_import", "DeepSpeed's Muon module imported with its torch.compile decorations deferred",
           "the import of deepspeed.runtime.zero.muon.muon_optimizer in ZeRO's optimizer check",
           "ds_core.compat.lazy_compile", "tests/test_lazy_compile.py", "before_initialize",
           "ds_core.compat.lazy_compile:apply", checks.muon),
    Change("cpu_gradient_buckets", "ZeRO-1/2's gradient buckets grouped by dtype, so every gradient is all-reduced",
           "deepspeed.runtime.zero.stage_1_and_2.split_half_float_double (0.16: matched CPU tensors to no bucket, "
           "and buffered_reduce_fallback all-reduced nothing)", "ds_core.compat.zero_buckets",
           "tests/test_study_comms.py", "before_initialize", "ds_core.compat.zero_buckets:apply", checks.buckets,
           not_needed=checks.buckets_fixed, bodies=(f"{_ZERO}:split_half_float_double",)),
    Change("zero3_gather_waits", "ZeRO-3's coalesced all-gather on the CPU accelerator one parameter at a time, each "
           "waited for", "deepspeed.runtime.zero.partition_parameters.Init._allgather_params_coalesced (0.16 waits "
           "for the last parameter's all-gather only: over gloo an earlier gathered weight could be read before it "
           "arrived)", "ds_core.compat.zero3_gather", "tests/test_zero3_gather.py", "before_initialize",
           "ds_core.compat.zero3_gather:apply", checks.zero3_gather, not_needed=checks.zero3_gather_fixed,
           bodies=("deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced",)),
    Change("flat_grad_norm_bf16", "BF16_Optimizer's global gradient norm from the flat fp32 gradient buffers: float64 "
           "norms of 2**26-element chunks, normed once more in float32 (DeepSpeed: one float32 norm per tensor)",
           "BF16_Optimizer.get_grads_for_norm (one norm per parameter tensor)", "ds_core.compat.flat_norm",
           "tests/test_flat_norm.py", "after_initialize", "ds_core.compat.flat_norm:apply_bf16", checks.bf16_norm,
           bodies=(f"{_BF16}:BF16_Optimizer.get_grads_for_norm",)),
    Change("flat_grad_norm_zero", "ZeRO-1/2's global gradient norm: float64 sums of squares over its flat fp32 "
           "partition in chunks, or one float64 multi-tensor norm, all-reduced and rounded once to float32",
           "DeepSpeedZeroOptimizer.get_grad_norm_direct (one float64 norm per tensor)", "ds_core.compat.flat_norm",
           "tests/test_flat_norm.py", "after_initialize", "ds_core.compat.flat_norm:apply_zero", checks.zero_norm,
           bodies=(f"{_ZERO}:DeepSpeedZeroOptimizer.get_grad_norm_direct",)),
    Change("nonfinite_group_norm", "a non-finite group norm makes ZeRO-1/2's global norm inf, as DeepSpeed 0.19 does",
           "DeepSpeedZeroOptimizer.scaled_global_norm, whose vector norm of the groups' norms turns their -1 mark of "
           "inf/NaN into a finite norm (DeepSpeed before combine_grad_norm_groups)", "ds_core.compat.flat_norm",
           "tests/test_ckpt_verify.py", "after_initialize", "ds_core.compat.flat_norm:apply_group_norm",
           checks.group_norms, not_needed=checks.group_norms_fixed,
           bodies=(f"{_ZERO}:DeepSpeedZeroOptimizer.scaled_global_norm",)),
    Change("device_clip", "the clip coefficient min(1, max_norm / (norm + eps)) kept on the device, multiplied in "
           "place into the fp32 gradients (no host read of the norm)",
           "deepspeed.runtime.bf16_optimizer.clip_tensors_by_global_norm", "ds_core.compat.flat_norm",
           "tests/test_device_clip.py", "after_initialize", "ds_core.compat.flat_norm:apply_device_clip",
           checks.device_clip, bodies=("deepspeed.runtime.utils:clip_tensors_by_global_norm",)),
    Change("one_op_grad_hook", "the per-parameter fp32 gradient accumulation as one in-place add of the bf16 gradient "
           "into the fp32 buffer (2 ops, not 5; the same fp32 sums)", "BF16_Optimizer._update_hp_grad",
           "ds_core.compat.grad_hook", "tests/test_flat_norm.py", "after_initialize", "ds_core.compat.grad_hook:apply",
           checks.grad_hook, bodies=(f"{_BF16}:BF16_Optimizer._update_hp_grad",)),
    Change("engine_grad_norm", "the step's global gradient norm read where the engine keeps it, as a device tensor",
           "DeepSpeedEngine.get_global_grad_norm (reads, changes none; Habana's fork's calls .item() on the norm: "
           "a device sync every step)", "ds_core.run.loop", "tests/test_step_syncs.py", "after_initialize",
           "ds_core.compat.reads:apply_engine_norm", checks.engine_norm),
    Change("zero_partition_layout", "NVLAMB / LANS trust ratios per parameter tensor under ZeRO (reads, changes none)",
           "the flat-partition attributes of BF16_Optimizer, DeepSpeedZeroOptimizer and ZeRO-3's optimizer",
           "ds_core.compat.zero_layout", "tests/test_bert_optim_zero.py", "after_initialize",
           "ds_core.compat.reads:apply_zero_layout", checks.zero_layout),
    Change("comm_phase_timing", "each collective timed inside sampled steps (wraps, changes no result)",
           "the methods of deepspeed.comm.comm.cdb", "ds_core.compat.comm_timing", "tests/test_ds_core_phases.py",
           "after_initialize", "ds_core.compat.comm_timing:apply", checks.comm_backend),
    Change("universal_load_links", "after a universal (resize) load, each parameter's fp32 view is its master weights",
           "the links deepspeed.utils.tensor_fragment.map_to_flat_opt_states leaves (0.16: every fp32 view pointed "
           "at the exp_avg_sq buffer)", "ds_core.compat.universal_load", "tests/test_resize.py", "checkpoint_load",
           "ds_core.compat.universal_load:apply", checks.relink, not_needed=checks.relink_fixed),
    Change("mpi_exports_as_given", "the launcher's exported variables reach MPI ranks as given (quoted only where a "
           "shell would split them)", "deepspeed.launcher.multinode_runner.MultiNodeRunner.add_export (0.16 wraps "
           "every value in double quotes, which mpirun's -x hands to every rank)", "ds_core.compat.mpi_exports",
           "tests/test_ds_runner.py", "launcher", "ds_core.compat.mpi_exports:apply", checks.exports,
           not_needed=checks.exports_fixed,
           bodies=("deepspeed.launcher.multinode_runner:MultiNodeRunner.add_export",)),
    Change("pdsh_remote_quoted", "every word of the remote command pdsh hands each node's shell quoted with "
           "shlex.quote (module arguments, working directory, interpreter, master address, exported values; % "
           "doubled for pdsh), and the command ends where `cd` into the working directory fails",
           "deepspeed.launcher.multinode_runner.PDSHRunner.get_cmd's remote command (DeepSpeed: `cd DIR;` unquoted, "
           "arguments with a space and exported values in double quotes, inside which `$(...)` runs)",
           "ds_core.compat.pdsh_quoting", "tests/test_launch_remote_shell.py", "launcher",
           "ds_core.compat.pdsh_quoting:apply", checks.pdsh,
           bodies=("deepspeed.launcher.multinode_runner:PDSHRunner.get_cmd",
                   "deepspeed.launcher.multinode_runner:PDSHRunner.parse_user_args")),
)
BY_NAME = {c.name: c for c in CHANGES}
_APPLIED: dict[str, str] = {}  # name -> state, as this process's last apply of its stage left it


# -- the switch ----------------------------------------------------------------------------------------------------
def parse_switch(value: str | None, source: str = ENV) -> dict[str, str]:
    """{name: why} of the changes a switch value turns off: "" / "on" none, "off" all, "off:a,b" those."""
    text = (value or "").strip()
    if text in ("", "on"):
        return {}
    if text == "off":
        return {c.name: f"switched off ({source}=off)" for c in CHANGES}
    if text.startswith("off:"):
        names = [n.strip() for n in text[4:].split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if names and not unknown:
            return {n: f"switched off ({source}={text})" for n in names}
        what = f"unknown change(s) {', '.join(unknown)}" if unknown else "no change named after 'off:'"
    else:
        what = f"{text!r} is not a switch value"
    raise ConfigError(f"{source}: {what}; expected 'on', 'off' or 'off:NAME[,NAME...]' with names among "
                      f"{', '.join(BY_NAME)}")


def switched_off() -> dict[str, str]:
    """{name: why} of what the switch (DS_TOOLKIT_CHANGES) turns off now."""
    return parse_switch(os.environ.get(ENV), ENV)


def add_argument(parser: Any) -> None:
    """--ds_changes on an argparse parser (an entry point without TrainConfig); pass its value to configure()."""
    parser.add_argument(FLAG, default="", help="the toolkit's changes inside DeepSpeed (ds_core.compat.changes): on, "
                        "off (DeepSpeed's own path) or off:NAME[,NAME...]; empty keeps DS_TOOLKIT_CHANGES")


def configure(value: str | None) -> dict[str, str]:
    """An entry point's --ds_changes VALUE: checked, then set as DS_TOOLKIT_CHANGES for this process and the ones it
    starts (None or "": the variable as it is)."""
    if not value:
        return switched_off()
    off = parse_switch(value, FLAG)
    os.environ[ENV] = value.strip()
    return off


# -- applying ------------------------------------------------------------------------------------------------------
def unverified(change: Change) -> str | None:
    """Why a body the change replaces is not one it was verified against (None: every one is)."""
    from ds_core.compat.deepspeed_behaviour import deepspeed_version
    from ds_core.compat.fingerprint import installed

    for target in change.bodies:
        got = installed(target)
        if got not in VERIFIED.get(target, {}):
            what = "has no source to fingerprint" if got is None else f"has fingerprint {got}"
            return (f"DeepSpeed {deepspeed_version()}'s {target.replace(':', '.')} {what}, not one this change was "
                    f"verified against ({', '.join(VERIFIED.get(target, {}).values()) or 'none'})")
    return None


def _decide(change: Change, off: dict[str, str], ctx: Context | None) -> tuple[str, bool]:
    """(state, whether to say it) for one change; applies it where ctx is given and every gate passes."""
    if change.name in off:
        undo(change.name)
        return f"off: {off[change.name]}", False
    if (fixed := change.not_needed()) is not None:
        return f"not needed: {fixed}", False
    if why := change.missing() or unverified(change):
        return f"off: {why}", True
    if ctx is None:
        return "on", False
    module, _, fn = change.apply.partition(":")
    result = getattr(importlib.import_module(module), fn)(ctx)
    if result is None:
        return "on", False
    if isinstance(result, NotNeeded):
        return f"not needed: {result}", False
    return f"off: {result}", True


def _context(context: dict[str, Any]) -> Context:
    if context.get("device_type") is None:
        from deepspeed.accelerator import get_accelerator

        context["device_type"] = get_accelerator().device_name()
    return Context(**context)


def apply_change(name: str, **context: Any) -> str:
    """Apply change `name` as its stage would (see the module docstring); its state."""
    change = BY_NAME[name]
    state, say = _decide(change, switched_off(), _context(dict(context)))
    _APPLIED[name] = state
    if say and context.get("say") is not None:
        say_off(name, state.removeprefix("off: "), context["say"])
    return state


def apply_stage(stage: str, **context: Any) -> dict[str, str]:
    """Apply every change of `stage` (one of STAGES); {name: state} of that stage's changes."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: expected one of {', '.join(STAGES)}")
    return {c.name: apply_change(c.name, **context) for c in CHANGES if c.stage == stage}


def say_off(name: str, why: str, say: Callable[[str], None] | None) -> None:
    """The one line for a change left off because the installed DeepSpeed lacks or changed what it replaces."""
    if say is not None:
        c = BY_NAME[name]
        say(f"{name} off: {why}; DeepSpeed's own path runs instead ({c.does}: {c.module})")


# -- recording -----------------------------------------------------------------------------------------------------
def states() -> dict[str, str]:
    """{name: "on" | "off: <why>" | "not needed: <why>"}: as applied in this process where its stage ran, else as
    the installed DeepSpeed would get it (instance conditions, such as the optimizer wrapper a run gets, are decided
    when the engine is built)."""
    off = switched_off()
    return {c.name: _APPLIED.get(c.name) or _decide(c, off, None)[0] for c in CHANGES}


def state(name: str) -> str:
    """Change `name`'s state in this process (as applied, or as it would be)."""
    return _APPLIED.get(name) or _decide(BY_NAME[name], switched_off(), None)[0]


def is_on(name: str) -> bool:
    """Whether change `name` is on in this process (as applied, or as it would be)."""
    return state(name) == "on"


def start_line(current: dict[str, str] | None = None) -> str:
    """The one line a run prints at start: every change and its state, with the reason where it is not on."""
    from ds_core.compat.deepspeed_behaviour import deepspeed_version

    current = states() if current is None else current
    parts = [f"{n}={s}" if s == "on" else f"{n}={s.split(':', 1)[0]} ({s.split(':', 1)[1].strip()})"
             for n, s in current.items()]
    return (f"changes inside DeepSpeed {deepspeed_version()} ({FLAG} / {ENV}; ds_core.compat.changes): "
            + "; ".join(parts))


def missing(name: str) -> str | None:
    """What the installed DeepSpeed lacks for change `name`; None where it has everything the change uses."""
    return BY_NAME[name].missing()


# -- a DeepSpeed test session with the changes applied as a run applies them ---------------------------------------
def install_initialize_hooks(say: Callable[[str], None] | None = None) -> None:
    """Apply process_start now, and make this process's deepspeed.initialize apply before_initialize and
    after_initialize around itself, and DeepSpeedEngine.load_checkpoint apply checkpoint_load after itself (idempotent;
    nothing of either changes where the switch is off)."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    apply_stage("process_start", say=say)

    def around_initialize(deepspeeds: Callable) -> Callable:
        def initialize(*args: Any, **kwargs: Any) -> Any:
            apply_stage("before_initialize", say=say)
            out = deepspeeds(*args, **kwargs)
            apply_stage("after_initialize", engine=out[0], say=say)
            return out
        return initialize

    def after_load(deepspeeds: Callable) -> Callable:
        def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = deepspeeds(self, *args, **kwargs)
            apply_stage("checkpoint_load", engine=self, universal=bool(self.load_universal_checkpoint()), say=say)
            return out
        return load_checkpoint

    replace(deepspeed, "initialize", around_initialize, "initialize_hooks")
    replace(DeepSpeedEngine, "load_checkpoint", after_load, "initialize_hooks")


__all__ = ["Change", "Context", "CHANGES", "BY_NAME", "STAGES", "ENV", "FLAG", "MUON_MODULE", "NotNeeded",
           "apply_stage", "apply_change", "parse_switch", "switched_off", "add_argument", "configure", "mark",
           "applied", "original", "replace", "unverified", "states", "state", "is_on", "start_line", "say_off",
           "missing", "install_initialize_hooks", "signature_differs"]
