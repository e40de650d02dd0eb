"""The published BERT pretraining runs as named recipes: `bert_ref.train --recipe nvidia_large_p1 ...` sets every
setting the reference run fixes (model, phase, batch layout, optimizer, LR schedule, steps, seed), so nobody copies
numbers by hand. Flags given on the command line still win (argparse keeps the last value; the recipe's go first).

Sources (docs/bert_pretraining.md shows the commands; tests/test_recipes.py checks them against the published values):
- NVIDIA DeepLearningExamples 7a4c42501ce05ac5b76999e3b9ddadeffd177b1d, PyTorch/LanguageModeling/BERT:
  scripts/run_pretraining.sh defaults (8 GPUs; phase 1: train_batch_size 8192 per GPU = 128 accumulated micro batches
  of 64, lr 6e-3, warm-up 0.2843, 7038 steps; phase 2: 4096 = 512 x 8, lr 4e-3, warm-up 0.128, 1563 steps; seed 12439;
  checkpoint every 200 steps) and run_pretraining.py (FusedLAMB(lr) with apex defaults: betas 0.9 / 0.999, eps 1e-6,
  max_grad_norm 1.0, bias correction; weight decay 0.01 except bias / LayerNorm; PolyWarmUpScheduler degree 0.5).
- HabanaAI Model-References, PyTorch/nlp/DeepSpeedExamples/deepspeed-bert, the BERT-1.5B phase-1 run:
  scripts/run_bert_1.5b_8x.sh (one node of 8 cards) and scripts/deepspeed_config_bert_1.5b.json at
  06bfc5eaa56c3282c26896efd535982abe52b2eb (both last changed in cce550e8b7d4a9c322cfdd774ce059d2f2bc86d2), and
  scripts/run_bert_1.5b_32x.sh (HL_NUM_NODES nodes x 8 cards, otherwise the same flags; its last version is at
  59a69770ac86f7065b2c5954b13cdf5cb9d1dfd8): the JSON fixes train_batch_size 12288 and micro 32 (DeepSpeed derives the
  accumulation: 48 on 8 cards, 6 on 8 nodes, 3 on 16), ZeRO-1, bf16, gradient_clipping 1.0; the scripts run lr 0.0015
  on any node count (not scaled), warm-up 0.05, constant 0.25, degree 1.0, 155,000 steps, seed 12439, a checkpoint
  every 200 steps; run_pretraining.py and lans.py at 06bfc5ea: LANS(max_grad_norm=0, eps=1e-6,
  adjust_step=<ZeRO on>), weight decay 0.01 except bias / LayerNorm. ds_configs/bert_1p5b_zero1_bf16.json is that JSON
  (clipping by LANS itself: docs/bert_pretraining.md).

Not reproduced: NVIDIA's fp16 AMP with DDP (the recipes run bf16 with ZeRO-1, which does not change the update's
arithmetic beyond precision).
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_core.config import Batch
from ds_core.errors import ConfigError


@dataclass(frozen=True)
class PublishedRun:
    """A reference run: the flags that reproduce it and the layout (world size) its batch arithmetic assumes."""

    flags: tuple[str, ...]
    world_size: int
    global_batch: int
    source: str


def _nvidia(phase: int) -> PublishedRun:
    micro, accum, lr, warm, steps = (64, 128, "6e-3", "0.2843", "7038") if phase == 1 else \
        (8, 512, "4e-3", "0.128", "1563")
    flags = ("--preset", "bert_large", "--phase", str(phase), "--deepspeed_config", "bert_large_zero1_bf16.json",
             "--micro_batch_size", str(micro), "--gradient_accumulation_steps", str(accum),
             "--optimizer", "lamb", "--learning_rate", lr, "--weight_decay", "0.01", "--beta1", "0.9",
             "--beta2", "0.999", "--eps", "1e-6", "--max_grad_norm", "1.0", "--bias_correction_lag", "false",
             "--lr_schedule", "nvidia_poly", "--warmup_proportion", warm, "--constant_proportion", "0",
             "--poly_degree", "0.5", "--scale_lr_with_global_batch", "false", "--max_steps", steps,
             "--seed", "12439", "--num_steps_per_checkpoint", "200")
    return PublishedRun(flags, 8, micro * accum * 8,
                        f"NVIDIA DeepLearningExamples BERT phase {phase} (run_pretraining.sh at 7a4c4250)")


def _habana(nodes: int) -> PublishedRun:
    """Habana's BERT-1.5B phase 1 on `nodes` x 8 cards: the batch numbers are the JSON's (12288 sequences of micro
    batches of 32, the accumulation derived from the world size)."""
    flags = ("--preset", "bert_1p5b", "--phase", "1", "--deepspeed_config", "bert_1p5b_zero1_bf16.json",
             "--optimizer", "lans", "--learning_rate", "0.0015", "--weight_decay", "0.01", "--beta1", "0.9",
             "--beta2", "0.999", "--eps", "1e-6", "--max_grad_norm", "1.0", "--bias_correction_lag", "true",
             "--lr_schedule", "habana_poly", "--warmup_proportion", "0.05", "--constant_proportion", "0.25",
             "--poly_degree", "1.0", "--scale_lr_with_global_batch", "false", "--max_steps", "155000",
             "--seed", "12439", "--num_steps_per_checkpoint", "200")
    script = "run_bert_1.5b_8x.sh" if nodes == 1 else f"run_bert_1.5b_32x.sh with HL_NUM_NODES={nodes}"
    return PublishedRun(flags, nodes * 8, 12288, f"Habana Model-References deepspeed-bert BERT-1.5B, {nodes} node(s) "
                                                 f"x 8 ({script})")


RECIPES: dict[str, PublishedRun] = {"nvidia_large_p1": _nvidia(1), "nvidia_large_p2": _nvidia(2),
                                    "habana_1p5b_8x": _habana(1), "habana_1p5b_8n": _habana(8),
                                    "habana_1p5b_16n": _habana(16)}


def expand_recipe(argv: list[str]) -> tuple[list[str], str]:
    """argv with the flags of `--recipe NAME` (or `--recipe=NAME`) placed first, so that flags the user gives win, and
    `--recipe NAME` kept (the run records it: BertArgs.recipe); and the recipe's name ('' when none)."""
    out, name, i = [], "", 0
    while i < len(argv):
        a = argv[i]
        if a == "--recipe" or a.startswith("--recipe="):
            if name:
                raise ConfigError("--recipe given twice: give one")
            if a == "--recipe":
                if i + 1 >= len(argv):
                    raise ConfigError(f"--recipe needs a name: one of {', '.join(RECIPES)}")
                name, i = argv[i + 1], i + 2
            else:
                name, i = a.split("=", 1)[1], i + 1
            check_recipe_name(name)
            out += ["--recipe", name]
            continue
        out.append(a)
        i += 1
    return (list(RECIPES[name].flags) + out if name else out), name


def check_recipe_name(name: str) -> None:
    if name and name not in RECIPES:
        raise ConfigError(f"--recipe {name!r}: unknown; expected one of {', '.join(RECIPES)}")


def check_recipe_batch(name: str, batch: Batch) -> None:
    """A recipe's LR and step count hold for its global batch only: refuse another one (a different world size
    changes micro x accumulation x world), naming the numbers and the accumulation that would restore it."""
    if not name:
        return
    run = RECIPES[name]
    got = batch.global_size
    if got == run.global_batch:
        return
    micro, world = batch.micro, batch.data_parallel
    fix = run.global_batch / (micro * world)
    hint = (f"--gradient_accumulation_steps {int(fix)}" if fix == int(fix) else
            f"a micro batch and accumulation whose product with world size {world} is {run.global_batch}")
    raise ConfigError(f"--recipe {name}: {run.source} trains with a global batch of {run.global_batch} sequences "
                      f"(world size {run.world_size}); this run's is {got} (micro {micro} x accumulation "
                      f"{batch.accumulation} x world size {world}): use {hint}")


__all__ = ["PublishedRun", "RECIPES", "expand_recipe", "check_recipe_name", "check_recipe_batch"]
