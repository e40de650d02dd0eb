"""`--config run_config.json` of a run written before the settings became one named tree still loads: every value of
the file lands in the section and field of the same name, and the tree writes the file back unchanged (the format of
run_config.json did not change). The files are in tests/data/run_config_v1 (tests/data/README.md says what wrote
them)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import REPO
from ds_core.config import parse_settings, save_run_config, sections_of

OLD = REPO / "tests" / "data" / "run_config_v1"
# settings moved to another section since the files were written: name -> (old section, new section); the value lands
# in the new one (parse_settings reads a file's sections flat)
MOVED = {"resume_from_checkpoint": ("CompatArgs", "TrainConfig")}  # one setting of the loop for both models


def _trees():
    from bert_ref.configs import BertSettings
    from bridgetower_ds.configs import BridgeTowerSettings

    return {"bert_ref.json": BertSettings, "bridgetower_ds.json": BridgeTowerSettings}


@pytest.mark.parametrize("name", ["bert_ref.json", "bridgetower_ds.json"])
def test_an_older_run_config_loads_into_the_tree_and_writes_back_the_same(name, tmp_path):
    tree = _trees()[name]
    old = json.loads((OLD / name).read_text())
    argv = ["--config", str(OLD / name)]
    if "BertArgs" in old:  # validate() wants the shards directory to exist: the one setting given again
        (tmp_path / "shards").mkdir()
        argv += ["--input_dir", str(tmp_path / "shards")]
        old["BertArgs"]["input_dir"] = str(tmp_path / "shards")
    cfg = parse_settings(tree, argv)
    for key, (was, now) in MOVED.items():
        if key in old.get(was, {}):
            old[now][key] = old[was].pop(key)
    assert sorted(type(s).__name__ for s in sections_of(cfg)) == sorted(old)
    expected = {}
    for section in sections_of(cfg):
        name, values = type(section).__name__, vars(section)
        # a setting added since the file was written takes its default; every value of the file lands unchanged
        added = {f.name: _default(f) for f in dataclasses.fields(section) if f.name not in old[name]}
        assert values == {**old[name], **added}, name
        expected[name] = {**old[name], **added}
    written = save_run_config(tmp_path / "again", *sections_of(cfg))
    assert json.loads(written.read_text()) == expected


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f"{f.name} has no default: an older file cannot load"
    return f.default_factory()
