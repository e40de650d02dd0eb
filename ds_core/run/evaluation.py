"""Evaluation for the loop, for every model: what one evaluation is (EvalTask: a name and fn(engine, step) -> dict)
and when the loop runs which (Evaluation: during training, after it, Trainer-style results files)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

EvalFn = Callable[[Any, int], dict]


@dataclass(frozen=True)
class EvalTask:
    """One evaluation: `name` keys its results (and Trainer-style <name>_results.json when the Evaluation saves
    them); fn(engine, step) -> dict is collective."""

    name: str
    fn: EvalFn


@dataclass
class Evaluation:
    """When and what to evaluate, for every model.

    during: evaluated every `every` optimizer steps and once at the end of training (unless the run stopped early,
        or the last step was an `every` step); its results become metrics.jsonl "eval" records. Without training
        (an eval-only run) it is evaluated once.
    after: evaluated once after training (or instead of it), e.g. a test split (predict).
    save_results: write each task's last results as transformers' Trainer does (<name>_results.json and
        all_results.json in run_dir, ds_core.outputs.results.save_metrics).
    close: releases what the tasks hold (prefetch threads of eval data sources)."""

    during: EvalTask | None = None
    after: Sequence[EvalTask] = ()
    every: int = 0
    save_results: bool = False
    close: Callable[[], None] | None = None
    results: dict[str, dict] = field(default_factory=dict)  # the last results of each task, by name

    def due(self, step: int) -> bool:
        return self.during is not None and bool(self.every) and step % self.every == 0

    def at_end(self, step: int, stopped: bool) -> bool:
        return self.during is not None and not stopped and not self.due(step)

    def run(self, task: EvalTask, engine: Any, step: int) -> dict:
        logs = task.fn(engine, step)
        if logs:
            self.results[task.name] = logs
        return logs


__all__ = ["EvalFn", "EvalTask", "Evaluation"]
