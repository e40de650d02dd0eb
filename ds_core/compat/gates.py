"""Whether a change inside DeepSpeed applies on the installed library (each change's one gate), and the state it ends
in (ds_core.compat.changes).

A change's gate asks the installed library one question about what the change replaces, mends or reads, by feature:
never by version number, never by parameter names.
- Bodies(targets, fixed=...): the DeepSpeed bodies the change replaces (or whose result it mends), each by the
  fingerprint of its source (ds_core.compat.fingerprint). Every body one the change was read against
  (ds_core.compat.verified.VERIFIED): it applies. A change that fixes an older release's fault names, in `fixed`,
  what a release with the fix does: where every body is one read and found to have the fix already
  (verified.FIXED), it is not needed. Any other body, or none: refused, so that a release that edits a method never
  keeps our old copy of it silently.
- Has(targets): what a change wraps or reads without replacing a body (a module, a function, a class, an
  attribute) is there.

The outcome is one State, with its reason (Outcome):
- APPLIED: on (before its stage ran in this process: will be);
- NOT_NEEDED: the installed library has the fix, or this run has nothing for it to do (another optimizer wrapper,
  another device): decided by the gate or, on this run's engine, by the change's apply function;
- REFUSED: the installed library lacks or changed what it replaces: the library's own path runs, one line says so;
- SWITCHED_OFF: --ds_changes / DS_TOOLKIT_CHANGES.
str(outcome) is what a run records: "on", "not needed: <why>", "off: <why>" (refused and switched off both read
"off", as the switch's own word).
"""
from __future__ import annotations

import enum
import importlib
import importlib.util
from dataclasses import dataclass

from ds_core.compat.fingerprint import installed, resolve
from ds_core.compat.verified import FIXED, VERIFIED


class State(enum.Enum):
    APPLIED = "applied"
    NOT_NEEDED = "not needed"
    REFUSED = "refused"
    SWITCHED_OFF = "switched off"


@dataclass(frozen=True)
class Outcome:
    state: State
    why: str = ""

    @property
    def label(self) -> str:
        """The word a run records: "on", "not needed" or "off"."""
        return {State.APPLIED: "on", State.NOT_NEEDED: "not needed"}.get(self.state, "off")

    def __str__(self) -> str:
        return self.label if self.state is State.APPLIED else f"{self.label}: {self.why}"


APPLIED = Outcome(State.APPLIED)


def not_needed(why: str) -> Outcome:
    return Outcome(State.NOT_NEEDED, why)


def refused(why: str) -> Outcome:
    return Outcome(State.REFUSED, why)


def _dotted(target: str) -> str:
    return target.replace(":", ".")


@dataclass(frozen=True)
class Bodies:
    """The gate of a change that replaces DeepSpeed bodies ("module:qualname" each), or mends what one leaves."""
    targets: tuple[str, ...]
    fixed: str | None = None  # a fix of an older release's fault: what a body with the fix does (why not needed)

    def __call__(self) -> Outcome:
        got = {t: installed(t) for t in self.targets}
        if all(got[t] in VERIFIED.get(t, {}) for t in self.targets):
            return APPLIED
        if self.fixed is not None and all(got[t] in FIXED.get(t, {}) for t in self.targets):
            return not_needed(self.fixed)
        target = next(t for t in self.targets if got[t] not in VERIFIED.get(t, {}))
        if resolve(target) is None:
            return refused(f"this DeepSpeed has no {_dotted(target)}")
        from ds_core.compat.deepspeed_behaviour import deepspeed_version

        what = "has no source to fingerprint" if got[target] is None else f"has fingerprint {got[target]}"
        read = [*VERIFIED.get(target, {}).values(), *FIXED.get(target, {}).values()]
        return refused(f"DeepSpeed {deepspeed_version()}'s {_dotted(target)} {what}, not one this change was "
                       f"verified against ({', '.join(read) or 'none'})")


_ABSENT = object()


def _present(target: str) -> bool:
    """Whether "module" (found without importing it) or "module:attr.path" (an attribute, None included) exists."""
    module, _, path = target.partition(":")
    try:
        if not path:
            return importlib.util.find_spec(module) is not None
        obj = importlib.import_module(module)
    except ImportError:
        return False
    for part in path.split("."):
        obj = getattr(obj, part, _ABSENT)
        if obj is _ABSENT:
            return False
    return True


@dataclass(frozen=True)
class Has:
    """The gate of a change that wraps or reads what it names ("module" or "module:attr.path" each) in place."""
    targets: tuple[str, ...]
    library: str = "this DeepSpeed"
    note: str = ""  # what the library does where it lacks them

    def __call__(self) -> Outcome:
        lacks = [_dotted(t) for t in self.targets if not _present(t)]
        if not lacks:
            return APPLIED
        return refused(f"{self.library} has no {', '.join(lacks)}" + (f" ({self.note})" if self.note else ""))


__all__ = ["State", "Outcome", "APPLIED", "not_needed", "refused", "Bodies", "Has"]
