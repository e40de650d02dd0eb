"""The image pipeline of a BridgeTower run, decided once and handed down: --image_pipeline (host | device | auto, or
--mediapipe_dataloader) and the training device resolve to one ImagePipeline (images.resolve_pipeline says how), and
the data path asks it, never the flag again: whether the DataLoader workers decode (fetch.FetchBatch), what turns a
worker's batch into normalized pixels in the training process (a PixelSource), and whether a Habana media pipe
replaces both (hpu_media.HpuMediaLoader)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import log
from .images import make_device_decoder, normalize, resolve_pipeline

PIPELINES = ("host", "device-cpu", "device-cuda", "device-hpu")


@dataclass(frozen=True)
class ImagePipeline:
    """host: decode, resize and crop in the DataLoader workers (uint8 pixels), normalize on the device; device-cpu /
    device-cuda: the workers read encoded bytes and a per-batch decoder in the training process decodes them (a CPU
    thread pool, nvJPEG); device-hpu: a Habana media pipe reads, decodes and normalizes on the Gaudi."""

    name: str
    reason: str = ""

    def __post_init__(self) -> None:
        if self.name not in PIPELINES:
            raise ValueError(f"image pipeline {self.name!r}: expected one of {', '.join(PIPELINES)}")

    @classmethod
    def resolve(cls, requested: str, device: torch.device | str, flag: str = "") -> "ImagePipeline":
        """The pipeline --image_pipeline asks for on `device` (images.resolve_pipeline: errors name `flag`, the
        option as the user gave it)."""
        return cls(*resolve_pipeline(requested, device, flag))

    @property
    def decodes_in_workers(self) -> bool:
        """The DataLoader workers hand over decoded uint8 pixels (else encoded bytes)."""
        return self.name == "host"

    @property
    def media_pipe(self) -> bool:
        """A Habana media pipe yields whole batches (hpu_media.HpuMediaLoader): no DataLoader, no PixelSource."""
        return self.name == "device-hpu"

    def announce(self, rank: int) -> None:
        log.say(f"image pipeline: {self.name} ({self.reason})", rank=rank)

    def pixel_source(self, size: int, device: torch.device, args: Any) -> "PixelSource":
        """What turns a worker's batch into normalized pixel values on `device`; args: the run's DataArgs."""
        if self.decodes_in_workers:
            return HostPixels(device)
        if self.media_pipe:
            raise ValueError("the HPU media pipe yields whole batches: it has no per-batch PixelSource")
        return DevicePixels(make_device_decoder(self.name, size, device, args.jpeg_draft, args.max_image_pixels,
                                                args.decode_threads, args.image_transform))

    def __str__(self) -> str:
        return self.name


HOST = ImagePipeline("host", "decoded by the DataLoader workers")


class PixelSource:
    """A worker's batch (fetch.FetchBatch's dict) -> (pixel_values [N, 3, S, S] float32 on the device or None, the
    positions of the rows kept, [(name, reason)] of the images that failed here)."""

    def __call__(self, raw: dict) -> tuple[torch.Tensor | None, list[int], list[tuple[str, str]]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the source holds (decoder threads)."""


class HostPixels(PixelSource):
    """Decoded uint8 pixels from the workers, normalized on the device (bad images were dropped by the workers)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, raw: dict) -> tuple[torch.Tensor | None, list[int], list[tuple[str, str]]]:
        if raw.get("pixels_u8") is None:
            return None, [], []
        pixel_values = normalize(raw["pixels_u8"], self.device)
        return pixel_values, list(range(pixel_values.shape[0])), []


class DevicePixels(PixelSource):
    """Encoded bytes from the workers, decoded per batch in the training process (images.make_device_decoder)."""

    def __init__(self, decoder: Any):
        self.decoder = decoder

    def __call__(self, raw: dict) -> tuple[torch.Tensor | None, list[int], list[tuple[str, str]]]:
        if not raw.get("encoded"):
            return None, [], []
        pixel_values, keep, bad = self.decoder(raw["encoded"], raw["names"])
        return pixel_values, keep, [(b.name, b.reason) for b in bad]

    def close(self) -> None:
        self.decoder.close()


__all__ = ["ImagePipeline", "HOST", "PIPELINES", "PixelSource", "HostPixels", "DevicePixels"]
