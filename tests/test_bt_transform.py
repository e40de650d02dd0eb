"""--image_transform: run_bridgetower.py's torchvision pixels and the processor geometry, host = device pipelines,
and odd aspect ratios. The reference pixels are torchvision's own output, kept as test data (no torchvision here)."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bridgetower_ds import images as I
from test_bt_images import _FakeTvio, jpeg_bytes, photo

# tests/data/bt_run_bridgetower_pixels.npz: torchvision 0.28.0 (the wheel matching torch 2.13.0, run outside the repo)
# applying optimum-habana's run_bridgetower.py Transform (examples/contrastive-image-text/run_bridgetower.py at
# huggingface/optimum-habana 1d8504c6c7666a19d71968dba50976dceaf7c6b6: Resize([S], BICUBIC) + CenterCrop(S), before
# ConvertImageDtype + Normalize) to uint8 CHW tensors of photo(w, h, seed=w + h), key "{w}x{h}_S{S}".
REFERENCE = Path(__file__).parent / "data" / "bt_run_bridgetower_pixels.npz"


def png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")  # lossless: the decoded pixels are exactly the array torchvision got
    return buf.getvalue()


def test_run_bridgetower_pixels_equal_torchvision():
    ref = np.load(REFERENCE)
    assert len(ref.files) == 8
    for key in ref.files:
        wh, s = key.split("_S")
        w, h = map(int, wh.split("x"))
        got = I.host_transform(png_bytes(photo(w, h, seed=w + h)), key, int(s), transform="run_bridgetower")
        want = ref[key]
        assert got.shape == want.shape == (3, int(s), int(s)), key
        diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
        # Bit-identical on this CPU; a CPU with other float32 summation (AVX2 vs AVX-512) may round a few .5 cases
        # the other way: 1 grey level on isolated pixels at most.
        assert diff.max() <= 1 and (diff == 0).mean() > 0.999, (key, diff.max(), (diff != 0).sum())


@pytest.mark.parametrize("h,w,size,want", [
    (480, 640, 64, (64, 85, 0, 10)),      # 4:3: the long side int(64 * 640 / 480) = 85, left round(10.5) = 10
    (480, 653, 64, (64, 87, 0, 12)),      # round(11.5) = 12 (Python's half-to-even), not floor 11
    (60, 2000, 64, (64, 2133, 0, 1034)),  # extreme aspect: no side is ever 0
    (2000, 60, 64, (2133, 64, 1034, 0)),
    (100, 100, 64, (64, 64, 0, 0)),
])
def test_run_bridgetower_geometry(h, w, size, want):
    assert I.geometry(h, w, size, "run_bridgetower") == want


def test_processor_geometry_never_rounds_a_side_to_zero():
    # the reference's flooring to 32 would give 0 rows for 2000 x 60 at 64 px (and fail): the side keeps 3 rows
    assert I.resize_target(60, 2000, 64) == (3, 96)
    assert I.resize_target(2000, 60, 64) == (96, 3)
    assert min(I.resize_target(1, 20000, 64)) >= 1


@pytest.mark.parametrize("transform", I.TRANSFORMS)
@pytest.mark.parametrize("w,h", [(2000, 60), (60, 2000), (5000, 7), (1, 1)])
def test_any_aspect_ratio_decodes(transform, w, h):
    out = I.host_transform(jpeg_bytes(photo(w, h, seed=3)), f"odd_{w}x{h}.jpg", 64, transform=transform)
    assert out.shape == (3, 64, 64) and out.dtype == np.uint8


def test_failure_after_decoding_is_a_named_bad_image(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("Input and output sizes should be greater than 0")
    monkeypatch.setattr(I, "resize_crop_u8", boom)
    with pytest.raises(I.BadImage, match="wide.jpg.*RuntimeError"):
        I.host_transform(jpeg_bytes(photo(200, 60)), "wide.jpg", 64)
    dec = I.ThreadDecoder(64, "cpu", threads=1)
    try:
        pv, keep, bad = dec([jpeg_bytes(photo(200, 60))], ["wide.jpg"])
    finally:
        dec.close()
    assert pv is None and keep == [] and bad[0].name == "wide.jpg"


def test_alpha_dropped_as_run_bridgetower_composited_as_processor():
    arr = photo(80, 60, seed=2)
    rgba = np.concatenate([arr, np.full((60, 80, 1), 0, np.uint8)], -1)  # fully transparent
    data = png_bytes(rgba)
    dropped = I.host_transform(data, "a.png", 32, transform="run_bridgetower")
    assert np.array_equal(dropped, I.host_transform(png_bytes(arr), "rgb.png", 32, transform="run_bridgetower"))
    assert (I.host_transform(data, "a.png", 32, transform="processor") == 255).all()  # white, as transformers


@pytest.mark.parametrize("transform", I.TRANSFORMS)
def test_host_and_device_pipelines_equal(transform, monkeypatch):
    """Both geometries: the CPU device pipeline (thread pool) is the host pipeline bit for bit; the CUDA decoder's
    logic (stand-in nvJPEG decode on the CPU) resizes in float: equal for run_bridgetower, rounding for processor.
    4:4:4 JPEGs: nvJPEG and libjpeg decode them alike (chroma upsampling: test_bt_images)."""
    datas = [jpeg_bytes(photo(w, h, seed=w), subsampling=0) for w, h in ((160, 120), (120, 160), (300, 70), (653, 480))]
    names = [f"{i}.jpg" for i in range(len(datas))]
    host = I.normalize(torch.from_numpy(np.stack([I.host_transform(d, n, 64, transform=transform)
                                                  for d, n in zip(datas, names)])))
    monkeypatch.setattr(I, "_torchvision_io", lambda: _FakeTvio)
    for pipeline in ("device-cpu", "device-cuda"):
        dec = I.make_device_decoder(pipeline, 64, "cpu", threads=2, transform=transform)
        try:
            pv, keep, bad = dec(datas, names)
        finally:
            dec.close()
        assert keep == [0, 1, 2, 3] and not bad
        if pipeline == "device-cpu" or transform == "run_bridgetower":
            assert torch.equal(pv, host), pipeline
        else:
            # torch's uint8 kernel (fixed-point weights) vs the float one: 3 grey levels at sharp 4:4:4 colour edges
            assert (pv - host).abs().max() <= 3 / 255 / min(I.CLIP_STD) + 1e-5


def test_unknown_transform_refused():
    with pytest.raises(Exception, match="--image_transform"):
        I.make_device_decoder("device-cpu", 64, "cpu", transform="bilinear")
