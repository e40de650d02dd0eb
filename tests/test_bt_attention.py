"""BridgeTower's attention through torch's scaled_dot_product_attention (model.use_sdpa): the same function as
transformers' eager attention, fewer aten ops per step."""
from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bridgetower_ds import configs
from bridgetower_ds.configs import ModelArgs
from bridgetower_ds.model import BridgeTowerContrastive, build_model, use_sdpa
from ds_core.compat.hf import bridgetower_sdpa_missing
from ds_core.errors import ConfigError

# transformers 4.55's BridgeTower has eager attention only: what needs the switch is skipped there, saying why
NO_SWITCH = bridgetower_sdpa_missing()
needs_switch = pytest.mark.skipif(NO_SWITCH is not None, reason=str(NO_SWITCH))

# fp32 unit roundoff is 2**-24 ~ 6e-8. SDPA's CPU kernel sums the softmax and the weighted values in another order
# (blocked, online softmax) than eager's matmul + softmax + matmul: a few ulps per attention output times the number
# of keys summed (<= 20 here), carried through 4 attention levels (text, cross self, cross, next layer). 1e-5 on
# unit-norm embeddings is ~170 ulps; gradients are compared relative to the largest one.
TOL = 1e-5


def _model_and_batch():
    cfg = configs.preset("debug")
    for c in (cfg.text_config, cfg.vision_config):
        c.hidden_dropout_prob = c.attention_probs_dropout_prob = 0.0  # dropout off: both paths are deterministic
    torch.manual_seed(0)
    model = BridgeTowerContrastive(cfg).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0  # padded captions: the mask must reach SDPA as it reaches eager
    mask[2, 3:] = 0
    size = cfg.vision_config.image_size
    pixels = torch.randn(3, 3, size, size, generator=gen)
    return model, {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "return_loss": True}


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: out[k].detach() for k in ("text_embeds", "image_embeds", "cross_embeds", "loss")}, grads


@needs_switch
def test_sdpa_outputs_and_gradients_equal_eager():
    eager, batch = _model_and_batch()
    sdpa = copy.deepcopy(eager)
    assert use_sdpa(sdpa) and sdpa.config.text_config._attn_implementation == "sdpa"
    assert eager.config.text_config._attn_implementation in (None, "eager")
    (out_e, grad_e), (out_s, grad_s) = _run(eager, batch), _run(sdpa, batch)
    for k in out_e:
        assert (out_e[k] - out_s[k]).abs().max() <= TOL, k
    assert grad_e.keys() == grad_s.keys() and len(grad_e) > 100
    scale = max(g.abs().max() for g in grad_e.values())
    assert max((grad_e[n] - grad_s[n]).abs().max() for n in grad_e) <= TOL * scale


@needs_switch
def test_switching_without_clearing_is_causal_changes_the_function():
    """Why use_sdpa clears is_causal: transformers builds the cross-modal self-attention with is_causal=True, which
    eager ignores and SDPA applies to the unmasked image stream. The naive switch is far outside the tolerance."""
    eager, batch = _model_and_batch()
    naive = copy.deepcopy(eager)
    naive.config._attn_implementation = "sdpa"
    (out_e, _), (out_n, _) = _run(eager, batch), _run(naive, batch)
    assert (out_e["cross_embeds"] - out_n["cross_embeds"]).abs().max() > 100 * TOL


def _op_counts(model, batch) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(model, batch)
    return {e.key: e.count for e in prof.key_averages()}


@needs_switch
def test_sdpa_runs_every_attention_fused():
    """Every attention of a step (forward) is one SDPA call, none is a softmax: text layers, the vision blocks the
    forward walks (nn.MultiheadAttention, need_weights=False), and per cross-modal layer and stream a self- and a
    cross-attention. Eager runs text and cross-modal attention as softmax; the vision tower is SDPA either way."""
    eager, batch = _model_and_batch()
    sdpa = copy.deepcopy(eager)
    use_sdpa(sdpa)
    cfg = eager.config
    text, cross = cfg.text_config.num_hidden_layers, cfg.num_hidden_layers
    vision = min(cfg.vision_config.num_hidden_layers, text)  # the forward walks the vision blocks with the text layers
    ops_e, ops_s = _op_counts(eager, batch), _op_counts(sdpa, batch)
    assert ops_s.get("aten::scaled_dot_product_attention") == vision + text + 4 * cross
    assert ops_e.get("aten::scaled_dot_product_attention") == vision
    assert ops_s.get("aten::softmax", 0) == 0 and ops_e["aten::softmax"] == text + 4 * cross
    assert sum(ops_s.values()) < sum(ops_e.values())


@pytest.mark.stack
@pytest.mark.each_gaudi
def test_build_model_attention_flag(capsys):
    default = build_model(ModelArgs(preset="debug")).config._attn_implementation  # --attn_implementation sdpa
    if NO_SWITCH is None:
        assert default == "sdpa"
    else:  # eager, and one line says why
        assert default != "sdpa" and capsys.readouterr().out.count(NO_SWITCH) == 1
    assert build_model(ModelArgs(preset="debug", attn_implementation="eager")).config._attn_implementation != "sdpa"
    with pytest.raises(ConfigError, match="--attn_implementation"):
        build_model(ModelArgs(preset="debug", attn_implementation="flash"))


def test_step_reads_no_count_back_from_the_device():
    """step_fn counts samples and tokens on the loader's CPU tensors: on an accelerator a count read back from the
    device stops the host every step. The engine here lives on the meta device, where any read-back raises."""
    from bridgetower_ds.step import step_fn

    class MetaEngine:
        device = torch.device("meta")

        def __call__(self, input_ids, attention_mask, pixel_values, return_loss):
            assert input_ids.device.type == "meta" and pixel_values.device.type == "meta"
            return types.SimpleNamespace(loss=torch.zeros((), device="meta"))

    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 3:] = 0
    batch = {"input_ids": torch.ones(4, 6, dtype=torch.long), "attention_mask": mask,
             "pixel_values": torch.zeros(4, 3, 8, 8), "index": torch.tensor([5, 6, -1, 7])}
    out = step_fn(MetaEngine(), batch)
    assert out.samples == 3 and out.tokens == 6 + 3 + 6 and out.loss.device.type == "meta"


def test_vision_self_attention_forward_equals_torchs_and_falls_back():
    """SelfAttentionMHA (use_sdpa swaps it in for the vision blocks' nn.MultiheadAttention): the same outputs and
    gradients as torch's forward on the same weights, fewer aten ops; masked or weight-returning calls take
    torch's own forward."""
    from bridgetower_ds.model import SelfAttentionMHA

    torch.manual_seed(0)
    stock = torch.nn.MultiheadAttention(64, 4)
    lean = copy.deepcopy(stock)
    lean.__class__ = SelfAttentionMHA
    x = torch.randn(17, 3, 64)
    counts = []
    for mha in (stock, lean):
        xi = x.clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = mha(xi, xi, xi, need_weights=False)[0]
            out.square().sum().backward()
        counts.append(sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")))
        mha.result = (out.detach(), xi.grad, mha.in_proj_weight.grad, mha.out_proj.weight.grad)
    for a, b in zip(stock.result, lean.result):
        assert (a - b).abs().max() <= TOL * a.abs().max()
    assert counts[1] < counts[0] - 40, counts
    mask = torch.zeros(3, 17, dtype=torch.bool)
    mask[0, 10:] = True
    want = stock(x, x, x, key_padding_mask=mask, need_weights=False)[0]
    assert torch.equal(lean(x, x, x, key_padding_mask=mask, need_weights=False)[0], want)
    assert lean(x, x, x)[1] is not None  # need_weights=True: torch's forward, attention weights returned


@needs_switch
@pytest.mark.parametrize("padded", [True, False])
def test_sdpa_forward_reads_no_mask_back_and_equals_the_2d_mask_path(padded):
    """BridgeTowerContrastive hands SDPA the 4-D boolean padding mask (model.sdpa_padding_mask): transformers' mask
    builder, given the 2-D mask, reads `mask.all()` back from the device every forward to drop an all-ones mask.
    The embeddings equal those of transformers' forward on the 2-D mask; without padding that path runs SDPA with
    no mask, so the two differ by the kernels' summation order (TOL)."""
    from transformers import BridgeTowerForContrastiveLearning

    from ds_tools.op_count import OpCounter

    model, batch = _model_and_batch()
    use_sdpa(model)
    if not padded:
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    with OpCounter(where=True) as count:
        out = model(**batch)
        out["loss"].backward()
    assert count.syncs == 0, dict(count.sync_sites)
    with torch.no_grad():
        stock = BridgeTowerForContrastiveLearning.forward(model, **{**batch, "return_loss": False})
    for k in ("text_embeds", "image_embeds", "cross_embeds"):
        assert (out[k].detach() - stock[k]).abs().max() <= TOL, k
