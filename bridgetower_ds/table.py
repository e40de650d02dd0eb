"""One split of image-caption rows (CaptionTable): what the data sources produce and the fetchers read.

Its own module so that both bridgetower_ds.data (which builds tables from the sources) and bridgetower_ds.fetch (which
reads rows of one in DataLoader workers) import it, and neither imports the other.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from .images import BadImage, read_bytes


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
