"""Every change the toolkit makes inside DeepSpeed (and the two outside it its op loads go through), in one list,
applied from one call per stage, recorded, and switchable.

Each change (CHANGES) says what it does instead, what it replaces, where its code and its test are, its stage, and
its one gate (ds_core.compat.gates): the question asked of the installed library, by feature, about what it
replaces or reads (the fingerprints of DeepSpeed's bodies it replaces, or the names it wraps). `fork_cpu_only` marks
the fixes that exist only because Habana's fork misbehaves on DeepSpeed's CPU accelerator, where this toolkit's tests
run: no Gaudi user meets those faults. A change ends in one State (gates.Outcome: applied, not needed, refused,
switched off, each with its reason), decided once per apply: the switch, then the gate, then, on this run's engine,
the change's own apply function (which may find it not needed for the optimizer wrapper or device the run got).

API (what a run, a tool and a test harness call):
- apply_stage(stage, **context) -> {name: Outcome}: applies every change of `stage` (STAGES); idempotent. Context
  keywords: device_type ("cpu" | "cuda" | "hpu"; default: DeepSpeed's accelerator), engine (after_initialize,
  checkpoint_load), universal (checkpoint_load: the load went through the universal format), say (where the one
  line of a refused change goes; None: nowhere). The stages, in a run's order:
    process_start      before deepspeed.init_distributed (ds_core.rank.dist)
    before_initialize  just before deepspeed.initialize (ds_core.rank.engine_build.build_engine)
    after_initialize   just after it, with the engine
    checkpoint_load    after engine.load_checkpoint (ds_core.checkpoint)
    launcher           in DeepSpeed's launcher process (launch.ds_runner)
  apply_change(name, **context) applies one entry the same way (a tool that needs one: ds_tools.build_ops).
- The switch: the environment variable DS_TOOLKIT_CHANGES (read at every apply) is unset / "on" (every change its
  gate lets through), "off" (none: DeepSpeed's own path) or "off:name1,name2" (those off); every entry point takes
  the same value as --ds_changes and calls configure(value), which checks it and sets the variable for the processes
  it starts. switched_off() says what the switch turns off. A change switched off after it was applied in the process
  is undone where it replaced a module or class attribute (DeepSpeed's own put back).
- outcome(name): the change's Outcome in this process: as applied where its stage ran, else as the installed
  library would get it; is_on(name): whether that is APPLIED. states() -> {name: "on" | "off: <why>" | "not needed:
  <why>"} is what a run records (its summary record, ds_core.run.trainer); start_line() is the one line it prints.
- One marker (ds_core.compat.marks): mark(new, original, name) sets new.__wrapped__ = original (DeepSpeed's own stays
  reachable, as functools.wraps does) and new.ds_core_change = name; original(obj) is DeepSpeed's own behind our
  marks, applied(obj) the change that put obj there (None: DeepSpeed's own). replace(owner, attr, make, name) is the
  one way an attribute is replaced.
- install_initialize_hooks(): deepspeed.initialize and DeepSpeedEngine.load_checkpoint of this process apply the
  before_initialize / after_initialize / checkpoint_load stages themselves, as a run applies them: for running
  DeepSpeed's own unit tests with the changes on (process_start is applied by the call itself).

The bodies are read per tested release (stacks/latest.txt: DeepSpeed 0.19.8; stacks/gaudi-1.21.txt and
gaudi-1.23.txt: Habana's fork 0.16.1, release 1.21.0; ds_core.compat.verified). Where a gate refuses, DeepSpeed's
own path runs and one line names the change and the DeepSpeed version.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from ds_core.compat.gates import Bodies, Has, Outcome, State
from ds_core.compat.lazy_compile import MUON_MODULE
from ds_core.compat.marks import applied, original, replace, undo
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
    apply: str  # "module:function" taking a Context, returning an Outcome (the gate has let it through)
    gate: Bodies | Has  # the one question asked of the installed library (ds_core.compat.gates)
    fork_cpu_only: bool = False  # a fix of Habana's fork on DeepSpeed's CPU accelerator only: no Gaudi user meets it


@dataclass(frozen=True)
class Context:
    device_type: str
    engine: Any = None
    universal: bool = False
    say: Callable[[str], None] | None = None


_BF16 = "deepspeed.runtime.bf16_optimizer"
_ZERO = "deepspeed.runtime.zero.stage_1_and_2"
_RUNNER = "deepspeed.launcher.multinode_runner"
_BATON = "torch.utils.cpp_extension:FileBaton"
CHANGES: tuple[Change, ...] = (
    Change("op_build_lock_holder", "the JIT build lock of DeepSpeed's ops names its holder; a dead holder's is cleared",
           "torch.utils.cpp_extension.FileBaton, the lock every load of a DeepSpeed op takes (torch's own, not "
           "DeepSpeed's)", "ds_core.compat.op_baton", "tests/test_ds_core_engine.py", "process_start",
           "ds_core.compat.op_baton:apply",
           Has((f"{_BATON}.try_acquire", f"{_BATON}.wait", f"{_BATON}.release"), library="torch")),
    Change("cached_cpu_info", "py-cpuinfo asked once per machine for DeepSpeed's op loads (CPU accelerator)",
           "cpuinfo.get_cpu_info, as DeepSpeed's op builder calls it", "ds_core.device.cpu_info",
           "tests/test_cpu_info.py", "process_start", "ds_core.device.cpu_info:apply",
           Has(("cpuinfo:get_cpu_info",), library="py-cpuinfo", note="not installed: DeepSpeed then asks lscpu")),
    Change("lazy_muon_import", "DeepSpeed's Muon module imported with its torch.compile decorations deferred",
           "the import of deepspeed.runtime.zero.muon.muon_optimizer in ZeRO's optimizer check",
           "ds_core.compat.lazy_compile", "tests/test_lazy_compile.py", "before_initialize",
           "ds_core.compat.lazy_compile:apply",
           Has((MUON_MODULE,), note="nothing compiles when ZeRO checks the optimizer")),
    Change("cpu_gradient_buckets", "ZeRO-1/2's gradient buckets grouped by dtype, so every gradient is all-reduced",
           "deepspeed.runtime.zero.stage_1_and_2.split_half_float_double (0.16: matched CPU tensors to no bucket, "
           "and buffered_reduce_fallback all-reduced nothing)", "ds_core.compat.zero_buckets",
           "tests/test_study_comms.py", "before_initialize", "ds_core.compat.zero_buckets:apply",
           Bodies((f"{_ZERO}:split_half_float_double",),
                  fixed="this DeepSpeed groups ZeRO's gradients by dtype, on any device"), fork_cpu_only=True),
    Change("zero3_gather_waits", "ZeRO-3's coalesced all-gather on the CPU accelerator one parameter at a time, each "
           "waited for", "deepspeed.runtime.zero.partition_parameters.Init._allgather_params_coalesced (0.16 waits "
           "for the last parameter's all-gather only: over gloo an earlier gathered weight could be read before it "
           "arrived)", "ds_core.compat.zero3_gather", "tests/test_zero3_gather.py", "before_initialize",
           "ds_core.compat.zero3_gather:apply",
           Bodies(("deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced",),
                  fixed="this DeepSpeed's ZeRO-3 coalesced all-gather waits for every parameter's collective"),
           fork_cpu_only=True),
    Change("flat_grad_norm_bf16", "BF16_Optimizer's global gradient norm from the flat fp32 gradient buffers: float64 "
           "norms of 2**26-element chunks, normed once more in float32 (DeepSpeed: one float32 norm per tensor)",
           "BF16_Optimizer.get_grads_for_norm (one norm per parameter tensor)", "ds_core.compat.flat_norm",
           "tests/test_flat_norm.py", "after_initialize", "ds_core.compat.flat_norm:apply_bf16",
           Bodies((f"{_BF16}:BF16_Optimizer.get_grads_for_norm",))),
    Change("flat_grad_norm_zero", "ZeRO-1/2's global gradient norm: float64 sums of squares over its flat fp32 "
           "partition in chunks, or one float64 multi-tensor norm, all-reduced and rounded once to float32",
           "DeepSpeedZeroOptimizer.get_grad_norm_direct (one float64 norm per tensor)", "ds_core.compat.flat_norm",
           "tests/test_flat_norm.py", "after_initialize", "ds_core.compat.flat_norm:apply_zero",
           Bodies((f"{_ZERO}:DeepSpeedZeroOptimizer.get_grad_norm_direct",))),
    Change("nonfinite_group_norm", "a non-finite group norm makes ZeRO-1/2's global norm inf, as DeepSpeed 0.19 does",
           "DeepSpeedZeroOptimizer.scaled_global_norm, whose vector norm of the groups' norms turns their -1 mark of "
           "inf/NaN into a finite norm (DeepSpeed before combine_grad_norm_groups)", "ds_core.compat.group_norm",
           "tests/test_ckpt_verify.py", "after_initialize", "ds_core.compat.group_norm:apply",
           Bodies((f"{_ZERO}:DeepSpeedZeroOptimizer.scaled_global_norm",), fixed="this DeepSpeed combines group "
                  "norms keeping a non-finite one (combine_grad_norm_groups)")),
    Change("device_clip", "the clip coefficient min(1, max_norm / (norm + eps)) kept on the device, multiplied in "
           "place into the fp32 gradients (no host read of the norm)",
           "deepspeed.runtime.bf16_optimizer.clip_tensors_by_global_norm", "ds_core.compat.flat_norm",
           "tests/test_device_clip.py", "after_initialize", "ds_core.compat.flat_norm:apply_device_clip",
           Bodies(("deepspeed.runtime.utils:clip_tensors_by_global_norm",))),
    Change("one_op_grad_hook", "the per-parameter fp32 gradient accumulation as one in-place add of the bf16 gradient "
           "into the fp32 buffer (2 ops, not 5; the same fp32 sums)", "BF16_Optimizer._update_hp_grad",
           "ds_core.compat.grad_hook", "tests/test_flat_norm.py", "after_initialize", "ds_core.compat.grad_hook:apply",
           Bodies((f"{_BF16}:BF16_Optimizer._update_hp_grad",))),
    Change("engine_grad_norm", "the step's global gradient norm read where the engine keeps it, as a device tensor",
           "DeepSpeedEngine.get_global_grad_norm (reads, changes none; Habana's fork's calls .item() on the norm: "
           "a device sync every step)", "ds_core.run.step", "tests/test_step_syncs.py", "after_initialize",
           "ds_core.compat.reads:apply_engine_norm",
           # both releases keep the optimizer's norm in engine._global_grad_norm after each step (_take_model_step)
           # and return it from get_global_grad_norm; the loop reads the attribute where the engine instance has it
           Has(tuple(f"deepspeed.runtime.engine:DeepSpeedEngine.{n}" for n in ("get_global_grad_norm",
                                                                              "_take_model_step")))),
    Change("zero_partition_layout", "NVLAMB / LANS trust ratios per parameter tensor under ZeRO (reads, changes none)",
           "the flat-partition attributes of BF16_Optimizer, DeepSpeedZeroOptimizer and ZeRO-3's optimizer",
           "ds_core.compat.zero_layout", "tests/test_bert_optim_zero.py", "after_initialize",
           "ds_core.compat.reads:apply_zero_layout",
           # the classes here; the attributes read, on the wrapper instance a run got (zero_layout.missing_attributes)
           Has((f"{_BF16}:BF16_Optimizer", f"{_ZERO}:DeepSpeedZeroOptimizer",
                "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"))),
    Change("comm_phase_timing", "each collective timed inside sampled steps (wraps, changes no result)",
           "the methods of deepspeed.comm.comm.cdb", "ds_core.compat.comm_timing", "tests/test_ds_core_phases.py",
           "after_initialize", "ds_core.compat.comm_timing:apply", Has(("deepspeed.comm.comm:cdb",))),
    Change("universal_load_links", "after a universal (resize) load, each parameter's fp32 view is its master weights",
           "the links deepspeed.utils.tensor_fragment.map_to_flat_opt_states leaves (0.16: every fp32 view pointed "
           "at the exp_avg_sq buffer)", "ds_core.compat.universal_load", "tests/test_resize.py", "checkpoint_load",
           "ds_core.compat.universal_load:apply",
           Bodies(("deepspeed.utils.tensor_fragment:map_to_flat_opt_states",),
                  fixed="this DeepSpeed's universal load leaves each parameter's fp32 fragment where it was")),
    Change("mpi_exports_as_given", "the launcher's exported variables reach MPI ranks as given (quoted only where a "
           "shell would split them)", "deepspeed.launcher.multinode_runner.MultiNodeRunner.add_export (0.16 wraps "
           "every value in double quotes, which mpirun's -x hands to every rank)", "ds_core.compat.mpi_exports",
           "tests/test_ds_runner.py", "launcher", "ds_core.compat.mpi_exports:apply",
           Bodies((f"{_RUNNER}:MultiNodeRunner.add_export",),
                  fixed="this DeepSpeed's launcher quotes only the exported values a shell would split")),
    Change("pdsh_remote_quoted", "every word of the remote command pdsh hands each node's shell quoted with "
           "shlex.quote (module arguments, working directory, interpreter, master address, exported values; % "
           "doubled for pdsh), and the command ends where `cd` into the working directory fails",
           "deepspeed.launcher.multinode_runner.PDSHRunner.get_cmd's remote command (DeepSpeed: `cd DIR;` unquoted, "
           "arguments with a space and exported values in double quotes, inside which `$(...)` runs)",
           "ds_core.compat.pdsh_quoting", "tests/test_launch_remote_shell.py", "launcher",
           "ds_core.compat.pdsh_quoting:apply",
           Bodies((f"{_RUNNER}:PDSHRunner.get_cmd", f"{_RUNNER}:PDSHRunner.parse_user_args"))),
)
BY_NAME = {c.name: c for c in CHANGES}
_APPLIED: dict[str, Outcome] = {}  # name -> outcome, as this process's last apply of its stage left it


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
def _decide(change: Change, off: dict[str, str], ctx: Context | None) -> Outcome:
    """The switch, then the gate, then (where ctx is given) the change's apply function on this run."""
    if change.name in off:
        undo(change.name)
        return Outcome(State.SWITCHED_OFF, off[change.name])
    gate = change.gate()
    if gate.state is not State.APPLIED or ctx is None:
        return gate
    module, _, fn = change.apply.partition(":")
    return getattr(importlib.import_module(module), fn)(ctx)


def _context(context: dict[str, Any]) -> Context:
    if context.get("device_type") is None:
        from deepspeed.accelerator import get_accelerator

        context["device_type"] = get_accelerator().device_name()
    return Context(**context)


def apply_change(name: str, **context: Any) -> Outcome:
    """Apply change `name` as its stage would (see the module docstring); its outcome."""
    change = BY_NAME[name]
    result = _decide(change, switched_off(), _context(dict(context)))
    _APPLIED[name] = result
    if result.state is State.REFUSED and context.get("say") is not None:
        context["say"](f"{name} off: {result.why}; DeepSpeed's own path runs instead ({change.does}: "
                       f"{change.module})")
    return result


def apply_stage(stage: str, **context: Any) -> dict[str, Outcome]:
    """Apply every change of `stage` (one of STAGES); {name: outcome} of that stage's changes."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: expected one of {', '.join(STAGES)}")
    return {c.name: apply_change(c.name, **context) for c in CHANGES if c.stage == stage}


# -- recording -----------------------------------------------------------------------------------------------------
def outcome(name: str) -> Outcome:
    """Change `name`'s outcome in this process: switched off where the switch says so now, else as applied where its
    stage ran, else as the installed library would get it (instance conditions, such as the optimizer wrapper a run
    gets, are decided when the engine is built)."""
    off = switched_off()
    return (name not in off and _APPLIED.get(name)) or _decide(BY_NAME[name], off, None)


def is_on(name: str) -> bool:
    """Whether change `name` is applied in this process (as applied, or as it would be)."""
    return outcome(name).state is State.APPLIED


def states() -> dict[str, str]:
    """{name: "on" | "off: <why>" | "not needed: <why>"}: every change's outcome as a run records it."""
    return {c.name: str(outcome(c.name)) for c in CHANGES}


def start_line() -> str:
    """The one line a run prints at start: every change and its state, with the reason where it is not on."""
    from ds_core.compat.deepspeed_behaviour import deepspeed_version

    told = {c.name: outcome(c.name) for c in CHANGES}
    parts = [f"{n}=on" if o.state is State.APPLIED else f"{n}={o.label} ({o.why})" for n, o in told.items()]
    return (f"changes inside DeepSpeed {deepspeed_version()} ({FLAG} / {ENV}; ds_core.compat.changes): "
            + "; ".join(parts))


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


__all__ = ["Change", "Context", "CHANGES", "BY_NAME", "STAGES", "ENV", "FLAG", "State", "Outcome", "apply_stage",
           "apply_change", "parse_switch", "switched_off", "add_argument", "configure", "applied", "original",
           "replace", "outcome", "is_on", "states", "start_line", "install_initialize_hooks"]
