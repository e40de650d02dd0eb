"""DeepSpeed JSON configs shipped as package data, and which of them a training module runs with when its command line
names none.

DEFAULT_JSON is that choice, per module: by `--recipe` (a published run names its JSON), else by `--preset` ('' is the
module's default preset). A preset without an entry has no JSON of its own and its run is refused without
`--deepspeed_config`. The model packages read their defaults from here (bert_ref.train, bridgetower_ds.train), and so
does `launch.run --dry_run`, which names the file a run will use without importing a model package; tests keep the
table equal to the presets and recipes. Free of imports: a launcher on a login node reads it.
"""
from __future__ import annotations

from typing import Sequence

_BERT_LARGE, _BERT_1P5B, _BERT_DEBUG = "bert_large_zero1_bf16.json", "bert_1p5b_zero1_bf16.json", \
    "bert_debug_zero1_bf16.json"
DEFAULT_JSON: dict[str, dict[str, dict[str, str]]] = {
    "bert_ref.train": {
        "preset": {"": _BERT_LARGE, "bert_large": _BERT_LARGE, "bert_1p5b": _BERT_1P5B, "bert_1p5b_habana": _BERT_1P5B,
                   "debug": _BERT_DEBUG, "debug_pre_ln": _BERT_DEBUG, "debug_habana": _BERT_DEBUG},
        "recipe": {"nvidia_large_p1": _BERT_LARGE, "nvidia_large_p2": _BERT_LARGE, "habana_1p5b_8x": _BERT_1P5B,
                   "habana_1p5b_8n": _BERT_1P5B, "habana_1p5b_16n": _BERT_1P5B},
    },
    "bridgetower_ds.train": {"preset": {"": "bridgetower_zero1_bf16.json"}},
}


def preset_json(module: str, preset: str) -> str:
    """The JSON `module` runs `--preset preset` with ('' when the preset has none of its own); every preset of a
    module without per-preset entries takes the module's one default."""
    table = DEFAULT_JSON.get(module, {}).get("preset", {})
    if set(table) == {""}:
        return table[""]
    return table.get(preset, "")


def _last_value(args: Sequence[str], name: str) -> str | None:
    """The last `--name X` / `--name=X` of an argument list (argparse keeps the last), None when absent."""
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args) and not args[i + 1].startswith("-"):  # not a bare switch (`--deepspeed`)
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def json_for_args(module: str, args: Sequence[str]) -> tuple[str, str]:
    """(file, why) of the DeepSpeed JSON a run of `module` with `args` uses: the one named by `--deepspeed_config` (or
    its alias `--deepspeed`), else the recipe's, else the preset's. file is '' where the module names none (a preset
    without its own JSON: the run refuses) or `module` is not in DEFAULT_JSON."""
    given = _last_value(args, "--deepspeed_config") or _last_value(args, "--deepspeed")
    if given:
        return given, "--deepspeed_config"
    if module not in DEFAULT_JSON:
        return "", f"{module} is not a module of this toolkit: it chooses its own"
    recipe = _last_value(args, "--recipe")
    if recipe:
        chosen = DEFAULT_JSON[module].get("recipe", {}).get(recipe, "")
        return chosen, f"--recipe {recipe}" if chosen else f"--recipe {recipe}: not a recipe of {module}"
    preset = _last_value(args, "--preset") or ""
    table = DEFAULT_JSON[module].get("preset", {})
    if preset not in table and set(table) != {""}:
        return "", f"--preset {preset}: not a preset of {module} (the module says which are)"
    chosen = preset_json(module, preset)
    return chosen, (f"--preset {preset}" if preset else f"{module}'s default preset") if chosen else \
        f"--preset {preset} has no DeepSpeed JSON of its own: give --deepspeed_config"
