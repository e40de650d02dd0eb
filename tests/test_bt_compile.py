"""bridgetower_ds under torch.compile (--compile on): one graph for the training forward with its fp32 contrastive
loss, and the compiled loss equal to eager within the rounding of the compute dtype (tests/compile_accuracy.py)."""
from __future__ import annotations

import copy
import time

import pytest
import torch

from bridgetower_ds.configs import ModelArgs
from bridgetower_ds.model import build_model
from compile_accuracy import assert_within_rounding, rounding_errors


def _model():
    torch.manual_seed(0)
    model = build_model(ModelArgs(preset="debug")).train()
    model.logit_scale_as_1d()  # as bridgetower_ds.train does before deepspeed.initialize
    return model


def _batch(B: int = 4, T: int = 16, size: int = 32, seed: int = 0) -> dict:
    """Captions padded to the longest (rows 1 and 3 shorter: the attention mask matters) and random images."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T // 2:] = 0
    mask[3, 3 * T // 4:] = 0
    return {"input_ids": torch.randint(5, 512, (B, T), generator=g) * mask, "attention_mask": mask,
            "pixel_values": torch.randn(B, 3, size, size, generator=g)}


def _train_forward(model):
    """What bridgetower_ds.step runs: the model with return_loss=True (the loss is computed inside forward)."""
    def fwd(batch):
        out = model(**batch, return_loss=True)
        return out.loss, out.text_embeds, out.image_embeds, out.cross_embeds
    return fwd


def test_training_forward_and_loss_is_one_graph():
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_train_forward(_model()))(_batch())
    reasons = [b.reason for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


# bf16 only (the training dtype): inductor compiles BridgeTower for about two minutes per dtype on two CPU cores.
# DeepSpeed + compile on 2 ranks is covered by BERT's run (tests/test_bert_compile.py): the same engine.compile path.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_compiled_loss_equals_eager_within_rounding(dtype, capsys):
    """Same weights (bf16-representable), same batch, training mode: the compiled loss and embeddings are as close to
    the float64 function as eager's rounding allows. Prints the numbers for the record."""
    base = _model()
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    batch = _batch()
    with torch.no_grad():
        ref = _train_forward(copy.deepcopy(base).double())({**batch, "pixel_values": batch["pixel_values"].double()})
        model = copy.deepcopy(base).to(dtype)
        typed = {**batch, "pixel_values": batch["pixel_values"].to(dtype)}
        eager = _train_forward(model)(typed)
        torch._dynamo.reset()
        start = time.perf_counter()
        compiled = torch.compile(_train_forward(model), dynamic=False)(typed)
        seconds = time.perf_counter() - start
    names = ("loss", "text_embeds", "image_embeds", "cross_embeds")
    for name, r, e, c in zip(names, ref, eager, compiled):
        assert_within_rounding(name, r, e, c, dtype)
    errors = ["{}: compiled {:.3g} eager {:.3g} allowed {:.3g}".format(n, *rounding_errors(r, e, c, dtype))
              for n, r, e, c in zip(names, ref, eager, compiled)]
    with capsys.disabled():
        print(f"\n[bridgetower debug {dtype}] loss eager {float(eager[0]):.7f} compiled {float(compiled[0]):.7f} "
              f"|diff| {abs(float(eager[0] - compiled[0])):.3g}; RMS from float64: {'; '.join(errors)}; "
              f"first compiled call {seconds:.0f} s")
