"""Image decode / resize / crop / normalize for BridgeTower, host side and on the accelerator.

Two geometries (`--image_transform`, both on the host and on the device pipelines, equal to each other):
- "run_bridgetower" (the default: what optimum-habana's examples/contrastive-image-text/run_bridgetower.py trains
  with): torchvision `Resize([S], bicubic)` (shorter side to S, longer side int(S * long / short), antialias as
  torchvision does for tensors), `CenterCrop(S)` (offsets int(round((side - S) / 2))), float, CLIP `Normalize`.
  The resize is torchvision's uint8-tensor path (float32 interpolate, clamp, round): exact against torchvision for
  images read as uint8 tensors; for images the script turns into float tensors first (`to_tensor`, datasets with
  image bytes) the only difference is that rounding to a grey level (<= 0.5 level, plus overshoot clamped).
  Alpha is dropped as PIL's convert("RGB") does.
- "processor": transformers' BridgeTowerImageProcessor exactly: the shorter side goes to S, the longer side is capped
  at int(1333/800*S), both are floored to a multiple of `size_divisor` (32), then an S x S center crop that zero-pads
  when the resized image is smaller than S (very wide or tall images). Zero padding happens in uint8 space, before
  normalization, as in the reference. Where the reference's flooring would leave a side of 0 pixels (aspect ratio
  past ~(1333/800 * S) / 31, e.g. 2000 x 60 at S = 64; the reference fails on such an image) the side keeps its
  unfloored size (>= 1), so every aspect ratio decodes.

Speed: JPEGs are decoded at a reduced DCT scale (1/2, 1/4, 1/8) when that still leaves at least the
resize target (`--jpeg_draft`, PIL's `Image.draft` semantics), and pixels stay uint8 until the accelerator normalizes
them. JPEG decoding goes through simplejpeg (libjpeg-turbo into numpy, bit-identical to PIL's output, less overhead)
when installed, PIL otherwise and for everything that is not a plain RGB/grayscale JPEG. The resize is torch's uint8
bicubic antialias kernel (channels-last, vectorized): same geometry and filter as PIL's bicubic (Keys a=-0.5,
support scaled when downsampling), within 2 grey levels of it (rounding), several times faster on the CPU.

Device pipelines (`--image_pipeline device`) take encoded bytes from the loader workers and decode on the accelerator:
CUDA uses torchvision's batched nvJPEG decoder (chroma upsampled as libjpeg does it: `jpeg_chroma.py`), HPU a
Habana media pipe (see `hpu_media.py`), and CPU a thread pool in the training process. Every decode failure
becomes a `BadImage` naming the file and the reason; callers decide whether to skip or raise (`--bad_image`).
16-bit grayscale images are scaled to 8 bits (`to_8bit`; transformers' processor refuses them).
"""
from __future__ import annotations

import functools
import io
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from ds_core.device import hpu as hpu_rules
from ds_core.errors import ConfigError

from .jpeg_chroma import chroma_factors, fancy_upsample_chroma, needs_fancy

try:  # libjpeg-turbo straight into a numpy array: bit-identical to PIL's decode, ~40% less CPU per 640x480 image
    import simplejpeg
except ImportError:  # optional: PIL does everything, just slower
    simplejpeg = None

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIZE_DIVISOR = 32
# The decompression-bomb limit, checked by us from the header before any pixel is decoded (PIL's own default,
# ~89.5 MP, deliberately: PIL would only warn there and raise at twice that). 8000 x 8000 (64 MP) is a legitimate
# photo and passes (JPEGs that large are decoded at 1/8 scale); beyond the limit an image is a bad image. Raise it with
# --max_image_pixels; PIL itself still refuses non-JPEG images above 2x its limit (also reported as bad images).
DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
JPEG_MAGIC = b"\xff\xd8\xff"
TRANSFORMS = ("run_bridgetower", "processor")


class BadImage(Exception):
    """An image that cannot be used; `name` is its path (or row id), `reason` says why."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"bad image {name}: {reason}")
        self.name = name
        self.reason = reason


# ---------------------------------------------------------------------------------------------------- geometry
def resize_target(height: int, width: int, shorter: int, size_divisor: int = SIZE_DIVISOR) -> tuple[int, int]:
    """(new_h, new_w) exactly as BridgeTowerImageProcessor.resize computes it (shorter edge, 1333/800 cap, divisor)."""
    longer = int(1333 / 800 * shorter)
    scale = shorter / min(height, width)
    if height < width:
        new_h, new_w = float(shorter), scale * width
    else:
        new_h, new_w = scale * height, float(shorter)
    if max(new_h, new_w) > longer:
        scale = longer / max(new_h, new_w)
        new_h, new_w = scale * new_h, scale * new_w
    new_h, new_w = max(1, int(new_h + 0.5)), max(1, int(new_w + 0.5))
    # The reference floors to the divisor; a side shorter than the divisor would become 0 (and fail): keep it.
    return new_h // size_divisor * size_divisor or new_h, new_w // size_divisor * size_divisor or new_w


def tv_resize_target(height: int, width: int, size: int) -> tuple[int, int]:
    """(new_h, new_w) of torchvision's Resize([size]): shorter side to size, longer int(size * long / short)
    (torchvision.transforms.functional._compute_resized_output_size, no max_size). Never 0: long >= short."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    return (new_long, size) if width <= height else (size, new_long)


def geometry(height: int, width: int, size: int, transform: str = "processor") -> tuple[int, int, int, int]:
    """(resize_h, resize_w, crop_top, crop_left) of one image under `transform` (see the module docstring).
    Offsets are negative where the processor pads (crop_or_pad)."""
    if transform == "processor":
        th, tw = resize_target(height, width, size)
        return th, tw, (th - size) // 2, (tw - size) // 2
    if transform == "run_bridgetower":
        th, tw = tv_resize_target(height, width, size)
        # torchvision's center_crop: int(round(...)), Python's round (half to even), as written there
        return th, tw, int(round((th - size) / 2.0)), int(round((tw - size) / 2.0))
    raise ConfigError(f"--image_transform must be one of {', '.join(TRANSFORMS)}, got {transform!r}")


def crop_at(img: torch.Tensor, top: int, left: int, size: int, transform: str = "processor") -> torch.Tensor:
    """The S x S crop of a resized [..., H, W] tensor at the offsets `geometry` gave (the processor zero-pads)."""
    if transform == "processor":
        return crop_or_pad(img, size)
    return img[..., top:top + size, left:left + size]


def crop_or_pad(img: torch.Tensor, size: int) -> torch.Tensor:
    """Center crop a [..., H, W] tensor to size x size, zero-padding like transformers' center_crop when too small."""
    h, w = img.shape[-2:]
    top, left = (h - size) // 2, (w - size) // 2
    if top >= 0 and left >= 0:
        return img[..., top:top + size, left:left + size]
    out = img.new_zeros(img.shape[:-2] + (max(h, size), max(w, size)))
    pad_t, pad_l = -(-(out.shape[-2] - h) // 2), -(-(out.shape[-1] - w) // 2)  # ceil, as the reference
    out[..., pad_t:pad_t + h, pad_l:pad_l + w] = img
    top, left = top + pad_t, left + pad_l
    return out[..., top:top + size, left:left + size]


# ---------------------------------------------------------------------------------------------------- decode
def read_bytes(path: str) -> bytes:
    """File contents; missing, unreadable or empty files raise BadImage."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise BadImage(path, "file not found") from None
    except OSError as e:
        raise BadImage(path, f"cannot read: {e}") from None
    if not data:
        raise BadImage(path, "empty file (0 bytes)")
    return data


def open_image(data: bytes, name: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Open lazily (header only) by content, not by file name, and apply the pixel-count guard."""
    if not data:
        raise BadImage(name, "empty file (0 bytes)")
    try:
        im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise BadImage(name, "not a recognised image format") from None
    except Image.DecompressionBombError as e:
        raise BadImage(name, f"decompression bomb guard: {e}") from None
    except Exception as e:  # noqa: BLE001 - any decoder error is a bad image, never a crash
        raise BadImage(name, f"cannot open: {type(e).__name__}: {e}") from None
    w, h = im.size
    if w <= 0 or h <= 0:
        raise BadImage(name, f"invalid size {w}x{h}")
    if w * h > max_pixels:
        raise BadImage(name, f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (decompression bomb guard)")
    return im


def to_8bit(im: Image.Image, name: str) -> Image.Image:
    """Images of more than 8 bits per channel, scaled to 8 bits by their declared depth.

    PIL opens 16-bit grayscale PNG/TIFF as mode "I;16" (or "I" in older releases / some TIFFs); PIL's convert("RGB")
    then clips every value above 255, so a photograph turns near-white. transformers' BridgeTowerImageProcessor
    refuses such an image ("values outside the range [0, 255] ... cannot be converted to uint8"). Here they are
    scaled: v -> round(v * 255 / 65535) (= (v + 128) // 257, exact at 0 and 65535). 16-bit RGB(A) PNGs are already
    reduced to 8 bits by PIL itself (high byte), so only the single-channel modes arrive here. 32-bit integer images
    whose values exceed 16 bits and floating-point images ("F") have no defined 8-bit range: bad images.
    """
    if im.mode not in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return im
    arr = np.asarray(im)
    if im.mode == "F":
        raise BadImage(name, "floating-point image (mode F): no defined 8-bit range; save it as 8- or 16-bit")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 65535):
        raise BadImage(name, f"32-bit integer image with values in [{arr.min()}, {arr.max()}]: no defined 8-bit "
                             "range; save it as 8- or 16-bit")
    return Image.fromarray(((arr + 128) // 257).astype(np.uint8), "L")


def to_rgb(im: Image.Image, composite_alpha: bool = True) -> Image.Image:
    """RGB, compositing transparency onto white exactly as transformers' convert_to_rgb does (composite_alpha), or
    dropping it as PIL's convert("RGB") does (run_bridgetower.py); CMYK/L/P converted."""
    if im.mode == "RGB":
        return im
    if composite_alpha and ("A" in im.getbands() or im.info.get("transparency") is not None):
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, im).convert("RGB")
    return im.convert("RGB")


def draft_scale(height: int, width: int, size: int, transform: str = "processor") -> int:
    """The DCT reduction (1, 2, 4, 8) PIL's draft would pick: the largest that keeps >= the resize target."""
    th, tw = geometry(height, width, size, transform)[:2]
    scale = max(1, min(width // max(tw, 1), height // max(th, 1)))  # 0 when upsampling
    return next(s for s in (8, 4, 2, 1) if scale >= s)


def _decode_turbo(data: bytes, name: str, size: int, draft: bool, max_pixels: int, transform: str):
    """simplejpeg fast path for plain JPEGs; None -> let PIL handle it (CMYK, odd files, real errors)."""
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("YCbCr", "Gray", "RGB") or h <= 0 or w <= 0:
        return None
    if w * h > max_pixels:
        raise BadImage(name, f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (decompression bomb guard)")
    s = draft_scale(h, w, size, transform) if draft else 1
    try:
        arr = simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h // s), min_width=-(-w // s))
    except ValueError:  # truncated / corrupt: PIL decides and words the error
        return None
    return arr, (h, w)


def decode(data: bytes, name: str, size: int, draft: bool = True, max_pixels: int = DEFAULT_MAX_PIXELS,
           transform: str = "processor") -> tuple[np.ndarray, tuple[int, int]]:
    """Decode to RGB uint8 HWC. Returns (pixels, (orig_h, orig_w)); pixels may be DCT-reduced when `draft`."""
    if simplejpeg is not None and data[:3] == JPEG_MAGIC:
        out = _decode_turbo(data, name, size, draft, max_pixels, transform)
        if out is not None:
            return out
    im = open_image(data, name, max_pixels)
    w, h = im.size
    try:
        if draft and im.format == "JPEG":
            th, tw = geometry(h, w, size, transform)[:2]
            # draft picks the largest 1/2, 1/4, 1/8 scale that still leaves >= the resize target: no upsampling.
            im.draft("RGB", (max(tw, 1), max(th, 1)))
        im.load()
        im = to_rgb(to_8bit(im, name), composite_alpha=transform == "processor")
        arr = np.array(im)  # writable (torch.from_numpy warns on PIL's read-only view); the fast path is simplejpeg
    except BadImage:
        raise
    except Exception as e:  # noqa: BLE001 - truncated JPEG, broken PNG, odd modes: all bad images
        raise BadImage(name, f"decode failed: {type(e).__name__}: {e}") from None
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise BadImage(name, f"unexpected decoded shape {arr.shape}")
    return arr, (h, w)


def _resize_u8_cpu(t: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor:
    """[1,3,H,W] uint8 channels-last -> resized uint8, torch's vectorized uint8 bicubic antialias kernel."""
    try:
        return F.interpolate(t, out_hw, mode="bicubic", antialias=True)
    except (RuntimeError, NotImplementedError):  # an older torch without the uint8 kernel: float path, PIL rounding
        return resize_float(t.float(), out_hw).to(torch.uint8)


def resize_float(t: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor:
    """[N,3,H,W] float in 0..255 -> bicubic antialias resize, rounded and clamped like a uint8 image (PIL semantics)."""
    return F.interpolate(t, out_hw, mode="bicubic", antialias=True).round_().clamp_(0, 255)


def crop_window(n_in: int, n_out: int, start: int, size: int, max_den: int = 16) -> tuple[int, int, int, int] | None:
    """Resize only the part of one axis that the center crop keeps, plus a margin wider than the filter support.

    With in/out = p/q, an output range [lo, hi) with lo, hi multiples of q maps to the integer input range
    [lo*p/q, hi*p/q), and the antialias filter taps of interior outputs are the same as in the full resize, so the
    kept pixels come out bit-identical (checked in tests) for ~15% less work on 4:3 photos. None -> resize it all.
    """
    from fractions import Fraction

    r = Fraction(n_in, n_out)
    q = r.denominator
    if q > max_den or start < 0:
        return None
    margin = math.ceil(2 * max(r, 1) / r) + 2  # filter support (2 input px, scaled when downsampling) in output px
    lo = max(0, (start - margin) // q * q)
    hi = min(n_out, -(-(start + size + margin) // q) * q)
    if hi - lo >= n_out - q:
        return None
    return int(lo * r), int(hi * r), lo, hi


def resize_crop_u8(arr: np.ndarray, orig_hw: tuple[int, int], size: int, transform: str = "processor") -> np.ndarray:
    """HWC uint8 (possibly draft-reduced) -> [3, S, S] uint8 (CHW) with the `transform` geometry, on the CPU.

    processor: torch's uint8 antialias kernel (PIL's filter, within 2 grey levels of it). run_bridgetower: the float32
    kernel, clamped and rounded, which is exactly what torchvision's Resize does to a uint8 tensor."""
    th, tw, top, left = geometry(orig_hw[0], orig_hw[1], size, transform)
    t = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1).unsqueeze(0)  # channels-last view, no copy
    h, w = t.shape[-2:]
    resize = _resize_u8_cpu if transform == "processor" else (lambda x, hw: resize_float(x.float(), hw).to(torch.uint8))
    if (h, w) != (th, tw):
        # windowed resize for the processor only: the float kernel's sums round differently on a window (1 grey
        # level on a few pixels), and run_bridgetower's pixels are meant to equal torchvision's exactly
        windowed = top >= 0 and left >= 0 and transform == "processor"
        win_y = crop_window(h, th, top, size) if windowed else None
        win_x = crop_window(w, tw, left, size) if windowed else None
        y0, y1, oy0, oy1 = win_y or (0, h, 0, th)
        x0, x1, ox0, ox1 = win_x or (0, w, 0, tw)
        t = resize(t[..., y0:y1, x0:x1], (oy1 - oy0, ox1 - ox0))
        if win_y or win_x:
            t = t[..., top - oy0:top - oy0 + size, left - ox0:left - ox0 + size]
            top = left = 0  # t is the S x S crop already
    # The one copy of the crop, into CHW: the accelerator then converts contiguous memory (no strided gather).
    return crop_at(t, top, left, size, transform)[0].contiguous().numpy()


def host_transform(data: bytes, name: str, size: int, draft: bool = True,
                   max_pixels: int = DEFAULT_MAX_PIXELS, transform: str = "processor") -> np.ndarray:
    """The host pipeline for one image: bytes -> [3, S, S] uint8 (normalization happens on the accelerator).
    Any failure, also past decoding (an extreme aspect ratio, memory), is a BadImage naming the image."""
    arr, orig = decode(data, name, size, draft, max_pixels, transform)
    try:
        return resize_crop_u8(arr, orig, size, transform)
    except Exception as e:  # noqa: BLE001 - a worker must never die on one image without naming it
        raise BadImage(name, f"resize/crop of {orig[1]}x{orig[0]} to {size} px failed: {type(e).__name__}: {e}") \
            from None


def normalize(u8: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """[B,3,S,S] uint8 -> [B,3,S,S] float32 CLIP-normalized, computed on `device` (the uint8 batch is what moves).

    One fused scale-and-shift, x * 1/(255 std) - mean/std: within 1e-6 of the reference's (x/255 - mean)/std.
    """
    x = u8.to(device, non_blocking=True) if device is not None else u8
    scale, shift = _clip_affine(x.device)
    return torch.addcmul(shift, x.float(), scale)


@functools.lru_cache(maxsize=8)
def _clip_affine(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """normalize's scale and shift on `device`, made once per device: building them per batch costs ~10 host ops
    and two blocking host-to-device copies every step."""
    std = torch.tensor(CLIP_STD, dtype=torch.float64)
    scale = (1.0 / (255.0 * std)).float().view(1, 3, 1, 1).to(device)
    shift = (-torch.tensor(CLIP_MEAN, dtype=torch.float64) / std).float().view(1, 3, 1, 1).to(device)
    return scale, shift


# ---------------------------------------------------------------------------------------------------- device decoders
class DeviceDecoder:
    """Turns a batch of encoded images into normalized pixel_values on the accelerator.

    __call__(items, names) -> (pixel_values [B',3,S,S] float32 on device, kept row positions, [BadImage, ...]).
    `items[i]` is the encoded bytes, or a BadImage already found by the loader worker (missing/empty file).
    """

    name = "device"

    def __init__(self, size: int, device: torch.device, draft: bool = True, max_pixels: int = DEFAULT_MAX_PIXELS,
                 transform: str = "processor"):
        self.size, self.device, self.draft, self.max_pixels = size, torch.device(device), draft, max_pixels
        geometry(1, 1, size, transform)  # an unknown transform fails here, not in a worker
        self.transform = transform

    def __call__(self, items: Sequence, names: Sequence[str]):
        raise NotImplementedError

    def close(self) -> None:
        pass


class ThreadDecoder(DeviceDecoder):
    """CPU device pipeline: decode + resize + crop in a thread pool inside the training process.

    PIL's decoder and torch's resize both release the GIL, so threads scale across cores without worker processes.
    """

    name = "device-cpu"

    def __init__(self, size, device, draft=True, max_pixels=DEFAULT_MAX_PIXELS, threads: int = 0,
                 transform: str = "processor"):
        super().__init__(size, device, draft, max_pixels, transform)
        self.threads = threads or max(1, min(8, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bt-decode")

    def _one(self, item, name):
        if isinstance(item, BadImage):
            return item
        try:
            return host_transform(item, name, self.size, self.draft, self.max_pixels, self.transform)
        except BadImage as e:
            return e
        except Exception as e:  # noqa: BLE001 - named, never a dead pool thread
            return BadImage(name, f"{type(e).__name__}: {e}")

    def decode_u8(self, items, names) -> tuple[list[np.ndarray], list[int], list[BadImage]]:
        results = list(self._pool.map(self._one, items, names))
        keep = [i for i, r in enumerate(results) if not isinstance(r, BadImage)]
        return [results[i] for i in keep], keep, [r for r in results if isinstance(r, BadImage)]

    def __call__(self, items, names):
        arrs, keep, bad = self.decode_u8(items, names)
        if not arrs:
            return None, keep, bad
        return normalize(torch.from_numpy(np.stack(arrs)), self.device), keep, bad

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


def _torchvision_io():
    try:
        import torchvision.io as tvio  # optional: only the CUDA device pipeline needs it
    except ImportError as e:
        raise RuntimeError(
            "--image_pipeline device on CUDA needs torchvision (torchvision.io.decode_jpeg for nvJPEG decoding), "
            f"which is not importable here ({e}). Install the torchvision build matching your CUDA torch, or use "
            "--image_pipeline host.") from None
    return tvio


class CudaDecoder(DeviceDecoder):
    """CUDA device pipeline: batched nvJPEG decode (torchvision.io.decode_jpeg on the GPU) + GPU resize/crop/normalize.

    nvJPEG repeats subsampled chroma where libjpeg (the host pipeline's and the reference's decoder) interpolates it;
    jpeg_chroma redoes the interpolation on the GPU, so the pixels equal the host pipeline's up to rounding (and a
    few grey levels next to colours nvJPEG clamped). JPEGs whose chroma planes it cannot describe go to the CPU.

    Images nvJPEG should not take go to a CPU thread pool with the host path's semantics: non-JPEG content (a PNG named
    .jpg), CMYK JPEGs, JPEGs without an end marker (truncated: PIL decides and words the error), and JPEGs that
    `draft` would reduce >= 2x (8000 x 8000 photos: decoding them at full size on the
    GPU would cost hundreds of MB per image for pixels that are thrown away).
    """

    name = "device-cuda"

    def __init__(self, size, device, draft=True, max_pixels=DEFAULT_MAX_PIXELS, threads: int = 0,
                 transform: str = "processor"):
        super().__init__(size, device, draft, max_pixels, transform)
        self.tvio = _torchvision_io()
        self.cpu = ThreadDecoder(size, "cpu", draft, max_pixels, threads, transform)

    def _gpu_eligible(self, data: bytes, name: str) -> tuple[int, int] | None:
        """The chroma factors (jpeg_chroma.chroma_factors; (1, 1) for grayscale) when nvJPEG should decode it;
        None -> CPU fallback. Raises BadImage on header problems."""
        im = open_image(data, name, self.max_pixels)
        if im.format != "JPEG" or im.mode not in ("RGB", "L"):
            return None
        if not data.rstrip(b"\x00").endswith(b"\xff\xd9"):  # no end-of-image marker: nvJPEG may not complain
            return None
        w, h = im.size
        if self.draft and draft_scale(h, w, self.size, self.transform) >= 2:
            return None
        return chroma_factors(im) if im.mode == "RGB" else (1, 1)

    def _resize_crop(self, img: torch.Tensor, factors: tuple[int, int]) -> torch.Tensor:
        """One nvJPEG-decoded [3, H, W] uint8 image -> [3, S, S] (float or uint8, integer grey levels): the chroma
        upsampled as libjpeg does it (jpeg_chroma), then the host pipeline's float resize and crop."""
        th, tw, top, left = geometry(img.shape[-2], img.shape[-1], self.size, self.transform)
        x = fancy_upsample_chroma(img, factors) if needs_fancy(factors, img.shape[-1]) else img
        x = x.unsqueeze(0)
        if x.shape[-2:] != (th, tw):
            x = resize_float(x.float(), (th, tw))
        return crop_at(x, top, left, self.size, self.transform)[0]

    def __call__(self, items, names):
        out: dict[int, torch.Tensor] = {}
        bad: list[BadImage] = []
        gpu_rows, cpu_rows, factors = [], [], {}
        for i, (item, name) in enumerate(zip(items, names)):
            if isinstance(item, BadImage):
                bad.append(item)
                continue
            try:
                factors[i] = self._gpu_eligible(item, name)
            except BadImage as e:
                bad.append(e)
                continue
            (gpu_rows if factors[i] else cpu_rows).append(i)
        if gpu_rows:
            datas = [torch.frombuffer(bytearray(items[i]), dtype=torch.uint8) for i in gpu_rows]
            try:
                decoded = self.tvio.decode_jpeg(datas, mode=self.tvio.ImageReadMode.RGB, device=self.device)
            except (RuntimeError, TypeError, ValueError):  # one corrupt stream fails the whole batched call (older
                # torchvision: no list input at all): decode one by one
                decoded = []
                for i, d in zip(gpu_rows, datas):
                    try:
                        decoded.append(self.tvio.decode_jpeg(d, mode=self.tvio.ImageReadMode.RGB, device=self.device))
                    except (RuntimeError, ValueError):
                        decoded.append(None)
                        cpu_rows.append(i)  # PIL decides whether it is really bad (and says why)
            for i, img in zip(gpu_rows, decoded):
                if img is None:
                    continue
                try:
                    out[i] = self._resize_crop(img, factors[i])
                except Exception as e:  # noqa: BLE001 - e.g. out of memory on one huge image: named, not a crash
                    bad.append(BadImage(names[i], f"resize/crop on {self.device} failed: {type(e).__name__}: {e}"))
        if cpu_rows:
            cpu_rows.sort()
            arrs, keep, cbad = self.cpu.decode_u8([items[i] for i in cpu_rows], [names[i] for i in cpu_rows])
            bad.extend(cbad)
            for k, a in zip(keep, arrs):
                out[cpu_rows[k]] = torch.from_numpy(a).to(self.device, non_blocking=True)
        keep = sorted(out)
        if not keep:
            return None, keep, bad
        return normalize(torch.stack([out[i].to(torch.uint8) for i in keep])), keep, bad

    def close(self):
        self.cpu.close()


# ---------------------------------------------------------------------------------------------------- selection
def hpu_available() -> tuple[bool, str]:
    try:
        import habana_frameworks.torch.hpu as hthpu
    except ImportError:
        return False, "habana_frameworks.torch is not installed"
    try:
        if not hthpu.is_available():
            return False, "habana_frameworks.torch is installed but no HPU is visible"
    except Exception as e:  # noqa: BLE001
        return False, f"HPU check failed: {e}"
    try:
        import habana_frameworks.mediapipe  # noqa: F401
    except ImportError:
        return False, "an HPU is present but habana_frameworks.mediapipe (pip package habana-media-loader) is missing"
    return True, "HPU and habana_frameworks.mediapipe present"


def cuda_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        _torchvision_io()
    except RuntimeError:
        return False, "CUDA is present but torchvision (for nvJPEG decode_jpeg) is not importable"
    return True, "CUDA device and torchvision.io.decode_jpeg present"


def resolve_pipeline(requested: str, device: torch.device | str, flag: str = "",
                     generation: str | None = None) -> tuple[str, str]:
    """Map --image_pipeline (host|device|auto) and the training device to a pipeline name and the reason for it.

    "device" follows the device the model trains on; it fails (RuntimeError naming what is missing) when that
    device's decoder cannot run, and on a first-generation Gaudi (ConfigError naming `flag`, the option the user gave:
    Habana's media pipe runs on Gaudi2 and Gaudi3 only). "auto" prefers hpu > cuda > cpu-thread decoding, and takes
    the host pipeline on a first-generation Gaudi. `generation`: the Gaudi's (default: asked of the bridge)."""
    dev = torch.device(device)
    if requested == "host":
        return "host", "requested --image_pipeline host"
    if requested == "device":
        if dev.type == "hpu":
            ok, why = hpu_available()
            if not ok:
                raise RuntimeError(f"--image_pipeline device on HPU cannot run: {why}")
            refusal = _media_pipe_refusal(generation)
            if refusal:
                raise ConfigError(f"{flag or '--image_pipeline device'}: {refusal}; use --image_pipeline host (or "
                                  "auto, which takes it there)")
            return "device-hpu", why
        if dev.type == "cuda":
            ok, why = cuda_available()
            if not ok:
                raise RuntimeError(f"--image_pipeline device on CUDA cannot run: {why}")
            return "device-cuda", why
        if dev.type == "cpu":
            return "device-cpu", "training on CPU: decoding in a thread pool inside the training process"
        raise RuntimeError(f"--image_pipeline device: no device decoder for device type {dev.type!r}")
    if requested == "auto":
        reasons = []
        for name, check, dtype_ in (("device-hpu", hpu_available, "hpu"), ("device-cuda", cuda_available, "cuda")):
            ok, why = check()
            if ok and dev.type == dtype_:
                refusal = _media_pipe_refusal(generation) if name == "device-hpu" else None
                return ("host", f"{refusal} -> host pipeline") if refusal else (name, why)
            reasons.append(why if not ok else f"{why}, but training runs on {dev.type}")
        return "device-cpu", "; ".join(reasons) + " -> CPU thread-pool decoding"
    raise ConfigError(f"--image_pipeline must be host, device or auto, got {requested!r}")


def _media_pipe_refusal(generation: str | None) -> str | None:
    """Why Habana's media pipe cannot run on this Gaudi, or None where it can (Gaudi2, Gaudi3)."""
    gen = generation if generation is not None else hpu_rules.device_generation()
    if hpu_rules.media_pipe_supported(gen):
        return None
    return (f"this is a first-generation Gaudi ({gen or 'no generation reported'}), and Habana's media pipe runs on "
            "Gaudi2 and Gaudi3 only (Intel Gaudi docs, MediaPipe: \"Includes Gaudi 3 and Gaudi 2 support\"; "
            "optimum-habana: --mediapipe_dataloader is not supported on Gaudi1)")


def make_device_decoder(pipeline: str, size: int, device, draft: bool = True,
                        max_pixels: int = DEFAULT_MAX_PIXELS, threads: int = 0,
                        transform: str = "processor") -> DeviceDecoder:
    if pipeline == "device-cpu":
        return ThreadDecoder(size, device, draft, max_pixels, threads, transform)
    if pipeline == "device-cuda":
        return CudaDecoder(size, device, draft, max_pixels, threads, transform)
    raise ValueError(f"no per-batch device decoder for pipeline {pipeline!r}")
