"""Behaviour that differs between DeepSpeed releases, read from the installed DeepSpeed rather than written down for
one of them.

- optimizer_wrapper: which wrapper a configuration gets (BF16_Optimizer, DeepSpeedZeroOptimizer, ...), or the error
  DeepSpeed raises for it, by running DeepSpeed's own decision (DeepSpeedEngine._do_optimizer_sanity_check) on the
  configuration. DeepSpeed 0.19 gives ZeRO-0 + bf16 its DDP_BFLOAT16 path with bf16 accumulation and refuses fp32
  accumulation; Habana's fork (0.16.1) gives it BF16_Optimizer with fp32 accumulation and refuses bf16 accumulation.
  ds-tune's memory model and the config checks (ds_core.config.settle_grad_accum_dtype) ask here.
- comms_timer_cumulative: whether the comms logger's per-call record is the running total of the op (0.19: its
  timer's elapsed(reset=False) sums every call so far) or that call's own time (the fork clears the timer's records
  on each read): the study's comm latency is then the largest record or their sum.
- universal_load_repoints_fp32, zero_buckets_drop_cpu, zero3_gather_waits_last_only, zero_group_norm_hides_nonfinite,
  quotes_plain_exports: faults of 0.16 that changes fix (ds_core.compat.universal_load, zero_buckets, zero3_gather,
  group_norm, mpi_exports), each probed on stand-ins by calling DeepSpeed's own function: whether its universal load
  re-points each parameter's fp32 fragment, whether ZeRO-1/2's buckets leave CPU tensors out, whether ZeRO-3's
  coalesced all-gather waits for its last collective only (a race over gloo), whether ZeRO-1/2's global norm stays
  finite over a non-finite group's, whether the launcher's add_export wraps a plain value in double quotes (mpirun's
  `-x KEY="value"` then hands the quotes to every rank). Each change's gate is the fingerprint of that
  function's body (ds_core.compat.verified: VERIFIED where it has the fault, FIXED where it has the fix); the probes
  hold those entries to the behaviour they stand for (tests/test_changes_gating.py, on every stack).
- bf16_grads_held: whether BF16_Optimizer's bf16 gradients stay allocated between steps (the fork's engine frees them
  only through the wrapper's zero_grad, which its BF16_Optimizer lacks: they go at the next backward); ds-tune's
  memory model counts them as held between steps there.
- What a non-finite gradient norm does is decided per wrapper by DeepSpeed's step and read at run time
  (ds_core.run.step): 0.19's BF16_Optimizer skips the update; the fork's asserts `all_groups_norm > 0`; ZeRO-1/2 with
  bf16 and no overflow check applies it with DeepSpeed's -1 for the norm. The loop turns each into the divergence
  guard's one line.
"""
from __future__ import annotations

import types
from typing import Any

WRAPPER_NAMES = {"zero": "DeepSpeedZeroOptimizer", "zero3": "DeepSpeedZeroOptimizer_Stage3",
                 "bf16": "BF16_Optimizer", "fp16_fused": "FP16_Optimizer", "fp16_unfused": "FP16_UnfusedOptimizer",
                 "amp": "amp", None: "basic"}


class WrapperRefused(ValueError):
    """DeepSpeed refuses the configuration at deepspeed.initialize; the message is DeepSpeed's."""


def _stub_engine(stage: int, model_dtype: Any, accum_dtype: Any, cpu_offload: bool) -> Any:
    """The engine methods _do_optimizer_sanity_check reads (0.16 and 0.19 read subsets of these), for one
    configuration; rank 1 so that DeepSpeed logs nothing."""
    return types.SimpleNamespace(
        get_data_types=lambda: (model_dtype, accum_dtype), zero_optimization=lambda: stage > 0,
        zero_optimization_stage=lambda: stage, zero_cpu_offload=lambda: cpu_offload,
        zero_compute_grad_norm=lambda: True, zero_allow_untested_optimizer=lambda: True, amp_enabled=lambda: False,
        pipeline_parallelism=False, global_rank=1)


def optimizer_wrapper(stage: int, precision: str, grad_accum_dtype: str | None = None, *, fused_adam: bool = True,
                      cpu_offload: bool = False) -> str:
    """The class name of the optimizer wrapper the installed DeepSpeed builds for this configuration ("basic": none,
    the optimizer itself); raises WrapperRefused with DeepSpeed's message where deepspeed.initialize would raise.
    precision: "bf16" | "fp16" | "fp32"; grad_accum_dtype: data_types.grad_accum_dtype (None: the model's dtype, as
    DeepSpeed defaults); fused_adam: FusedAdam as the optimizer (DeepSpeed's fused fp16 wrapper serves only it)."""
    import torch
    from deepspeed.runtime import engine as ds_engine

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    model = dtypes[precision]
    accum = dtypes[grad_accum_dtype] if grad_accum_dtype else model
    stub = _stub_engine(stage, model, accum, cpu_offload)
    # the ZeRO-supported-optimizer check asks the process group's rank (0.19): no process group in a tool; every
    # optimizer this toolkit builds runs with zero_allow_untested_optimizer's answer anyway
    real = ds_engine.is_zero_supported_optimizer
    ds_engine.is_zero_supported_optimizer = lambda _opt: True
    try:
        kind = ds_engine.DeepSpeedEngine._do_optimizer_sanity_check(stub, None)
    except (NotImplementedError, ValueError, AssertionError) as e:
        raise WrapperRefused(str(e)) from None
    finally:
        ds_engine.is_zero_supported_optimizer = real
    const = {getattr(ds_engine, n, object()): n for n in ("ZERO_OPTIMIZATION", "BFLOAT16", "FP16", "DDP_BFLOAT16",
                                                          "AMP")}
    name = const.get(kind)
    if name == "ZERO_OPTIMIZATION":
        return WRAPPER_NAMES["zero3" if stage == 3 else "zero"]
    if name == "BFLOAT16":
        return WRAPPER_NAMES["bf16"]
    if name in ("FP16", "DDP_BFLOAT16"):  # engine._configure_fp16_optimizer: the fused one serves FusedAdam only
        return WRAPPER_NAMES["fp16_fused" if fused_adam else "fp16_unfused"]
    if name == "AMP":
        return WRAPPER_NAMES["amp"]
    return WRAPPER_NAMES[None]


def deepspeed_version() -> str:
    try:
        import deepspeed
    except ImportError:
        return "not installed"
    return str(deepspeed.__version__)


def comms_timer_cumulative() -> bool:
    """Whether the installed DeepSpeed's comms-logger timer returns, on each read, the running total of every call of
    its op (True, 0.19) or only the calls since the last read (False, Habana's fork): one timed call, read twice."""
    from deepspeed.utils.timer import SynchronizedWallClockTimer

    timer = SynchronizedWallClockTimer.Timer("ds_core_probe")
    timer.use_host_timer = True  # what is probed is the bookkeeping, not the clock: no device event needed
    timer.start()
    timer.stop()
    timer.elapsed(reset=False)  # what deepspeed.comm's log_wrapper calls after every logged collective
    return bool(timer.event_timers)  # kept: the next read sums it again (cumulative); cleared: per-read


def universal_load_repoints_fp32() -> bool:
    """Whether the installed DeepSpeed's map_to_flat_opt_states (its universal-checkpoint load of ZeRO-1/2 and bf16
    optimizer states) re-points a parameter's fp32 fragment at an optimizer-state buffer (0.16: every fp32 view ends on
    exp_avg_sq; ds_core.compat.universal_load); one call on a stand-in parameter."""
    import importlib

    import torch

    # the module itself: deepspeed.utils exports a class of the same name
    tf = importlib.import_module("deepspeed.utils.tensor_fragment")
    flat = torch.zeros(2)
    fp32_view = flat.narrow(0, 0, 2)
    address = types.SimpleNamespace(start=0, numel=2)
    mapping = types.SimpleNamespace(hp_fragment=fp32_view, optim_fragment={"exp_avg": torch.ones(2)},
                                    get_hp_fragment_address=lambda: address)
    mapping.get_hp_fragment = lambda optim_state_key=None: (mapping.hp_fragment if optim_state_key is None
                                                            else mapping.optim_fragment[optim_state_key])
    tf.map_to_flat_opt_states(flat, [types.SimpleNamespace(_hp_mapping=mapping)], {flat: {}}, ["exp_avg"])
    return mapping.hp_fragment is not fp32_view


def zero_buckets_drop_cpu() -> bool:
    """Whether the installed DeepSpeed's ZeRO-1/2 split_half_float_double (the grouping of buffered_reduce_fallback)
    leaves a CPU float tensor out of every bucket (0.16; ds_core.compat.zero_buckets). Asked of DeepSpeed's own
    function also after ds_core.compat.zero_buckets replaced it (ds_core.compat.marks.original)."""
    import torch
    from deepspeed.runtime.zero import stage_1_and_2

    from ds_core.compat.marks import original

    return original(stage_1_and_2.split_half_float_double)([torch.zeros(4)]) == []


def bf16_grads_held() -> bool:
    """Whether the installed DeepSpeed keeps BF16_Optimizer's bf16 gradients allocated from one step to the next.
    DeepSpeedEngine's step releases gradients through the wrapper's zero_grad: 0.19's BF16_Optimizer has one (they are
    set to None), Habana's fork's has none and its engine then does nothing, so they live until BF16_Optimizer.backward
    clears them (2 bytes per parameter, measured by bench.zero_memory)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return not hasattr(BF16_Optimizer, "zero_grad")


class _Handle:
    def __init__(self, waited: list):
        self.waited = waited

    def wait(self) -> None:
        self.waited.append(self)


def zero3_gather_waits_last_only() -> bool:
    """Whether the installed DeepSpeed's Init._allgather_params_coalesced waits for its last collective's handle only
    (0.16: "Wait ensures the operation is enqueued"; 0.19 waits for each): one call of DeepSpeed's own function on two
    stand-in parameters of a two-rank partition, whose collectives (deepspeed.comm's, swapped for the call) return
    handles that record their waits."""
    import torch
    from deepspeed.runtime.zero import partition_parameters as pp

    from ds_core.compat.marks import original

    launched: list = []
    waited: list = []

    def all_gather(*args, **kwargs):
        launched.append(_Handle(waited))
        return launched[-1]

    def param() -> Any:
        shard = torch.zeros(1)
        shard.ds_numel = 1
        return types.SimpleNamespace(ds_tensor=shard, ds_numel=1, ds_shape=(1,), data=None)

    stand_in = types.SimpleNamespace(num_partitions=2, _partition_world_size=lambda p: 2, local_device="cpu",
                                     use_all_gather_into_tensor=True, get_partition_dp_group=lambda p: None)
    comm = types.SimpleNamespace(all_gather_into_tensor=all_gather, all_gather=all_gather)
    real = pp.dist
    pp.dist = comm
    try:
        original(pp.Init._allgather_params_coalesced)(stand_in, [param(), param()])
    finally:
        pp.dist = real
    return len(launched) == 2 and waited == launched[-1:]


def zero_group_norm_hides_nonfinite() -> bool:
    """Whether the installed DeepSpeed's DeepSpeedZeroOptimizer.scaled_global_norm combines its groups' norms into a
    finite one where a group's norm is non-finite (masked as -1: 0.16's torch.norm of the stacked norms gives
    sqrt(1 + 3**2); 0.19's combine_grad_norm_groups gives inf); ds_core.compat.group_norm. One call of DeepSpeed's own
    method on a stand-in optimizer of two groups."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from ds_core.compat.marks import original

    norms = iter([torch.tensor(-1.0), torch.tensor(3.0)])
    stand_in = types.SimpleNamespace(bit16_groups=[[], []], averaged_gradients=[[], []], params_in_partition=[[], []],
                                     cpu_offload=False, has_moe_layers=False, loss_scale=1.0,
                                     get_grad_norm_direct=lambda gradients, params: next(norms),
                                     _muon_update_lacks_loss_scale=lambda group: False)
    return bool(torch.isfinite(original(DeepSpeedZeroOptimizer.scaled_global_norm)(stand_in)))


def quotes_plain_exports() -> bool:
    """Whether the installed DeepSpeed's MultiNodeRunner.add_export quotes a plain value (0.16) or keeps it as given
    (0.19 quotes only what a shell would split); one call on a stand-in runner."""
    from deepspeed.launcher.multinode_runner import MultiNodeRunner

    from ds_core.compat.marks import original

    stand_in = types.SimpleNamespace(exports={})
    original(MultiNodeRunner.add_export)(stand_in, "DS_CORE_PROBE", "cpu")
    return stand_in.exports["DS_CORE_PROBE"] != "cpu"


__all__ = ["bf16_grads_held", "optimizer_wrapper", "WrapperRefused", "WRAPPER_NAMES", "comms_timer_cumulative",
           "deepspeed_version", "universal_load_repoints_fp32", "zero_buckets_drop_cpu", "zero3_gather_waits_last_only",
           "zero_group_norm_hides_nonfinite", "quotes_plain_exports"]
