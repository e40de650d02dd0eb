"""The callbacks through which a model package adds its own behaviour at the loop's named points (transformers'
TrainerCallback style), and the one the loop adds itself for --profile_steps (ProfileSteps)."""
from __future__ import annotations

from pathlib import Path


class Callback:
    """A model's own behaviour at the loop's named points (transformers' TrainerCallback style); every hook does
    nothing unless overridden. Hooks run on every rank unless their docstring says otherwise."""

    def on_step_end(self, step: int, logs: dict) -> None:
        """After optimizer step `step` (called at the step, on every rank), before its metrics record is written: add
        keys to `logs` (in place). The step's device values (loss, the step function's logs) are read later and
        are not in `logs` here."""

    def on_evaluate(self, step: int, logs: dict) -> None:
        """After an evaluation at `step`, before its eval record is written: add keys to `logs` (a copy of the
        evaluation's results, in place)."""

    def on_save(self, checkpoint_dir: Path, step: int) -> None:
        """Rank 0, while checkpoint `step` is saved, after the step's metrics record is durable and before COMPLETE:
        files of the model's own beside the checkpoint's (e.g. transformers' trainer_state.json)."""


class ProfileSteps(Callback):
    """TrainConfig.profile_steps: torch.profiler (ds_core.outputs.profile.StepProfile) over the last N warm-up steps,
    ending one step before the throughput window opens (turning the profiler off must not land in a timed step); the
    Trainer puts `summary` into the run's summary record under "profile"."""

    def __init__(self, steps: int, warmup: int):
        from ds_core.outputs.profile import StepProfile

        self.prof = StepProfile(warmup - 1 - steps, steps)

    @property
    def summary(self) -> dict | None:
        return self.prof.summary

    def on_step_end(self, step: int, logs: dict) -> None:
        self.prof.step_end()


__all__ = ["Callback", "ProfileSteps"]
