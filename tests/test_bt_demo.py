"""bridgetower_ds.demo's data: the New Yorker "matching" schema the published-command tests use, with the one bad
image and one empty caption per split that the demo's results report."""
from __future__ import annotations

from bridgetower_ds import data as D, demo
from bridgetower_ds.configs import DataArgs
from test_bt_compat import NEWYORKER_FEATURES
from test_bt_data import collect, tiny_tokenizer


def test_demo_set_has_the_newyorker_schema_and_its_odd_rows_are_counted(tmp_path):
    assert demo.NEWYORKER_FEATURES == NEWYORKER_FEATURES
    path = demo.make_newyorker_set(tmp_path, {"train": 6, "validation": 5})
    args = DataArgs(dataset_path=str(path), image_column="image", caption_column="image_description",
                    dataloader_num_workers=0)
    splits = D.open_dataset(args)
    assert set(splits.tables) == {"train", "validation"} and len(splits.get("validation")) == 5
    data = D.build_data(splits, "validation", tiny_tokenizer(), 32, 0, 1, 2, 0, "cpu", shuffle=False)
    rows = sorted(int(i) for b in collect(data) for i in b["index"])
    assert rows == [0, 1, 2] and data.result_counts("eval") == {"eval_bad_images": 1, "eval_bad_captions": 1}
