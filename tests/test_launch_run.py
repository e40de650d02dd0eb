"""launch.run / launch.slurm / launch.aws_batch: commands as argument lists for every launcher, named settings,
--help that explains every option, AWS Batch registration (bounded wait), Slurm per-node entry. No training here."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dist_env, free_port
from ds_core.cli import split_passthrough
from launch import run as runmod
from launch.local_ranks import deepspeed_launcher
from launch.settings import DEFAULT_DIST_TIMEOUT_S, LAUNCHERS

pytestmark = pytest.mark.stack  # the launchers' commands, parsed by the installed DeepSpeed's runner

# DeepSpeed's launcher as launch.run starts it: its script beside this Python, else `python -u -m` its module
LAUNCHER = len(deepspeed_launcher())


def py(module: str, *args: str, cwd: Path, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env or dist_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


def dry(cwd: Path, *args: str, env=None) -> dict:
    proc = py("launch.run", "--dry_run", *args, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def hosts(tmp_path) -> Path:
    (tmp_path / "hostfile").write_text("node0 slots=2\nnode1 slots=2\n")
    return tmp_path


@pytest.mark.parametrize("module", ["launch.run", "launch.preflight", "launch.aws_batch", "launch.slurm"])
def test_help_explains_every_option(module):
    import importlib

    mod = importlib.import_module(module)
    proc = py(module, "--help", cwd=REPO)
    assert proc.returncode == 0
    parser = mod.build_parser()
    for action in parser._actions:
        for opt in action.option_strings:
            assert opt in proc.stdout, f"{module} --help does not show {opt}"
        assert action.help and len(action.help) > 10, f"{module}: {action.option_strings} has no help"


def test_named_settings_come_from_env_with_defaults(hosts):
    out = dry(hosts, "--launcher", "no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1")
    argv = out["argv"]
    # every rank runs under launch.guard: the collective timeout (module default 1800 s) plus the 60 s grace
    assert argv[LAUNCHER:] == ["--hostfile", "hostfile", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1",
                        "--master_port", "29500", "--module", "launch.guard", "--stall_timeout_s", "1860",
                        "bert_ref.train"]  # the module's own default DeepSpeed JSON
    env = dist_env(LAUNCH_LAUNCHER="no_ssh", LAUNCH_NODE_RANK="0", MASTER_ADDR="10.0.0.9", MASTER_PORT="29611",
                   LAUNCH_PRESET="debug", LAUNCH_MODULE="bridgetower_ds.train", LAUNCH_NODES="1")
    argv = dry(hosts, env=env)["argv"]
    assert "--deepspeed_config" not in argv  # bridgetower_ds.train picks its own, not BERT's
    for pair in (["--node_rank", "0"], ["--master_addr", "10.0.0.9"], ["--master_port", "29611"],
                 ["--preset", "debug"], ["--num_nodes", "1"]):
        i = argv.index(pair[0])
        assert argv[i:i + 2] == pair
    assert argv[argv.index("launch.guard") + 3] == "bridgetower_ds.train"
    # a flag beats the variable
    assert "--preset" in dry(hosts, "--preset", "bert_large", env=env)["argv"]


def test_arguments_stay_whole_and_nothing_runs(hosts):
    marker = hosts / "pwned"
    nasty = f"a b; touch {marker}"
    for launcher in ("pdsh", "openmpi", "mpich", "mpirun"):
        extra = ["--mpi_flavor", "mpich"] if launcher == "mpirun" else []
        out = dry(hosts, "--launcher", launcher, "--master_addr", "10.0.0.1", *extra, "--", "--run_dir", nasty)
        assert out["argv"][-2:] == ["--run_dir", nasty], launcher
    assert not marker.exists()


def test_each_launcher_builds_its_command(hosts):
    (hosts / ".deepspeed_env").write_text("HCCL_SOCKET_IFNAME=eth0\nPT_HPU_LAZY_MODE=0\n")
    pdsh = dry(hosts, "--profile", "roce", "--preset", "debug")["argv"]
    assert pdsh[LAUNCHER:LAUNCHER + 2] == ["--hostfile", "hostfile"] and "--no_ssh" not in pdsh
    mpi = dry(hosts, "--launcher", "openmpi", "--launcher_arg=--mca", "--launcher_arg=btl_tcp_if_include eth1",
              "--master_addr", "10.0.0.1")["argv"]
    assert mpi[mpi.index("--launcher") + 1] == "openmpi"
    assert "--launcher_args=--mca 'btl_tcp_if_include eth1'" in mpi
    # our rendezvous goes to the guard, which sets it from mpi4py (DeepSpeed's mpi_discovery would take 29500)
    g = mpi.index("launch.guard")
    assert mpi[g - 1] == "--module" and mpi[g + 1:g + 6] == ["--stall_timeout_s", "1860", "--mpi", "--master_addr",
                                                             "10.0.0.1"]
    mpich = dry(hosts, "--launcher", "mpich", "--master_addr", "10.0.0.1")["argv"]
    assert mpich[mpich.index("--launcher") + 1] == "mpich"
    # DeepSpeed's MPICH runner cannot take --module: the guard goes by file path
    assert "--module" not in mpich and str(REPO / "launch" / "guard.py") in mpich
    # mpirun directly: ranks find each other through mpi4py; the profile travels as -genv / -x arguments
    direct = dry(hosts, "--launcher", "mpirun", "--mpi_flavor", "mpich", "--profile", "tcp")
    argv = direct["argv"]
    assert Path(argv[0]).name == "mpirun" and argv[1:7] == ["-n", "4", "-ppn", "2", "-hosts", "node0,node1"]
    assert ["-genv", "GLOO_SOCKET_IFNAME", "lo"] == argv[argv.index("GLOO_SOCKET_IFNAME") - 1:][:3]
    assert "MASTER_ADDR" not in argv and "MASTER_PORT" not in argv  # rank 0 picks them (launch.guard)
    assert argv[argv.index("-m") + 1] == "launch.guard" and "--mpi" in argv
    # the module follows the guard's options: --mpi, then --mpi_lib where an MPI library was found beside the mpirun
    # on PATH (a venv's MPICH, as with the venv active)
    after = argv[argv.index("--mpi") + 1:]
    after = after[2:] if after[:1] == ["--mpi_lib"] else after
    assert after[:1] == ["bert_ref.train"], argv
    ompi = dry(hosts, "--launcher", "mpirun", "--mpi_flavor", "openmpi", "--profile", "tcp")["argv"]
    assert ompi[1:7] == ["-n", "4", "-H", "node0:2,node1:2", "--map-by", "ppr:2:node"]
    assert "-x" in ompi and "DS_ACCELERATOR=cpu" in ompi
    # srun: one launch.slurm per node
    srun = dry(hosts, "--launcher", "srun", "--nodes", "2", "--profile", "roce", "--preset", "debug",
               "--stall_grace_s", "5", "--", "--max_steps", "2")["argv"]
    assert srun[:4] == ["srun", "--nodes", "2", "--ntasks-per-node=1"]
    assert srun[srun.index("-m") + 1] == "launch.slurm"
    from launch import slurm  # what each node parses: the submitting side's settings, the port resolved

    own, extra = split_passthrough(srun[srun.index("launch.slurm") + 1:])
    node = slurm.build_parser().parse_args(own)
    assert (node.profile, node.preset, node.stall_grace_s, node.master_port, extra) == \
        ("roce", "debug", 5, 29500, ["--max_steps", "2"])
    assert node.hostfile == slurm.build_parser().get_default("hostfile")  # not forwarded: each node writes its own
    # no_ssh: DeepSpeed skips .deepspeed_env there, so the wrapper hands profile + file to the launcher's env
    nossh = dry(hosts, "--launcher", "no_ssh", "--node_rank", "0", "--master_addr", "10.0.0.1", "--profile", "tcp")
    assert nossh["env_added"]["DS_ACCELERATOR"] == "cpu" and nossh["env_added"]["PT_HPU_LAZY_MODE"] == "0"


@pytest.mark.parametrize("args, message", [
    (["--launcher", "no_ssh", "--node_rank", "0"], "--master_addr (or $MASTER_ADDR) is required"),
    (["--launcher", "no_ssh", "--node_rank", "2", "--master_addr", "x"], "--node_rank 2 is outside 0..1"),
    (["--profile", "efa"], "profile efa: .deepspeed_env missing HCCL_SOCKET_IFNAME"),
    (["--launcher", "mpich", "--hostfile", "uneven"], "uneven line 2: host node1 has slots=1 but node0"),
    (["--hostfile", "missing"], "missing: cannot read hostfile"),
    (["--launcher", "openmpi", "--nodes", "1"], "cannot limit nodes"),
    (["--launcher", "srun"], "not inside a Slurm allocation"),
])
def test_launch_errors_name_the_problem(hosts, args, message):
    (hosts / "uneven").write_text("node0 slots=2\nnode1 slots=1\n")
    env = dist_env()
    env.pop("MASTER_ADDR", None)
    env.pop("SLURM_JOB_ID", None)
    proc = py("launch.run", *args, cwd=hosts, env=env)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_slurm_entry_builds_hostfile_and_node_rank(tmp_path):
    env = dist_env(SLURM_JOB_ID="77", SLURM_NODEID="2", SLURM_JOB_NODELIST="gaudi[01-03]", SLURM_GPUS_ON_NODE="",
                   TMPDIR=str(tmp_path))
    proc = py("launch.slurm", "--dry_run", "--slots", "8", "--profile", "roce", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)["argv"]
    hostfile = Path(argv[argv.index("--hostfile") + 1])
    assert hostfile.read_text() == "gaudi01 slots=8\ngaudi02 slots=8\ngaudi03 slots=8\n"
    assert argv[argv.index("--node_rank") + 1] == "2" and argv[argv.index("--master_addr") + 1] == "gaudi01"
    assert "--no_ssh" in argv


def _batch_env(index: int, num: int, main_addr: str = "", **extra) -> dict:
    # AWS_BATCH_JOB_ID (child nodes see `ID#INDEX`): the job's identity, which keys its registration
    env = dist_env(AWS_BATCH_JOB_NUM_NODES=str(num), AWS_BATCH_JOB_NODE_INDEX=str(index),
                   AWS_BATCH_JOB_MAIN_NODE_INDEX="0", AWS_BATCH_JOB_ID=f"0a1b2c3d#{index}", AWS_BATCH_JOB_ATTEMPT="1",
                   **extra)
    env.pop("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS", None)
    if main_addr:
        env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = main_addr
    return env


def test_aws_batch_main_and_child_agree(tmp_path):
    port = free_port()
    common = ["--dry_run", "--slots", "1", "--register_port", str(port), "--register_timeout", "60"]
    cmd = [sys.executable, "-m", "launch.aws_batch"]
    (tmp_path / "n0").mkdir()
    (tmp_path / "n1").mkdir()
    main = subprocess.Popen([*cmd, *common, "--", "--max_steps", "2"], cwd=tmp_path / "n0", env=_batch_env(0, 2),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # either order works: the child retries until the main node listens
    # on one machine the child registers from another loopback address so the two hosts differ
    child = subprocess.run([*cmd, *common, "--node_addr", "127.0.0.2"], cwd=tmp_path / "n1",
                           env=_batch_env(1, 2, "127.0.0.1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=90)
    out, err = main.communicate(timeout=90)
    assert main.returncode == 0 and child.returncode == 0, err + child.stderr
    for node, text in ((0, out), (1, child.stdout)):
        argv = json.loads(text[text.index("{"):])["argv"]
        assert argv[argv.index("--node_rank") + 1] == str(node)
        assert argv[argv.index("--master_addr") + 1] == "127.0.0.1"
        assert (tmp_path / f"n{node}" / "hostfile").read_text() == "127.0.0.1 slots=1\n127.0.0.2 slots=1\n"


def test_aws_batch_main_gives_up_with_a_clear_error(tmp_path):
    # the main gives up by itself at --register_timeout (its own status and message; py() fails the test on a hang)
    proc = py("launch.aws_batch", "--register_port", str(free_port()), "--register_timeout", "2", cwd=tmp_path,
              env=_batch_env(0, 3), timeout=60)
    assert proc.returncode == 2  # the one status for bad input (ds_core.cli); was 3
    assert "0 of 2 child nodes registered within 2 s; missing node indices [1, 2]" in proc.stderr
    child = py("launch.aws_batch", "--register_port", str(free_port()), "--register_timeout", "2", cwd=tmp_path,
               env=_batch_env(1, 2, "127.0.0.1"), timeout=60)
    assert child.returncode == 2 and "could not register with the main node 127.0.0.1" in child.stderr


def test_run_module_imports_no_torch():
    """The wrappers must start fast on a login node: no torch / deepspeed import."""
    code = "import sys, launch.run, launch.preflight, launch.aws_batch, launch.slurm; " \
           "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dist_env(), stdout=subprocess.PIPE, text=True,
                         timeout=60).stdout.strip()
    assert out == "[]"
    assert LAUNCHERS == ("pdsh", "no_ssh", "openmpi", "mpich", "mpirun", "srun")


@pytest.mark.parametrize("line, message", [
    ("node2;touch${IFS}pwned slots=1", "hostfile line 2: bad host name 'node2;touch${IFS}pwned'"),
    ("node2 slots=0", "hostfile line 2: host node2 has slots=0"),
])
def test_hostfile_is_checked_before_deepspeeds_parser(hosts, line, message):
    """DeepSpeed's own parser takes both lines (the reference below); launch.run refuses them first."""
    from deepspeed.launcher.runner import _parse_hostfile

    (hosts / "hostfile").write_text(f"node0 slots=2\n{line}\n")
    assert len(_parse_hostfile((hosts / "hostfile").read_text().splitlines())) == 2
    for launcher in ("pdsh", "openmpi", "mpich"):
        proc = py("launch.run", "--dry_run", "--launcher", launcher, "--master_addr", "10.0.0.1", cwd=hosts)
        assert proc.returncode == 2 and message in proc.stderr, (launcher, proc.stderr)


@pytest.mark.stack
def test_launcher_args_reach_deepspeed_whole(hosts):
    """Parsed by DeepSpeed's own argument parser: one --launcher_args value that splits back into our arguments,
    a leading '-' included (--allow-run-as-root was refused as a separate token)."""
    import shlex

    from deepspeed.launcher.runner import parse_args

    argv = dry(hosts, "--launcher", "openmpi", "--master_addr", "10.0.0.1", "--launcher_arg=--allow-run-as-root",
               "--launcher_arg=--mca", "--launcher_arg=btl_tcp_if_include eth1")["argv"]
    ds = parse_args(argv[LAUNCHER:])
    assert shlex.split(ds.launcher_args) == ["--allow-run-as-root", "--mca", "btl_tcp_if_include eth1"]
    assert ds.module and ds.user_script == "launch.guard" and ds.master_addr == "10.0.0.1"


@pytest.mark.stack
def test_mpich_command_as_deepspeed_builds_it(hosts):
    """DeepSpeed's MPICHRunner.get_cmd with what launch.run passes: python runs the helper script by path, and the
    helper runs our guard by path (with --module it would be `python -m /path/launcher_helper.py`)."""
    from deepspeed.launcher.multinode_runner import MPICHRunner
    from deepspeed.launcher.runner import parse_args

    argv = dry(hosts, "--launcher", "mpich", "--master_addr", "10.0.0.1", "--master_port", "29611")["argv"]
    ds = parse_args(argv[LAUNCHER:])
    pool = {"node0": 2, "node1": 2}
    cmd = MPICHRunner(ds, "e30=", pool).get_cmd(dict(), pool)
    helper = next(i for i, a in enumerate(cmd) if a.endswith("launcher_helper.py"))
    assert cmd[helper - 2:helper] == [sys.executable, "-u"]
    assert cmd[helper + 1:helper + 4] == ["--launcher", "mpich", str(REPO / "launch" / "guard.py")]
    assert cmd[helper + 4:helper + 10] == ["--stall_timeout_s", "1860", "--mpi", "--master_addr", "10.0.0.1",
                                           "--master_port"]


def test_a_master_port_in_use_is_named_before_anything_starts(tmp_path):
    import socket

    (tmp_path / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        for args in (["--launcher", "pdsh"], ["--launcher", "no_ssh", "--node_rank", "0", "--master_addr",
                                                                 "127.0.0.1"]):
            proc = py("launch.run", *args, "--master_port", str(port), cwd=tmp_path)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert f"master port {port} on 127.0.0.1: port {port} in use" in proc.stderr


def test_collective_timeout_default_matches_the_config():
    from ds_core.config import TrainConfig

    assert DEFAULT_DIST_TIMEOUT_S == TrainConfig().dist_timeout_s
    parser = runmod.build_parser()
    args = parser.parse_args(["--stall_grace_s", "15"])
    assert runmod.dist_timeout(args, ["--dist_timeout_s", "45"]) == 45
    assert runmod.guard_args(args, ["--dist_timeout_s=45"])[:2] == ["--stall_timeout_s", "60"]


def test_settings_are_resolved_once_then_built(hosts, monkeypatch):
    """launch.settings.LaunchSettings: typed from the flags, hosts read once, the command built from it alone (the
    same argv as the CLI's dry run); Slurm and AWS Batch return new settings instead of rewriting the flags."""
    import dataclasses

    from launch import aws_batch, slurm
    from launch.settings import LaunchError, LaunchSettings

    monkeypatch.chdir(hosts)
    flags = ["--launcher", "no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1", "--launcher_arg=-v"]
    s = LaunchSettings.from_args(runmod.build_parser().parse_args(flags), ["--max_steps", "2"])
    assert s.launcher_arg == ("-v",) and s.module_args == ("--max_steps", "2") and s.hosts == ()
    with pytest.raises(LaunchError, match="no hosts resolved from hostfile"):
        runmod.build_command(s)
    resolved = s.with_hosts()
    assert [h.name for h in resolved.hosts] == ["node0", "node1"] and resolved.used_hosts == resolved.hosts
    argv, added = runmod.build_command(resolved, cwd=str(hosts))
    assert argv == dry(hosts, *flags, "--", "--max_steps", "2")["argv"] and added == {}

    given = LaunchSettings(hostfile=str(hosts / "slurm_hf"), slots=4, master_port=29611)
    out = slurm.resolve(given, {"SLURM_JOB_ID": "5", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]"},
                        hostfile_given=True)
    assert (out.launcher, out.node_rank, out.master_addr, out.master_port) == ("no_ssh", 1, "n1", 29611)
    assert (hosts / "slurm_hf").read_text() == "n1 slots=4\nn2 slots=4\n"
    assert (given.launcher, given.node_rank, given.master_addr) == ("pdsh", -1, "")  # not rewritten
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.launcher = "no_ssh"  # type: ignore[misc]

    one = aws_batch.resolve(LaunchSettings(hostfile=str(hosts / "aws_hf"), slots=2),
                            {"AWS_BATCH_JOB_NUM_NODES": "1", "AWS_BATCH_JOB_NODE_INDEX": "0"}, 0, 1.0)
    assert (one.launcher, one.node_rank, one.master_addr) == ("no_ssh", 0, "127.0.0.1")
    assert (hosts / "aws_hf").read_text() == "127.0.0.1 slots=2\n"


def test_settings_flags_are_the_fields_and_to_argv_round_trips(monkeypatch, capsys):
    """LaunchSettings is declared once: every field but module_args/hosts is a flag of the same name, its environment
    variable gives the default, and to_argv writes settings that the same parser reads back unchanged."""
    import dataclasses

    from launch.settings import LaunchSettings

    parser = runmod.build_parser()
    dests = {a.dest for a in parser._actions} - {"help"}
    fields = {f.name for f in dataclasses.fields(LaunchSettings)} - {"module_args", "hosts"}
    assert dests == fields
    assert LaunchSettings.from_args(parser.parse_args([])) == LaunchSettings()  # same defaults, one declaration
    monkeypatch.setenv("LAUNCH_NODES", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert (LaunchSettings.from_args(runmod.build_parser().parse_args([])).nodes,
            LaunchSettings.from_args(runmod.build_parser().parse_args([])).master_addr) == (3, "10.1.2.3")
    monkeypatch.setenv("LAUNCH_NODES", "two")
    with pytest.raises(SystemExit) as e:
        runmod.build_parser()
    assert e.value.code == 2 and "$LAUNCH_NODES='two' (the default of --nodes): expected int" in capsys.readouterr().err
    monkeypatch.delenv("LAUNCH_NODES")
    # every field away from its default (and from the environment's), then back through the flags
    s = LaunchSettings(launcher="mpirun", hostfile="hf", nodes=2, profile="tcp", module="bridgetower_ds.train",
                       preset="debug", deepspeed_config="ds.json", master_addr="10.0.0.9", master_port=29611,
                       node_rank=1, dist_timeout_s=45, stall_grace_s=7, launcher_arg=("-x", "--bind-to=none"),
                       mpi_flavor="openmpi", slots=4, dry_run=True)
    assert all(getattr(s, f) != getattr(LaunchSettings(), f) for f in fields)
    assert LaunchSettings.from_args(runmod.build_parser().parse_args(s.to_argv())) == s
    assert s.to_argv(["slots", "launcher_arg"]) == ["--slots", "4", "--launcher_arg=-x",
                                                     "--launcher_arg=--bind-to=none"]
    with pytest.raises(ValueError, match="'hosts'"):
        s.to_argv(["hosts"])


def test_dry_run_names_the_deepspeed_json_the_run_will_use(hosts):
    """Each preset brings its own JSON (ds_configs.DEFAULT_JSON): the dry run names the file and what chose it, so a
    1.5B run is seen to take Habana's 1.5B JSON, not BERT-Large's."""
    def chosen(*args: str) -> dict:
        return dry(hosts, *args)["deepspeed_config"]

    one = chosen("--preset", "bert_1p5b")
    assert Path(one["file"]).name == "bert_1p5b_zero1_bf16.json" and one["chosen_by"] == "--preset bert_1p5b"
    assert Path(one["file"]).is_file()  # resolved where the module will open it
    assert Path(chosen()["file"]).name == "bert_large_zero1_bf16.json"  # the module's default preset
    assert Path(chosen("--", "--recipe", "habana_1p5b_8x")["file"]).name == "bert_1p5b_zero1_bf16.json"
    given = chosen("--preset", "bert_1p5b", "--", "--deepspeed_config", "bert_1p5b_zero3_bf16.json")
    assert Path(given["file"]).name == "bert_1p5b_zero3_bf16.json" and given["chosen_by"] == "--deepspeed_config"
    assert Path(chosen("--module", "bridgetower_ds.train")["file"]).name == "bridgetower_zero1_bf16.json"
    assert chosen("--preset", "bert_huge")["file"] is None  # the module itself refuses an unknown preset
