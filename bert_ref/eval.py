"""Held-out evaluation of BERT pretraining: the `*_test_*` shards of the input directory (`bert-prep shards
--num_test_shards K` writes them), each sample evaluated exactly once across the ranks.

Layout: the test files (sorted) are one sequence of N samples; rank r takes the contiguous range
[N*r//W, N*(r+1)//W) (`eval_ranges`, pure), in micro batches of B, the last one short. Every rank runs the same number
of forward passes, ceil(ceil(N/W) / B): under ZeRO-3 each forward gathers parameters collectively, so a rank that has
run out of samples runs a padding batch (one sample, weight 0) instead of leaving the others waiting.

Reported (two all-reduces at the end: the two loss sums, the four counts): MLM loss (mean cross entropy over all
masked tokens of the test set) and accuracy at the masked positions, NSP loss (mean over samples) and accuracy, and
the counts (samples, masked tokens) so a reader can check that every sample was seen once.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F

from bert_ref.configs import BertPreset, check_data_matches
from bert_ref.data import DEFAULT_BLOCK_SAMPLES, IGNORE_INDEX, Segment, load_block, make_batch
from bert_ref.shards import inspect_shards, list_test_shards
from bert_ref.step import forward
from ds_core.device import hpu
from ds_core.errors import ConfigError
from ds_core.run.evaluation import EvalFn, EvalTask, Evaluation
from ds_core.run.setup import Run
from ds_core.run.step import step_marker, to_device


def eval_ranges(sizes: list[int], rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """(file index, start, stop) sample ranges of `rank`'s share of files of `sizes` samples: the contiguous global
    range [N*rank//W, N*(rank+1)//W) of their concatenation. The shares partition the N samples."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
    n = sum(sizes)
    lo, hi = n * rank // world_size, n * (rank + 1) // world_size
    out, offset = [], 0
    for i, size in enumerate(sizes):
        s, e = max(lo, offset), min(hi, offset + size)
        if e > s:
            out.append((i, s - offset, e - offset))
        offset += size
    return out


class EvalData:
    """This rank's share of the test files as (batch, valid rows) pairs; see the module docstring."""

    def __init__(self, files: list[str], rank: int, world_size: int, micro_batch: int,
                 vocab_size: int | None = None, block_samples: int = DEFAULT_BLOCK_SAMPLES):
        if not files:
            raise ValueError("EvalData needs at least one test shard")
        infos = inspect_shards(files, vocab_size)
        first = infos[0]
        self.files, self.micro_batch, self.block_samples = list(files), micro_batch, block_samples
        self.seq_len, self.max_predictions_per_seq = first.seq_len, first.max_predictions_per_seq
        stored = [i.vocab_size for i in infos if i.vocab_size is not None]
        self.vocab_size = max(stored) if stored else None
        self.bounds = [i.vocab_size if i.vocab_size is not None else vocab_size for i in infos]
        sizes = [i.num_samples for i in infos]
        self.num_samples = sum(sizes)
        self.ranges = eval_ranges(sizes, rank, world_size)
        most = -(-self.num_samples // world_size)  # the largest share
        self.num_batches = max(1, -(-most // micro_batch))

    def _blocks(self) -> Iterator[dict[str, np.ndarray]]:
        for i, start, stop in self.ranges:
            for s in range(start, stop, self.block_samples):
                seg = Segment(self.files[i], s, min(stop, s + self.block_samples))
                yield load_block(seg, self.seq_len, self.bounds[i])

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """ceil(share / B) batches in file order (a batch may join two blocks or files), then padding batches."""
        B, done, pending, held = self.micro_batch, 0, [], 0
        for arrays in self._blocks():
            n, s = len(arrays["input_ids"]), 0
            while s < n:  # batches built B rows at a time: a whole block as int64 tensors would be ~1 GB
                take = min(B - held, n - s)
                pending.append(make_batch(arrays, np.arange(s, s + take)))
                held, s = held + take, s + take
                if held == B:
                    batch, held = _take(pending, B), 0
                    done += 1
                    yield batch, B
        if held:
            done += 1
            yield _take(pending, held), held
        if done < self.num_batches:  # this rank's share is used up: padding forwards, weight 0
            pad = make_batch(load_block(Segment(self.files[0], 0, 1), self.seq_len, self.bounds[0]), np.arange(1))
            for _ in range(self.num_batches - done):
                yield pad, 0


def _take(pending: list[dict[str, torch.Tensor]], n: int) -> dict[str, torch.Tensor]:
    """The pending parts (n rows in all) as one batch."""
    merged = pending[0] if len(pending) == 1 else {k: torch.cat([p[k] for p in pending]) for k in pending[0]}
    pending.clear()
    assert len(merged["input_ids"]) == n
    return merged


def evaluate(engine: Any, data: EvalData, sparse_predictions: int = 0) -> dict:
    """MLM / NSP loss and accuracy over every test sample (collective: every rank calls it). The loss sums are
    float64, the counts int64; on an HPU float32 and int32 (ds_core.device.hpu: no float64 there, and HCCL reduces
    float32 and int32), so the counts stay exact everywhere."""
    dev = engine.device
    losses = torch.zeros(2, dtype=hpu.sum_dtype(dev.type), device=dev)  # MLM, NSP cross-entropy sums
    counts = torch.zeros(4, dtype=hpu.count_dtype(dev.type), device=dev)  # MLM right, masked tokens, NSP right, samples
    samples = 0
    mark_step = step_marker(dev)  # Gaudi's lazy mode: one graph per batch, as GaudiTrainer's evaluation loop
    engine.eval()
    with torch.no_grad():
        for batch, n in data:
            out, labels = forward(engine, batch, sparse_predictions)
            labels = labels[:n]
            masked = labels != IGNORE_INDEX
            logits = out.prediction_logits[:n][masked].float()  # [masked tokens, V]: only those in fp32
            target = labels[masked]
            nsp_logits = out.seq_relationship_logits[:n].float()
            nsp_target = to_device(batch["next_sentence_label"][:n], dev)
            losses += torch.stack([F.cross_entropy(logits, target, reduction="sum"),
                                   F.cross_entropy(nsp_logits, nsp_target, reduction="sum")]).to(losses.dtype)
            counts[:3] += torch.stack([(logits.argmax(-1) == target).sum(), masked.sum(),
                                       (nsp_logits.argmax(-1) == nsp_target).sum()]).to(counts.dtype)
            samples += n
            if mark_step is not None:
                mark_step()
    counts[3:] += to_device(torch.tensor([samples], dtype=counts.dtype), dev)
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(losses)
        tdist.all_reduce(counts)
    mlm_loss, nsp_loss = losses.tolist()
    mlm_right, tokens, nsp_right, samples = counts.tolist()
    return {"mlm_loss": mlm_loss / max(tokens, 1), "mlm_accuracy": mlm_right / max(tokens, 1),
            "nsp_loss": nsp_loss / max(samples, 1), "nsp_accuracy": nsp_right / max(samples, 1),
            "samples": int(samples), "mlm_tokens": int(tokens)}


def held_out_evaluation(run: Run, input_dir: str, preset: BertPreset, sparse_predictions: int = 0) -> Evaluation:
    """The Trainer's evaluation of a BERT run: the held-out *_test_* shards of input_dir, every --eval_every steps and
    at the end (none without test shards; --eval_every without them is refused)."""

    train, dist = run.train, run.dist
    tests = list_test_shards(input_dir)
    if train.eval_every and not tests:
        raise ConfigError(f"--eval_every {train.eval_every}: {input_dir} has no held-out *_test_* shards "
                          "(bert-prep shards --num_test_shards K writes them)")
    if not tests:
        return Evaluation()
    data = EvalData(tests, dist.rank, dist.world_size, run.batch.micro,
                    vocab_size=preset.vocab_size)
    check_data_matches(preset, data, input_dir)
    return Evaluation(during=EvalTask("eval", make_eval_fn(data, sparse_predictions)), every=train.eval_every)


def make_eval_fn(data: EvalData, sparse_predictions: int = 0) -> EvalFn:
    """The evaluation task's function: eval_fn(engine, step) -> the record's values."""

    def eval_fn(engine: Any, step: int) -> dict:
        return evaluate(engine, data, sparse_predictions)

    return eval_fn

