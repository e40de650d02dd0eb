"""The one way the toolkit marks what it put in place of a library's attribute (ds_core.compat.changes).

A replacement carries `__wrapped__` (the object it replaced, as functools.wraps leaves it: DeepSpeed's own stays
reachable) and `ds_core_change` (the name of the change in ds_core.compat.changes.CHANGES). `replace` is the one way
an attribute is replaced; a module's or class's attribute is remembered so that switching its change off puts the
library's own back (`undo`). Apart from ds_core.compat.changes so that the changes' own modules, the fingerprints
(ds_core.compat.fingerprint) and the behaviour probes (ds_core.compat.deepspeed_behaviour) use it without importing
the list.
"""
from __future__ import annotations

import types
from typing import Any, Callable

_PATCHED: dict[str, list[tuple[Any, str, bool]]] = {}  # name -> (module or class, attribute, had its own) replaced


def mark(new: Any, original_obj: Any, name: str) -> Any:
    new.__wrapped__ = original_obj
    new.ds_core_change = name
    return new


def applied(obj: Any) -> str | None:
    """The change that put `obj` where it is; None where it is DeepSpeed's (or the library's) own."""
    return getattr(obj, "ds_core_change", None) if hasattr(obj, "__wrapped__") else None


def original(obj: Any) -> Any:
    """DeepSpeed's own object behind any number of our replacements."""
    while applied(obj) is not None:
        obj = obj.__wrapped__
    return obj


def replace(owner: Any, attr: str, make: Callable[[Any], Any], name: str) -> Any:
    """owner.attr = make(owner.attr), marked as change `name` (a marked one stays: idempotent); returns it."""
    current = getattr(owner, attr)
    if applied(current) == name:
        return current
    had_own = isinstance(owner, (type, types.ModuleType)) and attr in vars(owner)
    new = mark(make(current), current, name)
    setattr(owner, attr, new)
    if isinstance(owner, (type, types.ModuleType)):
        _PATCHED.setdefault(name, []).append((owner, attr, had_own))
    return new


def undo(name: str) -> None:
    """Put back what change `name` replaced on modules and classes (instances go with their engine)."""
    for owner, attr, had_own in reversed(_PATCHED.pop(name, [])):
        current = getattr(owner, attr)
        if applied(current) != name:
            continue
        if had_own:
            setattr(owner, attr, current.__wrapped__)
        else:
            delattr(owner, attr)


__all__ = ["mark", "applied", "original", "replace", "undo"]
