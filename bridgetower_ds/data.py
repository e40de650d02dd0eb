"""Image-caption data for BridgeTower: sources, splits, per-rank order with exact resume, host and device pipelines.

Sources (`--dataset_format auto` detects them): a `save_to_disk` directory (Dataset or DatasetDict), an imagefolder
directory (images + metadata.jsonl/csv, split sub-folders optional), or a manifest file (.jsonl, .json, .csv) whose
rows hold an image path (relative to the manifest's folder) and a caption. Missing validation/test splits are carved
out of train deterministically (`split_seed`), so every rank and every rerun sees the same split.

Order and resume are pure functions (`rank_order`): epoch e shuffles all rows with seed+e, trims the tail so every
rank gets the same count (train) or pads it with marked repeats (eval: index -1), and rank r takes rows r::world.
The position is (epoch, offset into that rank's list), so a resumed run continues with exactly the next batch.

Pipelines: "host" decodes/resizes/crops in DataLoader workers and ships uint8 [B,S,S,3]; normalization happens on
the training device. "device-*" pipelines ship encoded bytes from the workers and decode on the accelerator
(images.py / hpu_media.py). Either way the batch arrives on `device` as float32 pixel_values.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .images import (CLIP_MEAN, CLIP_STD, DEFAULT_MAX_PIXELS, BadImage, host_transform, make_device_decoder,  # noqa: F401
                     normalize, read_bytes, resolve_pipeline)

log = logging.getLogger(__name__)

FORMATS = ("auto", "hf", "imagefolder", "json", "jsonl", "csv")
ROLES = ("train", "validation", "test")
MAX_BAD_EXAMPLES = 10


@dataclass
class DataArgs:
    dataset_path: str = field(default="", metadata={
        "help": "Image-caption data: a save_to_disk directory, an imagefolder directory, or a .json/.jsonl/.csv "
                "manifest (image path relative to the manifest, caption)."})
    dataset_format: str = field(default="auto", metadata={"help": "auto|hf|imagefolder|json|csv|jsonl."})
    dataset_name: str = field(default="", metadata={
        "help": "Hub dataset (e.g. jmhessel/newyorker_caption_contest), loaded from the local datasets cache "
                "offline (bridgetower_ds.hub); instead of --dataset_path."})
    dataset_config_name: str = field(default="", metadata={"help": "Configuration of --dataset_name (e.g. matching)."})
    max_train_samples: int = field(default=0, metadata={
        "help": "Use only the first N rows of the train split (after any carve-out); 0: all."})
    max_eval_samples: int = field(default=0, metadata={"help": "Use only the first N rows of validation; 0: all."})
    max_predict_samples: int = field(default=0, metadata={"help": "Use only the first N rows of test; 0: all."})
    image_column: str = field(default="image", metadata={"help": "Column with the image (path, bytes or HF Image)."})
    caption_column: str = field(default="caption", metadata={
        "help": "Column with the caption text (a list of captions uses its first entry)."})
    train_split: str = field(default="train", metadata={"help": "Name of the training split."})
    validation_split: str = field(default="validation", metadata={"help": "Name of the validation split."})
    test_split: str = field(default="test", metadata={"help": "Name of the test split."})
    validation_fraction: float = field(default=0.1, metadata={
        "help": "Share of train carved out as validation when the data has no validation split."})
    test_fraction: float = field(default=0.1, metadata={
        "help": "Share of train carved out as test when the data has no test split."})
    split_seed: int = field(default=42, metadata={"help": "Seed of the deterministic carve-out of missing splits."})
    image_pipeline: str = field(default="host", metadata={
        "help": "host: decode/resize/crop in DataLoader workers, normalize on the accelerator; device: decode on "
                "the accelerator (HPU media pipe, CUDA nvJPEG, or a CPU thread pool); auto: best available."})
    mediapipe_dataloader: bool = field(default=False, metadata={"help": "Alias for --image_pipeline device."})
    dataloader_num_workers: int = field(default=2, metadata={"help": "DataLoader worker processes per rank."})
    bad_image: str = field(default="skip", metadata={
        "help": "skip: drop unreadable images (counted in metrics, first paths logged); error: stop with the path."})
    max_seq_length: int = field(default=128, metadata={"help": "Caption token limit (truncation)."})
    image_size: int = field(default=0, metadata={"help": "Image side S; 0 -> the model's vision image size."})
    pad_to_max_length: bool = field(default=False, metadata={
        "help": "Pad captions to max_seq_length (static shapes; always on for HPU) instead of the batch's longest."})
    jpeg_draft: bool = field(default=True, metadata={
        "help": "Decode large JPEGs at a reduced DCT scale (1/2, 1/4, 1/8) that still covers the resize target."})
    decode_threads: int = field(default=0, metadata={
        "help": "Threads of the device pipeline's CPU decoder (0 -> min(8, cores))."})
    max_image_pixels: int = field(default=DEFAULT_MAX_PIXELS, metadata={
        "help": "Images with more pixels (from the header) are bad images: decompression-bomb guard."})
    image_cache_dir: str = field(default="", metadata={
        "help": "HPU media pipe only: where images stored as bytes in the dataset are written as files (it reads "
                "files); empty -> a folder under the system temp dir named after the dataset."})
    dataloader_timeout_s: int = field(default=600, metadata={
        "help": "Seconds to wait for one batch from a worker before failing (instead of hanging)."})

    def validate(self) -> None:
        if self.dataset_format not in FORMATS:
            raise ValueError(f"--dataset_format must be one of {FORMATS}, got {self.dataset_format!r}")
        if self.image_pipeline not in ("host", "device", "auto"):
            raise ValueError(f"--image_pipeline must be host, device or auto, got {self.image_pipeline!r}")
        if self.bad_image not in ("skip", "error"):
            raise ValueError(f"--bad_image must be skip or error, got {self.bad_image!r}")
        for name in ("validation_fraction", "test_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"--{name} must be in [0, 1), got {v}")
        if self.validation_fraction + self.test_fraction >= 1.0:
            raise ValueError("--validation_fraction + --test_fraction must leave some training data")
        if self.max_seq_length < 2 or self.dataloader_num_workers < 0 or self.image_size < 0:
            raise ValueError("max_seq_length >= 2, dataloader_num_workers >= 0, image_size >= 0 expected")

    @property
    def requested_pipeline(self) -> str:
        return "device" if self.mediapipe_dataloader else self.image_pipeline


# ---------------------------------------------------------------------------------------------------- tables
class CaptionTable:
    """One split: rows of (image, caption). Images are paths (resolved against `base_dir`) or raw bytes."""

    def __init__(self, images: Sequence, captions: Sequence[str], base_dir: str, source: str):
        if len(images) != len(captions):
            raise ValueError(f"{source}: {len(images)} images but {len(captions)} captions")
        self.images, self.captions, self.base_dir, self.source = images, list(captions), base_dir, source

    def __len__(self) -> int:
        return len(self.captions)

    def subset(self, rows: np.ndarray, source: str) -> "CaptionTable":
        rows = np.sort(rows)
        imgs = self.images.select(rows) if hasattr(self.images, "select") else [self.images[int(i)] for i in rows]
        return CaptionTable(imgs, [self.captions[int(i)] for i in rows], self.base_dir, source)

    def name(self, i: int) -> str:
        ref = self._ref(i)
        return ref if isinstance(ref, str) else f"{self.source}[row {i}]"

    def _ref(self, i: int):
        v = self.images[int(i)]
        if isinstance(v, dict):  # datasets.Image(decode=False): {"bytes": ..., "path": ...}
            if v.get("bytes"):
                return bytes(v["bytes"])
            v = v.get("path")
        if isinstance(v, (bytes, bytearray)):
            return bytes(v)
        if v is None or v == "":
            return None
        p = str(v)
        return p if os.path.isabs(p) else os.path.join(self.base_dir, p)

    def path(self, i: int) -> str | None:
        ref = self._ref(i)
        return ref if isinstance(ref, str) else None

    def load(self, i: int) -> tuple[bytes | BadImage, str]:
        """Encoded bytes of row i, or the BadImage saying why there are none (never raises)."""
        ref, name = self._ref(i), self.name(i)
        if ref is None:
            return BadImage(name, f"no image in column for row {i}"), name
        if isinstance(ref, bytes):
            return (ref if ref else BadImage(name, "empty image bytes")), name
        try:
            return read_bytes(ref), name
        except BadImage as e:
            return e, name


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
    raise ValueError(f"--dataset_path {path}: cannot tell the format (expected a directory or .json/.jsonl/.csv); "
                     "pass --dataset_format")


def _check_columns(cols: Sequence[str], args: DataArgs, where: str) -> None:
    for c in (args.image_column, args.caption_column):
        if c not in cols:
            raise KeyError(f"{where}: no column {c!r} (columns: {sorted(cols)}); set --image_column/--caption_column")


def _from_hf(ds, args: DataArgs, base_dir: str, source: str) -> CaptionTable:
    from datasets import Image as HFImage  # noqa: PLC0415

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


def _read_manifest(path: Path, fmt: str) -> list[dict]:
    if fmt == "csv":
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    text = path.read_text(encoding="utf-8")
    if fmt == "jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        return rows
    obj = json.loads(text)
    if isinstance(obj, dict) and "data" in obj and isinstance(obj["data"], list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise ValueError(f"{path}: expected a JSON list of records (or {{'data': [...]}})")
    return obj


def load_tables(args: DataArgs) -> dict[str, CaptionTable]:
    """All splits the source has, by name. A single un-split source is returned as {train_split: table}."""
    if args.dataset_name:
        if args.dataset_path:
            raise ValueError(f"--dataset_name {args.dataset_name} and --dataset_path {args.dataset_path}: give one")
        from .hub import load_cached_dataset  # noqa: PLC0415

        obj = load_cached_dataset(args.dataset_name, args.dataset_config_name)
        name = f"{args.dataset_name}/{args.dataset_config_name}" if args.dataset_config_name else args.dataset_name
        return {k: _from_hf(v, args, "", f"{name}:{k}") for k, v in obj.items()}  # source names the configuration
    if not args.dataset_path:
        raise ValueError("--dataset_path (or --dataset_name) is required")
    path = Path(args.dataset_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--dataset_path {path} does not exist")
    fmt = args.dataset_format if args.dataset_format != "auto" else _detect_format(path)
    if fmt == "hf":
        from datasets import DatasetDict, load_from_disk  # noqa: PLC0415

        obj = load_from_disk(str(path))
        splits = dict(obj) if isinstance(obj, DatasetDict) else {args.train_split: obj}
        return {k: _from_hf(v, args, str(path), f"{path}:{k}") for k, v in splits.items()}
    if fmt == "imagefolder":
        from datasets import load_dataset  # noqa: PLC0415

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


def carve_splits(n: int, need_val: bool, need_test: bool, val_fraction: float, test_fraction: float,
                 seed: int) -> dict[str, np.ndarray]:
    """Deterministic rows of train/validation/test out of n training rows (only the missing ones are carved)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction)) if need_test else 0
    n_val = int(round(n * val_fraction)) if need_val else 0
    if need_test and n_test == 0 and test_fraction > 0 and n >= 3:  # tiny data: still one row per asked-for split
        n_test = 1
    if need_val and n_val == 0 and val_fraction > 0 and n >= 3:
        n_val = 1
    return {"test": perm[:n_test], "validation": perm[n_test:n_test + n_val], "train": perm[n_test + n_val:]}


def select_split(args: DataArgs, split: str, tables: dict[str, CaptionTable] | None = None) -> CaptionTable:
    """The table for role/name `split` (train|validation|test or the configured split names)."""
    names = {"train": args.train_split, "validation": args.validation_split, "test": args.test_split}
    role = split if split in names else next((r for r, n in names.items() if n == split), None)
    if role is None:
        raise ValueError(f"unknown split {split!r}: expected one of {sorted(names)} or {sorted(names.values())}")
    tables = tables if tables is not None else load_tables(args)
    if names[role] in tables:
        if role != "train":
            return tables[names[role]]
    if names["train"] not in tables:
        raise KeyError(f"{args.dataset_path}: no split {names[role]!r} and no {names['train']!r} split to carve it "
                       f"from (splits: {sorted(tables)})")
    train = tables[names["train"]]
    need_val, need_test = names["validation"] not in tables, names["test"] not in tables
    if role == "train" and not (need_val or need_test):
        return train
    rows = carve_splits(len(train), need_val, need_test, args.validation_fraction, args.test_fraction, args.split_seed)
    return train.subset(rows[role], f"{train.source}->{role}(seed {args.split_seed})")


def limit_rows(args: DataArgs, split: str, table: CaptionTable) -> CaptionTable:
    """The first --max_{train,eval,predict}_samples rows of a split (transformers' scripts: select(range(N)))."""
    names = {"train": args.train_split, "validation": args.validation_split, "test": args.test_split}
    role = split if split in names else next((r for r, n in names.items() if n == split), split)
    limit = {"train": args.max_train_samples, "validation": args.max_eval_samples,
             "test": args.max_predict_samples}.get(role, 0)
    if not limit or limit >= len(table):
        return table
    return table.subset(np.arange(limit), f"{table.source}[:{limit}]")


# ---------------------------------------------------------------------------------------------------- order / resume
def rank_order(n: int, epoch: int, seed: int, rank: int, world_size: int, shuffle: bool) -> np.ndarray:
    """This rank's rows for the epoch. shuffle (train): the tail is dropped so all ranks have n // world rows.
    No shuffle (eval): every row once, ranks padded to equal length with repeats encoded as -1 - row."""
    order = np.random.default_rng(seed + epoch).permutation(n) if shuffle else np.arange(n)
    if shuffle:
        per = n // world_size
        order = order[:per * world_size]
    else:
        per = -(-n // world_size)
        pad = per * world_size - n
        if pad:
            order = np.concatenate([order, -1 - order[:pad]])
    return order[rank::world_size]


# ---------------------------------------------------------------------------------------------------- workers
class _Batches(torch.utils.data.Sampler):
    """Yields (end_offset, rows) per batch from the current (epoch, offset); iterated in the main process each time
    the DataLoader starts, so persistent workers follow epoch changes and resumes."""

    def __init__(self, owner: "CaptionData"):
        self.owner = owner

    def __iter__(self):
        order, b = self.owner._order, self.owner.micro_batch
        for start in range(self.owner._offset, len(order), b):
            end = min(start + b, len(order))
            yield end, order[start:end]

    def __len__(self) -> int:
        return math.ceil(max(0, len(self.owner._order) - self.owner._offset) / self.owner.micro_batch)


class _Fetch(torch.utils.data.Dataset):
    """Worker side: one call builds one batch (host: decoded uint8 pixels; device: encoded bytes) plus tokens."""

    def __init__(self, table: CaptionTable, tokenizer, size: int, host: bool, draft: bool, max_pixels: int,
                 max_len: int, pad_to_max: bool):
        self.table, self.tokenizer, self.size, self.host = table, tokenizer, size, host
        self.draft, self.max_pixels, self.max_len, self.pad_to_max = draft, max_pixels, max_len, pad_to_max

    def __len__(self) -> int:
        return len(self.table)

    def _tokens(self, captions: list[str]) -> dict:
        enc = self.tokenizer(captions, truncation=True, max_length=self.max_len, return_tensors="pt",
                             padding="max_length" if self.pad_to_max else "longest")
        return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()}

    def __getitem__(self, spec) -> dict:
        end, rows = spec
        index = np.where(rows < 0, -1, rows)  # -1 marks an eval pad row (a repeat, to be ignored by metrics)
        real = np.where(rows < 0, -1 - rows, rows)
        items, names, bad = [], [], []
        keep = []
        for k, r in enumerate(real):
            data, name = self.table.load(int(r))
            if self.host and not isinstance(data, BadImage):
                try:
                    data = host_transform(data, name, self.size, self.draft, self.max_pixels)
                except BadImage as e:
                    data = e
            if isinstance(data, BadImage):  # dropped here; device decoders report their own failures
                bad.append((data.name, data.reason))
                continue
            keep.append(k)
            items.append(data)
            names.append(name)
        out = {"end": int(end), "bad": bad, "rows": len(rows)}
        caps = [self.table.captions[int(real[k])] for k in keep]
        out.update(self._tokens(caps) if caps else {})
        out["index"] = torch.as_tensor(index[keep], dtype=torch.long)
        if self.host:
            out["pixels_u8"] = torch.from_numpy(np.stack(items)) if items else None
        else:
            out["encoded"], out["names"] = items, names
        return out


# ---------------------------------------------------------------------------------------------------- data source
class CaptionData:
    """ds_core.loop.DataSource over one split for one rank. Yields dicts on `device`:
    input_ids [B,T] long, attention_mask [B,T] long, pixel_values [B,3,S,S] float32 (CLIP-normalized),
    pixel_mask [B,S,S] long, index [B] long (dataset row; -1 for eval pad rows and fill-in rows).

    Bad images are dropped (batch may be smaller). A batch with nothing valid is skipped on one rank; with several
    ranks it is replaced by one already-seen valid sample (index -1) so every rank runs the same number of steps
    (a skipped step on one rank would leave the others waiting in a collective).
    """

    def __init__(self, args: DataArgs, table: CaptionTable, tokenizer, image_size: int, rank: int, world_size: int,
                 micro_batch: int, seed: int, device, shuffle: bool = True, pipeline: str | None = None):
        args.validate()
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self.args, self.table, self.tokenizer = args, table, tokenizer
        self.size = int(args.image_size or image_size)
        if self.size < 1:
            raise ValueError("image size unknown: pass image_size (the model's vision size) or --image_size")
        self.rank, self.world_size, self.micro_batch, self.seed = rank, world_size, micro_batch, seed
        self.device, self.shuffle = torch.device(device), shuffle
        if pipeline is None:
            pipeline, why = resolve_pipeline(args.requested_pipeline, self.device)
            if rank == 0:
                print(f"[bridgetower_ds] image pipeline: {pipeline} ({why})", flush=True)
        self.pipeline = pipeline
        if shuffle and len(table) < world_size:
            raise ValueError(f"{table.source}: {len(table)} rows < world size {world_size}")
        self._epoch, self._offset = 0, 0
        self._order = rank_order(len(table), 0, seed, rank, world_size, shuffle)
        self.bad_images = 0
        self.bad_examples: list[str] = []
        self.filler_batches = 0
        self._last_good: dict | None = None
        pad_to_max = args.pad_to_max_length or self.device.type == "hpu"
        self._fetch = _Fetch(table, tokenizer, self.size, pipeline == "host", args.jpeg_draft, args.max_image_pixels,
                             args.max_seq_length, pad_to_max)
        self._decoder = None
        self._hpu = None
        if pipeline == "device-hpu":
            from .hpu_media import HpuMediaLoader  # noqa: PLC0415

            self._hpu = HpuMediaLoader(self, pad_to_max_length=True)
        elif pipeline != "host":
            self._decoder = make_device_decoder(pipeline, self.size, self.device, args.jpeg_draft,
                                                args.max_image_pixels, args.decode_threads)
        self._loader = None

    # -- DataSource protocol
    def set_epoch(self, epoch: int) -> None:
        self._epoch, self._offset = int(epoch), 0
        self._order = rank_order(len(self.table), self._epoch, self.seed, self.rank, self.world_size, self.shuffle)

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "offset": self._offset, "seed": self.seed, "world_size": self.world_size,
                "rows": len(self.table), "bad_images": self.bad_images}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_size", self.world_size) != self.world_size or state.get("rows", len(self.table)) != len(
                self.table):
            raise ValueError(f"data position was saved for world size {state.get('world_size')} and "
                             f"{state.get('rows')} rows; this run has {self.world_size} and {len(self.table)}: "
                             "the per-rank order would differ, so the position cannot be restored exactly")
        self.set_epoch(int(state["epoch"]))
        self._offset = int(state["offset"])
        self.bad_images = int(state.get("bad_images", self.bad_images))

    def summary_stats(self) -> dict:
        out = {"bad_images": self.bad_images, "bad_image_examples": list(self.bad_examples)}
        if self.filler_batches:
            out["filler_batches"] = self.filler_batches
        return out

    def __len__(self) -> int:
        """Batches in a full epoch on this rank."""
        return math.ceil(len(self._order) / self.micro_batch)

    def __iter__(self) -> Iterator[dict]:
        if self._hpu is not None:
            yield from self._hpu.iterate()
            return
        for raw in self._raw_batches():
            batch = self._finish(raw)
            self._offset = raw["end"]
            if batch is None:
                batch = self._fill_in()
                if batch is None:
                    continue
            yield batch

    # -- internals
    def _raw_batches(self) -> Iterator[dict]:
        workers = self.args.dataloader_num_workers
        if workers == 0:
            for spec in _Batches(self):
                yield self._fetch[spec]
            return
        if self._loader is None:
            self._loader = torch.utils.data.DataLoader(
                self._fetch, sampler=_Batches(self), batch_size=None, num_workers=workers, persistent_workers=True,
                prefetch_factor=2, pin_memory=self.device.type == "cuda", timeout=self.args.dataloader_timeout_s,
                collate_fn=_identity)
        yield from self._loader

    def record_bad(self, bad: list) -> None:
        for name, reason in bad:
            if self.args.bad_image == "error":
                raise BadImage(name, reason + " (--bad_image error; use --bad_image skip to drop such images)")
            self.bad_images += 1
            entry = f"{name}: {reason}"
            if len(self.bad_examples) < MAX_BAD_EXAMPLES and entry not in self.bad_examples:
                self.bad_examples.append(entry)
                log.warning("[bridgetower_ds] rank %d skipping bad image %s", self.rank, entry)

    def _finish(self, raw: dict) -> dict | None:
        """Worker output -> batch on the device (decoding there for device pipelines); None when nothing is valid."""
        bad = list(raw["bad"])
        if self._decoder is not None and raw.get("encoded"):
            pixel_values, keep, dbad = self._decoder(raw["encoded"], raw["names"])
            bad.extend((b.name, b.reason) for b in dbad)
        elif self._decoder is None and raw.get("pixels_u8") is not None:
            pixel_values = normalize(raw["pixels_u8"], self.device)
            keep = list(range(pixel_values.shape[0]))
        else:
            pixel_values, keep = None, []
        self.record_bad(bad)
        if pixel_values is None or not keep:
            return None
        sel = torch.as_tensor(keep, dtype=torch.long)
        full = len(keep) == raw["input_ids"].shape[0]
        batch = {k: (raw[k] if full else raw[k][sel]).to(self.device, non_blocking=True)
                 for k in ("input_ids", "attention_mask", "index")}
        batch["pixel_values"] = pixel_values
        batch["pixel_mask"] = torch.ones((len(keep), self.size, self.size), dtype=torch.long, device=self.device)
        if self.world_size > 1:
            self._last_good = {k: v[:1] for k, v in batch.items()}
        return batch

    def _fill_in(self) -> dict | None:
        """A batch with nothing valid: skip (one rank) or substitute one seen-valid sample (several ranks)."""
        if self.world_size == 1:
            return None
        if self._last_good is None:
            self._last_good = self._first_valid_sample()
        self.filler_batches += 1
        out = dict(self._last_good)
        out["index"] = torch.full_like(out["index"], -1)
        return out

    def _first_valid_sample(self) -> dict:
        order = rank_order(len(self.table), self._epoch, self.seed, self.rank, self.world_size, self.shuffle)
        host = _Fetch(self.table, self.tokenizer, self.size, True, self.args.jpeg_draft, self.args.max_image_pixels,
                      self.args.max_seq_length, self._fetch.pad_to_max)
        for r in order:
            raw = host[(0, np.array([r]))]
            if raw.get("pixels_u8") is not None:
                return {"input_ids": raw["input_ids"].to(self.device), "attention_mask": raw["attention_mask"].to(
                    self.device), "index": torch.full((1,), -1, dtype=torch.long, device=self.device),
                    "pixel_values": normalize(raw["pixels_u8"], self.device),
                    "pixel_mask": torch.ones((1, self.size, self.size), dtype=torch.long, device=self.device)}
        raise RuntimeError(f"{self.table.source}: rank {self.rank} has no readable image at all in epoch "
                           f"{self._epoch}; see the bad-image log lines")

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()
        self._loader = None


def _identity(x):
    return x


def build_data(args: DataArgs, split: str, tokenizer, image_size: int, rank: int, world_size: int,
               micro_batch: int, seed: int, device, shuffle: bool = True) -> CaptionData:
    """The per-rank DataSource for `split` (train|validation|test or the configured split names)."""
    args.validate()
    table = limit_rows(args, split, select_split(args, split))
    if len(table) == 0:
        raise ValueError(f"{args.dataset_path or args.dataset_name}: split {split!r} is empty")
    return CaptionData(args, table, tokenizer, image_size, rank, world_size, micro_batch, seed, device, shuffle)
