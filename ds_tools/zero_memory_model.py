"""The ZeRO memory model ds-tune uses: every buffer DeepSpeed 0.19 allocates per rank for a configuration
(stage, precision, data_types.grad_accum_dtype, accumulation, buckets, contiguous gradients, overlap), read from
DeepSpeed's code; each component names its deepspeed/runtime/ file and line.

Which optimizer wrapper a configuration gets decides most of it, and that is asked of the installed DeepSpeed
(ds_core.compat.deepspeed_behaviour.optimizer_wrapper runs its _do_optimizer_sanity_check): on 0.19, fp32 ZeRO-0 ->
the plain optimizer; bf16 ZeRO-0 -> FP16_(Unfused)Optimizer (bf16 accumulation only); bf16 ZeRO-1 with fp32
accumulation (the shipped configs) -> BF16_Optimizer, whose fp32 gradient buffer is NOT partitioned (4 B/param on every
rank); otherwise DeepSpeedZeroOptimizer (ZeRO-1/2) or DeepSpeedZeroOptimizer_Stage3. Habana's fork (0.16.1) gives bf16
ZeRO-0 BF16_Optimizer (fp32 accumulation only). estimate() returns what the wrapper holds between steps plus what comes
on top in each phase of a step; the peak is the first plus the largest phase.
bench/zero_memory.py measures it on 2 CPU ranks (ZeRO 0-3 x fp32/bf16 x accumulation 1/2, within 10 % per case).
Arithmetic, but for the wrapper decision (which imports DeepSpeed's engine module once, ~3 s).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

STAGES = (0, 1, 2, 3)
# Buckets written into the recommended DeepSpeed JSON (elements); the memory model uses the same numbers.
DEFAULT_BUCKETS = {"reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
                   "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000}


class TuningError(ValueError):
    """Bad model spec, accelerator, batch or configuration; the message names the value and what was expected."""


@dataclass
class Tower:
    """A stack of identical transformer layers seen by the activation model."""
    name: str
    layers: int
    hidden: int
    heads: int
    intermediate: int
    seq: int
    cross_seq: int = 0          # >0: each layer also cross-attends to a sequence this long (BridgeTower)


@dataclass
class ModelShape:
    name: str
    params: int
    largest_layer_params: int   # largest parameter count held directly by one module (ZeRO-3 gathers it whole)
    towers: list
    vocab: int                  # MLM head width (0: no token-level head)
    head_seq: int
    exact: bool                 # params counted on a meta-device model, not by formula


def activation_bytes(shape: ModelShape, micro_batch: int, checkpointing: bool) -> float:
    """bf16 activations kept for backward, per micro batch (Korthikanti et al. 2022, generalised to any FFN width):
    per layer s*(18h + 4i) + 5*a*s^2 bytes per sample, plus embeddings and the MLM head (bf16 logits + fp32
    log-softmax + its gradient, 10*s*V); with activation checkpointing each layer keeps only its 2*s*h input and one
    layer is live again during its recomputation."""
    per_sample = 0.0
    live_layer = 0.0
    for t in shape.towers:
        s, h = t.seq, t.hidden
        layer = s * (18 * h + 4 * t.intermediate) + 5 * t.heads * s * s
        if t.cross_seq:
            layer += 13 * s * h + 5 * t.heads * s * t.cross_seq
        per_sample += 7 * s * h                                    # embeddings sum, layernorm, dropout
        per_sample += t.layers * (2 * s * h if checkpointing else layer)
        live_layer = max(live_layer, layer)
    if checkpointing:
        per_sample += live_layer                                   # one layer recomputed at a time
    if shape.vocab:
        h = shape.towers[0].hidden
        per_sample += shape.head_seq * (6 * h + 10 * shape.vocab)  # transform + logits/log-softmax/grad
    return micro_batch * per_sample



@dataclass
class Estimate:
    """Predicted bytes per rank. `parts`: what the rank holds between steps (model states, persistent buffers);
    `phases`: what comes on top of that in each phase of a step. Peak = parts + the largest phase."""
    stage: int
    micro_batch: int
    checkpointing: bool
    optimizer: str = ""                          # the DeepSpeed optimizer class this configuration gets
    parts: dict = field(default_factory=dict)    # component -> bytes, held between steps
    phases: dict = field(default_factory=dict)   # phase -> {component -> bytes} on top of `parts`
    sources: dict = field(default_factory=dict)

    @property
    def resident(self) -> float:
        return sum(self.parts.values())

    @property
    def model_states(self) -> float:
        return sum(v for k, v in self.parts.items() if k.startswith("states"))

    @property
    def activations(self) -> float:
        return self.phases.get("forward/backward", {}).get("activations", 0.0)

    def phase_totals(self) -> dict:
        return {k: sum(v.values()) for k, v in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_totals()
        return max(totals, key=totals.get)

    @property
    def total(self) -> float:
        return self.resident + max(self.phase_totals().values(), default=0.0)


# DeepSpeed 0.19 engine.allreduce_gradients -> buffered_allreduce_fallback flattens gradients in buckets of this many
# elements (runtime/engine.py:151 MEMORY_OPT_ALLREDUCE_SIZE, :3921, flatten at :3796); reduce_bucket_size plays no part
DS_ALLREDUCE_BUCKET = 500_000_000


@functools.lru_cache(maxsize=None)
def deepspeed_optimizer(stage: int, precision: str, grad_accum_dtype: str | None, fused_adam: bool) -> str:
    """The wrapper the installed DeepSpeed puts around the optimizer (its own _do_optimizer_sanity_check, run by
    ds_core.compat.deepspeed_behaviour); TuningError with DeepSpeed's reason where it refuses the configuration."""
    from ds_core.compat.deepspeed_behaviour import WrapperRefused, deepspeed_version, optimizer_wrapper

    try:
        return optimizer_wrapper(stage, precision, grad_accum_dtype, fused_adam=fused_adam)
    except WrapperRefused as e:
        raise TuningError(f"ZeRO-{stage} with {precision} and grad_accum_dtype {grad_accum_dtype or precision}: "
                          f"DeepSpeed {deepspeed_version()} refuses it at deepspeed.initialize ({e})") from None


@functools.lru_cache(maxsize=None)
def bf16_grads_held() -> bool:
    """Whether the installed DeepSpeed keeps BF16_Optimizer's bf16 gradients between steps (ds_core.compat.
    deepspeed_behaviour.bf16_grads_held: Habana's fork does, 0.19 frees them)."""
    from ds_core.compat.deepspeed_behaviour import bf16_grads_held as held

    return held()


def estimate(shape: ModelShape, stage: int, micro_batch: int, ranks_per_node: int, nodes: int, *,
             checkpointing: bool = False, fused_adam: bool = True, buckets: dict | None = None,
             overlap_comm: bool = False, precision: str = "bf16", grad_accum: int = 1,
             grad_accum_dtype: str | None = None, contiguous_gradients: bool = True) -> Estimate:
    """Predicted bytes per rank: every buffer DeepSpeed 0.19 allocates for this configuration (file:line in
    deepspeed/runtime/), as named components held between steps plus per-phase transients.

    grad_accum_dtype None: DeepSpeed's default, the model's dtype. fused_adam False: torch's single-tensor Adam(W)
    (the CPU accelerator's), whose update makes two fp32 temporaries the size of the tensor it steps
    (exp_avg_sq.sqrt() and its quotient): the largest parameter at ZeRO-0, the flat partition at ZeRO >= 1.
    grad_accum changes no buffer (gradients accumulate in place) but is accepted so callers state it."""
    if stage not in STAGES:
        raise TuningError(f"ZeRO stage {stage}: expected one of {STAGES}")
    if precision not in ("bf16", "fp32"):
        raise TuningError(f"precision {precision!r}: expected bf16 or fp32")
    if grad_accum < 1:
        raise TuningError(f"gradient accumulation {grad_accum}: expected >= 1")
    b = {**DEFAULT_BUCKETS, **(buckets or {})}
    P, n = float(shape.params), ranks_per_node * nodes
    lp = 2.0 if precision == "bf16" else 4.0                    # bytes of a model parameter / gradient
    acc = 4.0 if (grad_accum_dtype or precision) == "fp32" else 2.0
    opt = deepspeed_optimizer(stage, precision, grad_accum_dtype, fused_adam)
    e = Estimate(stage=stage, micro_batch=micro_batch, checkpointing=checkpointing, optimizer=opt)
    adam_tmp = 0.0 if fused_adam else 8.0 * (shape.largest_layer_params if stage == 0 else P / n)
    rb = min(P, b["reduce_bucket_size"])
    fb = {"activations": activation_bytes(shape, micro_batch, checkpointing)}
    st: dict = {}       # the optimizer update
    prep: dict = {}     # ZeRO: the step's gradient preparation, before the update (not at the same time)
    if opt == "basic":
        e.parts["states: fp32 params (4 B/param)"] = 4.0 * P
        e.parts["states: Adam moments (8 B/param)"] = 8.0 * P
        fb["gradients: fp32 (4 B/param)"] = 4.0 * P
        fb["all-reduce flattening (engine.py:3796, 500M-element buckets)"] = 4.0 * min(P, DS_ALLREDUCE_BUCKET)
        st["gradients: fp32 (4 B/param)"] = 4.0 * P
    elif opt in ("FP16_UnfusedOptimizer", "FP16_Optimizer"):
        e.parts["states: bf16 params (2 B/param)"] = 2.0 * P
        e.parts["states: fp32 master copy (4 B/param, unfused_optimizer.py:78)"] = 4.0 * P
        e.parts["states: Adam moments (8 B/param)"] = 8.0 * P
        fb["gradients: bf16 (2 B/param)"] = 2.0 * P
        fb["all-reduce flattening (engine.py:3796, 500M-element buckets)"] = 2.0 * min(P, DS_ALLREDUCE_BUCKET)
        st["gradients: bf16 (2 B/param)"] = 2.0 * P
        st["gradients: fp32 copies for the step (unfused_optimizer.py:222)"] = 4.0 * P
    elif opt == "BF16_Optimizer":
        e.parts["states: bf16 flat params (2 B/param, bf16_optimizer.py:166)"] = 2.0 * P
        e.parts["states: fp32 gradient buffer, NOT partitioned (4 B/param, bf16_optimizer.py:191)"] = 4.0 * P
        e.parts["states: fp32 master partition (4 B/param / N, bf16_optimizer.py:182)"] = 4.0 * P / n
        e.parts["states: Adam moments partition (8 B/param / N)"] = 8.0 * P / n
        if bf16_grads_held():  # Habana's fork: no zero_grad of BF16_Optimizer, the step leaves them allocated
            e.parts["states: bf16 gradients, kept between steps (2 B/param)"] = 2.0 * P
        else:
            fb["gradients: bf16 (2 B/param), added into the fp32 buffer at the boundary"] = 2.0 * P
            st["gradients: bf16 (2 B/param)"] = 2.0 * P
        # communication_data_type defaults to bf16 (engine.py:1727): the fp32 buffer is cast for the all-reduce
        fb["all-reduce: bf16 cast of the fp32 buffer (engine.py:3802)"] = 2.0 * min(P, DS_ALLREDUCE_BUCKET)
    elif opt == "DeepSpeedZeroOptimizer":
        e.parts[f"states: flat {precision} params ({lp:.0f} B/param, stage_1_and_2.py:560)"] = lp * P
        e.parts["states: fp32 master partition (4 B/param / N, stage_1_and_2.py:560)"] = 4.0 * P / n
        e.parts["states: Adam moments partition (8 B/param / N)"] = 8.0 * P / n
        if contiguous_gradients:
            fb["reduce bucket (stage_1_and_2.py:3266, x2 with overlap_comm)"] = rb * lp * (2 if overlap_comm else 1)
        else:     # each bucket of gradients is flattened for its collective instead (stage_1_and_2.py:2367)
            fb["flattened gradient bucket (stage_1_and_2.py:2367)"] = rb * lp
        # step() (stage_1_and_2.py:3013): first the rank's gradient partition is flattened (3116) while the
        # gradients it came from still live, then cast to fp32 (3118) and the rest freed before the Adam update
        if stage == 1:
            fb[f"gradients: {precision} (unpartitioned)"] = lp * P
            fb["gradient partition being reduced"] = acc * P / n
            prep[f"gradients: {precision}, this rank's partition"] = lp * P / n
            prep["gradient partition (averaged_gradients)"] = acc * P / n
            prep["flattened gradient partition (stage_1_and_2.py:3116)"] = lp * P / n
        else:
            # contiguous_gradients: grads_in_partition (stage_1_and_2.py:2192); a parameter's own gradient lives
            # until it is copied into the bucket, the largest one bounds that
            fb["gradient partition (grads_in_partition)"] = acc * P / n
            fb["gradient of the largest parameter before bucketing"] = lp * shape.largest_layer_params
            if grad_accum > 1 and acc == lp:
                # measured (bench/zero_memory.py, fp32 ZeRO-2, accumulation 2: +4 B/param / N, none with bf16 and
                # fp32 accumulation, whose compact fp32 buffer takes the sum in place): a micro-step's reduced
                # partition is added to the accumulated one from a second buffer (copy_grads_in_partition, 2142)
                fb["second gradient partition while accumulating"] = acc * P / n
            prep["gradient partition (grads_in_partition)"] = acc * P / n
        if acc != 4.0:
            prep["fp32 copy of the gradient partition (stage_1_and_2.py:3118)"] = 4.0 * P / n
        st["fp32 gradient partition (stage_1_and_2.py:3126)"] = 4.0 * P / n
    else:                                                           # ZeRO-3
        e.parts[f"states: {precision} param partition ({lp:.0f} B/param / N, stage3.py:907)"] = lp * P / n
        e.parts["states: fp32 master partition (4 B/param / N, stage3.py:1160)"] = 4.0 * P / n
        e.parts["states: Adam moments partition (8 B/param / N)"] = 8.0 * P / n
        e.parts["states: gradient partition buffer (stage3.py:791)"] = acc * P / n
        if contiguous_gradients:
            e.parts["buffer: reduce bucket (stage3.py:782)"] = rb * lp
        else:
            fb["flattened gradient bucket (stage3.py:2267)"] = rb * lp
        # parameters gathered in forward/backward stay until stage3_max_live_parameters (zero/config.py:245,
        # default 1e9 elements) are live: measured whole at this bench's 110 M parameters
        fb["gathered parameters (stage3_max_live_parameters)"] = lp * min(P, max(
            b["stage3_max_live_parameters"], b["stage3_prefetch_bucket_size"]))
        fb["gradient of the largest parameter before bucketing"] = lp * shape.largest_layer_params
        prep["flattened gradient partition (stage3.py:2686)"] = acc * P / n
        if acc != 4.0:
            prep["fp32 copy of the gradient partition (stage3.py:2686)"] = 4.0 * P / n
        st["fp32 gradient partition (stage3.py:2686)"] = 4.0 * P / n
    if adam_tmp:
        st["non-fused Adam temporaries (2 x fp32 of the stepped tensor)"] = adam_tmp
    e.phases = {"forward/backward": fb, "optimizer step": st}
    if prep:
        e.phases["step: gradient partition"] = prep
    e.sources["states"] = f"DeepSpeed 0.19 allocations ({opt})"
    return e


def resident_state_bytes(shape: ModelShape, stage: int, ranks: int, buckets: dict | None = None, **kw) -> float:
    """What a rank holds BETWEEN steps (estimate(...).resident); the bench checks it against the live tensors."""
    return estimate(shape, stage, 1, ranks, 1, buckets=buckets, **kw).resident


def grad_accum_dtype_for(stage: int, precision: str) -> str | None:
    """The accumulation dtype ds-tune's configurations use: fp32 for bf16 where the installed DeepSpeed has an fp32
    path for it (ZeRO >= 1 everywhere, as the shipped configs and ds_core.config.settle_grad_accum_dtype; ZeRO-0 on
    Habana's fork), the model's dtype otherwise (ZeRO-0 + bf16 on DeepSpeed 0.19)."""
    if precision != "bf16":
        return None
    try:
        deepspeed_optimizer(stage, precision, "fp32", True)
    except TuningError:
        return None
    return "fp32"
