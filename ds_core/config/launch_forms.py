"""Command lines of the launchers users come with, read as their tools mean them: DeepSpeed's own `--deepspeed`
switch (deepspeed.add_config_arguments: "enable DeepSpeed", beside `--deepspeed_config X`), and what `accelerate
launch` hands each rank of a DeepSpeed run in its environment (its DeepSpeed plugin's JSON, its mixed precision).

torchrun and DeepSpeed's launcher need nothing here: the rank reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* as both
set them (ds_core.rank.dist). `accelerate launch` runs torchrun underneath (one machine) with those variables too,
plus ACCELERATE_USE_DEEPSPEED and its plugin's settings, which accelerate's own Accelerator would read in the script;
here they are turned into this toolkit's flags, or refused in one line saying what to run instead.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ds_core.errors import ConfigError


def drop_deepspeed_switch(argv: Sequence[str]) -> list[str]:
    """argv without DeepSpeed's bare `--deepspeed` switch (no value after it: the end, or another flag): DeepSpeed is
    always on here. `--deepspeed X.json` (transformers' TrainingArguments.deepspeed) stays: it names the JSON."""
    out = []
    for i, a in enumerate(argv):
        if a == "--deepspeed" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            continue
        out.append(a)
    return out


def _given(argv: Sequence[str], *flags: str) -> str | None:
    """The last value of any of `flags` in argv (`--f X` or `--f=X`; a bare boolean flag gives "true"), else None."""
    found = None
    for i, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if name in flags:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            found = value if eq else (nxt if nxt is not None and not nxt.startswith("-") else "true")
    return found


# accelerate's mixed precision -> this toolkit's --precision
_PRECISION = {"bf16": "bf16"}


def from_accelerate(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """argv with what `accelerate launch --use_deepspeed` set for this rank: its plugin's deepspeed_config_file as
    --deepspeed_config (unless the same file is given), its --mixed_precision bf16 as --precision bf16 (unless
    --precision / --bf16 is given). Refused, naming what to run instead: a plugin without a JSON file (its zero_stage,
    offload and accumulation settings have no JSON to be read from), fp16 / fp8, a different JSON given too."""
    argv = list(argv)
    if str(env.get("ACCELERATE_USE_DEEPSPEED", "")).lower() != "true":
        return argv
    instead = ("run `torchrun --nproc_per_node N -m <module> --deepspeed_config X.json ...` (or `deepspeed --num_gpus "
               "N --module <module> ...`) instead")
    ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if not ds_file or ds_file.lower() == "none":
        raise ConfigError("accelerate launch --use_deepspeed without a deepspeed_config_file: its DeepSpeed plugin's "
                          "settings (zero_stage, offload, gradient accumulation) are not read here; give accelerate a "
                          f"--deepspeed_config_file, or {instead}")
    given = _given(argv, "--deepspeed_config", "--deepspeed")
    if given is None:
        argv += ["--deepspeed_config", ds_file]
    elif given != ds_file:
        raise ConfigError(f"accelerate launch's deepspeed_config_file {ds_file} and --deepspeed_config {given}: two "
                          f"DeepSpeed JSONs; give one")
    mixed = str(env.get("ACCELERATE_MIXED_PRECISION", "no")).lower()
    if mixed in ("fp16", "fp8"):
        raise ConfigError(f"accelerate launch --mixed_precision {mixed}: refused; training here is bf16 or fp32 "
                          f"(--mixed_precision bf16, or --precision); or {instead}")
    wanted = _PRECISION.get(mixed)
    given_precision = _given(argv, "--precision") or ("bf16" if _given(argv, "--bf16") not in (None, "false", "False",
                                                                                              "0", "no") else None)
    if wanted and given_precision is None:
        argv += ["--precision", wanted]
    elif wanted and given_precision != wanted:
        raise ConfigError(f"accelerate launch --mixed_precision {mixed} and --precision {given_precision}: give one")
    return argv


__all__ = ["drop_deepspeed_switch", "from_accelerate"]
