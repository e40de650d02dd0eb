"""BERT pretraining LR schedules named by their source, equal to it at every optimizer step.

- `nvidia_poly`: NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT `schedulers.py` PolyWarmUpScheduler (commit
  7a4c4250) as its `run_pretraining.py` steps it: linear warm-up over `warmup` of the steps, then
  (1 - progress)^degree on the OVERALL progress (no rescaling after warm-up: at the end of BERT-Large phase 1's
  warm-up the LR is already 0.846 x peak). No constant phase.
- `habana_poly`: HabanaAI Model-References PyTorch/nlp/DeepSpeedExamples/deepspeed-bert `schedulers.py`
  PolyWarmUpScheduler as `scripts/run_bert_1.5b_8x.sh` runs it: linear warm-up, a constant phase, then
  ((1 - progress) / (1 - warmup - constant))^degree.
- `poly_warmup` (ds_core.schedule.poly_warmup_factor): this project's earlier Habana-like schedule (warm-up reaching the
  peak at its last step, decay rescaled to start after warm-up + constant); it is neither reference's step counting.

Step counting (0-based step k = updates already applied, as ds_core.schedule.LRSchedule counts): both references
apply progress (k + 1) / total_steps to update k. NVIDIA steps the scheduler before each update and the scheduler reads
apex FusedLAMB's param_group['step'] + 1; phase 2 (`--phase2 --resume_from_checkpoint`) sets that count to
resume_step - phase1_end_step = 0, so phase 2 counts its own steps from 0 against its own max_steps (1563).
Habana's scheduler reads param_group['step'] (no + 1) after each update, but under ZeRO-1 the DeepSpeed their script
was written for runs one zero-gradient optimizer step inside deepspeed.initialize (the step LANS's adjust_step, on
"for Zero01 optimization when using DeepSpeed", takes back for bias correction), so update k again sees progress
(k + 1) / total. (A DeepSpeed whose ZeRO-1 skips that initial step, as the upstream one installed here does, would
give updates 0 and 1 both progress 1 / total and lag one step after: 1/155000 of the schedule.)
tests/data/lr_reference.npz holds every step of the references' own code for the published settings
(tests/test_schedules_ref.py compares them).

Past total_steps both references are undefined (NVIDIA's (1 - progress) ** 0.5 turns complex, Habana's goes negative):
here the factor is 0.
"""
from __future__ import annotations

from typing import Callable

from ds_core.errors import ConfigError

# The kinds defined here; ds_core.schedule adds them to its one vocabulary (KINDS). This module imports no schedule
# code, so ds_core.schedule can import it without a circle.
REF_KINDS = ("nvidia_poly", "habana_poly")


def _check(kind: str, total_steps: int, warmup: float, constant: float, degree: float) -> None:
    if kind not in REF_KINDS:
        raise ConfigError(f"--lr_scheduler_type {kind!r}: expected one of {', '.join(REF_KINDS)}")
    if total_steps <= 0:
        raise ConfigError(f"LR schedule {kind}: total_steps = {total_steps}: expected > 0 (set --max_steps)")
    if not (0 <= warmup <= 1 and 0 <= constant <= 1 and warmup + constant <= 1) or degree <= 0:
        raise ConfigError(f"LR schedule {kind}: warmup_proportion {warmup}, constant_proportion {constant}, degree "
                          f"{degree}: expected proportions in [0, 1] summing to <= 1 and degree > 0")
    if kind == "nvidia_poly" and constant:
        raise ConfigError(f"--lr_schedule nvidia_poly with --constant_proportion {constant}: NVIDIA's "
                          "PolyWarmUpScheduler has no constant phase (use habana_poly)")
    if kind == "habana_poly" and warmup + constant >= 1:
        raise ConfigError(f"--lr_schedule habana_poly: warmup {warmup} + constant {constant} leave no decay phase "
                          "(Habana's formula divides by 1 - warmup - constant)")


def nvidia_poly_factor(step: int, total_steps: int, warmup: float, degree: float = 0.5) -> float:
    """NVIDIA's PolyWarmUpScheduler multiplier for 0-based update `step` (the same arithmetic, so values agree to
    the last bit or two)."""
    if step >= total_steps:
        return 0.0
    progress = (step + 1) / total_steps
    if progress < warmup:
        return progress / warmup
    return (1.0 - progress) ** degree


def habana_poly_factor(step: int, total_steps: int, warmup: float, constant: float = 0.0,
                       degree: float = 1.0) -> float:
    """Habana's PolyWarmUpScheduler multiplier for 0-based update `step` (run under ZeRO as the 1.5B script runs)."""
    if step >= total_steps:
        return 0.0
    progress = (step + 1) / total_steps
    if progress < warmup:
        return progress / warmup
    if progress < warmup + constant:
        return 1.0
    return ((1.0 - progress) / (1.0 - warmup - constant)) ** degree


def ref_schedule_factor(kind: str, total_steps: int, warmup_proportion: float, constant_proportion: float = 0.0,
                        degree: float = 1.0) -> Callable[[int], float]:
    """0-based step -> LR multiplier for a kind in REF_KINDS; bad settings fail here, before any rank builds. The
    warm-up is a proportion of the steps, as both references take it (not rounded to a step count)."""
    _check(kind, total_steps, warmup_proportion, constant_proportion, degree)
    if kind == "nvidia_poly":
        return lambda step: nvidia_poly_factor(step, total_steps, warmup_proportion, degree)
    return lambda step: habana_poly_factor(step, total_steps, warmup_proportion, constant_proportion, degree)


__all__ = ["REF_KINDS", "nvidia_poly_factor", "habana_poly_factor", "ref_schedule_factor"]
