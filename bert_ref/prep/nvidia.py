"""`bert-prep shards --nvidia_compat`: the h5 arrays NVIDIA DeepLearningExamples' PyTorch BERT
create_pretraining_data.py (h5-era commit 7a4c4250) writes for the same text shard, vocab, seed and settings.

What the compat mode does as NVIDIA's script does, and the default mode does not (bert_ref.prep.instances):
- one `random.Random(seed)` per text shard (bertPrep.py runs the script once per shard with the same --random_seed),
  and the shard's documents shuffled with it before any instance is made;
- masking draws: `random() < 0.8` -> [MASK], else a second `random() < 0.5` -> keep, else a random id over the WHOLE
  vocabulary ([PAD], [unused*], [CLS], [SEP], [MASK] included: NVIDIA draws from `list(tokenizer.vocab.keys())`);
- text is always lower-cased and accent-stripped (the script's --do_lower_case is store_true with default True);
- tokenization of NVIDIA's BertTokenizer (pytorch-pretrained-bert's): a whitespace token that IS one of
  [UNK] [SEP] [PAD] [CLS] [MASK] (case-sensitive) is never split or lower-cased, so a literal "[MASK]" in the text
  becomes the [MASK] id; "[MASK]," or "[mask]" are ordinary text ("[", "mask", "]", ","). The default mode's
  `tokenizers` BertWordPieceTokenizer instead matches the special tokens anywhere in the text.
The rest (chunking into A/B, random next, truncation, instance shuffle, array layout) is the algorithm both modes
share (instances_from_document, to_arrays).

Tokenization uses Hugging Face `tokenizers` (BERT's normalizer, pre-tokenizer and WordPiece, the same rules as
NVIDIA's Python, ~50x faster) with no added special tokens; the lines where the two could differ go through a slower
path that applies NVIDIA's two context rules first: the never-split tokens above, and Python's str.lower(), which
lower-cases a word-final capital sigma to 'ς' where `tokenizers` lower-cases characters one by one ('σ').
"""
from __future__ import annotations

import random
import unicodedata
from array import array

from bert_ref.prep.text import encode_docs

NEVER_SPLIT = ("[UNK]", "[SEP]", "[PAD]", "[CLS]", "[MASK]")
_SLOW_MARKERS = NEVER_SPLIT + ("\u03a3",)  # capital sigma: Python's lower() is context dependent for it


class NvidiaTokenizer:
    """NVIDIA's BertTokenizer(vocab, do_lower_case=True).tokenize, as ids (module docstring)."""

    def __init__(self, tokens: list[str]):
        from tokenizers import Tokenizer, normalizers, pre_tokenizers
        from tokenizers.models import WordPiece

        vocab = {t: i for i, t in enumerate(tokens)}
        self.wordpiece = WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100)
        self.tok = Tokenizer(self.wordpiece)
        self.tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                         strip_accents=True, lowercase=True)
        self.tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        # NVIDIA's _clean_text + _tokenize_chinese_chars only: its whitespace tokens, before lower-casing
        self.clean = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False,
                                                lowercase=False)
        self.vocab = vocab

    def _slow(self, line: str) -> list[int]:
        ids: list[int] = []
        run: list[str] = []
        for word in self.clean.normalize_str(line).split():
            if word in NEVER_SPLIT:
                if run:
                    ids += self.tok.encode(" ".join(run), add_special_tokens=False).ids
                    run = []
                ids += [self.vocab[t.value] for t in self.wordpiece.tokenize(word)]
            else:  # NVIDIA: token.lower(), then strip accents (NFD, drop Mn), per whitespace token
                word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                               if unicodedata.category(c) != "Mn")
                run.append(word)
        if run:
            ids += self.tok.encode(" ".join(run), add_special_tokens=False).ids
        return ids

    def encode_lines(self, lines: list[str]) -> list[list[int]]:
        fast = [i for i, s in enumerate(lines) if not any(m in s for m in _SLOW_MARKERS)]
        out: list[list[int]] = [[] for _ in lines]
        for i, enc in zip(fast, self.tok.encode_batch([lines[i] for i in fast], add_special_tokens=False)):
            out[i] = enc.ids
        for i in sorted(set(range(len(lines))) - set(fast)):
            out[i] = self._slow(lines[i])
        return out


def tokenize_docs(docs: list[list[str]], tokens: list[str], batch_sentences: int = 8192) -> list[list[array]]:
    """Documents of sentences -> documents of int32 id arrays; sentences without tokens and then documents without
    sentences are dropped (as NVIDIA's reader does)."""
    return encode_docs(docs, NvidiaTokenizer(tokens).encode_lines, batch_sentences)


def mask_nvidia(tokens: list[int], p, vocab, rng: random.Random) -> tuple[list[int], list[int]]:
    """NVIDIA's create_masked_lm_predictions on ids, in place; returns (sorted positions, original ids)."""
    cand = [i for i, t in enumerate(tokens) if t != vocab.cls and t != vocab.sep]
    rng.shuffle(cand)
    num_to_predict = min(p.max_predictions_per_seq, max(1, int(round(len(tokens) * p.masked_lm_prob))))
    last = len(vocab.tokens) - 1
    picked: list[tuple[int, int]] = []
    for i in cand:
        if len(picked) >= num_to_predict:
            break
        original = tokens[i]
        if rng.random() < 0.8:
            tokens[i] = vocab.mask
        elif rng.random() >= 0.5:  # else: keep the original (the other half of the remaining 20%)
            tokens[i] = rng.randint(0, last)
        picked.append((i, original))
    picked.sort()
    return [i for i, _ in picked], [t for _, t in picked]


def shard_rng(seed: int, docs: list) -> random.Random:
    """NVIDIA's per-invocation generator, after its document shuffle (done here, in place)."""
    rng = random.Random(seed)
    rng.shuffle(docs)
    return rng
