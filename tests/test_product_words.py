"""The repository's files speak of the product: no ticket numbers, no account of how or where the code was written,
no path of one particular machine. A reader has the repository only; "added for issue 26", "measured while other
sessions' jobs ran" or "../shared/STYLE.md" tell them nothing, so a docstring, doc, study or test says what a thing
is and why instead.

Scanned: every text file git lists for the repository (tracked, plus new files not ignored), or, without git, every
file under the repository root outside the folders in SKIP_DIRS. Binary files (a NUL byte, or not UTF-8) are skipped.
This file is the one exception (SELF): it holds the patterns and examples of each. Each pattern is matched per line;
PENDING names the lines still allowed and why, and an entry whose count no longer matches fails too, so the list only
shrinks.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO

SELF = "tests/test_product_words.py"

# name -> (pattern, what a reader lacks). Case-insensitive, one line at a time.
PATTERNS: dict[str, tuple[str, str]] = {
    # "issue 26", "issues 29, 27", "(issue 27 item 5)", "Issue 29:"; not "DeepSpeed issues 2 all-reduces" (a verb
    # followed by a noun), hence the look-ahead for punctuation, "item", "and" or the end of the line
    "issue number": (r"\bissues? #?\d{1,4}(?=\s*(?:[,;:.)(]|item\b|and\b|$))", "a ticket number"),
    # "(#26)", "PR #12"; not "##98" (a WordPiece token), "&#123;" (an HTML entity), "#fff" / "#123456" (colours),
    # a lint marker ("#", a space, "noqa") or "## Heading" (a space follows the hash)
    "hash number": (r"(?<![\w#&])#\d{2,4}\b", "a ticket or pull-request number"),
    # "device time" of a lease ("device time left"), not of a kernel ("the most device time")
    "lent machine": (r"\blent\b|\bloans?\b|\bdevice command\b|\bdevice time (?:left|budget|per session)\b",
                     "that a machine was lent to the developers, and the terms of the loan"),
    "half an hour": (r"half an hour", "how long a machine was lent"),
    "session story": (r"\b(?:other|this|next|previous|earlier|later)\s+sessions?\b|\bsessions'"
                      r"|\bsession's (?:pip|jobs?|time|budget|machine)",
                      "the development sessions (a POSIX or ssh session is fine)"),
    "host story": (r"\b(?:shared (?:with|by) (?:other|several)|load from other) jobs\b|\bof the issue\b",
                   "who else used the development host, or a ticket's text (say the load: 'load average 0.2-7')"),
    "first GPU run": (r"\bfirst (?:gpu|cuda|device) run\b|gpu-first-run", "the first GPU run as a story"),
    "branch name": (r"\bbranch i\d", "a development branch the repository does not have"),
    "machine path": (r"(?<![\w.~-])/(?:work|root|home/[a-z_][\w.-]*)/", "a path of one machine"),
    "outside path": (r"\.\./shared\b|\.library/|KINDS\.md", "a file outside the repository"),
}
COMPILED = {name: re.compile(p, re.IGNORECASE) for name, (p, _) in PATTERNS.items()}

SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "runs", "wheelhouse", "__pycache__", ".pytest_cache",
             ".hypothesis", "node_modules"}

# (path, pattern name) -> (lines still matching, why they are allowed). Empty: nothing is allowed; an entry whose
# count no longer matches fails the test, so the list only shrinks.
PENDING: dict[tuple[str, str], tuple[int, str]] = {}


def repo_files() -> list[str]:
    """Paths relative to the repository root, sorted."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (an unpacked sdist)
        names = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                 if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(REPO).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return sorted(n for n in names if n != SELF and (REPO / n).is_file())


def text_of(path: str) -> str | None:
    data = (REPO / path).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def find_traces(text: str) -> list[tuple[str, int, str]]:
    """(pattern name, line number, line) for every line of `text` that a pattern matches."""
    return [(pat, no, line.strip()) for no, line in enumerate(text.splitlines(), 1)
            for pat, rx in COMPILED.items() if rx.search(line)]


def all_traces() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in repo_files():
        text = text_of(path)
        if text is not None:
            for pat, no, line in find_traces(text):
                found.setdefault((path, pat), []).append(f"{path}:{no}: {line}")
    return found


def test_no_ticket_numbers_or_development_story_in_the_repository():
    found = all_traces()
    new = [hit for key, hits in found.items() if key not in PENDING for hit in hits]
    assert not new, ("these lines speak of how the project was made, not of the product (say what the thing is; "
                     "patterns in tests/test_product_words.py):\n" + "\n".join(new))
    changed = {key: (len(found.get(key, [])), n) for key, (n, _) in PENDING.items() if len(found.get(key, [])) != n}
    assert not changed, f"PENDING no longer matches (found, allowed): {changed}; update or remove those entries"


def test_the_scan_sees_the_whole_repository():
    files = repo_files()
    for expected in ("README.md", "docs/development.md", "ds_core/run/trainer.py", "studies/emulated_fabrics.toml",
                     "studies/results/emulated_fabrics_cpu.md", "tests/test_layering.py", "Makefile"):
        assert expected in files and text_of(expected) is not None
    assert text_of("studies/results/bert_scaling_cpu_debug.png") is None  # binary: skipped


@pytest.mark.parametrize("line, pattern", [
    ("Trainer's files beside ours (issue 26): trainer_state.json", "issue number"),
    ("Targets (issue 27): efficiency within 5 points", "issue number"),
    ("Around them (issue 29, 27, 26): manifest", "issue number"),
    ("Issue 29: checkpoints that prove themselves", "issue number"),
    ("emulated fabrics (issue 27 item 5): 1 and 2", "issue number"),
    ("see issues 12 and 14", "issue number"),
    ("fixed in #26, see (#31)", "hash number"),
    ("everything a lent CUDA machine should answer", "lent machine"),
    ("so the check cannot rot between GPU loans", "lent machine"),
    ("each fits in one 10-minute device command", "lent machine"),
    ("for half an hour, to a machine", "half an hour"),
    ("shared with other sessions' jobs", "session story"),
    ("Versions where a session's pip list gave them", "session story"),
    ("The first GPU run's raw outputs", "first GPU run"),
    ("2-core Intel Xeon shared with other jobs (load 10-16)", "host story"),
    ("the ~12.6 GB of the issue, before activations", "host story"),
    ("Recorded on 2026-11-25 (branch i27a)", "branch name"),
    ("cat /root/notes.txt", "machine path"),
    ("in /home/alice/project", "machine path"),
    ("The layering of ../shared/STYLE.md", "outside path"),
])
def test_each_pattern_finds_what_it_is_for(line, pattern):
    assert [p for p, _, _ in find_traces(line)] == [pattern], line


@pytest.mark.parametrize("line", [
    "the collectives DeepSpeed 0.19 issues for the stage",
    "LANS issues two such exchanges per step; DeepSpeed issues 2 all-reduces per step",
    'tokens += ["run", "##ning", "##98"]',
    "color: #1f77b4; #123456; &#123;; rank #0 of 2",
    "x = 1  # noqa: E501",
    "## 2. Install",
    "Run cmd in a session of its own; the ssh session of a remote launcher; same session; the session's leader",
    "os.killpg(p.pid, signal.SIGKILL)  # our own session: the node's launcher and its ranks",
    "https://example.org/work/page and /tmp/x, ~/home/, runs/home/",
    "TORCH_CUDA_ARCH_LIST='8.0;9.0'",
    "the silent, relentless talent",
    "a rendezvous port taken on this machine (another job, a leftover rank)",
    "the device's command queue; a device timer",
])
def test_ordinary_text_is_not_flagged(line):
    assert find_traces(line) == []
