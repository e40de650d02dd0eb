"""The study file (TOML) and the cells it expands to: one training run per combination of axis values and repeat.

Schema (every key of [study] is optional except `module`; unknown keys are refused with a did-you-mean):

    [study]
    name = "bridgetower_dataloading"       # default: the file's stem; the study directory is runs/studies/<name>
    module = "bridgetower_ds.train"        # run on every rank as `python -m MODULE` (or a script path ending in .py)
    preset = "debug"                       # passed as --preset
    deepspeed_config = "bridgetower_zero1_bf16.json"   # path, or a file name in ds_configs/; patched per cell
    steps = 12                             # --max_steps
    warmup_steps = 3                       # --throughput_warmup_steps (excluded from samples/s)
    args = ["--do_train", "--dataset_path", "data/captions.jsonl"]   # further flags of the module, as given
    launcher = "local"                     # local: deepspeed --num_gpus; simulated_nodes: N `--no_ssh --node_rank`
                                           # launchers on loopback; hostfile: python -m launch.run, first N hosts;
                                           # emulated_fabric: one network namespace per node on a tc-shaped
                                           # bridge (ds_tools/study/netns.py; root), links from [fabrics]
    ranks_per_node = 2                     # local ranks per (simulated) node
    hostfile = ""                          # launcher = "hostfile": the cluster's hostfile
    launch_args = []                       # launcher = "hostfile": extra flags of launch.run (--profile efa, ...)
    timeout_s = 900                        # per cell; the cell's process groups are killed after it
    repeats = 1                            # runs per combination to start with (2 or more for an interval)
    precision = 0.05                       # then more runs, round by round, of each combination whose throughput's
                                           # 95 % interval is wider than +-5 % of its mean (0: just `repeats`) ...
    max_repeats = 8                        # ... up to this many runs per combination (default 8 with a precision)
    budget_s = 1800                        # ... and no new round after this many seconds of measuring
    master_port = 0                        # first cell's master port; 0: derived from the study directory
    baseline = { allreduce = "buckets" }   # the cell speedups are measured against (default: first value per axis)
    comms_logger = false                   # DeepSpeed's communication logger in every cell's JSON
    single_bucket_elements = 2000000000    # allreduce = "single": reduce_bucket_size (>= gradient elements)
    prepare = ["python", "studies/make_caption_set.py", "data/bt_study"]  # run once before the cells when
    prepare_creates = "data/bt_study/captions.jsonl"                         # this path does not exist yet

    [axes]                                 # each axis: a list of values; the cells are their cartesian product
    dataloader_num_workers = [0, 1, 2]     # ordinary axis: passed as `--dataloader_num_workers VALUE`
    allreduce = ["buckets", "single"]      # special: patches the DeepSpeed JSON (see ALLREDUCE)
    # nodes (launcher), zero_stage and micro_batch_size (DeepSpeed JSON) are special too

    [flags]                                # axis -> the module's flag, where it is not --<axis>
    workers = "--dataloader_num_workers"

    [env]                                  # extra environment of every rank
    OMP_NUM_THREADS = "1"

    [fabrics]                              # launcher = "emulated_fabric": the links; axis `fabric` picks one
    slow = { mbit = 100, delay_ms = 1.0 }  # tbf bandwidth, netem delay (where the kernel has sch_netem)
"""
from __future__ import annotations

import copy
import difflib
import itertools
import json
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9 / 3.10 (e.g. Gaudi images): the same parser as a package
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_core.config import read_ds_json, resolve_ds_path
from ds_core.errors import ConfigError

LAUNCHERS = ("local", "simulated_nodes", "hostfile", "emulated_fabric")
SPECIAL_AXES = ("nodes", "allreduce", "zero_stage", "micro_batch_size", "fabric")
ALLREDUCE_VALUES = ("buckets", "single")

# allreduce = "single": the fast_ddp equivalent (optimum-habana's fast_ddp packs every gradient into one flat buffer
# and all-reduces it once per optimizer step). For ZeRO-1/2, DeepSpeed's stage_1_and_2 optimizer flushes its
# gradient bucket whenever it would exceed reduce_bucket_size, and with contiguous_gradients it pre-allocates a buffer
# of reduce_bucket_size elements, so: no pre-allocated bucket, one bucket larger than every gradient, reduced at the
# accumulation boundary (no overlap with backward), as one all-reduce (no per-partition reduce_scatter). The flush
# then flattens every gradient into one contiguous tensor and all-reduces it (stage_1_and_2.allreduce_bucket).
# ZeRO-0 needs nothing: engine.allreduce_gradients already flattens all gradients into 5e8-element buffers
# (MEMORY_OPT_ALLREDUCE_SIZE, not configurable) and all-reduces each once per step.
SINGLE_ZERO = {"contiguous_gradients": False, "overlap_comm": False, "reduce_scatter": False}
DEFAULT_SINGLE_BUCKET = 2_000_000_000
DEFAULT_MAX_REPEATS = 8

# A cell's run directory is cells/<axis>-<value>__...; the study's is runs/studies/<name>: names and values that are
# not one plain path component (`../x`, `a/b`, a space, a shell character) would put a run elsewhere or reach a
# shell under launcher = "hostfile", so they are refused when the file is read.
SAFE_COMPONENT = re.compile(r"[A-Za-z0-9_.+,=@-]+")
SAFE_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STUDY_KEYS = {"name", "module", "preset", "deepspeed_config", "steps", "warmup_steps", "args", "launcher",
               "ranks_per_node", "hostfile", "launch_args", "timeout_s", "repeats", "baseline", "comms_logger",
               "single_bucket_elements", "prepare", "prepare_creates", "precision", "max_repeats", "budget_s",
               "master_port"}
_TOP_KEYS = {"study", "axes", "flags", "env", "fabrics"}
_FABRIC_KEYS = {"mbit", "delay_ms"}


class StudyError(ValueError):
    """A study file that cannot be run; the message names the file, the key and what was expected."""


@dataclass
class Cell:
    index: int
    values: dict           # axis -> value, in [axes] order
    repeat: int

    @property
    def key(self) -> str:
        """Directory name: `axis-value__axis-value__rep0` (stable, readable, one per cell)."""
        parts = [f"{k}-{v}" for k, v in self.values.items()]
        return "__".join([*parts, f"rep{self.repeat}"]) if parts else f"rep{self.repeat}"

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values.items()) + f" (repeat {self.repeat})"


@dataclass
class Study:
    path: Path
    name: str
    module: str
    preset: str = ""
    deepspeed_config: str = ""
    steps: int = 10
    warmup_steps: int = 3
    args: list = field(default_factory=list)
    launcher: str = "local"
    ranks_per_node: int = 1
    hostfile: str = ""
    launch_args: list = field(default_factory=list)
    timeout_s: float = 900.0
    repeats: int = 1
    baseline: dict = field(default_factory=dict)
    comms_logger: bool = False
    single_bucket_elements: int = DEFAULT_SINGLE_BUCKET
    prepare: list = field(default_factory=list)
    prepare_creates: str = ""
    precision: float = 0.0     # target 95 % half-width / mean of each cell's throughput; 0: `repeats` runs only
    max_repeats: int = 0       # set by load_study: repeats, or DEFAULT_MAX_REPEATS with a precision
    budget_s: float = 1800.0   # no new measuring round starts after this many seconds
    master_port: int = 0       # 0: derived from the study directory (runner.planned_port)
    axes: dict = field(default_factory=dict)
    flags: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    fabrics: dict = field(default_factory=dict)   # launcher = "emulated_fabric": name -> {mbit, delay_ms}

    def fabric_of(self, cell: Cell) -> dict:
        """The emulated link of a cell (launcher = "emulated_fabric"): {"name", "mbit", "delay_ms"}."""
        name = str(cell.values.get("fabric", next(iter(self.fabrics), "")))
        return {"name": name, **self.fabrics[name]}

    # ----------------------------------------------------------------------------------------------- cells
    def combos(self) -> list[dict]:
        """Every combination of axis values, in [axes] order."""
        names = list(self.axes)
        return [dict(zip(names, c)) for c in (itertools.product(*(self.axes[n] for n in names)) if names else [()])]

    def cell(self, combo: int, repeat: int) -> Cell:
        """Repeat `repeat` of combination `combo`. Cells are numbered round by round (all combinations' repeat 0,
        then all repeat 1, ...): the order they are measured in, interleaved so that a machine's load falls on
        every combination alike."""
        combos = self.combos()
        return Cell(repeat * len(combos) + combo, combos[combo], repeat)

    def cells(self) -> list[Cell]:
        """The cells every study runs: `repeats` rounds of every combination (a precision may add rounds)."""
        return [self.cell(i, r) for r in range(self.repeats) for i in range(len(self.combos()))]

    def all_cells(self) -> list[Cell]:
        """Every cell a run may measure: `max_repeats` rounds."""
        return [self.cell(i, r) for r in range(self.max_repeats) for i in range(len(self.combos()))]

    def baseline_values(self) -> dict:
        return {n: self.baseline.get(n, vals[0]) for n, vals in self.axes.items() if n != "nodes"}

    def nodes_of(self, cell: Cell) -> int:
        return int(cell.values.get("nodes", 1))

    # --------------------------------------------------------------------------------------- DeepSpeed JSON
    def ds_config_for(self, cell: Cell) -> dict | None:
        """The cell's DeepSpeed JSON: the study's file patched by the special axes; None keeps the module's default."""
        patch = {k: v for k, v in cell.values.items() if k in ("allreduce", "zero_stage", "micro_batch_size")}
        if not self.deepspeed_config and not patch and not self.comms_logger:
            return None
        if not self.deepspeed_config:
            raise StudyError(f"{self.path}: [study] deepspeed_config is required when axes "
                             f"{sorted(patch) or ''} or comms_logger patch the DeepSpeed JSON")
        try:
            cfg = copy.deepcopy(read_ds_json(self.deepspeed_config))
        except ConfigError as e:
            raise StudyError(f"{self.path}: [study] deepspeed_config: {e}") from None
        zero = cfg.setdefault("zero_optimization", {})
        if "zero_stage" in patch:
            zero["stage"] = int(patch["zero_stage"])
        if "micro_batch_size" in patch:
            cfg["train_micro_batch_size_per_gpu"] = int(patch["micro_batch_size"])
            cfg.pop("train_batch_size", None)  # re-derived from micro x accumulation x world by ds_core.config
        if patch.get("allreduce") == "single":
            zero.update(SINGLE_ZERO, reduce_bucket_size=int(self.single_bucket_elements))
        if self.comms_logger:
            cfg["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
        return cfg

    # ---------------------------------------------------------------------------------------------- commands
    def train_args(self, cell: Cell, run_dir: Path, ds_json: Path | None) -> list[str]:
        """The module's arguments for one cell (what follows `--module ds_tools.study.cell`)."""
        out = ["--study_target", self.module]
        if self.preset:
            out += ["--preset", self.preset]
        if ds_json is not None:
            out += ["--deepspeed_config", str(ds_json)]
        out += ["--run_dir", str(run_dir), "--max_steps", str(self.steps),
                "--throughput_warmup_steps", str(self.warmup_steps), "--progress_bar", "false",
                "--save_final_checkpoint", "false", *map(str, self.args)]
        for name, value in cell.values.items():
            if name in SPECIAL_AXES:
                continue
            flag = self.flags.get(name, f"--{name}")
            out += [flag, _flag_value(value)]
        return out


def _flag_value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _hint(key: str, known) -> str:
    m = difflib.get_close_matches(key, sorted(known), 1)
    return f"{key!r}" + (f" (did you mean {m[0]!r}?)" if m else "")


def _expect(path: Path, where: str, value: Any, types: tuple, what: str) -> Any:
    if isinstance(value, bool) and bool not in types:
        raise StudyError(f"{path}: {where} = {value!r}: expected {what}")
    if not isinstance(value, types):
        raise StudyError(f"{path}: {where} = {value!r}: expected {what}")
    return value


def load_study(path: str | Path) -> Study:
    """Parse and check a study file; every error names the file and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StudyError(f"{path}: study file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise StudyError(f"{path}: not valid TOML: {e}") from None
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise StudyError(f"{path}: unknown table(s) {', '.join(_hint(k, _TOP_KEYS) for k in sorted(unknown))}; "
                         f"expected {sorted(_TOP_KEYS)}")
    s = data.get("study", {})
    unknown = set(s) - _STUDY_KEYS
    if unknown:
        hints = ', '.join(_hint(k, _STUDY_KEYS) for k in sorted(unknown))
        raise StudyError(f"{path}: unknown key(s) in [study]: {hints}")
    if "module" not in s:
        raise StudyError(f"{path}: [study] module is required (e.g. module = \"bert_ref.train\")")
    st = Study(path=path, name=s.get("name", path.stem), module=_expect(path, "[study] module", s["module"], (str,),
                                                                         "a module name or a .py path"))
    for key, types, what in (("preset", (str,), "a string"), ("deepspeed_config", (str,), "a string"),
                             ("steps", (int,), "an integer >= 1"), ("warmup_steps", (int,), "an integer >= 0"),
                             ("args", (list,), "a list of strings"), ("launcher", (str,), f"one of {LAUNCHERS}"),
                             ("ranks_per_node", (int,), "an integer >= 1"), ("hostfile", (str,), "a path"),
                             ("launch_args", (list,), "a list of strings"), ("timeout_s", (int, float), "seconds > 0"),
                             ("repeats", (int,), "an integer >= 1"), ("baseline", (dict,), "a table axis = value"),
                             ("comms_logger", (bool,), "true or false"),
                             ("single_bucket_elements", (int,), "an integer >= 1"), ("name", (str,), "a string"),
                             ("prepare", (list,), "a command as a list of strings"),
                             ("prepare_creates", (str,), "a path"), ("precision", (int, float), "a fraction"),
                             ("max_repeats", (int,), "an integer"), ("budget_s", (int, float), "seconds"),
                             ("master_port", (int,), "a port number")):
        if key in s:
            setattr(st, key, _expect(path, f"[study] {key}", s[key], types, what))
    checks = [("steps", st.steps >= 1, ">= 1"), ("warmup_steps", 0 <= st.warmup_steps < st.steps,
                                                   f">= 0 and < steps ({st.steps})"),
              ("ranks_per_node", st.ranks_per_node >= 1, ">= 1"), ("timeout_s", st.timeout_s > 0, "> 0"),
              ("repeats", st.repeats >= 1, ">= 1"), ("launcher", st.launcher in LAUNCHERS, f"one of {LAUNCHERS}"),
              ("single_bucket_elements", st.single_bucket_elements >= 1, ">= 1"),
              ("precision", 0 <= st.precision < 1, ">= 0 and < 1 (e.g. 0.05: +-5 % of the mean)"),
              ("budget_s", st.budget_s > 0, "> 0"),
              ("master_port", st.master_port == 0 or 1024 <= st.master_port <= 65000, "0 or 1024-65000")]
    st.max_repeats = st.max_repeats or (max(st.repeats, DEFAULT_MAX_REPEATS) if st.precision else st.repeats)
    checks += [("max_repeats", st.max_repeats >= st.repeats, f">= repeats ({st.repeats})"),
               ("repeats", st.repeats >= 2 or not st.precision, ">= 2 with a precision (an interval needs two runs)")]
    for key, ok, what in checks:
        if not ok:
            raise StudyError(f"{path}: [study] {key} = {getattr(st, key)!r}: expected {what}")
    if st.launcher == "hostfile" and not st.hostfile:
        raise StudyError(f"{path}: [study] launcher = \"hostfile\" needs hostfile = \"PATH\"")
    if st.deepspeed_config and not resolve_ds_path(st.deepspeed_config).is_file():
        raise StudyError(f"{path}: [study] deepspeed_config = {st.deepspeed_config!r}: no such file "
                         f"(nor in ds_configs/)")
    if bool(st.prepare) != bool(st.prepare_creates):
        raise StudyError(f"{path}: [study] prepare and prepare_creates go together (the command, and the path "
                         "whose existence says it already ran)")
    st.prepare = [str(a) for a in st.prepare]
    st.args = [str(a) for a in st.args]
    st.launch_args = [str(a) for a in st.launch_args]

    if not st.name or "/" in st.name or st.name in (".", "..") or not st.name.isprintable():
        raise StudyError(f"{path}: [study] name = {st.name!r}: expected one path component (no /, not . or ..): "
                         f"it names the study directory runs/studies/<name>")
    axes = data.get("axes", {})
    for name, values in axes.items():
        if not SAFE_AXIS_NAME.fullmatch(name):
            raise StudyError(f"{path}: [axes] {name!r}: expected a name of letters, digits and _ (it names the "
                             f"cell directories and the module's flag --{name})")
        if not isinstance(values, list) or not values:
            raise StudyError(f"{path}: [axes] {name} = {values!r}: expected a non-empty list of values")
        for v in values:
            text = _flag_value(v) if isinstance(v, bool) else str(v)
            if not SAFE_COMPONENT.fullmatch(text):
                raise StudyError(f"{path}: [axes] {name} value {v!r}: expected letters, digits and _ . + , = @ - "
                                 f"only: a value is part of its cell's directory name (cells/{name}-VALUE__...) and "
                                 f"a flag value of the module")
        if len(set(map(str, values))) != len(values):
            raise StudyError(f"{path}: [axes] {name} = {values!r}: values repeat")
        if name == "repeats":
            raise StudyError(f"{path}: [axes] repeats: set repeats = N in [study] instead (every cell runs N times)")
    if "allreduce" in axes and set(map(str, axes["allreduce"])) - set(ALLREDUCE_VALUES):
        raise StudyError(f"{path}: [axes] allreduce = {axes['allreduce']!r}: expected values from {ALLREDUCE_VALUES}")
    for name in ("nodes", "zero_stage", "micro_batch_size"):
        for v in axes.get(name, []):
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "zero_stage" else 1):
                raise StudyError(f"{path}: [axes] {name} value {v!r}: expected an integer "
                                 f"{'0-3' if name == 'zero_stage' else '>= 1'}")
    if "nodes" in axes and st.launcher == "local" and any(n > 1 for n in axes["nodes"]):
        raise StudyError(f"{path}: [axes] nodes > 1 needs launcher = \"simulated_nodes\" or \"hostfile\" "
                         f"(launcher is \"local\")")
    st.axes = dict(axes)
    for name, v in st.baseline.items():
        if name not in st.axes:
            raise StudyError(f"{path}: [study] baseline names axis {name!r}, which is not in [axes] {sorted(st.axes)}")
        if v not in st.axes[name]:
            raise StudyError(f"{path}: [study] baseline {name} = {v!r} is not among its values {st.axes[name]}")
    flags = data.get("flags", {})
    for name, flag in flags.items():
        if name not in st.axes:
            raise StudyError(f"{path}: [flags] {name!r} maps an axis that is not in [axes] {sorted(st.axes)}")
        if name in SPECIAL_AXES:
            raise StudyError(f"{path}: [flags] {name!r}: a special axis ({', '.join(SPECIAL_AXES)}) maps to no flag")
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise StudyError(f"{path}: [flags] {name} = {flag!r}: expected a flag such as \"--{name}\"")
    st.flags = dict(flags)
    env = data.get("env", {})
    st.env = {str(k): _flag_value(v) if isinstance(v, bool) else str(v) for k, v in env.items()}
    _load_fabrics(path, data.get("fabrics", {}), st)
    return st


def _load_fabrics(path: Path, fabrics: dict, st: Study) -> None:
    """[fabrics] name = { mbit = 100, delay_ms = 1.0 }: the links of launcher = "emulated_fabric"
    (ds_tools.study.netns); the special axis `fabric` picks one per cell."""
    for name, f in fabrics.items():
        if not isinstance(f, dict) or set(f) - _FABRIC_KEYS or "mbit" not in f:
            raise StudyError(f"{path}: [fabrics] {name} = {f!r}: expected {{ mbit = N, delay_ms = N }}")
        for k in f:
            v = f[k]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (k == "mbit" and v == 0):
                raise StudyError(f"{path}: [fabrics] {name}.{k} = {v!r}: expected a number "
                                 f"{'> 0' if k == 'mbit' else '>= 0'}")
    st.fabrics = {n: {"mbit": float(f["mbit"]), "delay_ms": float(f.get("delay_ms", 0.0))} for n, f in fabrics.items()}
    if st.launcher == "emulated_fabric":
        if not st.fabrics:
            raise StudyError(f"{path}: launcher = \"emulated_fabric\" needs a [fabrics] table, e.g. "
                             "slow = { mbit = 100, delay_ms = 1.0 }")
        if len(st.fabrics) > 1 and "fabric" not in st.axes:
            raise StudyError(f"{path}: [fabrics] has {len(st.fabrics)} entries: "
                             f"add [axes] fabric = {sorted(st.fabrics)}")
    for v in st.axes.get("fabric", []):
        if st.launcher != "emulated_fabric":
            raise StudyError(f"{path}: [axes] fabric needs launcher = \"emulated_fabric\"")
        if v not in st.fabrics:
            raise StudyError(f"{path}: [axes] fabric value {v!r}: not in [fabrics] {sorted(st.fabrics)}")


def dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
