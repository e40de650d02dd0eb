"""`--report_to`: transformers' Trainer names for where a run's numbers also go, turned into DeepSpeed's monitor
sections (DeepSpeed's MonitorMaster then receives what ds_core.outputs.metrics reports). One setting for every model:
bert_ref and bridgetower_ds both take it."""
from __future__ import annotations

from pathlib import Path

from ds_core.errors import ConfigError

# --report_to value -> DeepSpeed monitor section
MONITORS = {"tensorboard": "tensorboard", "csv": "csv_monitor", "wandb": "wandb", "comet": "comet"}
# transformers' Trainer names of the same backends (its `--report_to comet_ml`)
ALIASES = {"comet_ml": "comet"}
# the package DeepSpeed's monitor of each backend imports inside deepspeed.initialize (tensorboard: through
# torch.utils.tensorboard); csv needs none
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
REPORT_TO_HELP = ("tensorboard | csv | wandb | comet | all | none (comma-separated for several): DeepSpeed's monitor, "
                  "writing under the run directory's <name>/ (a monitor section in the DeepSpeed JSON wins); all: "
                  "every installed one, as transformers' Trainer")


def installed_backends() -> tuple[list[str], list[str]]:
    """(the backends of --report_to all, the installed Trainer integrations DeepSpeed has no monitor for): Trainer's
    "all" is transformers.integrations.get_available_reporting_integrations(), every installed one."""
    from transformers.integrations import get_available_reporting_integrations

    found = get_available_reporting_integrations()
    ours = [ALIASES.get(n, n) for n in found if ALIASES.get(n, n) in MONITORS]
    return ours, [n for n in found if ALIASES.get(n, n) not in MONITORS]


def report_to_names(report_to: str) -> list[str]:
    """The monitors of a --report_to value ([] for none), each checked: a known name whose package is installed
    (DeepSpeed imports it inside deepspeed.initialize, where a missing one would end every rank). "all": every
    installed backend DeepSpeed has a monitor for."""
    names = [ALIASES.get(n.strip(), n.strip()) for n in report_to.replace(" ", ",").split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return installed_backends()[0]
    import importlib.util

    for name in names:
        if name not in MONITORS:
            raise ConfigError(f"--report_to {name!r}: expected one of {', '.join(MONITORS)}, all, none")
        package = PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--report_to {name}: the {package} package is not installed (DeepSpeed's {name} monitor "
                              f"imports it); install it or leave {name} out")
    return names


def report_to_notices(report_to: str) -> list[str]:
    """One line for --report_to all naming what it reports to, and the installed backends it cannot."""
    if [n.strip() for n in report_to.replace(" ", ",").split(",") if n.strip()] != ["all"]:
        return []
    ours, other = installed_backends()
    line = f"--report_to all: {', '.join(ours) or 'nothing (no backend installed)'}"
    return [line + (f"; installed but without a DeepSpeed monitor: {', '.join(other)}" if other else "")]


def apply_report_to(report_to: str, ds_config: dict, run_dir: str, job_name: str) -> list[str]:
    """Turn on DeepSpeed's monitors for --report_to in a resolved DeepSpeed config, writing under run_dir/<monitor>/;
    returns one-line notices (a monitor section of the JSON that is kept as it is)."""
    notes = report_to_notices(report_to)
    for name in report_to_names(report_to):
        section = MONITORS[name]
        if ds_config.get(section, {}).get("enabled"):
            notes.append(f"--report_to {name}: the DeepSpeed config's {section!r} section is used as it is")
            continue
        # tensorboard / csv write files under run_dir; wandb / comet report to their services (their own config)
        ds_config[section] = ({"enabled": True} if name in ("wandb", "comet") else
                              {"enabled": True, "output_path": str(Path(run_dir) / name), "job_name": job_name})
    return notes


__all__ = ["MONITORS", "REPORT_TO_HELP", "report_to_names", "report_to_notices", "installed_backends",
           "apply_report_to"]
