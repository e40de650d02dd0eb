"""Stage `check DIR`: validate every h5 shard completely and print a summary.

Per file: the layout checks of the loader (datasets, dtypes, shapes, lengths), then all rows in chunks (memory stays
at one chunk): ids, masks and labels in range, masked positions inside the real tokens, increasing, then 0-padding,
[CLS] first. Summary: files, samples, sequence length, predictions, masked fraction of real tokens, NSP balance.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bert_ref import log
from bert_ref.shards import H5_SUFFIXES, ShardError, check_arrays, inspect_shard

CHUNK = 1 << 15


@dataclass
class Summary:
    files: int = 0
    samples: int = 0
    seq_len: set = field(default_factory=set)
    max_predictions_per_seq: set = field(default_factory=set)
    real_tokens: int = 0
    masked: int = 0
    random_next: int = 0
    errors: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"files": self.files, "samples": self.samples,
                "seq_len": sorted(self.seq_len), "max_predictions_per_seq": sorted(self.max_predictions_per_seq),
                "masked_fraction": round(self.masked / max(1, self.real_tokens), 4),
                "nsp_random_fraction": round(self.random_next / max(1, self.samples), 4),
                "errors": len(self.errors)}


def check_file(path: str, vocab_size: int | None, s: Summary) -> None:
    import h5py

    info = inspect_shard(path, vocab_size=vocab_size)
    vocab_size = vocab_size if info.vocab_size is None else info.vocab_size  # the file's own vocabulary first
    L = info.seq_len
    with h5py.File(path, "r") as f:
        for lo in range(0, info.num_samples, CHUNK):
            hi = min(info.num_samples, lo + CHUNK)
            a = {}
            for name in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
                         "next_sentence_labels"):
                try:
                    a[name] = f[name][lo:hi]
                except Exception as e:
                    raise ShardError(path, name, f"cannot read samples {lo}:{hi} ({type(e).__name__}: {e})") from e
            check_arrays(path, a, L, first_row=lo, vocab_size=vocab_size)
            ids, mask, pos = a["input_ids"], a["input_mask"].astype(bool), a["masked_lm_positions"]
            lengths = mask.sum(1)

            def fail(name: str, bad: np.ndarray, what: str) -> None:
                rows = np.nonzero(bad)[0]
                if len(rows):
                    raise ShardError(path, name, f"{what} (first at sample {lo + int(rows[0])})")

            fail("input_mask", (mask[:, 1:] & ~mask[:, :-1]).any(1), "padding before real tokens")
            fail("input_mask", lengths < 3, "fewer than 3 real tokens ([CLS] a [SEP] ...)")
            fail("input_ids", ids[:, 0] != ids[0, 0], "samples do not all start with the same [CLS] id")
            fail("input_ids", (np.where(mask, 0, ids) != 0).any(1), "non-zero ids in the padding")
            if vocab_size is not None:
                fail("input_ids", (ids >= vocab_size).any(1), f"ids >= vocab size {vocab_size}")
                fail("masked_lm_ids", (a["masked_lm_ids"] >= vocab_size).any(1), f"ids >= vocab size {vocab_size}")
            used = pos > 0
            n_used = used.sum(1)
            fail("masked_lm_positions", n_used == 0, "no masked position")
            fail("masked_lm_positions", (used[:, 1:] & ~used[:, :-1]).any(1), "padding (0) before a position")
            inc = np.diff(pos, axis=1) > 0
            fail("masked_lm_positions", (used[:, 1:] & ~inc).any(1), "positions not strictly increasing")
            fail("masked_lm_positions", (pos >= lengths[:, None]).any(1), "position in the padding")
            fail("masked_lm_ids", (np.where(used, 0, a["masked_lm_ids"]) != 0).any(1),
                 "non-zero ids where masked_lm_positions is padding")
            s.samples += hi - lo
            s.real_tokens += int(lengths.sum())
            s.masked += int(n_used.sum())
            s.random_next += int(a["next_sentence_labels"].sum())
    s.seq_len.add(L)
    s.max_predictions_per_seq.add(info.max_predictions_per_seq)


def run_check(directory: str | os.PathLike, vocab_file: str | os.PathLike | None = None,
              progress: bool = True) -> Summary:
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"check: directory not found: {d}")
    files = sorted(str(p) for p in d.iterdir() if p.suffix in H5_SUFFIXES and ".tmp" not in p.name)
    s = Summary()
    if not files:
        s.errors.append(f"{d}: no h5 shards (*.hdf5, *.h5)")
    vocab_size = None
    if vocab_file:
        from bert_ref.prep.vocab import read_vocab

        vocab_size = len(read_vocab(vocab_file))
    for path in tqdm(files, desc="[check] files", unit="file", disable=not progress):
        try:
            check_file(path, vocab_size, s)
            s.files += 1
        except ShardError as e:
            s.errors.append(str(e))
    if len(s.seq_len) > 1:
        s.errors.append(f"{d}: files have different sequence lengths {sorted(s.seq_len)}")
    return s


def print_summary(directory: str | os.PathLike, s: Summary) -> None:
    d = s.as_dict()
    log.say(f"check: {directory}: {d['files']} good files, {d['samples']} samples, seq_len {d['seq_len']}, "
            f"max_predictions_per_seq {d['max_predictions_per_seq']}, masked fraction {d['masked_fraction']:.4f}, "
            f"NSP random-next fraction {d['nsp_random_fraction']:.4f}, {d['errors']} errors")
    for e in s.errors:
        log.say(f"check: ERROR {e}")
    print(json.dumps(d))  # the command's result: one JSON line, last
