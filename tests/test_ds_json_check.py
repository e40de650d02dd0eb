"""The whole DeepSpeed JSON checked by DeepSpeed's own config classes before any rank is spawned
(ds_core.config.ds_json): each bad case is refused naming the file and the key, by the starters (local_ranks,
launch.run) before a rank runs."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dist_env
from ds_core.config import DS_CONFIG_DIR
from ds_core.config.ds_json import check_before_spawn, check_ds_json, ds_config_in
from ds_core.errors import ConfigError

pytestmark = pytest.mark.stack

BASE = json.loads((DS_CONFIG_DIR / "zero1_bf16.json").read_text())


def _with(**changes):
    """BASE with dotted-key changes ("a.b": v sets cfg["a"]["b"]; a value None deletes)."""
    cfg = copy.deepcopy(BASE)
    for dotted, v in changes.items():
        *parents, last = dotted.split("__")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return cfg


# (case, JSON, what the message must say). Before this check, all but the first two were found only by the ranks,
# after distributed init (or after the model was built), and the nested ones without the file's name.
CASES = [
    ("malformed JSON", "{", "malformed JSON at line 1"),
    ("negative lr", _with(optimizer__params__lr=-1.0), "optimizer.params.lr = -1.0"),
    ("top-level typo", _with(zero_optimisation={"stage": 1}),
     "'zero_optimisation' (did you mean 'zero_optimization'?)"),
    ("batch arithmetic", _with(train_batch_size=12), "train_batch_size=12"),
    ("zero stage 4", _with(zero_optimization__stage=4), "zero_optimization.stage = 4"),
    ("zero section a list", _with(zero_optimization=[1]), "zero_optimization = [1]: expected a JSON object"),
    ("nested typo", _with(zero_optimization__overlap_com=True),
     "unknown key zero_optimization.overlap_com (did you mean zero_optimization.overlap_comm?)"),
    ("doubly nested typo", _with(zero_optimization__offload_optimizer={"devcie": "cpu"}),
     "unknown key zero_optimization.offload_optimizer.devcie "
     "(did you mean zero_optimization.offload_optimizer.device?)"),
    ("offload device", _with(zero_optimization__offload_optimizer={"device": "gpu"}),
     "zero_optimization.offload_optimizer.device = 'gpu'"),
    ("bf16.enabled not a bool", _with(bf16__enabled="maybe"), "bf16.enabled = 'maybe'"),
    ("fp16 typo", _with(fp16={"enabled": False, "initial_scale_pwr": 16}),
     "unknown key fp16.initial_scale_pwr (did you mean fp16.initial_scale_power?)"),
    ("fp16 negative loss scale", _with(fp16={"enabled": False, "loss_scale": -1}), "fp16.loss_scale = -1"),
    ("tensorboard typo", _with(tensorboard={"enabled": True, "output": "tb"}),
     "unknown key tensorboard.output (did you mean tensorboard.output_path?)"),
    ("comms_logger value", _with(comms_logger={"enabled": "x"}), "comms_logger.enabled = 'x'"),
    ("optimizer type", _with(optimizer__type="Adamm"), "optimizer.type = 'Adamm'"),
    ("scheduler type", _with(scheduler={"type": "WarmupLRR", "params": {}}), "scheduler.type = 'WarmupLRR'"),
    ("scheduler param typo", _with(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 10}}),
     "unknown key scheduler.params.warmup_num_step for WarmupLR"),
]


def _write(tmp_path: Path, cfg) -> Path:
    p = tmp_path / "bad.json"
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return p


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_json_is_refused_naming_file_and_key(tmp_path, case):
    _, cfg, says = case
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError) as e:
        check_before_spawn(path, world_size=2)
    assert str(path) in str(e.value) and says in str(e.value), str(e.value)


def test_shipped_configs_pass_and_entry_check_covers_nested_keys(tmp_path):
    for p in sorted(DS_CONFIG_DIR.glob("*.json")):
        check_before_spawn(p)  # every shipped JSON is one DeepSpeed accepts
    path = _write(tmp_path, _with(zero_optimization__overlap_com=True))
    with pytest.raises(ConfigError, match=r"bad.json: unknown key zero_optimization.overlap_com"):
        check_ds_json(path, optimizer_in_code=False)  # the ranks' own check, before distributed init
    assert ds_config_in(["-m", "x", "--deepspeed_config", "a.json"]) == "a.json"
    assert ds_config_in(["--deepspeed_config=b.json"]) == "b.json" and ds_config_in(["--x"]) == ""


def test_starters_refuse_before_spawning_a_rank(tmp_path):
    """local_ranks and launch.run exit 2 naming file and key; the target never ran (it would leave a file)."""
    path = _write(tmp_path, _with(zero_optimization__offload_optimizer={"devcie": "cpu"}))
    target = tmp_path / "target.py"
    target.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "launch.local_ranks", "-n", "2", str(target), "--deepspeed_config",
                           str(path)], cwd=REPO, env=dist_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"{path}: unknown key zero_optimization.offload_optimizer.devcie" in proc.stderr
    assert not (tmp_path / "ran").exists()

    (tmp_path / "hosts").write_text("localhost slots=2\n")
    proc = subprocess.run([sys.executable, "-m", "launch.run", "--launcher", "no_ssh", "--hostfile",
                           str(tmp_path / "hosts"), "--master_addr", "127.0.0.1", "--node_rank", "0",
                           "--deepspeed_config", str(path), "--module", "tests.nothing"], cwd=REPO, env=dist_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{path}: unknown key zero_optimization.offload_optimizer.devcie" in proc.stderr
