"""Model shapes for ds-tune and `ds-scaling-report predict`: the shipped models' descriptions (ds_configs/models/,
written from the model packages' presets) or any HF config.json, turned into a ModelShape (exact parameter count
from the transformers class built on the meta device; towers, sequence lengths, vocabulary for the memory model).

Its own module so that predict (which sizes gradients by it) and the tuner (which uses predict's communication model)
do not import each other.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from ds_core.config import DS_CONFIG_DIR
from ds_tools.zero_memory_model import ModelShape, Tower, TuningError

# Model descriptions (HF config.json form plus "seq_len") are written from the model packages' presets into
# ds_configs/models/ (ds_core imports no model package): `python -m bert_ref.configs --preset bert_1p5b --write_config
# PATH`, `python -m bridgetower_ds.configs --preset bridgetower_large --write_config PATH`; a test keeps the shipped
# files equal to the presets. Exact parameter counts come from building the matching transformers class on the meta
# device.
MODEL_DIR = DS_CONFIG_DIR / "models"
# the names ds-tune took before the descriptions came from the presets
MODEL_ALIASES = {"bert-large": "bert_large", "bert-1.5b": "bert_1p5b", "bridgetower-large": "bridgetower_large"}


def shipped_models() -> list[str]:
    """Names --model accepts besides a path: the files in ds_configs/models/ (and MODEL_ALIASES)."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.json"))


# ----------------------------------------------------------------------------------------------- model shapes



def load_spec(model: str) -> tuple:
    """(name, HF-config-like dict) for a shipped model name (or its old alias) or a config.json path."""
    p = Path(model)
    if not p.is_file():
        shipped = MODEL_DIR / f"{MODEL_ALIASES.get(model, model)}.json"
        if p.parent != Path(".") or not shipped.is_file():
            raise TuningError(f"--model {model!r}: not one of {', '.join(shipped_models() + sorted(MODEL_ALIASES))} "
                              f"(ds_configs/models/) and not an HF config.json file")
        p = shipped
    try:
        spec = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TuningError(f"{p}: not JSON ({e})") from None
    if not isinstance(spec, dict) or "model_type" not in spec:
        raise TuningError(f"{p}: expected an HF config with a 'model_type' key")
    return p.stem, spec


def _hf_config(spec: dict):
    from transformers import AutoConfig

    kw = {k: v for k, v in spec.items() if k not in ("model_type", "seq_len", "architectures")}
    return AutoConfig.for_model(spec["model_type"], **kw)


def _count_on_meta(spec: dict) -> tuple:
    """(params, largest single-module params) of the real transformers class, built on the meta device."""
    import transformers

    from ds_core.compat.torch_releases import meta_device

    cfg = _hf_config(spec)
    arch = (spec.get("architectures") or [None])[0]
    with meta_device():
        if arch and hasattr(transformers, arch):
            model = getattr(transformers, arch)(cfg)
        else:
            model = transformers.AutoModel.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())           # tied weights counted once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return params, largest


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _analytic_params(h: int, i: int, layers: int, vocab: int, pos: int) -> int:
    per_layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h     # qkvo + biases, ffn, 2 layernorms
    return layers * per_layer + (vocab + pos + 2) * h + 2 * h


@lru_cache(maxsize=16)
def _shape_cached(model: str, seq_len: int) -> ModelShape:
    name, spec = load_spec(model)
    mt = spec["model_type"]
    if mt == "bridgetower":
        t, v = spec["text_config"], spec["vision_config"]
        s_txt = seq_len or spec.get("seq_len", 50)
        s_img = (v["image_size"] // v["patch_size"]) ** 2 + 1
        h, heads = spec["hidden_size"], spec["num_attention_heads"]
        towers = [Tower("text", t["num_hidden_layers"], t["hidden_size"], t["num_attention_heads"],
                        t.get("intermediate_size", 4 * t["hidden_size"]), s_txt),
                  Tower("vision", v["num_hidden_layers"], v["hidden_size"], v.get("num_attention_heads", 16),
                        v.get("intermediate_size", 4 * v["hidden_size"]), s_img),
                  Tower("cross-text", spec["num_hidden_layers"], h, heads, 4 * h, s_txt, cross_seq=s_img),
                  Tower("cross-image", spec["num_hidden_layers"], h, heads, 4 * h, s_img, cross_seq=s_txt)]
        vocab, head_seq = t["vocab_size"], s_txt
        approx = (_analytic_params(t["hidden_size"], 4 * t["hidden_size"], t["num_hidden_layers"], t["vocab_size"],
                                   514)
                  + _analytic_params(v["hidden_size"], 4 * v["hidden_size"], v["num_hidden_layers"], 0, s_img)
                  + 2 * spec["num_hidden_layers"] * (_analytic_params(h, 4 * h, 1, 0, 0) + 4 * h * h))
        approx_largest = max(t["vocab_size"] * t["hidden_size"], 4 * h * h)
        # only BridgeTowerForMaskedLM computes token logits; the contrastive/ITM heads are small
        if "MaskedLM" not in str(spec.get("architectures")):
            vocab = 0
    else:
        h = _get(spec, "hidden_size", "n_embd", "d_model")
        layers = _get(spec, "num_hidden_layers", "n_layer", "num_layers")
        heads = _get(spec, "num_attention_heads", "n_head")
        if not (h and layers and heads):
            raise TuningError(f"{model}: need hidden_size, num_hidden_layers and num_attention_heads in the config")
        i = _get(spec, "intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h
        vocab = _get(spec, "vocab_size", default=0)
        pos = _get(spec, "max_position_embeddings", "n_positions", default=512)
        s = seq_len or spec.get("seq_len") or min(pos, 512)
        towers = [Tower("encoder" if mt in ("bert", "megatron-bert") else "layers", layers, h, heads, i, s)]
        head_seq = s
        approx = _analytic_params(h, i, layers, vocab, pos)
        approx_largest = max(vocab * h, h * i)
    try:
        params, largest = _count_on_meta(spec)
        exact = True
    except Exception:  # noqa: BLE001 - unknown model_type / no transformers: the formula is close
        params, largest, exact = approx, approx_largest, False
    return ModelShape(name=name, params=params, largest_layer_params=largest, towers=towers, vocab=vocab,
                      head_seq=head_seq, exact=exact)


def model_shape(model: str, seq_len: int = 0) -> ModelShape:
    return _shape_cached(model, int(seq_len or 0))
