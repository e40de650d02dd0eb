"""Weight-decay groups as transformers' Trainer makes them: no decay for biases and norm weights."""
from __future__ import annotations

import torch

# transformers' Trainer.get_decay_parameter_names: parameters of nn.LayerNorm modules and names matching these
# patterns (lower-cased) get no weight decay.
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def decay_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters that get weight decay: transformers' Trainer.get_decay_parameter_names (no decay for
    biases and LayerNorm / RMSNorm weights), through the same transformers helper."""
    from transformers.trainer_pt_utils import get_parameter_names

    return get_parameter_names(model, [torch.nn.LayerNorm], list(NO_DECAY_PATTERNS))


def param_groups(model: torch.nn.Module, weight_decay: float, lr: float | None = None) -> list[dict]:
    """Trainer's two optimizer groups over trainable parameters: decayed, and biases/norms with weight_decay 0.

    An empty group is left out (DeepSpeed's ZeRO optimizers refuse empty groups)."""
    decay = set(decay_parameter_names(model))
    with_decay, without = [], []
    for name, p in model.named_parameters():  # tied weights are yielded once
        if p.requires_grad:
            (with_decay if name in decay else without).append(p)
    groups = [{"params": with_decay, "weight_decay": weight_decay}, {"params": without, "weight_decay": 0.0}]
    if lr is not None:
        for g in groups:
            g["lr"] = lr
    return [g for g in groups if g["params"]]
