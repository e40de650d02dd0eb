"""The changes inside DeepSpeed (ds_core.compat.changes) switched on and off: `--ds_changes off` runs DeepSpeed's own
path, the run's summary and its start line name every change's state, and the same 2-rank training (bf16 ZeRO-1 with
fp32 gradient accumulation: BF16_Optimizer, where the flat-buffer norm, the device clip and the one-op gradient hook
are on) gives the same losses either way.

The tolerance, from what the changed arithmetic can move: the gradient hook's in-place mixed-dtype add is DeepSpeed's
copy-then-add bit for bit (tests/test_flat_norm.py); the clip's coefficient is DeepSpeed's, and with a threshold no
norm reaches, DeepSpeed skips the multiply and device_clip multiplies by exactly 1.0: the same bits; the flat norm
differs from DeepSpeed's per-tensor float32 norm by float32 rounding only, and enters nothing but the clip and the
logged norm. So the losses are equal bit for bit, and the logged norms agree within float32 summation's bound: the
square sum of a tensor of n elements accumulated in float32 is off by at most n * 2**-24 relative (recursive
summation), its square root by half that, and combining the tensors' norms adds one rounding per tensor."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, run_deepspeed
from ds_core.compat import changes
from ds_core.config import DS_CONFIG_DIR
from ds_core.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.stack]
SCRIPT = str(REPO / "tests" / "tiny_train.py")
# the tiny model's largest tensor (tests/tiny_train.py: 64-token vocabulary x 32 hidden, 32 x 64 feed-forward) and
# a bound on its tensor count: the float32 bound above
LARGEST, TENSORS = 64 * 32, 64
NORM_REL = (LARGEST / 2 + TENSORS + 2) * 2.0 ** -24


def train(tmp_path: Path, switch: str) -> tuple[dict, str]:
    cfg = json.loads((DS_CONFIG_DIR / "zero1_bf16.json").read_text())
    cfg.update(gradient_clipping=1e6, data_types={"grad_accum_dtype": "fp32"})  # clip called, never scaling
    cfg["optimizer"]["params"]["lr"] = 3e-3
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    run = tmp_path / switch.replace(":", "_")
    out = run_deepspeed([SCRIPT, "--run_dir", str(run), "--deepspeed_config", str(tmp_path / "ds.json"),
                         "--precision", "bf16", "--max_steps", "8", "--progress_bar", "false",
                         "--save_final_checkpoint", "false", "--ds_changes", switch]).stdout
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"steps": {r["step"]: r for r in recs if r["type"] == "step"},
            "summary": next(r for r in recs if r["type"] == "summary")}, out


def test_all_off_is_deepspeeds_path_with_the_same_losses(tmp_path):
    on, on_out = train(tmp_path, "on")
    off, off_out = train(tmp_path, "off")
    on_states, off_states = on["summary"]["ds_changes"], off["summary"]["ds_changes"]
    assert set(on_states) == set(off_states) == set(changes.BY_NAME)
    for name in ("flat_grad_norm_bf16", "device_clip", "engine_grad_norm"):  # on for BF16_Optimizer on every stack
        assert on_states[name] == "on", on_states
    if changes.BY_NAME["one_op_grad_hook"].gate().state is changes.State.APPLIED:
        assert on_states["one_op_grad_hook"] == "on", on_states
    assert all(s == "off: switched off (DS_TOOLKIT_CHANGES=off)" for s in off_states.values()), off_states
    # the one line at start names every change's state
    line = next(ln for ln in on_out.splitlines() if "changes inside DeepSpeed" in ln)
    assert all(f"{n}=" in line for n in changes.BY_NAME) and "flat_grad_norm_bf16=on" in line, line
    assert "flat_grad_norm_bf16=off (switched off" in next(
        ln for ln in off_out.splitlines() if "changes inside DeepSpeed" in ln)
    assert list(on["steps"]) == list(off["steps"]) == list(range(1, 9))
    for step, rec in on["steps"].items():
        assert rec["loss"] == off["steps"][step]["loss"], (step, rec["loss"], off["steps"][step]["loss"])
        assert rec["grad_norm"] == pytest.approx(off["steps"][step]["grad_norm"], rel=NORM_REL, abs=0), step


def test_the_switch_names_what_it_knows(monkeypatch):
    monkeypatch.setenv(changes.ENV, "on")  # put back as it was after the test (configure sets it)
    assert changes.parse_switch("on") == {} and changes.parse_switch("") == {}
    assert set(changes.parse_switch("off")) == set(changes.BY_NAME)
    assert set(changes.parse_switch("off: device_clip, flat_grad_norm_bf16")) == {"device_clip", "flat_grad_norm_bf16"}
    with pytest.raises(ConfigError, match="--ds_changes: unknown change.*device_clp.*expected 'on', 'off'"):
        changes.configure("off:device_clp")
    changes.configure("off:device_clip")
    assert changes.switched_off() == {"device_clip": "switched off (DS_TOOLKIT_CHANGES=off:device_clip)"}
    assert changes.outcome("device_clip").state is changes.State.SWITCHED_OFF
    assert str(changes.outcome("device_clip")).startswith("off: switched off")
    with pytest.raises(ConfigError, match="DS_TOOLKIT_CHANGES: 'of' is not a switch value"):
        monkeypatch.setenv(changes.ENV, "of")
        changes.switched_off()
