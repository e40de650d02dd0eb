"""bridgetower_ds.data: sources, splits, per-rank order, exact resume, host vs device pipeline, bad images in
batches."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image

from bridgetower_ds import data as D
from bridgetower_ds.configs import DataArgs
from bridgetower_ds.images import CLIP_MEAN, CLIP_STD, BadImage

S = 32  # tiny images keep the suite fast on 2 shared cores


def tiny_tokenizer():
    """A real fast tokenizer (word level over a fixed vocabulary), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = (["<s>", "<pad>", "</s>", "<unk>"] + "a photo of number red blue cat dog".split()
             + [str(i) for i in range(40)])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def write_jpeg(path, w=48, h=40, seed=0, mode="RGB", fmt="JPEG"):
    rng = np.random.default_rng(seed)
    arr = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    im = Image.fromarray(arr)
    if mode != "RGB":
        im = im.convert(mode)
    im.save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))


def make_manifest(root, n=12, bad=None, fmt="jsonl", extra_fields=None):
    """n good images (+ named bad rows) and a manifest in `fmt`; returns the manifest path."""
    rows = []
    for i in range(n):
        write_jpeg(root / f"img{i}.jpg", seed=i, w=40 + i, h=36)
        rows.append({"image": f"img{i}.jpg", "caption": f"a photo of number {i}"})
    for name in bad or []:
        rows.append({"image": name, "caption": "a photo of number 0"})
    for r, extra in zip(rows, extra_fields or []):
        r.update(extra)
    path = root / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


def args_for(path, **kw):
    base = dict(dataset_path=str(path), dataloader_num_workers=0, validation_fraction=0.0, test_fraction=0.0,
                missing_splits="fractions")
    base.update(kw)
    return DataArgs(**base)


def collect(data):
    return [{k: v.clone() for k, v in b.items()} for b in data]


# ---------------------------------------------------------------------------------------------------- sources/splits
@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv"])
def test_manifest_formats(tmp_path, fmt):
    path = make_manifest(tmp_path, n=5, fmt=fmt)
    tables = D.load_tables(args_for(path))
    t = tables["train"]
    assert len(t) == 5 and t.captions[2] == "a photo of number 2"
    data, name = t.load(3)
    assert isinstance(data, bytes) and name.endswith("img3.jpg")


def test_missing_column_names_it(tmp_path):
    path = make_manifest(tmp_path, n=2)
    with pytest.raises(KeyError, match="'text'"):
        D.load_tables(args_for(path, caption_column="text"))


def test_hf_save_to_disk_with_image_feature_and_split_names(tmp_path):
    from datasets import Dataset, DatasetDict, Image as HFImage

    for i in range(6):
        write_jpeg(tmp_path / f"i{i}.jpg", seed=i)
    def ds(rows):
        d = Dataset.from_dict({"img": [str(tmp_path / f"i{i}.jpg") for i in rows],
                               "text": [[f"a photo of number {i}", "second caption"] for i in rows]})
        return d.cast_column("img", HFImage())
    DatasetDict({"train": ds(range(4)), "validation": ds([4, 5])}).save_to_disk(str(tmp_path / "hf"))
    args = args_for(tmp_path / "hf", image_column="img", caption_column="text", test_fraction=0.25)
    val = D.select_split(args, "validation")
    assert len(val) == 2 and val.captions[0] == "a photo of number 4"  # list of captions -> the first
    train, test = D.select_split(args, "train"), D.select_split(args, "test")
    assert len(test) == 1 and len(train) == 3  # test carved out of train, deterministically
    data = D.CaptionData(args, val, tiny_tokenizer(), S, 0, 1, 2, 0, "cpu", shuffle=False)
    b = next(iter(data))
    assert b["pixel_values"].shape == (2, 3, S, S) and b["index"].tolist() == [0, 1]


def test_imagefolder_with_metadata(tmp_path):
    for i in range(3):
        write_jpeg(tmp_path / f"p{i}.jpg", seed=i)
    (tmp_path / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"p{i}.jpg", "caption": f"a photo {i}"}) + "\n" for i in range(3)))
    t = D.load_tables(args_for(tmp_path))["train"]
    assert len(t) == 3 and sorted(t.captions) == ["a photo 0", "a photo 1", "a photo 2"]
    assert all(isinstance(t.load(i)[0], bytes) for i in range(3))


def test_manifest_split_column_and_deterministic_carving(tmp_path):
    path = make_manifest(tmp_path, n=20, extra_fields=[{"split": "train" if i < 16 else "test"} for i in range(20)])
    args = args_for(path, validation_fraction=0.25, split_seed=7)
    test = D.select_split(args, "test")
    val, train = D.select_split(args, "validation"), D.select_split(args, "train")
    assert len(test) == 4 and len(val) == 4 and len(train) == 12
    assert set(val.captions).isdisjoint(train.captions)
    again = D.select_split(args_for(path, validation_fraction=0.25, split_seed=7), "validation")
    assert again.captions == val.captions
    other = D.select_split(args_for(path, validation_fraction=0.25, split_seed=8), "validation")
    assert other.captions != val.captions


def test_carve_splits_partition():
    rows = D.carve_splits(100, True, True, 0.1, 0.2, seed=3)
    allr = np.concatenate([rows["train"], rows["validation"], rows["test"]])
    assert sorted(allr.tolist()) == list(range(100))
    assert (len(rows["validation"]), len(rows["test"])) == (10, 20)


# ---------------------------------------------------------------------------------------------------- order/resume
def test_dataset_opened_and_split_once(tmp_path, monkeypatch):
    path = make_manifest(tmp_path, n=20)
    args = args_for(path, validation_fraction=0.2, test_fraction=0.1)
    calls = []
    real_load, real_carve = D.load_tables, D.carve_splits
    monkeypatch.setattr(D, "load_tables", lambda a: calls.append("load") or real_load(a))
    monkeypatch.setattr(D, "carve_splits", lambda *a: calls.append("carve") or real_carve(*a))
    splits = D.open_dataset(args)
    val = splits.get("validation")
    assert splits.get("validation") is val and splits.get(args.validation_split) is val
    sizes = {r: len(splits.get(r)) for r in ("train", "test", "validation")}
    assert sizes == {"train": 14, "validation": 4, "test": 2} and calls == ["load", "carve"]
    tok = tiny_tokenizer()
    for _ in range(2):  # e.g. two evaluations of one run: the same tables, nothing reloaded
        D.build_data(splits, "validation", tok, S, 0, 1, 2, 0, "cpu", shuffle=False)
    assert calls == ["load", "carve"]


def test_exact_resume_mid_epoch(tmp_path):
    path = make_manifest(tmp_path, n=14)
    args, tok = args_for(path), tiny_tokenizer()
    table = D.select_split(args, "train")
    ref = D.CaptionData(args, table, tok, S, 1, 2, 2, 11, "cpu")
    ref.set_epoch(3)
    full = collect(ref)
    assert len(full) == len(ref) == 3  # 14 rows / 2 ranks = 7 -> batches 2,2,2 (+1 row: no negative, dropped)
    part = D.CaptionData(args, table, tok, S, 1, 2, 2, 11, "cpu")
    part.set_epoch(3)
    it = iter(part)
    next(it), next(it)
    state = json.loads(json.dumps(part.state_dict()))
    resumed = D.CaptionData(args, table, tok, S, 1, 2, 2, 11, "cpu")
    resumed.load_state_dict(state)
    rest = collect(resumed)
    assert len(rest) == 1
    for a, b in zip(full[2:], rest):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="world_size 2 -> 3"):
        D.CaptionData(args, table, tok, S, 0, 3, 2, 11, "cpu").load_state_dict(state)


# ---------------------------------------------------------------------------------------------------- pipelines
def test_the_image_pipeline_is_decided_once_and_handed_to_every_split(tmp_path, capsys):
    """build_data with the run's ImagePipeline uses it as given: the flag in the data settings is not read again (a
    host pipeline handed over where the settings say device decodes in the workers), and nothing is announced per
    split; a source built alone resolves and announces it itself."""
    from bridgetower_ds.image_pipeline import HOST, DevicePixels, HostPixels, ImagePipeline

    path = make_manifest(tmp_path, n=6)
    args = args_for(path, image_pipeline="device", missing_splits="fractions", validation_fraction=0.5,
                    test_fraction=0.0)
    splits = D.open_dataset(args)
    built = [D.build_data(splits, split, tiny_tokenizer(), S, 0, 1, 2, 0, "cpu", shuffle=False, pipeline=HOST)
             for split in ("train", "validation")]
    assert capsys.readouterr().out == ""
    for data in built:
        assert data.pipeline is HOST and data._fetch.host and isinstance(data._pixels, HostPixels)
        assert all(b["pixel_values"].shape[1:] == (3, S, S) for b in collect(data))
    alone = D.build_data(splits, "train", tiny_tokenizer(), S, 0, 1, 2, 0, "cpu", shuffle=False)
    assert alone.pipeline == ImagePipeline("device-cpu", alone.pipeline.reason) and not alone._fetch.host
    assert isinstance(alone._pixels, DevicePixels)
    assert "image pipeline: device-cpu" in capsys.readouterr().out
    alone.close()
    with pytest.raises(ValueError, match="image pipeline 'gpu'"):
        ImagePipeline("gpu")
    with pytest.raises(ValueError, match="no per-batch PixelSource"):
        ImagePipeline("device-hpu").pixel_source(S, torch.device("cpu"), args)


def test_host_and_device_cpu_pipelines_give_the_same_tensors(tmp_path):
    path = make_manifest(tmp_path, n=6)
    tok = tiny_tokenizer()
    host_args = args_for(path, image_pipeline="host")
    table = D.select_split(host_args, "train")
    host = D.CaptionData(host_args, table, tok, S, 0, 1, 4, 0, "cpu")
    dev_args = args_for(path, mediapipe_dataloader=True)  # the alias of --image_pipeline device
    dev = D.CaptionData(dev_args, table, tok, S, 0, 1, 4, 0, "cpu")
    assert host.pipeline.name == "host" and dev.pipeline.name == "device-cpu"
    hb, db = collect(host), collect(dev)
    assert len(hb) == len(db) == 2
    for a, b in zip(hb, db):
        assert a["pixel_values"].dtype == torch.float32 and a["pixel_values"].shape[1:] == (3, S, S)
        assert a["input_ids"].dtype == torch.long and a["pixel_mask"].shape == (a["index"].shape[0], S, S)
        # Identical decode + resize code on CPU: equal up to float rounding (tolerance 1e-6).
        assert torch.allclose(a["pixel_values"], b["pixel_values"], atol=1e-6)
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "attention_mask", "index", "pixel_mask"))
    dev.close()


BAD_CASES = ["missing.jpg", "zero.jpg", "trunc.jpg"]


def write_bad_files(root):
    (root / "zero.jpg").write_bytes(b"")
    write_jpeg(root / "full.jpg", seed=99)
    (root / "trunc.jpg").write_bytes((root / "full.jpg").read_bytes()[:200])
    write_jpeg(root / "cmyk.jpg", seed=5, mode="CMYK")
    write_jpeg(root / "gray.jpg", seed=6, mode="L")
    write_jpeg(root / "png.jpg", seed=7, fmt="PNG")
    Image.fromarray(np.linspace(0, 65535, 48 * 40).reshape(40, 48).astype(np.uint16)).save(root / "gray16.png")


@pytest.mark.parametrize("pipeline,workers", [("host", 0), ("host", 2), ("device", 0)])
def test_bad_images_skipped_and_counted_convertible_ones_kept(tmp_path, pipeline, workers):
    write_bad_files(tmp_path)
    path = make_manifest(tmp_path, n=3, bad=BAD_CASES + ["cmyk.jpg", "gray.jpg", "png.jpg", "gray16.png"])
    args = args_for(path, image_pipeline=pipeline, dataloader_num_workers=workers)
    data = D.build_data(D.open_dataset(args), "train", tiny_tokenizer(), S, 0, 1, 4, 0, "cpu", shuffle=False)
    batches = collect(data)
    seen = sorted(int(i) for b in batches for i in b["index"])
    assert seen == [0, 1, 2, 6, 7, 8, 9]  # 3 good + CMYK, grayscale, PNG-named-.jpg, 16-bit gray converted; 3 bad
    g16 = next(b for b in batches if 9 in b["index"].tolist())
    px = g16["pixel_values"][g16["index"].tolist().index(9)]
    assert 0.3 < ((px[0] * CLIP_STD[0] + CLIP_MEAN[0]).mean().item()) < 0.7  # a mid-grey ramp, not clipped white
    for b in batches:
        n = b["index"].shape[0]
        assert b["pixel_values"].shape == (n, 3, S, S) and b["input_ids"].shape[0] == n
    stats = data.summary_stats()
    assert stats["bad_images"] == 3
    assert sorted(e.split(":")[0].rsplit("/", 1)[-1] for e in stats["bad_image_examples"]) == sorted(BAD_CASES)
    data.close()


def test_bad_image_error_mode_names_the_file(tmp_path):
    path = make_manifest(tmp_path, n=2, bad=["missing.jpg"])
    args = args_for(path, bad_image="error")
    data = D.build_data(D.open_dataset(args), "train", tiny_tokenizer(), S, 0, 1, 8, 0, "cpu", shuffle=False)
    with pytest.raises(BadImage, match="missing.jpg.*file not found"):
        collect(data)


def test_all_bad_batch_skipped_alone_or_filled_in_with_several_ranks(tmp_path):
    from bridgetower_ds.batching import BatchPlan

    (tmp_path / "zero.jpg").write_bytes(b"")
    path = make_manifest(tmp_path, n=6, bad=["missing.jpg", "zero.jpg"])  # rows 0-5 good; 6, 7 bad
    args, tok = args_for(path), tiny_tokenizer()
    table = D.select_split(args, "train")
    # two ranks, micro batch 2: 4 rows each. Pick a shuffle seed where rank 0's 2nd batch holds both bad rows.
    seed = next(s for s in range(500) if set(BatchPlan(8, 0, 2, 2, s, train=True).rank_batches(0)[1]) == {6, 7})
    r0 = D.CaptionData(args, table, tok, S, 0, 2, 2, seed, "cpu")
    got = collect(r0)
    assert len(got) == 2 and min(got[0]["index"].tolist()) >= 0
    assert got[1]["index"].tolist() == [-1, -1]  # the last good batch again, counted as no samples
    assert torch.equal(got[1]["pixel_values"], got[0]["pixel_values"])
    assert r0.summary_stats()["filler_batches"] == 1 and r0.summary_stats()["bad_images"] == 2
    # one rank: a training batch left with fewer than 2 valid rows is skipped (nothing to contrast it with)
    one = D.CaptionData(args, table, tok, S, 0, 1, 2, seed, "cpu")
    planned = [sorted(int(r) for r in b) for b in one.plan.rank_batches(0)]
    expect = [b for b in ([r for r in b if r < 6] for b in planned) if len(b) >= 2]
    assert [sorted(b["index"].tolist()) for b in one] == expect and len(expect) < len(planned)


def test_data_args_validation():
    with pytest.raises(ValueError, match="image_pipeline"):
        DataArgs(dataset_path="x", image_pipeline="gpu").validate()
    with pytest.raises(ValueError, match="bad_image"):
        DataArgs(dataset_path="x", bad_image="ignore").validate()
    assert DataArgs(mediapipe_dataloader=True).requested_pipeline == "device"
    for f in DataArgs.__dataclass_fields__.values():
        assert f.metadata.get("help"), f.name


def test_data_args_parse_with_hf_argument_parser():
    from transformers import HfArgumentParser

    (a,) = HfArgumentParser([DataArgs], allow_abbrev=False).parse_args_into_dataclasses(
        ["--dataset_path", "d.jsonl", "--mediapipe_dataloader", "--bad_image", "error", "--image_size", "64"])
    assert a.mediapipe_dataloader and a.bad_image == "error" and a.image_size == 64


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv"])
def test_manifest_not_utf8_names_file_and_line(tmp_path, fmt):
    path = make_manifest(tmp_path, n=4, fmt=fmt)
    lines = path.read_bytes().split(b"\n")
    k = 2 if fmt != "json" else 0  # json: one line
    lines[k] = lines[k].replace(b"number", "n\u00famero".encode("latin-1"))  # latin-1, not UTF-8
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=rf"data\.{fmt}:{k + 1}: not UTF-8 text \(byte 0xfa"):
        D.load_tables(args_for(path))


def test_manifest_with_utf8_bom_and_non_ascii_captions(tmp_path):
    path = make_manifest(tmp_path, n=2, fmt="csv")
    text = path.read_text().replace("number 1", "n\u00famero 1")
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # Excel's "CSV UTF-8"
    t = D.load_tables(args_for(path))["train"]
    assert t.captions == ["a photo of number 0", "a photo of n\u00famero 1"]
