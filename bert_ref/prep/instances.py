"""Stage `shards`: text shards -> h5 pretraining shards, by the recipe of BERT's create_pretraining_data.py.

Per document: sentences are packed into chunks up to a target length (max_seq_length - 3, or with probability
short_seq_prob a random shorter one), split into A and B; half the time B is replaced by text from a random other
document (next_sentence_labels = 1, as in NVIDIA's files; 0 when the draw fell on the same document, as NVIDIA's
create_pretraining_data.py sets it), the unused sentences are put back. The pair is truncated
from a random end, and masked: masked_lm_prob of the tokens (at most max_predictions_per_seq, at least one), never
[CLS]/[SEP]; 80% become [MASK], 10% stay, 10% become a random non-special token. Everything is repeated dupe_factor
times with different masks, and the instances of a shard are shuffled.

One process per text shard (`--workers`); each shard's random stream is seeded by (seed, shard index), so the output
does not depend on the number of workers. Memory per worker is one text shard and its instances.

With nvidia_compat (`--nvidia_compat`) the arrays are those NVIDIA's create_pretraining_data.py writes for the same
shard, vocab, seed and settings: its seeding, document shuffle, masking draws, replacement vocabulary and
tokenization (bert_ref.prep.nvidia says what differs and why).
"""
from __future__ import annotations

import os
import random
import time
from array import array
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bert_ref import log
from bert_ref.prep.h5io import write_shard
from bert_ref.prep.text import PrepError, encode_docs, list_text_shards, read_text_shard
from bert_ref.prep.vocab import SPECIAL_TOKENS, read_vocab


@dataclass
class ShardParams:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    seed: int = 12345
    whole_word_mask: bool = False
    lowercase: bool = True
    compression: str = "gzip"
    nvidia_compat: bool = False

    def validate(self) -> None:
        if self.max_seq_length < 8:
            raise PrepError(f"--max_seq_length {self.max_seq_length} too small (>= 8)")
        if not 1 <= self.max_predictions_per_seq < self.max_seq_length:
            raise PrepError(f"--max_predictions_per_seq {self.max_predictions_per_seq} not in [1, max_seq_length)")
        if not 0 < self.masked_lm_prob < 1 or not 0 <= self.short_seq_prob <= 1:
            raise PrepError(f"--masked_lm_prob {self.masked_lm_prob} / --short_seq_prob {self.short_seq_prob} "
                            "must be probabilities")
        if self.dupe_factor < 1:
            raise PrepError(f"--dupe_factor must be >= 1, got {self.dupe_factor}")
        if self.nvidia_compat and self.whole_word_mask:
            raise PrepError("--nvidia_compat with --whole_word_mask: NVIDIA's create_pretraining_data.py (7a4c4250) "
                            "has no whole-word masking; drop one of them")
        if self.nvidia_compat and not self.lowercase:
            raise PrepError("--nvidia_compat with a cased vocab / --cased: NVIDIA's create_pretraining_data.py always "
                            "lower-cases (its --do_lower_case defaults to True and cannot be turned off); use "
                            "--uncased or drop --nvidia_compat")


def output_name(prefix: str, split: str, p: ShardParams, index: int) -> str:
    """File names say training/test and carry the parameters, e.g.
    bert_training_seq128_pred20_mlm0.15_dupe5_seed12345_uncased_00003.hdf5"""
    case = "uncased" if p.lowercase else "cased"
    wwm = "_wwm" if p.whole_word_mask else ""
    nv = "_nvidia" if p.nvidia_compat else ""
    return (f"{prefix}_{split}_seq{p.max_seq_length}_pred{p.max_predictions_per_seq}_mlm{p.masked_lm_prob:g}"
            f"_dupe{p.dupe_factor}_seed{p.seed}_{case}{wwm}{nv}_{index:05d}.hdf5")


# ---------------------------------------------------------------------------------------------- the recipe
class Vocab:
    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.cls, self.sep, self.mask = self.ids["[CLS]"], self.ids["[SEP]"], self.ids["[MASK]"]
        # random replacements come from real tokens only: never a special or [unused] token
        self.replace_ids = [i for i, t in enumerate(tokens)
                            if not (t in SPECIAL_TOKENS or (t.startswith("[") and t.endswith("]")))]
        self.is_continuation = np.array([t.startswith("##") for t in tokens])


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    while len(a) + len(b) > max_tokens:
        trunc = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del trunc[0]
        else:
            trunc.pop()


def _mask(tokens: list[int], p: ShardParams, vocab: Vocab, rng: random.Random) -> tuple[list[int], list[int]]:
    """Mask in place; returns (sorted positions, original ids)."""
    cand: list[list[int]] = []
    for i, t in enumerate(tokens):
        if t == vocab.cls or t == vocab.sep:
            continue
        if p.whole_word_mask and cand and vocab.is_continuation[t]:
            cand[-1].append(i)
        else:
            cand.append([i])
    rng.shuffle(cand)
    num_to_predict = min(p.max_predictions_per_seq, max(1, int(round(len(tokens) * p.masked_lm_prob))))
    picked: list[tuple[int, int]] = []
    for word in cand:
        if len(picked) >= num_to_predict:
            break
        if len(picked) + len(word) > num_to_predict:
            continue
        for i in word:
            original = tokens[i]
            r = rng.random()
            if r < 0.8:
                tokens[i] = vocab.mask
            elif r >= 0.9:
                tokens[i] = vocab.replace_ids[rng.randint(0, len(vocab.replace_ids) - 1)]
            picked.append((i, original))
    picked.sort()
    return [i for i, _ in picked], [t for _, t in picked]


def instances_from_document(docs: list[list[array]], d: int, p: ShardParams, vocab: Vocab,
                            rng: random.Random, out: list, mask=_mask) -> None:
    """Append (tokens, len_a, positions, ids, is_random_next) for document `d` (BERT's original algorithm); `mask`:
    _mask, or bert_ref.prep.nvidia.mask_nvidia in the compat mode."""
    document = docs[d]  # sentences of int32 token ids
    max_tokens = p.max_seq_length - 3
    target = max_tokens if rng.random() >= p.short_seq_prob else rng.randint(2, max_tokens)
    chunk: list[list[int]] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                a = [t for s in chunk[:a_end] for t in s]
                b: list[int] = []
                random_next = len(chunk) == 1 or rng.random() < 0.5
                if random_next:
                    target_b = target - len(a)
                    for _ in range(10):
                        r = rng.randint(0, len(docs) - 1)
                        if r != d:
                            break
                    if r == d:  # only one document to draw from: NVIDIA's create_pretraining_data.py labels this pair
                        # 'is next' (is_random_next = False), though B still starts at a random sentence
                        random_next = False
                    other = docs[r]
                    for j in range(rng.randint(0, len(other) - 1), len(other)):
                        b.extend(other[j])
                        if len(b) >= target_b:
                            break
                    i -= len(chunk) - a_end  # put the unused sentences back
                else:
                    b = [t for s in chunk[a_end:] for t in s]
                _truncate_pair(a, b, max_tokens, rng)
                if a and b:
                    tokens = [vocab.cls, *a, vocab.sep, *b, vocab.sep]
                    positions, ids = mask(tokens, p, vocab, rng)
                    out.append((array("i", tokens), len(a), array("i", positions), array("i", ids), random_next))
            chunk, length = [], 0
        i += 1


def to_arrays(instances: list, p: ShardParams) -> dict[str, np.ndarray]:
    n, L, P = len(instances), p.max_seq_length, p.max_predictions_per_seq
    a = {"input_ids": np.zeros((n, L), np.int32), "input_mask": np.zeros((n, L), np.int8),
         "segment_ids": np.zeros((n, L), np.int8), "masked_lm_positions": np.zeros((n, P), np.int32),
         "masked_lm_ids": np.zeros((n, P), np.int32), "next_sentence_labels": np.zeros(n, np.int8)}
    for k, (tokens, len_a, positions, ids, random_next) in enumerate(instances):
        a["input_ids"][k, :len(tokens)] = tokens
        a["input_mask"][k, :len(tokens)] = 1
        a["segment_ids"][k, len_a + 2:len(tokens)] = 1
        a["masked_lm_positions"][k, :len(positions)] = positions
        a["masked_lm_ids"][k, :len(ids)] = ids
        a["next_sentence_labels"][k] = random_next
    return a


_TOKENIZER = None


def _tokenize_docs(docs: list[list[str]], vocab_file: str, lowercase: bool,
                   batch_sentences: int = 8192) -> list[list[array]]:
    """Sentences -> WordPiece ids (bert_ref.prep.text.encode_docs: int32 arrays, in batches, empty ones dropped)."""
    global _TOKENIZER
    if _TOKENIZER is None or _TOKENIZER[0] != (vocab_file, lowercase):
        from tokenizers import BertWordPieceTokenizer

        _TOKENIZER = ((vocab_file, lowercase), BertWordPieceTokenizer(vocab_file, lowercase=lowercase,
                                                                      strip_accents=None, clean_text=True))
    tok = _TOKENIZER[1]
    return encode_docs(docs, lambda lines: [e.ids for e in tok.encode_batch(lines, add_special_tokens=False)],
                       batch_sentences)


def make_shard(text_path: str, out_path: str, index: int, vocab_file: str, p: ShardParams) -> tuple[str, int]:
    """One text shard -> one h5 file (written atomically). Returns (output path, samples)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vocab = Vocab(read_vocab(vocab_file))
    mask = _mask
    if p.nvidia_compat:
        from bert_ref.prep import nvidia

        docs = nvidia.tokenize_docs(read_text_shard(text_path), vocab.tokens)
        rng = nvidia.shard_rng(p.seed, docs)  # NVIDIA: the same seed for every shard, then a document shuffle
        mask = nvidia.mask_nvidia
    else:
        docs = _tokenize_docs(read_text_shard(text_path), vocab_file, p.lowercase)
        rng = random.Random(p.seed * 1_000_003 + index)
    if not docs:
        raise PrepError(f"{text_path}: no documents with tokens")
    instances: list = []
    for _ in range(p.dupe_factor):
        for d in range(len(docs)):
            instances_from_document(docs, d, p, vocab, rng, instances, mask)
    rng.shuffle(instances)
    if not instances:
        raise PrepError(f"{text_path}: produced no instances (documents too short?)")
    write_shard(out_path, to_arrays(instances, p), compression=p.compression or None,
                vocab_size=len(vocab.tokens))
    return out_path, len(instances)


def _job(args):
    return make_shard(*args)


def run_shards(text_dir: str | os.PathLike, vocab_file: str | os.PathLike, output: str | os.PathLike,
               p: ShardParams, *, workers: int = 1, num_test_shards: int = 0, prefix: str = "bert",
               progress: bool = True) -> list[Path]:
    """All text shards -> h5 files in `output`; existing outputs are complete (atomic writes) and skipped."""
    p.validate()
    texts = list_text_shards(text_dir)
    read_vocab(vocab_file)  # fail early, in the parent, on a bad vocab
    if not 0 <= num_test_shards < len(texts):
        raise PrepError(f"--num_test_shards {num_test_shards} must leave at least one of {len(texts)} "
                        "text shards for training")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    jobs, outputs = [], []
    for i, t in enumerate(texts):
        split = "test" if i >= len(texts) - num_test_shards else "training"
        target = out / output_name(prefix, split, p, i)
        outputs.append(target)
        if target.exists():
            continue
        jobs.append((str(t), str(target), i, str(vocab_file), p))
    skipped = len(texts) - len(jobs)
    if skipped:
        log.say(f"shards: {skipped} of {len(texts)} outputs already done, skipping them")
    t0, total = time.time(), 0
    bar = tqdm(total=len(jobs), desc="[shards] files", unit="file", disable=not progress)
    if workers > 1 and len(jobs) > 1:
        with get_context("fork").Pool(min(workers, len(jobs))) as pool:
            for _, n in pool.imap_unordered(_job, jobs):
                total += n
                bar.update(1)
    else:
        for job in jobs:
            total += _job(job)[1]
            bar.update(1)
    bar.close()
    log.say(f"shards: wrote {len(jobs)} files, {total} samples in {time.time() - t0:.1f}s -> {out} ({asdict(p)})")
    return outputs
