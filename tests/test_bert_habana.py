"""Habana's BERT-1.5B function, bit for bit: our Pre-LN model in Habana's form (habana_pre_ln presets) against the
outputs of HabanaAI Model-References' own modeling.py (tests/data/habana_bert: made by make_reference.py there, from
a copy of the reference outside this repository; file and commit in reference.json), the Habana checkpoint loader,
and the SDPA attention path of the Pre-LN presets against the eager one."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_ref.configs import BertArgs, bert_1p5b, bert_1p5b_habana, debug_habana, debug_pre_ln
from bert_ref.habana_ckpt import habana_to_ours, load_habana_state_dict, read_habana_checkpoint
from bert_ref.model import build_model
from ds_core.compat.torch_releases import meta_device
from ds_core.errors import ConfigError

DATA = Path(__file__).parent / "data" / "habana_bert"
_spec = importlib.util.spec_from_file_location("habana_make_reference", DATA / "make_reference.py")
ref_recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref_recipe)
META = json.loads((DATA / "reference.json").read_text())
REF = np.load(DATA / "reference.npz")


def small(form, **kw):
    """The reference's config in one of our presets' forms; vocab 250 padded to 256, as 30522 -> 30528."""
    c = META["config"]
    return dataclasses.replace(form(), num_hidden_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                               num_attention_heads=c["num_attention_heads"], intermediate_size=c["intermediate_size"],
                               vocab_size=256, max_position_embeddings=c["max_position_embeddings"], seq_len=16, **kw)


def habana_weights() -> dict[str, torch.Tensor]:
    sd = ref_recipe.seeded_state_dict([(n, s) for n, s in META["state_dict"]], META["weight_seed"])
    assert ref_recipe.fingerprint(sd) == META["state_dict_sha256"], "the weight recipe no longer gives the reference's"
    return sd


def logits(model) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(REF[k]) for k in ("input_ids", "token_type_ids", "attention_mask")})
    return out.prediction_logits[..., :META["config"]["vocab_size"]].numpy(), out.seq_relationship_logits.numpy()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_habana_form_computes_habanas_function(attn):
    assert META["reference"]["file"].endswith("deepspeed-bert/modeling.py") and META["config"]["layer_norm_large_model"]
    model = build_model(small(debug_habana), attn_implementation=attn).eval()
    load_habana_state_dict(model, habana_weights(), "reference weights")
    mlm, nsp = logits(model)
    assert mlm.shape == REF["mlm_logits"].shape and nsp.shape == REF["nsp_logits"].shape
    assert np.abs(mlm - REF["mlm_logits"]).max() <= 1e-5
    assert np.abs(nsp - REF["nsp_logits"]).max() <= 1e-5
    # the padded vocabulary rows: zero embedding and bias, so their logits are exactly 0
    with torch.no_grad():
        assert model.cls.predictions.bias[250:].abs().max() == 0


# Which dropout stream torch draws: the kept positions of dropout(ones(4096), 0.1) after manual_seed(0), summed.
# 7494417 under torch 2.9 and 2.13, the stream the reference's training-mode logits were drawn from; torch 2.6's CPU
# dropout draws another stream (7530515), where the same masks cannot be asked of it.
REFERENCE_DROPOUT_STREAM = 7494417


def dropout_stream() -> int:
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        return int(torch.nn.functional.dropout(torch.ones(4096), 0.1, True).nonzero().sum())
    finally:
        torch.random.set_rng_state(state)


def test_habana_form_dropout_where_habanas_is():
    """Training mode, dropout 0.1: with torch's generator seeded the same, our eager path draws the same masks as
    Habana's modeling.py (same dropout calls, same order, same shapes: the embedding dropout after its LayerNorm), so
    the logits match too. (SDPA draws its attention dropout inside the kernel: not compared.)"""
    if dropout_stream() != REFERENCE_DROPOUT_STREAM:
        pytest.skip(f"torch {torch.__version__} draws another dropout stream than the reference's (probe "
                    f"{dropout_stream()} against {REFERENCE_DROPOUT_STREAM}): its masks cannot match")
    model = build_model(small(debug_habana, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
                        attn_implementation="eager").train()
    load_habana_state_dict(model, habana_weights())
    torch.manual_seed(META["dropout_seed"])
    mlm, nsp = logits(model)
    assert np.abs(mlm - REF["mlm_logits_train"]).max() <= 1e-5
    assert np.abs(nsp - REF["nsp_logits_train"]).max() <= 1e-5
    assert np.abs(REF["mlm_logits_train"] - REF["mlm_logits"]).max() > 0.1  # dropout did act


def test_megatron_form_is_another_function():
    """The same weights in MegatronBert's own Pre-LN (bert_1p5b's form) do not give Habana's logits: the comparison
    above can fail, and the two forms must not be mixed (check_checkpoint_form)."""
    model = build_model(small(debug_pre_ln)).eval()
    model.config.habana_pre_ln = True  # get past the loader's guard to show the difference
    load_habana_state_dict(model, habana_weights())
    mlm, _ = logits(model)
    assert np.abs(mlm - REF["mlm_logits"]).max() > 0.1


def test_pre_ln_presets_run_sdpa_equal_to_eager():
    """bert_1p5b (both forms) builds with the SDPA self-attention, and it computes what the eager one does
    (padding mask included), forward and gradients, fp32."""
    with meta_device():
        for preset in (bert_1p5b(), bert_1p5b_habana()):
            names = {type(layer.attention.self).__name__ for layer in build_model(preset).bert.encoder.layer}
            assert names == {"MegatronBertSdpaSelfAttention"}, (preset.name, names)
    for form in (debug_pre_ln, debug_habana):
        torch.manual_seed(0)
        sdpa = build_model(small(form))
        eager = build_model(small(form), attn_implementation="eager")
        eager.load_state_dict(sdpa.state_dict())
        assert type(eager.bert.encoder.layer[0].attention.self).__name__ == "MegatronBertSelfAttention"
        grads = []
        for model in (sdpa, eager):
            model.train()  # the debug presets have no dropout: train mode is deterministic
            out = model(**{k: torch.from_numpy(REF[k]) for k in ("input_ids", "token_type_ids", "attention_mask")})
            (out.prediction_logits.square().mean() + out.seq_relationship_logits.square().mean()).backward()
            grads.append((out.prediction_logits.detach(), model.bert.encoder.layer[1].attention.self.query.weight.grad))
        assert (grads[0][0] - grads[1][0]).abs().max() <= 1e-5
        assert (grads[0][1] - grads[1][1]).abs().max() <= 1e-6 * max(1.0, float(grads[1][1].abs().max()))


def test_loader_names_and_errors(tmp_path):
    assert habana_to_ours("bert.embeddings.LayerNorm.gamma", 3) == "bert.encoder.layer.0.attention.ln.weight"
    assert habana_to_ours("bert.encoder.layer.1.output.LayerNorm.bias", 3) == "bert.encoder.layer.2.attention.ln.bias"
    assert habana_to_ours("bert.encoder.layer.2.output.LayerNorm.weight", 3) == "bert.encoder.ln.weight"
    assert habana_to_ours("bert.encoder.layer.2.attention.output.LayerNorm.beta", 3) == "bert.encoder.layer.2.ln.bias"
    assert habana_to_ours("bert.pooler.dense_act.weight", 3) == "bert.pooler.dense.weight"
    sd = habana_weights()
    # DeepSpeed's checkpoint file (what Habana's run_pretraining.py saves), 'module.'-prefixed names included
    for tag in ("500", "1000"):
        (tmp_path / "ckpt" / tag).mkdir(parents=True)
        torch.save({"module": {"module." + k: v * (tag == "1000") for k, v in sd.items()}, "global_steps": int(tag)},
                   tmp_path / "ckpt" / tag / "mp_rank_00_model_states.pt")
    with pytest.raises(ConfigError, match="no 'latest' file and 2 tag directories"):
        read_habana_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest").write_text("1000")
    # --init_checkpoint: accepted by the run settings, loaded by build_model (the tag `latest` names)
    BertArgs(preset="debug_habana", input_dir=str(tmp_path), init_checkpoint=str(tmp_path / "ckpt")).validate()
    with pytest.raises(ConfigError, match="--init_checkpoint"):
        BertArgs(preset="debug_pre_ln", input_dir=str(tmp_path), init_checkpoint=str(tmp_path / "ckpt")).validate()
    model = build_model(small(debug_habana), init_checkpoint=str(tmp_path / "ckpt")).eval()
    assert np.abs(logits(model)[1] - REF["nsp_logits"]).max() <= 1e-5
    with pytest.raises(ConfigError, match="bert.encoder.layer.1.output.dense.weight"):
        load_habana_state_dict(model, {k: v for k, v in sd.items() if k != "bert.encoder.layer.1.output.dense.weight"})
    bad = dict(sd, **{"bert.pooler.dense_act.weight": torch.zeros(3, 3)})
    with pytest.raises(ConfigError, match=r"bert.pooler.dense_act.weight \(ours bert.pooler.dense.weight\) has shape"):
        load_habana_state_dict(model, bad)
    with pytest.raises(ConfigError, match="habana_pre_ln preset"):
        load_habana_state_dict(build_model(small(debug_pre_ln)), sd)


def test_checkpoint_forms_do_not_mix(tmp_path):
    """A saved Habana-form model says so in config.json, reloads into its preset with the same function, and is
    refused by the MegatronBert-form preset (same tensors, another function) and vice versa."""
    model = build_model(debug_habana()).eval()
    model.save_pretrained(tmp_path / "habana")
    build_model(debug_pre_ln()).save_pretrained(tmp_path / "megatron")
    assert json.loads((tmp_path / "habana" / "config.json").read_text())["habana_pre_ln"] is True
    again = build_model(debug_habana(), init_checkpoint=str(tmp_path / "habana")).eval()
    ids = torch.from_numpy(REF["input_ids"]) % 1024
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).prediction_logits, again(input_ids=ids).prediction_logits)
    with pytest.raises(ConfigError, match="Habana's form"):
        build_model(debug_pre_ln(), init_checkpoint=str(tmp_path / "habana"))
    with pytest.raises(ConfigError, match="habana_pre_ln True"):
        build_model(debug_habana(), init_checkpoint=str(tmp_path / "megatron"))
