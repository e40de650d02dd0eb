"""Checkpoints are data: every kind of checkpoint file the toolkit reads is loaded weights-only, so a pickle payload
(a `__reduce__` that would create a marker file) placed in it is refused with the file's name and never runs:
a rank's client state (ds-ckpt info, resume), a Habana checkpoint (--init_checkpoint), and DeepSpeed's module,
optimizer and universal files (ds-ckpt export-hf / universal, on a real ZeRO-1 checkpoint). What the toolkit writes
(client state with its RNG states) loads weights-only and restores the same streams; a COMPLETE marker that is empty
or not the save's JSON object is named in one line, not a traceback."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, dist_env
from ds_core import checkpoint as ckpt
from ds_core.errors import ConfigError


class Payload:
    """What a hostile checkpoint holds: unpickling it runs `touch MARKER`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _complete(tag_dir: Path, step: int = 1, world: int = 1) -> None:
    (tag_dir / "COMPLETE").write_text(json.dumps({"step": step, "fingerprint": {"dp_world_size": world},
                                                  "batch": {"dp_world_size": world}}) + "\n")


def _hostile_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory whose one checkpoint's client state carries the payload; (run dir, marker path)."""
    marker = tmp_path / "PAYLOAD_RAN"
    tag = tmp_path / "run" / "checkpoints" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"step": 1, "epoch": 0, "data": Payload(marker)}, tag / "client_rank0.pt")
    _complete(tag)
    return tmp_path / "run", marker


def ds_ckpt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_tools.ckpt_cli", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, env=dist_env(), timeout=600)


def test_ds_ckpt_info_never_runs_a_client_state_payload(tmp_path):
    run, marker = _hostile_run(tmp_path)
    proc = ds_ckpt("info", run)
    assert not marker.exists(), "ds-ckpt info unpickled a client state file"
    assert proc.returncode == 0, proc.stderr
    assert "client_rank0.pt: not plain data" in proc.stdout and "posix.system" in proc.stdout, proc.stdout


def test_resume_reads_no_client_state_payload(tmp_path):
    run, marker = _hostile_run(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"client_rank0\.pt: not plain data"):
        ckpt.read_client_states(run / "checkpoints", "global_step1", 1)
    assert not marker.exists()


def test_habana_init_checkpoint_payload_is_refused_in_one_line(tmp_path):
    from bert_ref.habana_ckpt import read_habana_checkpoint

    marker = tmp_path / "PAYLOAD_RAN"
    f = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"bert.pooler.dense.weight": torch.zeros(2, 2)}, "args": Payload(marker)}, f)
    with pytest.raises(ConfigError) as e:
        read_habana_checkpoint(f)
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and "not plain data" in msg and "safetensors" in msg, msg
    # the plain form of the same checkpoint loads: a state dict of tensors, or its safetensors file
    torch.save({"module": {"bert.pooler.dense.weight": torch.ones(2, 2)}}, f)
    assert torch.equal(read_habana_checkpoint(f)["bert.pooler.dense.weight"], torch.ones(2, 2))
    from safetensors.torch import save_file

    save_file({"bert.pooler.dense.weight": torch.ones(2, 2)}, str(tmp_path / "habana.safetensors"))
    assert torch.equal(read_habana_checkpoint(tmp_path / "habana.safetensors")["bert.pooler.dense.weight"],
                       torch.ones(2, 2))


def test_rng_state_is_plain_data_that_restores_the_streams(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    from ds_core.checkpoint.client_state import plain_data

    state = plain_data(ckpt.rng_state())
    torch.save(state, tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand()) == want[:2] and torch.equal(torch.rand(1), want[2])


def test_client_state_of_the_earlier_layout_still_resumes(tmp_path):
    """Files written before the RNG state was stored as lists (numpy's state as its ndarray tuple) load as data, also
    where numpy 1.x's `numpy._core` (a stub for reading 2.x pickles, without its submodules) was imported first, as a
    library in a training process may do."""
    import importlib

    importlib.import_module("numpy._core")  # numpy 1.26 and 2.x both have it; 1.x's is the stub
    tag = tmp_path / "global_step1"
    tag.mkdir()
    np.random.seed(7)
    torch.save({"step": 1, "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                                   "torch": torch.get_rng_state()}}, tag / "client_rank0.pt")
    want = np.random.rand()
    (state,) = ckpt.read_client_states(tmp_path, "global_step1", 1)
    np.random.seed(0)
    ckpt.set_rng_state(state["rng"])
    assert np.random.rand() == want


def test_plain_data_names_what_would_need_unpickling():
    from ds_core.checkpoint.client_state import plain_data

    assert plain_data({"a": np.int64(3), "b": np.arange(2), "c": (1, [2.5])}) == {"a": 3, "b": [0, 1], "c": (1, [2.5])}
    with pytest.raises(TypeError, match=r"client state\['data'\]\['when'\]: a datetime\.date"):
        import datetime

        plain_data({"data": {"when": datetime.date(2024, 1, 1)}})


@pytest.mark.parametrize("text, why", [("", "empty"), ("[1]", "a JSON list, not an object"),
                                       ('{"step": "x", "fingerprint": {}}', "step 'x' is not an integer"),
                                       ("{nope", "not JSON")])
def test_bad_complete_marker_is_named_in_one_line(tmp_path, text, why):
    tag = tmp_path / "run" / "checkpoints" / "global_step1"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text(text)
    with pytest.raises(ConfigError, match=why):
        ckpt.read_marker(tag.parent, "global_step1")
    proc = ds_ckpt("info", tmp_path / "run")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "global_step1: INCOMPLETE (unreadable COMPLETE; never loaded)" in proc.stdout and why in proc.stdout
    assert "latest complete none" in proc.stdout


# ---- DeepSpeed's own files, on a real ZeRO-1 bf16 checkpoint (BF16_Optimizer: export-hf goes through the universal
# conversion, so ds_to_universal's and zero_to_fp32's reads are both exercised)

@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from test_resize import ds_json, tiny_run

    d = tmp_path_factory.mktemp("ckpt_data")
    tiny_run(d / "run", ds_json(d, 1), 2, "--max_steps", "2", "--num_steps_per_checkpoint", "2", precision="bf16")
    return d / "run"


def _copy_with_payload(run: Path, dest: Path, rel: str, marker: Path) -> Path:
    """A copy of the run whose file `rel` (under checkpoints/global_step2) also holds the payload."""
    import shutil

    shutil.copytree(run, dest)
    f = dest / "checkpoints" / "global_step2" / rel
    obj = torch.load(f, map_location="cpu", weights_only=False)  # the test's own file
    obj["injected"] = Payload(marker)
    torch.save(obj, f)
    return dest


@pytest.mark.slow
def test_own_checkpoint_files_load_weights_only(bf16_checkpoint):
    tag = bf16_checkpoint / "checkpoints" / "global_step2"
    for f in sorted(tag.glob("client_rank*.pt")):
        state = torch.load(f, weights_only=True)
        assert state["step"] == 2 and isinstance(state["rng"]["numpy"]["keys"], list), f


@pytest.mark.slow
@pytest.mark.parametrize("rel, command", [("mp_rank_00_model_states.pt", "export-hf"),
                                          ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "export-hf"),
                                          ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "universal")])
def test_deepspeed_file_payload_is_refused_by_export_and_universal(bf16_checkpoint, tmp_path, rel, command):
    marker = tmp_path / "PAYLOAD_RAN"
    run = _copy_with_payload(bf16_checkpoint, tmp_path / "run", rel, marker)
    proc = ds_ckpt(command, run, *([tmp_path / "hf"] if command == "export-hf" else []))
    assert not marker.exists(), f"ds-ckpt {command} unpickled {rel}"
    assert proc.returncode == 2 and f"{rel}: not plain data" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_universal_fp32_file_payload_is_refused_by_export(bf16_checkpoint, tmp_path):
    """export-hf's reader of the fp32 master weights in a universal conversion (what it takes where zero_to_fp32
    does not read BF16_Optimizer's files: DeepSpeed 0.16)."""
    import shutil

    from ds_core.checkpoint.safe_load import NotPlainData
    from ds_tools.ckpt_cli import fp32_from_universal

    run = tmp_path / "run"
    shutil.copytree(bf16_checkpoint, run)
    root = run / "checkpoints"
    assert ds_ckpt("universal", run).returncode == 0
    clean = fp32_from_universal(root, "global_step2")
    f = sorted((root / "global_step2_universal" / "zero").glob("*/fp32.pt"))[0]
    marker = tmp_path / "PAYLOAD_RAN"
    obj = torch.load(f, weights_only=False)
    obj["injected"] = Payload(marker)
    torch.save(obj, f)
    with pytest.raises(NotPlainData, match=r"fp32\.pt: not plain data"):
        fp32_from_universal(root, "global_step2")
    assert not marker.exists()
    assert f.parent.name in clean and clean[f.parent.name].dtype == torch.float32
