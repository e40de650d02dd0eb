"""bridgetower_ds model side without DeepSpeed: presets, building, freezing, FLOPs, tokenizer, step function."""
from __future__ import annotations

import pytest
import torch
from transformers import BridgeTowerForContrastiveLearning

from bridgetower_ds import configs
from bridgetower_ds.configs import ModelArgs
from bridgetower_ds.model import (
    BridgeTowerContrastive,
    apply_freezing,
    build_model,
    flops_per_sample,
    forward_flops,
    load_config,
)
from bridgetower_ds.tokenizer import debug_tokenizer, load_tokenizer
from ds_core.compat.torch_releases import meta_device
from ds_core.errors import ConfigError


def _batch(tok, n=4, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    caps = ["a red circle on a blue background", "two dogs playing in the snow", "a man riding a horse",
            "a pizza on a white plate", "green striped squares", "a cat sitting near a window"][:n]
    enc = tok(caps, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "pixel_values": torch.randn(n, 3, size, size, generator=g), "pixel_mask": torch.ones(n, size, size),
            "index": torch.arange(n)}


def test_presets_match_published_architecture():
    large = configs.bridgetower_large()
    assert (large.text_config.hidden_size, large.text_config.num_hidden_layers,
            large.text_config.num_attention_heads, large.text_config.intermediate_size) == (1024, 24, 16, 4096)
    assert (large.vision_config.hidden_size, large.vision_config.num_hidden_layers,
            large.vision_config.patch_size, large.vision_config.image_size) == (1024, 24, 14, 294)
    assert large.share_cross_modal_transformer_layers and not large.share_link_tower_layers
    assert (large.hidden_size, large.num_hidden_layers, large.num_attention_heads) == (1024, 6, 16)
    assert (large.contrastive_hidden_size, large.logit_scale_init_value) == (512, 2.6592)
    base = configs.bridgetower_base()
    assert ((base.text_config.hidden_size, base.vision_config.patch_size, base.vision_config.image_size)
            == (768, 16, 288))
    assert base.contrastive_hidden_size == 512
    with pytest.raises(ConfigError, match="--preset 'huge': unknown BridgeTower preset; expected one of "
                                          "bridgetower_large, bridgetower_base, debug"):
        configs.preset("huge")


def test_large_parameter_count_is_the_published_checkpoints():
    # ~0.9B parameters ("almost 900M" for the Large ITM/MLM/ITC checkpoint); built on the meta device.
    with meta_device():
        model = BridgeTowerForContrastiveLearning(configs.bridgetower_large())
    n = sum(p.numel() for p in model.parameters())
    assert 0.85e9 < n < 0.95e9, n


def test_debug_model_forward_loss_matches_reference_and_trains():
    tok = debug_tokenizer()
    torch.manual_seed(0)
    model = build_model(ModelArgs(preset="debug"))
    assert isinstance(model, BridgeTowerContrastive) and len(tok) == model.config.text_config.vocab_size
    batch = _batch(tok)
    model.eval()
    ours = model(**{k: v for k, v in batch.items() if k != "index"}, return_loss=True)
    ref = BridgeTowerForContrastiveLearning.forward(model, **{k: v for k, v in batch.items() if k != "index"},
                                                    return_loss=True)
    assert torch.allclose(ours.loss, ref.loss, atol=1e-5), (ours.loss, ref.loss)
    # a few optimizer steps on one batch: the loss falls
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(8):
        loss = model(**{k: v for k, v in batch.items() if k != "index"}, return_loss=True).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses
    # every trainable parameter got a gradient (the default-frozen text pooler is the only unused module)
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


def test_freezing_flags():
    model = build_model(ModelArgs(preset="debug"))
    bt = model.bridgetower
    assert not any(p.requires_grad for p in bt.text_model.pooler.parameters())
    assert all(p.requires_grad for p in bt.vision_model.parameters())
    counts = apply_freezing(model, ModelArgs(freeze_vision_model=True, freeze_text_model=True))
    assert not any(p.requires_grad for p in bt.vision_model.parameters())
    assert not any(p.requires_grad for p in bt.text_model.parameters())
    assert all(p.requires_grad for p in bt.cross_modal_text_layers.parameters()) and model.logit_scale.requires_grad
    assert counts["frozen"] == sum(p.numel() for p in bt.vision_model.parameters()) + \
        sum(p.numel() for p in bt.text_model.parameters())
    apply_freezing(model, ModelArgs(freeze_text_pooler=False))
    assert all(p.requires_grad for p in bt.text_model.pooler.parameters())


def test_flops_per_sample_matches_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    cfg = configs.debug()
    model = BridgeTowerForContrastiveLearning(cfg).eval()
    tok = debug_tokenizer()
    b = _batch(tok, n=2)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], pixel_values=b["pixel_values"])
    measured = fc.get_total_flops() / 2
    ours = sum(forward_flops(cfg, seq_len=16).values())
    assert abs(ours - measured) / measured < 0.05, (ours, measured)
    # training: 3x forward when everything trains, frozen towers count forward only
    assert flops_per_sample(cfg, 16) == pytest.approx(3 * ours)
    f = forward_flops(cfg, 16)
    assert flops_per_sample(cfg, 16, freeze_vision=True, freeze_text=True) == pytest.approx(
        3 * f["cross"] + f["vision"] + f["text"])
    # Large at 128 tokens: ~2 x params x tokens per tower (sanity bound, not a reference)
    large = sum(forward_flops(configs.bridgetower_large(), 128).values())
    assert 3e11 < large < 1e12, large


def test_tokenizer_debug_and_local_dir(tmp_path):
    tok = debug_tokenizer()
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("A red circle.")["input_ids"]
    assert ids[0] == 0 and ids[-1] == 2 and tok.unk_token_id not in ids
    # unknown words fall back to characters, never <unk>
    assert tok.unk_token_id not in tok("xylophone quux")["input_ids"]
    assert load_tokenizer(ModelArgs(preset="debug"))("a dog")["input_ids"] == tok("a dog")["input_ids"]
    tok.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(ModelArgs(preset="bridgetower_large", tokenizer_name_or_path=str(tmp_path / "tok")))
    assert again("a red circle")["input_ids"] == tok("a red circle")["input_ids"]
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        load_tokenizer(ModelArgs(preset="bridgetower_large"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(ModelArgs(model_name_or_path=str(tmp_path / "missing")))


def test_load_from_local_checkpoint_dir(tmp_path):
    torch.manual_seed(1)
    model = build_model(ModelArgs(preset="debug"))
    model.save_pretrained(tmp_path / "ckpt")
    debug_tokenizer().save_pretrained(tmp_path / "ckpt")
    loaded = build_model(ModelArgs(model_name_or_path=str(tmp_path / "ckpt")))
    assert load_config(ModelArgs(model_name_or_path=str(tmp_path / "ckpt"))).contrastive_hidden_size == 32
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    # the stock transformers class loads the same directory
    stock = BridgeTowerForContrastiveLearning.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    assert torch.equal(stock.logit_scale, model.logit_scale)
    assert load_tokenizer(ModelArgs(model_name_or_path=str(tmp_path / "ckpt")))("a dog")["input_ids"][0] == 0
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(ModelArgs(model_name_or_path=str(tmp_path)))


def test_step_fn_on_plain_module():
    from bridgetower_ds.step import step_fn

    model = build_model(ModelArgs(preset="debug"))

    class Engine:  # the two things step_fn uses of a DeepSpeed engine
        device = torch.device("cpu")
        module = model

        def __call__(self, **kw):
            return model(**kw)

    b = _batch(debug_tokenizer())
    out = step_fn(Engine(), b)
    assert out.samples == 4 and out.tokens == int(b["attention_mask"].sum()) and out.loss.ndim == 0
    out.loss.backward()
    assert model.logit_scale.grad is not None


def test_logit_scale_1d_for_deepspeed_keeps_checkpoint_layout(tmp_path):
    model = build_model(ModelArgs(preset="debug"))
    b = _batch(debug_tokenizer())
    inputs = {k: v for k, v in b.items() if k != "index"}
    model.eval()
    before = model(**inputs, return_loss=True).loss
    model.logit_scale_as_1d()
    assert model.logit_scale.shape == (1,) and model.logit_scale.requires_grad
    assert torch.allclose(model(**inputs, return_loss=True).loss, before)
    sd = model.state_dict()
    assert sd["logit_scale"].shape == ()
    model.load_state_dict(sd)  # 0-dim in, [1] parameter kept
    assert model.logit_scale.shape == (1,)
    # save_pretrained with an explicit (e.g. ZeRO-3 gathered) state dict still writes the 0-dim layout
    model.save_pretrained(tmp_path / "m", state_dict={k: v for k, v in model.named_parameters()} |
                          {k: v for k, v in model.named_buffers() if k in sd})
    stock = BridgeTowerForContrastiveLearning.from_pretrained(tmp_path / "m", local_files_only=True)
    assert stock.logit_scale.shape == () and torch.equal(stock.logit_scale, sd["logit_scale"])


def test_expected_padded_length():
    from bridgetower_ds.tokenizer import expected_padded_length

    tok = debug_tokenizer()
    # 4, 12, 4, 4 tokens with <s> </s>
    caps = ["a dog", "a red circle on a blue background near a tree", "a cat", "two dogs"]
    assert [len(x) for x in tok(caps)["input_ids"]] == [4, 12, 4, 4]
    assert expected_padded_length(tok, caps, micro_batch=2, max_length=128) == 8  # batches pad to 12 and 4
    assert expected_padded_length(tok, caps, micro_batch=4, max_length=128) == 12
    assert expected_padded_length(tok, caps, micro_batch=2, max_length=128, pad_to_max=True) == 128
    assert expected_padded_length(tok, caps, micro_batch=2, max_length=6) == 5  # truncation caps at 6


# The published Large ITM/MLM/ITC checkpoint's config.json (its architecture fields), as shipped with the weights.
PUBLISHED_LARGE_CONFIG = {
    "architectures": ["BridgeTowerForContrastiveLearning"], "model_type": "bridgetower",
    "contrastive_hidden_size": 512, "share_cross_modal_transformer_layers": True, "drop_rate": 0.1,
    "head_hidden_scale": 2, "hidden_act": "gelu", "hidden_size": 1024, "initializer_factor": 1,
    "is_encoder_decoder": False, "layer_norm_eps": 1e-05, "share_link_tower_layers": False, "link_tower_type": "add",
    "logit_scale_init_value": 2.6592, "num_attention_heads": 16, "num_hidden_layers": 6,
    "tie_word_embeddings": False, "text_config_dict": None, "init_layernorm_from_vision_encoder": False,
    "text_config": {"architectures": ["BridgeTowerTextModel"], "vocab_size": 50265, "hidden_size": 1024,
                    "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                    "max_position_embeddings": 514, "type_vocab_size": 1, "initializer_factor": 1,
                    "initializer_range": 0.02, "layer_norm_eps": 1e-05, "pad_token_id": 1, "bos_token_id": 0,
                    "eos_token_id": 2, "position_embedding_type": "absolute", "use_cache": True,
                    "classifier_dropout": None},
    "vision_config_dict": None,
    "vision_config": {"architectures": ["BridgeTowerVisionModel"], "hidden_size": 1024, "num_hidden_layers": 24,
                      "patch_size": 14, "image_size": 294, "initializer_factor": 1, "stop_gradient": False,
                      "share_layernorm": True, "remove_last_layer": False},
}


def test_published_large_config_json_matches_the_preset(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_LARGE_CONFIG))
    loaded = load_config(ModelArgs(model_name_or_path=str(tmp_path)))
    ours = configs.bridgetower_large()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "contrastive_hidden_size",
                "logit_scale_init_value", "share_cross_modal_transformer_layers", "share_link_tower_layers",
                "link_tower_type"):
        assert getattr(loaded, key) == getattr(ours, key), key
    for sub in ("text_config", "vision_config"):
        a, b = getattr(loaded, sub).to_dict(), getattr(ours, sub).to_dict()
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                    "patch_size", "image_size", "max_position_embeddings", "share_layernorm"):
            assert a.get(key) == b.get(key), (sub, key)
    # same parameter shapes: a checkpoint of this architecture loads into the preset's model
    with meta_device():
        shapes_loaded = {k: v.shape for k, v in BridgeTowerForContrastiveLearning(loaded).state_dict().items()}
        shapes_ours = {k: v.shape for k, v in BridgeTowerForContrastiveLearning(ours).state_dict().items()}
    assert shapes_loaded == shapes_ours
    # a checkpoint config without the ITC fields (e.g. ITM/MLM-only) gets the published values
    itm_mlm = {k: v for k, v in PUBLISHED_LARGE_CONFIG.items()
               if k not in ("contrastive_hidden_size", "logit_scale_init_value")}
    (tmp_path / "config.json").write_text(json.dumps(itm_mlm))
    patched = load_config(ModelArgs(model_name_or_path=str(tmp_path)))
    assert (patched.contrastive_hidden_size, patched.logit_scale_init_value) == (512, 2.6592)
