"""The three batch numbers of a DeepSpeed JSON checked against the data-parallel world size, a missing one
derived as DeepSpeed derives it, and a run's Batch, decided once."""
from __future__ import annotations

from dataclasses import dataclass

from ds_core.config.accumulation import settle_grad_accum_dtype  # noqa: F401 - part of ds_core.config's API
from ds_core.errors import ConfigError

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_batch_arithmetic(tb: int | None, mb: int | None, ga: int | None, world_size: int,
                           source: str = "DeepSpeed config") -> tuple[int, int, int]:
    """Fill in and check train_batch_size = micro_batch x grad_accum x world_size, deriving a missing number the way
    DeepSpeed's _configure_train_batch_size does. Returns (train_batch_size, micro_batch, grad_accum)."""
    if world_size < 1:
        raise ConfigError(f"{source}: data-parallel world size {world_size}: expected >= 1")
    for name, v in zip(_BATCH_KEYS, (tb, mb, ga)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{source}: {name} = {v!r}: expected a positive integer")
    numbers = (f"train_batch_size={tb}, train_micro_batch_size_per_gpu={mb}, gradient_accumulation_steps={ga}, "
               f"data-parallel world size={world_size}")
    if tb and mb and ga:
        if tb != mb * ga * world_size:
            raise ConfigError(f"{source}: inconsistent batch numbers: {numbers}; expected train_batch_size = "
                              f"{mb} x {ga} x {world_size} = {mb * ga * world_size}")
    elif tb and mb:
        if tb % (mb * world_size):
            raise ConfigError(f"{source}: train_batch_size {tb} is not divisible by micro batch x world size = "
                              f"{mb} x {world_size} = {mb * world_size} ({numbers})")
        ga = tb // (mb * world_size)
    elif tb and ga:
        if tb % (ga * world_size):
            raise ConfigError(f"{source}: train_batch_size {tb} is not divisible by grad accumulation x world size "
                              f"= {ga} x {world_size} = {ga * world_size} ({numbers})")
        mb = tb // (ga * world_size)
    elif mb and ga:
        tb = mb * ga * world_size
    elif tb:
        ga = 1
        if tb % world_size:
            raise ConfigError(f"{source}: train_batch_size {tb} is not divisible by world size {world_size}")
        mb = tb // world_size
    elif mb:
        ga = 1
        tb = mb * world_size
    else:
        raise ConfigError(f"{source}: give train_batch_size or train_micro_batch_size_per_gpu ({numbers})")
    return tb, mb, ga


@dataclass(frozen=True)
class Batch:
    """A run's batch numbers, decided once from its resolved DeepSpeed config (load_ds_config fills them in):
    micro batch per rank, micro batches accumulated per optimizer step, data-parallel ranks, and the global batch
    (micro x accumulation x data-parallel ranks), in samples."""

    micro: int
    accumulation: int
    data_parallel: int
    global_size: int

    @classmethod
    def of(cls, ds_config: dict, data_parallel: int) -> "Batch":
        """The numbers of a resolved DeepSpeed config (load_ds_config's, after any resize) on `data_parallel` ranks,
        checked against each other once more: a config edited after resolving would fail here, naming them."""
        tb, mb, ga = check_batch_arithmetic(ds_config.get("train_batch_size"),
                                            ds_config.get("train_micro_batch_size_per_gpu"),
                                            ds_config.get("gradient_accumulation_steps"), data_parallel,
                                            "resolved DeepSpeed config")
        return cls(micro=mb, accumulation=ga, data_parallel=data_parallel, global_size=tb)
