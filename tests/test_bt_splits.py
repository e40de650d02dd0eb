"""bridgetower_ds splits and odd data: run_bridgetower.py's carving, empty captions, distinct bad-image counts, the
dataset check before any rank starts, and worker errors that name the image."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bridgetower_ds import data as D, fetch
from conftest import REPO, end_rank
from test_bt_data import S, args_for, collect, make_manifest, tiny_tokenizer, write_jpeg


def _hf_train_only(root, n):
    import datasets

    ds = datasets.Dataset.from_dict({"image": [f"img{i}.jpg" for i in range(n)],
                                     "caption": [f"a photo of number {i}" for i in range(n)]})
    ds.save_to_disk(str(root / "hf"))
    return ds


@pytest.mark.parametrize("seed", [42, 7])
def test_missing_splits_carved_as_run_bridgetower_py(tmp_path, seed):
    """The reference is run_bridgetower.py's own calls on the same datasets.Dataset (optimum-habana
    examples/contrastive-image-text/run_bridgetower.py at 1d8504c6c7666a19d71968dba50976dceaf7c6b6, lines 405-410)."""
    ds = _hf_train_only(tmp_path, 23)
    ref = ds.train_test_split(test_size=0.4, shuffle=True, seed=seed)
    buf = ref["test"].train_test_split(test_size=0.5, shuffle=False)
    want = {"train": ref["train"]["caption"], "validation": buf["train"]["caption"], "test": buf["test"]["caption"]}
    splits = D.open_dataset(args_for(tmp_path / "hf", missing_splits="run_bridgetower"), seed=seed)
    got = {role: splits.get(role).captions for role in ("train", "validation", "test")}
    assert got == want  # the same rows in the same order: --max_*_samples then pick the same rows too
    assert [len(v) for v in got.values()] == [13, 5, 5]
    first3 = D.limit_rows(args_for(tmp_path / "hf", max_train_samples=3), "train", splits.get("train"))
    assert first3.captions == ref["train"].select(range(3))["caption"]


def test_run_bridgetower_policy_keeps_a_validation_split_and_fractions_still_work(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    path = make_manifest(tmp_path / "a", n=20, extra_fields=[{"split": "train" if i < 16 else "validation"}
                                                        for i in range(20)])
    splits = D.open_dataset(args_for(path, missing_splits="run_bridgetower"), seed=1)
    assert len(splits.get("validation")) == 4  # given: kept; only test is carved (40 % of 16 -> 7, ceil)
    assert (len(splits.get("train")), len(splits.get("test"))) == (9, 7)
    with_test = make_manifest(tmp_path / "b", n=20, extra_fields=[{"split": "train" if i < 16 else "test"}
                                                             for i in range(20)])
    with pytest.raises(KeyError, match="--missing_splits fractions"):  # the script carves nothing here
        D.open_dataset(args_for(with_test, missing_splits="run_bridgetower")).get("validation")
    old = D.open_dataset(args_for(with_test, missing_splits="fractions", validation_fraction=0.25))
    assert len(old.get("validation")) == 4
    with pytest.raises(Exception, match="--missing_splits"):
        args_for(path, missing_splits="half").validate()


def test_empty_null_missing_captions_skipped_and_counted(tmp_path):
    rows = []
    for i in range(8):
        write_jpeg(tmp_path / f"img{i}.jpg", seed=i)
        rows.append({"image": f"img{i}.jpg", "caption": f"a photo of number {i}"})
    rows[1]["caption"], rows[3]["caption"], rows[6]["caption"] = "", None, "   "
    del rows[5]["caption"]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = args_for(tmp_path / "data.jsonl")
    data = D.build_data(D.open_dataset(args), "train", tiny_tokenizer(), S, 0, 1, 2, 0, "cpu", shuffle=False)
    assert data.table.captions == [f"a photo of number {i}" for i in (0, 2, 4, 7)]
    stats = data.summary_stats()
    assert stats["bad_captions"] == 4 and stats["bad_images"] == 0
    assert data.result_counts("eval") == {"eval_bad_images": 0, "eval_bad_captions": 4}
    assert "row 1" in data.bad_captions[0] and "img1.jpg" in data.bad_captions[0]
    assert "bad_captions" in D.CaptionData.shared_summary_stats  # counted on the whole split: not summed over ranks


def test_bad_images_counted_once_per_distinct_image_over_epochs_and_resume(tmp_path):
    path = make_manifest(tmp_path, n=6, bad=["missing1.jpg", "missing2.jpg"])
    args, tok = args_for(path), tiny_tokenizer()
    table = D.select_split(args, "train")
    data = D.CaptionData(args, table, tok, S, 0, 1, 2, 3, "cpu")
    for epoch in range(3):
        data.set_epoch(epoch)
        collect(data)
    assert data.bad_images == 2  # 2 files, 3 epochs: 2 (it was 6)
    state = data.state_dict()
    again = D.CaptionData(args, table, tok, S, 0, 1, 2, 3, "cpu")
    again.load_state_dict(state)
    again.set_epoch(3)
    collect(again)
    assert again.bad_images == 2 and again.result_counts("train")["train_bad_images"] == 2


def test_unexpected_error_in_a_worker_becomes_a_named_bad_image(tmp_path, monkeypatch):
    path = make_manifest(tmp_path, n=4)
    real = fetch.host_transform

    def flaky(data, name, *a, **k):
        if name.endswith("img2.jpg"):
            raise RuntimeError("Input and output sizes should be greater than 0")
        return real(data, name, *a, **k)

    monkeypatch.setattr(fetch, "host_transform", flaky)  # DataLoader workers fork: they see it too
    args = args_for(path, dataloader_num_workers=1)
    data = D.build_data(D.open_dataset(args), "train", tiny_tokenizer(), S, 0, 1, 4, 0, "cpu", shuffle=False)
    seen = sorted(int(i) for b in collect(data) for i in b["index"])
    data.close()
    assert seen == [0, 1, 3]
    (example,) = data.summary_stats()["bad_image_examples"]
    assert "img2.jpg" in example and "RuntimeError" in example


def test_missing_dataset_refused_before_distributed_init(tmp_path, monkeypatch):
    import bridgetower_ds.train as T
    import ds_core.run.setup

    def reached(*a, **k):
        raise AssertionError("init_distributed reached")

    monkeypatch.setattr(ds_core.run.setup, "init_distributed", reached)  # start_run starts the process group
    with pytest.raises(FileNotFoundError, match="--dataset_path .*nowhere"):
        T.main(["--do_train", "--dataset_path", str(tmp_path / "nowhere.jsonl"), "--run_dir", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()
    # a hub dataset/config absent from the offline cache: a fresh interpreter (datasets reads the cache path on import)
    # run as a rank runs it (run_main): one line `... error: ...`, exit status 2, no traceback
    code = ("import bridgetower_ds.train as T, ds_core.run.setup as S\n"
            "from ds_core.rank.process_end import run_main\n"
            "S.init_distributed = lambda *a, **k: (_ for _ in ()).throw(SystemExit('REACHED init_distributed'))\n"
            "run_main(lambda: T.main(['--do_eval', '--dataset_name', 'jmhessel/newyorker_caption_contest',\n"
            "        '--dataset_config_name', 'matching', '--run_dir', %r]))\n" % str(tmp_path / "r2"))
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "empty_cache"),
               PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 2 and "REACHED" not in out.stdout and "Traceback" not in out.stdout, out.stdout[-2000:]
    said = [line for line in out.stdout.splitlines() if "error:" in line]
    assert len(said) == 1 and "not in the local datasets cache" in said[0], out.stdout[-2000:]


def test_carving_sizes_follow_datasets_rounding():
    rows = D.run_bridgetower_splits(96, True, seed=42)
    assert (len(rows["train"]), len(rows["validation"]), len(rows["test"])) == (57, 19, 20)
    assert sorted(np.concatenate(list(rows.values())).tolist()) == list(range(96))
    assert set(D.run_bridgetower_splits(96, False, seed=42)) == {"train", "test"}
    with pytest.raises(ValueError, match="run_bridgetower.py"):
        D.run_bridgetower_splits(1, True, seed=0)


def _two_rank_counts(rank: int, world: int, port: int, path, q) -> None:
    import torch.distributed as dist

    from ds_core.run.data import reduce_summary_stats

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        args = args_for(path)
        data = D.build_data(D.open_dataset(args), "train", tiny_tokenizer(), S, rank, world, 2, 5, "cpu")
        for epoch in range(4):  # each epoch deals the rows anew: a bad image meets both ranks
            data.set_epoch(epoch)
            collect(data)
        stats = reduce_summary_stats(data.summary_stats(), world, frozenset(data.shared_summary_stats))  # the loop's
        q.put((rank, stats["bad_images"], stats["bad_captions"], data.result_counts("train"), sorted(data.bad.seen)))
    finally:
        end_rank()  # the group released, the process ended as a rank is (conftest)


@pytest.mark.slow  # two gloo processes (tens of seconds on a loaded 2-core machine)
def test_bad_image_counts_are_distinct_over_ranks_and_epochs(tmp_path):
    import torch.multiprocessing as mp

    from conftest import free_port, spawned

    path = make_manifest(tmp_path, n=10, bad=["missing1.jpg", "missing2.jpg"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[3]["caption"] = ""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx, port = mp.get_context("spawn"), free_port()
    q = ctx.Queue()
    with spawned(ctx, _two_rank_counts, [(r, 2, port, path, q) for r in range(2)]) as procs:
        got = sorted(q.get(timeout=300) for _ in procs)
    per_rank = [set(g[4]) for g in got]
    assert per_rank[0] & per_rank[1], "the test needs an image met by both ranks"
    for _, bad_images, bad_captions, counts, _ in got:
        assert (bad_images, bad_captions) == (2, 1)
        assert counts == {"train_bad_images": 2, "train_bad_captions": 1}
