"""A product lint: the repository's files speak of the product. Two things a reader cannot use are refused in any text
file: ticket numbers in prose ("fixed in issue 26", "see #31"), and absolute paths of one machine (a home directory,
or this checkout's own location), which exist nowhere else. A docstring, doc, study or test says what a thing is and
why instead, and names files relative to the repository root.

Scanned: every text file git lists for the repository (tracked, plus new files not ignored), or, without git, every
file under the repository root outside the folders in SKIP_DIRS. Binary files (a NUL byte, or not UTF-8) are skipped,
and so is this file, which holds the patterns and their examples. Each pattern is matched per line; PENDING names the
lines still allowed and why, and an entry whose count no longer matches fails too, so the list only shrinks.
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
    # a home directory, or where this checkout lies (its absolute path); not a URL's path, ~/... or runs/home/
    "machine path": (r"(?<![\w.~:/-])/(?:root|home/[a-z_][\w.-]*|Users/[\w.-]+)/"
                     + (f"|(?<![\\w.~:/-]){re.escape(str(REPO))}/" if REPO.parent != REPO else ""),
                     "a path that exists on one machine only"),
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
    ("cat /root/notes.txt", "machine path"),
    ("in /home/alice/project", "machine path"),
    (f"see {REPO}/docs/studies.md", "machine path"),
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
    "https://example.org/home/page and /tmp/x, ~/home/, runs/home/, $HOME/.deepspeed_env",
    "docs/studies.md and ds_configs/README.md (paths inside the repository)",
])
def test_ordinary_text_is_not_flagged(line):
    assert find_traces(line) == []
