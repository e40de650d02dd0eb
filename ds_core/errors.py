"""The error every bad setting raises, in a module of its own so that every room can raise it without importing the
settings (ds_core.config imports the schedule, device and rank rooms)."""


class ConfigError(ValueError):
    """A config problem; the message names the file, the key and what was expected."""


class InputNotFound(ConfigError, FileNotFoundError):
    """A file, directory or cache entry the user named is not there; the message names it and, where it can, how to
    get it. A FileNotFoundError too, for callers that catch that."""
