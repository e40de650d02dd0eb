"""A generated corpus and vocabulary for comparing `bert-prep shards --nvidia_compat` with NVIDIA's
create_pretraining_data.py (tests/test_bert_prep_nvidia.py; the reference's output fingerprints: reference.json).

Deterministic from the code alone (Python's random.Random with a fixed seed; no tokenizer training), so the test
regenerates the same bytes. The text exercises what the two implementations could differ on: upper case and accents
(lower-cased and stripped), a word-final capital sigma (Python's lower() gives 'ς'), punctuation, digits, a CJK
character in and one out of the vocabulary, words that split into ## pieces or become [UNK], one-sentence documents,
long documents, and special-token text: "[MASK]", "[SEP]", "[CLS]", "[UNK]" as whole whitespace tokens (NVIDIA's
BasicTokenizer never splits those), and "[MASK]," / "x[MASK]" / "[mask]" (which it splits into "[", "mask", "]" ...).

    python tests/data/nvidia_shards/make_corpus.py OUT_DIR    # writes OUT_DIR/text/shard_{0,1}.txt, OUT_DIR/vocab.txt
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 2024
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "from", "home", "and", "then", "it",
         "came", "back", "to", "eat", "some", "food", "with", "its", "friend", "who", "was", "very", "happy", "today",
         "river", "stone", "green", "light", "house", "under", "over", "quickly", "slowly", "big", "small", "café",
         "naïve", "Zürich", "running", "jumped", "cats", "houses", "1984", "42", "中", "文", "über", "Ärger", "ΟΔΟΣ",
         "Σοφία"]
# left out of the vocabulary: they become ## pieces ("running" -> run ##ning) or [UNK] ("文")
NOT_IN_VOCAB = {"running", "jumped", "cats", "houses", "1984", "文", "über", "ärger", "uber", "arger", "cafe", "naive",
                "zurich", "οδοσ", "σοφία"}
SPECIAL_TEXT = ["[MASK]", "[SEP]", "[CLS]", "[UNK]", "[MASK],", "x[MASK]", "[mask]", "[PAD]"]
PUNCT = [".", ",", "!", "?", "'", "-", "(", ")", "[", "]", ":", ";"]


def vocab_tokens() -> list[str]:
    """BERT's layout in small: [PAD], [unused*], [UNK], [CLS], [SEP], [MASK], characters, ## characters, words."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(4)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789") + PUNCT + ["中"]
    tokens += chars + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    words = sorted({w.lower() for w in WORDS} - NOT_IN_VOCAB - {"中"} | {"cafe", "naive", "zurich"} - NOT_IN_VOCAB)
    tokens += [w for w in words if w not in tokens]
    tokens += ["run", "##ning", "##s", "##ed", "jump", "house", "mask", "##98", "οδος"]
    seen: set[str] = set()
    return [t for t in tokens if not (t in seen or seen.add(t))]


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 14))]
    if rng.random() < 0.25:
        words.insert(rng.randint(0, len(words)), rng.choice(SPECIAL_TEXT))
    if rng.random() < 0.3:
        words.insert(rng.randint(1, len(words)), rng.choice(PUNCT))
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text + rng.choice([".", ".", "!", "?", ""])


def corpus_lines(rng: random.Random, documents: int) -> list[str]:
    lines: list[str] = []
    for _ in range(documents):
        n = rng.choice([1, 2, 3, 5, 8, 13, 30])
        lines += [sentence(rng) for _ in range(n)] + [""]
    return lines


def write(out: str | Path) -> tuple[list[Path], Path]:
    out = Path(out)
    (out / "text").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    shards = []
    for i, docs in enumerate((40, 25)):
        path = out / "text" / f"shard_{i}.txt"
        path.write_text("\n".join(corpus_lines(rng, docs)) + "\n", encoding="utf-8")
        shards.append(path)
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(vocab_tokens()) + "\n", encoding="utf-8")
    return shards, vocab


if __name__ == "__main__":
    shards, vocab = write(sys.argv[1])
    print(*shards, vocab, sum(len(p.read_text().splitlines()) for p in shards), "lines")
