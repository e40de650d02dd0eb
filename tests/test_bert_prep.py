"""bert-prep: tiny corpus -> text shards -> vocab -> h5 shards -> check; recipe statistics; determinism; resume."""
from __future__ import annotations

import json
import random
from pathlib import Path

import h5py
import numpy as np
import pytest

from bert_ref.data import PretrainingData
from bert_ref.prep.__main__ import main
from bert_ref.prep.text import PrepError, TextParams, read_text_shard, run_text
from bert_ref.prep.vocab import read_vocab, run_vocab
from bert_ref.shards import SCHEMA

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "from", "home", "and", "then", "it",
         "came", "back", "to", "eat", "some", "food", "with", "its", "friend", "who", "was", "very", "happy", "today",
         "river", "stone", "green", "light", "house", "under", "over", "quickly", "slowly", "big", "small"]


def write_corpus(root: Path, files: int = 3, docs: int = 20, seed: int = 0) -> Path:
    """Plain text: documents separated by blank lines, a few sentences per line (so segmentation has work)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines = []
        for _ in range(docs):
            sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "."
                     for _ in range(rng.randint(4, 10))]
            lines += [" ".join(sents[i:i + 3]) for i in range(0, len(sents), 3)] + [""]
        (root / f"part{f}.txt").write_text("\n".join(lines))
    return root


def h5_arrays(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][:] for k in f}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One round trip through the CLI, shared by the tests below."""
    root = tmp_path_factory.mktemp("prep")
    raw = write_corpus(root / "raw")
    work = root / "work"
    rc = main(["all", "--input", str(raw), "--output", str(work), "--num-shards", "3", "--vocab-size", "200",
               "--min-frequency", "1", "--max-seq-length", "128", "--max-predictions-per-seq", "20",
               "--dupe-factor", "4", "--num-test-shards", "1", "--workers", "2", "--no-progress"])
    assert rc == 0
    return work


def test_round_trip_layout_and_loader(prepared, capsys):
    h5_dir = prepared / "hdf5_seq128_pred20"
    files = sorted(h5_dir.glob("*.hdf5"))
    names = [f.name for f in files]
    assert sum("_training_" in n for n in names) == 2 and sum("_test_" in n for n in names) == 1
    assert all("seq128_pred20_mlm0.15_dupe4_seed12345_uncased" in n for n in names)
    for f in files:
        with h5py.File(f, "r") as h:
            assert set(h.keys()) == set(SCHEMA)
            for name, (dtype, ndim) in SCHEMA.items():
                assert h[name].dtype == dtype and h[name].ndim == ndim
            assert h["input_ids"].shape[1] == 128 and h["masked_lm_positions"].shape[1] == 20
    assert main(["check", str(h5_dir), "--vocab", str(prepared / "vocab.txt"), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["files"] == 3 and summary["errors"] == 0 and summary["seq_len"] == [128]
    # the loader reads the training files (the test file is left out by name)
    data = PretrainingData(h5_dir, rank=0, world_size=1, micro_batch=4)
    assert len(data.files) == 2 and data.seq_len == 128 and data.max_predictions_per_seq == 20
    batch = next(iter(data))
    assert batch["input_ids"].shape == (4, 128)


def test_text_shards_balanced_and_complete(prepared):
    text_dir = prepared / "text"
    shards = sorted(text_dir.glob("text_shard_*.txt"))
    sizes = [s.stat().st_size for s in shards]
    docs = [read_text_shard(s) for s in shards]
    assert sum(len(d) for d in docs) == 60  # 3 files x 20 documents, none lost
    biggest_doc = max(len("\n".join(d)) for ds in docs for d in ds) + 2
    assert max(sizes) - min(sizes) <= biggest_doc
    # segmentation split the 3-sentences lines into sentences
    assert all(line.endswith(".") and line.count(".") == 1 for d in docs[0] for line in d)


def test_masking_statistics(prepared):
    vocab = read_vocab(prepared / "vocab.txt")
    ids = {t: i for i, t in enumerate(vocab)}
    special = {ids[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
    arrays = [h5_arrays(f) for f in sorted((prepared / "hdf5_seq128_pred20").glob("*.hdf5"))]
    a = {k: np.concatenate([x[k] for x in arrays]) for k in arrays[0]}
    pos, mlm, inp, mask = a["masked_lm_positions"], a["masked_lm_ids"], a["input_ids"], a["input_mask"]
    used = pos > 0
    real = int(mask.sum())
    assert 0.13 <= used.sum() / real <= 0.17, used.sum() / real
    rows = np.nonzero(used)[0]
    at = inp[rows, pos[used]]
    orig = mlm[used]
    assert len(orig) > 1500
    # special tokens are never chosen, and random replacements are never special
    assert not np.isin(orig, [ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]]).any()
    assert not np.isin(at[at != ids["[MASK]"]], list(special - {ids["[UNK]"]})).any()
    masked, kept = (at == ids["[MASK]"]).mean(), (at == orig).mean()
    assert abs(masked - 0.8) < 0.04 and abs(kept - 0.1) < 0.03 and abs(1 - masked - kept - 0.1) < 0.03
    # [CLS] first, two [SEP]; segment B after the first [SEP]
    assert (inp[:, 0] == ids["[CLS]"]).all()
    assert ((inp == ids["[SEP]"]).sum(1) == 2).all()
    nsp = a["next_sentence_labels"].mean()
    assert 0.4 <= nsp <= 0.62, nsp


def test_determinism_and_workers(prepared, tmp_path):
    """Same inputs and seed give identical arrays, whatever the number of workers; another seed differs."""
    common = ["shards", "--input", str(prepared / "text"), "--vocab", str(prepared / "vocab.txt"),
              "--dupe-factor", "4", "--num-test-shards", "1", "--no-progress"]
    assert main(common + ["--output", str(tmp_path / "w1"), "--workers", "1"]) == 0
    assert main(common + ["--output", str(tmp_path / "s2"), "--seed", "7"]) == 0
    ref = sorted((prepared / "hdf5_seq128_pred20").glob("*.hdf5"))
    mine = sorted((tmp_path / "w1").glob("*.hdf5"))
    assert [f.name for f in ref] == [f.name for f in mine]
    for r, m in zip(ref, mine):
        ra, ma = h5_arrays(r), h5_arrays(m)
        assert all(np.array_equal(ra[k], ma[k]) for k in SCHEMA)
    other = h5_arrays(sorted((tmp_path / "s2").glob("*.hdf5"))[0])
    assert not np.array_equal(other["input_ids"], h5_arrays(ref[0])["input_ids"])
    # the text stage is deterministic too
    p = TextParams(input=str(tmp_path / "raw"), num_shards=3, seed=12345)
    write_corpus(tmp_path / "raw")
    run_text(p, tmp_path / "t1", progress=False)
    for s in sorted((prepared / "text").glob("text_shard_*.txt")):
        assert (tmp_path / "t1" / s.name).read_bytes() == s.read_bytes()


def test_resume_skips_finished_outputs(prepared, tmp_path, capsys):
    text = prepared / "text"
    out = tmp_path / "h5"
    args = ["shards", "--input", str(text), "--vocab", str(prepared / "vocab.txt"), "--output", str(out),
            "--dupe-factor", "1", "--no-progress"]
    assert main(args) == 0
    files = sorted(out.glob("*.hdf5"))
    # an interrupted run: one output missing, a stale temporary file left behind
    files[1].unlink()
    stale = out / (files[1].name + ".tmp999")
    stale.write_bytes(b"partial")
    before = {f: f.stat().st_mtime_ns for f in (files[0], files[2])}
    assert main(args) == 0
    assert "2 of 3 outputs already done" in capsys.readouterr().out
    assert files[1].exists() and all(f.stat().st_mtime_ns == t for f, t in before.items())
    assert main(["check", str(out), "--no-progress"]) == 0  # the .tmp file is not taken as a shard
    # the text and vocab stages skip a finished output too (same parameters), and redo it when they change
    raw = write_corpus(tmp_path / "raw")
    t_args = ["text", "--input", str(raw), "--output", str(tmp_path / "text"), "--num-shards", "2", "--no-progress"]
    assert main(t_args) == 0 and main(t_args) == 0
    assert "2 shards already done, skipping" in capsys.readouterr().out
    assert main(t_args[:-2] + ["3", "--no-progress"]) == 0
    assert "already done" not in capsys.readouterr().out
    v_args = ["vocab", "--input", str(tmp_path / "text"), "--output", str(tmp_path / "vocab.txt"),
              "--vocab-size", "120", "--no-progress"]
    assert main(v_args) == 0 and main(v_args) == 0
    assert "already done, skipping" in capsys.readouterr().out
    assert main(["text", "--input", str(tmp_path / "none"), "--output", str(text), "--num-shards", "3",
                 "--no-progress"]) == 2  # missing input is an error, named
    assert "input not found" in capsys.readouterr().err


def test_input_formats(tmp_path):
    """wikiextractor output, one document per line, and a HF dataset saved with save_to_disk."""
    wiki = tmp_path / "wiki" / "AA"
    wiki.mkdir(parents=True)
    (wiki / "wiki_00").write_text(
        '<doc id="1" url="u" title="Cats">\nCats\n\nCats are small. They sleep a lot.\nThey purr.\n</doc>\n'
        '<doc id="2" url="u" title="Dogs">\nDogs\n\nDogs bark. Dogs run.\n</doc>\n')
    run_text(TextParams(input=str(tmp_path / "wiki"), num_shards=1), tmp_path / "t_wiki", progress=False)
    docs = read_text_shard(tmp_path / "t_wiki" / "text_shard_00000.txt")
    assert sorted(docs) == sorted([["Cats are small.", "They sleep a lot.", "They purr."],
                                   ["Dogs bark.", "Dogs run."]])
    lines = tmp_path / "lines"
    lines.mkdir()
    (lines / "a.txt").write_text("First doc. Two sentences.\nSecond doc.\n\nThird doc.\n")
    run_text(TextParams(input=str(lines), num_shards=2, one_doc_per_line=True), tmp_path / "t_lines",
             progress=False)
    got = [d for s in sorted((tmp_path / "t_lines").glob("*.txt")) for d in read_text_shard(s)]
    assert sorted(got) == sorted([["First doc.", "Two sentences."], ["Second doc."], ["Third doc."]])
    import datasets

    ds = datasets.Dataset.from_dict({"body": ["Alpha one. Alpha two.", "", "Beta one."], "id": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(PrepError, match="text column 'text'"):
        run_text(TextParams(input=str(tmp_path / "hf"), num_shards=1), tmp_path / "t_bad", progress=False)
    run_text(TextParams(input=str(tmp_path / "hf"), num_shards=1, text_column="body"), tmp_path / "t_hf",
             progress=False)
    assert read_text_shard(tmp_path / "t_hf" / "text_shard_00000.txt") == [["Alpha one.", "Alpha two."],
                                                                             ["Beta one."]]


def test_existing_vocab_cased_and_bad_vocab(prepared, tmp_path):
    src = tmp_path / "given.txt"
    src.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "The", "the", "cat", "Cat", "."]) + "\n")
    out = run_vocab(None, tmp_path / "v" / "vocab.txt", existing=src, lowercase=False, progress=False)
    assert read_vocab(out)[5] == "The"
    assert json.loads((out.parent / "vocab.json").read_text())["lowercase"] is False
    # the shards stage follows the vocab's case from vocab.json: "Cat" keeps its own id
    assert main(["shards", "--input", str(prepared / "text"), "--vocab", str(out), "--output", str(tmp_path / "h"),
                 "--dupe-factor", "1", "--no-progress"]) == 0
    name = sorted((tmp_path / "h").glob("*.hdf5"))[0].name
    assert "_cased_" in name
    bad = tmp_path / "bad.txt"
    bad.write_text("[PAD]\n[UNK]\nthe\nthe\n")
    with pytest.raises(PrepError, match="token 'the' on lines 3 and 4"):
        read_vocab(bad)
    bad.write_text("[PAD]\n[UNK]\nthe\n")
    with pytest.raises(PrepError, match=r"special tokens \['\[CLS\]', '\[SEP\]', '\[MASK\]'\] missing"):
        read_vocab(bad)


def test_check_reports_bad_file(prepared, tmp_path, capsys):
    import shutil

    out = tmp_path / "h5"
    shutil.copytree(prepared / "hdf5_seq128_pred20", out)
    victim = sorted(out.glob("*.hdf5"))[0]
    with h5py.File(victim, "r+") as f:
        pos = f["masked_lm_positions"][:]
        pos[3, 0] = 500
        f["masked_lm_positions"][...] = pos
    assert main(["check", str(out), "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert victim.name in text and "masked_lm_positions" in text and "out of range" in text
    assert json.loads(text.strip().splitlines()[-1])["files"] == 2


def test_vocab_size_attribute_written(prepared):
    vocab = len(read_vocab(prepared / "vocab.txt"))
    for f in sorted((prepared / "hdf5_seq128_pred20").glob("*.hdf5")):
        with h5py.File(f, "r") as h:
            assert int(h.attrs["vocab_size"]) == vocab
            assert h["input_ids"][:].max() < vocab


def _shards_of(raw: Path, out: Path) -> dict[str, np.ndarray]:
    rc = main(["all", "--input", str(raw), "--output", str(out), "--num-shards", "1", "--vocab-size", "200",
               "--min-frequency", "1", "--max-seq-length", "64", "--max-predictions-per-seq", "10",
               "--dupe-factor", "3", "--no-progress"])
    assert rc == 0
    return h5_arrays(next((out / "hdf5_seq64_pred10").glob("*.hdf5")))


def test_nsp_label_of_a_random_next_from_the_same_document(tmp_path):
    """NVIDIA's create_pretraining_data.py: when the 'random' B can only come from A's own document, the pair is
    labelled is-next (0). A single-document shard therefore has only 0 labels; the same text split into documents
    has random-next pairs (1) too."""
    raw = write_corpus(tmp_path / "raw", files=1, docs=12, seed=3)
    many = _shards_of(raw, tmp_path / "many")
    assert 0 < many["next_sentence_labels"].mean() < 1
    one = tmp_path / "one" / "raw"
    one.mkdir(parents=True)
    text = (raw / "part0.txt").read_text()
    (one / "part0.txt").write_text("\n".join(line for line in text.splitlines() if line.strip()) + "\n")
    single = _shards_of(one, tmp_path / "one" / "work")
    assert len(single["next_sentence_labels"]) > 20
    assert not single["next_sentence_labels"].any()
