"""Each rank's client state file (client_rank{r}.pt): step, epoch, data position, RNG states, fingerprint, written as
plain data so that it loads with torch.load(weights_only=True) (ds_core.checkpoint.safe_load) on every torch the
support matrix runs.

What weights-only loading rebuilds: tensors, Python numbers, strings, None, lists, tuples and dicts. So the RNG
states are stored in those terms: python's random.getstate() is already a tuple of ints; numpy's legacy MT19937 state
(a tuple holding an ndarray of 624 uint32 keys) becomes {"kind", "keys" (a list of ints), "pos", "has_gauss",
"cached_gaussian"}; torch's and the accelerator's states are byte tensors. A data position is whatever the data
source's state_dict returns, which is meant to be JSON-able; plain_data turns numpy scalars and arrays into Python
numbers and lists and refuses anything else, naming its key, when the checkpoint is written rather than when someone
tries to read it. Files written before this layout (numpy's state as an ndarray) still load: read_client_states
allows numpy's array reconstruction for them.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ds_core.checkpoint.safe_load import NotPlainData, load


class CheckpointError(RuntimeError):
    pass


def rng_state() -> dict:
    """This process's python / numpy / torch (and accelerator) RNG states, as plain data."""
    from deepspeed.accelerator import get_accelerator

    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {"python": random.getstate(),
             "numpy": {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        state["accelerator"] = accel.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state saved (or a file of the earlier layout: numpy's state as the tuple numpy returns)."""
    from deepspeed.accelerator import get_accelerator

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    if isinstance(np_state, dict):
        np_state = (np_state["kind"], np.asarray(np_state["keys"], dtype=np.uint32), np_state["pos"],
                    np_state["has_gauss"], np_state["cached_gaussian"])
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


def plain_data(obj: Any, where: str = "client state") -> Any:
    """obj with numpy scalars and arrays as Python numbers and lists; tensors, numbers, strings, None, lists, tuples
    and dicts with string keys as they are. Anything else raises TypeError naming where it is: it would make the
    file need unpickling."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (list, tuple)):
        out = [plain_data(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, (str, int))]
        if bad:
            raise TypeError(f"{where}: key {bad[0]!r} is a {type(bad[0]).__name__}; a checkpoint's client state "
                            f"keys are strings")
        return {k: plain_data(v, f"{where}[{k!r}]") for k, v in obj.items()}
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__name__}, which a weights-only load cannot "
                    f"rebuild; a checkpoint's client state holds tensors, numbers, strings, lists and dicts")


def read_client_state(path: Path) -> dict:
    """One client_rank{r}.pt, loaded as data (numpy's array reconstruction allowed for files of the earlier layout);
    NotPlainData where the file needs anything else."""
    state = load(path, numpy=True)
    if not isinstance(state, dict):
        raise NotPlainData(f"{path}: a {type(state).__name__}, expected the client state dict")
    return state


def read_client_states(ckpt_root: str | Path, tag: str, world: int) -> list[dict]:
    """client_rank{r}.pt of every saved rank, in rank order; a missing, unreadable or not-plain one is named."""
    states = []
    for r in range(world):
        f = Path(ckpt_root) / tag / f"client_rank{r}.pt"
        if not f.is_file():
            raise CheckpointError(f"checkpoint {f.parent}: {f.name} is missing (saved by {world} ranks, each writes "
                                  f"one); this checkpoint cannot be resumed")
        try:
            states.append(read_client_state(f))
        except NotPlainData as e:
            raise CheckpointError(f"checkpoint {f.parent}: {e}") from None
        except Exception as e:  # a truncated zip: torch raises RuntimeError / EOFError
            raise CheckpointError(f"checkpoint {f.parent}: {f.name} is unreadable ({type(e).__name__}: {e})") from e
    return states


__all__ = ["CheckpointError", "rng_state", "set_rng_state", "plain_data", "read_client_state", "read_client_states"]
