"""The training step: batch -> BridgeTower contrastive loss and counts (ds_core.run.loop does backward/step/timing)."""
from __future__ import annotations

import torch

from ds_core.run.loop import StepOutput


def step_fn(engine, batch: dict) -> StepOutput:
    """StepFn for ds_core.run.trainer.Trainer: forward with return_loss=True (fp32 ITC loss, see
    model.BridgeTowerContrastive).

    Negatives are the other samples of this rank's micro batch (or every rank's, with global negatives on).
    Samples and tokens count real rows only: a fill-in batch (index -1, data.CaptionData on several ranks) repeats
    seen samples to keep the ranks in step and counts 0. Tokens are the non-padding caption tokens.
    """
    # Counted from the batch as the loader made it (index and tokens are CPU tensors): reading a count back from the
    # accelerator would stop the host until the device caught up, twice a step.
    mask = batch["attention_mask"]
    real = batch["index"] >= 0 if "index" in batch else torch.ones(mask.shape[0], dtype=torch.bool)
    samples, tokens = int(real.sum()), int(mask[real.to(mask.device)].sum())
    device = engine.device
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out = engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixel_values"],
                 return_loss=True)
    return StepOutput(loss=out.loss, samples=samples, tokens=tokens)
