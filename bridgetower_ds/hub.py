"""Hugging Face Hub names, resolved from the local caches only: nothing is downloaded during a run.

`--dataset_name jmhessel/newyorker_caption_contest --dataset_config_name matching` (the published command) loads the
dataset from the local datasets cache (HF_DATASETS_CACHE, default ~/.cache/huggingface/datasets) in offline mode, the
way `datasets.load_dataset` finds it there after one online call; `--model_name_or_path BridgeTower/...` resolves to
the snapshot in the local hub cache (HF_HUB_CACHE). When the cache lacks it, the error says what to run where there is
internet. Training clusters often have none, and a run that starts downloading gigabytes on every rank at once is
worse than one that stops and says so.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ds_core.errors import InputNotFound

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _offline() -> None:
    # datasets and huggingface_hub read these variables when they are imported; set the modules' constants too in
    # case they already are (transformers imports huggingface_hub).
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    for mod, attr in (("datasets.config", "HF_HUB_OFFLINE"), ("huggingface_hub.constants", "HF_HUB_OFFLINE")):
        if mod in sys.modules:
            setattr(sys.modules[mod], attr, True)


def save_dataset_hint(name: str, config: str) -> str:
    cfg = f", {config!r}" if config else ""
    return (f"on a machine with internet run `python -c \"import datasets; datasets.load_dataset({name!r}{cfg})\"` "
            f"and copy its datasets cache (HF_DATASETS_CACHE, default ~/.cache/huggingface/datasets) here, or run "
            f"`python -c \"import datasets; datasets.load_dataset({name!r}{cfg}).save_to_disk('DIR')\"` and pass "
            f"--dataset_path DIR")


def load_cached_dataset(name: str, config: str = "", cache_dir: str = ""):
    """The DatasetDict of hub dataset `name` (configuration `config`) from the local datasets cache, offline."""
    _offline()
    import datasets

    where = cache_dir or datasets.config.HF_DATASETS_CACHE
    try:
        obj = datasets.load_dataset(name, config or None, cache_dir=cache_dir or None)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        raise InputNotFound(f"--dataset_name {name} --dataset_config_name {config or '(none)'}: not in the local "
                                f"datasets cache {where} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                                + save_dataset_hint(name, config)) from None
    if not isinstance(obj, datasets.DatasetDict):
        obj = datasets.DatasetDict({"train": obj})
    return obj


def resolve_pretrained(name_or_path: str, flag: str = "--model_name_or_path", revision: str | None = None) -> str:
    """A local directory as given, or the local hub-cache snapshot of a hub id such as BridgeTower/bridgetower-large-
    itm-mlm-itc (what from_pretrained would download); the error says how to fetch it."""
    if not name_or_path or Path(name_or_path).expanduser().exists() or not HUB_ID.match(name_or_path):
        return name_or_path
    _offline()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name_or_path, local_files_only=True, revision=revision or None)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise InputNotFound(
            f"{flag} {name_or_path}: no such directory and not in the local hub cache ({type(e).__name__}); on a "
            f"machine with internet run `hf download {name_or_path} --local-dir DIR` (or without --local-dir to fill "
            f"the hub cache, HF_HUB_CACHE) and copy it here, then pass {flag} DIR") from None


def check_model_dir(path: str) -> None:
    """Before any rank builds a model: a --model_name_or_path (resolved to a local directory) holds a config.json,
    so that a mistyped path is one line from rank 0, not a traceback per rank from the model's loader."""
    if path and not (Path(path).expanduser() / "config.json").is_file():
        where = "no such directory" if not Path(path).expanduser().exists() else "no config.json there"
        raise InputNotFound(f"--model_name_or_path {path}: {where} (expected a local directory holding a saved "
                            "BridgeTower, e.g. the Large ITM/MLM/ITC checkpoint, or a hub id in the local hub cache)")

