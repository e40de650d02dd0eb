"""A model written in transformers' save_pretrained format, the one way every export of this toolkit writes it: the
end-of-run exports of both models (ds_core.outputs.results.save_model, ds_core.checkpoint.export_hf) and
`ds-ckpt export-hf` of any checkpoint.

`module.save_pretrained(dir, state_dict=...)` writes safetensors (model.safetensors, sharded where large) and
handles tied weights as transformers does: a tensor shared by several names (BERT's MLM decoder and its word
embeddings), or a name the class declares tied, is written once and tied again by from_pretrained. The config says
the dtype the file holds (`dtype`, `torch_dtype` before transformers 4.56: ds_core.compat.hf), so from_pretrained's
"auto" dtype loads the weights as saved. Files are written into a temporary sibling directory and renamed into
out_dir one by one: a partial write never sits under a model file's name, and other files already in out_dir (a
run's results, a model card) are kept.
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from ds_core.compat.hf import set_config_dtype

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def transformers_class(module) -> str | None:
    """The name of the module's transformers class: the first in its MRO that transformers exports (a model
    package's subclass, such as bert_ref's sparse-MLM head, is its base), or None."""
    import transformers

    return next((c.__name__ for c in type(module).__mro__ if getattr(transformers, c.__name__, None) is c), None)


def write_pretrained(module, state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike, *,
                     extras: Callable[[Path], None] | None = None) -> Path:
    """save_pretrained of `module` (its class and config; its own weights are not read, so a model on the meta
    device does) with `state_dict`, into out_dir; extras(tmp) adds files beside the model (tokenizer, image
    processor, model card). One process writes: the caller's rank 0."""
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.model.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    module.save_pretrained(str(tmp), state_dict=state_dict)  # safetensors: the default of every supported release
    config = copy.deepcopy(module.config)
    dtypes = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPE_NAMES:
        # save_pretrained records the module's dtype (bf16 under DeepSpeed bf16, anything on the meta device), and
        # from_pretrained's "auto" dtype would load the file in that dtype: the config says what the file holds
        set_config_dtype(config, _DTYPE_NAMES[next(iter(dtypes))])
    cls = transformers_class(module)
    if cls:  # a model package's subclass (BridgeTower's contrastive wrapper) is saved as the transformers class
        config.architectures = [cls]
    config.save_pretrained(str(tmp))
    if extras is not None:
        extras(tmp)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    tmp.rmdir()
    return out


__all__ = ["write_pretrained", "transformers_class"]
