"""`--report_to`: transformers' Trainer names for where a run's numbers also go, turned into DeepSpeed's monitor
sections (DeepSpeed's MonitorMaster then receives what ds_core.outputs.metrics reports). One setting for every model:
bert_ref and bridgetower_ds both take it."""
from __future__ import annotations

from pathlib import Path

from ds_core.errors import ConfigError

# --report_to value -> DeepSpeed monitor section
MONITORS = {"tensorboard": "tensorboard", "csv": "csv_monitor", "wandb": "wandb", "comet": "comet"}
REPORT_TO_HELP = ("tensorboard | csv | wandb | comet | none (comma-separated for several): DeepSpeed's monitor, "
                  "writing under the run directory's <name>/ (a monitor section in the DeepSpeed JSON wins)")


def report_to_names(report_to: str) -> list[str]:
    """The monitors of a --report_to value ([] for none), each checked."""
    names = [n.strip() for n in report_to.replace(" ", ",").split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return ["tensorboard"]  # Trainer's "all" = every installed integration; tensorboard is the one shipped here
    for name in names:
        if name not in MONITORS:
            raise ConfigError(f"--report_to {name!r}: expected one of {', '.join(MONITORS)}, none")
    return names


def apply_report_to(report_to: str, ds_config: dict, run_dir: str, job_name: str) -> list[str]:
    """Turn on DeepSpeed's monitors for --report_to in a resolved DeepSpeed config, writing under run_dir/<monitor>/;
    returns one-line notices (a monitor section of the JSON that is kept as it is)."""
    notes = []
    for name in report_to_names(report_to):
        section = MONITORS[name]
        if ds_config.get(section, {}).get("enabled"):
            notes.append(f"--report_to {name}: the DeepSpeed config's {section!r} section is used as it is")
            continue
        # tensorboard / csv write files under run_dir; wandb / comet report to their services (their own config)
        ds_config[section] = ({"enabled": True} if name in ("wandb", "comet") else
                              {"enabled": True, "output_path": str(Path(run_dir) / name), "job_name": job_name})
    return notes


__all__ = ["MONITORS", "REPORT_TO_HELP", "report_to_names", "apply_report_to"]
