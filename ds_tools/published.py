"""Published multi-node throughput tables, each with a record of the settings it ran with: what `ds-scaling-report
predict` calibrates its fabrics on and validates against (ds_tools.calibration).

Every table is the publisher's throughput at each node count (sequences per second, whole job), read from the
document named in `source`; `read` says which part of it the figures were read from. Every setting that decides
what the collectives of a step cost is a `Setting`: stated, with the document and what it says, or not stated, with
the values that are plausible and why. A setting the source does not state is never picked: the calibration carries
every plausible value into the range it prints.

The settings the communication model needs:

  pattern      the collectives one optimizer step issues for data parallelism (COMM_PATTERNS), from the code that ran
  grad_bytes   bytes per gradient element on the wire
  overlap      share of the communication hidden behind compute (0: reduced after the backward)
  schedule     the batch schedule across node counts: ("global", G) keeps the global batch (accumulation follows
               the nodes, strong scaling), ("per_accelerator", B) keeps each accelerator's batch (weak scaling)
  micro_batch, buckets, gradient_path, stage: recorded for the reader; they do not enter the model's costs of a table
               (the micro batch does not change a step's collectives; buckets only their call count)

A table whose multi-node loss is mostly not what its collectives cost carries `unexplained`: the table of the same
collectives it is judged against (its sibling: same fabric, model, pattern, gradient bytes and schedule kind) and
what the sources say differs between the two. ds_tools.calibration checks the claim on the figures (its fitted
per-step loss more than twice its sibling's) and leaves such a table out of every fit; a prediction of its kind
carries no range (ds_tools.validation, ds_tools.ranges).

`POINTS` holds published results that are not a table (one node count, no 1-node figure readable here): the DL1
BERT-1.5B run, validated from the BERT-Large calibration over the 1-node range its compute can have.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# What one optimizer step issues, per collective: (kind, what it moves). all_reduce of the gradients: NVIDIA's DDP
# and DeepSpeed's ZeRO-0; ZeRO-1 in DeepSpeed 0.6 (stage_1_and_2.py average_tensor with reduce_scatter, the default:
# one dist.reduce of each rank's slice to its owner, the volume of a reduce-scatter) then the all-gather of the
# updated 16-bit partitions; ZeRO-1 in DeepSpeed 0.19 all-reduces the gradient buckets (use_multi_rank_bucket_allreduce,
# zero/config.py) then all-gathers (ds_tools.predict.collectives cites the lines).
COMM_PATTERNS = {
    "all_reduce": (("all_reduce", "grad"),),
    "reduce_scatter+all_gather": (("reduce_scatter", "grad"), ("all_gather", "param")),
    "all_reduce+all_gather": (("all_reduce", "grad"), ("all_gather", "param")),
}


@dataclass(frozen=True)
class Setting:
    """One setting of a published run: `value` with the `source` that states it, or, not stated (`value` None), the
    `plausible` values and why they are the plausible ones (`source` then says what the documents do say)."""
    value: object
    source: str
    plausible: tuple = ()

    @property
    def stated(self) -> bool:
        return self.value is not None

    @property
    def values(self) -> tuple:
        """Every value the calibration evaluates: the stated one, or each plausible one."""
        return (self.value,) if self.stated else tuple(self.plausible)

    def text(self) -> str:
        if self.stated:
            return f"{self.value} ({self.source})"
        return f"not stated; evaluated at {', '.join(map(str, self.plausible))} ({self.source})"


@dataclass(frozen=True)
class Unexplained:
    """A table's multi-node loss that its collectives do not account for: `sibling` is the table with the same
    collectives it is judged against, `differs` what the sources say differs between the two (none of it costed)."""
    sibling: str
    differs: str


@dataclass(frozen=True)
class PublishedTable:
    key: str                     # fabric/model-phase-precision
    fabric: str                  # ds_tools.fabrics.FABRICS name
    model: str                   # ds_configs/models/ name
    seq_len: int
    precision: str               # the publisher's label
    per_node: int
    table: dict                  # nodes -> sequences/s, whole job
    source: str                  # where the figures are
    read: str                    # what of it the figures were read from
    settings: dict = field(default_factory=dict)     # name -> Setting
    unexplained: Unexplained | None = None

    def setting(self, name: str) -> Setting:
        return self.settings[name]

    @property
    def nodes(self) -> list:
        return sorted(self.table)


_DLE = ("NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md (commit a07d20a124b2, 2022-05-25), "
        "'Pre-training NVIDIA DGX A100 (8x A100 80GB) Multi-node Scaling', pytorch:21.11-py3 container")
# The commit that added these tables together with the code and configs that ran them; run_pretraining.py's all-reduce
# path, the configs and the data loader are the same through c1584f00 (2022-06-30)
_DLE_CODE = "NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT (commit a9e2c1d5, 2022-03-02)"
# what the README's single-node table (same container, same systems, 8 GPUs) prints for each multi-node table's 1-node
# configuration: a second measurement of the same figure, 0.5-0.8 % above it
_DLE_SINGLE_NODE = {(1, True): 4591, (1, False): 2505, (2, True): 1657, (2, False): 860}


def _dle_settings(fp16: bool, phase: int) -> dict:
    g, micro = (65536, 256 if fp16 else 128) if phase == 1 else (32768, 32 if fp16 else 16)
    cfg = "dgxa10080g_8gpu_fp16" if fp16 else "dgxa10080g_8gpu_tf32"
    printed = ("126 and 256 (TF32 printed 126: 8192 accumulated / 64 steps is 128; the 4-node row's accumulation "
               "'16 and 18' is 16 and 8: 2048 / 256)" if phase == 1 else "16 and 32")
    return {
        "pattern": Setting("all_reduce", f"{_DLE_CODE} run_pretraining.py: torch DDP, every micro-step but the last "
                           "under model.no_sync() (--allreduce_post_accumulation, set by run.sub and by "
                           f"pretrain_config.sh {cfg}): one gradient all-reduce per optimizer step"),
        "grad_bytes": Setting(2 if fp16 else 4, f"{_DLE_CODE} scripts/configs/pretrain_config.sh {cfg}: "
                              f"allreduce_post_accumulation_fp16 {'true' if fp16 else 'false'} (run.sub: "
                              f"{'--fp16 --allreduce_post_accumulation_fp16' if fp16 else 'neither flag for tf32'}); "
                              "run_pretraining.py "
                              + ("model.half() with it: fp16 gradients" if fp16 else
                                 "keeps the fp32 model: fp32 gradients")),
        "overlap": Setting(0.0, f"{_DLE_CODE} run_pretraining.py: DDP(bucket_cap_mb=the device's total memory): one "
                           "bucket, reduced once every gradient of the backward is ready: nothing left to hide behind"),
        "schedule": Setting(("global", g), f"{_DLE} table: accumulated batch per GPU "
                            f"{g // 8} at 1 node halving with each doubling ('Strong Scaling'): global batch {g}"),
        "micro_batch": Setting(micro, f"{_DLE} table: batch size / GPU (TF32 and FP16) {printed}; the 80 GB "
                               f"configs' (pretrain_config.sh {cfg}), not the 40 GB ones' (dgxa100_8gpu_*: 64 in "
                               "phase 1, 16 (fp16) and 8 (TF32) in phase 2)"),
        "buckets": Setting("one DDP bucket", f"{_DLE_CODE} run_pretraining.py bucket_cap_mb"),
        "gradient_path": Setting("FusedLAMBAMP on fp32 master weights" if fp16 else "FusedLAMBAMP, fp32 model",
                                 f"{_DLE_CODE} run_pretraining.py"),
        "stage": Setting("no ZeRO (DDP)", f"{_DLE_CODE} run_pretraining.py"),
        "timing": Setting(f"micro batch x ranks x timed micro-steps / their time, the first "
                          f"{4 if phase == 1 else 50} micro-steps left out",
                          f"{_DLE_CODE} run_pretraining.py training_perf and skip_fwd_bwd_for_perf ('avoid nvfuser "
                          "compilation times in measuring perf with phase2 binning')"),
        "data": (Setting("unbinned: each batch padded to its longest sequence", f"{_DLE_CODE} pretrain_config.sh "
                         "DATASET=pretrain/phase1/unbinned; lddl/torch/bert.py pads a batch to its longest sequence, "
                         "aligned to 8") if phase == 1 else
                 Setting(None, f"{_DLE_CODE} pretrain_config.sh reads phase 2 in bins of 64 tokens ('All "
                         "configs using bin size=64 with phase2 by default'), run.sub (the multi-node launcher) "
                         "defaults BIN_SIZE to none; binned, every rank draws the same bin each micro-step "
                         "(lddl/torch/dataloader.py Binned: one world seed) and pads its own batch to its longest "
                         "sequence",
                         plausible=("bins of 64", "unbinned"))),
        "one_node": Setting(_DLE_SINGLE_NODE[phase, fp16], f"{_DLE} single-node table ('Pre-training NVIDIA DGX "
                            "A100 (8x A100 80GB)'), 8 GPUs at the same batch: a second measurement of the 1-node "
                            "figure"),
    }


_P2_TF32_DIFFERS = (
    "phase-1 TF32 all-reduces the same 1.34 GB of fp32 gradients through the same one DDP bucket on the same "
    "systems; what the sources say differs: sequence length 512 (micro batch 16, accumulation 256 at 1 node), the "
    "phase-2 data (bins of 64 tokens in pretrain_config.sh, each rank padding its own batch to its longest "
    "sequence, so ranks can wait for each other at the all-reduce; run.sub's default is unbinned: not stated for "
    "the multi-node runs) and 50 untimed warm-up micro-steps (4 in phase 1); none of it is stated as a cost per "
    "step, so none of it is modelled (the phase-2 fp16 table, the same data at micro batch 32, stays near its "
    "sibling: ds_tools.calibration.siblings prints every pair's ratio)")


def _dle(phase: int, fp16: bool, table: dict) -> PublishedTable:
    prec = "fp16" if fp16 else "tf32"
    odd = Unexplained("dgx-a100/bert-large-p1-tf32", _P2_TF32_DIFFERS) if (phase, fp16) == (2, False) else None
    return PublishedTable(
        key=f"dgx-a100/bert-large-p{phase}-{prec}", fabric="dgx-a100", model="bert_large",
        seq_len=128 if phase == 1 else 512, precision="mixed precision (fp16)" if fp16 else "TF32", per_node=8,
        table=table, source=_DLE,
        read=f"the table's rows at sequence length {128 if phase == 1 else 512}, column "
             f"'{'Mixed Precision' if fp16 else 'TF32'} Throughput' (read from the README in the repository, fetched)",
        settings=_dle_settings(fp16, phase), unexplained=odd)


_AWS = ("AWS Machine Learning Blog, 'Accelerate PyTorch with DeepSpeed to train large language models with Intel "
        "Habana Gaudi-based DL1 EC2 instances' (2023-06-07, aws.amazon.com/blogs/machine-learning/accelerate-pytorch-"
        "with-deepspeed-to-train-large-language-models-with-intel-habana-gaudi-based-dl1-ec2-instances)")
_WORKSHOP = ("aws-samples/aws-hpc-tutorials content/06-batch-mnp-train-dl1/08-submit-mnp-job.md (the AWS Batch "
             "workshop the blog names), DeepSpeedEngine configuration printed for run_bert_large.sh")
_DS061 = "DeepSpeed v0.6.1 (the base of the logged 'version=0.6.1+0f2b744, git-branch=v1.5.0')"

DL1_BERT_LARGE = PublishedTable(
    key="dl1/bert-large-p1-bf16", fabric="dl1", model="bert_large", seq_len=128, precision="bf16", per_node=8,
    table={1: 1379.76, 2: 2705.57, 4: 5291.58, 8: 9977.54}, source=_AWS,
    read="the figures as this project has held them since its first scaling report (studies/published/"
         "bert_large_dl1.csv); the copies of the blog reachable here hold its opening only, where 'scaling efficiency "
         "never dropping below 90 % with eight instances and 64 accelerators' (multiplatform.ai's summary of it) "
         "agrees with the 8-node row's 90.4 %",
    settings={
        "pattern": Setting(None, f"{_WORKSHOP}: zero_optimization_stage 1, reduce_scatter true, "
                           f"'stage_1_and_2.py:527 optimizer state initialized'; {_DS061} "
                           "engine.allreduce_gradients: stage 1 reduces at the accumulation boundary "
                           "(reduce_gradients), average_tensor a dist.reduce of each slice to its owner, then "
                           "all_gather_dp_groups of the bf16 partitions; Habana's fork of that release (the code that "
                           "ran) is not public here, and later releases all-reduce the buckets instead",
                           plausible=("reduce_scatter+all_gather", "all_reduce+all_gather")),
        "grad_bytes": Setting(2, f"{_WORKSHOP}: bfloat16_enabled True, communication_data_type None (the gradients' "
                              "own dtype, bf16)"),
        "overlap": Setting(0.0, f"{_WORKSHOP}: overlap_comm false; stage 1 reduces after the last backward"),
        "schedule": Setting(None, f"the blog's opening does not state it; {_WORKSHOP}: "
                            "deepspeed_config_bert_large.json sets train_batch_size 65536 and multi-node runs change "
                            "NUM_NODES only, so DeepSpeed derives the accumulation from the global batch",
                            plausible=(("global", 65536),)),
        "micro_batch": Setting(None, f"not stated in the blog's opening; {_WORKSHOP}: "
                               "train_micro_batch_size_per_gpu 32", plausible=(32,)),
        "buckets": Setting("reduce 5e8, all-gather 5e8 elements", f"{_WORKSHOP}: zero_config"),
        "gradient_path": Setting("DeepSpeedZeroOptimizer (stage_1_and_2), bf16 gradients", f"{_WORKSHOP} log"),
        "stage": Setting(1, _WORKSHOP),
    })

@dataclass(frozen=True)
class PublishedPoint:
    """One published efficiency at one node count whose 1-node figure is not readable here: validated from the
    calibration of its fabric, its 1-node step evaluated over the range its compute can have (`compute_from`'s
    1-node compute per sequence scaled by 6 x parameters x tokens, at that table's MFU or down to the lowest MFU the
    published 1-node figures imply: ds_tools.validation)."""
    key: str
    fabric: str
    model: str
    seq_len: int
    precision: str
    per_node: int
    nodes: int
    efficiency: float
    source: str
    read: str
    compute_from: str            # the table whose 1-node figure gives the compute per sequence
    settings: dict = field(default_factory=dict)

    def setting(self, name: str) -> Setting:
        return self.settings[name]


_HABANA_1P5B = ("HabanaAI/Model-References PyTorch/nlp/pretraining/deepspeed-bert/scripts/"
                "deepspeed_config_bert_1.5b.json (the recipe the workshop's container carries): bf16, ZeRO stage 1, "
                "no communication_data_type, no overlap_comm")
_TOMS = ("Tom's Hardware's account of the blog (tomshardware.com/news/aws-uses-intel-habana-gaudi-for-llvm; its "
         "copies at inkl.com and elsewhere)")

DL1_BERT_1P5B = PublishedPoint(
    key="dl1/bert-1.5b-p1-bf16", fabric="dl1", model="bert_1p5b", seq_len=128, precision="bf16", per_node=8,
    nodes=16, efficiency=0.827, source=_AWS,
    read="the blog's opening (its copies at amazonaws.cn/blog-selection, phdstudio.org and others hold it whole): 'a "
         "scaling efficiency of 82.7% across 128 accelerators (16 dl1.24xlarge instances) using DeepSpeed ZeRO "
         "stage 1'; its throughputs per node count (and so its 1-node figure) are not in any copy reachable here",
    compute_from="dl1/bert-large-p1-bf16",
    settings={
        "pattern": DL1_BERT_LARGE.setting("pattern"),
        "grad_bytes": Setting(2, f"{_AWS}: 'Gaudi's native support of the BF16 data type'; {_HABANA_1P5B}: the "
                              "gradients' own dtype on the wire"),
        "overlap": Setting(0.0, f"{_HABANA_1P5B}; {_DS061} zero/config.py: overlap_comm defaults to false"),
        "schedule": Setting(("per_accelerator", 384), f"{_TOMS}: 'the effective batch size per accelerator was set "
                            "to 384, with micro-batches of 16 per step and 24 steps of gradient accumulation' (the "
                            "scaling efficiency of that run is its per-accelerator throughput against 1 node's)"),
        "micro_batch": Setting(16, _TOMS),
        "stage": Setting(1, f"{_AWS}: 'using DeepSpeed ZeRO stage 1 optimizations'"),
    })

POINTS: tuple = (DL1_BERT_1P5B,)

PUBLISHED: tuple = (
    _dle(1, True, {1: 4553, 2: 9191, 4: 18119, 8: 35774, 16: 70555, 32: 138294}),
    _dle(1, False, {1: 2486, 2: 4979, 4: 9859, 8: 19815, 16: 38866, 32: 75706}),
    _dle(2, True, {1: 1648, 2: 3291, 4: 6464, 8: 13005, 16: 25570, 32: 49663}),
    _dle(2, False, {1: 854, 2: 1684, 4: 3293, 8: 6515, 16: 12131, 32: 21298}),
    DL1_BERT_LARGE,
)

BY_KEY = {t.key: t for t in PUBLISHED}


def on_fabric(fabric: str) -> list:
    return [t for t in PUBLISHED if t.fabric == fabric]
