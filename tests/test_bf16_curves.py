"""The checks of tests/test_gpu_train.py's bf16-against-fp32 tests (tests/bf16_curves.py), run without a GPU: on
curves made to fail each check, and on the debug BERT itself in bf16 and fp32 on the CPU (bf16 is emulated on a CPU
without native bf16 matmuls: slow, but the model is tiny), through the same command line and dtype recorder."""
from __future__ import annotations

import pytest

from bf16_curves import BF16_UNIT, MIN_DROP, check_bf16_against_fp32, linear_dtypes, run_recording_dtypes
from conftest import REPO, dist_env

STEPS = 20


def _learning(start: float = 7.6, per_step: float = 0.05) -> dict[int, float]:
    return {s: start - per_step * (s - 1) for s in range(1, STEPS + 1)}


def test_the_checks_pass_close_learning_curves_and_fail_each_fault():
    fp32 = _learning()
    near = {s: v * (1 + (-1) ** s * 0.9 * BF16_UNIT) for s, v in fp32.items()}
    assert check_bf16_against_fp32(near, fp32, "close") == []
    flat = {s: 7.6 for s in fp32}  # neither run learned: equal curves, which a relative tolerance alone would pass
    problems = check_bf16_against_fp32(flat, flat, "flat")
    assert len(problems) == 2 and all("did not learn" in p for p in problems)
    far = {**fp32, 3: fp32[3] * (1 + 1.2 * BF16_UNIT)}  # one step off by more than one bf16 unit
    problems = check_bf16_against_fp32(far, fp32, "far")
    assert len(problems) == 1 and "step 3:" in problems[0]
    assert check_bf16_against_fp32({s: fp32[s] for s in range(1, 10)}, fp32, "short")[0].startswith("short: steps")
    assert MIN_DROP < fp32[1] - sum(fp32[s] for s in range(16, 21)) / 5  # the made-up curve learns enough


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    d = tmp_path_factory.mktemp("bert_shards")
    write_shard(d / "part-00000.hdf5", synthetic_arrays(64, 128, 20, vocab_size=1024, seed=3))
    return d


@pytest.mark.slow
def test_debug_bert_bf16_on_cpu_computes_in_bf16_learns_and_stays_within_rounding_of_fp32(shards, tmp_path):
    """bf16 and fp32 pass every check; the control, the fp32 run at LR 1e-12 (weights that do not move), fails the
    learning check."""
    from test_gpu_train import bert_args, losses

    curves, dtypes = {}, {}
    for name, precision, extra in (("bf16", "bf16", ()), ("fp32", "fp32", ()),
                                   ("still", "fp32", ("--learning_rate", "1e-12"))):
        run = tmp_path / name
        proc = run_recording_dtypes(bert_args(shards, run, 1, precision, *extra), dist_env(DS_ACCELERATOR="cpu"),
                                    tmp_path / f"{name}_dtypes.json", cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-6000:]
        curves[name], dtypes[name] = losses(run), linear_dtypes(tmp_path / f"{name}_dtypes.json")
    assert dtypes == {"bf16": {"bfloat16/bfloat16"}, "fp32": {"float32/float32"}, "still": {"float32/float32"}}
    assert check_bf16_against_fp32(curves["bf16"], curves["fp32"], "BERT debug ZeRO-1 on CPU") == []
    learned = [p for p in check_bf16_against_fp32(curves["still"], curves["fp32"], "control, LR 1e-12")
               if "did not learn" in p]
    assert learned == [next(p for p in learned if "the bf16 run" in p)]  # the still run, in the bf16 slot, only
