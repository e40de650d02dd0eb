"""Secrets stay secret: a run given `--token` (and a secret-looking variable in its environment) writes it into no
file of its run directory (run_config.json, the run lock, checkpoints, Trainer's files) and prints it in no line;
`launch.env write --forward` writes .deepspeed_env 0600 and names the secret-looking variables it forwarded without
their values; `launch.run --dry_run` shows <redacted>; mpirun (ours and DeepSpeed's MPI runners) gets secrets by
name, never as a value on its command line; DeepSpeed's launcher log lines and the preflight all-reduce's ssh
command carry none."""
from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dist_env, run_deepspeed

SECRET = "hf_s3cr3tVALUE42"


def _grep_tree(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.mark.slow
def test_a_run_writes_and_prints_no_secret(tmp_path):
    from test_bt_train import COMMON, ds_json, make_caption_set

    data = make_caption_set(tmp_path / "captions", 32)
    run = tmp_path / "run"
    proc = run_deepspeed(["--module", "bridgetower_ds.train", "--do_train", "--dataset_path", str(data),
                          "--run_dir", str(run), "--deepspeed_config",
                          str(ds_json(tmp_path, "bridgetower_zero1_bf16.json")), "--token", SECRET,
                          "--missing_splits", "fractions", *COMMON[:1], "2", *COMMON[2:],
                          "--num_steps_per_checkpoint", "2"],
                         env=dist_env(WANDB_API_KEY=SECRET + "w"))
    assert (run / "run_config.json").is_file() and (run / "checkpoints" / "global_step2" / "COMPLETE").is_file()
    assert json.loads((run / "run_config.json").read_text())["CompatArgs"]["token"] == "<redacted>"
    assert not _grep_tree(run, SECRET), "secret written into the run directory"
    assert SECRET not in proc.stdout, [ln for ln in proc.stdout.splitlines() if SECRET in ln]


def test_run_config_and_lock_redact_and_read_back(tmp_path, monkeypatch):
    from bridgetower_ds.configs import CompatArgs
    from ds_core.config import parse_args, save_run_config
    from ds_core.rank import run_lock

    args = CompatArgs(token=SECRET)
    path = save_run_config(tmp_path, args)
    assert SECRET not in path.read_text() and json.loads(path.read_text())["CompatArgs"]["token"] == "<redacted>"
    (back,) = parse_args([CompatArgs], ["--config", str(tmp_path)])
    assert back.token == ""  # the placeholder is not taken for a token
    monkeypatch.setattr(sys, "argv", ["train.py", "--token", SECRET, f"--hub_token={SECRET}"])
    lock = run_lock.acquire(tmp_path / "r", heartbeat=False)
    try:
        text = (tmp_path / "r" / run_lock.LOCK_NAME).read_text()
        assert SECRET not in text and "--token <redacted> --hub_token=<redacted>" in text, text
    finally:
        lock.release()


def _env_tool(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.env", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=dist_env(PYTHONPATH=str(REPO), **env))


def test_forwarded_secret_file_is_0600_and_named_without_its_value(tmp_path):
    old = os.umask(0o022)
    try:
        proc = _env_tool(tmp_path, "write", "--forward", "HF_", "--set", "PLAIN_SETTING=1", HF_TOKEN=SECRET,
                         HF_HOME="/x")
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    f = tmp_path / ".deepspeed_env"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and SECRET in f.read_text()
    assert "forwarded secret-looking variables: HF_TOKEN" in proc.stderr and "HF_HOME" not in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr


def _dry(tmp_path: Path, *args: str, hosts: int = 2) -> tuple[dict, str]:
    (tmp_path / "hostfile").write_text("".join(f"node{i} slots=1\n" for i in range(hosts)))
    proc = subprocess.run([sys.executable, "-m", "launch.run", "--hostfile", "hostfile", "--dry_run", *args,
                           "--", "--token", SECRET], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dist_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout and SECRET not in proc.stderr, proc.stdout + proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_dry_run_and_mpi_command_lines_carry_no_secret(tmp_path):
    (tmp_path / ".deepspeed_env").write_text(f"HF_TOKEN={SECRET}\nDS_ACCELERATOR=cpu\n")
    out, err = _dry(tmp_path, "--launcher", "mpirun", "--mpi_flavor", "openmpi")
    argv = out["argv"]
    assert argv[argv.index("HF_TOKEN") - 1] == "-x" and "DS_ACCELERATOR=cpu" in argv  # by name; a plain value as is
    assert "--token" in argv and argv[argv.index("--token") + 1] == "<redacted>"
    assert out["env_added"]["HF_TOKEN"] == "<redacted>"
    out, _ = _dry(tmp_path, "--launcher", "mpirun", "--mpi_flavor", "mpich")
    assert out["argv"][out["argv"].index("-genvlist") + 1] == "HF_TOKEN"
    # DeepSpeed's Open MPI runner: its .deepspeed_env comes without the secret, which mpirun forwards by name
    out, _ = _dry(tmp_path, "--launcher", "openmpi", "--master_addr", "10.0.0.1")
    assert "--launcher_args=-x HF_TOKEN" in out["argv"], out["argv"]
    env_file = Path(out["env_added"]["DS_ENV_FILE"])
    assert env_file.read_text() == "DS_ACCELERATOR=cpu\n" and stat.S_IMODE(env_file.stat().st_mode) == 0o600
    # pdsh: no other channel than the remote command line: said, by name
    _, err = _dry(tmp_path)
    assert "pdsh will put HF_TOKEN on every node's command line" in err, err


def test_deepspeed_launcher_log_lines_are_redacted(monkeypatch, caplog):
    from deepspeed.utils import logger

    from launch.ds_runner import RedactSecrets, secret_values

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    f = RedactSecrets(secret_values())
    logger.addFilter(f)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            logger.propagate, was = True, logger.propagate
            logger.info("cmd = pdsh ... export AWS_SECRET_ACCESS_KEY=%s; cd /w;", SECRET)
            logger.propagate = was
    finally:
        logger.removeFilter(f)
    assert caplog.records and SECRET not in caplog.text and "AWS_SECRET_ACCESS_KEY=<redacted>" in caplog.text


def test_preflight_allreduce_ssh_command_has_no_secret():
    from launch.allreduce import remote_command

    cmd = remote_command("node1", ["python", "-m", "launch.allreduce"], {"HF_TOKEN": SECRET, "FI_PROVIDER": "tcp"},
                         0, 10)
    assert SECRET not in " ".join(cmd) and "FI_PROVIDER=tcp" in cmd[-1]
