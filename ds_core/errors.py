"""The error every bad setting raises, in a module of its own so that every room can raise it without importing the
settings (ds_core.config imports the schedule, device and rank rooms); and the verdict that ends a run (divergence)."""


class ConfigError(ValueError):
    """A config problem; the message names the file, the key and what was expected."""


class InputNotFound(ConfigError, FileNotFoundError):
    """A file, directory or cache entry the user named is not there; the message names it and, where it can, how to
    get it. A FileNotFoundError too, for callers that catch that."""


class RunVerdict(RuntimeError):
    """A verdict that ends the run, the same on every rank (a diverged run: ds_core.run.divergence.TrainingDiverged):
    said in one line, once per job, and the process exits with `status` (ds_core.rank.process_end.run_main), not a
    traceback per rank."""

    status = 1
