"""A pytest plugin for DeepSpeed's own unit tests (tools/ds_unit_tests.py runs them): the toolkit's changes inside
DeepSpeed applied as a run applies them, in every process of the session, and the CPU's answer to the tests' bf16
check.

The changes come from ds_core.compat.changes, one call per stage, as a training run makes them:
changes.install_initialize_hooks() applies `process_start` and makes DeepSpeed's own deepspeed.initialize and
DeepSpeedEngine.load_checkpoint apply `before_initialize`, `after_initialize` and `checkpoint_load` around
themselves; `launcher` is applied in the pytest process, where DeepSpeed's launcher tests build its runners.
The switch DS_TOOLKIT_CHANGES decides what they apply: with "off" the same calls apply nothing, and the session is
DeepSpeed's own path.

DeepSpeed's distributed tests run each rank in a process forked from multiprocessing's fork server, which imports the
test module afresh and never sees this pytest process's patches: the fork server preloads this module, whose import
installs the same, so every rank starts with them as a run's rank does. Every stage's result (apply_stage's
{name: state}) is appended to DS_UNIT_RECORD/<pid>.jsonl, so the driver can tell a change that ran from one that
never did, and so are the selected tests the suite's own pytest.ini deselects.

The tests' bf16 check (unit/util.py bf16_required_version_check) asks for CUDA and NCCL versions, so on the CPU
accelerator every bf16 test would skip; DeepSpeed's CPU accelerator supports bf16 (its is_bf16_supported), and the
check gets that answer here: the function is replaced in unit.util before any test module imports it by name.
"""
from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from typing import Any, Callable

RECORD = "DS_UNIT_RECORD"
_installed = False


def record(line: dict) -> None:
    """One JSON line of this process: a stage's {"stage", "states"}, or the tests pytest deselected."""
    folder = os.environ.get(RECORD)
    if folder:
        with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def recorded(own: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """ds_core.compat.changes.apply_stage, each result also recorded (each outcome as a run records it: "on", "off:
    why", "not needed: why"). The stage hooks call the module's apply_stage by name, so this sees every stage they
    apply; the toolkit's own function, DeepSpeed untouched."""
    def apply_stage(stage: str, **context: Any) -> dict[str, Any]:
        out = own(stage, **context)
        record({"stage": stage, "states": {name: str(outcome) for name, outcome in out.items()}})
        return out

    apply_stage.__wrapped__ = own
    return apply_stage


def bf16_on_cpu(original: Callable[..., bool]) -> Callable[..., bool]:
    """DeepSpeed's bf16 check with the CPU accelerator's answer (its is_bf16_supported); other devices: the check."""
    from deepspeed.accelerator import get_accelerator

    def bf16_required_version_check(accelerator_check=True):
        accel = get_accelerator()
        if accel.device_name() != "cpu":
            return original(accelerator_check)
        return accel.is_bf16_supported() if accelerator_check else True

    bf16_required_version_check.__wrapped__ = original
    return bf16_required_version_check


def install() -> None:
    """Once per process: the stages recorded, process_start applied, the engine stages hooked, the bf16 check
    answered, and the fork server told to do the same in every rank."""
    global _installed
    if _installed:
        return
    _installed = True
    from ds_core.compat import changes

    changes.apply_stage = recorded(changes.apply_stage)
    changes.install_initialize_hooks()  # process_start now; the engine stages around DeepSpeed's own calls
    try:
        import unit.util  # DeepSpeed's tests/unit: the session runs in tests/, which is on sys.path
    except ImportError:
        pass
    else:
        unit.util.bf16_required_version_check = bf16_on_cpu(unit.util.bf16_required_version_check)
    multiprocessing.set_forkserver_preload([__name__])


def pytest_configure(config):
    """The launcher stage in the pytest process only, as a run applies it in the launcher's process only: DeepSpeed's
    launcher tests build its runners here (pytest-forked's children inherit it), never in a rank."""
    from ds_core.compat import changes

    changes.apply_stage("launcher")


def pytest_deselected(items):
    """A selected test the suite's pytest.ini deselects (its markers) is recorded: the driver refuses a comparison
    of tests that never ran."""
    record({"deselected": [item.nodeid for item in items]})


def pytest_report_header(config):
    from ds_core.compat import changes

    return [changes.start_line()]


install()
