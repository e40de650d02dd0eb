"""How transformers and run_bridgetower.py turn images into pixels, as this package keeps them: the
BridgeTowerImageProcessor saved beside the final model (Trainer-style outputs), and run_bridgetower.py's torchvision
transform, the reference bridgetower_ds.images.host_transform(transform="run_bridgetower") is checked against."""
from __future__ import annotations

from pathlib import Path

import torch

from ds_core.compat.hf import bridgetower_image_processor
from ds_core.errors import ConfigError

from .images import CLIP_MEAN, CLIP_STD, SIZE_DIVISOR


def image_processor(source_dir: str, image_size: int):
    """The checkpoint's image processor when it has one, else BridgeTower's with this pipeline's geometry (shorter
    side S, S x S center crop, size divisor 32, CLIP mean/std: bridgetower_ds.images). The PIL-backed class of the
    installed transformers (ds_core.compat.hf.bridgetower_image_processor)."""
    processor_cls = bridgetower_image_processor()
    if source_dir and (Path(source_dir) / "preprocessor_config.json").is_file():
        proc = processor_cls.from_pretrained(source_dir)
    else:
        proc = processor_cls(size={"shortest_edge": image_size}, crop_size={"shortest_edge": image_size},
                             size_divisor=SIZE_DIVISOR, do_center_crop=True, image_mean=list(CLIP_MEAN),
                             image_std=list(CLIP_STD))
    got = proc.size.get("shortest_edge") if isinstance(proc.size, dict) else getattr(proc.size, "shortest_edge", None)
    if got != image_size:
        raise ConfigError(f"{source_dir}/preprocessor_config.json: size.shortest_edge {got} != the model's vision "
                          f"image_size {image_size}")
    return proc


def torchvision_transform(size: int):
    """path -> normalized [3, S, S] float32 exactly as run_bridgetower.py makes pixels from an image file
    (examples/contrastive-image-text/run_bridgetower.py, huggingface/optimum-habana
    1d8504c6c7666a19d71968dba50976dceaf7c6b6): torchvision `read_image(path, RGB)`, then its Transform,
    Resize([S], bicubic) + CenterCrop(S) + ConvertImageDtype(float) + Normalize(CLIP mean, std). The reference
    itself, for baselines and for checking images.host_transform(transform="run_bridgetower"); needs torchvision."""
    try:
        from torchvision.io import ImageReadMode, read_image  # optional: the reference only
        from torchvision.transforms import CenterCrop, ConvertImageDtype, InterpolationMode, Normalize, Resize
    except ImportError as e:
        raise RuntimeError(f"run_bridgetower.py's image transform is torchvision's, and torchvision is not importable "
                           f"here ({e})") from None
    pipeline = torch.nn.Sequential(Resize([size], interpolation=InterpolationMode.BICUBIC), CenterCrop(size),
                                   ConvertImageDtype(torch.float), Normalize(CLIP_MEAN, CLIP_STD))

    def run(path: str) -> torch.Tensor:
        with torch.no_grad():
            return pipeline(read_image(path, mode=ImageReadMode.RGB))
    return run
