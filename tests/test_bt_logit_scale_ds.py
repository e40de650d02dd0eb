"""BridgeTower's 0-dim `logit_scale` on the real DeepSpeed engine, 2 gloo ranks.

DeepSpeed 0.19 broadcasts every parameter at engine start as `p.data.view(torch.uint8)` (DeepSpeedEngine.
_broadcast_model; ZeRO-3's parameter conversion does the same), and torch refuses that view for a 0-dim tensor of
any dtype wider than a byte: transformers' BridgeTowerForContrastiveLearning cannot reach its first step under
deepspeed.initialize, in bf16 or fp32, on any number of ranks. Habana's fork (0.16.1) broadcasts the tensor itself,
so there the 0-dim parameter starts. The control states that per release (if a release changes it, the control fails
and docs/bridgetower.md's paragraph about it is due for a change); the run as
bridgetower_ds.train does it (logit_scale_as_1d: a [1] parameter inside the engine) trains in bf16 on both ranks, and
its state_dict keeps the published checkpoint's 0-dim layout, and no weight after it in DeepSpeed's flat
buffer is pushed off 16-byte alignment. The engine starts share one launch with tests/test_ops_check.py
(conftest.bt_engine_starts)."""
from __future__ import annotations

import json

import pytest

from conftest import deepspeed_release

pytestmark = pytest.mark.slow


# DeepSpeed release (stacks/) -> whether its engine start refuses a 0-dim parameter
REFUSES_0DIM = {(0, 19): True, (0, 16): False}


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_deepspeed_refuses_the_0dim_logit_scale_at_engine_start(bt_engine_starts, bf16):
    release = deepspeed_release(REFUSES_0DIM)
    out_dir, _ = bt_engine_starts
    ranks = [json.loads((out_dir / f"0d_{'bf16' if bf16 else 'fp32'}" / f"rank{r}.json").read_text()) for r in (0, 1)]
    dtype = "BFloat16" if bf16 else "Float"
    for r in ranks:
        assert r["world"] == 2 and r["logit_scale_shape"] == []
        if REFUSES_0DIM[release]:
            assert f"self.dim() cannot be 0 to view {dtype} as Byte" in r.get("error", ""), r
        else:
            assert "error" not in r and len(r["losses"]) == 2, r


def test_logit_scale_as_1d_trains_in_bf16_on_two_ranks_and_saves_it_0dim(bt_engine_starts):
    """The shipped JSON's start (its optimizer torch's AdamW, as tests/test_ops_check.py's failed op build leaves it:
    the same update as the JSON's torch_adam)."""
    out_dir, _ = bt_engine_starts
    ranks = [json.loads((out_dir / "fallback" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert "error" not in r, r
        assert r["world"] == 2 and r["bf16"] and r["param_dtype"] == "bfloat16" and r["logit_scale_shape"] == [1]
        assert len(r["losses"]) == 2 and all(0 < x < 10 for x in r["losses"])
        assert r["saved_logit_scale_shape"] == []  # the published checkpoint's layout (transformers: 0-dim)
        # the [1] logit_scale, first in model order, is placed last in ZeRO's flat buffer: every weight after it
        # keeps the 16-byte alignment cuBLAS's fast GEMM kernels need (ds_core.rank.engine_build.odd_sizes_last)
        assert r["flat_layout"] == "odd sizes last: logit_scale" and r["misaligned"] == [], r
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the same batch on both ranks, one set of weights
    assert ranks[0]["logit_scale_after"] == ranks[1]["logit_scale_after"]
