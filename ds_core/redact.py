"""Secrets by name: the settings, variables and flags whose names say they hold a secret are never written or printed.

A name is secret-looking when one of its words (split at anything but letters and digits) ends in TOKEN or holds
SECRET or PASSWORD (or is PASSWD), or when the whole name ends in _KEY: HF_TOKEN, hub_token, --token,
AWS_SECRET_ACCESS_KEY, WANDB_API_KEY, DB_PASSWORD. A word that only begins with TOKEN is not one (tokenizer_name,
TOKENIZERS_PARALLELISM, max_tokens are settings, not secrets); AWS_ACCESS_KEY_ID, an identifier, does not end in _KEY.

Where it applies: run_config.json and the run_dir lock (ds_core.config.save_run_config, ds_core.rank.run_lock),
launch.run's --dry_run output, the launcher's log lines (launch.ds_runner), and what launch.env write reports. A
redacted value is written as REDACTED; reading a run_config.json back (--config RUN_DIR) leaves such a setting at its
default rather than taking the placeholder for its value.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

REDACTED = "<redacted>"
_WORD = re.compile(r"[A-Za-z0-9]+")


def is_secret(name: str) -> bool:
    """Whether a setting / variable / flag name is secret-looking (module docstring); leading dashes ignored."""
    upper = name.lstrip("-").upper()
    if upper == "KEY" or upper.endswith("_KEY"):
        return True
    return any(w.endswith("TOKEN") or "SECRET" in w or "PASSWORD" in w or w == "PASSWD" for w in _WORD.findall(upper))


def secret_names(names: Iterable[str]) -> list[str]:
    """The secret-looking names among `names`, sorted."""
    return sorted(n for n in names if is_secret(n))


def _held(value: Any) -> bool:
    return value not in (None, "", [], {})  # an empty setting holds nothing to hide


def redact_mapping(obj: Any) -> Any:
    """obj with the value of every secret-looking key (at any depth of dicts and lists) replaced by REDACTED."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if isinstance(k, str) and is_secret(k) and _held(v) else redact_mapping(v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_mapping(v) for v in obj)
    return obj


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line with the values of secret-looking flags (`--token X`, `--token=X`) and assignments
    (`HF_TOKEN=X`, mpirun's `-x HF_TOKEN=X` and `-genv HF_TOKEN X`) replaced by REDACTED."""
    out = list(argv)
    for i, word in enumerate(out):
        name, eq, value = word.partition("=")
        if eq:
            if value and is_secret(name):
                out[i] = f"{name}={REDACTED}"
        elif (i + 1 < len(out) and is_secret(word) and not out[i + 1].startswith("--")
              and (word.startswith("--") or (i > 0 and out[i - 1] == "-genv"))):
            out[i + 1] = REDACTED
    return out


def redact_text(text: str, values: Iterable[str]) -> str:
    """text with every occurrence of each secret value (4 characters or more: a shorter one would blank out
    ordinary words) replaced by REDACTED."""
    for v in sorted({v for v in values if len(v) >= 4}, key=len, reverse=True):
        text = text.replace(v, REDACTED)
    return text


def dropped_placeholders(data: Mapping[str, Any]) -> dict[str, Any]:
    """A settings mapping without the secret-looking keys whose value is REDACTED (a run_config.json read back)."""
    return {k: v for k, v in data.items() if not (is_secret(k) and v == REDACTED)}


__all__ = ["REDACTED", "is_secret", "secret_names", "redact_mapping", "redact_argv", "redact_text",
           "dropped_placeholders"]
