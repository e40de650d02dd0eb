"""The DL1 path end to end: first-generation Gaudi (AWS DL1) runs Intel Gaudi software 1.21 for good, and DL1 is the EFA
cluster of the published BERT-1.5B study. On every stack (the gaudi-1.21 lane is that release's): the published
recipe resolves to Habana's settings through the launcher's dry run with the `efa` profile, a shortened run of that
recipe trains on 2 ranks, and `launch.env show` / `launch.preflight` answer for an emulated DL1 host."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dist_env, run_deepspeed
from launch import env as envmod
from test_launch_fabric import emulated_preflight
from test_recipes import PUBLISHED, resolved

pytestmark = pytest.mark.stack


def test_the_dl1_recipe_resolves_through_the_launcher(tmp_path):
    """`python -m launch.run --dry_run --profile efa` on one DL1 node of 8 Gaudi: the recipe's module command and
    Habana's 1.5B JSON; the recipe's settings on 8 ranks are Habana's published ones."""
    (tmp_path / "hostfile").write_text("dl1-node0 slots=8\n")
    env = dist_env()
    wrote = subprocess.run([sys.executable, "-m", "launch.env", "write", "--profile", "efa"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert wrote.returncode == 0, wrote.stderr
    proc = subprocess.run([sys.executable, "-m", "launch.run", "--dry_run", "--hostfile", "hostfile", "--profile",
                           "efa", "--", "--recipe", "habana_1p5b_8x", "--input_dir", str(tmp_path), "--run_dir",
                           str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["argv"][plan["argv"].index("bert_ref.train") + 1:][:2] == ["--recipe", "habana_1p5b_8x"]
    assert Path(plan["deepspeed_config"]["file"]).name == "bert_1p5b_zero1_bf16.json"
    assert plan["deepspeed_config"]["chosen_by"] == "--recipe habana_1p5b_8x"
    train_cfg, args, opt, ds = resolved(["--recipe", "habana_1p5b_8x", "--input_dir", "x"], 8, tmp_path)
    pub = PUBLISHED["habana_1p5b_8x"]
    assert (args.preset, ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"], ds["zero_optimization"]["stage"], opt.optimizer) == \
        (pub["preset"], pub["train_batch_size"], pub["micro"], pub["accum"], pub["zero_stage"], pub["optimizer"])


def dl1_stack() -> str | None:
    """None where the installed packages are Gaudi software 1.21's (the stack DL1 runs), else what they are."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stacks_tool", REPO / "tools" / "stacks.py")
    stacks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stacks)
    have = stacks.installed()
    release = stacks.gaudi_release(have)
    return None if release == "1.21" else (f"torch {have.get('torch')}, deepspeed {have.get('deepspeed')}: Intel Gaudi "
                                           f"software {release}" if release else "not a Gaudi stack")


def test_a_shortened_dl1_recipe_run_trains(tmp_path):
    """The recipe's every setting (LANS under ZeRO-1, Habana's poly schedule, its JSON and global batch of 12288) on 2
    ranks, shortened: the 1.5B model's Pre-LN code at the debug size, two optimizer steps; in the precision `auto`
    gives the machine (bf16 where the CPU has it natively, else fp32). Its 2 x 12288 samples cost a minute on 2 cores,
    so it runs on the stack DL1 runs (gaudi-1.21's lane); the recipe's settings resolve on every stack (above)."""
    why = dl1_stack()
    if why:
        pytest.skip(f"the shortened DL1 run belongs to Gaudi software 1.21's stack; this is {why}")
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(shards / "part-00000.hdf5", synthetic_arrays(64, 128, 20, vocab_size=1024, seed=3))
    run = tmp_path / "run"
    run_deepspeed(["--module", "bert_ref.train", "--recipe", "habana_1p5b_8x", "--preset", "debug_pre_ln",
                   "--input_dir", str(shards), "--run_dir", str(run), "--max_steps", "2", "--progress_bar", "false",
                   "--export_hf", "false", "--save_final_checkpoint", "false"], timeout=800)
    cfg = json.loads((run / "run_config.json").read_text())
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 12288 and ds["zero_optimization"]["stage"] == 1
    assert json.dumps(cfg).count("habana_1p5b_8x") >= 1 and json.dumps(cfg).count("lans") >= 1
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2], steps
    rec = steps[0]
    assert all(math.isfinite(rec[k]) and rec[k] > 0 for k in ("loss", "mlm_loss", "nsp_loss", "grad_norm")), rec
    # two steps of Habana's poly schedule (warm-up 5 %, constant 25 %): the first at 0.5 / 0.7 of the peak 0.0015
    assert rec["lr"] == pytest.approx(0.0015 * 0.5 / 0.7)


def test_the_efa_profile_and_preflight_on_an_emulated_dl1_host(tmp_path):
    """`launch.env show --profile efa`: Habana's host-NIC Gaudi Direct variables for EFA; preflight on a DL1 host
    (8 HL-205, libfabric 1.18 with the efa provider): HCCL takes host NIC Gaudi Direct, and the run may start."""
    shown = subprocess.run([sys.executable, "-m", "launch.env", "show", "--profile", "efa"], cwd=tmp_path,
                           env=dist_env(), capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == envmod.format_env(envmod.resolve_profile("efa", {}))
    assert "FI_PROVIDER=efa" in shown.stdout and "FI_EFA_USE_DEVICE_RDMA=1" in shown.stdout
    assert "HCCL_OVER_OFI" not in shown.stdout  # it would force host memory (docs/gaudi.md "Scale-out")
    code, rows, out = emulated_preflight(tmp_path, "dl1-efa")
    assert code == 0 and rows["hccl scale-out"]["result"] == "PASS", out
    assert rows["libfabric"]["result"] == "PASS" and "1.18.2" in rows["libfabric"]["detail"], out
    assert (REPO / "launch" / "env" / "efa.env").is_file()
