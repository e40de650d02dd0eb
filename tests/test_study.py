"""ds_tools.study without training runs: the study file's checks, `plan`, `--from_table` (the published BridgeTower
H100 table and the BERT-Large scaling table), and launch.local_ranks killing a whole process group on timeout."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO
from ds_core.rank.rendezvous import rank_env
from ds_tools.study import StudyError, load_study, plan, runner
from ds_tools.study.__main__ import main as study_main
from launch import local_ranks

STUDY_2X2 = """
[study]
module = "bridgetower_ds.train"
preset = "debug"
deepspeed_config = "bridgetower_zero1_bf16.json"
steps = 4
warmup_steps = 1
args = ["--do_train", "--dataset_path", "d/captions.jsonl"]
ranks_per_node = 2
baseline = { workers = 0, allreduce = "buckets" }

[axes]
workers = [0, 1]
allreduce = ["buckets", "single"]

[flags]
workers = "--dataloader_num_workers"
"""

# optimum-habana's published BridgeTower fine-tuning on one H100 (samples/s), dataloader_num_workers 0 / 1 / 2
BT_H100 = "source,dataloader_num_workers,samples_per_s\nH100 published,0,336.5\nH100 published,1,580.1\n" \
          "H100 published,2,602.1\n"
BERT_LARGE = "nodes,accelerators,throughput\n1,8,1379.76\n2,16,2705.57\n4,32,5291.58\n8,64,9977.54\n"


def write(tmp_path: Path, text: str, name: str = "study.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_plan_lists_cells_with_flags_and_patched_json(tmp_path, capsys):
    study = load_study(write(tmp_path, STUDY_2X2))
    cells = study.cells()
    assert [c.values for c in cells] == [{"workers": 0, "allreduce": "buckets"}, {"workers": 0, "allreduce": "single"},
                                         {"workers": 1, "allreduce": "buckets"}, {"workers": 1, "allreduce": "single"}]
    single = study.ds_config_for(cells[1])["zero_optimization"]
    assert single["contiguous_gradients"] is False and single["reduce_scatter"] is False
    assert single["overlap_comm"] is False and single["reduce_bucket_size"] >= 10**9
    buckets = study.ds_config_for(cells[0])["zero_optimization"]
    assert buckets == json.loads((REPO / "ds_configs" / "bridgetower_zero1_bf16.json").read_text())["zero_optimization"]
    assert study_main(["plan", str(tmp_path / "study.toml"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "4 cell(s)" in out and out.count("--num_gpus 2") == 4
    assert out.count("--dataloader_num_workers 1") == 2 and "--workers" not in out  # the [flags] mapping
    assert "--module ds_tools.study.cell --study_target bridgetower_ds.train" in out
    assert not (tmp_path / "out").exists()  # plan writes nothing


def test_shipped_single_allreduce_jsons_are_the_axis_patch(tmp_path):
    """The documented DeepSpeed JSONs and the study axis `allreduce = single` are the same four settings."""
    for base, shipped in (("zero1_bf16.json", "zero1_bf16_single_allreduce.json"),
                          ("bridgetower_zero1_bf16.json", "bridgetower_zero1_bf16_single_allreduce.json")):
        text = STUDY_2X2.replace("bridgetower_zero1_bf16.json", base).replace("single_bucket", "x")
        study = load_study(write(tmp_path, text.replace("[study]", "[study]\nsingle_bucket_elements = 2000000000")))
        assert study.ds_config_for(study.cells()[1]) == json.loads((REPO / "ds_configs" / shipped).read_text())


def test_nodes_and_hostfile_commands(tmp_path, monkeypatch):
    (tmp_path / "hosts").write_text("# cluster\nnode-a slots=8\nnode-b slots=8\nnode-c slots=8\n")
    text = STUDY_2X2.replace('ranks_per_node = 2', 'ranks_per_node = 8\nlauncher = "hostfile"\nhostfile = "hosts"')
    text = text.replace("workers = [0, 1]\n", "nodes = [1, 2]\n").replace("workers = 0, ", "")
    text = text.replace('[flags]\nworkers = "--dataloader_num_workers"\n', "")
    study = load_study(write(tmp_path, text))
    monkeypatch.chdir(tmp_path)
    p = plan.build(study, study.cells()[2], tmp_path / "out")  # nodes=2, buckets
    cmds = p.commands
    assert cmds[0][1:3] == ["-m", "launch.run"] and "--module" in cmds[0]
    hostfile = Path(cmds[0][cmds[0].index("--hostfile") + 1])
    assert p.files[hostfile] == "node-a slots=8\nnode-b slots=8\n"  # the first N hosts
    assert cmds[0].count("--deepspeed_config") == 1  # given to launch.run, not twice
    assert not (tmp_path / "out").exists()  # a plan writes nothing
    text2 = text.replace('launcher = "hostfile"\nhostfile = "hosts"', 'launcher = "simulated_nodes"')
    study = load_study(write(tmp_path, text2))
    cmds = plan.build(study, study.cells()[2], tmp_path / "out2").commands
    assert len(cmds) == 2 and [c[c.index("--node_rank") + 1] for c in cmds] == ["0", "1"]
    assert all("--no_ssh" in c and c[c.index("--master_addr") + 1] == "127.0.0.1" for c in cmds)


@pytest.mark.parametrize("edit, message", [
    (("steps = 4", "stesp = 4"), "unknown key(s) in [study]: 'stesp' (did you mean 'steps'?)"),
    (('allreduce = ["buckets", "single"]', 'allreduce = ["buckets", "flat"]'), "[axes] allreduce"),
    (('workers = 0,', 'workers = 5,'), "baseline workers = 5 is not among its values [0, 1]"),
    (("workers = [0, 1]", "workers = [0, 1]\nnodes = [1, 2]"), "nodes > 1 needs launcher"),
    (('workers = "--dataloader_num_workers"', 'workers = "dataloader_num_workers"'), "[flags] workers"),
    (('module = "bridgetower_ds.train"', ''), "[study] module is required"),
    (('deepspeed_config = "bridgetower_zero1_bf16.json"', 'deepspeed_config = "nope.json"'), "no such file"),
    (("warmup_steps = 1", "warmup_steps = 4"), "warmup_steps = 4: expected >= 0 and < steps (4)"),
])
def test_bad_study_files_name_file_and_key(tmp_path, edit, message):
    path = write(tmp_path, STUDY_2X2.replace(*edit))
    with pytest.raises(StudyError) as e:
        load_study(path)
    assert str(path) in str(e.value) and message in str(e.value), str(e.value)


def test_from_table_reproduces_published_speedups(tmp_path, capsys):
    from PIL import Image

    table = tmp_path / "bt_h100.csv"
    table.write_text(BT_H100)
    assert study_main(["report", "--from-table", str(table), "--out", str(tmp_path / "rep")]) == 0
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    rows = data["combos"]
    assert [r["dataloader_num_workers"] for r in rows] == [0, 1, 2]
    assert [round(r["speedup"], 2) for r in rows] == [1.0, round(580.1 / 336.5, 2), round(602.1 / 336.5, 2)]
    assert [round(r["speedup"], 2) for r in rows] == [1.0, 1.72, 1.79]
    md = (tmp_path / "rep" / "report.md").read_text()
    # one published figure each: said to be one measurement, no interval
    assert "| 2 | 602.10 | one run |  | 1.79 | one run | 1 |" in md
    assert "| 0 | 336.50 | one run |  | 1.00 (baseline) |  | 1 |" in md
    csv_lines = (tmp_path / "rep" / "report.csv").read_text().splitlines()
    assert csv_lines[0].startswith("source,cell,dataloader_num_workers,samples_per_s") and len(csv_lines) == 4
    with Image.open(tmp_path / "rep" / "throughput.png") as im:
        assert im.format == "PNG" and im.size[0] > 400


def test_from_table_scaling_goes_through_ds_core_scaling(tmp_path, capsys):
    table = tmp_path / "bert_large.csv"
    table.write_text(BERT_LARGE)
    assert study_main(["report", "--from_table", str(table), "--out", str(tmp_path / "rep")]) == 0
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["scaling"]
    assert [round(100 * r["efficiency"], 2) for r in rows] == [100.0, 98.04, 95.88, 90.39]  # ds_tools.scaling's
    assert (tmp_path / "rep" / "scaling.png").stat().st_size > 1000
    assert "| 8 | 64 | 9977.54 | one run | 155.90 | 90.39 | one run | 7.23 | 1 |" in \
        (tmp_path / "rep" / "report.md").read_text()


def test_bad_table_and_missing_study_dir(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("workers,speed\n0,1\n")
    assert study_main(["report", "--from_table", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "expected a samples_per_s (or throughput) column" in capsys.readouterr().err
    assert study_main(["report", str(tmp_path)]) == 2
    assert "no study.toml" in capsys.readouterr().err


def test_timeout_kills_launcher_and_its_children(tmp_path):
    """A launcher whose child ignores it: after the timeout both are gone (the whole process group is killed)."""
    pidfile = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)']); open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    res = local_ranks.run_launchers([[sys.executable, "-c", script]], env=rank_env(), cwd=tmp_path,
                                    timeout_s=3, log_path=tmp_path / "log.txt", poll_s=0.2)
    # ended by the timeout, not by the launcher's own 600-s sleep: it was still running when its group was killed
    assert res.timed_out and res.exit_code == 124 and not res.ok and res.killed == [True]
    child = int(pidfile.read_text())
    for _ in range(50):
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_one_failing_launcher_stops_the_others(tmp_path):
    """A simulated node that dies must not leave its peer waiting for the collective timeout."""
    ok = [sys.executable, "-c", "import time; time.sleep(600)"]
    bad = [sys.executable, "-c", "raise SystemExit(3)"]
    res = local_ranks.run_launchers([ok, bad], env=rank_env(), cwd=tmp_path, timeout_s=120, poll_s=0.2)
    # the peer sleeps 600 s: without the stop it would run into the 120 s timeout (timed_out)
    assert not res.timed_out and res.codes[1] == 3 and res.exit_code != 0


def test_report_of_ok_failed_and_unrun_cells(tmp_path, capsys):
    """Report rows from cell files as `ds-study run` writes them: ok (summary + comms records), failed, not run."""
    text = STUDY_2X2.replace("workers = [0, 1]", "workers = [0, 1, 2]").replace('["buckets", "single"]', '["single"]')
    study = load_study(write(tmp_path, text.replace(', allreduce = "buckets"', "")))
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.toml").write_text(study.path.read_text())
    ok, failed = (runner.cell_dir(out, c) for c in study.cells()[:2])
    ok.mkdir(parents=True)
    summary = {"type": "summary", "model": "bridgetower:debug", "world_size": 2, "nodes": 1, "samples_per_s": 10.0,
               "steps": 4, "measured_steps": 3, "measured_seconds": 1.5, "zero_stage": 1, "micro_batch": 4}
    (ok / "metrics.jsonl").write_text(json.dumps({"type": "step", "step": 1}) + "\n" + json.dumps(summary) + "\n")
    (ok / "cell_stats").mkdir()
    comms = {"all_reduce": {"count": 12, "sizes": {"4096": 4, "4": 8}}, "broadcast": {"count": 3, "sizes": {"8": 3}}}
    (ok / "cell_stats" / "rank0.json").write_text(json.dumps({"rank": 0, "comms": comms,
                                                              "memory": {"host_peak_rss_bytes": 2**20 * 300}}))
    (ok / "cell.json").write_text(json.dumps({"status": "ok", "exit_code": 0}))
    failed.mkdir(parents=True)
    (failed / "cell.json").write_text(json.dumps({"status": "failed", "exit_code": 3, "log_tail": "x\nboom\n"}))
    assert study_main(["report", str(out)]) == 0
    md = (out / "report" / "report.md").read_text()
    assert "| 0 | single | 10.00 | one run | 5.00 | 1.00 (baseline) |  | 1 | 1.0 | 0.00 | 0.500 | 300.00 |" in md
    assert "| 1 | single |  |  |  |  |  | 0 (+1 failed) |" in md
    assert "| 2 | single |  |  |  |  |  | 0 (not run) |" in md
    assert "`workers-1__allreduce-single__rep0`: failed, exit code 3: `boom`" in md
    assert "1 cell(s) not run yet" in md and "workers-2__allreduce-single__rep0" in md
    data = json.loads((out / "report" / "report.json").read_text())
    assert data["combos"][0]["grad_collectives_per_step"] == 1.0  # 4 of 4096 bytes in 4 steps; 8 scalars apart
    assert data["cells"][0]["scalar_reductions_per_step"] == 2.0 and data["cells"][0]["grad_bytes_per_step"] == 4096
    assert [r["status"] for r in data["cells"]] == ["ok", "failed", "not run"]


def test_a_cell_runs_a_script_target_as_python_runs_the_script(tmp_path):
    """A study target given as a path runs as `python PATH` (and `deepspeed PATH`) would run it: its own folder first on
    sys.path, so a script that imports a module beside it (tests/tiny_train.py imports tests/faults.py) runs."""
    (tmp_path / "beside_target.py").write_text("VALUE = 'found'\n")
    (tmp_path / "target.py").write_text("import sys, beside_target\n"
                                        "print('target', beside_target.VALUE, sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-m", "ds_tools.study.cell", "--study_target", str(tmp_path / "target.py"),
                           "--flag", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "target found ['--flag', '1']" in proc.stdout
