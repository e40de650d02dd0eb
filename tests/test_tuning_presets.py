"""ds-tune reads model shapes from the model packages' presets: the descriptions shipped in ds_configs/models/ equal
what the presets write, ds-tune counts exactly the parameters of the model each package builds, and the names ds-tune
took before (bert-large, bert-1.5b, bridgetower-large) still resolve to them."""
import json

import pytest

from ds_core.compat.torch_releases import meta_device
from ds_tools import tuning

pytestmark = pytest.mark.stack

PRESET_FILES = {"bert_large": ("bert", "bert_large"), "bert_1p5b": ("bert", "bert_1p5b"),
                "bridgetower_large": ("bridgetower", "bridgetower_large")}


def written_by_preset(package: str, preset: str, tmp_path, **kw) -> dict:
    out = tmp_path / f"{preset}.json"
    if package == "bert":
        from bert_ref.configs import main
        extra = [f"--phase={kw['phase']}"] if "phase" in kw else []
    else:
        from bridgetower_ds.configs import main
        extra = [f"--seq_len={kw['seq_len']}"] if "seq_len" in kw else []
    assert main(["--preset", preset, "--write_config", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_every_shipped_description_is_written_by_its_preset(tmp_path):
    assert tuning.shipped_models() == sorted(PRESET_FILES)
    for name, (package, preset) in PRESET_FILES.items():
        shipped = json.loads((tuning.MODEL_DIR / f"{name}.json").read_text())
        assert shipped == written_by_preset(package, preset, tmp_path), (
            f"ds_configs/models/{name}.json differs from preset {preset}: regenerate it (ds_configs/models/README.md)")
    for old, new in tuning.MODEL_ALIASES.items():
        assert tuning.load_spec(old) == tuning.load_spec(new)


@pytest.mark.parametrize("preset", ["bert_large", "bert_1p5b", "debug_pre_ln"])
def test_bert_parameters_are_those_bert_ref_builds(preset, tmp_path):
    from bert_ref.configs import get_preset
    from bert_ref.model import param_counts

    for phase in (1, 2):
        (tmp_path / str(phase)).mkdir()
        spec = written_by_preset("bert", preset, tmp_path / str(phase), phase=phase)
        shape = tuning.model_shape(str(tmp_path / str(phase) / f"{preset}.json"))
        built = get_preset(preset, phase)
        assert shape.exact and shape.params == param_counts(built)["total"]
        assert shape.towers[0].seq == spec["seq_len"] == built.seq_len
        assert (shape.towers[0].layers, shape.towers[0].hidden, shape.towers[0].heads, shape.towers[0].intermediate,
                shape.vocab) == (built.num_hidden_layers, built.hidden_size, built.num_attention_heads,
                                 built.intermediate_size, built.vocab_size)


@pytest.mark.parametrize("preset", ["bridgetower_large", "bridgetower_base"])
def test_bridgetower_parameters_are_those_bridgetower_ds_builds(preset, tmp_path):
    from bridgetower_ds.configs import preset as bt_preset
    from bridgetower_ds.model import BridgeTowerContrastive

    spec = written_by_preset("bridgetower", preset, tmp_path, seq_len=40)
    shape = tuning.model_shape(str(tmp_path / f"{preset}.json"))
    cfg = bt_preset(preset)
    with meta_device():
        model = BridgeTowerContrastive(cfg)
    assert shape.exact and shape.params == sum(p.numel() for p in model.parameters())
    text, vision = shape.towers[0], shape.towers[1]
    assert text.seq == spec["seq_len"] == 40 and text.layers == cfg.text_config.num_hidden_layers
    assert vision.seq == (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2 + 1


def test_unknown_model_names_the_shipped_ones():
    with pytest.raises(tuning.TuningError, match="bert_1p5b.*ds_configs/models"):
        tuning.model_shape("gpt-17")
    with pytest.raises(tuning.TuningError, match="not an HF config.json"):
        tuning.model_shape("no/such/bert_large.json")
