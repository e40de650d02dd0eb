"""Resuming a data epoch on another world size (the data side), both loaders, pure data (no engine).

For W -> W' at several positions (mid-block / mid-file, epoch end): the samples consumed before the checkpoint and
after the resume are each seen once, and together they are the uninterrupted run's epoch, less a dropped tail of
fewer than W' x micro batch samples. Same W: exactly the order the loaders produced before resizing was
supported (digests of it, recorded by running the same loops)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from bert_ref.data import DataStateError, PretrainingData
from bert_ref.prep.h5io import synthetic_arrays, write_shard
from ds_core.outputs.sample_log import ENV, read_sample_log

L, P, V = 32, 5, 300
SIZES = (70, 55, 90, 23)
RESIZES = [(2, 1), (1, 2), (2, 3), (3, 2)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, dict[bytes, int]]:
    """Shards, and each sample's global index (position in the sorted files' concatenation) keyed by its ids."""
    d = tmp_path_factory.mktemp("h5")
    rows = []
    for i, n in enumerate(SIZES):
        a = synthetic_arrays(n, L, P, V, seed=i)
        write_shard(d / f"bert_training_seq{L}_{i:05d}.hdf5", a)
        rows.append(a["input_ids"])
    key = {r.tobytes(): i for i, r in enumerate(np.concatenate(rows).astype(np.int64))}
    assert len(key) == sum(SIZES)  # every sample recognisable by its ids
    return d, key


def ids(batch, key) -> list[int]:
    return [key[row.numpy().tobytes()] for row in batch["input_ids"]]


def bert(d, world, micro=4, block=16, seed=11):
    return [PretrainingData(d, r, world, micro, seed=seed, block_samples=block, prefetch=False) for r in range(world)]


def consume(loaders, key, k=None) -> list[list[int]]:
    """k batches (None: the rest of the epoch) from every rank, as the loop does; sample indices per rank."""
    out = []
    for data in loaders:
        it, got = iter(data), []
        for batch in it if k is None else (next(it) for _ in range(k)):
            got += ids(batch, key)
        out.append(got)
    return out


def saved(loaders) -> list[dict]:
    return [json.loads(json.dumps(x.state_dict())) for x in loaders]  # through JSON, as a checkpoint would


def flat(per_rank: list[list[int]]) -> list[int]:
    return [i for r in per_rank for i in r]


# ------------------------------------------------------------------------------------------- same world size
# sha1 of the index sequences the loaders yielded before resizing was supported (recorded at commit 5b34ada with
# the same loops): a same-size resume and a normal epoch must not move a single sample.
BERT_MAIN = {(1, 4, 16, 11): "17d60ab8facac6e1", (1, 5, 1000, 3): "9333e5f2979e8816",
             (1, 3, 7, 0): "6ab06ed46f5fb3de", (2, 4, 16, 11): "8e73aafafb530d38",
             (2, 5, 1000, 3): "0259fccbe218697c", (2, 3, 7, 0): "c9fdbb4f9937f7f6",
             (3, 4, 16, 11): "0d0d01f81d4f9d5d", (3, 5, 1000, 3): "71cd2aaf325e7960",
             (3, 3, 7, 0): "7e82f74c9e7be4a1", (5, 4, 16, 11): "c18dd3a25f2eb457",
             (5, 5, 1000, 3): "328d0389a0c5335c", (5, 3, 7, 0): "cf9a67718a0fa5a6"}


@pytest.mark.parametrize("cfg", sorted(BERT_MAIN))
def test_bert_order_is_the_one_main_produced(shards, cfg):
    d, key = shards
    world, micro, block, seed = cfg
    per_rank = []
    for data in bert(d, world, micro, block, seed):
        seq = []
        for ep in (0, 1):
            data.set_epoch(ep)
            seq.append([i for b in data for i in ids(b, key)])
        per_rank.append(seq)
    assert hashlib.sha1(json.dumps(per_rank).encode()).hexdigest()[:16] == BERT_MAIN[cfg]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bert_same_world_resume_through_load_state_dicts_is_uninterrupted(shards, world):
    d, key = shards
    full = consume(bert(d, world), key)
    n = len(full[0]) // 4
    for k in (0, 3, n // 2, n):
        before = bert(d, world)
        head = consume(before, key, k)
        after = bert(d, world)
        states = saved(before)
        for x in after:
            x.load_state_dicts(states)
        assert [h + t for h, t in zip(head, consume(after, key))] == full


# ------------------------------------------------------------------------------------------- another world size
def check_exactly_once(epoch: list[int], before: list[int], after: list[int], world_after: int, micro: int,
                       batches_after: int) -> None:
    seen = before + after
    assert len(seen) == len(set(seen)), "a sample was repeated"
    assert set(seen) <= set(epoch), "a sample from outside the epoch"
    assert len(after) == world_after * micro * batches_after
    dropped = set(epoch) - set(seen)
    assert len(dropped) < world_after * micro, f"{len(dropped)} samples skipped"


@pytest.mark.parametrize("w0,w1", RESIZES)
def test_bert_resize_sees_the_rest_of_the_epoch_once(shards, w0, w1):
    d, key = shards
    epoch = flat(consume(bert(d, w0), key))
    n = len(bert(d, w0)[0])
    # 5 x micro 4 = 20 samples: mid-block (blocks of <= 16), mid-file, the last batch, the epoch's end
    for k in sorted({0, 1, 5, n // 2, n - 1, n}):
        before = bert(d, w0)
        head = flat(consume(before, key, k))
        after = bert(d, w1)
        states = saved(before)
        for x in after:
            x.load_state_dicts(states)
        lens = {len(x) for x in after}
        assert len(lens) == 1  # every new rank runs the same number of batches
        tail = flat(consume(after, key))
        check_exactly_once(epoch, head, tail, w1, 4, lens.pop())
        # the next epoch is a normal one at the new size
        fresh = bert(d, w1)
        for x, y in zip(after, fresh):
            x.set_epoch(1), y.set_epoch(1)
        assert consume(after, key) == consume(fresh, key)


def test_bert_resize_twice_in_one_epoch_and_resume_the_resized_plan(shards):
    """2 -> 3 -> 2 -> 2 (a same-size resume of a dealt plan) in one epoch, with another micro batch on the way."""
    d, key = shards
    epoch = flat(consume(bert(d, 2), key))
    a = bert(d, 2)
    seen = flat(consume(a, key, 3))
    b = bert(d, 3, micro=3)
    for x in b:
        x.load_state_dicts(saved(a))
    seen += flat(consume(b, key, 2))
    c = bert(d, 2)
    for x in c:
        x.load_state_dicts(saved(b))
    assert all(len(st["history"]) == 2 for st in saved(c))
    seen += flat(consume(c, key, 1))
    rest = [x.state_dict() for x in c]
    ref = flat(consume(c, key))  # the uninterrupted continuation of the dealt plan
    e = bert(d, 2)
    for x in e:
        x.load_state_dicts(json.loads(json.dumps(rest)))
    tail = flat(consume(e, key))
    assert tail == ref
    seen += tail
    assert len(seen) == len(set(seen)) and set(seen) <= set(epoch)
    assert len(set(epoch) - set(seen)) < 3 * 3 + 2 * 4  # at most one tail dropped per resize


def test_bert_same_world_with_another_block_size_continues_from_what_was_consumed(shards):
    """The saved plan's blocks are not this loader's: the position is re-planned like a resize, not misread."""
    d, key = shards
    epoch = flat(consume(bert(d, 2, block=16), key))
    before = bert(d, 2, block=16)
    head = flat(consume(before, key, 5))
    after = bert(d, 2, block=1000)
    for x in after:
        x.load_state_dict(json.loads(json.dumps(before[x.rank].state_dict())))
    tail = flat(consume(after, key))
    check_exactly_once(epoch, head, tail, 2, 4, len(after[0]))
    assert saved(after)[0]["history"][0]["block_samples"] == 16


def test_bert_block_reads_stay_block_reads_after_a_resize(shards, monkeypatch):
    """Dealt ranges are consecutive in the pool: each block is read once per rank that reads from it."""
    import bert_ref.data as data_mod

    d, key = shards
    loads = []
    real = data_mod.load_block
    monkeypatch.setattr(data_mod, "load_block", lambda seg, L, v=None: loads.append(seg) or real(seg, L, v))
    before = bert(d, 3)
    consume(before, key, 5)
    after = bert(d, 2)
    for x in after:
        x.load_state_dicts(saved(before))
    for x in after:
        loads.clear()
        consume([x], key)
        assert len(loads) == len(set(loads))  # no block read twice


def test_bert_refuses_states_that_are_not_one_checkpoint(shards):
    d, key = shards
    a = bert(d, 2)
    consume(a, key, 2)
    st = saved(a)
    x = bert(d, 1)[0]
    with pytest.raises(DataStateError, match="world_size=2 but this run has 1.*load_state_dicts"):
        x.load_state_dict(st[0])
    with pytest.raises(DataStateError, match="state 0 of 1 has world_size=2, expected 1"):
        x.load_state_dicts(st[:1])
    with pytest.raises(DataStateError, match="state 1 of 2 has rank=0, expected 1"):
        x.load_state_dicts([st[0], st[0]])
    with pytest.raises(DataStateError, match="state 1 of 2 has epoch=1 but rank 0's has 0"):
        x.load_state_dicts([st[0], {**st[1], "epoch": 1}])
    with pytest.raises(DataStateError, match="seed=12 but this run has 11"):
        x.load_state_dicts([{**s, "seed": 12} for s in st])
    with pytest.raises(DataStateError, match="does not fit its plan"):
        x.load_state_dicts([{**s, "samples": 10**6} for s in st])


def test_bert_sample_log_is_what_was_yielded(shards, tmp_path, monkeypatch):
    d, key = shards
    monkeypatch.setenv(ENV, str(tmp_path / "log"))
    a = bert(d, 2)
    head = consume(a, key, 3)
    b = bert(d, 1)
    for x in b:
        x.load_state_dicts(saved(a))
    tail = consume(b, key)
    log0, log1 = (read_sample_log(tmp_path / "log" / f"rank{r}.jsonl") for r in (0, 1))
    assert [len(r["indices"]) for r in log1] == [4] * 3
    assert [i for r in log1 for i in r["indices"]] == head[1]
    assert [i for r in log0 for i in r["indices"]] == head[0] + tail[0]  # rank 0 of both runs, appended
    assert {r["epoch"] for r in log0 + log1} == {0}


# ================================================================================================ BridgeTower
from bridgetower_ds import batching as BT, data as D  # noqa: E402
from test_bt_data import S, args_for, make_manifest, tiny_tokenizer  # noqa: E402

# sha1 of BatchPlan.rank_batches of epochs 0 and 1 on every rank (seed 7), recorded at commit 5b34ada
BT_MAIN = {(12, 1, 2): "fc38d2c2784db02e", (12, 1, 3): "a045d5c2a74dc931", (12, 1, 4): "3d7db377464f86b9",
           (12, 2, 2): "c7244ad315328a93", (12, 2, 3): "cc6717afaa744386", (12, 2, 4): "1360a4f3dd464642",
           (12, 3, 2): "b10f329f8f2d9b8c", (12, 3, 3): "fa2b0b50e561d1c6", (12, 3, 4): "ba92043c2b2389d2",
           (37, 1, 2): "f467db6ea34b36c2", (37, 1, 3): "609ac8b3b1c3aae0", (37, 1, 4): "4dae26231ad655fb",
           (37, 2, 2): "b3a4f2645ce3cbea", (37, 2, 3): "43bdb0ad004f652a", (37, 2, 4): "196b36305d66e601",
           (37, 3, 2): "4e51d1cc68218cf6", (37, 3, 3): "d82a2e36ec38f706", (37, 3, 4): "b00a4ca8b2fae76d",
           (100, 1, 2): "6bcc43a86e1bbab8", (100, 1, 3): "87e21cb557b1d7cf", (100, 1, 4): "f126c93dfabbc03a",
           (100, 2, 2): "3aadf6bda9de90fc", (100, 2, 3): "858ba6f21f9ced84", (100, 2, 4): "db802f35a476d24d",
           (100, 3, 2): "603f06de3f2adf1b", (100, 3, 3): "62ea5bd6132a1ec7", (100, 3, 4): "d7d8c29b1aa9faa5"}


@pytest.mark.parametrize("cfg", sorted(BT_MAIN))
def test_bt_plan_is_the_one_main_produced(cfg):
    n, world, micro = cfg
    plans = [[[b.tolist() for b in BT.BatchPlan(n, r, world, micro, 7, True).rank_batches(ep)] for ep in (0, 1)]
             for r in range(world)]
    assert hashlib.sha1(json.dumps(plans).encode()).hexdigest()[:16] == BT_MAIN[cfg]


def bt_state(plan: BT.BatchPlan, epoch: int, k: int, window=None) -> dict:
    """What CaptionData.state_dict saves after k batches (the plan's fields)."""
    return {"epoch": epoch, "sample_offset": plan.sample_offset(epoch, k, window),
            "window": list(window) if window else None, "seed": plan.seed, "world_size": plan.world_size,
            "micro_batch": plan.micro_batch, "rows": plan.rows}


@pytest.mark.parametrize("n,micro", [(23, 3), (37, 2), (40, 4)])
@pytest.mark.parametrize("w0,w1", RESIZES)
def test_bt_plan_resize_sees_the_rest_of_the_epoch_once(n, micro, w0, w1):
    epoch = 2
    old = [BT.BatchPlan(n, r, w0, micro, 5, True) for r in range(w0)]
    full = [b for p in old for b in p.rank_batches(epoch)]
    epoch_rows = np.concatenate(full).tolist()
    nb = len(old[0].rank_batches(epoch))
    for k in range(nb + 1):
        before = [int(x) for p in old for b in p.rank_batches(epoch)[:k] for x in b]
        states = [bt_state(p, epoch, k) for p in old]
        ep, window = BT.resume_window(states, n, 5)
        new = [BT.BatchPlan(n, r, w1, micro, 5, True) for r in range(w1)]
        batches = [p.rank_batches(ep, window) for p in new]
        assert ep == epoch and len({len(b) for b in batches}) == 1  # every new rank runs the same steps
        after = [int(x) for bs in batches for b in bs for x in b]
        seen = before + after
        assert len(seen) == len(set(seen)) and set(seen) <= set(epoch_rows)
        assert len(set(epoch_rows) - set(seen)) < w1 * max(micro, 2)
        # the position is still a prefix of the global order, on the new world size too
        order = new[0].order(epoch).tolist()
        for j in range(len(batches[0]) + 1):
            off = new[0].sample_offset(epoch, j, window)
            assert sorted(before + [int(x) for bs in batches for b in bs[:j] for x in b]) == sorted(order[:off])
            assert new[0].batches_done(epoch, off, window) == j


def test_bt_resume_window_refuses_what_is_not_one_checkpoint():
    plans = [BT.BatchPlan(20, r, 2, 2, 0, True) for r in range(2)]
    states = [bt_state(p, 0, 2) for p in plans]
    with pytest.raises(ValueError, match="state 1 of 2 has sample_offset=4 but rank 0's has 8"):
        BT.resume_window([states[0], bt_state(plans[1], 0, 1)], 20, 0)
    with pytest.raises(ValueError, match="state 0 of 1 has world_size=2, expected 1"):
        BT.resume_window(states[:1], 20, 0)
    with pytest.raises(ValueError, match="rows 20, this run has 21"):
        BT.resume_window(states, 21, 0)
    with pytest.raises(ValueError, match="outside its epoch's plan"):
        BT.resume_window([{**s, "sample_offset": 40} for s in states], 20, 0)


def bt_sources(args, table, tok, world, micro=2):
    return [D.CaptionData(args, table, tok, S, r, world, micro, 11, "cpu") for r in range(world)]


def bt_consume(sources, k=None) -> list[list[int]]:
    out = []
    for data in sources:
        it, got = iter(data), []
        for batch in it if k is None else (next(it) for _ in range(k)):
            got += batch["index"].tolist()
        out.append(got)
    return out


@pytest.mark.parametrize("w0,w1", RESIZES)
def test_bt_caption_data_resize_and_sample_log(tmp_path, monkeypatch, w0, w1):
    """Real images through the host pipeline: W -> W' mid-epoch and at the epoch's end; the log holds the rows."""
    monkeypatch.setenv(ENV, str(tmp_path / "log"))
    args, tok = args_for(make_manifest(tmp_path, n=17)), tiny_tokenizer()
    table = D.select_split(args, "train")
    epoch_rows = flat(bt_consume(bt_sources(args, table, tok, w0)))
    nb = len(bt_sources(args, table, tok, w0)[0])
    for k in (1, nb):
        (tmp_path / "log").exists() and [f.unlink() for f in (tmp_path / "log").iterdir()]
        before = bt_sources(args, table, tok, w0)
        head = flat(bt_consume(before, k))
        after = bt_sources(args, table, tok, w1)
        states = [json.loads(json.dumps(x.state_dict())) for x in before]
        for x in after:
            x.load_state_dicts(states)
        tail = flat(bt_consume(after))
        seen = head + tail
        assert len(seen) == len(set(seen)) and set(seen) <= set(epoch_rows)
        assert len(set(epoch_rows) - set(seen)) < w1 * 2
        logged = [i for r in range(max(w0, w1)) if (tmp_path / "log" / f"rank{r}.jsonl").exists()
                  for rec in read_sample_log(tmp_path / "log" / f"rank{r}.jsonl") for i in rec["indices"]]
        assert sorted(logged) == sorted(seen)
        if k == nb:
            assert tail == []  # resumed at the epoch's end: nothing left, the next epoch is whole
            for x in after:
                x.set_epoch(1)
            assert sorted(flat(bt_consume(after))) == sorted(flat(bt_consume(
                [x for x in bt_sources(args, table, tok, w1) if x.set_epoch(1) or True])))


def test_bt_same_world_resume_through_load_state_dicts_and_a_resized_plan_resumes(tmp_path):
    args, tok = args_for(make_manifest(tmp_path, n=17)), tiny_tokenizer()
    table = D.select_split(args, "train")
    a = bt_sources(args, table, tok, 2)
    head = bt_consume(a, 1)
    b = bt_sources(args, table, tok, 2)
    for x in b:
        x.load_state_dicts([x.state_dict() for x in a])
    assert [h + t for h, t in zip(head, bt_consume(b))] == bt_consume(bt_sources(args, table, tok, 2))
    # 2 -> 3, one batch, then 3 -> 3 from the resized plan's state equals going on uninterrupted
    c = bt_sources(args, table, tok, 3)
    for x in c:
        x.load_state_dicts([y.state_dict() for y in bt_sources(args, table, tok, 2)])  # epoch start, window all
    bt_consume(c, 1)
    states = [json.loads(json.dumps(x.state_dict())) for x in c]
    assert all(st["window"] for st in states)
    d = bt_sources(args, table, tok, 3)
    for x in d:
        x.load_state_dicts(states)
    assert bt_consume(d) == bt_consume(c)
