"""bridgetower_ds.batching: the one batch plan (order, rank share, global position) and the one assembly (bad rows,
fill-in, padding policy), and the HPU media pipe's feeding through them with a stand-in decoder. No DeepSpeed."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bridgetower_ds import batching as B, data as D, hpu_media
from bridgetower_ds.images import host_transform, normalize, read_bytes
from test_bt_data import S, args_for, collect, make_manifest, tiny_tokenizer


# ---------------------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_position_is_a_prefix_of_the_global_order(world):
    n, micro, epoch = 23, 3, 4
    plans = [B.BatchPlan(n, r, world, micro, seed=9, train=True) for r in range(world)]
    order = B.epoch_order(n, epoch, 9, shuffle=True)
    assert np.array_equal(order, plans[0].order(epoch))  # the global order does not depend on the world size
    per_rank = [p.rank_batches(epoch) for p in plans]
    assert len({len(b) for b in per_rank}) == 1  # every rank runs the same number of steps
    for k in range(len(per_rank[0]) + 1):
        done = sorted(int(r) for b in per_rank for batch in b[:k] for r in batch)
        offset = plans[0].sample_offset(epoch, k)
        assert done == sorted(order[:offset].tolist())  # consumed rows = the first `offset` of the global order
        assert plans[0].batches_done(epoch, offset) == k
    assert len(set(plans[0].sample_offset(epoch, k) for k in range(3))) == 3


def test_position_that_is_no_batch_boundary_is_refused_with_the_numbers():
    plan = B.BatchPlan(20, 0, 2, 3, seed=0, train=True)
    with pytest.raises(ValueError, match="not a micro batch boundary for world size 2 x micro batch 3"):
        plan.batches_done(0, 7)


def test_train_drops_a_last_batch_of_one_row_eval_rebalances_it():
    sizes = lambda bs: [len(b) for b in bs]  # noqa: E731
    assert sizes(B.BatchPlan(10, 0, 1, 3, 0, train=True).rank_batches(0)) == [3, 3, 3]  # 1-row tail dropped
    assert sizes(B.BatchPlan(11, 0, 1, 3, 0, train=True).rank_batches(0)) == [3, 3, 3, 2]
    assert sizes(B.BatchPlan(22, 1, 2, 4, 0, train=True).rank_batches(0)) == [4, 4, 3]  # 11 per rank
    assert sizes(B.BatchPlan(10, 0, 1, 3, 0, train=False).rank_batches(0)) == [3, 3, 2, 2]
    assert sizes(B.BatchPlan(5, 0, 1, 2, 0, train=False).rank_batches(0)) == [2, 3]
    assert sizes(B.BatchPlan(1, 0, 1, 4, 0, train=False).rank_batches(0)) == [1]
    assert sizes(B.BatchPlan(3, 0, 1, 1, 0, train=True).rank_batches(0)) == [1, 1, 1]  # micro 1: global negatives
    every = np.concatenate(B.BatchPlan(10, 0, 1, 3, 0, train=False).rank_batches(0))
    assert sorted(every.tolist()) == list(range(10))


@pytest.mark.parametrize("n,micro", [(10, 8), (17, 4), (5, 2)])
def test_eval_batches_are_the_same_on_any_world_size(n, micro):
    def batches(world):
        return sorted(tuple(b.tolist()) for r in range(world)
                      for b in B.BatchPlan(n, r, world, micro, 0, train=False).rank_batches(0))
    assert batches(1) == batches(2) == batches(3)


# ---------------------------------------------------------------------------------------------------- assembly
def _tokens(tok, captions, pad_to_max, max_len=16):
    return B.tokenize(tok, captions, max_len, pad_to_max)


def _assembler(world=1, pad_to_max=False, min_rows=2, fill_in=True, first_valid=None):
    return B.BatchAssembler(size=4, device="cpu", world_size=world, pad_to_max=pad_to_max, min_rows=min_rows,
                            fill_in=fill_in, bad=B.BadImageLog("skip"), first_valid=first_valid or (lambda: None))


def test_batch_on_an_accelerator_keeps_its_counts_on_the_host():
    """The model's inputs go to the device; index and caption_tokens stay on the host, so the step counts samples and
    tokens without reading anything back from the device. The device here is meta: any read-back from it raises."""
    from bridgetower_ds.step import step_fn

    class MetaEngine:
        device = torch.device("meta")

        def __call__(self, input_ids, attention_mask, pixel_values, return_loss):
            assert {t.device.type for t in (input_ids, attention_mask, pixel_values)} == {"meta"}
            return SimpleNamespace(loss=torch.zeros((), device="meta"))

    toks = _tokens(tiny_tokenizer(), ["a cat", "a small dog sleeps", "x"], False)
    lengths = toks["attention_mask"].sum(dim=1).tolist()
    assembler = B.BatchAssembler(size=4, device="meta", world_size=2, pad_to_max=False, min_rows=2, fill_in=True,
                                 bad=B.BadImageLog("skip"), first_valid=lambda: None)
    batch = assembler.assemble(torch.randn(2, 3, 4, 4), [0, 1], toks, torch.tensor([7, 8, 9]))  # row 2 dropped
    assert batch["input_ids"].device.type == batch["pixel_values"].device.type == "meta"
    assert batch["index"].tolist() == [7, 8] and batch["caption_tokens"].tolist() == lengths[:2]
    out = step_fn(MetaEngine(), batch)
    assert (out.samples, out.tokens) == (2, sum(lengths[:2])) and out.loss.device.type == "meta"
    filler = step_fn(MetaEngine(), assembler.fill_in())  # repeated rows: counted as nothing
    assert (filler.samples, filler.tokens) == (0, 0)


def test_padding_policy_is_decided_once_and_dropped_rows_do_not_widen_the_batch():
    assert B.pad_to_max_length(False, "cpu") is False and B.pad_to_max_length(True, "cpu") is True
    assert B.pad_to_max_length(False, torch.device("hpu")) is True  # static shapes on Gaudi
    tok = tiny_tokenizer()
    caps = ["a cat", "a photo of number 1 red blue cat dog", "a dog"]
    px = torch.zeros(2, 3, 4, 4)
    longest = _assembler().assemble(px, [0, 2], _tokens(tok, caps, False), torch.tensor([5, 6, 7]))
    assert longest["input_ids"].shape == (2, 2) and longest["index"].tolist() == [5, 7]  # long caption dropped
    fixed = _assembler(pad_to_max=True).assemble(px, [0, 2], _tokens(tok, caps, True), torch.tensor([5, 6, 7]))
    assert fixed["input_ids"].shape == (2, 16)
    assert torch.equal(fixed["input_ids"][:, :2], longest["input_ids"])


def test_fill_in_one_rank_skips_several_ranks_repeat_the_last_good_batch():
    tok = tiny_tokenizer()
    toks = _tokens(tok, ["a cat", "a dog"], False)
    px = torch.randn(2, 3, 4, 4)
    bad = [("x.jpg", "file not found")]
    one = _assembler(world=1)
    assert one.assemble(px[:1], [0], toks, torch.tensor([0, 1]), bad) is None  # one valid row: no negative
    assert one.fill_in() is None and one.bad.count == 1
    first = {"input_ids": toks["input_ids"], "attention_mask": toks["attention_mask"], "index": torch.tensor([8, 9]),
             "pixel_values": px, "pixel_mask": torch.ones(2, 4, 4, dtype=torch.long)}
    two = _assembler(world=2, first_valid=lambda: first)
    early = two.fill_in()  # nothing good seen yet: the first valid rows
    assert early["index"].tolist() == [-1, -1] and torch.equal(early["pixel_values"], px)
    good = two.assemble(px, [0, 1], toks, torch.tensor([3, 4]))
    filler = two.fill_in()
    assert good["index"].tolist() == [3, 4] and filler["index"].tolist() == [-1, -1]
    assert torch.equal(filler["pixel_values"], good["pixel_values"]) and two.filler_batches == 2
    evaluation = _assembler(world=2, min_rows=1, fill_in=False)
    assert evaluation.assemble(px[:1], [1], toks, torch.tensor([3, 4]))["index"].tolist() == [4]
    assert evaluation.fill_in() is None


def test_bad_image_log_counts_keeps_examples_or_raises():
    from bridgetower_ds.images import BadImage

    log = B.BadImageLog("skip")
    log.record([("a.jpg", "empty file (0 bytes)")] * 3)  # one image met 3 times (e.g. 3 epochs): counted once
    log.record([("b.jpg", "file not found")])
    assert log.count == 2 and log.examples == ["a.jpg: empty file (0 bytes)", "b.jpg: file not found"]
    log.restore(["x.jpg"], count=5)  # a checkpoint saved before names were kept: its count is kept
    assert log.count == 5
    log.record([("x.jpg", "file not found")])
    assert log.count == 5
    with pytest.raises(BadImage, match="a.jpg.*--bad_image error"):
        B.BadImageLog("error").record([("a.jpg", "file not found")])


# ---------------------------------------------------------------------------------------------------- data source
def test_resume_offset_is_global_and_old_local_offsets_still_load(tmp_path):
    path = make_manifest(tmp_path, n=14)
    args, tok = args_for(path), tiny_tokenizer()
    table = D.select_split(args, "train")
    part = D.CaptionData(args, table, tok, S, 1, 2, 2, 11, "cpu")
    part.set_epoch(3)
    it = iter(part)
    next(it), next(it)
    state = json.loads(json.dumps(part.state_dict()))
    assert state["sample_offset"] == 2 * 2 * 2  # 2 batches x micro 2 x 2 ranks of the epoch's global order
    resumed = D.CaptionData(args, table, tok, S, 1, 2, 2, 11, "cpu")
    resumed.load_state_dict(state)
    assert resumed.batches_done == 2 and len(resumed.pending_batches()) == len(resumed) - 2
    legacy = {k: v for k, v in state.items() if k not in ("sample_offset", "micro_batch")} | {"offset": 4}
    old = D.CaptionData(args, table, tok, S, 1, 2, 2, 11, "cpu")
    old.load_state_dict(legacy)
    assert old.batches_done == 2
    with pytest.raises(ValueError, match="micro_batch 2 -> 3"):
        D.CaptionData(args, table, tok, S, 1, 2, 3, 11, "cpu").load_state_dict(state)


def test_one_row_tail_never_reaches_training(tmp_path):
    path = make_manifest(tmp_path, n=7)
    data = D.CaptionData(args_for(path), D.select_split(args_for(path), "train"), tiny_tokenizer(), S, 0, 1, 3, 0,
                         "cpu")
    assert [b["index"].shape[0] for b in collect(data)] == [3, 3]  # 7 = 3 + 3 + 1: the 1 is dropped


def test_eval_rank_without_a_share_runs_one_stand_in(tmp_path):
    path = make_manifest(tmp_path, n=4)
    args = args_for(path)
    table = D.select_split(args, "train")
    shares = [collect(D.CaptionData(args, table, tiny_tokenizer(), S, r, 3, 2, 0, "cpu", shuffle=False))
              for r in range(3)]
    assert [[b["index"].tolist() for b in s] for s in shares] == [[[0, 1]], [[2, 3]], [[-1]]]


def _stand_in_pipe(loader):
    """What the Habana media pipe does, on the CPU: run the module's own reader, decode its files with the host
    transform, normalize; outputs shaped as HPUGenericPytorchIterator yields them."""
    reader = hpu_media._Reader({"priv_params": {"loader": loader}}, SimpleNamespace(batch_size=loader.data.micro_batch))
    assert len(reader) == len(loader.data.pending_batches())
    for files, ids, mask, rowid in reader:
        images = np.stack([host_transform(read_bytes(str(f)), str(f), loader.data.size,
                                          transform=loader.data.args.image_transform) for f in files])
        yield (normalize(torch.from_numpy(images)), torch.from_numpy(ids.astype(np.int64)),
               torch.from_numpy(mask.astype(np.int64)), torch.from_numpy(rowid.astype(np.int64)))


def test_hpu_media_feeding_through_the_same_plan_and_assembly(tmp_path):
    path = make_manifest(tmp_path, n=10, bad=["missing.jpg"])
    args = args_for(path, pad_to_max_length=True, max_seq_length=12)
    table = D.select_split(args, "train")
    tok = tiny_tokenizer()

    def source(pipeline, **kw):
        return D.CaptionData(args, table, tok, S, 1, 2, 3, 5, "cpu", pipeline=pipeline, **kw)

    host = source("host")
    host.set_epoch(2)
    ref = collect(host)
    hpu = source("device-hpu", media_pipe_iterator=_stand_in_pipe)
    hpu.set_epoch(2)
    got = collect(hpu)
    assert len(got) == len(ref) == len(hpu) == 2  # 11 rows / 2 ranks = 5 -> batches 3, 2
    for a, b in zip(ref, got):
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "attention_mask", "index", "pixel_mask"))
        assert torch.allclose(a["pixel_values"], b["pixel_values"], atol=1e-6)
    assert hpu.summary_stats() == host.summary_stats()
    # resume mid-epoch: the pipe starts a new pass from the plan's position
    part = source("device-hpu", media_pipe_iterator=_stand_in_pipe)
    part.set_epoch(2)
    next(iter(part))
    resumed = source("device-hpu", media_pipe_iterator=_stand_in_pipe)
    resumed.load_state_dict(part.state_dict())
    rest = collect(resumed)
    assert len(rest) == 1 and torch.equal(rest[0]["index"], got[1]["index"])


def test_hpu_media_reports_what_its_decoder_cannot_take(tmp_path):
    from test_bt_data import write_jpeg

    write_jpeg(tmp_path / "cmyk.jpg", seed=5, mode="CMYK")  # fine on the host, not for the HPU JPEG decoder
    path = make_manifest(tmp_path, n=3, bad=["cmyk.jpg"])
    args = args_for(path, pad_to_max_length=True)
    data = D.CaptionData(args, D.select_split(args, "train"), tiny_tokenizer(), S, 0, 1, 4, 0, "cpu",
                         shuffle=False, pipeline="device-hpu", media_pipe_iterator=_stand_in_pipe)
    (batch,) = collect(data)
    assert batch["index"].tolist() == [0, 1, 2] and batch["pixel_values"].shape == (3, 3, S, S)
    assert data.summary_stats()["bad_image_examples"][0].endswith("JPEG mode CMYK (the HPU decoder takes "
                                                                  "RGB/grayscale; use --image_pipeline host)")


def test_hpu_media_needs_static_caption_length(tmp_path):
    path = make_manifest(tmp_path, n=4)
    args = args_for(path)
    with pytest.raises(ValueError, match="padded to max_seq_length"):
        D.CaptionData(args, D.select_split(args, "train"), tiny_tokenizer(), S, 0, 1, 2, 0, "cpu",
                      pipeline="device-hpu", media_pipe_iterator=_stand_in_pipe)
