"""What the loop needs of a model's training data (DataSource), and the data's summary statistics summed over ranks
into the run's summary record (reduce_summary_stats)."""
from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch.distributed as tdist


class DataSource(Protocol):
    """What the loop needs of a model's data.

    state_dict(): THIS rank's position (saved per rank in client_rank{r}.pt of each checkpoint).
    load_state_dict(state): this rank's own saved state; used on a resume onto the same world size by a source that
        has no load_state_dicts.
    load_state_dicts(states) (optional; the resize contract): called on every resume with the saved states of ALL
        ranks of the checkpoint, in rank order, whether the world size is the same or not. The source knows its own
        rank and world size, and takes its share of the epoch's samples that no saved rank consumed: over the epoch
        every sample is seen exactly once, on any world size. On the same world size it must behave as
        load_state_dict(states[rank]) did (bitwise on CPU). A source without it resumes on the same world size only:
        ds_core refuses a resize naming the source's class, before any loading.
    RNG on a resize (ds_core.checkpoint.load): a rank that existed in the saved run gets its own python / numpy /
    torch streams back; a new rank r gets ds_core.rank.dist.set_seed(seed + step, r). Data order never comes from
    these streams (each source seeds its own generators from the global seed), so they only drive dropout and the like.
    """

    def set_epoch(self, epoch: int) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    # Optional: summary_stats() -> dict of THIS rank's counts (summed over ranks into the summary, lists
    # concatenated), and shared_summary_stats, the keys of it that are the same on every rank (taken from rank 0).


def reduce_summary_stats(stats: dict, world_size: int, shared: frozenset | set = frozenset()) -> dict:
    """Sum a data source's summary statistics over ranks (numbers summed, lists concatenated in rank order), except
    the keys in `shared` (the same on every rank, e.g. the dataset size): those are rank 0's. Every rank calls it."""
    gathered: list = [stats]
    if tdist.is_initialized() and world_size > 1:
        gathered = [None] * world_size
        tdist.all_gather_object(gathered, stats)
    out: dict = {}
    for key in gathered[0]:
        vals = [g.get(key) for g in gathered]
        if key in shared:
            out[key] = vals[0]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = sum(vals)
        elif all(isinstance(v, list) for v in vals):
            out[key] = [x for v in vals for x in v]
        else:
            out[key] = vals  # anything else is reported per rank rather than guessed at
    return out


__all__ = ["DataSource", "reduce_summary_stats"]
