"""Benchmark: our BERT h5 loader against a reference-style loader, on one generated shard, in one run.

Reference (the pattern of NVIDIA's run_pretraining.py `pretraining_dataset`): the whole file read into numpy,
`__getitem__` building one sample's tensors and its MLM labels, torch DataLoader with default collate,
num_workers=0, RandomSampler. Ours: `bert_ref.data.PretrainingData` (block read, vectorized gather and labels,
background prefetch). Both at micro batch 64. Then the resume seek time of ours at sample offset 1k and 150k.

Usage: python -m bench.h5_loader [--samples 204800] [--micro_batch 64] [--ref_samples 32768] [--keep DIR]
The last line printed is one JSON object (ratio = ours / reference samples/s; seek_ratio = seek@150k / seek@1k).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from bert_ref.data import IGNORE_INDEX, PretrainingData
from bert_ref.prep.h5io import synthetic_arrays, write_shard
from ds_core.cli import ArgumentParser, flag

KEYS = ["input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels"]


class ReferenceDataset(Dataset):
    """NVIDIA-style: whole file into numpy, per-sample tensors and labels."""

    def __init__(self, path: str, max_pred_length: int):
        with h5py.File(path, "r") as f:
            self.inputs = [np.asarray(f[k][:]) for k in KEYS]
        self.max_pred_length = max_pred_length

    def __len__(self) -> int:
        return len(self.inputs[0])

    def __getitem__(self, index: int):
        input_ids, input_mask, segment_ids, positions, ids, nsp = [
            torch.from_numpy(np.asarray(a[index].astype(np.int64))) for a in self.inputs]
        labels = torch.full(input_ids.shape, IGNORE_INDEX, dtype=torch.long)
        count = int(torch.count_nonzero(positions))
        index = count if count != 0 else self.max_pred_length
        labels[positions[:index]] = ids[:index]
        return [input_ids, segment_ids, input_mask, labels, nsp]


def bench_reference(path: str, preds: int, micro_batch: int, samples: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    ds = ReferenceDataset(path, preds)
    load_s = time.perf_counter() - t0
    loader = DataLoader(ds, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(0)),
                        batch_size=micro_batch, num_workers=0)
    n, t0 = 0, time.perf_counter()
    for batch in loader:
        n += batch[0].shape[0]
        if n >= samples:
            break
    return n / (time.perf_counter() - t0), load_s


def bench_ours(data_dir: str, micro_batch: int) -> tuple[float, float, int]:
    """(samples/s after the first batch, samples/s including the first read of the shard, samples). The reference's
    file load is not counted either; in training the next shard is read by the prefetch thread meanwhile."""
    data = PretrainingData(data_dir, 0, 1, micro_batch, seed=0)
    it = iter(data)
    t0 = time.perf_counter()
    n = next(it)["input_ids"].shape[0]
    t1 = time.perf_counter()
    for batch in it:
        n += batch["input_ids"].shape[0]
    t2 = time.perf_counter()
    data.close(wait=True)
    return (n - micro_batch) / (t2 - t1), n / (t2 - t0), n


def seek_times(data_dir: str, micro_batch: int, offsets: list[int], repeats: int = 3) -> list[float]:
    """Seconds from load_state_dict(position at each offset) to the first batch; the offsets are measured
    interleaved and the fastest of `repeats` is kept (the machine may be shared: the minimum is the least noisy)."""
    times: dict[int, list[float]] = {o: [] for o in offsets}
    for _ in range(repeats):
        for offset in offsets:
            data = PretrainingData(data_dir, 0, 1, micro_batch, seed=0, prefetch=True)
            state = {**data.state_dict(), "samples": offset, "batches": offset // micro_batch}
            t0 = time.perf_counter()
            data.load_state_dict(state)
            next(iter(data))
            times[offset].append(time.perf_counter() - t0)
            data.close(wait=True)
    return [min(times[o]) for o in offsets]


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--samples", type=int, default=204800)
    ap.add_argument(*flag("--seq_len"), type=int, default=128)
    ap.add_argument("--preds", type=int, default=20)
    ap.add_argument(*flag("--micro_batch"), type=int, default=64)
    ap.add_argument(*flag("--ref_samples"), type=int, default=32768, help="samples the (slow) reference iterates")
    ap.add_argument(*flag("--seek_offsets"), type=int, nargs=2, default=[1000, 150000])
    ap.add_argument(*flag("--no_compression"), action="store_true", help="write the shard without gzip")
    ap.add_argument("--keep", default=None, help="write the shard into this directory and keep it")
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)

    tmp = None
    if a.keep:
        out = Path(a.keep)
        out.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_h5_")
        out = Path(tmp.name)
    path = out / f"bench_training_seq{a.seq_len}_pred{a.preds}_{a.samples}.hdf5"
    if not path.exists():
        t0 = time.perf_counter()
        write_shard(path, synthetic_arrays(a.samples, a.seq_len, a.preds, seed=0),
                    compression=None if a.no_compression else "gzip")
        print(f"generated {a.samples} samples (seq {a.seq_len}, {a.preds} predictions) -> {path} "
              f"({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s")

    ref_rate, ref_load = bench_reference(str(path), a.preds, a.micro_batch, a.ref_samples)
    print(f"reference (whole file -> numpy, per-sample __getitem__, DataLoader default collate, num_workers=0): "
          f"{ref_rate:,.0f} samples/s over {a.ref_samples} samples (file load {ref_load:.2f}s not counted)")
    ours_rate, ours_cold, n = bench_ours(str(out), a.micro_batch)
    print(f"ours (bert_ref.data.PretrainingData, vectorized, prefetch): {ours_rate:,.0f} samples/s over a full "
          f"epoch of {n} samples after the first batch ({ours_cold:,.0f} samples/s counting the shard read)")
    ratio = ours_rate / ref_rate
    # both counting their one read of the shard, over one epoch
    ref_cold = a.samples / (ref_load + a.samples / ref_rate)
    print(f"ratio ours/reference: {ratio:.1f}x (counting each one's shard read over an epoch: "
          f"{ours_cold / ref_cold:.1f}x)")
    lo, hi = a.seek_offsets
    s_lo, s_hi = seek_times(str(out), a.micro_batch, [lo, hi])
    seek_ratio = s_hi / s_lo
    print(f"resume seek to sample {lo}: {s_lo:.3f}s, to sample {hi}: {s_hi:.3f}s, ratio {seek_ratio:.2f} "
          f"(replaying batches at the reference rate would take ~{hi / ref_rate:.1f}s to reach {hi})")
    result = {"ratio": round(ratio, 2), "seek_ratio": round(seek_ratio, 3),
              "ours_samples_per_s": round(ours_rate), "reference_samples_per_s": round(ref_rate),
              "ratio_incl_read": round(ours_cold / ref_cold, 2),
              f"seek_s_{lo}": round(s_lo, 4), f"seek_s_{hi}": round(s_hi, 4),
              f"reference_replay_s_{hi}": round(hi / ref_rate, 2), "samples": a.samples, "seq_len": a.seq_len,
              "max_predictions_per_seq": a.preds, "micro_batch": a.micro_batch,
              "compression": None if a.no_compression else "gzip"}
    if tmp:
        tmp.cleanup()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
