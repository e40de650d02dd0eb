"""Chroma upsampling of nvJPEG's output made equal to libjpeg's, for the CUDA device image pipeline.

A JPEG usually stores its two chroma planes at half resolution (4:2:0, 4:2:2, 4:4:0). libjpeg-turbo, which decodes
for the reference (torchvision's `read_image` and PIL in run_bridgetower.py) and for our host pipeline, upsamples them
with its default "fancy" filter: each output chroma sample is 3/4 of the nearest stored sample plus 1/4 of the next
one in each subsampled direction (a triangle filter, the edge sample repeated). nvJPEG (torchvision.io.decode_jpeg
on the GPU) repeats each stored sample instead (box upsampling; libjpeg-turbo does the same with fancy upsampling
off). At a sharp colour edge the two differ by up to a quarter of the chroma step: tens of grey levels, which a
downscaling resize blurs but an image already near the target size keeps (a 300 x 300 photo at 294 px: 33 levels).

nvJPEG only returns RGB, so the stored chroma is recovered from it. With box upsampling every pixel of one chroma
block has the same chroma, and YCbCr -> RGB is RGB = Y + D(Cb, Cr) with luma weights that cancel D
(0.299 D_r + 0.587 D_g + 0.114 D_b = 0). So Y = 0.299 R + 0.587 G + 0.114 B per pixel, D = RGB - Y, and the block
mean of D is the stored chroma's contribution (per-pixel rounding averaged out). Bilinear interpolation with
align_corners=False at the block factor is exactly libjpeg's triangle filter (same 3/4 and 1/4 weights, edges
repeated); the result is Y + D_upsampled, rounded and clamped like a decoded image. What stays different: integer
rounding (libjpeg rounds chroma before the colour conversion; <= 1 grey level) and pixels nvJPEG clamped to 0 or 255,
whose Y and D are no longer recoverable exactly (saturated colours at an edge: a few grey levels).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# ITU-R BT.601 luma weights, as JFIF's YCbCr defines them (libjpeg's jccolor.c / jdcolor.c)
LUMA = (0.299, 0.587, 0.114)
# (horizontal, vertical) chroma block factors whose libjpeg upsampling is the triangle filter (jdsample.c:
# h2v1, h2v2, h1v2 fancy upsamplers). (1, 1) needs nothing; others (4:1:1) libjpeg upsamples by repetition too.
FANCY = ((2, 1), (2, 2), (1, 2))


@functools.lru_cache(maxsize=8)
def _luma(device: torch.device) -> torch.Tensor:
    """The luma weights as a [1, 3, 1, 1] float32 tensor on `device`, made once (not a host-to-device copy per
    image)."""
    return torch.tensor(LUMA, dtype=torch.float32).view(1, 3, 1, 1).to(device)


def chroma_factors(im) -> tuple[int, int] | None:
    """(horizontal, vertical) chroma subsampling of a 3-component YCbCr JPEG opened by PIL (header only):
    (1, 1) for 4:4:4, (2, 2) for 4:2:0, (2, 1) for 4:2:2, ... None when the two chroma planes differ in sampling,
    the factors are not whole numbers, or the file is not YCbCr (Adobe RGB JPEGs): the caller decodes those on the
    CPU."""
    layers = getattr(im, "layer", None) or []
    if len(layers) != 3 or im.info.get("adobe_transform") == 0:
        return None
    max_h, max_v = max(c[1] for c in layers), max(c[2] for c in layers)
    (_, h1, v1, _), (_, h2, v2, _) = layers[1], layers[2]
    if (h1, v1) != (h2, v2) or max_h % h1 or max_v % v1:
        return None
    return max_h // h1, max_v // v1


def needs_fancy(factors: tuple[int, int] | None, width: int) -> bool:
    """Whether libjpeg would upsample this image's chroma with the triangle filter (and nvJPEG's output must be
    corrected). libjpeg keeps plain repetition for a horizontally subsampled chroma plane of <= 2 samples."""
    if factors not in FANCY:
        return False
    return not (factors[0] == 2 and -(-width // 2) <= 2)


def fancy_upsample_chroma(rgb: torch.Tensor, factors: tuple[int, int]) -> torch.Tensor:
    """[3, H, W] uint8 RGB decoded with box chroma upsampling -> [3, H, W] float32 (integers 0..255) as libjpeg's
    fancy upsampling would have decoded it (see the module docstring for the derivation and what stays different)."""
    fh, fv = factors
    x = rgb.unsqueeze(0).float()
    h, w = x.shape[-2:]
    pad_h, pad_w = -h % fv, -w % fh
    if pad_h or pad_w:  # a partial block at the right / bottom edge: its pixels repeat, as libjpeg's padding does
        x = F.pad(x, (0, pad_w, 0, pad_h), mode="replicate")
    y = (x * _luma(x.device)).sum(1, keepdim=True)
    stored = F.avg_pool2d(x - y, (fv, fh))
    up = F.interpolate(stored, scale_factor=(fv, fh), mode="bilinear", align_corners=False)
    return (y + up)[0, :, :h, :w].round_().clamp_(0, 255)
