"""Under --launcher pdsh no value reaches a node's shell unquoted. DeepSpeed's own PDSHRunner (with the launcher stage
applied, as launch.ds_runner applies it) builds the remote command; it is joined and %-substituted as pdsh does
(chaos/pdsh src/common/pipecmd.c) and run by a real bash, started in $HOME as an ssh session's shell is, with the
interpreter replaced by a script that records what it got. `$(...)`, backquotes, `;` and `%n` in module arguments
and exported values run nothing and arrive as given, and a working directory with a space is where the ranks start.
Where the quoting change is off, launch.run refuses such values before launch, naming them; a study with
launcher = "hostfile" gets the same check when it is planned."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, dist_env

BUILD = textwrap.dedent("""
    import json, os, sys
    from ds_core.compat.changes import apply_stage
    apply_stage("launcher")  # what launch.ds_runner does before DeepSpeed's runner starts
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import encode_world_info, parse_args
    spec = json.loads(sys.argv[1])
    sys.executable = spec["python"]  # the interpreter DeepSpeed names in the remote command
    args = parse_args(["--hostfile", spec["hostfile"], "--master_addr", "127.0.0.1", "--module", *spec["args"]])
    hosts = {"node-a": 1, "node-b": 1}
    runner = PDSHRunner(args, encode_world_info(hosts))
    for k, v in spec["exports"].items():  # as runner.main exports PYTHON* variables and .deepspeed_env entries
        runner.add_export(k, v)
    cmd, _, _ = runner.get_cmd(dict(os.environ), hosts)
    print(json.dumps(cmd))
""")

RECORDER = """#!{python}
import json, os, sys
with open({out!r}, "w") as f:
    env = {{k: os.environ.get(k) for k in ("EVIL", "PYTHONPATH")}}
    json.dump({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": env}}, f)
"""


def pdsh_format(word: str, host: str, user: str, rank: int) -> str:
    """pdsh's pipecmd_format_arg: %h host, %u user, %n rank, %% a percent sign; any other %x kept."""
    out, i = [], 0
    while i < len(word):
        c = word[i]
        if c == "%" and i + 1 < len(word):
            nxt = word[i + 1]
            out.append({"h": host, "u": user, "n": str(rank), "%": "%"}.get(nxt, "%" + nxt))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def run_on_node(tmp_path: Path, workdir: Path, args: list[str], exports: dict[str, str]) -> dict:
    """DeepSpeed's remote command for node-b (rank 1), run as pdsh + ssh run it; what the interpreter got."""
    bindir = tmp_path / "bin dir"
    bindir.mkdir(exist_ok=True)
    record = tmp_path / "record.json"
    fake = bindir / "python"
    fake.write_text(RECORDER.format(python=sys.executable, out=str(record)))
    fake.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    spec = {"python": str(fake), "hostfile": str(hostfile), "args": args, "exports": exports}
    proc = subprocess.run([sys.executable, "-c", BUILD, json.dumps(spec)], cwd=workdir, capture_output=True,
                          text=True, env=dist_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cmd = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node-a,node-b"], cmd
    line = pdsh_format(" ".join(cmd[6:]), "node-b", "someone", 1)  # pdsh: the words joined, one string
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    shell = subprocess.run(["bash", "-c", line], cwd=home, capture_output=True, text=True, timeout=60,
                           env={"HOME": str(home), "PATH": os.environ["PATH"]})
    assert record.is_file(), f"the interpreter never ran: {shell.stderr}\n{line}"
    return {**json.loads(record.read_text()), "stderr": shell.stderr, "line": line}


@pytest.mark.stack
def test_pdsh_remote_command_runs_nothing_and_lands_in_the_working_directory(tmp_path):
    workdir = tmp_path / "my runs"  # a space: DeepSpeed's `cd /a b;` failed and the ranks started in $HOME
    workdir.mkdir()
    m = [tmp_path / f"RAN{i}" for i in range(5)]
    args = ["launch.guard", "--stall_timeout_s", "0", "bert_ref.train", "--input_dir", f"/data/$(touch {m[0]})",
            "--run_name", f"a b`touch {m[1]}`", f"--note=x;touch {m[2]}", "--tag", "100%n $HOME 'q' \"dq\""]
    exports = {"EVIL": f"$(touch {m[3]})", "PYTHONPATH": f"{workdir}:{REPO}"}
    got = run_on_node(tmp_path, workdir, args, exports)
    ran = [p.name for p in m if p.exists()]
    assert not ran, f"the node's shell ran {ran}: {got['line']}"
    assert got["cwd"] == str(workdir), got
    assert got["argv"][-len(args):] == args, got["argv"]
    assert "--node_rank=1" in got["argv"] and "--master_addr=127.0.0.1" in got["argv"], got["argv"]
    assert got["env"] == exports, got["env"]


def _launch_run(tmp_path: Path, cwd: Path, extra: list[str], **env: str) -> subprocess.CompletedProcess:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    return subprocess.run([sys.executable, "-m", "launch.run", "--hostfile", str(hostfile), "--dry_run", "--",
                           *extra], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=dist_env(PYTHONPATH=str(REPO), **env))


@pytest.mark.stack
def test_quoting_off_refuses_what_the_shell_would_act_on_before_launch(tmp_path):
    marker = tmp_path / "RAN"
    off = {"DS_TOOLKIT_CHANGES": "off:pdsh_remote_quoted"}
    proc = _launch_run(tmp_path, tmp_path, ["--input_dir", f"/data/$(touch {marker})"], **off)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    msg = proc.stderr.strip().splitlines()[-1]
    assert f"argument '/data/$(touch {marker})'" in msg and "pdsh_remote_quoted" in msg, msg
    spaced = tmp_path / "my runs"
    spaced.mkdir()
    proc = _launch_run(tmp_path, spaced, ["--input_dir", "/data"], **off)
    assert proc.returncode == 2 and f"working directory '{spaced}'" in proc.stderr, proc.stderr
    # the same launches with the change on (the default) pass: every word is quoted for the nodes
    for cwd, arg in ((tmp_path, f"/data/$(touch {marker})"), (spaced, "/data")):
        proc = _launch_run(tmp_path, cwd, ["--input_dir", arg])
        assert proc.returncode == 0, proc.stderr
        assert arg in json.loads(proc.stdout)["argv"]
    assert not marker.exists()


def test_master_address_must_be_an_address(tmp_path):
    proc = _launch_run(tmp_path, tmp_path, [], MASTER_ADDR="10.0.0.1;reboot")
    assert proc.returncode == 2 and "--master_addr '10.0.0.1;reboot'" in proc.stderr, proc.stderr


def test_study_with_hostfile_launcher_is_checked_when_planned(tmp_path, monkeypatch):
    from ds_tools.study import plan, spec

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    f = tmp_path / "s.toml"
    f.write_text(textwrap.dedent(f"""
        [study]
        module = "bert_ref.train"
        deepspeed_config = "bert_debug_zero1_bf16.json"
        launcher = "hostfile"
        hostfile = "{hostfile}"
        args = ["--input_dir", "/data/$(touch {tmp_path / 'RAN'})"]
        [axes]
        nodes = [2]
    """))
    study = spec.load_study(f)
    monkeypatch.setenv("DS_TOOLKIT_CHANGES", "off:pdsh_remote_quoted")
    with pytest.raises(spec.StudyError, match=r"argument '/data/\$\(touch .*RAN\)'.*pdsh_remote_quoted"):
        plan.build(study, study.cells()[0], tmp_path / "out")
    monkeypatch.delenv("DS_TOOLKIT_CHANGES")
    assert plan.build(study, study.cells()[0], tmp_path / "out").commands
