r"""`python -m bert_ref.prep` / `bert-prep`: raw text -> text shards -> vocab -> h5 shards -> check.

    bert-prep text   --input RAW --output WORK/text --num_shards 64 --workers 8
    bert-prep vocab  --input WORK/text --output WORK/vocab.txt --vocab_size 30522        (or --vocab_file vocab.txt)
    bert-prep shards --input WORK/text --vocab WORK/vocab.txt --output WORK/h5_seq128 --max_seq_length 128 \
                     --max_predictions_per_seq 20 --workers 8
    bert-prep check  WORK/h5_seq128
    bert-prep all    --input RAW --output WORK ...          (the four stages chained; finished outputs are skipped)

Flags take underscores (`--max_seq_length`); the dashed spellings of earlier versions are accepted too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bert_ref.prep.text import FORMATS, PrepError, TextParams
from ds_core.cli import ArgumentParser, flag, run_cli


def _add_text(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("text")
    g.add_argument("--format", choices=FORMATS, default="auto",
                   help="input kind: plain text files, wikiextractor output, HF dataset (save_to_disk); auto detects")
    g.add_argument(*flag("--num_shards"), type=int, default=4, help="number of balanced text shards")
    g.add_argument(*flag("--one_doc_per_line"), action="store_true",
                   help="plain text: each non-empty line is a document (default: blank lines separate documents)")
    g.add_argument(*flag("--text_column"), default="text", help="HF dataset: column holding the text")
    g.add_argument(*flag("--hf_split"), default="train", help="HF DatasetDict: split to read")
    g.add_argument("--segmenter", choices=("pysbd", "lines"), default="pysbd",
                   help="pysbd sentence segmentation, or 'lines' when every input line is already a sentence")
    g.add_argument("--language", default="en", help="pysbd language code")
    g.add_argument(*flag("--min_sentences"), type=int, default=1, help="drop documents with fewer sentences")


def _add_vocab(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vocab")
    g.add_argument(*flag("--vocab_file"), default=None, help="use this existing BERT vocab.txt instead of training one")
    g.add_argument(*flag("--vocab_size"), type=int, default=30522, help="WordPiece vocab size to train")
    g.add_argument(*flag("--min_frequency"), type=int, default=2, help="minimum pair frequency when training")


def _add_case(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cased", dest="lowercase", action="store_false", default=None,
                   help="keep case (default: uncased; `shards` follows the vocab's vocab.json)")
    p.add_argument("--uncased", dest="lowercase", action="store_true", help="lowercase and strip accents")


def _add_shards(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shards")
    g.add_argument(*flag("--max_seq_length"), type=int, default=128, help="128 for phase 1, 512 for phase 2")
    g.add_argument(*flag("--max_predictions_per_seq"), type=int, default=20, help="20 for phase 1, 80 for phase 2")
    g.add_argument(*flag("--masked_lm_prob"), type=float, default=0.15)
    g.add_argument(*flag("--short_seq_prob"), type=float, default=0.1)
    g.add_argument(*flag("--dupe_factor"), type=int, default=5,
                   help="times each document is used, with different masks")
    g.add_argument(*flag("--whole_word_mask"), action="store_true", help="mask whole words (all their ## pieces)")
    g.add_argument(*flag("--num_test_shards"), type=int, default=0, help="the last K text shards become *_test_* files")
    g.add_argument("--prefix", default="bert", help="output file name prefix")
    g.add_argument(*flag("--no_compression"), action="store_true", help="write h5 without gzip")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="bert-prep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--seed", type=int, default=12345)
    common.add_argument("--workers", type=int, default=1, help="worker processes")
    common.add_argument(*flag("--no_progress"), dest="progress", action="store_false", help="no progress bars")

    p = sub.add_parser("text", parents=[common], help="raw documents -> balanced sentence-per-line text shards")
    p.add_argument("--input", required=True, help="text directory / file, wikiextractor output, or HF dataset dir")
    p.add_argument("--output", required=True, help="directory for text_shard_*.txt")
    _add_text(p)

    p = sub.add_parser("vocab", parents=[common], help="train a WordPiece vocab, or validate and take an existing one")
    p.add_argument("--input", default=None, help="text shard directory (from `text`)")
    p.add_argument("--output", required=True, help="vocab.txt path to write")
    _add_vocab(p)
    _add_case(p)

    p = sub.add_parser("shards", parents=[common], help="text shards + vocab -> h5 pretraining shards")
    p.add_argument("--input", required=True, help="text shard directory (from `text`)")
    p.add_argument("--vocab", required=True, help="vocab.txt")
    p.add_argument("--output", required=True, help="directory for the .hdf5 files")
    _add_shards(p)
    _add_case(p)

    p = sub.add_parser("check", help="validate every h5 file of DIR and print a summary")
    p.add_argument("directory")
    p.add_argument("--vocab", default=None, help="also check ids against this vocab.txt")
    p.add_argument(*flag("--no_progress"), dest="progress", action="store_false")

    p = sub.add_parser("all", parents=[common], help="text -> vocab -> shards -> check, into OUTPUT/{text,vocab.txt,"
                                                     "hdf5_seqL}")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True, help="work directory")
    _add_text(p)
    _add_vocab(p)
    _add_shards(p)
    _add_case(p)
    return ap


def _shard_params(a: argparse.Namespace, vocab: str):
    from bert_ref.prep.instances import ShardParams
    from bert_ref.prep.vocab import vocab_lowercase

    lower = vocab_lowercase(vocab) if a.lowercase is None else a.lowercase
    return ShardParams(max_seq_length=a.max_seq_length, max_predictions_per_seq=a.max_predictions_per_seq,
                       masked_lm_prob=a.masked_lm_prob, short_seq_prob=a.short_seq_prob, dupe_factor=a.dupe_factor,
                       seed=a.seed, whole_word_mask=a.whole_word_mask, lowercase=lower,
                       compression="" if a.no_compression else "gzip")


def _text_params(a: argparse.Namespace) -> TextParams:
    return TextParams(input=str(a.input), format=a.format, num_shards=a.num_shards, seed=a.seed,
                      one_doc_per_line=a.one_doc_per_line, text_column=a.text_column, hf_split=a.hf_split,
                      segmenter=a.segmenter, language=a.language, min_sentences=a.min_sentences)


def _check(directory: str, vocab: str | None, progress: bool) -> int:
    from bert_ref.prep.check import print_summary, run_check

    s = run_check(directory, vocab, progress=progress)
    print_summary(directory, s)
    return 1 if s.errors else 0


def _main(a: argparse.Namespace) -> int:
    if a.stage == "text":
        from bert_ref.prep.text import run_text

        run_text(_text_params(a), a.output, workers=a.workers, progress=a.progress)
    elif a.stage == "vocab":
        from bert_ref.prep.vocab import run_vocab

        run_vocab(a.input, a.output, vocab_size=a.vocab_size, lowercase=a.lowercase is not False,
                  min_frequency=a.min_frequency, existing=a.vocab_file, progress=a.progress)
    elif a.stage == "shards":
        from bert_ref.prep.instances import run_shards

        run_shards(a.input, a.vocab, a.output, _shard_params(a, a.vocab), workers=a.workers,
                   num_test_shards=a.num_test_shards, prefix=a.prefix, progress=a.progress)
    elif a.stage == "check":
        return _check(a.directory, a.vocab, a.progress)
    elif a.stage == "all":
        from bert_ref.prep.instances import run_shards
        from bert_ref.prep.text import run_text
        from bert_ref.prep.vocab import run_vocab

        work = Path(a.output)
        text_dir = run_text(_text_params(a), work / "text", workers=a.workers, progress=a.progress)
        vocab = run_vocab(text_dir, work / "vocab.txt", vocab_size=a.vocab_size,
                          lowercase=a.lowercase is not False, min_frequency=a.min_frequency,
                          existing=a.vocab_file, progress=a.progress)
        h5_dir = work / f"hdf5_seq{a.max_seq_length}_pred{a.max_predictions_per_seq}"
        run_shards(text_dir, vocab, h5_dir, _shard_params(a, str(vocab)), workers=a.workers,
                   num_test_shards=a.num_test_shards, prefix=a.prefix, progress=a.progress)
        return _check(str(h5_dir), str(vocab), a.progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_cli(f"bert-prep {a.stage}", lambda: _main(a), (PrepError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
