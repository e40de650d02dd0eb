"""Habana deepspeed-bert checkpoints (HabanaAI Model-References PyTorch/nlp/DeepSpeedExamples/deepspeed-bert,
modeling.py BertForPreTraining with `layer_norm_large_model: true`) into our Pre-LN model in Habana's form
(presets with habana_pre_ln: bert_1p5b_habana, debug_habana; bert_ref.model.habana_pre_ln_form).

Habana's names -> ours (MegatronBertForPreTraining), L layers:
  bert.embeddings.LayerNorm.*                 -> bert.encoder.layer.0.attention.ln.*
  bert.encoder.layer.i.attention.output.LayerNorm.* -> bert.encoder.layer.i.ln.*
  bert.encoder.layer.i.output.LayerNorm.*     -> bert.encoder.layer.{i+1}.attention.ln.*, and for i = L-1
                                                 bert.encoder.ln.*
  *.dense_act.* (fused linear + activation)   -> *.dense.*  (intermediate, pooler, MLM transform)
  *.gamma / *.beta (TF-era names, renamed by Habana's from_pretrained too) -> *.weight / *.bias
and every other name is the same. A checkpoint is a state dict, a dict with one under 'module' (DeepSpeed's
mp_rank_00_model_states.pt, what Habana's run_pretraining.py saves) or 'model', a `.safetensors` file of the state
dict, or a DeepSpeed checkpoint directory.

Such a file always comes from elsewhere, so it is read as data: torch.load(weights_only=True) with DeepSpeed's plain
records allowed (ds_core.checkpoint.safe_load), never unpickled. A file that needs more (a pickled object among its
entries) is refused in one line that names it and says how to turn it into a state dict where it is trusted.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ds_core.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a checkpoint is read: bert_ref.configs imports this module for the check
    import torch

_DECODER = "cls.predictions.decoder.weight"
_WORDS = "bert.embeddings.word_embeddings.weight"


def habana_to_ours(name: str, num_layers: int) -> str:
    """Our parameter name of one Habana state-dict name (module docstring)."""
    name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
    name = name.replace(".dense_act.", ".dense.")
    if name.startswith("bert.embeddings.LayerNorm."):
        return "bert.encoder.layer.0.attention.ln." + name.rsplit(".", 1)[1]
    m = re.fullmatch(r"bert\.encoder\.layer\.(\d+)\.(attention\.output|output)\.LayerNorm\.(weight|bias)", name)
    if m:
        i, where, kind = int(m.group(1)), m.group(2), m.group(3)
        if where == "attention.output":
            return f"bert.encoder.layer.{i}.ln.{kind}"
        return f"bert.encoder.ln.{kind}" if i == num_layers - 1 else f"bert.encoder.layer.{i + 1}.attention.ln.{kind}"
    return name


_MODEL_FILE = "mp_rank_00_model_states.pt"


def is_habana_checkpoint(path: str | Path) -> bool:
    """A DeepSpeed checkpoint file, a tag directory holding one, or a DeepSpeed save directory (`latest` + tags);
    not a Hugging Face directory (config.json)."""
    path = Path(path)
    if path.is_file():
        return path.suffix in (".pt", ".safetensors")
    return path.is_dir() and not (path / "config.json").exists() and (
        (path / _MODEL_FILE).is_file() or (path / "latest").is_file() or any(path.glob(f"*/{_MODEL_FILE}")))


def read_habana_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The model state dict in a Habana checkpoint file or DeepSpeed checkpoint directory (module docstring); of a
    save directory, the tag its `latest` file names."""
    path = Path(path)
    if path.is_dir():
        if (path / _MODEL_FILE).is_file():
            path = path / _MODEL_FILE
        elif (path / "latest").is_file():
            tag = (path / "latest").read_text().strip()
            if not (path / tag / _MODEL_FILE).is_file():
                raise ConfigError(f"Habana checkpoint {path}: 'latest' names tag {tag!r}, but "
                                  f"{path / tag / _MODEL_FILE} does not exist (an unfinished save?)")
            path = path / tag / _MODEL_FILE
        else:
            files = sorted(path.glob(f"*/{_MODEL_FILE}"))
            if len(files) != 1:
                raise ConfigError(f"Habana checkpoint {path}: no 'latest' file and {len(files)} tag directories with "
                                  f"{_MODEL_FILE}; give the tag directory")
            path = files[0]
    import torch

    from ds_core.checkpoint.safe_load import NotPlainData, load

    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path))
        else:
            obj = load(path, deepspeed=True)
    except NotPlainData as e:
        raise ConfigError(f"Habana checkpoint {e}. Where you trust the file, save its state dict as tensors only "
                          f"and pass that: python -c \"import torch; from safetensors.torch import save_file; "
                          f"save_file(torch.load('{path}', weights_only=False)['module'], 'habana.safetensors')\"") \
            from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported with its path
        raise ConfigError(f"Habana checkpoint {path}: cannot read it: {type(e).__name__}: {e}") from e
    for key in ("module", "model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"Habana checkpoint {path}: expected a state dict (name -> tensor), or one under "
                          f"'module' / 'model'")
    return obj


def load_habana_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], where: str = "state dict"
                           ) -> None:
    """Copy a Habana BertForPreTraining state dict into `model` (our Pre-LN model in Habana's form). Every tensor of
    the model must be given and every given tensor used, with the same shape, except the vocabulary: Habana's 30522
    rows go into our padded 30528 (the extra rows, never produced by the tokenizer, get zero embeddings and MLM bias).
    Errors name the checkpoint and the tensors."""
    import torch

    if not getattr(model.config, "habana_pre_ln", False):
        raise ConfigError(f"{where}: a Habana checkpoint goes into a habana_pre_ln preset (bert_1p5b_habana, "
                          f"debug_habana); this model computes MegatronBert's Pre-LN, another function")
    sd = {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state_dict.items()}
    if _DECODER in sd and _WORDS in sd and not torch.equal(sd[_DECODER], sd[_WORDS]):
        raise ConfigError(f"{where}: {_DECODER} differs from {_WORDS}; Habana's model ties them")
    sd.pop(_DECODER, None)
    layers = model.config.num_hidden_layers
    mapped: dict[str, torch.Tensor] = {}
    theirs: dict[str, str] = {}
    for name, tensor in sd.items():
        ours = habana_to_ours(name, layers)
        if ours in mapped:
            raise ConfigError(f"{where}: {name} maps to {ours}, which {theirs[ours]} already filled")
        mapped[ours], theirs[ours] = tensor, name
    own = {k: v for k, v in model.state_dict().items() if k != _DECODER and k != "cls.predictions.decoder.bias"}
    missing, unused = sorted(set(own) - set(mapped)), sorted(set(mapped) - set(own))
    if missing or unused:
        raise ConfigError(f"{where}: not a Habana BertForPreTraining of {layers} layers: missing {missing[:6]}"
                          f"{' ...' if len(missing) > 6 else ''}; not used {unused[:6]}"
                          f"{' ...' if len(unused) > 6 else ''}")
    for name, tensor in mapped.items():
        want = own[name].shape
        if name in (_WORDS, "cls.predictions.bias") and tensor.shape[0] < want[0] and tensor.shape[1:] == want[1:]:
            tensor = torch.cat([tensor, tensor.new_zeros((want[0] - tensor.shape[0], *want[1:]))])
        if tensor.shape != want:
            raise ConfigError(f"{where}: {theirs[name]} (ours {name}) has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(want)}")
        mapped[name] = tensor
    with torch.no_grad():
        result = model.load_state_dict(mapped, strict=False)
    left = [k for k in result.missing_keys if k not in (_DECODER, "cls.predictions.decoder.bias")]
    if left or result.unexpected_keys:
        raise ConfigError(f"{where}: load left {left} unset and did not use {result.unexpected_keys}")
    model.tie_weights()
