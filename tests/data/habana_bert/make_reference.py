"""Runs HabanaAI Model-References' own BERT modeling code (PyTorch/nlp/DeepSpeedExamples/deepspeed-bert/modeling.py,
BertForPreTraining with `layer_norm_large_model: true`, the form of scripts/bert_1.5b_config.json) on seeded random
weights and inputs of a small config, and writes what tests/test_bert_habana.py compares against:
reference.json (config, state-dict names and shapes in Habana's order, seeds, sha256 of the weights) and
reference.npz (inputs, MLM and NSP logits, float32, in eval mode and in training mode with a seeded dropout).

Run from a copy of the reference OUTSIDE this repository (no HPU needed: on a machine without CUDA, modeling.py uses
torch.nn.LayerNorm and F.gelu, as it does on Gaudi):
    git --git-dir=<mirror of HabanaAI/Model-References> archive 06bfc5ea PyTorch/nlp/DeepSpeedExamples/deepspeed-bert \
        | tar -x -C /tmp/ref_habana
    PYTHONPATH=/tmp/ref_habana/PyTorch/nlp/DeepSpeedExamples/deepspeed-bert \
        python tests/data/habana_bert/make_reference.py
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REFERENCE = {"repo": "HabanaAI/Model-References", "commit": "06bfc5eaa56c3282c26896efd535982abe52b2eb",
             "commit_title": "Model-References content for 1.23.0",
             "file": "PyTorch/nlp/DeepSpeedExamples/deepspeed-bert/modeling.py"}
# bert_1.5b_config.json's structure (Pre-LN, gelu, 2 token types) at a size a CPU test runs in milliseconds; 3 layers
# so that a LayerNorm between two layers is mapped too; vocab 250 is not a multiple of 8 (ours pads it, as 30522).
CONFIG = {"vocab_size": 250, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
          "intermediate_size": 256, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
          "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 64, "type_vocab_size": 2,
          "initializer_range": 0.02, "layer_norm_large_model": True}
WEIGHT_SEED, INPUT_SEED, DROPOUT_SEED, BATCH, SEQ = 1234, 99, 7, 3, 16


def seeded_state_dict(names_shapes: list[tuple[str, list[int]]], seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    """Every tensor drawn in Habana's state-dict order from one generator: LayerNorm weights 1 + 0.1 N(0, 1), the
    rest 0.05 N(0, 1) (random LayerNorms and biases, so a wrong name mapping cannot hide behind ones and zeros); the
    MLM decoder weight is the word embeddings (tied, as in the model)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names_shapes:
        if name == "cls.predictions.decoder.weight":
            continue
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        out[name] = 1 + 0.1 * t if "LayerNorm.weight" in name else 0.05 * t
    out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    return out


def fingerprint(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(sd):
        h.update(name.encode())
        h.update(sd[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def seeded_inputs(seed: int = INPUT_SEED) -> dict[str, np.ndarray]:
    """Token ids over the whole vocabulary, two segments, and padding at the end of rows 1 and 2."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    for row, (sep, length) in enumerate([(7, SEQ), (5, 11), (9, 13)]):
        types[row, sep:length] = 1
        mask[row, length:] = 0
        ids[row, length:] = 0
    return {"input_ids": ids.numpy(), "token_type_ids": types.numpy(), "attention_mask": mask.numpy()}


def main() -> None:
    import modeling  # Habana's, from PYTHONPATH (see the docstring)

    torch.manual_seed(0)
    model = modeling.BertForPreTraining(modeling.BertConfig.from_dict(dict(CONFIG, output_all_encoded_layers=False,
                                                                           gated_layers=()))).eval()
    names_shapes = [(n, list(t.shape)) for n, t in model.state_dict().items()]
    sd = seeded_state_dict(names_shapes)
    model.load_state_dict(sd)
    inputs = seeded_inputs()
    args = [torch.from_numpy(inputs[k]) for k in ("input_ids", "token_type_ids", "attention_mask")]
    with torch.no_grad():
        mlm, nsp = model(*args)
        # training mode: dropout 0.1 everywhere, torch's generator seeded just before the forward (the draws are
        # then comparable with a model that calls its dropouts in the same order on the same shapes)
        torch.manual_seed(DROPOUT_SEED)
        mlm_train, nsp_train = model.train()(*args)
    np.savez_compressed(HERE / "reference.npz", mlm_logits=mlm.numpy(), nsp_logits=nsp.numpy(),
                        mlm_logits_train=mlm_train.numpy(), nsp_logits_train=nsp_train.numpy(), **inputs)
    meta = {"reference": REFERENCE, "config": CONFIG, "weight_seed": WEIGHT_SEED, "input_seed": INPUT_SEED,
            "dropout_seed": DROPOUT_SEED,
            "state_dict": names_shapes, "state_dict_sha256": fingerprint(sd), "torch": torch.__version__,
            "command": "PYTHONPATH=<deepspeed-bert copy> python tests/data/habana_bert/make_reference.py"}
    (HERE / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print("mlm", tuple(mlm.shape), float(mlm.abs().max()), "nsp", nsp.numpy().tolist(), file=sys.stderr)


if __name__ == "__main__":
    main()
