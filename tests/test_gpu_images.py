"""The CUDA device image pipeline (batched nvJPEG through torchvision.io.decode_jpeg(device="cuda") + GPU resize,
crop, normalize) against the host pipeline on generated photo-like JPEGs: baseline, progressive, grayscale, CMYK,
truncated, huge (decoded at a reduced DCT scale on the host: the CPU fallback) and extreme-aspect files.

The reference is the host pipeline under each `--image_transform`: for "run_bridgetower", torchvision's transform of
optimum-habana's examples/contrastive-image-text/run_bridgetower.py (huggingface/optimum-habana
1d8504c6c7666a19d71968dba50976dceaf7c6b6) on images decoded by libjpeg-turbo, which tests/test_bt_transform.py checks
against torchvision itself. Per file: the largest difference in grey levels (the normalized values mapped back to
0..255); the CPU fallbacks must equal the host pipeline exactly (it is the same code), nvJPEG rows within 12 grey
levels: rounding (two IDCTs, chroma upsampling redone as libjpeg's by bridgetower_ds.jpeg_chroma, a float instead of
a uint8 resize) everywhere but near pixels nvJPEG clamped to 0 or 255, whose chroma is not recoverable (the CPU
emulation in tests/test_bt_images.py: <= 9). Runs only with CUDA and torchvision (skipped here with the reason).
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() "
                          "is False)")

SIZE = 294  # BridgeTower-Large's image size


def _jpeg(im, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", **kw)
    return buf.getvalue()


def photo_like(rng, w: int = 640, h: int = 480):
    """A photograph-like image: lit gradient, blurred shapes, fine texture and sensor noise (JPEG-typical content,
    not flat colour, so both decoders' IDCT and chroma upsampling are exercised)."""
    from PIL import Image, ImageDraw, ImageFilter

    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = rng.uniform(40, 200, 3) + (rng.uniform(-0.2, 0.2) * x + rng.uniform(-0.2, 0.2) * y)[..., None]
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(5):
        x0, y0 = int(rng.integers(0, max(1, w - 20))), int(rng.integers(0, max(1, h - 20)))
        box = [x0, y0, x0 + int(rng.integers(10, max(11, w // 2))), y0 + int(rng.integers(10, max(11, h // 2)))]
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape(box, fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    arr = np.asarray(im.filter(ImageFilter.GaussianBlur(1.2))).astype(np.float32)
    arr += 8 * np.sin(x / 3.1 + y / 4.7)[..., None] + rng.normal(0, 4, arr.shape)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def corpus() -> dict[str, bytes]:
    """name -> JPEG bytes, one of each kind the pipeline meets in real data."""
    rng = np.random.default_rng(7)
    photo = photo_like(rng)
    return {
        "baseline_640x480.jpg": _jpeg(photo, quality=90),
        "progressive_640x480.jpg": _jpeg(photo, quality=85, progressive=True),
        "subsampling444_640x480.jpg": _jpeg(photo, quality=95, subsampling=0),
        "grayscale_640x480.jpg": _jpeg(photo.convert("L"), quality=90),
        "cmyk_640x480.jpg": _jpeg(photo.convert("CMYK"), quality=90),
        "truncated_640x480.jpg": _jpeg(photo, quality=90)[:20_000],
        "huge_6000x4000.jpg": _jpeg(photo.resize((6000, 4000)), quality=80),
        "wide_4000x100.jpg": _jpeg(photo_like(rng, 4000, 100), quality=90),
        "tall_100x3000.jpg": _jpeg(photo_like(rng, 100, 3000), quality=90),  # both: 0 px after resize -> bad
        "wide_2000x300.jpg": _jpeg(photo_like(rng, 2000, 300), quality=90),  # extreme but usable: zero-padded
        "small_300x300.jpg": _jpeg(photo_like(rng, 300, 300), quality=90),
    }


def _grey_levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from bridgetower_ds.images import CLIP_STD

    std = torch.tensor(CLIP_STD, device=a.device).view(3, 1, 1)
    return ((a - b).abs() * 255 * std).amax(dim=(1, 2))  # per channel, in 0..255 units


@cuda
@pytest.mark.parametrize("transform", ("run_bridgetower", "processor"))
def test_cuda_decoder_matches_host_pipeline_and_takes_the_fallbacks(transform):
    pytest.importorskip("torchvision", reason="the CUDA device pipeline needs torchvision (decode_jpeg)")
    from bridgetower_ds.images import BadImage, CudaDecoder, host_transform, normalize

    files = corpus()
    names = list(files)
    dec = CudaDecoder(SIZE, torch.device("cuda"), transform=transform)
    try:
        pix, keep, bad = dec([files[n] for n in names], names)
    finally:
        dec.close()
    host: dict[str, torch.Tensor | BadImage] = {}
    for n in names:
        try:
            host[n] = normalize(torch.from_numpy(host_transform(files[n], n, SIZE, transform=transform))[None],
                                "cuda")[0]
        except BadImage as e:
            host[n] = e
    host_bad = {n for n, v in host.items() if isinstance(v, BadImage)}
    assert {b.name for b in bad} == host_bad, (bad, host_bad)  # the same files refused, each by name
    assert [names[i] for i in keep] == [n for n in names if n not in host_bad]
    report = {}
    for row, i in enumerate(keep):
        n = names[i]
        report[n] = float(_grey_levels(pix[row], host[n]).max())
    print(transform, "max grey-level difference per file:", report)
    # CPU fallbacks: CMYK and the 6000 x 4000 photo (reduced-scale decode) run the host code itself
    for n in ("cmyk_640x480.jpg", "huge_6000x4000.jpg"):
        assert report[n] < 1e-3, f"{n} should take the CPU fallback (same code as the host): {report[n]}"
    for n, diff in report.items():
        assert diff <= 12, f"{n}: nvJPEG + GPU resize differ from the host pipeline by {diff:.1f} grey levels"
    assert pix.dtype == torch.float32 and pix.shape[1:] == (3, SIZE, SIZE) and pix.device.type == "cuda"


@cuda
def test_resolve_pipeline_on_cuda_picks_nvjpeg_when_torchvision_is_there():
    pytest.importorskip("torchvision", reason="the CUDA device pipeline needs torchvision (decode_jpeg)")
    from bridgetower_ds.images import resolve_pipeline

    assert resolve_pipeline("device", "cuda")[0] == "device-cuda"
    assert resolve_pipeline("auto", "cuda")[0] == "device-cuda"
