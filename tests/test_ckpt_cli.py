"""`ds-ckpt` (python -m ds_tools.ckpt_cli) on a real 2-rank ZeRO-3 checkpoint of tests/tiny_train.py: info, universal
conversion, and export-hf whose weights a transformers from_pretrained loads equal to the run's own gathered export."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, dist_env, run_deepspeed
from test_resize import ds_json

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "tiny_train.py")


def ds_ckpt_process(*args):
    """`python -m ds_tools.ckpt_cli ARGS`, what the ds-ckpt console script runs."""
    return subprocess.run([sys.executable, "-m", "ds_tools.ckpt_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=dist_env(), timeout=300)


@pytest.fixture
def ds_ckpt(capsys):
    """ds-ckpt's main(ARGS) in this process (exit status, stdout, stderr as a finished process has them): the entry
    point's own process is ds_ckpt_process, started once below; each further start would only import torch again."""
    from ds_tools.ckpt_cli import main

    def run(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["ds-ckpt", *map(str, args)], code, out, err)

    return run


@pytest.mark.stack
@pytest.mark.each_gaudi
def test_info_universal_and_export_hf_of_a_zero3_checkpoint(tmp_path, ds_ckpt):
    run = tmp_path / "run"
    run_deepspeed([SCRIPT, "--run_dir", str(run), "--deepspeed_config", ds_json(tmp_path, 3), "--max_steps", "3",
                   "--num_steps_per_checkpoint", "2", "--progress_bar", "false", "--num_samples", "256",
                   "--export_dir", str(tmp_path / "gathered")])
    root = run / "checkpoints"
    # a save cut short: a step directory without COMPLETE
    shutil.copytree(root / "global_step2", root / "global_step9")
    (root / "global_step9" / "COMPLETE").unlink()

    proc = ds_ckpt_process("info", run)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "latest complete global_step3" in out
    assert "global_step3: step 3, ZeRO-3, world size 2, global batch 16 (micro 8 x accum 1)" in out
    assert "global_step9: INCOMPLETE" in out
    assert "rank 1: epoch 0, data {\"epoch\": 0, \"offset\": 24}" in out  # 3 steps x micro 8 on each rank
    info = json.loads(ds_ckpt("info", run, "--json").stdout)
    assert [t["tag"] for t in info["tags"]] == ["global_step9", "global_step3", "global_step2"]
    assert info["tags"][1]["bytes"] > 0

    proc = ds_ckpt("universal", run, "--tag", "global_step9")
    assert proc.returncode == 2 and "global_step9: no COMPLETE marker" in proc.stderr
    assert ds_ckpt("universal", run).returncode == 0
    assert (root / "global_step3_universal" / "COMPLETE").is_file()
    zero = root / "global_step3_universal" / "zero"
    assert (zero / "bert.embeddings.word_embeddings.weight" / "exp_avg.pt").is_file()
    assert "universal: " in ds_ckpt("info", run).stdout

    proc = ds_ckpt("export-hf", run, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    from transformers import BertForSequenceClassification

    exported = BertForSequenceClassification.from_pretrained(tmp_path / "hf")
    gathered = BertForSequenceClassification.from_pretrained(tmp_path / "gathered")
    assert exported.dtype == torch.float32
    # the run's precision (bf16 where the CPU has it natively): the gathered copy is the fp32 master rounded to it
    bf16 = json.loads((run / "ds_config.json").read_text()).get("bf16", {}).get("enabled", False)
    for (name, a), (_, b) in zip(exported.state_dict().items(), gathered.state_dict().items()):
        assert torch.equal(a.bfloat16(), b.bfloat16()) if bf16 else torch.equal(a, b.float()), name
    proc = ds_ckpt("export-hf", run, tmp_path / "hf")  # never overwrites
    assert proc.returncode == 2 and "not empty" in proc.stderr
    proc = ds_ckpt("info", tmp_path / "nothing")
    assert proc.returncode == 2 and "no checkpoints/ directory" in proc.stderr
