"""`python -m ds_tools.study run` for real: a 2x2 BridgeTower debug study on 2 CPU ranks (report files and PNG, comms
logger counts, resume, an injected failing cell), and a 1- and 2-simulated-node study that gives ds_tools.scaling's
table. Steps are few: these check the machinery and DeepSpeed's collective counts, not speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dist_env
from ds_tools.intervals import mean_interval
from ds_tools.study import load_study

pytestmark = pytest.mark.slow
TIMEOUT = 1500


def study_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_tools.study", *args], cwd=cwd, env=dist_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)


def bt_study(tmp_path: Path, workers: str) -> Path:
    # --bf16: the mixed-precision path fast_ddp is about (auto is fp32 on a CPU without native bf16)
    # ZeRO-1 with a reduce bucket far smaller than the debug model's gradients: "buckets" must need several
    # bf16 gradient accumulation: DeepSpeedZeroOptimizer, whose bucketed reduction the `single` axis changes (the
    # shipped JSON's fp32 accumulation runs BF16_Optimizer, which all-reduces its flat buffer once whatever the keys)
    cfg = json.loads((REPO / "ds_configs" / "bridgetower_zero1_bf16.json").read_text())
    cfg["data_types"] = {"grad_accum_dtype": "bf16"}
    cfg["zero_optimization"]["reduce_bucket_size"] = 20000
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    path = tmp_path / "bt.toml"
    path.write_text(f"""
[study]
name = "bt_2x2"
module = "bridgetower_ds.train"
preset = "debug"
deepspeed_config = "{tmp_path / 'ds.json'}"
steps = 3
warmup_steps = 1
args = ["--do_train", "--dataset_path", "data/captions.jsonl", "--micro_batch_size", "4", "--max_seq_length", "16",
        "--bf16"]
ranks_per_node = 2
timeout_s = 600
comms_logger = true
single_bucket_elements = 10000000
baseline = {{ workers = 0, allreduce = "buckets" }}
prepare = ["python", "{REPO / 'studies' / 'make_caption_set.py'}", "data", "--images", "48", "--width", "64",
           "--height", "48"]
prepare_creates = "data/captions.jsonl"

[axes]
workers = {workers}
allreduce = ["buckets", "single"]

[flags]
workers = "--dataloader_num_workers"
""")
    return path


def test_two_by_two_study_runs_reports_resumes_and_records_a_failure(tmp_path):
    from PIL import Image

    out = tmp_path / "out"
    proc = study_cli("run", str(bt_study(tmp_path, "[0, 1]")), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "cell 4/4" in proc.stdout and "samples/s" in proc.stdout
    rep = out / "report"
    for name in ("report.md", "report.csv", "report.json", "throughput.png"):
        assert (rep / name).is_file(), name
    with Image.open(rep / "throughput.png") as im:
        assert im.format == "PNG" and im.size[0] > 400
    combos = {(c["workers"], c["allreduce"]): c for c in json.loads((rep / "report.json").read_text())["combos"]}
    assert len(combos) == 4 and all(c["runs"] == 1 and c["samples_per_s"] > 0 for c in combos.values())
    assert combos[(0, "buckets")]["baseline"] and combos[(0, "buckets")]["speedup"] == 1.0
    # DeepSpeed's comms logger: one gradient all-reduce per optimizer step with `single`, several with `buckets`
    for w in (0, 1):
        assert combos[(w, "single")]["grad_collectives_per_step"] == 1.0, combos[(w, "single")]
        assert combos[(w, "buckets")]["grad_collectives_per_step"] >= 3, combos[(w, "buckets")]
        # the same gradients either way
        assert combos[(w, "single")]["grad_bytes_per_step"] == combos[(w, "buckets")]["grad_bytes_per_step"]
    cells = sorted((out / "cells").iterdir())
    assert len(cells) == 4
    stamps = {d.name: (d / "metrics.jsonl").stat().st_mtime_ns for d in cells}

    # resume: every complete cell is skipped, nothing is rewritten
    proc = study_cli("run", str(bt_study(tmp_path, "[0, 1]")), "--out", str(out), "--no_report", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("complete, skipped") == 4 and "0 ran, 4 skipped" in proc.stdout
    assert stamps == {d.name: (d / "metrics.jsonl").stat().st_mtime_ns for d in cells}

    # an injected failure: one cell left unfinished (its cell.json gone, as after a crash of ds-study itself) is run
    # again, and this time its ranks cannot start (an accelerator name DeepSpeed refuses). It is recorded with its
    # exit code and log, the earlier attempt is moved aside (not deleted), and the other cells are still reported.
    victim = out / "cells" / "workers-1__allreduce-single__rep0"
    (victim / "cell.json").unlink()
    text = bt_study(tmp_path, "[0, 1]").read_text() + '\n[env]\nDS_ACCELERATOR = "no_such_accelerator"\n'
    (tmp_path / "bt.toml").write_text(text)
    proc = study_cli("run", str(tmp_path / "bt.toml"), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "0 ran, 3 skipped (complete), 1 failed" in proc.stdout and "FAILED: exit code" in proc.stdout
    assert (out / "previous" / "workers-1__allreduce-single__rep0.0" / "metrics.jsonl").is_file()
    failed = json.loads((victim / "cell.json").read_text())
    assert failed["status"] == "failed" and failed["exit_code"] != 0
    assert "no_such_accelerator" in failed["log_tail"]
    data = json.loads((rep / "report.json").read_text())
    assert [r["status"] for r in data["cells"]].count("ok") == 3
    assert [r["cell"] for r in data["cells"] if r["status"] == "failed"] == [victim.name]
    md = (rep / "report.md").read_text()
    assert "Cells that did not complete" in md and f"`{victim.name}`: failed, exit code" in md
    assert md.count("(baseline)") == 1


def test_simulated_nodes_study_measures_round_by_round_and_gives_the_scaling_table(tmp_path):
    """Two rounds of both cells, then (a precision no run can reach) a third round, bounded by max_repeats; cells run
    interleaved, each with the port `ds-study plan` printed; the scaling table has each scale's mean, interval and
    the three runs behind it."""
    study = tmp_path / "nodes.toml"
    study.write_text(f"""
[study]
module = "{REPO / 'tests' / 'tiny_train.py'}"
steps = 6
warmup_steps = 2
args = ["--num_samples", "256"]
launcher = "simulated_nodes"
ranks_per_node = 1
timeout_s = 600
repeats = 2
precision = 0.000001
max_repeats = 3

[axes]
nodes = [1, 2]
""")
    out = tmp_path / "out"
    planned = study_cli("plan", str(study), "--out", str(out), cwd=tmp_path)
    assert planned.returncode == 0, planned.stdout[-3000:]
    proc = study_cli("run", str(study), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # interleaved: round by round, each round starting one combination later
    order = [line.split(": ", 1)[1].split(" (repeat")[0] + f" r{line.split('(repeat ')[1][0]}"
             for line in proc.stdout.splitlines() if line.startswith("[ds-study] cell ")]
    assert order == ["nodes=1 r0", "nodes=2 r0", "nodes=2 r1", "nodes=1 r1", "nodes=1 r2", "nodes=2 r2"], order
    assert "measuring done after 3 round(s): 3 run(s) per combination" in proc.stdout
    for cell in load_study(study).cells():   # the first two rounds: the plan's port is the one the cell used
        rec = json.loads((out / "cells" / cell.key / "cell.json").read_text())
        assert f"master port {rec['master_port']}\n" in planned.stdout
        assert all(c[c.index("--master_port") + 1] == str(rec["master_port"]) for c in rec["command"])
    log = (out / "cells" / "nodes-2__rep0" / "log.txt").read_text()
    assert "node_rank=1" in log and "nnodes=2" in log  # two launchers, each its own simulated node
    rows = json.loads((out / "report" / "report.json").read_text())["scaling"]
    assert [(r["nodes"], r["accelerators"], r["n"]) for r in rows] == [(1, 1, 3), (2, 2, 3)]
    thr = {n: [[json.loads(x) for x in (out / "cells" / f"nodes-{n}__rep{r}" / "metrics.jsonl").read_text()
                .splitlines()][-1]["samples_per_s"] for r in range(3)] for n in (1, 2)}
    for row in rows:
        est = mean_interval(thr[row["nodes"]])
        assert row["throughput"] == pytest.approx(est.value, rel=1e-4)
        assert row["throughput_half"] == pytest.approx(est.half, rel=1e-3)
    assert rows[0]["baseline"] and rows[1]["efficiency"] == pytest.approx(
        rows[1]["per_accelerator"] / rows[0]["per_accelerator"], rel=1e-4)  # the JSON rounds to 4 decimals
    assert rows[1]["efficiency_half"] > 0
    md = (out / "report" / "report.md").read_text()
    assert "Scaling over nodes (ds_tools.scaling)" in md and "scaling efficiency %" in md
    assert (out / "report" / "scaling.png").stat().st_size > 1000
    assert (out / "report" / "throughput.png").stat().st_size > 1000
