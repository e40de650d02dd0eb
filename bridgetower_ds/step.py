"""The training step: batch -> BridgeTower contrastive loss and counts (ds_core.run.trainer does backward, step and
timing)."""
from __future__ import annotations

from ds_core.run.step import StepOutput

# What the model reads of a batch; the rest (index, caption_tokens, pixel_mask) is bookkeeping that stays where it is.
MODEL_INPUTS = ("input_ids", "attention_mask", "pixel_values")


def step_fn(engine, batch: dict) -> StepOutput:
    """StepFn for ds_core.run.trainer.Trainer: forward with return_loss=True (fp32 ITC loss, see
    model.BridgeTowerContrastive).

    Negatives are the other samples of this rank's micro batch (or every rank's, with global negatives on).
    Samples and tokens count real rows only: a fill-in batch (index -1, data.CaptionData on several ranks) repeats
    seen samples to keep the ranks in step and counts 0. Tokens are the non-padding caption tokens.
    """
    samples, tokens = real_counts(batch)
    device = engine.device
    b = {k: batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS}
    out = engine(**b, return_loss=True)
    return StepOutput(loss=out.loss, samples=samples, tokens=tokens)


def real_counts(batch: dict) -> tuple[int, int]:
    """(samples, caption tokens) of the batch's real rows (index >= 0), from the host tensors the loader made
    (batching.BatchAssembler: index and caption_tokens stay on the host). Read as Python lists, not reduced by torch:
    a torch reduction is ops and a `.item()` per count every step, and on an accelerator a read-back stops the host
    until the device caught up. A batch without caption_tokens (built elsewhere) counts from its attention_mask."""
    lengths = batch.get("caption_tokens")
    if lengths is None:
        lengths = batch["attention_mask"].sum(dim=1)
    lengths = lengths.tolist()
    index = batch["index"].tolist() if "index" in batch else [0] * len(lengths)
    real = [n for i, n in zip(index, lengths) if i >= 0]
    return len(real), int(sum(real))
