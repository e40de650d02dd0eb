"""ds_core.run.setup's Run without a process group: the total optimizer steps are decided once, from the data, and the
run's settings cannot be edited afterwards (start_run itself runs in every multi-rank test through the entry points)."""
import dataclasses

import pytest

from ds_core.config import TrainConfig
from ds_core.errors import ConfigError
from ds_core.rank.dist import DistInfo
from ds_core.run.setup import LoopSettings, Run

DIST = DistInfo(rank=1, local_rank=1, world_size=2, local_world_size=2, nodes=1, accelerator="cpu", device=None,
                backend="gloo")


def run_for(accum: int, **train) -> Run:
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accum}
    return Run.of(LoopSettings(TrainConfig(**train)), DIST, ds)


def test_total_steps_count_accumulation_across_epochs_and_are_decided_once():
    run = run_for(4, max_epochs=3).with_data(list(range(10)))  # 30 micro batches, 4 per step: 7 (not 2 x 3)
    assert run.total_steps == 7 and len(run.data) == 10
    assert run_for(4, max_steps=5, max_epochs=3).with_data(list(range(10))).total_steps == 5  # max_steps wins
    with pytest.raises(RuntimeError, match="already has its data"):
        run.with_data(list(range(10)))
    with pytest.raises(ConfigError, match=r"1 micro batches per epoch on rank 1 x 2 epoch\(s\) make no optimizer "
                                          r"step of 4 accumulated"):
        run_for(4, max_epochs=2).with_data([0])


def test_run_and_its_settings_are_frozen():
    run = run_for(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.train.max_steps = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.total_steps = 3
    ds = run.ds_config
    ds["gradient_accumulation_steps"] = 8  # a copy: the run's DeepSpeed config stays as resolved
    assert run.ds_config["gradient_accumulation_steps"] == 1
    assert run.section(TrainConfig) is run.train
    with pytest.raises(KeyError, match="no DistInfo section"):
        run.section(DistInfo)
