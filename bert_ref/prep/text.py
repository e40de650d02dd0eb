"""Stage `text`: raw documents -> N text shards balanced by size, one sentence per line, a blank line between documents
(the input format of BERT's create_pretraining_data.py).

Inputs: a directory of plain-text files (documents separated by blank lines, or one per line), the output of
wikiextractor (`<doc ...>` ... `</doc>`), or a Hugging Face dataset saved with `save_to_disk`. Documents are streamed,
segmented into sentences with pysbd (rule based, nothing downloaded) in a process pool, and each goes to the currently
lightest shard. Memory is bounded by one batch of documents, whatever the corpus size.
"""
from __future__ import annotations

import heapq
import json
import os
import random
import re
from array import array
from collections import deque
from dataclasses import asdict, dataclass
from itertools import islice
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from tqdm import tqdm

from bert_ref import log
from bert_ref.prep.h5io import atomic_replace, tmp_name

FORMATS = ("auto", "plain", "wikiextractor", "hf")
MANIFEST = "text_manifest.json"
_WS = re.compile(r"\s+")


@dataclass
class TextParams:
    input: str
    format: str = "auto"
    num_shards: int = 4
    seed: int = 12345
    one_doc_per_line: bool = False
    text_column: str = "text"
    hf_split: str = "train"
    segmenter: str = "pysbd"  # "pysbd" or "lines" (input lines already are sentences)
    language: str = "en"
    min_sentences: int = 1


class PrepError(ValueError):
    """Bad prep input; the message names the path or option."""


# --------------------------------------------------------------------------------------------------- readers
def detect_format(path: Path) -> str:
    if path.is_dir() and any((path / n).exists() for n in ("dataset_info.json", "dataset_dict.json", "state.json")):
        return "hf"
    for f in _text_files(path)[:5]:
        with open(f, encoding="utf-8", errors="replace") as fh:
            head = fh.read(4096).lstrip()
        if head.startswith("<doc "):
            return "wikiextractor"
    return "plain"


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                  and ".tmp" not in p.name and p.name != MANIFEST)


def _ordered_files(path: Path, seed: int) -> list[Path]:
    """Input files in a seed-shuffled order: shard contents depend on the seed, and on nothing else."""
    files = _text_files(path)
    if not files:
        raise PrepError(f"no input text files under {path}")
    random.Random(seed).shuffle(files)
    return files


def read_plain(path: Path, seed: int, one_doc_per_line: bool) -> Iterator[list[str]]:
    """Documents as lists of paragraphs (lines). Blank lines separate documents unless one_doc_per_line."""
    for f in _ordered_files(path, seed):
        with open(f, encoding="utf-8", errors="replace") as fh:
            doc: list[str] = []
            for line in fh:
                line = line.strip()
                if one_doc_per_line:
                    if line:
                        yield [line]
                elif line:
                    doc.append(line)
                elif doc:
                    yield doc
                    doc = []
            if doc:
                yield doc


def read_wikiextractor(path: Path, seed: int) -> Iterator[list[str]]:
    """wikiextractor output (AA/wiki_00 ...): paragraphs between <doc ...> and </doc>; the title line is dropped."""
    for f in _ordered_files(path, seed):
        with open(f, encoding="utf-8", errors="replace") as fh:
            doc: list[str] | None = None
            title_pending = False
            for line in fh:
                line = line.strip()
                if line.startswith("<doc "):
                    doc, title_pending = [], True
                elif line == "</doc>":
                    if doc:
                        yield doc
                    doc = None
                elif doc is not None and line:
                    if title_pending:  # wikiextractor repeats the title as the first line
                        title_pending = False
                        continue
                    doc.append(line)


def read_hf(path: Path, text_column: str, split: str) -> Iterator[list[str]]:
    """A dataset saved with `save_to_disk` (memory-mapped Arrow: rows are read in batches, never all at once)."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise PrepError(f"{path}: split '{split}' not in dataset (has {list(ds)}); use --hf_split")
        ds = ds[split]
    if text_column not in ds.column_names:
        raise PrepError(f"{path}: text column '{text_column}' not in dataset (columns {ds.column_names}); "
                        "use --text_column")
    for batch in ds.select_columns([text_column]).iter(batch_size=256):
        for text in batch[text_column]:
            if text:
                paras = [p.strip() for p in str(text).split("\n") if p.strip()]
                if paras:
                    yield paras


def read_documents(p: TextParams) -> Iterator[list[str]]:
    path = Path(p.input)
    if not path.exists():
        raise PrepError(f"input not found: {path}")
    fmt = detect_format(path) if p.format == "auto" else p.format
    if fmt == "plain":
        return read_plain(path, p.seed, p.one_doc_per_line)
    if fmt == "wikiextractor":
        return read_wikiextractor(path, p.seed)
    if fmt == "hf":
        return read_hf(path, p.text_column, p.hf_split)
    raise PrepError(f"unknown --format {fmt!r} (choose from {FORMATS})")


# ------------------------------------------------------------------------------------------------ segmentation
_SEGMENTER = None


def _segment_docs(args: tuple[list[list[str]], str, str]) -> list[list[str]]:
    """Worker: paragraphs -> sentences (whitespace collapsed, empties dropped)."""
    global _SEGMENTER
    docs, mode, language = args
    if mode == "pysbd" and _SEGMENTER is None:
        import pysbd

        _SEGMENTER = pysbd.Segmenter(language=language, clean=False)
    out = []
    for paras in docs:
        sents: list[str] = []
        for para in paras:
            pieces = _SEGMENTER.segment(para) if mode == "pysbd" else [para]
            sents.extend(s for s in (_WS.sub(" ", x).strip() for x in pieces) if s)
        out.append(sents)
    return out


def _chunks(it: Iterable, n: int) -> Iterator[list]:
    it = iter(it)
    while chunk := list(islice(it, n)):
        yield chunk


def shard_names(num_shards: int) -> list[str]:
    return [f"text_shard_{i:05d}.txt" for i in range(num_shards)]


def run_text(p: TextParams, output: str | os.PathLike, workers: int = 1, docs_per_task: int = 64,
             progress: bool = True) -> Path:
    """Write `num_shards` balanced text shards into `output` (atomically) and a manifest; skip if already done."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    if p.num_shards < 1:
        raise PrepError(f"--num_shards must be >= 1, got {p.num_shards}")
    if p.segmenter not in ("pysbd", "lines"):
        raise PrepError(f"--segmenter must be 'pysbd' or 'lines', got {p.segmenter!r}")
    names = shard_names(p.num_shards)
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text())
        if m.get("params") == asdict(p) and all((out / n).exists() for n in names):
            log.say(f"text: {out}: {p.num_shards} shards already done, skipping")
            return out
    # the assignment of documents to shards depends on all documents before them, so an interrupted text stage is
    # redone as a whole; outputs appear only when complete.
    tmps = [tmp_name(out / n) for n in names]
    fhs = [open(t, "w", encoding="utf-8") for t in tmps]
    heap = [(0, i) for i in range(p.num_shards)]  # (bytes written, shard): every document goes to the lightest
    counts = [0] * p.num_shards
    ctx = get_context("fork")
    pool = ctx.Pool(workers) if workers > 1 else None
    try:
        tasks = ((chunk, p.segmenter, p.language) for chunk in _chunks(read_documents(p), docs_per_task))
        results = ordered_map(pool, _segment_docs, tasks, 2 * workers) if pool else map(_segment_docs, tasks)
        bar = tqdm(desc="[text] documents", unit="doc", disable=not progress)
        for docs in results:
            for sents in docs:
                bar.update(1)
                if len(sents) < p.min_sentences:
                    continue
                text = "\n".join(sents) + "\n\n"
                size, i = heapq.heappop(heap)
                fhs[i].write(text)
                counts[i] += 1
                heapq.heappush(heap, (size + len(text.encode("utf-8")), i))
        bar.close()
        for fh in fhs:
            fh.close()
        if sum(counts) == 0:
            raise PrepError(f"no documents with >= {p.min_sentences} sentences in {p.input}")
        for t, n in zip(tmps, names):
            atomic_replace(t, out / n)
        for stale in set(out.glob("text_shard_*.txt")) - {out / n for n in names}:  # from a run with more shards
            stale.unlink()
        sizes = {n: (out / n).stat().st_size for n in names}
        tmp = tmp_name(manifest_path)
        tmp.write_text(json.dumps({"params": asdict(p), "documents": dict(zip(names, counts)), "bytes": sizes},
                                  indent=1))
        atomic_replace(tmp, manifest_path)
    finally:
        if pool:
            pool.terminate()
        for fh in fhs:
            fh.close()
        for t in tmps:
            if t.exists():
                t.unlink()
    log.say(f"text: {sum(counts)} documents -> {p.num_shards} shards in {out} "
            f"(bytes min {min(sizes.values())}, max {max(sizes.values())})")
    return out


def ordered_map(pool, fn, tasks: Iterable, window: int) -> Iterator:
    """Like pool.imap, but at most `window` tasks in flight: imap's feeder thread would read the whole input ahead,
    and a corpus larger than RAM must not be read into the task queue."""
    pending: deque = deque()
    for t in tasks:
        pending.append(pool.apply_async(fn, (t,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def read_text_shard(path: str | os.PathLike) -> list[list[str]]:
    """A text shard back as documents of sentences."""
    docs, doc = [], []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                doc.append(line)
            elif doc:
                docs.append(doc)
                doc = []
    if doc:
        docs.append(doc)
    return docs


def list_text_shards(input_dir: str | os.PathLike) -> list[Path]:
    d = Path(input_dir)
    if not d.is_dir():
        raise PrepError(f"text shard directory not found: {d}")
    files = sorted(p for p in d.glob("*.txt") if ".tmp" not in p.name)
    if not files:
        raise PrepError(f"no text shards (*.txt) in {d}; run `bert-prep text` first")
    return files


def encode_docs(docs: list[list[str]], encode_lines: Callable[[list[str]], Sequence[Sequence[int]]],
                batch_sentences: int = 8192) -> list[list[array]]:
    """Documents of sentences -> documents of int32 id arrays (a Python list of ints costs ~8x more memory), with
    encode_lines (a tokenizer's batch encoder) called on batches of whole documents of about batch_sentences
    sentences: a tokenizer's per-sentence objects are large, a whole shard of them would not fit. Sentences without
    tokens, then documents without sentences, are dropped (as NVIDIA's reader does). Both shard writers use it."""
    out: list[list[array]] = []
    start = 0
    while start < len(docs):
        stop, n = start, 0
        while stop < len(docs) and (n == 0 or n + len(docs[stop]) <= batch_sentences):
            n += len(docs[stop])
            stop += 1
        ids = encode_lines([s for doc in docs[start:stop] for s in doc])
        k = 0
        for doc in docs[start:stop]:
            sents = [array("i", x) for x in ids[k:k + len(doc)] if len(x)]
            k += len(doc)
            if sents:
                out.append(sents)
        start = stop
    return out
