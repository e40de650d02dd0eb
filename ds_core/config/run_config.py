"""The file a run writes its resolved settings to (run_config.json) and --config's reading of it."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ds_core.config.accumulation import settle_grad_accum_dtype  # noqa: F401 - part of ds_core.config's API
from ds_core.errors import ConfigError
from ds_core.files import atomic_write_text
from ds_core.redact import redact_mapping

# The file a run writes its resolved settings to. Not config.json: BridgeTower's run_dir also receives the saved model,
# whose own config.json is the model's. OLD_RUN_CONFIG is what bert_ref runs wrote before; --config still reads it.
RUN_CONFIG = "run_config.json"
OLD_RUN_CONFIG = "config.json"


def config_file(given: str | os.PathLike) -> Path:
    """--config's file: the path itself, or for a run directory its run_config.json (config.json in a run directory
    written before the rename)."""
    path = Path(given)
    if not path.is_dir():
        return path
    for name in (RUN_CONFIG, OLD_RUN_CONFIG):
        if (path / name).is_file():
            return path / name
    raise ConfigError(f"--config {path}: a directory without {RUN_CONFIG} (or {OLD_RUN_CONFIG} of an older run); "
                      f"expected a settings JSON file or a run directory")


def save_run_config(run_dir: str | os.PathLike, *instances: Any, rank: int = 0) -> Path:
    """Write run_dir/run_config.json, sectioned by dataclass name (rank 0 only); it reads back with --config."""
    path = Path(run_dir) / RUN_CONFIG
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a secret-looking setting (--token) is written as ds_core.redact.REDACTED: never on disk
        data = redact_mapping({type(i).__name__: dataclasses.asdict(i) for i in instances})
        atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path
