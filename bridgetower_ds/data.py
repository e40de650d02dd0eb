"""Image-caption data for BridgeTower: sources, splits, per-rank order with exact resume, host and device pipelines.

Sources (`--dataset_format auto` detects them): a `save_to_disk` directory (Dataset or DatasetDict), an imagefolder
directory (images + metadata.jsonl/csv, split sub-folders optional), or a manifest file (.jsonl, .json, .csv) whose
rows hold an image path (relative to the manifest's folder) and a caption. Missing validation/test splits are carved
out of train deterministically, so every rank and every rerun sees the same split: as run_bridgetower.py does it
(`--missing_splits run_bridgetower`: no test split -> datasets' train_test_split(test_size=0.4, shuffle=True,
seed=<training seed>), and without a validation split that 40 % is halved, unshuffled, into validation and test), or
by fractions (`--missing_splits fractions`: --validation_fraction, --test_fraction, --split_seed; the behaviour before).
Rows whose caption is empty, null or missing are skipped and counted (`bad_captions`; an empty caption would train
as "<s></s>"); bad images are counted once per distinct image. Both counts are summed over ranks and reported in the
train, eval and predict results.

Order, rank share and resume position come from batching.BatchPlan (pure); every pipeline turns decoded rows into a
batch with batching.BatchAssembler. The position saved in checkpoints is a point in the epoch's global sample order;
`load_state_dicts` (the states of all ranks) resumes on another world size by dealing the rest of the epoch's order
to the new ranks (batching.resume_window). With `DS_CORE_SAMPLE_LOG=<dir>`, each rank appends {"epoch", "indices":
the plan's dataset rows of each training micro batch it consumed, "trained": the rows in the batch when bad images
removed some} to `<dir>/rank{r}.jsonl` (ds_core.outputs.sample_log).

Pipelines: "host" decodes/resizes/crops in DataLoader workers and ships uint8 [B,S,S,3]; normalization happens on
the training device. "device-*" pipelines ship encoded bytes from the workers and decode on the accelerator
(images.py / hpu_media.py). Either way the batch arrives on `device` as float32 pixel_values.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ds_core.errors import ConfigError, InputNotFound
from ds_core.outputs.sample_log import SampleLog
from ds_core.run.step import pin_batches

from . import log
from .batching import MIN_CONTRASTIVE_ROWS, BadImageLog, BatchAssembler, BatchPlan, pad_to_max_length, resume_window
from .configs import DataArgs
from .fetch import FetchBatch, PlanSampler, identity
from .image_pipeline import HOST, ImagePipeline, PixelSource

# Names of images.py and splits.py that are still importable from here (bridgetower_ds.train imports check_dataset
# from this module), hence no unused-import warnings on them.
from .images import (  # noqa: F401
    CLIP_MEAN,
    CLIP_STD,
    DEFAULT_MAX_PIXELS,
    TRANSFORMS,
    BadImage,
    host_transform,
    normalize,
    read_bytes,
)
from .splits import (  # noqa: F401
    carve_splits,
    check_dataset,
    drop_bad_captions,
    limit_rows,
    run_bridgetower_splits,
    take_rows,
)
from .table import CaptionTable

ROLES = ("train", "validation", "test")


# ---------------------------------------------------------------------------------------------------- tables
def _caption(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        v = v[0] if v else ""
    return "" if v is None else str(v)


def _detect_format(path: Path) -> str:
    if path.is_dir():
        if any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
            return "hf"
        return "imagefolder"
    suffix = path.suffix.lower().lstrip(".")
    if suffix in ("json", "jsonl", "csv"):
        return suffix
    raise ConfigError(f"--dataset_path {path}: cannot tell the format (expected a directory or .json/.jsonl/.csv); "
                     "pass --dataset_format")


def _check_columns(cols: Sequence[str], args: DataArgs, where: str) -> None:
    for c in (args.image_column, args.caption_column):
        if c not in cols:
            raise KeyError(f"{where}: no column {c!r} (columns: {sorted(cols)}); set --image_column/--caption_column")


def _from_hf(ds, args: DataArgs, base_dir: str, source: str) -> CaptionTable:
    from datasets import Image as HFImage

    _check_columns(ds.column_names, args, source)
    if isinstance(ds.features[args.image_column], HFImage):
        ds = ds.cast_column(args.image_column, HFImage(decode=False))  # we decode ourselves (bad images, speed)
    images = ds.select_columns([args.image_column])
    col = _LazyColumn(images, args.image_column)
    return CaptionTable(col, [_caption(c) for c in ds[args.caption_column]], base_dir, source)


class _LazyColumn:
    """Row access into one Arrow column without materializing image bytes for the whole split."""

    def __init__(self, ds, column: str):
        self.ds, self.column = ds, column

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return self.ds[int(i)][self.column]

    def select(self, rows) -> "_LazyColumn":
        return _LazyColumn(self.ds.select(rows), self.column)


def _manifest_text(path: Path) -> str:
    """The manifest as text; not UTF-8 -> ValueError naming the file, the line and the offending byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a leading BOM (Excel's "CSV UTF-8") is not part of the first column name
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason}); "
                         "save the manifest as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _read_manifest(path: Path, fmt: str) -> list[dict]:
    text = _manifest_text(path)
    if fmt == "csv":
        return list(csv.DictReader(io.StringIO(text, newline="")))
    if fmt == "jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        return rows
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(obj, dict) and "data" in obj and isinstance(obj["data"], list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise ValueError(f"{path}: expected a JSON list of records (or {{'data': [...]}})")
    return obj


def load_tables(args: DataArgs) -> dict[str, CaptionTable]:
    """All splits the source has, by name. A single un-split source is returned as {train_split: table}."""
    if args.dataset_name:
        if args.dataset_path:
            raise ConfigError(f"--dataset_name {args.dataset_name} and --dataset_path {args.dataset_path}: give one")
        from .hub import load_cached_dataset

        obj = load_cached_dataset(args.dataset_name, args.dataset_config_name)
        name = f"{args.dataset_name}/{args.dataset_config_name}" if args.dataset_config_name else args.dataset_name
        return {k: _from_hf(v, args, "", f"{name}:{k}") for k, v in obj.items()}  # source names the configuration
    if not args.dataset_path:
        raise ConfigError("--dataset_path (or --dataset_name) is required")
    path = Path(args.dataset_path).expanduser()
    if not path.exists():
        raise InputNotFound(f"--dataset_path {path} does not exist")
    fmt = args.dataset_format if args.dataset_format != "auto" else _detect_format(path)
    if fmt == "hf":
        from datasets import DatasetDict, load_from_disk

        obj = load_from_disk(str(path))
        splits = dict(obj) if isinstance(obj, DatasetDict) else {args.train_split: obj}
        return {k: _from_hf(v, args, str(path), f"{path}:{k}") for k, v in splits.items()}
    if fmt == "imagefolder":
        from datasets import load_dataset

        obj = load_dataset("imagefolder", data_dir=str(path))
        return {k: _from_hf(v, args, str(path), f"{path}:{k}") for k, v in obj.items()}
    rows = _read_manifest(path, fmt)
    if not rows:
        raise ValueError(f"{path}: no rows")
    _check_columns(list(rows[0].keys()), args, str(path))
    base = str(path.parent)
    if "split" in rows[0]:  # a manifest may name each row's split
        out: dict[str, list[dict]] = {}
        for r in rows:
            out.setdefault(str(r.get("split") or args.train_split), []).append(r)
    else:
        out = {args.train_split: rows}
    return {k: CaptionTable([r.get(args.image_column) for r in v], [_caption(r.get(args.caption_column)) for r in v],
                            base, f"{path}:{k}") for k, v in out.items()}


class Splits:
    """The dataset of one run, opened once; train/validation/test tables, missing ones carved out of train once
    (deterministically: `--missing_splits`, with the training `seed` or `split_seed`). Every evaluation of the run
    reuses the same tables."""

    def __init__(self, args: DataArgs, tables: dict[str, CaptionTable] | None = None, seed: int = 42):
        self.args, self.seed = args, seed
        self.tables = tables if tables is not None else load_tables(args)
        self.names = {"train": args.train_split, "validation": args.validation_split, "test": args.test_split}
        self._carved: dict[str, np.ndarray] | None = None
        self._cache: dict[str, CaptionTable] = {}

    def role(self, split: str) -> str:
        role = split if split in self.names else next((r for r, n in self.names.items() if n == split), None)
        if role is None:
            raise ValueError(f"unknown split {split!r}: expected one of {sorted(self.names)} or "
                             f"{sorted(self.names.values())}")
        return role

    def get(self, split: str) -> CaptionTable:
        """The table for role/name `split` (train|validation|test or the configured split names)."""
        role = self.role(split)
        if role not in self._cache:
            self._cache[role] = self._select(role)
        return self._cache[role]

    def _select(self, role: str) -> CaptionTable:
        args, names, tables = self.args, self.names, self.tables
        if names[role] in tables and role != "train":
            return tables[names[role]]
        if names["train"] not in tables:
            raise KeyError(f"{args.dataset_path}: no split {names[role]!r} and no {names['train']!r} split to carve "
                           f"it from (splits: {sorted(tables)})")
        train = tables[names["train"]]
        need_val, need_test = names["validation"] not in tables, names["test"] not in tables
        if args.missing_splits == "run_bridgetower":
            if not need_test:  # run_bridgetower.py carves only when there is no test split
                if role == "validation":
                    raise KeyError(f"{args.dataset_path or args.dataset_name}: no split {names['validation']!r} "
                                   f"(splits: {sorted(tables)}); run_bridgetower.py carves one only when there is "
                                   "no test split either. Pass --missing_splits fractions to carve "
                                   "--validation_fraction of train")
                return train
            if self._carved is None:
                self._carved = run_bridgetower_splits(len(train), need_val, self.seed)
            return take_rows(train, self._carved[role], f"{train.source}->{role}(run_bridgetower, seed {self.seed})")
        if role == "train" and not (need_val or need_test):
            return train
        if self._carved is None:
            self._carved = carve_splits(len(train), need_val, need_test, args.validation_fraction,
                                        args.test_fraction, args.split_seed)
        return train.subset(self._carved[role], f"{train.source}->{role}(seed {args.split_seed})")


def open_dataset(args: DataArgs, seed: int = 42) -> Splits:
    """Open the run's dataset once (the splits are carved on first use and kept); `seed`: the training seed, which
    carves missing splits under --missing_splits run_bridgetower."""
    return Splits(args, seed=seed)


def select_split(args: DataArgs, split: str, tables: dict[str, CaptionTable] | None = None,
                 seed: int = 42) -> CaptionTable:
    """One table without keeping the Splits (tests, tools); a run uses open_dataset once."""
    return Splits(args, tables, seed).get(split)


# ---------------------------------------------------------------------------------------------------- data source
class CaptionData:
    """ds_core.run.data.DataSource over one split for one rank; yields BatchAssembler's batch dicts on `device`.

    The rows come from a `BatchPlan` (train: shuffled, equal share per rank, a last one-row batch dropped; eval:
    batch c on rank c mod W). Bad images are dropped (a batch may be smaller). In training, a batch left with fewer
    than two valid rows is skipped on one rank and replaced by the last good batch (index -1) on several, so every
    rank runs the same number of steps. In evaluation such batches are skipped (evaluate keeps ranks in step).
    """

    # the same on every rank: taken from rank 0, not summed. bad_captions is counted on the whole split before it is
    # dealt; bad_images is the union of the ranks' bad images (summary_stats gathers it: in training an image meets
    # another rank in each epoch, so summing per-rank counts would count it once per rank that met it)
    shared_summary_stats = ("bad_captions", "bad_images")

    def __init__(self, args: DataArgs, table: CaptionTable, tokenizer, image_size: int, rank: int, world_size: int,
                 micro_batch: int, seed: int, device, shuffle: bool = True,
                 pipeline: ImagePipeline | str | None = None,
                 media_pipe_iterator=None, bad_captions: Sequence[str] = ()):
        """pipeline: the run's ImagePipeline (bridgetower_ds.image_pipeline), decided once for every split, or its
        name; None: resolved here from args. media_pipe_iterator: with pipeline "device-hpu", what builds the pipe's
        output iterator (default: the Habana media pipe; tests pass a stand-in decoder, see hpu_media.HpuMediaLoader).
        bad_captions: names of the split's rows dropped for their caption (drop_bad_captions), counted in the
        results."""
        self.args, self.table, self.tokenizer = args, table, tokenizer
        self.bad_captions = list(bad_captions)
        self.size = int(args.image_size or image_size)
        if self.size < 1:
            raise ConfigError("image size unknown: pass image_size (the model's vision image size) or --image_size")
        self.rank, self.world_size, self.micro_batch, self.seed = rank, world_size, micro_batch, seed
        self.device, self.shuffle = torch.device(device), shuffle
        try:
            self.plan = BatchPlan(len(table), rank, world_size, micro_batch, seed, train=shuffle)
        except ValueError as e:
            raise ValueError(f"{table.source}: {e}") from None
        if not isinstance(pipeline, ImagePipeline):  # a name (tests), or decided here for a source built alone
            pipeline = ImagePipeline(pipeline, "given") if pipeline else self._resolve_pipeline(args, rank)
        self.pipeline = pipeline
        self.epoch, self.batches_done = 0, 0
        self.window: tuple[int, int] | None = None  # self.epoch's rest after a resize (batching.resume_window)
        self._batches = self.plan.rank_batches(0)
        self.sample_log = SampleLog(rank, enabled=shuffle)
        self.pad_to_max = pad_to_max_length(args.pad_to_max_length, self.device)
        self.bad = BadImageLog(args.bad_image, rank)
        self.assembler = BatchAssembler(size=self.size, device=self.device, world_size=world_size,
                                        pad_to_max=self.pad_to_max,
                                        min_rows=min(MIN_CONTRASTIVE_ROWS, micro_batch) if shuffle else 1,
                                        fill_in=shuffle, bad=self.bad, first_valid=self._first_valid_batch)
        self._fetch = FetchBatch(table, tokenizer, self.size, pipeline, args.jpeg_draft,
                                 args.max_image_pixels, args.max_seq_length, self.pad_to_max, args.image_transform)
        self._pixels: PixelSource | None = None
        self._hpu = None
        if pipeline.media_pipe:
            from .hpu_media import HpuMediaLoader

            self._hpu = HpuMediaLoader(self, media_pipe_iterator)
        else:
            self._pixels = pipeline.pixel_source(self.size, self.device, args)
        self._loader = None

    def _resolve_pipeline(self, args: DataArgs, rank: int) -> ImagePipeline:
        pipeline = ImagePipeline.resolve(args.requested_pipeline, self.device, args.pipeline_flag)
        pipeline.announce(rank)
        return pipeline

    # -- the plan, as every pipeline reads it
    def pending_batches(self) -> list[tuple[int, np.ndarray]]:
        """(batches_done after this batch, rows) for the rest of the epoch from the current position."""
        return [(k + 1, rows) for k, rows in enumerate(self._batches) if k >= self.batches_done]

    # -- DataSource protocol
    def set_epoch(self, epoch: int, window: tuple[int, int] | None = None) -> None:
        self.epoch, self.batches_done, self.window = int(epoch), 0, window
        self._batches = self.plan.rank_batches(self.epoch, window)

    def state_dict(self) -> dict:
        """The position as a point in the epoch's global (world-size-independent) sample order; `window`: the part
        of it this epoch deals since a resume on another world size (None: all)."""
        return {"epoch": self.epoch, "sample_offset": self.plan.sample_offset(self.epoch, self.batches_done,
                                                                              self.window),
                "window": list(self.window) if self.window else None,
                "seed": self.seed, "world_size": self.world_size, "micro_batch": self.micro_batch,
                "rows": len(self.table), "bad_images": self.bad.count, "bad_image_names": sorted(self.bad.seen)}

    def load_state_dicts(self, states: list[dict]) -> None:
        """Resume from the saved states of ALL ranks of a checkpoint (rank order). Same world size and micro batch:
        `load_state_dict(states[self.rank])`, exactly as before. Otherwise the rest of the epoch's global order is
        dealt to this run's ranks (batching.resume_window); bad-image counts are summed so their total is kept."""
        if len(states) == self.world_size and all(st.get("world_size") == self.world_size and
                                                  st.get("micro_batch", self.micro_batch) == self.micro_batch
                                                  for st in states):
            return self.load_state_dict(states[self.rank])
        try:
            self.set_epoch(*resume_window(states, len(self.table), self.seed))
        except ValueError as e:
            raise ValueError(f"{self.table.source}: {e}") from None
        mine = states[self.rank::self.world_size]  # the saved ranks' distinct bad images, dealt to keep the total
        self.bad.restore([n for st in mine for n in st.get("bad_image_names") or ()],
                         sum(int(st.get("bad_images", 0)) for st in mine))

    def load_state_dict(self, state: dict) -> None:
        saved = {k: state.get(k, now) for k, now in (("world_size", self.world_size), ("rows", len(self.table)),
                                                     ("micro_batch", self.micro_batch), ("seed", self.seed))}
        now = {"world_size": self.world_size, "rows": len(self.table), "micro_batch": self.micro_batch,
               "seed": self.seed}
        if saved != now:
            diff = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in now if saved[k] != now[k])
            raise ValueError(f"data position was saved with a different plan ({diff}): the per-rank order would "
                             "differ, so the position cannot be restored exactly")
        self.set_epoch(int(state["epoch"]), tuple(state["window"]) if state.get("window") else None)
        if "sample_offset" in state:
            self.batches_done = self.plan.batches_done(self.epoch, int(state["sample_offset"]), self.window)
        else:  # positions saved before the global offset: rows into this rank's list
            self.batches_done = -(-int(state["offset"]) // self.micro_batch)
        self.bad.restore(state.get("bad_image_names"), int(state.get("bad_images", self.bad.count)))

    def distinct_bad_images(self) -> int:
        """Distinct bad images of the split over all ranks. Every rank calls it (a collective when distributed)."""
        import torch.distributed as tdist

        mine = (sorted(self.bad.seen), self.bad.count - len(self.bad.seen))
        gathered = [mine]
        if self.world_size > 1 and tdist.is_available() and tdist.is_initialized():
            gathered = [None] * self.world_size
            tdist.all_gather_object(gathered, mine)
        return len({n for names, _ in gathered for n in names}) + sum(unnamed for _, unnamed in gathered)

    def summary_stats(self) -> dict:
        """Counts for the run summary; every rank calls it (the loop does, then reduces over ranks)."""
        out = {"bad_images": self.distinct_bad_images(), "bad_captions": len(self.bad_captions),
               "bad_image_examples": list(self.bad.examples)}
        if self.assembler.filler_batches:
            out["filler_batches"] = self.assembler.filler_batches
        return out

    @property
    def bad_images(self) -> int:
        return self.bad.count

    def result_counts(self, prefix: str) -> dict:
        """{prefix}_bad_images (distinct over all ranks) and {prefix}_bad_captions for a results file, e.g.
        eval_bad_images. Every rank calls it (a collective)."""
        return {f"{prefix}_bad_images": self.distinct_bad_images(), f"{prefix}_bad_captions": len(self.bad_captions)}

    def __len__(self) -> int:
        """Batches in a full epoch on this rank."""
        return len(self._batches)

    def __iter__(self) -> Iterator[dict]:
        yielded = False
        source = self._hpu.batches() if self._hpu is not None else self._assembled()
        for end, batch in source:
            self.batches_done = end
            if self.sample_log:
                self._log(self._batches[end - 1], batch)
            if batch is None:
                batch = self.assembler.fill_in()
                if batch is None:
                    continue
            yielded = True
            yield batch
        if not yielded and not self.plan.train and self.world_size > 1 and self.batches_done == len(self._batches):
            # this rank's evaluation share is empty (or all bad) while other ranks have batches: one stand-in
            # forward keeps the ranks in step (evaluate ignores index -1 rows)
            yield self.assembler.stand_in()

    # -- internals
    def _log(self, rows: np.ndarray, batch: dict | None) -> None:
        trained = [] if batch is None else [int(i) for i in batch["index"].tolist()]
        extra = {} if trained == rows.tolist() else {"trained": trained}
        self.sample_log.write(self.epoch, rows.tolist(), **extra)

    def _raw_batches(self) -> Iterator[dict]:
        workers = self.args.dataloader_num_workers
        if workers == 0:
            for spec in self.pending_batches():
                yield self._fetch[spec]
            return
        if self._loader is None:
            self._loader = torch.utils.data.DataLoader(
                self._fetch, sampler=PlanSampler(self), batch_size=None, num_workers=workers, persistent_workers=True,
                prefetch_factor=2, pin_memory=pin_batches(self.device), timeout=self.args.dataloader_timeout_s,
                collate_fn=identity)
        yield from self._loader

    def _assembled(self) -> Iterator[tuple[int, dict | None]]:
        """Host and CPU/CUDA device pipelines: worker output -> decode (device pipelines) -> assemble."""
        for raw in self._raw_batches():
            yield raw["end"], self._decode_and_assemble(raw, self.assembler)

    def _decode_and_assemble(self, raw: dict, assembler: BatchAssembler, remember: bool = True) -> dict | None:
        pixel_values, keep, failed = self._pixels(raw)
        bad = list(raw["bad"]) + failed
        tokens = {k: raw[k] for k in ("input_ids", "attention_mask") if k in raw}
        return assembler.assemble(pixel_values, keep, tokens, raw["index"], bad, remember=remember)

    def _first_valid_batch(self) -> dict:
        """The epoch's first rows of this rank that decode (host path, bad images not counted twice), enough for a
        contrastive batch: the fill-in before any good batch was seen."""
        host = FetchBatch(self.table, self.tokenizer, self.size, HOST, self.args.jpeg_draft, self.args.max_image_pixels,
                          self.args.max_seq_length, self.pad_to_max, self.args.image_transform)
        need = self.assembler.min_rows
        order = np.concatenate(self._batches) if self._batches else self.plan.order(self.epoch)
        rows: list[int] = []
        for r in np.concatenate([order, self.plan.order(self.epoch)]):  # this rank's rows first, then any row
            if int(r) in rows:
                continue
            if host[(0, np.array([r]))]["pixels_u8"] is not None:
                rows.append(int(r))
                if len(rows) == need:
                    raw = host[(0, np.array(rows))]
                    return self.assembler.assemble(normalize(raw["pixels_u8"], self.device), list(range(need)), raw,
                                                   raw["index"], remember=False)
        raise RuntimeError(f"{self.table.source}: rank {self.rank} found fewer than {need} readable images in "
                           f"epoch {self.epoch}; see the bad-image log lines")

    def close(self) -> None:
        if self._pixels is not None:
            self._pixels.close()
        self._loader = None


def build_data(splits: Splits, split: str, tokenizer, image_size: int, rank: int, world_size: int,
               micro_batch: int, seed: int, device, shuffle: bool = True,
               pipeline: ImagePipeline | None = None) -> CaptionData:
    """The per-rank DataSource for `split` (train|validation|test or the configured split names) of the run's
    dataset (open it once with open_dataset); pipeline: the run's image pipeline, resolved once for every split
    (None: resolved from the data settings here)."""
    table, bad_captions = drop_bad_captions(limit_rows(splits.args, split, splits.get(split)))
    where = splits.args.dataset_path or splits.args.dataset_name
    if bad_captions:
        log.say(f"{where} split {split!r}: skipping {len(bad_captions)} rows with an empty, null or missing caption "
                f"(first: {', '.join(bad_captions[:3])})", rank=rank)
    if len(table) == 0:
        raise ValueError(f"{where}: split {split!r} is empty" +
                         (f" ({len(bad_captions)} rows without a caption)" if bad_captions else ""))
    return CaptionData(splits.args, table, tokenizer, image_size, rank, world_size, micro_batch, seed, device,
                       shuffle, pipeline=pipeline, bad_captions=bad_captions)
