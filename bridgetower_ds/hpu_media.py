"""HPU device pipeline: a Habana media pipe decodes, center-crops, resizes and normalizes JPEGs on the Gaudi.

Graph (habana_frameworks.mediapipe, documented operators only):
    fn.MediaExtReaderOp (our reader: file list + tokens + row ids, from the data source's BatchPlan)
      -> fn.ImageDecoder(device="hpu", output_format=RGB_P, random_crop_type=CENTER_CROP, resize=[S, S], BICUBIC)
      -> fn.CropMirrorNorm(crop S x S, mean*255, 1/(std*255), FLOAT32)
and habana_frameworks.mediapipe.plugins.iterator_pytorch.HPUGenericPytorchIterator hands the outputs to torch.

Differences from the host pipeline, stated rather than hidden: the decoder's CENTER_CROP takes the largest centered
square and resizes it to S x S, which equals "shorter side to S, then center crop" except for the reference's
size_divisor flooring and its 1333/800 long-side cap (aspect > 1.67 pads in the reference). So the pipe has one
geometry whatever `--image_transform` says: the region run_bridgetower.py's Resize([S]) + CenterCrop(S) keeps (up to
a pixel of crop offset), resampled by the media decoder's bicubic, which is not torchvision's antialias filter: pixel
equality with the host pipeline is not claimed on HPU (it is, and tested, for the CPU and CUDA decoders). The HPU
decoder reads
JPEG files only (images stored as bytes in a dataset are written to files once: `--image_cache_dir`), at a
fixed batch size: rows that are not plain RGB/grayscale JPEG files (missing, empty, truncated
without an EOI marker, PNG content, CMYK) are replaced by a known-good file and dropped after decoding, and count as
bad images exactly as on the other pipelines.

This module is imported only when `--image_pipeline device|auto` resolves to an HPU with the media package present.
"""
from __future__ import annotations

import os
import stat
from collections import deque
from pathlib import Path

import numpy as np
import torch

from . import log
from .batching import tokenize
from .images import CLIP_MEAN, CLIP_STD, BadImage, open_image

try:
    from habana_frameworks.mediapipe import fn
    from habana_frameworks.mediapipe.media_types import dtype as mdt, ftype, imgtype, randomCropType, readerOutType
    from habana_frameworks.mediapipe.mediapipe import MediaPipe
    from habana_frameworks.mediapipe.operators.reader_nodes.reader_nodes import (
        media_ext_reader_op_impl,
        media_ext_reader_op_tensor_info,
    )
    from habana_frameworks.mediapipe.plugins.iterator_pytorch import HPUGenericPytorchIterator
    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - only on Gaudi machines
    _IMPORT_ERROR = e
    media_ext_reader_op_impl = object
    MediaPipe = object


def check_hpu_media() -> None:
    if _IMPORT_ERROR is not None:
        raise RuntimeError("--image_pipeline device on HPU needs habana_frameworks.mediapipe (pip package "
                           f"habana-media-loader, part of the Gaudi software stack): {_IMPORT_ERROR}")


def jpeg_file_problem(path: str, max_pixels: int) -> str | None:
    """Why the HPU JPEG decoder should not get this file (None when it is fine). Header-only checks."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty file (0 bytes)"
        with open(path, "rb") as f:
            head = f.read(65536)
            f.seek(max(0, size - 2))
            tail = f.read(2)
    except FileNotFoundError:
        return "file not found"
    except OSError as e:
        return f"cannot read: {e}"
    if not head.startswith(b"\xff\xd8\xff"):
        return "not JPEG content (the HPU decoder reads JPEG only; use --image_pipeline host for other formats)"
    if tail != b"\xff\xd9":
        return "truncated JPEG (no end-of-image marker)"
    try:
        im = open_image(head, path, max_pixels)  # lazy: the header is enough for size and mode
        if im.mode not in ("RGB", "L"):
            return f"JPEG mode {im.mode} (the HPU decoder takes RGB/grayscale; use --image_pipeline host)"
    except BadImage as e:
        return e.reason
    return None


def cache_dir_of(cache_dir: str) -> str:
    """Where embedded images are written: --image_cache_dir, else this user's own directory under the system temp
    dir (bt_images-<uid>). Either must be a real directory that this user owns and no one else can write to
    (ds_core.files.check_private_dir): a directory another account made, or can write into, could hand the decoder
    files of its choosing. Made with mode 0700 when missing."""
    from ds_core.files import check_private_dir, private_dir

    if not cache_dir:
        return str(private_dir("bt_images"))
    path = Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(check_private_dir(path))


def _write_new(path: str, data: bytes) -> None:
    """data into `path` through a temporary file made anew (O_EXCL, no symlink followed), renamed into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def materialize(table, cache_dir: str, rank: int) -> list[str]:
    """Write images stored as bytes (e.g. a save_to_disk of a parquet dataset such as the New Yorker caption
    contest) to files, since the media pipe's decoder reads files. Each file is named by the SHA-256 of its bytes, so
    a changed dataset gets new files and never an old image, and rows with the same image share one; an existing file
    of that name and size is reused. Atomic per file (temp name + rename), so ranks sharing the directory can race
    safely. Returns one path per row."""
    import hashlib

    root = cache_dir_of(cache_dir)
    log.say(f"HPU media pipe: embedded images of {table.source} are files in {root} (named by their content; "
            "written once)", rank=rank)
    paths = []
    for i in range(len(table)):
        p = table.path(i)
        if p is None:
            data, _ = table.load(i)
            data = data if isinstance(data, bytes) else b""  # a bad row stays bad (0 bytes)
            p = os.path.join(root, hashlib.sha256(data).hexdigest() + ".jpg")
            try:
                st = os.lstat(p)
                fresh = not (stat.S_ISREG(st.st_mode) and st.st_size == len(data))
            except FileNotFoundError:
                fresh = True
            if fresh:
                _write_new(p, data)
        paths.append(p)
    return paths


class _Reader(media_ext_reader_op_impl):
    """Media pipe reader: one fixed-size batch of file paths + caption tokens + row codes (see prepare)."""

    def __init__(self, params, fw_params):
        self.loader: HpuMediaLoader = params["priv_params"]["loader"]
        self.batch_size = fw_params.batch_size

    def gen_output_info(self):
        b, t = self.batch_size, self.loader.max_len
        return [media_ext_reader_op_tensor_info(mdt.NDT, np.array([b], dtype=np.uint32), ""),
                media_ext_reader_op_tensor_info(mdt.UINT32, np.array([t, b], dtype=np.uint32), ""),
                media_ext_reader_op_tensor_info(mdt.UINT32, np.array([t, b], dtype=np.uint32), ""),
                media_ext_reader_op_tensor_info(mdt.UINT32, np.array([b], dtype=np.uint32), "")]

    def get_largest_file(self):
        return self.loader.largest_file

    def get_media_output_type(self):
        return readerOutType.FILE_LIST

    def __len__(self):
        return len(self.loader.data.pending_batches())

    def __iter__(self):  # called by the pipe's iter_init(): a new pass from the data source's current position
        self._batches = self.loader.start_pass()
        return self

    def __next__(self):
        end, rows = next(self._batches)
        return self.loader.prepare(end, rows)


class _Pipe(MediaPipe):
    def __init__(self, loader: "HpuMediaLoader", batch_size: int, size: int, threads: int = 2):
        import inspect

        kw = dict(batch_size=batch_size, prefetch_depth=2, pipe_name=f"BridgeTowerPipe:{id(loader)}")
        if "num_threads" in inspect.signature(MediaPipe.__init__).parameters:
            kw["num_threads"] = threads
        # "mixed" (CPU reader + HPU ops) in current releases; "legacy" and "hpu" name the same in older ones.
        errors = []
        for device in ("mixed", "legacy", "hpu"):
            try:
                super().__init__(device=device, **kw)
                break
            except (ValueError, RuntimeError, TypeError) as e:
                errors.append(f"{device}: {e}")
        else:
            raise RuntimeError("cannot create the Habana media pipe: " + "; ".join(errors))
        self.reader = fn.MediaExtReaderOp(impl=_Reader, num_outputs=4, priv_params={"loader": loader})
        self.decode = fn.ImageDecoder(device="hpu", output_format=imgtype.RGB_P,
                                      random_crop_type=randomCropType.CENTER_CROP, resize=[size, size],
                                      resampling_mode=ftype.BICUBIC)
        mean = np.array(CLIP_MEAN, dtype=np.float32) * 255
        inv_std = 1.0 / (np.array(CLIP_STD, dtype=np.float32) * 255)
        self.mean = fn.MediaConst(data=mean, shape=[1, 1, 3], dtype=mdt.FLOAT32)
        self.inv_std = fn.MediaConst(data=inv_std, shape=[1, 1, 3], dtype=mdt.FLOAT32)
        self.cmn = fn.CropMirrorNorm(crop_w=size, crop_h=size, crop_pos_x=0.5, crop_pos_y=0.5, crop_d=0,
                                     dtype=mdt.FLOAT32)

    def definegraph(self):
        files, ids, mask, rowid = self.reader()
        images = self.cmn(self.decode(files), self.mean(), self.inv_std())
        return images, ids, mask, rowid


class HpuMediaLoader:
    """Feeds the media pipe from a CaptionData's plan and turns its outputs into batches with the same
    BatchAssembler as the other pipelines. Only public CaptionData members are used: pending_batches(), assembler,
    table, tokenizer, args, micro_batch, size, pad_to_max.

    `make_iterator(loader)` builds the iterator of pipe outputs (images [B,3,S,S] normalized, ids [B,T], mask [B,T],
    rowid [B]); the default builds the Habana media pipe. Tests pass a stand-in decoder that drives the same
    `_Reader` (there is no HPU here).
    """

    def __init__(self, data, make_iterator=None):
        if make_iterator is None:
            check_hpu_media()
        if not data.pad_to_max:  # the reader's outputs have fixed shapes [T, B]
            raise ValueError("the HPU media pipe needs captions padded to max_seq_length (batching.pad_to_max_length "
                             "decides it for HPU devices)")
        self.data = data
        self._make_iterator = make_iterator or _habana_iterator
        self.max_len = data.args.max_seq_length
        table = data.table
        paths = [table.path(i) for i in range(len(table))]
        if any(p is None for p in paths):
            paths = materialize(table, data.args.image_cache_dir, data.rank)
        self.paths = paths
        sizes = [(os.path.getsize(p) if os.path.exists(p) else 0, p) for p in paths]
        self.largest_file = max(sizes)[1]
        self._good_path: str | None = None
        self._pending: deque = deque()  # (end, [(name, reason), ...]) in pipe order
        self._iter = None

    def start_pass(self):
        """The reader's batches for a new pass from the current position (batches prefetched for an abandoned pass
        never reach the consumer)."""
        self._pending.clear()
        return iter(self.data.pending_batches())

    def prepare(self, end: int, rows: np.ndarray):
        """One fixed-size reader batch: files (bad rows replaced by a known-good file), tokens, row codes."""
        b = self.data.micro_batch
        if len(rows) > b:  # batching.split_batches: only micro batch 2 merges an evaluation tail (3 rows)
            raise ValueError(f"HPU media pipe: a batch of {len(rows)} rows for a pipe of fixed batch size {b}; use "
                             "an evaluation micro batch of 3 or more")
        files, caps, rowid, bad = [], [], np.zeros([b], dtype=np.uint32), []
        for k in range(b):
            real = int(rows[k]) if k < len(rows) else None
            problem = None if real is None else jpeg_file_problem(self.paths[real], self.data.args.max_image_pixels)
            if real is not None and problem is None:
                files.append(self.paths[real])
                caps.append(self.data.table.captions[real])
                rowid[k] = real + 1  # 0: no row / dropped row, else row + 1
                self._good_path = self._good_path or self.paths[real]
            else:
                if real is not None:
                    bad.append((self.data.table.name(real), problem))
                files.append(None)
                caps.append("")
        filler = self._good_path or self._find_good()
        files = np.array([f or filler for f in files])
        enc = tokenize(self.data.tokenizer, caps, self.max_len, pad_to_max=True)
        self._pending.append((end, bad))
        return (files, np.ascontiguousarray(enc["input_ids"].numpy().astype(np.uint32)),
                np.ascontiguousarray(enc["attention_mask"].numpy().astype(np.uint32)), rowid)

    def _find_good(self) -> str:
        for p in self.paths:
            if jpeg_file_problem(p, self.data.args.max_image_pixels) is None:
                self._good_path = p
                return p
        raise RuntimeError(f"{self.data.table.source}: no readable RGB JPEG file at all for the HPU media pipe")

    def batches(self):
        """(batches_done after it, batch or None) per pipe output, as CaptionData's other pipelines yield them."""
        if self._iter is None:
            self._iter = self._make_iterator(self)
        for images, ids, mask, rowid in self._iter:
            end, bad = self._pending.popleft()
            rowid = rowid.to(torch.int64).cpu()
            keep = torch.nonzero(rowid != 0).flatten()
            # reader outputs are host tensors (uint32): widen on the host; the assembler moves them
            tokens = {"input_ids": ids.cpu().to(torch.int64), "attention_mask": mask.cpu().to(torch.int64)}
            pixel_values = images[keep.to(images.device)] if keep.numel() else None
            yield end, self.data.assembler.assemble(pixel_values, keep.tolist(), tokens, rowid - 1, bad)


def _habana_iterator(loader: HpuMediaLoader):
    pipe = _Pipe(loader, loader.data.micro_batch, loader.data.size, max(1, loader.data.args.dataloader_num_workers))
    return HPUGenericPytorchIterator(mediapipe=pipe)
