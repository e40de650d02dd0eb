"""ds_core.log: the one logger each package speaks through ("[package] " lines), rank 0's only unless a line is about
the rank itself, on the stream current when the line is written."""
from __future__ import annotations

from ds_core import log


def test_rank_zero_speaks_other_ranks_only_when_asked(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    log.say("once per run")
    log.warn("a warning", stderr=True)
    out, err = capsys.readouterr()
    assert out == "[ds_core] once per run\n" and err == "[ds_core] warning: a warning\n"
    monkeypatch.setenv("RANK", "1")
    log.say("once per run")
    log.say("about this rank", every_rank=True)
    out, err = capsys.readouterr()
    assert out == "[ds_core] about this rank\n" and err == ""


def test_each_package_speaks_through_its_own_console(monkeypatch, capsys):
    """bert_ref, bridgetower_ds and launch each have one console (`log`), a ds_core.log.Console named after the
    package; a line naming the rank it speaks for is rank 0's alone; a launcher is no rank, so the RANK in its
    environment (its training process's) does not silence it."""
    import importlib

    for pkg in ("ds_core", "bert_ref", "bridgetower_ds", "launch"):
        mod = importlib.import_module(f"{pkg}.log")
        assert isinstance(getattr(mod, "CONSOLE", log.DS_CORE), log.Console)
        assert (getattr(mod, "CONSOLE", None) or log.DS_CORE).prefix == f"[{pkg}] "
    from bridgetower_ds import log as bt_log
    from launch import log as launch_log

    monkeypatch.setenv("RANK", "0")
    bt_log.say("for rank 1", rank=1)
    bt_log.say("for rank 0", rank=0)
    bt_log.warn("a warning", stderr=True)
    out, err = capsys.readouterr()
    assert out == "[bridgetower_ds] for rank 0\n" and err == "[bridgetower_ds] warning: a warning\n"
    monkeypatch.setenv("RANK", "3")
    bt_log.say("not rank 0's")
    launch_log.say("guard: the launcher speaks")
    launch_log.say("guard: MPI rank 3's", rank=3)
    out, _ = capsys.readouterr()
    assert out == "[launch] guard: the launcher speaks\n"


def test_no_package_prints_a_console_line_by_hand():
    """A console line goes through the package's logger: no `print` of a "[prefix] ..." line and no `print` behind a
    hand-written rank check in bert_ref, bridgetower_ds, launch or ds_core. What a command answers (JSON, a table)
    is still printed."""
    import ast

    from conftest import REPO

    found = []
    for pkg in ("ds_core", "bert_ref", "bridgetower_ds", "launch"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            under_rank_check = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "rank" in ast.unparse(node.test):
                    under_rank_check.update(id(n) for stmt in node.body for n in ast.walk(stmt))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"):
                    continue
                first = node.args[0] if node.args else None
                text = (first.value if isinstance(first, ast.Constant) else
                        first.values[0].value if isinstance(first, ast.JoinedStr) and first.values
                        and isinstance(first.values[0], ast.Constant) else None)
                if (isinstance(text, str) and text.startswith("[")) or id(node) in under_rank_check:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"console lines printed by hand (use the package's log.say): {found}"


def test_the_guard_run_by_path_finds_the_launch_console(tmp_path):
    """DeepSpeed's MPICH backend runs launch/guard.py by its path, from any directory, without this checkout on
    PYTHONPATH: its console import still resolves."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(REPO / "launch" / "guard.py"), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr[-2000:]
