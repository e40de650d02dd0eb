"""The DeepSpeed engine of a run: deepspeed.initialize with the resolved config, the changes inside DeepSpeed applied
around it (ds_core.compat.changes), and the parameter order of its flat buffers.
"""
from __future__ import annotations

import torch

from ds_core import log
from ds_core.compat import changes
from ds_core.errors import ConfigError


def without_throughput_timer(ds_config: dict) -> dict:
    """The DeepSpeed config with DeepSpeed's throughput timer off unless the JSON sets "timers" itself. That timer
    (on by default, synchronized) synchronizes the device at every micro batch's forward and at every engine.step()
    when deepspeed.initialize got no dataloader, as here: on a GPU, two host waits per micro batch (measured on an
    H200: BERT-Large at accumulation 8 spent 68 % of its step with the GPU idle). The toolkit times its own window
    (ds_core.outputs.metrics), so the timer's figures are not used."""
    if "timers" in ds_config:
        return ds_config
    return dict(ds_config, timers={"throughput": {"enabled": False}})


def build_engine(model: torch.nn.Module, ds_config: dict, *, optimizer=None, lr_scheduler=None,
                 model_parameters=None):
    """deepspeed.initialize with a resolved config (see ds_core.config.load_ds_config); returns the engine.

    An optimizer passed here and an "optimizer" section in the DeepSpeed JSON would be the same setting in two
    places, so that combination is refused.
    """
    import deepspeed

    if optimizer is not None and "optimizer" in ds_config:
        raise ConfigError("an optimizer was built in code and the DeepSpeed config also has an \"optimizer\" section: "
                          "remove one (use a DeepSpeed JSON without \"optimizer\" for models that build their own)")
    if lr_scheduler is not None and "scheduler" in ds_config:
        raise ConfigError("an LR scheduler was built in code and the DeepSpeed config also has a \"scheduler\" "
                          "section: remove one")
    if optimizer is None and "optimizer" not in ds_config:
        raise ConfigError("no optimizer: pass one in code or add an \"optimizer\" section to the DeepSpeed config")
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    model_parameters, moved = odd_sizes_last(model, model_parameters)
    from deepspeed.accelerator import get_accelerator

    from ds_core.device.ops_check import prepare_optimizer_ops

    # the optimizer's compiled op loaded (or built) here, on every rank: where it cannot be, torch's AdamW with the
    # reason in one line, never a build error inside deepspeed.initialize
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    ds_config = prepare_optimizer_ops(ds_config, get_accelerator().device_name(), rank, say=log.say)
    ds_config = without_throughput_timer(ds_config)
    # the changes inside DeepSpeed (ds_core.compat.changes) of the stages around deepspeed.initialize, each where the
    # switch leaves it on and the installed DeepSpeed has (and needs) what it replaces; rank 0 says which is off
    say = log.say
    device_type = get_accelerator().device_name()
    changes.apply_stage("before_initialize", device_type=device_type, say=say)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters, optimizer=optimizer,
                                           lr_scheduler=lr_scheduler, config=ds_config)
    engine.flat_layout = flat_layout(moved)  # recorded in checkpoints' fingerprints (ds_core.checkpoint)
    changes.apply_stage("after_initialize", engine=engine, device_type=device_type, say=say)
    log.say(changes.start_line())  # every change's state, as the run's summary records it
    return engine


# Where DeepSpeed flattens a parameter group into one buffer (ZeRO-1/2's and its bf16 optimizer's bit16 groups),
# each parameter becomes a view at the running sum of the sizes before it. One parameter whose size is not a
# multiple of 8 elements (BridgeTower's 1-element logit_scale, first in its group) puts every later weight off
# 16-byte alignment, and cuBLAS then runs those GEMMs with its align1 kernels: measured on an H200, two such kernels
# took 366 ms of BridgeTower-Large's 771 ms step. DeepSpeed has no per-parameter alignment setting, so the order is
# ours: within each group, parameters of such sizes go last (stable otherwise), and every other view stays aligned.
ALIGN_ELEMENTS = 8


def odd_sizes_last(model: torch.nn.Module, model_parameters) -> tuple[list, list[str]]:
    """model_parameters (tensors, or param-group dicts) with, in each group, the parameters whose numel is not a
    multiple of ALIGN_ELEMENTS moved to the group's end; also the names of those that moved."""
    names = {id(p): n for n, p in model.named_parameters()}
    moved: list[str] = []

    def reorder(params: list) -> list:
        params = list(params)
        odd = [i for i, p in enumerate(params) if p.numel() % ALIGN_ELEMENTS]
        if odd and odd != list(range(len(params) - len(odd), len(params))):  # not already at the end
            moved.extend(names.get(id(params[i]), f"#{i}") for i in odd)
            params = [p for p in params if p.numel() % ALIGN_ELEMENTS == 0] + [params[i] for i in odd]
        return params

    model_parameters = list(model_parameters)
    if model_parameters and isinstance(model_parameters[0], dict):
        return [dict(g, params=reorder(g["params"])) for g in model_parameters], moved
    return reorder(model_parameters), moved


def flat_layout(moved: list[str]) -> str:
    """The fingerprint's name of the parameter order in the flat buffers: a checkpoint's optimizer state is stored
    in that order, so one written in another order must not load (its values would land on other parameters)."""
    return "model order" if not moved else "odd sizes last: " + ", ".join(moved)


__all__ = ["build_engine", "without_throughput_timer", "odd_sizes_last", "flat_layout", "ALIGN_ELEMENTS"]
