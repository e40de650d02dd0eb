"""Checkpoints that prove themselves: a manifest of every file's size and checksum, written before COMPLETE and
verified on resume by every rank for its own files before anything is loaded.

Why: COMPLETE says every rank finished writing, not that the bytes are still the ones written. A flipped byte in a
ZeRO partition or a rank's RNG state loads without an error and silently changes the run; a truncated file fails deep
inside torch's zip reader without a path. The manifest names the file, the expected and the found size/checksum.

Checksum: xxHash's XXH3-64 (the `xxhash` package, already required by `datasets`). It is a non-cryptographic hash
meant for exactly this (detecting corruption, not tampering) and runs at several GB/s per core: measured 4.7 GB/s
on this project's 2-core Xeon against 0.96 GB/s for hashlib's sha256 and 1.4 GB/s for zlib.crc32, so hashing a 1 GB
checkpoint costs ~0.2 s of CPU on top of reading it back (from the page cache right after the save).

Who hashes what: a file's owner is the rank in its name (DeepSpeed's `zero_pp_rank_{r}_...`, our `client_rank{r}.pt`,
`mp_rank_00_model_states.pt` is rank 0's); files without a rank are rank 0's. On save each rank hashes the files it
owns in parallel and writes a part; rank 0 merges the parts into MANIFEST.json before COMPLETE. On resume rank r
checks the files whose owner is congruent to r modulo the resuming world size (so a resume on fewer ranks still checks
every file), and every rank learns, through one all-reduce, whether any rank found a problem.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import xxhash

from ds_core.files import atomic_write_text

MANIFEST = "MANIFEST.json"
PART = ".manifest_rank{}.json"
_OWNER = (re.compile(r"zero_pp_rank_(\d+)_"), re.compile(r"^client_rank(\d+)\.pt$"), re.compile(r"^mp_rank_(\d+)_"))
# not part of a checkpoint: the markers, and hidden or temporary files (another rank's part being written atomically
# is a hidden `..manifest_rank{r}.json.tmp.<pid>` while this rank lists the directory)
_SKIP = re.compile(r"^(COMPLETE|MANIFEST\.json)$|^\.|\.tmp(\.\d+)?$")
_CHUNK = 16 * 2**20


def owner(name: str) -> int:
    """The rank that wrote (and hashes) a checkpoint file; 0 for files that name no rank."""
    for pattern in _OWNER:
        m = pattern.search(name)
        if m:
            return int(m.group(1))
    return 0


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, XXH3-64 hex digest) of a file, read in 16 MiB chunks."""
    h = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            h.update(chunk)
    return size, h.hexdigest()


def _entries(tag_dir: Path, keep) -> dict:
    out = {}
    for p in sorted(tag_dir.rglob("*")):
        rel = p.relative_to(tag_dir).as_posix()
        if p.is_file() and not _SKIP.match(p.name) and keep(rel):
            size, digest = file_digest(p)
            out[rel] = {"size": size, "xxh3_64": digest}
    return out


def write_part(tag_dir: Path, rank: int) -> None:
    """Every rank, after its files are written: hash the files this rank owns into a part file."""
    part = _entries(tag_dir, lambda rel: owner(Path(rel).name) == rank)
    atomic_write_text(tag_dir / PART.format(rank), json.dumps(part) + "\n")


def merge_parts(tag_dir: Path, world_size: int) -> dict:
    """Rank 0, after every rank wrote its part (the save's verdict collective) and its own late files (hf_model.json):
    one MANIFEST.json with every file, written atomically; the parts are removed. Returns the manifest."""
    files: dict = {}
    for r in range(world_size):
        files.update(json.loads((tag_dir / PART.format(r)).read_text()))
    # Files rank 0 wrote after its part (hf_model.json) and any file without an owner among the saving ranks.
    files.update(_entries(tag_dir, lambda rel: rel not in files))
    manifest = {"hash": "xxh3_64", "files": files}
    atomic_write_text(tag_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for r in range(world_size):
        (tag_dir / PART.format(r)).unlink(missing_ok=True)
    return manifest


def verify(tag_dir: Path, rank: int, world_size: int) -> list[str] | None:
    """Problems with the files this rank checks (empty: all good). None: the checkpoint predates manifests (its
    COMPLETE marker does not promise one), so there is nothing to check against."""
    complete = tag_dir / "COMPLETE"
    try:
        promised = bool(json.loads(complete.read_text()).get("manifest"))
    except (OSError, ValueError, AttributeError):
        return [f"{complete}: unreadable COMPLETE marker"]
    path = tag_dir / MANIFEST
    if not path.is_file():
        return [f"{path}: missing (COMPLETE promises a manifest)"] if promised else None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path}: unreadable manifest ({type(e).__name__}: {e})"]
    problems = []
    for rel, want in sorted(files.items()):
        if owner(Path(rel).name) % world_size != rank:
            continue
        f = tag_dir / rel
        if not f.is_file():
            problems.append(f"{f}: missing (manifest: {want['size']:,} bytes)")
            continue
        size = f.stat().st_size
        if size != want["size"]:
            problems.append(f"{f}: {size:,} bytes, manifest {want['size']:,} (truncated or rewritten)")
            continue
        _, digest = file_digest(f)
        if digest != want["xxh3_64"]:
            problems.append(f"{f}: xxh3_64 checksum {digest}, manifest {want['xxh3_64']} (same size: the bytes "
                            f"changed after the save)")
    return problems


def quarantine(tag_dir: Path) -> Path:
    """Rank 0: move a checkpoint that failed verification aside (renamed, never deleted: it is the user's data), so
    neither `latest`, a resume nor a later save of the same step takes it. Returns the new path."""
    dest = tag_dir.with_name(tag_dir.name + ".corrupt")
    n = 1
    while dest.exists():
        n += 1
        dest = tag_dir.with_name(f"{tag_dir.name}.corrupt{n}")
    os.replace(tag_dir, dest)
    return dest
