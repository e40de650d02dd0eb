"""The compile policy: whether a run's model is torch.compile'd (TrainConfig.compile resolved per accelerator), with
which backend, and the compile itself through DeepSpeed's engine.compile.
"""
from __future__ import annotations

from ds_core import log
from ds_core.device import hpu
from ds_core.errors import ConfigError


def compile_backend() -> str:
    """The torch.compile backend of the accelerator DeepSpeed runs on ("inductor" on CUDA and CPU, "hpu_backend" on
    Gaudi, where inductor is not supported: Habana's PyTorch Support Matrix): the one every compile here takes.
    DeepSpeed's accelerators name it (get_compile_backend, in DeepSpeed 0.16.1 and Habana's fork as in 0.19);
    one without the method gets torch's default."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    return accel.get_compile_backend() if hasattr(accel, "get_compile_backend") else "inductor"


def compile_wanted(setting: str, accelerator: str = "cpu", auto_on: tuple[str, ...] = (), lazy: bool = False) -> bool:
    """TrainConfig.compile resolved. auto compiles
    - on Gaudi, every model: eager + torch.compile(backend="hpu_backend") is Habana's default and recommended
      execution (PyTorch Support Matrix; Habana's DeepSpeed BERT-1.5B script runs with --enable_torch_compile). That
      default follows Habana's guidance; the toolkit has not measured it (docs/compile.md);
    - on the accelerators a model names in `auto_on`: those where its compiled step was measured faster than the
      eager one (BERT: CUDA, an H200 at 1.51x, docs/compile.md);
    and stays eager elsewhere (on a CPU the compile costs minutes for a step of seconds).
    In Gaudi's lazy mode (`lazy`: PT_HPU_LAZY_MODE=1) nothing compiles: auto stays with lazy mode's graphs and on is
    refused (ConfigError), since Habana lists no torch.compile backend for lazy mode."""
    if setting == "off":
        return False
    why = hpu.compile_refusal(accelerator, lazy)
    if why:
        if setting == "on":
            raise ConfigError(f"--compile on: {why}. Run with PT_HPU_LAZY_MODE=0 (Habana's default execution), or "
                              "with --compile off / auto in lazy mode")
        return False
    return setting == "on" or (setting == "auto" and (accelerator == "hpu" or accelerator in auto_on))


def compile_model(engine, setting: str, *, dynamic: bool | None, auto_on: tuple[str, ...] = ()) -> bool:
    """torch.compile the engine's module when `setting` (TrainConfig.compile) says so; True if it did.

    DeepSpeed's engine.compile is the library's way: it calls module.compile(backend=the accelerator's backend,
    compile_backend()), so the engine's own forward hooks stay in the compiled call, and a DeepSpeed JSON with
    "compile": {"deepcompile": true} turns it into DeepCompile. dynamic: False for models whose batches all have one
    shape (one graph, no symbolic sizes), None for models whose shapes vary (torch recompiles once with the varying
    sizes symbolic)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    lazy = accelerator == "hpu" and hpu.lazy_mode()
    if not compile_wanted(setting, accelerator, auto_on, lazy):
        if lazy and setting == "auto":
            log.say("--compile auto: eager model in lazy mode (PT_HPU_LAZY_MODE=1, graphs cut by mark_step); "
                    "torch.compile runs on Gaudi in eager mode only")
        return False
    if engine.zero_optimization_partition_weights():
        # measured on DeepSpeed 0.19: its ZeRO-3 gather / release hooks are torch.compiler.disable'd, so dynamo
        # breaks the graph at every submodule (the run trains, with many small graphs and recompiles)
        log.warn("--compile with ZeRO-3 compiles each submodule separately (DeepSpeed's parameter hooks break the "
                 "graph); DeepCompile (\"compile\": {\"deepcompile\": true} in the DeepSpeed JSON) is DeepSpeed's "
                 "path for ZeRO-3")
    engine.compile(compile_kwargs={"dynamic": dynamic})
    why = (" (--compile auto on Gaudi: Habana's recommended execution, eager + torch.compile; not measured by "
           "this toolkit)" if setting == "auto" and accelerator == "hpu" and accelerator not in auto_on else "")
    log.say(f"torch.compile ({compile_backend()}): the model's forward through engine.compile (dynamic={dynamic})"
            f"{why}; the first steps include the compile")
    return True


__all__ = ["compile_backend", "compile_wanted", "compile_model"]
