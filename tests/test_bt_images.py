"""bridgetower_ds.images: reference equality, bad images, device decoders, pipeline selection. Real JPEGs via PIL."""
from __future__ import annotations

import importlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from bridgetower_ds import images as I
from ds_core.compat.hf import bridgetower_image_processor

# Tolerances, in normalized units (1 grey level = 1/255/std ~ 0.0142..0.0150), measured on photo-like JPEGs:
#  * no JPEG draft (640x480 at S=288 never drafts): torch's uint8 bicubic-antialias kernel vs PIL's (the reference)
#    differ by rounding only: max <= 2 grey levels on isolated pixels, mean abs diff < 0.005 (typically < 1e-4).
#  * draft engaged (JPEG >= 2x the resize target, e.g. 1600x1200): libjpeg's DCT downscale replaces part of the
#    bicubic filtering: mean abs diff < 0.015 (~1 grey level), max < 0.5 at sharp edges.
ONE_LEVEL = 1 / 255 / min(I.CLIP_STD) + 1e-5
MAX_DIFF, MEAN_DIFF = 2 * ONE_LEVEL, 0.005
DRAFT_MAX_DIFF, DRAFT_MEAN_DIFF = 0.5, 0.015


def photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients + shapes + mild noise: compresses and resamples like a photograph."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 90 * np.sin(x / (30 + 40 * rng.random()) + 6 * rng.random()),
                    128 + 90 * np.cos(y / (25 + 40 * rng.random())),
                    255 * (x + y) / (w + h)], -1)
    cx, cy, r = w * rng.random(), h * rng.random(), min(w, h) / 4
    img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.random(3) * 255
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(arr: np.ndarray, mode: str = "RGB", fmt: str = "JPEG", quality: int = 90, **jpeg) -> bytes:
    """Encoded bytes; `jpeg` goes to PIL's JPEG writer (e.g. subsampling=0: 4:4:4, no chroma upsampling to decode)."""
    im = Image.fromarray(arr)
    if mode != "RGB":
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": quality, **jpeg} if fmt == "JPEG" else {}))
    return buf.getvalue()


# transformers 4.55's BridgeTowerImageProcessor has no RGB conversion (no do_convert_rgb): a CMYK, grey or alpha
# picture has no reference there; these comparisons run where transformers has one (5.x)
converts_rgb = pytest.mark.skipif(not hasattr(bridgetower_image_processor()(), "do_convert_rgb"),
                                  reason="this transformers' BridgeTower image processor converts no image to RGB")


def reference(data: bytes) -> torch.Tensor:
    proc = bridgetower_image_processor()()  # the PIL backend of BridgeTowerImageProcessor (ds_core.compat.hf)
    # do_convert_rgb: transformers' own RGB conversion (CMYK, L, alpha composited onto white), as our decoder does;
    # do_center_crop: the processor's configured value (True), given per call because transformers 4.51's preprocess
    # drops its own (`do_center_crop if ... else self.do_center_crop` is a statement there, not an assignment), so
    # that release crops only when asked in the call (docs/gaudi.md, transformers differences)
    return proc(Image.open(io.BytesIO(data)), do_convert_rgb=True, do_center_crop=True,
                return_tensors="pt")["pixel_values"][0]


def ours(data: bytes, size: int = 288, draft: bool = True) -> torch.Tensor:
    u8 = I.host_transform(data, "x.jpg", size, draft)
    return I.normalize(torch.from_numpy(u8)[None])[0]


@pytest.mark.stack
@pytest.mark.each_gaudi
@pytest.mark.parametrize("h,w", [(480, 640), (640, 480), (300, 700), (1000, 250), (100, 150), (427, 640), (288, 384)])
def test_resize_target_matches_transformers(h, w):
    # the function of the module that defines the PIL processor class (transformers 5: image_processing_pil_*; 4.55:
    # image_processing_bridgetower)
    module = importlib.import_module(bridgetower_image_processor().__module__)
    ref = module.get_resize_output_image_size(np.zeros((3, h, w)), shorter=288, longer=int(1333 / 800 * 288),
                                       size_divisor=32)
    assert I.resize_target(h, w, 288) == ref


@pytest.mark.stack
@pytest.mark.each_gaudi
@pytest.mark.parametrize("w,h", [(640, 480), (480, 640), (700, 300), (150, 100), (333, 517)])
def test_host_equals_bridgetower_image_processor(w, h):
    data = jpeg_bytes(photo(w, h, seed=w))
    ref, got = reference(data), ours(data)
    assert got.shape == ref.shape == (3, 288, 288)
    diff = (got - ref).abs()
    assert diff.max() <= MAX_DIFF, diff.max()
    assert diff.mean() < MEAN_DIFF, diff.mean()


def test_draft_decode_within_stated_tolerance():
    data = jpeg_bytes(photo(1600, 1200, seed=3))
    ref = reference(data)
    exact = (ours(data, draft=False) - ref).abs()
    assert exact.max() <= MAX_DIFF and exact.mean() < MEAN_DIFF
    drafted = (ours(data, draft=True) - ref).abs()
    assert drafted.mean() < DRAFT_MEAN_DIFF and drafted.max() < DRAFT_MAX_DIFF, (drafted.mean(), drafted.max())
    arr, orig = I.decode(data, "x", 288, draft=True)
    assert orig == (1200, 1600) and arr.shape[:2] == (300, 400)  # 1/4 DCT scale, still >= the 288 x 384 target


def test_normalize_arithmetic_matches_reference_formula():
    u8 = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    got = I.normalize(u8)
    x = u8.double() / 255
    want = (x - torch.tensor(I.CLIP_MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        I.CLIP_STD, dtype=torch.float64).view(1, 3, 1, 1)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 8, 8)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_crop_or_pad_matches_reference_padding():
    from transformers.image_transforms import center_crop

    x = torch.arange(3 * 5 * 9, dtype=torch.uint8).view(3, 5, 9)
    ref = center_crop(x.numpy(), (8, 8), input_data_format="channels_first")
    assert np.array_equal(I.crop_or_pad(x, 8).numpy(), ref)


# ---------------------------------------------------------------------------------------------------- bad images
def test_truncated_jpeg_is_bad():
    data = jpeg_bytes(photo(64, 48))
    with pytest.raises(I.BadImage, match="decode failed"):
        I.host_transform(data[: len(data) // 2], "t.jpg", 32)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "zero.jpg").write_bytes(b"")
    with pytest.raises(I.BadImage, match="0 bytes"):
        I.read_bytes(str(tmp_path / "zero.jpg"))
    with pytest.raises(I.BadImage, match="not found") as e:
        I.read_bytes(str(tmp_path / "nope.jpg"))
    assert e.value.name.endswith("nope.jpg")
    with pytest.raises(I.BadImage, match="0 bytes"):
        I.host_transform(b"", "zero.jpg", 32)


def test_garbage_bytes_are_bad():
    with pytest.raises(I.BadImage, match="not a recognised image"):
        I.host_transform(b"this is not an image at all", "g.jpg", 32)


@converts_rgb
def test_cmyk_and_grayscale_are_converted_like_reference():
    arr = photo(120, 90, seed=5)
    for mode in ("CMYK", "L"):
        data = jpeg_bytes(arr, mode=mode)
        ref, got = reference(data), ours(data, size=288)
        assert (got - ref).abs().max() <= MAX_DIFF, mode


@converts_rgb
def test_png_named_jpg_decodes_by_content_and_alpha_composites_on_white():
    rgba = np.dstack([photo(80, 60, seed=7), np.full((60, 80), 128, np.uint8)])
    data = jpeg_bytes(rgba, fmt="PNG")
    ref, got = reference(data), ours(data)
    assert (got - ref).abs().max() <= MAX_DIFF


def test_very_large_image_uses_draft_and_bomb_guard():
    big = Image.new("RGB", (8000, 8000), (200, 30, 60))
    buf = io.BytesIO()
    big.save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    del big
    arr, orig = I.decode(data, "big.jpg", 288)
    assert orig == (8000, 8000) and arr.shape == (1000, 1000, 3)  # 1/8 DCT scale: 3 MB instead of 192 MB
    out = I.host_transform(data, "big.jpg", 288)
    assert out.shape == (3, 288, 288) and abs(int(out[0, 100, 100]) - 200) <= 2
    with pytest.raises(I.BadImage, match="decompression bomb"):
        I.host_transform(data, "big.jpg", 288, max_pixels=50_000_000)


# ---------------------------------------------------------------------------------------------------- device side
def test_thread_decoder_equals_host_and_reports_bad():
    datas = [jpeg_bytes(photo(160, 120, seed=s)) for s in range(3)]
    items = [datas[0], b"", datas[1], I.BadImage("gone.jpg", "file not found"), datas[2]]
    names = ["a.jpg", "zero.jpg", "b.jpg", "gone.jpg", "c.jpg"]
    dec = I.ThreadDecoder(64, "cpu", threads=2)
    try:
        pv, keep, bad = dec(items, names)
    finally:
        dec.close()
    assert keep == [0, 2, 4]
    assert sorted(b.name for b in bad) == ["gone.jpg", "zero.jpg"]
    host = I.normalize(torch.from_numpy(np.stack([I.host_transform(d, "x", 64) for d in datas])))
    assert torch.equal(pv, host)


@pytest.mark.parametrize("w,h", [(640, 480), (480, 640), (800, 600), (1024, 768), (500, 375), (640, 427), (150, 100)])
def test_windowed_resize_equals_full_resize_then_crop(w, h):
    arr = photo(w, h, seed=h)
    th, tw = I.resize_target(h, w, 288)
    t = torch.from_numpy(arr).permute(2, 0, 1)[None]
    full = I.crop_or_pad(torch.nn.functional.interpolate(t, (th, tw), mode="bicubic", antialias=True), 288)[0]
    assert torch.equal(torch.from_numpy(I.resize_crop_u8(arr, (h, w), 288)), full)


def test_cuda_resize_path_matches_host_on_cpu_tensors():
    """The CUDA decoder's float resize (used on GPU tensors) agrees with the host uint8 kernel: checked on CPU."""
    arr = photo(640, 480, seed=11)
    host = I.resize_crop_u8(arr, (480, 640), 288).astype(np.int16)
    t = torch.from_numpy(arr).permute(2, 0, 1)[None].float()
    dev = I.crop_or_pad(I.resize_float(t, I.resize_target(480, 640, 288)), 288)[0]
    assert np.abs(dev.numpy().astype(np.int16) - host).max() <= 1


def test_resolve_pipeline_choices_and_errors(monkeypatch):
    assert I.resolve_pipeline("host", "cpu")[0] == "host"
    assert I.resolve_pipeline("device", "cpu")[0] == "device-cpu"
    name, why = I.resolve_pipeline("auto", "cpu")
    assert name == "device-cpu" and ("habana" in why.lower() or "hpu" in why.lower())
    monkeypatch.setattr(I, "cuda_available", lambda: (False, "no CUDA device"))
    with pytest.raises(RuntimeError, match="no CUDA device"):
        I.resolve_pipeline("device", "cuda")
    with pytest.raises(RuntimeError, match="habana"):
        I.resolve_pipeline("device", "hpu")
    with pytest.raises(ValueError, match="host, device or auto"):
        I.resolve_pipeline("gpu", "cpu")


def test_cuda_decoder_needs_torchvision_error_is_clear():
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="torchvision"):
            I.CudaDecoder(288, "cpu")
    else:
        pytest.skip("torchvision is installed here")


def test_hpu_media_module_imports_without_habana_and_says_what_is_missing():
    from bridgetower_ds import hpu_media

    if hpu_media._IMPORT_ERROR is None:
        pytest.skip("habana_frameworks.mediapipe present")
    with pytest.raises(RuntimeError, match="habana-media-loader"):
        hpu_media.check_hpu_media()


def test_hpu_jpeg_file_checks(tmp_path):
    from bridgetower_ds.hpu_media import jpeg_file_problem

    good = tmp_path / "g.jpg"
    good.write_bytes(jpeg_bytes(photo(40, 30)))
    assert jpeg_file_problem(str(good), I.DEFAULT_MAX_PIXELS) is None
    trunc = tmp_path / "t.jpg"
    trunc.write_bytes(good.read_bytes()[:300])
    assert "truncated" in jpeg_file_problem(str(trunc), I.DEFAULT_MAX_PIXELS)
    png = tmp_path / "p.jpg"
    png.write_bytes(jpeg_bytes(photo(40, 30), fmt="PNG"))
    assert "not JPEG" in jpeg_file_problem(str(png), I.DEFAULT_MAX_PIXELS)
    cmyk = tmp_path / "c.jpg"
    cmyk.write_bytes(jpeg_bytes(photo(40, 30), mode="CMYK"))
    assert "CMYK" in jpeg_file_problem(str(cmyk), I.DEFAULT_MAX_PIXELS)
    assert "not found" in jpeg_file_problem(str(tmp_path / "none.jpg"), I.DEFAULT_MAX_PIXELS)


def test_pil_fallback_without_simplejpeg_is_identical(monkeypatch):
    datas = [jpeg_bytes(photo(640, 480, seed=21)), jpeg_bytes(photo(1300, 900, seed=22))]
    fast = [I.host_transform(d, "x", 288) for d in datas]
    monkeypatch.setattr(I, "simplejpeg", None)
    slow = [I.host_transform(d, "x", 288) for d in datas]
    assert all(np.array_equal(a, b) for a, b in zip(fast, slow))  # same libjpeg-turbo output, same draft scale


def test_hpu_materialize_writes_embedded_images_once(tmp_path):
    from bridgetower_ds.hpu_media import materialize
    from bridgetower_ds.table import CaptionTable

    good = jpeg_bytes(photo(40, 30))
    table = CaptionTable([good, b"", str(tmp_path / "on_disk.jpg")], ["a", "b", "c"], str(tmp_path), "mem")
    paths = materialize(table, str(tmp_path / "cache"), rank=0)
    assert open(paths[0], "rb").read() == good and open(paths[1], "rb").read() == b""
    assert paths[2] == str(tmp_path / "on_disk.jpg")
    assert materialize(table, str(tmp_path / "cache"), rank=1) == paths


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns at open; we then refuse
def test_default_pixel_limit_rejects_a_bomb_from_its_header():
    buf = io.BytesIO()
    Image.new("1", (9500, 9500)).save(buf, "PNG")  # 90 MP > PIL's 89.5 MP limit, a few KB on disk
    with pytest.raises(I.BadImage, match="decompression bomb"):
        I.host_transform(buf.getvalue(), "bomb.png", 288)


class _FakeTvio:
    """Stands in for torchvision.io on this CPU-only machine: decode_jpeg as nvJPEG decodes on the GPU, same call
    shapes. libjpeg-turbo with fancy upsampling off repeats each stored chroma sample, as nvJPEG does; this stand-in
    reproduces nvJPEG's measured differences from the host pipeline exactly (4:2:0 640x480 baseline 9, progressive
    11, 4:4:4 and grayscale 1, 300x300 33 grey levels, before bridgetower_ds.jpeg_chroma)."""

    class ImageReadMode:
        RGB = "RGB"

    calls = 0

    @classmethod
    def decode_jpeg(cls, data, mode=None, device=None):
        import simplejpeg

        cls.calls += 1
        if isinstance(data, list):
            return [cls.decode_jpeg(d, mode, device) for d in data]
        arr = simplejpeg.decode_jpeg(data.numpy().tobytes(), "RGB", fastupsample=True)
        return torch.from_numpy(arr).permute(2, 0, 1).contiguous().to(device)


def test_cuda_decoder_logic_with_a_stand_in_decoder(monkeypatch):
    """Routing (GPU batch vs CPU fallback), float resize, crop and normalize of CudaDecoder, run on the CPU. The
    nvJPEG rows are 4:4:4 (both decoders give the same pixels; chroma upsampling is tested below)."""
    monkeypatch.setattr(I, "_torchvision_io", lambda: _FakeTvio)
    ok = [jpeg_bytes(photo(640, 480, seed=s), subsampling=0) for s in range(2)]
    png = jpeg_bytes(photo(120, 90, seed=3), fmt="PNG")
    cmyk = jpeg_bytes(photo(120, 90, seed=4), mode="CMYK")
    big = jpeg_bytes(photo(1400, 1000, seed=5))  # draft 1/4 -> CPU path
    trunc = ok[0][: len(ok[0]) // 2]
    items = [ok[0], png, trunc, cmyk, ok[1], big, b"garbage"]
    dec = I.CudaDecoder(288, "cpu", threads=2)
    try:
        pv, keep, bad = dec(items, [f"r{i}" for i in range(len(items))])
    finally:
        dec.close()
    assert keep == [0, 1, 3, 4, 5] and sorted(b.name for b in bad) == ["r2", "r6"]
    host = I.normalize(torch.from_numpy(np.stack([I.host_transform(items[i], "x", 288) for i in keep])))
    assert (pv - host).abs().max() <= 2 * ONE_LEVEL  # float resize on the device vs the uint8 kernel: rounding only


def _png16(arr16: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr16).save(buf, "PNG")
    return buf.getvalue()


@converts_rgb
def test_16_bit_grayscale_png_is_scaled_to_8_bits_not_clipped():
    rng = np.random.default_rng(3)
    gray8 = photo(64, 48)[..., 0]
    # the same picture at 16 bits (v * 257 maps 0..255 onto 0..65535 exactly) plus noise below one 8-bit level
    arr16 = (gray8.astype(np.uint32) * 257 + rng.integers(-100, 100, gray8.shape)).clip(0, 65535).astype(np.uint16)
    data = _png16(arr16)
    assert Image.open(io.BytesIO(data)).mode == "I;16"  # what PIL makes of it (its convert("RGB") would clip)
    arr, _ = I.decode(data, "g16.png", 32)
    assert arr.dtype == np.uint8 and arr.shape == (48, 64, 3)
    assert np.array_equal(arr[..., 0], gray8) and np.array_equal(arr[..., 1], gray8)
    # the host transform then equals the processor applied to the 8-bit picture (which it refuses at 16 bits)
    proc = bridgetower_image_processor()(size={"shortest_edge": 32})
    with pytest.raises(ValueError, match=r"outside the range \[0, 255\]"):
        proc(Image.open(io.BytesIO(data)), return_tensors="pt")
    assert torch.equal(torch.from_numpy(I.host_transform(data, "g16.png", 32)),
                       torch.from_numpy(I.host_transform(_png16(gray8), "g8.png", 32)))


def test_images_without_a_defined_8_bit_range_are_bad():
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32), "F").save(buf, "TIFF")
    with pytest.raises(I.BadImage, match="f.tif: floating-point image"):
        I.decode(buf.getvalue(), "f.tif", 32)
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 1 << 20, dtype=np.int32), "I").save(buf, "TIFF")
    with pytest.raises(I.BadImage, match=r"i.tif: 32-bit integer image with values in \[1048576, 1048576\]"):
        I.decode(buf.getvalue(), "i.tif", 32)


def _grey_levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-value |a - b| of two normalized [3, S, S] images, in grey levels (0..255 units)."""
    return (a - b).abs() * 255 * torch.tensor(I.CLIP_STD).view(3, 1, 1)


def test_chroma_upsampled_as_libjpeg_from_nvjpeg_output():
    """jpeg_chroma on what nvJPEG returns equals libjpeg's fancy-upsampled decode (the reference's) up to rounding
    (<= 2 grey levels) on every pixel farther than 3 px from a pixel nvJPEG clamped to 0 or 255: a pixel's chroma
    comes from its own 2 x 2 block and the neighbouring one, and a block holding a clamped pixel has lost part of
    its chroma. Box-upsampled chroma itself is tens of levels off at colour edges."""
    import simplejpeg

    from bridgetower_ds.jpeg_chroma import chroma_factors, fancy_upsample_chroma, needs_fancy
    from test_gpu_images import photo_like

    rng = np.random.default_rng(5)
    for sub, w, h in (("4:2:0", 300, 300), ("4:2:2", 301, 203), ("4:2:0", 97, 61)):
        buf = io.BytesIO()
        photo_like(rng, w, h).save(buf, "JPEG", quality=90, subsampling=sub)
        data = buf.getvalue()
        factors = chroma_factors(Image.open(io.BytesIO(data)))
        assert factors == {"4:2:0": (2, 2), "4:2:2": (2, 1)}[sub] and needs_fancy(factors, w)
        box = simplejpeg.decode_jpeg(data, "RGB", fastupsample=True)
        want = simplejpeg.decode_jpeg(data, "RGB").astype(np.int16)
        got = fancy_upsample_chroma(torch.from_numpy(box).permute(2, 0, 1), factors).permute(1, 2, 0).numpy()
        clamped = torch.from_numpy(((box == 0) | (box == 255)).any(-1).astype(np.float32))[None, None]
        far = (torch.nn.functional.max_pool2d(clamped, 7, 1, 3)[0, 0] == 0).numpy()
        assert far.mean() > 0.5, sub  # the check covers most of the image
        assert np.abs(got.astype(np.int16) - want).max(-1)[far].max() <= 2, sub
        assert np.abs(box.astype(np.int16) - want).max(-1)[far].max() > 10, sub  # what the correction removes
    assert chroma_factors(Image.open(io.BytesIO(jpeg_bytes(photo(64, 48), mode="L")))) is None  # grayscale


@pytest.mark.parametrize("transform", I.TRANSFORMS)
def test_cuda_pipeline_with_nvjpeg_chroma_matches_host(transform, monkeypatch):
    """The CUDA decoder's tensor ops (chroma upsampling as libjpeg's, float resize, crop, normalize) on the CPU, fed
    what nvJPEG returns, against the host pipeline on the GPU test's images. Left after the chroma correction:
    rounding (IDCT, chroma before colour conversion, float vs uint8 resize kernel: <= 2 grey levels) everywhere but
    near pixels nvJPEG clamped to 0 or 255 (saturated colours), where the stored chroma is not recoverable: up to 9
    levels (the test above bounds the rest). Box-upsampled chroma as nvJPEG gives it is 33 levels off on the
    300 x 300 photo."""
    from test_gpu_images import SIZE, corpus

    monkeypatch.setattr(I, "_torchvision_io", lambda: _FakeTvio)
    files = {n: d for n, d in corpus().items() if not n.startswith("huge")}  # huge: the CPU fallback, tested above
    names = list(files)
    dec = I.CudaDecoder(SIZE, "cpu", threads=1, transform=transform)
    try:
        pix, keep, bad = dec([files[n] for n in names], names)
    finally:
        dec.close()
    report = {}
    for row, i in enumerate(keep):
        host = I.normalize(torch.from_numpy(I.host_transform(files[names[i]], names[i], SIZE, transform=transform)))
        diff = _grey_levels(pix[row], host[0])
        report[names[i]] = round(float(diff.max()), 1)
    print(transform, "max grey-level difference per file:", report)
    assert [b.name for b in bad] == ["truncated_640x480.jpg"]
    assert "small_300x300.jpg" in report and "baseline_640x480.jpg" in report
    for n, worst in report.items():
        assert worst <= 12, (n, worst)
