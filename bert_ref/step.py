"""One BERT pretraining micro step: batch -> MLM and NSP losses (separately, so both are logged) and counts."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ds_core.config import ConfigError
from ds_core.loop import StepOutput

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def pretraining_losses(prediction_logits: torch.Tensor, seq_relationship_logits: torch.Tensor,
                       labels: torch.Tensor, next_sentence_label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLM cross-entropy over the masked positions (labels != -100) and NSP cross-entropy, both in fp32 (bf16 logits
    over a 30k vocabulary lose too much precision in log-softmax)."""
    vocab = prediction_logits.size(-1)
    mlm = F.cross_entropy(prediction_logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=-100)
    nsp = F.cross_entropy(seq_relationship_logits.reshape(-1, 2).float(), next_sentence_label.reshape(-1))
    return mlm, nsp


def step_fn(engine: Any, batch: dict) -> StepOutput:
    """Moves the CPU batch to the engine's device, runs the (DeepSpeed-wrapped) BertForPreTraining, returns
    loss = MLM + NSP (the original BERT objective) with both parts in logs."""
    dev = engine.device
    vocab = engine.module.config.vocab_size
    top = int(batch["input_ids"].max())  # on the CPU batch: cheap, and clearer than an index error in the embedding
    if top >= vocab:
        raise ConfigError(f"token id {top} in the data >= the model's vocab_size {vocab}: the shards were made with a "
                          f"larger vocabulary than the preset's (bert-prep vocab --vocab-size)")
    inputs = {k: batch[k].to(dev, non_blocking=True) for k in MODEL_INPUTS}
    out = engine(**inputs)
    mlm, nsp = pretraining_losses(out.prediction_logits, out.seq_relationship_logits,
                                  batch["labels"].to(dev, non_blocking=True),
                                  batch["next_sentence_label"].to(dev, non_blocking=True))
    loss = mlm + nsp
    ids = batch["input_ids"]
    # tokens = every position processed (padding included): that is what the FLOPs per sequence count.
    return StepOutput(loss=loss, samples=int(ids.size(0)), tokens=int(ids.numel()),
                      logs={"mlm_loss": mlm.detach(), "nsp_loss": nsp.detach()})
