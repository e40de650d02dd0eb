"""bert_ref.data: shard assignment, vectorized batches, exact resume across ranks, validation of bad files."""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from bert_ref.data import (
    IGNORE_INDEX,
    DataStateError,
    PretrainingData,
    assign_shards,
    batches_per_epoch,
    build_data,
    plan_segments,
)
from bert_ref.prep.h5io import synthetic_arrays, write_shard
from bert_ref.shards import SCHEMA, DataDirError, ShardError, list_test_shards

L, P, V = 32, 5, 300
SIZES = (70, 55, 90)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("h5")
    for i, n in enumerate(SIZES):
        write_shard(d / f"bert_training_seq{L}_{i:05d}.hdf5", synthetic_arrays(n, L, P, V, seed=i))
    write_shard(d / f"bert_test_seq{L}_00000.hdf5", synthetic_arrays(10, L, P, V, seed=9))  # not read
    return d


def all_rows(d: Path) -> dict[str, np.ndarray]:
    files = sorted(d.glob("*training*.hdf5"))
    out = {}
    for k in SCHEMA:
        parts = []
        for f in files:
            with h5py.File(f, "r") as h:
                parts.append(h[k][:])
        out[k] = np.concatenate(parts)
    return out


# --------------------------------------------------------------------------------------------- assignment
@pytest.mark.parametrize("n_files,world", [(8, 2), (8, 3), (5, 4), (2, 4), (1, 3), (7, 7)])
def test_assign_shards_pure_distinct_and_covering(n_files, world):
    files = [f"f{i:02d}.hdf5" for i in range(n_files)]
    per_rank = [assign_shards(files, r, world, epoch=0, seed=1) for r in range(world)]
    assert per_rank == [assign_shards(list(reversed(files)), r, world, 0, 1) for r in range(world)]  # pure, sorted
    n_whole = n_files - n_files % world
    whole = [f for fs in per_rank for f in fs[:n_whole // world]]
    assert len(whole) == len(set(whole)) == n_whole  # whole files are distinct per rank
    assert set().union(*map(set, per_rank)) == set(files)  # nothing left out
    assert all(per_rank)  # every rank gets data, also with more ranks than files
    # a different epoch reshuffles
    if n_files >= 5:
        assert assign_shards(files, 0, world, 1, 1) != per_rank[0] or assign_shards(files, 0, world, 2, 1) != \
            per_rank[0]


def test_segments_partition_every_sample():
    sizes = {"a.h5": 70, "b.h5": 55, "c.h5": 90}
    for world in (1, 2, 3, 4, 7):
        seen: dict[str, list[int]] = {k: [] for k in sizes}
        for r in range(world):
            for s in plan_segments(sizes, r, world, epoch=3, seed=5, block_samples=16):
                assert 0 < s.size <= 16
                seen[s.path].extend(range(s.start, s.stop))
        assert all(sorted(v) == list(range(sizes[k])) for k, v in seen.items())  # each sample once
        nb = batches_per_epoch(sizes, world, 3, 5, micro_batch=4)
        assert nb == min(sum(s.size for s in plan_segments(sizes, r, world, 3, 5)) for r in range(world)) // 4


# ------------------------------------------------------------------------------------------------ batches
def test_batches_and_labels_match_the_files(shard_dir):
    rows = all_rows(shard_dir)
    data = build_data(shard_dir, rank=0, world_size=1, micro_batch=8, seed=3)
    assert (data.seq_len, data.max_predictions_per_seq, data.num_samples) == (L, P, sum(SIZES))
    batches = list(data)
    assert len(batches) == len(data) == sum(SIZES) // 8
    b = batches[0]
    for k in ("input_ids", "token_type_ids", "attention_mask", "labels"):
        assert b[k].dtype == torch.long and b[k].shape == (8, L)
    assert b["next_sentence_label"].dtype == torch.long and b["next_sentence_label"].shape == (8,)
    # every sample seen at most once per epoch; find each batch row in the files and check its labels
    index = {bytes(r.tobytes()): i for i, r in enumerate(rows["input_ids"])}
    seen = []
    for b in batches:
        for j in range(8):
            i = index[b["input_ids"][j].to(torch.int32).numpy().tobytes()]
            seen.append(i)
            expect = np.full(L, IGNORE_INDEX)
            pos, ids = rows["masked_lm_positions"][i], rows["masked_lm_ids"][i]
            expect[pos[pos > 0]] = ids[pos > 0]
            assert np.array_equal(b["labels"][j].numpy(), expect)
            assert np.array_equal(b["attention_mask"][j].numpy(), rows["input_mask"][i])
            assert np.array_equal(b["token_type_ids"][j].numpy(), rows["segment_ids"][i])
            assert b["next_sentence_label"][j] == rows["next_sentence_labels"][i]
    assert len(set(seen)) == len(seen)
    # the same epoch again is the same; the next epoch is another order
    data.set_epoch(0)
    again = next(iter(data))
    assert torch.equal(again["input_ids"], batches[0]["input_ids"])
    data.set_epoch(1)
    assert not torch.equal(next(iter(data))["input_ids"], batches[0]["input_ids"])
    data.close()


def test_prefetch_and_blocks_do_not_change_batches(shard_dir):
    ref = list(PretrainingData(shard_dir, 1, 2, 4, seed=0, prefetch=False, block_samples=1000))
    for prefetch, block in ((True, 1000), (True, 16), (False, 16)):
        got = PretrainingData(shard_dir, 1, 2, 4, seed=0, prefetch=prefetch, block_samples=block)
        batches = list(got)
        assert len(batches) == len(ref)
        if prefetch and block == 16:  # the block after the current one is already being read
            fresh = PretrainingData(shard_dir, 1, 2, 4, seed=0, prefetch=True, block_samples=16)
            next(iter(fresh))
            assert len(fresh._cache) == 2
            fresh.close(wait=True)
        if block == 1000:
            assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, ref))
        else:  # smaller blocks shuffle within smaller windows: other order (so another dropped tail), no repeats
            rows = [tuple(r) for r in torch.cat([b["input_ids"] for b in batches]).tolist()]
            assert len(set(rows)) == len(rows)
        got.close()


# ------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("world,block", [(2, 1000), (2, 16), (4, 16)])
def test_resume_equals_uninterrupted_across_ranks(shard_dir, world, block):
    """For every rank: state saved after k batches, loaded into a fresh loader (from JSON, as in a checkpoint),
    continues exactly with the batches an uninterrupted iterator yields, into the next epoch too."""
    mk = lambda r: PretrainingData(shard_dir, r, world, micro_batch=4, seed=11, block_samples=block)  # noqa: E731
    for rank in range(world):
        full = mk(rank)
        epoch0 = list(full)
        full.set_epoch(1)
        epoch1 = list(full)
        assert len(epoch0) == len(mk((rank + 1) % world))  # every rank the same number of batches
        for k in (0, 1, len(epoch0) // 2, len(epoch0) - 1, len(epoch0)):
            run = mk(rank)
            it = iter(run)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(run.state_dict()))
            assert state["epoch"] == 0 and state["batches"] == k and state["rank"] == rank
            resumed = mk(rank)
            resumed.load_state_dict(state)
            rest = list(resumed)
            assert len(rest) == len(epoch0) - k
            for x, y in zip(rest, epoch0[k:]):
                assert all(torch.equal(x[key], y[key]) for key in x)
            resumed.set_epoch(1)
            assert torch.equal(next(iter(resumed))["labels"], epoch1[0]["labels"])
        # the position is rank independent: rank 0's state puts another rank at its own next batch
        other = mk(rank)
        st = mk((rank + 1) % world)
        it = iter(st)
        next(it), next(it)
        other.load_state_dict(st.state_dict())
        assert torch.equal(next(iter(other))["input_ids"], epoch0[2]["input_ids"])


def test_resume_reads_one_block_and_replays_nothing(shard_dir, monkeypatch):
    import bert_ref.data as data_mod

    loads, made = [], []
    real_load, real_make = data_mod.load_block, data_mod.make_batch
    monkeypatch.setattr(data_mod, "load_block", lambda seg, L, v=None: loads.append(seg) or real_load(seg, L, v))
    monkeypatch.setattr(data_mod, "make_batch", lambda a, idx: made.append(len(idx)) or real_make(a, idx))
    ref = PretrainingData(shard_dir, 0, 1, 4, seed=2, prefetch=False, block_samples=16)
    n = len(ref)
    state = {**ref.state_dict(), "samples": (n - 1) * 4, "batches": n - 1}
    resumed = PretrainingData(shard_dir, 0, 1, 4, seed=2, prefetch=False, block_samples=16)
    resumed.load_state_dict(state)
    loads.clear(), made.clear()
    batches = list(resumed)
    assert len(batches) == 1 and sum(made) == 4  # only the one remaining batch is built
    assert 1 <= len(loads) <= 2  # the block the position falls in (and the next, if the batch straddles two)


def test_corrupt_chunk_found_while_reading(tmp_path):
    path = tmp_path / "c_training_0.hdf5"
    write_shard(path, synthetic_arrays(20000, L, P, V, seed=0), compression="gzip")  # ~10 chunks of input_ids
    with h5py.File(path, "r") as f:
        ds = f["input_ids"]
        middle = ds.id.get_chunk_info(ds.id.get_num_chunks() // 2)
    raw = bytearray(path.read_bytes())
    raw[middle.byte_offset:middle.byte_offset + 32] = b"\x00" * 32
    path.write_bytes(bytes(raw))
    data = PretrainingData(tmp_path, 0, 1, 8)  # first and last rows are fine: opens
    with pytest.raises(ShardError, match=r"c_training_0.hdf5 \[dataset 'input_ids'\]: cannot read"):
        list(data)


def test_resume_refuses_other_world_or_data(shard_dir):
    a = PretrainingData(shard_dir, 0, 2, 4)
    next(iter(a))
    state = a.state_dict()
    with pytest.raises(DataStateError, match="world_size=2 but this run has 1"):
        PretrainingData(shard_dir, 0, 1, 4).load_state_dict(state)
    with pytest.raises(DataStateError, match="fingerprint"):
        PretrainingData(shard_dir, 0, 2, 4).load_state_dict({**state, "fingerprint": "0"})


# ------------------------------------------------------------------------------------------------ bad input
def good(n=12) -> dict[str, np.ndarray]:
    return synthetic_arrays(n, L, P, V, seed=1)


def write_raw(path: Path, arrays: dict) -> None:
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)


def bad_cases():
    a = good()
    yield "missing", {k: v for k, v in a.items() if k != "masked_lm_ids"}, "masked_lm_ids", "missing dataset"
    yield "dtype", {**a, "input_ids": a["input_ids"].astype(np.int64)}, "input_ids", "dtype int64, expected int32"
    yield "shape", {**a, "segment_ids": a["segment_ids"][:, :-1]}, "segment_ids", "expected"
    yield "ndim", {**a, "next_sentence_labels": a["next_sentence_labels"][:, None]}, "next_sentence_labels", \
        "dimensions"
    yield "lengths", {**a, "input_mask": a["input_mask"][:-2]}, "input_mask", "10 samples but input_ids has 12"
    pos = a["masked_lm_positions"].copy()
    pos[5, 1] = L
    yield "positions", {**a, "masked_lm_positions": pos}, "masked_lm_positions", "out of range"
    pos = a["masked_lm_positions"].copy()
    pos[0, 0] = -1
    yield "negative", {**a, "masked_lm_positions": pos}, "masked_lm_positions", "out of range"
    yield "nsp", {**a, "next_sentence_labels": np.full(12, 2, np.int8)}, "next_sentence_labels", "0/1"


@pytest.mark.parametrize("case", list(bad_cases()), ids=lambda c: c[0])
def test_bad_files_name_file_and_dataset(tmp_path, case):
    _, arrays, dataset, problem = case
    write_raw(tmp_path / "x_training_0.hdf5", arrays)
    with pytest.raises(ShardError) as e:
        PretrainingData(tmp_path, 0, 1, 2)
    assert "x_training_0.hdf5" in str(e.value) and f"'{dataset}'" in str(e.value) and problem in str(e.value)


def test_truncated_and_corrupt_files(tmp_path):
    write_shard(tmp_path / "t_training_0.hdf5", synthetic_arrays(400, L, P, V, seed=0), compression="gzip")
    path = tmp_path / "t_training_0.hdf5"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ShardError, match="t_training_0.hdf5.*cannot open as HDF5"):
        PretrainingData(tmp_path, 0, 1, 2)
    path.write_bytes(b"not an hdf5 file at all" * 10)
    with pytest.raises(ShardError, match="t_training_0.hdf5.*cannot open as HDF5"):
        PretrainingData(tmp_path, 0, 1, 2)
    # corrupt data chunk: the file opens, the read of the damaged dataset fails, named
    write_shard(path, synthetic_arrays(400, L, P, V, seed=0), compression="gzip")
    with h5py.File(path, "r") as f:
        offset = f["input_ids"].id.get_offset() if f["input_ids"].chunks is None else \
            f["input_ids"].id.get_chunk_info(0).byte_offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"t_training_0.hdf5 \[dataset 'input_ids'\]: cannot read"):
        PretrainingData(tmp_path, 0, 1, 2)


def test_mixed_lengths_and_missing_dir(tmp_path):
    with pytest.raises(DataDirError, match="not found"):
        build_data(tmp_path / "nope", 0, 1, 2)
    with pytest.raises(DataDirError, match="no h5 shards"):
        build_data(tmp_path, 0, 1, 2)
    (tmp_path / "partial.hdf5.tmp123").write_bytes(b"x")  # an unfinished write never counts
    with pytest.raises(DataDirError, match="no h5 shards"):
        build_data(tmp_path, 0, 1, 2)
    write_shard(tmp_path / "a_training.hdf5", synthetic_arrays(8, L, P, V))
    write_shard(tmp_path / "b_training.hdf5", synthetic_arrays(8, 2 * L, P, V))
    with pytest.raises(ShardError, match="b_training.hdf5.*seq_len 64 differs from 32"):
        build_data(tmp_path, 0, 1, 2)


def test_only_held_out_shards_are_refused_by_name(tmp_path):
    """A directory of `bert_test_*` shards alone (a wrong --input_dir) is never trained on: it used to be taken as
    the training set (and then evaluated on as well)."""
    for i in range(2):
        write_shard(tmp_path / f"bert_test_{i}.hdf5", synthetic_arrays(8, L, P, V, seed=i))
    with pytest.raises(DataDirError, match=r"only held-out test shards \(bert_test_0.hdf5, bert_test_1.hdf5\)"):
        build_data(tmp_path, 0, 1, 2)
    assert len(list_test_shards(tmp_path)) == 2  # eval still finds them
    write_shard(tmp_path / "bert_0.hdf5", synthetic_arrays(8, L, P, V, seed=3))  # an unnamed training file
    assert [Path(f).name for f in build_data(tmp_path, 0, 1, 2).files] == ["bert_0.hdf5"]


def test_masked_position_in_the_padding_fails_at_block_read(tmp_path):
    """Row 300 (past the rows inspected at open) masks a padding position: the block read refuses it, naming the
    file, the dataset and the row, before the first batch is handed out."""
    a = synthetic_arrays(600, L, P, V, seed=7)
    row = 300
    length = int(a["input_mask"][row].sum())
    assert length < L  # the row has padding
    n = int((a["masked_lm_positions"][row] > 0).sum())
    a["masked_lm_positions"][row, n - 1] = length  # the first padding position, still sorted and in range
    write_raw(tmp_path / "pad_training_0.hdf5", a)
    data = PretrainingData(tmp_path, 0, 1, 2, prefetch=False)
    with pytest.raises(ShardError) as e:
        next(iter(data))
    msg = str(e.value)
    assert "pad_training_0.hdf5" in msg and "'masked_lm_positions'" in msg and "first at sample 300" in msg, msg
    assert f"masked position {length} lies in the padding" in msg


def test_nvidia_layout_reads_unchanged(tmp_path):
    """A file written the way NVIDIA's create_pretraining_data.py writes it (h5py, 'i4'/'i1', gzip)."""
    a = synthetic_arrays(20, L, P, V, seed=4)
    with h5py.File(tmp_path / "books_wiki_en_corpus_training_0.hdf5", "w") as f:
        f.create_dataset("input_ids", data=a["input_ids"], dtype="i4", compression="gzip")
        f.create_dataset("input_mask", data=a["input_mask"], dtype="i1", compression="gzip")
        f.create_dataset("segment_ids", data=a["segment_ids"], dtype="i1", compression="gzip")
        f.create_dataset("masked_lm_positions", data=a["masked_lm_positions"], dtype="i4", compression="gzip")
        f.create_dataset("masked_lm_ids", data=a["masked_lm_ids"], dtype="i4", compression="gzip")
        f.create_dataset("next_sentence_labels", data=a["next_sentence_labels"], dtype="i1", compression="gzip")
    data = build_data(tmp_path, 0, 1, 20)
    b = next(iter(data))
    assert int((b["labels"] != IGNORE_INDEX).sum()) == int((a["masked_lm_positions"] > 0).sum())


# ------------------------------------------------------------------------------------------ vocabulary checks
@pytest.mark.parametrize("dataset", ["input_ids", "masked_lm_ids"])
def test_out_of_vocab_ids_fail_at_block_read_naming_file_dataset_row(tmp_path, dataset):
    """NVIDIA-style file (no vocab_size attribute): ids are checked against the model's vocabulary. Row 300 is past
    the rows inspected at open, so the block read finds it, before the first batch is handed out."""
    a = synthetic_arrays(600, L, P, V, seed=5)
    col = 3 if dataset == "input_ids" else 0  # masked_lm_ids column 0 is a real masked token in every row
    a[dataset][300, col] = 5000
    write_raw(tmp_path / "nv_training_0.hdf5", a)
    data = PretrainingData(tmp_path, 0, 1, 2, vocab_size=1024, prefetch=False)
    with pytest.raises(ShardError) as e:
        next(iter(data))
    msg = str(e.value)
    assert "nv_training_0.hdf5" in msg and f"'{dataset}'" in msg and "first at sample 300" in msg, msg
    assert "[0, 1024)" in msg
    # the same file is fine for a model with a larger vocabulary
    assert next(iter(PretrainingData(tmp_path, 0, 1, 2, vocab_size=8192, prefetch=False)))["input_ids"].shape[0] == 2


def test_vocab_attribute_is_the_bound_and_checked_at_open(tmp_path):
    a = synthetic_arrays(40, L, P, V, seed=6)
    write_shard(tmp_path / "b_training_0.hdf5", a, vocab_size=2000)
    with pytest.raises(ShardError, match=r"b_training_0.hdf5.*vocabulary of 2000 tokens.*vocab_size is 1024"):
        PretrainingData(tmp_path, 0, 1, 2, vocab_size=1024)
    # ids checked against the file's own vocabulary even when the model's is larger (or unknown)
    a["input_ids"][0, 2] = 250
    write_shard(tmp_path / "b_training_0.hdf5", a, vocab_size=200)
    with pytest.raises(ShardError, match=r"'input_ids'.*out of the vocabulary \[0, 200\).*first at sample 0"):
        PretrainingData(tmp_path, 0, 1, 2, vocab_size=30528)
    write_shard(tmp_path / "b_training_0.hdf5", synthetic_arrays(40, L, P, 200, seed=6), vocab_size=200)
    data = PretrainingData(tmp_path, 0, 1, 2)
    assert data.vocab_size == 200 and len(list(data)) == 20


# ------------------------------------------------------------------------------------------ held-out shares
def test_eval_ranges_partition():
    from bert_ref.eval import eval_ranges

    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(1, 40, size=rng.integers(1, 5)).tolist()
        world = int(rng.integers(1, 9))
        seen = []
        for r in range(world):
            for i, s, e in eval_ranges(sizes, r, world):
                seen += [(i, k) for k in range(s, e)]
        assert seen == [(i, k) for i, n in enumerate(sizes) for k in range(n)]


@pytest.mark.parametrize("world,micro", [(1, 4), (2, 4), (3, 5)])
def test_eval_data_yields_every_test_sample_once(tmp_path, world, micro):
    """Test files of 13 + 9 samples: no rank count divides by world x micro; every rank runs the same number of
    forward passes (padding ones carry weight 0) and the weighted rows are exactly the test samples."""
    from bert_ref.eval import EvalData

    for i, n in enumerate((13, 9)):
        write_shard(tmp_path / f"bert_test_{i}.hdf5", synthetic_arrays(n, L, P, V, seed=20 + i))
    write_shard(tmp_path / "bert_training_0.hdf5", synthetic_arrays(8, L, P, V, seed=30))
    files = list_test_shards(tmp_path)
    assert [Path(f).name for f in files] == ["bert_test_0.hdf5", "bert_test_1.hdf5"]
    expect = np.concatenate([h5py.File(f, "r")["input_ids"][:] for f in files])
    rows, passes = [], set()
    for r in range(world):
        data = EvalData(files, r, world, micro, block_samples=4)  # small blocks: batches join blocks and files
        got = list(data)
        passes.add(len(got))
        for batch, n in got:
            assert 0 <= n <= micro and len(batch["input_ids"]) == max(n, 1)
            rows.append(batch["input_ids"][:n].numpy())
    assert len(passes) == 1
    np.testing.assert_array_equal(np.concatenate(rows), expect)  # in order, once each
