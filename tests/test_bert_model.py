"""bert_ref presets, parameter counts (meta device), FLOPs formula, losses, checkpoint init, named errors."""
from __future__ import annotations

import json

import pytest
import torch

from bert_ref.configs import (
    BertArgs,
    InputDirError,
    PhaseMismatchError,
    UnknownPresetError,
    bert_1p5b,
    bert_large,
    check_data_matches,
    debug,
    debug_pre_ln,
    get_preset,
    pad_vocab,
)
from bert_ref.data import IGNORE_INDEX
from bert_ref.model import build_model, flops_per_sequence, param_counts
from bert_ref.step import pretraining_losses
from ds_core.compat.torch_releases import meta_device
from ds_core.errors import ConfigError


def test_presets_shapes_and_phases():
    assert pad_vocab(30522) == 30528 and pad_vocab(1024) == 1024
    for make in (bert_large, bert_1p5b, debug):
        p1, p2 = make(1), make(2)
        assert (p1.seq_len, p1.max_predictions_per_seq) == (128, 20)
        assert (p2.seq_len, p2.max_predictions_per_seq) == (512, 80)
    large, big = bert_large(), bert_1p5b()
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads, large.intermediate_size) == \
        (24, 1024, 16, 4096)
    assert (big.num_hidden_layers, big.hidden_size, big.num_attention_heads, big.intermediate_size) == \
        (48, 1600, 25, 6400)
    assert large.vocab_size == big.vocab_size == 30528
    assert get_preset("bert_1p5b", 2) == bert_1p5b(2)
    with pytest.raises(ConfigError):
        get_preset("bert_large", 3)


def test_param_counts_on_meta_device():
    large = param_counts(bert_large())
    big = param_counts(bert_1p5b())
    assert 335e6 <= large["total"] <= 340e6, large
    assert 1.45e9 <= big["total"] <= 1.6e9, big
    assert large["embeddings"] == (30528 + 512 + 2) * 1024 + 2 * 1024
    assert large["encoder"] == 24 * (4 * 1024 * 1024 + 2 * 1024 * 4096 + 9 * 1024 + 4096)
    # BERT-1.5B, Pre-LN: no LayerNorm in the embeddings; two per layer; one final (2L + 1, as Habana's model)
    h, inter, V, L = 1600, 6400, 30528, 48
    assert big["embeddings"] == (V + 512 + 2) * h
    assert big["encoder"] == L * (4 * h * h + 4 * h + 2 * h * inter + inter + h + 2 * 2 * h) + 2 * h
    assert big["heads"] == (h * h + h) + (h * h + h + 2 * h) + V + (2 * h + 2)
    assert big["total"] == 1_530_388_930


def test_pre_ln_structure_on_meta_device():
    """bert_1p5b is Pre-LN (MegatronBertForPreTraining): LayerNorm before attention and before the FFN of every
    layer, a final LayerNorm, none in the embeddings; bert_large stays Post-LN BertForPreTraining."""
    from transformers import BertForPreTraining, MegatronBertForPreTraining

    from bert_ref.model import hf_config, model_class

    assert bert_1p5b().pre_ln and debug_pre_ln().pre_ln and not bert_large().pre_ln and not debug().pre_ln
    assert model_class(bert_large()) is BertForPreTraining and model_class(bert_1p5b()) is MegatronBertForPreTraining
    with meta_device():
        big = model_class(bert_1p5b())(hf_config(bert_1p5b()))
    names = {n for n, _ in big.named_parameters()}
    assert not any("embeddings.LayerNorm" in n for n in names)
    for i in range(48):
        assert {f"bert.encoder.layer.{i}.attention.ln.weight", f"bert.encoder.layer.{i}.ln.weight"} <= names
    assert "bert.encoder.ln.weight" in names and big.config.model_type == "megatron-bert"


def test_pre_ln_forward_is_pre_ln():
    """The debug Pre-LN model's encoder output equals a hand-written Pre-LN forward from its own weights:
    x = emb; per layer x = x + Attn(LN_a(x)); x = x + FFN(LN_f(x)); out = LN_final(x)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_model(debug_pre_ln()).eval()
    ids = torch.randint(5, 1000, (2, 16))
    tt = torch.zeros_like(ids)
    with torch.no_grad():
        out = model.bert(ids, token_type_ids=tt, attention_mask=torch.ones_like(ids)).last_hidden_state
        e = model.bert.embeddings
        x = e.word_embeddings(ids) + e.position_embeddings(torch.arange(16))[None] + e.token_type_embeddings(tt)
        nh = model.config.num_attention_heads
        for layer in model.bert.encoder.layer:
            a = layer.attention
            h = a.ln(x)
            q, k, v = (m(h).view(2, 16, nh, -1).transpose(1, 2) for m in (a.self.query, a.self.key, a.self.value))
            ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 16, -1)
            x = x + a.output.dense(ctx)
            x = x + layer.output.dense(F.gelu(layer.intermediate.dense(layer.ln(x))))
        x = model.bert.encoder.ln(x)
    assert torch.allclose(out, x, atol=1e-5)


def test_pre_ln_export_loads_with_transformers_alone(tmp_path):
    """save_pretrained of the Pre-LN model (what ds_core.checkpoint.export_hf writes) loads in a process that imports
    transformers only, with identical outputs."""
    import os
    import subprocess
    import sys

    torch.manual_seed(0)
    model = build_model(debug_pre_ln(), sparse_mlm=True).eval()
    model.save_pretrained(tmp_path / "hf")
    ids = torch.randint(5, 1000, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids))
    torch.save({"ids": ids, "pred": want.prediction_logits, "nsp": want.seq_relationship_logits}, tmp_path / "io.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForPreTraining
m = AutoModelForPreTraining.from_pretrained({str(tmp_path / "hf")!r}, local_files_only=True).eval()
assert type(m).__name__ == "MegatronBertForPreTraining", type(m)
io = torch.load({str(tmp_path / "io.pt")!r})
ids = io["ids"]
with torch.no_grad():
    out = m(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids))
assert torch.allclose(out.prediction_logits, io["pred"], atol=1e-5)
assert torch.allclose(out.seq_relationship_logits, io["nsp"], atol=1e-5)
assert not [k for k in sys.modules if k.startswith("bert_ref") or k.startswith("ds_core")]
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "HF_HUB_OFFLINE": "1"},
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_init_checkpoint_of_the_other_form_is_refused(tmp_path):
    torch.manual_seed(0)
    build_model(debug_pre_ln()).save_pretrained(tmp_path / "pre")
    build_model(debug()).save_pretrained(tmp_path / "post")
    with pytest.raises(ConfigError, match=r"Pre-LN MegatronBertForPreTraining checkpoint, but preset debug is a "
                                          r"Post-LN"):
        build_model(debug(), init_checkpoint=str(tmp_path / "pre"))
    with pytest.raises(ConfigError, match=r"Post-LN BertForPreTraining checkpoint, but preset debug_pre_ln is a "
                                          r"Pre-LN"):
        build_model(debug_pre_ln(), init_checkpoint=str(tmp_path / "post"))
    model = build_model(debug_pre_ln(2), init_checkpoint=str(tmp_path / "pre"))  # same form: loads
    assert type(model).__name__ == "MegatronBertForPreTraining"


def test_flops_formula():
    p = bert_large()
    f = flops_per_sequence(p)
    S, h, L, V, inter = 128, 1024, 24, 30528, 4096
    by_hand = 3 * (L * (2 * S * (4 * h * h + 2 * h * inter) + 4 * S * S * h) + 2 * S * (h * h + h * V)
                   + 2 * (h * h + 2 * h))
    assert f == by_hand
    assert f == pytest.approx(6 * param_counts(p)["total"] * S, rel=0.05)  # the usual rule of thumb
    assert flops_per_sequence(bert_large(2)) > 4 * f  # seq 512: 4x the tokens plus the quadratic term


def test_named_errors(tmp_path):
    with pytest.raises(UnknownPresetError, match="bert_huge"):
        get_preset("bert_huge")
    with pytest.raises(UnknownPresetError, match="bert_huge"):
        BertArgs(preset="bert_huge", input_dir=str(tmp_path)).validate()
    with pytest.raises(InputDirError, match="no_such_dir"):
        BertArgs(preset="debug", input_dir=str(tmp_path / "no_such_dir")).validate()
    with pytest.raises(InputDirError):
        BertArgs(preset="debug", input_dir="").validate()


def test_phase_shard_mismatch_is_named(tmp_path):
    from bert_ref.data import build_data
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    write_shard(tmp_path / "part-0.hdf5", synthetic_arrays(8, 128, 20, vocab_size=1024))
    data = build_data(str(tmp_path), 0, 1, micro_batch=2)
    try:
        check_data_matches(bert_large(1), data, str(tmp_path))  # phase 1 shards, phase 1 preset: fine
        with pytest.raises(PhaseMismatchError, match=r"seq_len=128.*seq_len=512"):
            check_data_matches(bert_large(2), data, str(tmp_path))
    finally:
        data.close()


def test_train_cli_fails_fast_with_named_errors(tmp_path):
    from bert_ref.train import main

    with pytest.raises(UnknownPresetError):
        main(["--preset", "nope", "--input_dir", str(tmp_path), "--run_dir", str(tmp_path / "r")])
    with pytest.raises(InputDirError):
        main(["--preset", "debug", "--input_dir", str(tmp_path / "missing"), "--run_dir", str(tmp_path / "r")])


def test_losses_are_separate_and_ignore_unmasked():
    torch.manual_seed(0)
    model = build_model(debug()).eval()
    ids = torch.randint(5, 1000, (2, 16))
    out = model(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids))
    assert out.prediction_logits.shape == (2, 16, 1024) and out.seq_relationship_logits.shape == (2, 2)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 3], labels[1, 5] = 7, 9
    nsp_label = torch.tensor([0, 1])
    mlm, nsp = pretraining_losses(out.prediction_logits, out.seq_relationship_logits, labels, nsp_label)
    logp = out.prediction_logits.float().log_softmax(-1)
    assert mlm.item() == pytest.approx(-(logp[0, 3, 7] + logp[1, 5, 9]).item() / 2, rel=1e-5)
    assert nsp.item() == pytest.approx(
        torch.nn.functional.cross_entropy(out.seq_relationship_logits, nsp_label).item(), rel=1e-5)


def test_init_checkpoint_loads_and_pads_vocab(tmp_path):
    from transformers import BertForPreTraining

    from bert_ref.model import hf_config

    cfg = hf_config(debug())
    cfg.vocab_size = 1018  # an unpadded checkpoint vocabulary, like the published 30522
    src = BertForPreTraining(cfg)
    src.save_pretrained(tmp_path / "ckpt")
    model = build_model(debug(2), init_checkpoint=str(tmp_path / "ckpt"), activation_checkpointing=True)
    emb = model.bert.embeddings.word_embeddings.weight
    assert emb.shape == (1024, 64)
    assert torch.equal(emb[:1018], src.bert.embeddings.word_embeddings.weight)
    assert model.cls.predictions.decoder.weight.data_ptr() == emb.data_ptr()  # still tied
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    cfg2 = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg2["hidden_size"] = 128
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg2))
    with pytest.raises(ConfigError, match="hidden_size"):
        build_model(debug(), init_checkpoint=str(tmp_path / "ckpt"))



def test_sparse_mlm_head_matches_dense_loss_and_grads():
    """build_model(sparse_mlm=True) + make_step_fn(P): the MLM head runs at P positions per sequence only, with the
    same loss and gradients as the dense head (dropout off); FLOPs count P positions for the MLM head."""
    import dataclasses

    import numpy as np

    from bert_ref.data import make_batch
    from bert_ref.prep.h5io import synthetic_arrays
    from bert_ref.step import make_step_fn, masked_positions, step_fn

    p = dataclasses.replace(debug(1), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = build_model(p, sparse_mlm=True)
    arr = synthetic_arrays(3, p.seq_len, p.max_predictions_per_seq, vocab_size=p.vocab_size, seed=1)
    batch = make_batch(arr, np.arange(3))

    class Engine:  # the two things step_fn uses of a DeepSpeed engine
        device = torch.device("cpu")
        module = model

        def __call__(self, **kw):
            return model(**kw)

    outs, grads = [], []
    for fn in (step_fn, make_step_fn(p.max_predictions_per_seq)):
        model.zero_grad()
        out = fn(Engine(), batch)
        out.loss.backward()
        outs.append(out)
        grads.append([q.grad.clone() for q in model.parameters()])
    assert torch.allclose(outs[0].loss, outs[1].loss, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))
    pos = masked_positions(batch["labels"], p.max_predictions_per_seq)
    assert pos.shape == (3, p.max_predictions_per_seq)
    assert ((batch["labels"] != IGNORE_INDEX).sum(1) == (pos > 0).sum(1)).all()
    with pytest.raises(ConfigError):
        masked_positions(batch["labels"], 1)
    S, h, V = p.seq_len, p.hidden_size, p.vocab_size
    dense, sparse = flops_per_sequence(p), flops_per_sequence(p, mlm_positions=p.max_predictions_per_seq)
    assert dense - sparse == 3 * 2 * (S - p.max_predictions_per_seq) * (h * h + h * V)


def test_fast_dropout_rate_scale_and_grad():
    from bert_ref.model import FastDropout

    d = FastDropout(0.1)
    x = torch.ones(400_000, requires_grad=True)
    y = d(x)
    y.sum().backward()
    assert abs(float((y > 0).float().mean()) - 0.9) < 0.005
    assert abs(float(y.detach().mean()) - 1.0) < 0.01  # kept values scaled by 1 / (1 - p)
    assert torch.equal(x.grad, y.detach())  # d y / d x = mask * scale
    assert torch.equal(d.eval()(x), x)
    model = build_model(debug(1), fast_dropout=True)
    assert any(isinstance(m, FastDropout) for m in model.modules())


@pytest.mark.stack
@pytest.mark.each_gaudi
@pytest.mark.parametrize("name", ["debug", "debug_pre_ln"])
def test_sdpa_model_gets_a_ready_mask_same_outputs_no_host_sync(name):
    """The boolean mask bert_ref.step hands the SDPA model (ds_core.compat.hf.padding_mask: 4-D on transformers 5,
    3-D on 4.55, which takes no 4-D mask) gives the outputs of the 2-D mask it replaces, bit for bit on BERT, on a
    padded batch; the 2-D mask costs BERT a host sync in transformers (`padding_mask.all()` in 5's masking_utils,
    `torch.all(mask == 1)` in 4.55's modeling_attn_mask_utils, to drop a mask that masks nothing), the ready one none.
    A batch without padding (where transformers dropped the mask) agrees within the rounding of a masked and an
    unmasked attention. The Pre-LN presets (MegatronBert, eager in transformers, given SDPA attention by
    bert_ref.model) build an additive float mask from the 2-D one: the same attention within float rounding, and on
    transformers 5 the same sync avoided."""
    from bert_ref import configs
    from ds_core.compat.hf import padding_mask
    from ds_tools.op_count import OpCounter

    torch.manual_seed(0)
    preset = getattr(configs, name)(1)
    model = build_model(preset).eval()
    sdpa = model.config._attn_implementation == "sdpa" or getattr(model, "sdpa_attention", False)
    assert sdpa  # what bert_ref.step.forward checks before handing over the 4-D mask
    bert_sdpa = model.config._attn_implementation == "sdpa"
    ids = torch.randint(5, preset.vocab_size, (3, 32))
    mask = torch.ones_like(ids)
    mask[0, 20:], mask[2, 9:] = 0, 0
    for m, exact in ((mask, True), (torch.ones_like(ids), False)):
        with torch.no_grad(), OpCounter(where=True) as c2:
            a = model(input_ids=ids, attention_mask=m)
        with torch.no_grad(), OpCounter(where=True) as c4:
            b = model(input_ids=ids, attention_mask=padding_mask(m, model))
        if bert_sdpa or padding_mask(m, model).dim() == 4:  # 4.55's MegatronBert builds its float mask without one
            assert c2.syncs >= 1 and any("mask" in s or "modeling_" in s for s in c2.sync_sites), dict(c2.sync_sites)
        assert c4.syncs == 0, dict(c4.sync_sites)
        for x, y in ((a.prediction_logits, b.prediction_logits), (a.seq_relationship_logits,
                                                                   b.seq_relationship_logits)):
            if exact and bert_sdpa:
                assert torch.equal(x, y)
            else:  # fp32 attention with another form of the same mask (or none): a few ulps
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
