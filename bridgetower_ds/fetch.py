"""DataLoader side of bridgetower_ds.data: the sampler that follows the data source's plan and the per-batch fetch
that runs in the worker processes (split from data.py to keep files small; data.CaptionData owns both)."""
from __future__ import annotations

import numpy as np
import torch

from .batching import tokenize
from .image_pipeline import ImagePipeline
from .images import BadImage, host_transform
from .table import CaptionTable


class PlanSampler(torch.utils.data.Sampler):
    """Yields (batches_done_after, rows) from the source's current position; iterated in the main process each time
    the DataLoader starts, so persistent workers follow epoch changes and resumes."""

    def __init__(self, owner):  # a data.CaptionData: pending_batches()
        self.owner = owner

    def __iter__(self):
        return iter(self.owner.pending_batches())

    def __len__(self) -> int:
        return len(self.owner.pending_batches())


class FetchBatch(torch.utils.data.Dataset):
    """Worker side: one call builds one batch's candidates (host: decoded uint8 pixels; device: encoded bytes) and
    their tokens; rows whose image is already known bad are dropped here and reported."""

    def __init__(self, table: CaptionTable, tokenizer, size: int, pipeline: ImagePipeline, draft: bool,
                 max_pixels: int, max_len: int, pad_to_max: bool, transform: str = "processor"):
        self.table, self.tokenizer, self.size = table, tokenizer, size
        self.host = pipeline.decodes_in_workers  # decided once, by the run's ImagePipeline
        self.draft, self.max_pixels, self.max_len, self.pad_to_max = draft, max_pixels, max_len, pad_to_max
        self.transform = transform

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, spec) -> dict:
        end, rows = spec
        items, names, bad, keep = [], [], [], []
        for r in rows:
            data, name = self.table.load(int(r))
            if self.host and not isinstance(data, BadImage):
                try:
                    data = host_transform(data, name, self.size, self.draft, self.max_pixels, self.transform)
                except BadImage as e:
                    data = e
                except Exception as e:  # noqa: BLE001 - an error escaping a worker would name no image
                    data = BadImage(name, f"{type(e).__name__}: {e}")
            if isinstance(data, BadImage):  # dropped here; device decoders report their own failures
                bad.append((data.name, data.reason))
                continue
            keep.append(int(r))
            items.append(data)
            names.append(name)
        out = {"end": int(end), "bad": bad, "index": torch.as_tensor(keep, dtype=torch.long)}
        if keep:
            out.update(tokenize(self.tokenizer, [self.table.captions[r] for r in keep], self.max_len, self.pad_to_max))
        if self.host:
            out["pixels_u8"] = torch.from_numpy(np.stack(items)) if items else None
        else:
            out["encoded"], out["names"] = items, names
        return out


def identity(x):
    return x
