"""bridgetower_ds refuses bad user input with ds_core's ConfigError (as bert_ref does), naming the flag and what was
expected, before any data or model is loaded."""
import dataclasses

import pytest
import torch

from bridgetower_ds.configs import DataArgs, ModelArgs
from bridgetower_ds.images import resolve_pipeline
from bridgetower_ds.model import apply_freezing, build_model
from bridgetower_ds.tokenizer import load_tokenizer
from ds_core.errors import ConfigError


@pytest.mark.parametrize("change,flag", [
    (dict(dataset_format="parquet"), "--dataset_format"), (dict(image_pipeline="gpu"), "--image_pipeline"),
    (dict(bad_image="ignore"), "--bad_image"), (dict(test_fraction=1.5), "--test_fraction"),
    (dict(validation_fraction=0.6, test_fraction=0.5), "--validation_fraction"),
    (dict(max_seq_length=1), "max_seq_length")])
def test_data_flags(change, flag):
    with pytest.raises(ConfigError, match=flag):
        dataclasses.replace(DataArgs(dataset_path="x.json"), **change).validate()


def test_pipeline_tokenizer_and_freezing_flags():
    with pytest.raises(ConfigError, match="--image_pipeline must be host, device or auto, got 'gpu'"):
        resolve_pipeline("gpu", torch.device("cpu"))
    with pytest.raises(ConfigError, match="preset 'bridgetower_large' needs the model's tokenizer"):
        load_tokenizer(ModelArgs(preset="bridgetower_large"))
    args = ModelArgs(preset="debug", freeze_vision_model=True, freeze_text_model=True)
    model = build_model(args)
    for p in model.parameters():      # what is left after the towers: freeze it too
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="every parameter is frozen.*--freeze_"):
        apply_freezing(model, args)


def test_help_lists_every_flag():
    """--help renders every setting's help (argparse formats help with %: a literal '40 %' in a help string must not
    break it)."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "bridgetower_ds.train", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--attn_implementation" in proc.stdout and "--missing_splits" in proc.stdout
    assert "40 % of train" in proc.stdout
