"""`bert-prep shards --nvidia_compat` writes, array for array, what NVIDIA's create_pretraining_data.py writes: the
sha256 of each of the six arrays NVIDIA's script produced from the generated corpus of
tests/data/nvidia_shards/make_corpus.py are kept in reference.json (file, commit, command: make_reference.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bert_ref.prep.__main__ import main

DATA = Path(__file__).parent / "data" / "nvidia_shards"
sys.path.insert(0, str(DATA))
import make_corpus  # noqa: E402
import make_reference  # noqa: E402

REF = json.loads((DATA / "reference.json").read_text())


def shards_cli(text: Path, vocab: Path, out: Path, *extra: str) -> int:
    s = REF["settings"]
    return main(["shards", "--input", str(text), "--vocab", str(vocab), "--output", str(out), "--seed",
                 str(s["random_seed"]), "--max_seq_length", str(s["max_seq_length"]), "--max_predictions_per_seq",
                 str(s["max_predictions_per_seq"]), "--masked_lm_prob", str(s["masked_lm_prob"]), "--dupe_factor",
                 str(s["dupe_factor"]), "--short_seq_prob", str(s["short_seq_prob"]), "--no_progress", *extra])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvidia_corpus")
    shards, vocab = make_corpus.write(root)
    assert make_reference.sha256_file(vocab) == REF["vocab_sha256"]
    for shard in shards:  # the generator still makes the text NVIDIA's script was run on
        assert make_reference.sha256_file(shard) == REF["shards"][shard.name]["text_sha256"], shard.name
    return root


def test_compat_arrays_equal_nvidias(corpus, tmp_path):
    assert REF["reference"]["commit"].startswith("7a4c4250")
    assert shards_cli(corpus / "text", corpus / "vocab.txt", tmp_path / "h5", "--nvidia_compat") == 0
    files = sorted((tmp_path / "h5").glob("*.hdf5"))
    assert len(files) == 2 and all(f.name.endswith(f"_nvidia_{i:05d}.hdf5") for i, f in enumerate(files))
    for name, f in zip(sorted(REF["shards"]), files):
        assert make_reference.array_fingerprints(f) == REF["shards"][name]["arrays"], (name, f.name)


def test_default_mode_is_not_nvidias(corpus, tmp_path):
    """The default mode keeps its own seeding and masking: the comparison above is not vacuous."""
    assert shards_cli(corpus / "text", corpus / "vocab.txt", tmp_path / "h5") == 0
    got = make_reference.array_fingerprints(sorted((tmp_path / "h5").glob("*.hdf5"))[0])
    want = REF["shards"]["shard_0.txt"]["arrays"]
    assert got["input_ids"]["sha256"] != want["input_ids"]["sha256"]
    assert {k: v["dtype"] for k, v in got.items()} == {k: v["dtype"] for k, v in want.items()}


def test_compat_tokenizer_special_token_text(corpus):
    """NVIDIA's never-split rule and Python's lower() on its own, on one line each (ids of make_corpus's vocab)."""
    from bert_ref.prep.nvidia import NvidiaTokenizer
    from bert_ref.prep.vocab import read_vocab

    tokens = read_vocab(corpus / "vocab.txt")
    tok = NvidiaTokenizer(tokens)
    ids = {t: i for i, t in enumerate(tokens)}
    words = lambda line: [tokens[i] for i in tok.encode_lines([line])[0]]  # noqa: E731
    assert words("The [MASK] sat [MASK], x[MASK] [mask]") == \
        ["the", "[MASK]", "sat", "[", "mask", "]", ",", "x", "[", "mask", "]", "[", "mask", "]"]
    assert words("ΟΔΟΣ. Café [SEP]") == ["οδος", ".", "c", "##a", "##f", "##e", "[SEP]"] and ids["[SEP]"] == 7
    assert words("Running 文") == ["run", "##ning", "[UNK]"]


def test_compat_refuses_what_nvidia_cannot_do(corpus, tmp_path, capsys):
    status = shards_cli(corpus / "text", corpus / "vocab.txt", tmp_path / "a", "--nvidia_compat", "--whole_word_mask")
    assert status == 2
    assert "--nvidia_compat with --whole_word_mask" in capsys.readouterr().err
    assert shards_cli(corpus / "text", corpus / "vocab.txt", tmp_path / "b", "--nvidia_compat", "--cased") == 2
    assert "always lower-cases" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").iterdir())
