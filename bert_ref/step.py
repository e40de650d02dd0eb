"""One BERT pretraining micro step: batch -> MLM and NSP losses (separately, so both are logged) and counts."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from bert_ref.data import IGNORE_INDEX
from ds_core.compat.hf import padding_mask
from ds_core.errors import ConfigError
from ds_core.rank.compile import compile_backend
from ds_core.run.step import StepOutput, to_device

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def pretraining_losses(prediction_logits: torch.Tensor, seq_relationship_logits: torch.Tensor,
                       labels: torch.Tensor, next_sentence_label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLM cross-entropy over the masked positions (labels != IGNORE_INDEX) and NSP cross-entropy, both in fp32 (bf16
    logits over a 30k vocabulary lose too much precision in log-softmax)."""
    vocab = prediction_logits.size(-1)
    mlm = F.cross_entropy(prediction_logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    nsp = F.cross_entropy(seq_relationship_logits.reshape(-1, 2).float(), next_sentence_label.reshape(-1))
    return mlm, nsp


def masked_positions(labels: torch.Tensor, max_predictions: int) -> torch.Tensor:
    """[B, P] positions of the masked tokens (labels != IGNORE_INDEX) of each row, ascending, 0-padded like the shards'
    masked_lm_positions (position 0 is [CLS], never masked, so its label is IGNORE_INDEX and padding slots add no
    loss)."""
    B, S = labels.shape
    n = int((labels != IGNORE_INDEX).sum(1).max()) if labels.numel() else 0
    if n > max_predictions:
        raise ConfigError(f"a sequence has {n} masked tokens > max_predictions_per_seq {max_predictions}: the shards "
                          f"were made for another phase than the preset")
    col = torch.arange(S, device=labels.device).expand(B, S)
    key = torch.where(labels != IGNORE_INDEX, col, S)
    pos = key.sort(dim=1).values[:, :max_predictions]
    return torch.where(pos < S, pos, 0)


def make_step_fn(sparse_mlm_predictions: int = 0, compiled: bool = False) -> Callable[[Any, dict], StepOutput]:
    """step_fn, or with sparse_mlm_predictions = P > 0 the sparse-MLM step: the model (build_model(...,
    sparse_mlm=True)) computes the MLM head only at P positions per sequence (the masked ones, 0-padded), the loss is
    the same mean over the masked tokens. FLOPs: flops_per_sequence(preset, mlm_positions=P).
    compiled: the losses through torch.compile too (the model is compiled by ds_core.rank.compile.compile_model), with
    the accelerator's backend as the model's (hpu_backend on Gaudi, which has no inductor): the fp32 cast, log-softmax
    and gather over the vocabulary become one kernel instead of an fp32 copy of the logits."""
    if not sparse_mlm_predictions and not compiled:
        return step_fn
    losses = compiled_losses() if compiled else pretraining_losses

    def configured_step_fn(engine: Any, batch: dict) -> StepOutput:
        return _step(engine, batch, sparse_mlm_predictions, losses)

    return configured_step_fn


def compiled_losses() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """pretraining_losses through torch.compile with the accelerator's backend (ds_core.rank.compile.compile_backend:
    hpu_backend on Gaudi, where inductor, torch.compile's default, is not supported), one static graph."""
    return torch.compile(pretraining_losses, dynamic=False, backend=compile_backend())


def step_fn(engine: Any, batch: dict) -> StepOutput:
    """Moves the CPU batch to the engine's device, runs the (DeepSpeed-wrapped) BertForPreTraining, returns
    loss = MLM + NSP (the original BERT objective) with both parts in logs."""
    return _step(engine, batch, 0)


def forward(engine: Any, batch: dict, sparse_predictions: int = 0) -> tuple[Any, torch.Tensor]:
    """Run the (DeepSpeed-wrapped) model on a CPU batch: (model output, MLM labels on the device, [B, P] with the
    sparse head, else [B, L]). Token ids were checked against the vocabulary when the data block was read
    (bert_ref.data), naming the file and row; the step does not look again. An SDPA model (BERT's, or the Pre-LN
    presets' SDPA attention: bert_ref.model.use_sdpa_attention) gets its attention mask ready-made in the form its
    transformers module takes without a host sync (ds_core.compat.hf.padding_mask: 4-D on transformers 5, 3-D on
    4.55; from a 2-D one transformers first asks `mask.all()` on the host, a device sync every forward)."""
    dev = engine.device
    inputs = {k: to_device(batch[k], dev) for k in MODEL_INPUTS}  # through pinned memory on CUDA and HPU
    model = engine.module
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa" or \
            getattr(model, "sdpa_attention", False):  # BERT's SDPA; the Pre-LN presets' (bert_ref.model)
        inputs["attention_mask"] = padding_mask(inputs["attention_mask"], model)
    labels = batch["labels"]
    if sparse_predictions:
        pos = masked_positions(labels, sparse_predictions)
        labels = torch.gather(labels, 1, pos)
        inputs["masked_lm_positions"] = to_device(pos, dev)
    return engine(**inputs), to_device(labels, dev)


def _step(engine: Any, batch: dict, sparse_predictions: int, losses=pretraining_losses) -> StepOutput:
    out, labels = forward(engine, batch, sparse_predictions)
    mlm, nsp = losses(out.prediction_logits, out.seq_relationship_logits, labels,
                      to_device(batch["next_sentence_label"], engine.device))
    loss = mlm + nsp
    ids = batch["input_ids"]
    # tokens = every position processed (padding included): that is what the FLOPs per sequence count.
    return StepOutput(loss=loss, samples=int(ids.size(0)), tokens=int(ids.numel()),
                      logs={"mlm_loss": mlm.detach(), "nsp_loss": nsp.detach()})
