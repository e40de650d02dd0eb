"""The differences between the transformers releases of the support matrix (stacks/: 5.x on the newest stack,
4.55.4 on a Gaudi image), each decided by a feature of the installed transformers, not by its version number.

- dtype_field: the name of a model's dtype in its config and in from_pretrained's keywords: `dtype` from
  transformers 4.56 on (PretrainedConfig.__init__ takes `dtype`), `torch_dtype` before. The fp32 export writes its
  dtype under that name, so that from_pretrained(dtype / torch_dtype="auto") reloads the fp32 weights as fp32.
- bridgetower_image_processor: BridgeTowerImageProcessorPil (5.x, the PIL backend; 5.x's BridgeTowerImageProcessor
  wants torchvision) or BridgeTowerImageProcessor (4.55, which is the PIL one there).
- padding_mask: the attention mask handed to an SDPA encoder so that transformers adds no host sync. Where the
  model's module builds its masks with masking_utils.create_bidirectional_mask (5.x), a ready 4-D boolean mask is
  passed on as it is (from a 2-D one it would first ask `mask.all()` on the host); where it calls
  get_extended_attention_mask (4.55), which takes 2-D or 3-D masks only and sends a 2-D SDPA mask through
  _prepare_4d_attention_mask_for_sdpa (the same host check), a 3-D [B, L, L] mask becomes the additive [B, 1, L, L]
  one with no host read.
- bridgetower_sdpa_missing: BridgeTower's attention-function switch (ALL_ATTENTION_FUNCTIONS, 5.x); 4.55's BridgeTower
  has only its eager attention, which then runs (one line says so).
- call_arguments: a transformers module's forward arguments by name, however the installed release calls it: 4.51's
  encoder layers pass attention_mask, head_mask, encoder states, past_key_value and output_attentions positionally,
  4.55 and 5.x by keyword (5.x names the cache `cache`): a replacement forward reads them through the signature of
  the forward it replaces, so one body serves every release.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch


@functools.lru_cache(maxsize=None)
def dtype_field() -> str:
    """"dtype" or "torch_dtype": what the installed transformers calls a model's dtype (config field and
    from_pretrained keyword)."""
    from transformers import PretrainedConfig

    return "dtype" if "dtype" in inspect.signature(PretrainedConfig.__init__).parameters else "torch_dtype"


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """from_pretrained's keyword for the dtype to load in: {"dtype": d} or {"torch_dtype": d}."""
    return {dtype_field(): dtype}


def set_config_dtype(config: Any, name: str) -> None:
    """Record `name` ("float32") as the dtype a saved config.json declares, under the field this transformers reads."""
    setattr(config, dtype_field(), name)


def bridgetower_image_processor() -> type:
    """The PIL-backed BridgeTower image processor class of the installed transformers."""
    import transformers

    cls = getattr(transformers, "BridgeTowerImageProcessorPil", None)
    return cls if cls is not None else transformers.BridgeTowerImageProcessor


@functools.lru_cache(maxsize=None)
def _mask_rank(model_type: type) -> int:
    """4 where the transformers module that defines model_type's encoder builds masks with create_bidirectional_mask,
    else 3 (get_extended_attention_mask)."""
    for cls in model_type.__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and cls.__module__.startswith("transformers.models."):
            return 4 if hasattr(module, "create_bidirectional_mask") else 3
    return 4


def padding_mask(attention_mask: torch.Tensor, model: Any) -> torch.Tensor:
    """[B, L] 0/1 -> the boolean mask `model` (a transformers encoder, or a subclass of one) takes without a host
    sync: [B, 1, L, L] (5.x) or [B, L, L] (4.55); key k of row b visible where attention_mask[b, k] is 1. An expanded
    view, no memory."""
    b, n = attention_mask.shape
    keys = attention_mask.bool()
    if _mask_rank(type(model)) == 4:
        return keys[:, None, None, :].expand(b, 1, n, n)
    return keys[:, None, :].expand(b, n, n)


def bridgetower_sdpa_missing() -> str | None:
    """What the installed transformers' BridgeTower lacks for running its attention through SDPA, or None."""
    from transformers.models.bridgetower import modeling_bridgetower as mb

    lacks = [n for n in ("ALL_ATTENTION_FUNCTIONS", "BridgeTowerSelfAttention", "BridgeTowerCrossAttention")
             if not hasattr(mb, n)]
    if not lacks:
        return None
    import transformers

    return (f"transformers {transformers.__version__}'s BridgeTower has no {', '.join(lacks)} (its attention has no "
            f"SDPA switch): attention runs eager")


def call_arguments(forward: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """{name: value} of a call `module.forward(*args, **kwargs)` (self not included in args) bound to the signature of
    `forward`, the installed transformers' unbound method the call was meant for; names it takes through **kwargs
    are kept as given. A call that does not fit that signature raises TypeError, as the method itself would."""
    bound = inspect.signature(forward).bind(None, *args, **kwargs)
    named = {k: v for k, v in bound.arguments.items() if k != "self"}
    for name, param in inspect.signature(forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    return named


__all__ = ["call_arguments", "dtype_field", "dtype_kwargs", "set_config_dtype", "bridgetower_image_processor",
           "padding_mask",
           "bridgetower_sdpa_missing"]
