"""Host syncs of a training step: a short BERT run (debug preset, bf16, ZeRO-1, NVLAMB, the repository's BERT
DeepSpeed config) on one CPU rank, every host read of a tensor counted per optimizer step (tests/count_syncs_run.py).

On a step that writes no metrics record (--log_every 4) the loop reads nothing of its own step: it reads the
previous step's values (loss, counts, stop flag, gradient norm), whose work is done by then; nothing else in the
step may read a device value, except DeepSpeed's non-finite gradient check in its BF16_Optimizer (bf16 ZeRO-1 with
fp32 accumulation, the BERT-Large recipe's), which runs whatever the settings. The first step is left out (state
created on it)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import deepspeed_release, run_deepspeed

# the host reads of a step (what bounds an HPU's or a GPU's step), on every stack: torch's ops decide them too
pytestmark = [pytest.mark.stack, pytest.mark.each_gaudi]
STEPS, LOG_EVERY = 8, 4
DEFERRED = "run/readback.py"  # PendingStep.read: the loop's one read per step, of the previous step's values
# DeepSpeed's own non-finite check in BF16_Optimizer.step, where the read is recorded, per release of the support
# matrix: 0.19's is_invalid_grad_norm (runtime/utils.py); Habana's fork's `assert all_groups_norm > 0.` (recorded at
# the engine's optimizer.step() call)
BF16_OPTIMIZER_CHECKS = {(0, 19): "runtime/utils.py", (0, 16): "runtime/engine.py"}


def bf16_optimizer_check() -> str:
    return BF16_OPTIMIZER_CHECKS[deepspeed_release(BF16_OPTIMIZER_CHECKS)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    d = tmp_path_factory.mktemp("sync_shards")
    write_shard(d / "part-00000.hdf5", synthetic_arrays(16, 128, 20, vocab_size=1024, seed=3))
    return d


def _count(shards: Path, tmp: Path, *extra: str, ds_config: str = "ds_configs/bert_debug_zero1_bf16.json") -> dict:
    out = tmp / "syncs.json"
    run_deepspeed(["tests/count_syncs_run.py", str(out), "--",
                   "--preset", "debug", "--deepspeed_config", ds_config,
                   "--input_dir", str(shards), "--run_dir", str(tmp / "run"), "--max_steps", str(STEPS),
                   "--log_every", str(LOG_EVERY), "--throughput_warmup_steps", "0", "--progress_bar", "false",
                   "--optimizer", "lamb", "--learning_rate", "0.01", "--precision", "bf16", "--export_hf", "false",
                   *extra], num_ranks=1)
    return json.loads(out.read_text())


def _quiet_steps(info: dict) -> dict[int, list[str]]:
    steps = {int(k): v for k, v in info["steps"].items()}
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    return {k: v for k, v in steps.items() if k > 1 and k % LOG_EVERY}


def _check_deferred(info: dict, quiet: dict[int, list[str]]) -> dict[int, list[str]]:
    """The loop's own reads on quiet steps: one each, of the step before; returns the other reads."""
    lag = {now + 1: read for now, read in info["lagged"]}  # read during the window of step now + 1
    others = {}
    for step, sites in quiet.items():
        ours = [s for s in sites if DEFERRED in s]
        assert len(ours) <= 1, (step, sites)
        if ours:
            assert lag.get(step) == step - 1, (step, info["lagged"])
        others[step] = [s for s in sites if DEFERRED not in s]
    return others


@pytest.mark.slow
def test_zero1_bf16_step_reads_nothing_of_its_own(shards, tmp_path):
    """ZeRO-1 bf16 with bf16 accumulation (DeepSpeed's ZeRO-1/2 optimizer): no read stalls a quiet step."""
    info = _count(shards, tmp_path)
    others = _check_deferred(info, _quiet_steps(info))
    assert all(not v for v in others.values()), others


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["optimizer", "deepspeed"])
def test_bf16_optimizer_step_has_only_deepspeeds_finite_check(shards, tmp_path, clip):
    """Accumulation 2 (fp32 accumulation: DeepSpeed's BF16_Optimizer, the BERT-Large recipe's path): at most one
    read stalls a quiet step, DeepSpeed's non-finite gradient check. The global clip at 1.0 either in NVLAMB
    (gradient_clipping 0, the BERT JSONs) or in DeepSpeed (gradient_clipping 1.0, as BridgeTower's JSON and Habana's
    LANS recipe): DeepSpeed's own clip reads the norm (`if clip_coef < 1`), ds_core.compat.flat_norm's does not."""
    config = "ds_configs/bert_debug_zero1_bf16.json"
    if clip == "deepspeed":
        ds = json.loads(Path(config).read_text())
        ds["gradient_clipping"] = 1.0  # NVLAMB's max_grad_norm: DeepSpeed clips, the optimizer leaves it
        config = str(tmp_path / "clip_in_deepspeed.json")
        Path(config).write_text(json.dumps(ds))
    info = _count(shards, tmp_path, "--gradient_accumulation_steps", "2", ds_config=config)
    others = _check_deferred(info, _quiet_steps(info))
    for step, sites in others.items():
        assert len(sites) <= 1 and all(bf16_optimizer_check() in s for s in sites), (step, sites)
