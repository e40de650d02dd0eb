"""The one fault-injection hook of the test drivers (tests/tiny_train.py): what to break, and when, in a run the
tests start. A test writes `dist_env(**faults.env(nan_at_step=5))`; the driver reads `faults.read()` once at start.
The hook is one environment variable, TINY_FAULTS, holding a JSON object of the fields below (the ranks a launcher
starts inherit it); an unknown name or a value of the wrong type is refused, so a test cannot silently inject
nothing. Steps count optimizer steps from 1; 0 or "" is off."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

VAR = "TINY_FAULTS"


@dataclass(frozen=True)
class Faults:
    # -- faults
    nan_at_step: int = 0  # the loss is NaN at this step
    nan_grad_steps: str = ""  # the gradients (not the loss) are NaN at these steps: "3,7-" is step 3 and 7 onwards
    kill_in_save: int = 0  # rank 0 kills -9 itself inside this step's save: DeepSpeed's files written, not complete
    kill_after_complete: int = 0  # rank 0 kills -9 itself right after this step's checkpoint is complete
    disk_full_at: int = 0  # every rank's checkpoint writer fails with ENOSPC at this step
    signal_at_step: int = 0  # signal_rank sends itself `signal` during this step
    signal_rank: int = 0
    signal: str = "SIGTERM"  # SIGTERM or SIGUSR1
    slow_rank: int = -1  # this rank sleeps slow_s in each forward: a straggler the others wait for
    slow_s: float = 0.2
    # -- instruments and variants
    fake_clock: bool = False  # ds_core.outputs.metrics' clock moves 1.0 per micro step, 100.0 per save, 50.0 per eval
    eval: bool = False  # an eval hook
    stats: bool = False  # the data source reports per-rank summary statistics (rank r: bad_rows = r + 1)
    no_resize: bool = False  # a data source without load_state_dicts (it cannot resize)
    sample_log: str = ""  # DIR: each rank appends the sample indices it trains on to DIR/samples_rank{r}.txt
    dropout_dump: str = ""  # DIR: each rank saves its first dropout mask (embeddings) to DIR/mask_rank{r}.pt
    dump_opt: str = ""  # FILE: the full fp32 master weights and Adam moments after training (rank 0 writes)
    dump_opt_at_save: str = ""  # FILE: the same right after each checkpoint save (the last save's stays)
    dump_opt_on_resume: str = ""  # FILE: the same right after a resume loaded the checkpoint
    lazy_marks: str = ""  # FILE: where the loop would cut Gaudi's lazy-mode graph (tiny_train.record_lazy_marks)


_TYPES = {f.name: f.type for f in fields(Faults)}


def _check(values: dict, where: str) -> dict:
    unknown = sorted(set(values) - set(_TYPES))
    if unknown:
        raise ValueError(f"{where}: unknown fault {', '.join(unknown)} (known: {', '.join(_TYPES)})")
    kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
    for name, value in values.items():
        kind = kinds[_TYPES[name]]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}: fault {name} must be {_TYPES[name]}, got {value!r}")
    return values


def env(**values) -> dict:
    """The environment entry that injects these faults: {"TINY_FAULTS": "<json>"}."""
    return {VAR: json.dumps(_check({k: str(v) if hasattr(v, "__fspath__") else v for k, v in values.items()},
                                   "faults.env"))}


def read(environ=os.environ) -> Faults:
    """The faults this process was started with (none without TINY_FAULTS)."""
    text = environ.get(VAR, "")
    if not text:
        return Faults()
    values = json.loads(text)
    if not isinstance(values, dict):
        raise ValueError(f"{VAR}: expected a JSON object of faults, got {text!r}")
    return Faults(**_check(values, VAR))

