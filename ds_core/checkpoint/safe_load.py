"""Checkpoint files read as data: torch.load(weights_only=True), never unpickled.

Why: a `.pt` file is a pickle, and `torch.load(weights_only=False)` calls whatever callable the pickle names (a
`__reduce__` of `os.system` runs a command the moment the file is read). A checkpoint passed between teams, or a
broken one a user was sent to look at with `ds-ckpt info`, must not be able to do that. torch's weights-only
unpickler rebuilds tensors, numbers, strings, lists, tuples and dicts, plus the classes named to it, and refuses
every other global, so what it loads is data whoever wrote the file.

What this toolkit writes loads that way as it is (client state and RNG state are tensors, numbers and lists:
ds_core.checkpoint.plain_data; manifests and markers are JSON). Two allowances, each a set of classes whose
instances are rebuilt from their fields (no code of the file's choosing runs):
- legacy_numpy: numpy's array reconstruction, for client files written before the RNG state was stored as lists
  (numpy's MT19937 keys were an ndarray);
- deepspeed_records: the plain records DeepSpeed's ZeRO optimizer files hold (its loss scaler, the ZeRO stage enum,
  tensor-fragment addresses), for the offline tools that convert or export a checkpoint (`ds-ckpt universal`,
  `export-hf`) through DeepSpeed's own readers inside data_only_loads.

DeepSpeed's engine loader (engine.load_checkpoint, what --resume and a run-directory --init_checkpoint use) calls
torch.load(weights_only=False) itself: docs/checkpoints.md says what that means for a checkpoint from elsewhere.
By feature: torch.serialization.safe_globals (torch >= 2.5) scopes the allowances to one load; where it is missing,
add_safe_globals (torch 2.4) registers them for the process.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
from pathlib import Path
from typing import Any, Iterator

import torch

# "module:name" of the classes DeepSpeed 0.16 - 0.19 ZeRO optimizer states pickle (read with
# torch.serialization.get_unsafe_globals_in_checkpoint on real ZeRO-1/2/3 checkpoints, fp32 and bf16)
DEEPSPEED_RECORDS = ("deepspeed.runtime.fp16.loss_scaler:LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
                     "deepspeed.runtime.zero.config:ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment:fragment_address")


class NotPlainData(ValueError):
    """A checkpoint file that a weights-only load refuses; the message names the file and the globals it needs."""


def legacy_numpy() -> list:
    """numpy's array reconstruction (numpy 1.x: numpy.core, 2.x: numpy._core) and the dtypes of its RNG state."""
    import numpy as np

    if int(np.__version__.split(".")[0]) >= 2:
        from numpy._core.multiarray import _reconstruct
    else:  # numpy 1.26 also has a numpy._core, a stub for reading 2.x pickles without its submodules until imported
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, *{type(np.dtype(t)) for t in ("u4", "i8", "f8")}]


def deepspeed_records() -> list:
    """The classes of DEEPSPEED_RECORDS the installed DeepSpeed has (a release without one simply lacks it)."""
    found = []
    for target in DEEPSPEED_RECORDS:
        module, _, name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
        if cls is not None:
            found.append(cls)
    return found


@contextlib.contextmanager
def _allowed(classes: list) -> Iterator[None]:
    ser = torch.serialization
    if not classes:
        yield
    elif hasattr(ser, "safe_globals"):
        with ser.safe_globals(classes):
            yield
    else:  # torch 2.4: process-wide registration, the same classes every time
        ser.add_safe_globals(classes)
        yield


def _unsafe_names(path: str | os.PathLike) -> str:
    get = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if get is None:
        return ""
    try:
        names = get(str(path))
    except Exception:  # noqa: BLE001 - only for the message
        return ""
    return f" (it names {', '.join(names[:4])}{' ...' if len(names) > 4 else ''})" if names else ""


def refused(path: str | os.PathLike, error: BaseException) -> NotPlainData:
    """The one-line error for a file a weights-only load refused."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    # torch's message starts with advice on loading the file anyway; the line that names the refusal is the one
    why = next((ln for ln in lines if "unsupported" in ln.lower() or "GLOBAL" in ln), lines[0] if lines else
               type(error).__name__)
    return NotPlainData(f"{path}: not plain data{_unsafe_names(path)}: a weights-only load refuses it "
                        f"({why[:200]}); this toolkit never unpickles a checkpoint file")


def load(path: str | os.PathLike, *, numpy: bool = False, deepspeed: bool = False, map_location: Any = "cpu") -> Any:
    """torch.load(path, weights_only=True) with the allowances asked for (module docstring). Raises NotPlainData
    for a file that names other globals (a pickle payload among them); OSError / RuntimeError for an unreadable one."""
    classes = (legacy_numpy() if numpy else []) + (deepspeed_records() if deepspeed else [])
    try:
        with _allowed(classes):
            return torch.load(Path(path), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(path, e) from None


@contextlib.contextmanager
def data_only_loads(numpy: bool = False, deepspeed: bool = True) -> Iterator[None]:
    """Every torch.load inside the block loads data only (weights_only=True, with the allowances), whatever its
    caller asked: for running DeepSpeed's own checkpoint readers (ds_to_universal, zero_to_fp32), which pass
    weights_only=False, on files from elsewhere. One process, one thread (the offline tools); torch.load is put back
    on exit. A refused file raises NotPlainData naming it."""
    own = torch.load
    classes = (legacy_numpy() if numpy else []) + (deepspeed_records() if deepspeed else [])

    def data_only(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return own(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise refused(f, e) from None

    torch.load = data_only
    try:
        with _allowed(classes):
            yield
    finally:
        torch.load = own


__all__ = ["NotPlainData", "load", "data_only_loads", "legacy_numpy", "deepspeed_records", "refused",
           "DEEPSPEED_RECORDS"]
