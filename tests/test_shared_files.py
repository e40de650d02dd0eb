"""Files on a shared machine: the HPU media cache is this user's own directory (0700, owner and mode checked),
content-keyed and written without following a planted symlink; the demos never remove a directory they did not
make; the Slurm entry's hostfile is created anew (O_EXCL) in this user's private directory; run directories follow
the umask while a file holding a secret is 0600 whatever the umask."""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

import pytest

from conftest import dist_env


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The system temp dir is tmp_path (where a shared /tmp would be)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _table(images: list[bytes], source: str = "/data/newyorker"):
    from bridgetower_ds.table import CaptionTable

    return CaptionTable(images, [f"caption {i}" for i in range(len(images))], "", source)


def test_media_cache_is_private_and_named_by_content(private_tmp):
    from bridgetower_ds.hpu_media import materialize

    a, b = b"\xff\xd8\xff first image", b"\xff\xd8\xff second image"
    paths = materialize(_table([a, b, a]), "", 0)
    root = private_tmp / f"bt_images-{os.getuid()}"
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    assert [Path(p).parent for p in paths] == [root] * 3
    assert [Path(p).name for p in paths] == [hashlib.sha256(x).hexdigest() + ".jpg" for x in (a, b, a)]
    assert Path(paths[1]).read_bytes() == b
    # the same dataset path with other images: other files, never the earlier run's
    again = materialize(_table([b"\xff\xd8\xff changed"]), "", 0)
    assert Path(again[0]).read_bytes() == b"\xff\xd8\xff changed"


def test_media_cache_planted_symlink_is_not_followed(private_tmp):
    from bridgetower_ds.hpu_media import cache_dir_of, materialize

    data = b"\xff\xd8\xff the image"
    root = Path(cache_dir_of(""))
    victim = private_tmp / "victim.txt"
    victim.write_text("keep me")
    (root / (hashlib.sha256(data).hexdigest() + ".jpg")).symlink_to(victim)
    (p,) = materialize(_table([data]), "", 0)
    assert victim.read_text() == "keep me" and not Path(p).is_symlink() and Path(p).read_bytes() == data


def test_media_cache_of_another_account_or_open_to_others_is_refused(private_tmp):
    from bridgetower_ds.hpu_media import materialize
    from ds_core.files import UnsafeDirectory

    root = private_tmp / f"bt_images-{os.getuid()}"
    root.mkdir(mode=0o777)
    root.chmod(0o777)  # as another account would leave it for everyone
    (root / "row000000000.jpg").write_bytes(b"poisoned")
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        materialize(_table([b"\xff\xd8\xff x"]), "", 0)
    if os.geteuid() == 0:  # made by another uid (root can make it so)
        root.chmod(0o700)
        os.chown(root, 4242, 4242)
        with pytest.raises(UnsafeDirectory, match="owned by uid 4242"):
            materialize(_table([b"\xff\xd8\xff x"]), "", 0)


@pytest.mark.parametrize("module, runner", [("bert_ref.demo", "make_corpus"),
                                            ("bridgetower_ds.demo", "make_newyorker_set")])
def test_demos_never_remove_a_directory_they_did_not_make(tmp_path, monkeypatch, capsys, module, runner):
    import importlib

    demo = importlib.import_module(module)

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop  # the demo's first real step: what happened to --out before it is what the test looks at

    monkeypatch.setattr(demo, runner, stop)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("a user's file")
    with pytest.raises(SystemExit, match=r"--out .*mine: exists, is not empty and was not made by"):
        demo.main(["--out", str(out)])
    assert (out / "thesis.tex").read_text() == "a user's file"
    fresh = tmp_path / "fresh"
    with pytest.raises(Stop):
        demo.main(["--out", str(fresh)])
    (fresh / "result.txt").write_text("an earlier demo run's")
    with pytest.raises(Stop):
        demo.main(["--out", str(fresh)])  # its own earlier output: replaced, said in one line
    assert not (fresh / "result.txt").exists() and f"replacing {fresh}" in capsys.readouterr().out


def test_slurm_hostfile_is_created_anew_in_a_private_directory(private_tmp, monkeypatch):
    import socket

    from launch import slurm
    from launch.settings import LaunchSettings

    env = dist_env(SLURM_JOB_ID="77", SLURM_NODEID="1", SLURM_JOB_NODELIST="gaudi[01-02]")
    # the name the entry used to write, taken by someone else first (here: a directory, so a rename onto it fails)
    (private_tmp / f"ds_hostfile_77_{socket.gethostname()}").mkdir()
    s = slurm.resolve(LaunchSettings(slots=8), env)
    path = Path(s.hostfile)
    assert path.parent == private_tmp / f"ds_launch-{os.getuid()}"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "gaudi01 slots=8\ngaudi02 slots=8\n" and s.node_rank == 1
    assert slurm.resolve(LaunchSettings(slots=8), env).hostfile != s.hostfile  # a requeue writes its own file


def test_run_files_follow_the_umask_and_secret_files_are_0600(tmp_path, monkeypatch):
    import sys

    from ds_core.files import atomic_write_text
    from ds_core.rank import run_lock
    from launch.env import write_env_file

    old = os.umask(0o077)  # a user who shares nothing
    try:
        monkeypatch.setattr(sys, "argv", ["train.py"])
        lock = run_lock.acquire(tmp_path / "run", heartbeat=False)
        atomic_write_text(tmp_path / "run" / "metrics.jsonl", "{}\n")
        lock_mode = stat.S_IMODE((tmp_path / "run" / run_lock.LOCK_NAME).stat().st_mode)
        lock.release()
        assert lock_mode == 0o600 and stat.S_IMODE((tmp_path / "run" / "metrics.jsonl").stat().st_mode) == 0o600
        os.umask(0o002)  # a team whose members all write into its runs
        lock = run_lock.acquire(tmp_path / "team", heartbeat=False)
        atomic_write_text(tmp_path / "team" / "metrics.jsonl", "{}\n")
        lock_mode = stat.S_IMODE((tmp_path / "team" / run_lock.LOCK_NAME).stat().st_mode)
        lock.release()
        assert lock_mode == 0o664 and stat.S_IMODE((tmp_path / "team" / "metrics.jsonl").stat().st_mode) == 0o664
        os.umask(0)  # whatever the umask: a file that may hold a forwarded secret
        write_env_file(tmp_path / ".deepspeed_env", {"HF_TOKEN": "hf_x"})
        assert stat.S_IMODE((tmp_path / ".deepspeed_env").stat().st_mode) == 0o600
    finally:
        os.umask(old)
