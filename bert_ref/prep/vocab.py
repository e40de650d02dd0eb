"""Stage `vocab`: train a WordPiece vocab with `tokenizers` on the text shards, or take an existing BERT `vocab.txt`.

Writes `vocab.txt` (one token per line, the id is the line number: the standard BERT format) and `vocab.json` next
to it saying whether the vocab is cased, so `shards` tokenizes the same way without being told twice.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from bert_ref import log
from bert_ref.prep.h5io import atomic_replace, tmp_name
from bert_ref.prep.text import PrepError, list_text_shards

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SIDECAR = "vocab.json"


def read_vocab(path: str | os.PathLike) -> list[str]:
    """Tokens of a BERT vocab.txt, validated: no blank or duplicate token, all special tokens present."""
    path = Path(path)
    if not path.is_file():
        raise PrepError(f"vocab file not found: {path}")
    tokens = path.read_text(encoding="utf-8").split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not t.strip():
            raise PrepError(f"{path}: line {i + 1} is blank; a BERT vocab has one token per line")
        if t in seen:
            raise PrepError(f"{path}: token {t!r} on lines {seen[t] + 1} and {i + 1}")
        seen[t] = i
    missing = [t for t in SPECIAL_TOKENS if t not in seen]
    if missing:
        raise PrepError(f"{path}: special tokens {missing} missing (need {SPECIAL_TOKENS})")
    return tokens


def vocab_lowercase(vocab_path: str | os.PathLike, default: bool = True) -> bool:
    """Whether text is lowercased for this vocab: from the vocab.json sidecar if present."""
    side = Path(vocab_path).with_name(SIDECAR)
    if side.is_file():
        return bool(json.loads(side.read_text()).get("lowercase", default))
    return default


def _write_atomic(path: Path, text: str) -> None:
    tmp = tmp_name(path)
    tmp.write_text(text, encoding="utf-8")
    atomic_replace(tmp, path)


def run_vocab(text_dir: str | os.PathLike | None, output: str | os.PathLike, *, vocab_size: int = 30522,
              lowercase: bool = True, min_frequency: int = 2, limit_alphabet: int = 1000,
              existing: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Write `output` (a vocab.txt path) and its sidecar; skip if it exists with the same settings."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    side = out.with_name(SIDECAR)
    settings = {"lowercase": lowercase, "source": str(existing) if existing else "trained",
                "vocab_size": vocab_size, "min_frequency": min_frequency}
    if out.is_file() and side.is_file() and json.loads(side.read_text()).get("settings") == settings:
        log.say(f"vocab: {out} already done, skipping")
        return out
    if existing:
        tokens = read_vocab(existing)
    else:
        if text_dir is None:
            raise PrepError("vocab: give the text shard directory (--input) or an existing vocab (--vocab_file)")
        from tokenizers import BertWordPieceTokenizer

        files = [str(p) for p in list_text_shards(text_dir)]
        tok = BertWordPieceTokenizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                     lowercase=lowercase)
        # tokenizers streams the files and keeps word counts only; it does not hold the corpus in memory
        tok.train(files, vocab_size=vocab_size, min_frequency=min_frequency, limit_alphabet=limit_alphabet,
                  special_tokens=SPECIAL_TOKENS, show_progress=progress, wordpieces_prefix="##")
        vocab = tok.get_vocab()
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    _write_atomic(out, "\n".join(tokens) + "\n")
    _write_atomic(side, json.dumps({"lowercase": lowercase, "size": len(tokens), "settings": settings}, indent=1))
    log.say(f"vocab: {len(tokens)} tokens ({'uncased' if lowercase else 'cased'}) -> {out}")
    return out
