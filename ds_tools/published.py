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

    def setting(self, name: str) -> Setting:
        return self.settings[name]

    @property
    def nodes(self) -> list:
        return sorted(self.table)


_DLE = ("NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md (commit a07d20a124b2, 2022-05-25), "
        "'Pre-training NVIDIA DGX A100 (8x A100 80GB) Multi-node Scaling', pytorch:21.11-py3 container")
_DLE_CODE = "NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT (commit c1584f00, 2022-06-30)"


def _dle_settings(fp16: bool, phase: int) -> dict:
    g, micro = (65536, 256 if fp16 else 128) if phase == 1 else (32768, 32 if fp16 else 16)
    cfg = "dgxa100-80g_8gpu_fp16" if fp16 else "dgxa100-80g_8gpu_tf32"
    return {
        "pattern": Setting("all_reduce", f"{_DLE_CODE} run_pretraining.py: torch DDP, every micro-step but the last "
                           "under model.no_sync() (--allreduce_post_accumulation, on in scripts/run_pretraining.sh): "
                           "one gradient all-reduce per optimizer step"),
        "grad_bytes": Setting(2 if fp16 else 4, f"{_DLE_CODE} scripts/configs/pretrain_config.sh {cfg}: "
                              f"allreduce_post_accumulation_fp16 {'true' if fp16 else 'false'}; run_pretraining.py "
                              + ("model.half() with it: fp16 gradients" if fp16 else
                                 "keeps the fp32 model: fp32 gradients")),
        "overlap": Setting(0.0, f"{_DLE_CODE} run_pretraining.py: DDP(bucket_cap_mb=the device's total memory): one "
                           "bucket, reduced once every gradient of the backward is ready: nothing left to hide behind"),
        "schedule": Setting(("global", g), f"{_DLE} table: accumulated batch per GPU "
                            f"{g // 8} at 1 node halving with each doubling ('Strong Scaling'): global batch {g}"),
        "micro_batch": Setting(micro, f"{_DLE} table: batch size / GPU (TF32 and FP16) "
                               + ("126 and 256 (126: as printed)" if phase == 1 else "16 and 32")),
        "buckets": Setting("one DDP bucket", f"{_DLE_CODE} run_pretraining.py bucket_cap_mb"),
        "gradient_path": Setting("FusedLAMBAMP on fp32 master weights" if fp16 else "FusedLAMBAMP, fp32 model",
                                 f"{_DLE_CODE} run_pretraining.py"),
        "stage": Setting("no ZeRO (DDP)", f"{_DLE_CODE} run_pretraining.py"),
    }


def _dle(phase: int, fp16: bool, table: dict) -> PublishedTable:
    prec = "fp16" if fp16 else "tf32"
    return PublishedTable(
        key=f"dgx-a100/bert-large-p{phase}-{prec}", fabric="dgx-a100", model="bert_large",
        seq_len=128 if phase == 1 else 512, precision="mixed precision (fp16)" if fp16 else "TF32", per_node=8,
        table=table, source=_DLE,
        read=f"the table's rows at sequence length {128 if phase == 1 else 512}, column "
             f"'{'Mixed Precision' if fp16 else 'TF32'} Throughput' (read from the README in the repository, fetched)",
        settings=_dle_settings(fp16, phase))


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

# The blog's BERT-1.5B run, recorded for its settings: the copies of the blog reachable here state its layout and its
# 16-node efficiency, not its throughputs (so it is not a table to validate on here).
DL1_BERT_1P5B_LAYOUT = {
    "stage": Setting(1, f"{_AWS}: 'using DeepSpeed ZeRO stage 1 optimizations'"),
    "schedule": Setting(("per_accelerator", 384), "Tom's Hardware's account of the blog (tomshardware.com/news/"
                        "aws-uses-intel-habana-gaudi-for-llvm): 'the effective batch size per accelerator was set to "
                        "384, with micro-batches of 16 per step and 24 steps of gradient accumulation'"),
    "micro_batch": Setting(16, "the same"),
    "efficiency_16_nodes": Setting(0.827, f"{_AWS}: 'a scaling efficiency of 82.7% across 128 accelerators (16 "
                                   "dl1.24xlarge instances)'"),
}

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
