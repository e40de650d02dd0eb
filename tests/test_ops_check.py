"""DeepSpeed's op builds never end a run: a TORCH_CUDA_ARCH_LIST that DeepSpeed's own parser reads (the same
architectures), and torch's AdamW with one named line wherever the optimizer's op fails to build, on every rank,
before deepspeed.initialize. The arch-list half calls DeepSpeed's own parsing (CUDAOpBuilder.compute_capability_args,
which needs no GPU); the build half makes a real JIT build fail (a C++ compiler that rejects every source file)."""
from __future__ import annotations

import json
import os
import re

import pytest

from conftest import REPO
from ds_core.device.ops_check import arch_list_for_deepspeed, needed_op, prepare_optimizer_ops


def deepspeed_archs(value: str, jit: bool, monkeypatch) -> set[tuple[int, int, bool]]:
    """{(major, minor, ptx)} that DeepSpeed 0.19's CUDA fused_adam builder makes of TORCH_CUDA_ARCH_LIST=value, by
    its own parser: cross-compile mode returns the -gencode flags, JIT mode the list it hands on to torch."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, whatever the accelerator

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    builder = FusedAdamBuilder()
    builder.jit_mode, builder._jit_arch_list = jit, value  # what OpBuilder.jit_load sets before it builds
    flags = builder.compute_capability_args()
    if jit:  # JIT: DeepSpeed rewrites the variable and lets torch make the flags (adding +PTX to the highest arch)
        return {(int(m[1]), int(m[2]), bool(m[3])) for m in
                re.finditer(r"(\d+)\.(\d+)(\+PTX)?", os.environ["TORCH_CUDA_ARCH_LIST"])}
    sm = {(int(m[1][:-1]), int(m[1][-1])) for m in re.finditer(r"code=sm_(\d+)", " ".join(flags))}
    ptx = {(int(m[1][:-1]), int(m[1][-1])) for m in re.finditer(r"code=compute_(\d+)", " ".join(flags))}
    return {(a, b, (a, b) in ptx) for a, b in sm}


# raw value -> {(major, minor, +PTX)} it names
ARCH_LISTS = {"9.0a": {(9, 0, False)}, "10.0f": {(10, 0, False)}, "9.0a+PTX": {(9, 0, True)},
              "8.0;9.0a;10.0a+PTX": {(8, 0, False), (9, 0, False), (10, 0, True)}, "9.0a 9.0": {(9, 0, False)}}


def wanted_archs(raw: str, jit: bool) -> set[tuple[int, int, bool]]:
    want = ARCH_LISTS[raw]
    if jit:  # JIT mode also marks the highest arch +PTX when none is
        top = max(want)
        want = want if any(p for *_, p in want) else (want - {top}) | {(top[0], top[1], True)}
    return want


def unread(value: str, jit: bool, want: set, monkeypatch) -> str | None:
    """None where the installed DeepSpeed reads the plain list `value` as `want` in that mode; else what it does."""
    try:
        got = deepspeed_archs(value, jit, monkeypatch)
    except (ValueError, IndexError) as e:
        return f"{type(e).__name__} on {value!r}"
    return None if got == want else f"reads {value!r} as {sorted(got)}"


@pytest.mark.parametrize("raw", ARCH_LISTS)
@pytest.mark.parametrize("jit", [False, True])
def test_deepspeed_parses_the_rewritten_arch_list_as_the_same_architectures(raw, jit, monkeypatch):
    # What the installed DeepSpeed's CUDA builder reads at all, plain lists included: Habana's fork (0.16.1, for
    # Gaudi) builds JIT ops for the visible GPUs' capabilities, not TORCH_CUDA_ARCH_LIST, and reads only one-digit
    # majors ("10.0" as "1."): there the rewrite can change nothing in those cases
    if jit and (why := unread("8.0", True, {(8, 0, True)}, monkeypatch)):
        pytest.skip(f"this DeepSpeed's JIT build does not take TORCH_CUDA_ARCH_LIST ({why})")
    if max(ARCH_LISTS[raw])[0] >= 10 and (why := unread("10.0", False, {(10, 0, False)}, monkeypatch)):
        pytest.skip(f"this DeepSpeed reads no two-digit major ({why})")
    want = wanted_archs(raw, jit)
    try:
        raw_reading = deepspeed_archs(raw, jit, monkeypatch)
    except ValueError:  # DeepSpeed 0.19.8: "invalid literal for int" on every suffixed entry: why the rewrite
        raw_reading = None
    assert raw_reading in (None, want)  # refused, or (an older parser) read right: never silently other archs
    fixed, note = arch_list_for_deepspeed(raw)
    assert deepspeed_archs(fixed, jit, monkeypatch) == want
    assert raw in note and fixed in note and "DeepSpeed" in note and "\n" not in note


@pytest.mark.parametrize("plain", ["9.0", "9.0+PTX", "8.0;8.6;9.0+PTX", "7.5 8.0"])
def test_lists_deepspeed_already_parses_are_left_alone(plain, monkeypatch):
    """`9.0+PTX` and plain entries: DeepSpeed 0.19.8 parses them as they are, so nothing is rewritten or said."""
    assert arch_list_for_deepspeed(plain) == (plain, None)
    assert deepspeed_archs(plain, False, monkeypatch)
    assert arch_list_for_deepspeed("") == ("", None) and arch_list_for_deepspeed(None) == (None, None)


def test_prepare_rewrites_the_variable_on_cuda_and_rank_0_says_it_once(monkeypatch):
    said: list[str] = []
    no_opt = {"train_micro_batch_size_per_gpu": 1}  # nothing to build: only the variable is at stake
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert prepare_optimizer_ops(no_opt, "cuda", rank=1, say=said.append) is no_opt
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0" and said == []  # every rank rewrites, only rank 0 speaks
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "10.0a")
    prepare_optimizer_ops(no_opt, "cuda", rank=0, say=said.append)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "10.0" and len(said) == 1 and "'10.0a' -> '10.0'" in said[0]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    prepare_optimizer_ops(no_opt, "cpu", rank=0, say=said.append)  # only CUDA builds read it
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a" and len(said) == 1


def test_needed_op_follows_deepspeeds_choice():
    cfg = json.loads((REPO / "ds_configs" / "bridgetower_zero1_bf16.json").read_text())
    assert needed_op(cfg) == "fused_adam"
    offload = {**cfg, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert needed_op(offload) == "cpu_adam"  # DeepSpeedCPUAdam
    torch_adam = json.loads(json.dumps(cfg))
    torch_adam["optimizer"]["params"]["torch_adam"] = True
    assert needed_op(torch_adam) is None and needed_op({"train_batch_size": 8}) is None
    assert needed_op({**cfg, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}) is None  # torch.optim's own


def test_a_failed_load_gives_torch_adamw_with_the_reason_on_any_accelerator():
    cfg = json.loads((REPO / "ds_configs" / "bridgetower_zero1_bf16.json").read_text())
    for accel in ("cpu", "hpu", "cuda"):
        said: list[str] = []
        got = prepare_optimizer_ops(cfg, accel, say=said.append, env={"PATH": ""},
                                    load=lambda op: f"{op} failed to compile")
        assert got["optimizer"]["params"]["torch_adam"] is True and "torch_adam" not in cfg["optimizer"]["params"]
        assert len(said) == 1 and "fused_adam" in said[0] and "\n" not in said[0]
    said = []
    assert prepare_optimizer_ops(cfg, "cpu", say=said.append, load=lambda op: None) is cfg and said == []  # loaded


@pytest.mark.slow
def test_a_build_that_fails_on_two_ranks_trains_with_torch_adamw_and_says_why_once(bt_engine_starts):
    """The shipped BridgeTower JSON (AdamW, DeepSpeed's FusedAdam) on 2 gloo ranks whose fused_adam JIT build fails
    to compile (an empty op cache, conftest.FAILING_CXX): both ranks reach deepspeed.initialize with torch's AdamW and
    take optimizer steps; one line names the op and the compiler's error. (Without the fallback this run ends in
    deepspeed.initialize with "Error building extension 'fused_adam'".) The launch is shared with
    tests/test_bt_logit_scale_ds.py (conftest.bt_engine_starts); its other starts need no op."""
    out_dir, out = bt_engine_starts
    ranks = [json.loads((out_dir / "fallback" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r.get("error") for r in ranks] == [None, None], ranks
    assert {r["optimizer"] for r in ranks} == {"torch.optim.adamw.AdamW"}, ranks
    assert all(len(r["losses"]) == 2 for r in ranks)
    lines = [x for x in out.splitlines() if "DeepSpeed's fused_adam op cannot be had here" in x]
    assert len(lines) == 1, out[-6000:]
    assert "rejects the Adam sources" in lines[0] and "torch.optim's AdamW" in lines[0]


class _Builder:
    def __init__(self, fail: str | None = None):
        self.fail, self.loads = fail, 0

    def load(self, verbose=True):
        self.loads += 1
        if self.fail:
            raise RuntimeError(self.fail)


class _Accel:
    def __init__(self, name: str, builders: dict):
        self.name, self.builders = name, builders

    def device_name(self):
        return self.name

    def create_op_builder(self, cls):
        return self.builders.get(cls)


def test_build_ahead_loads_each_op_of_the_accelerator_and_names_a_failure_without_raising():
    from ds_core.device.ops_check import build_ahead

    shm, adam = _Builder(), _Builder(fail="Error building extension 'fused_adam': [1/3] c++ ...\n"
                                          "fused_adam.cpp:1:1: error: this compiler rejects the Adam sources")
    said: list[str] = []
    out = build_ahead(said.append, _Accel("cpu", {"ShareMemCommBuilder": shm, "FusedAdamBuilder": adam}))
    assert shm.loads == adam.loads == 1
    assert out["shm_comm"] is None and "this compiler rejects the Adam sources" in out["fused_adam"]
    assert said[0].startswith("[build_ops] cpu shm_comm: ready")
    assert said[1].startswith("[build_ops] cpu fused_adam: not built (RuntimeError: Error building extension")
    # an accelerator without a builder of a name (CUDA has no shm collectives) has nothing to build for it
    assert set(build_ahead(said.append, _Accel("hpu", {"FusedAdamBuilder": _Builder()}))) == {"fused_adam"}


def test_build_ahead_on_cuda_rewrites_the_arch_list_and_checks_the_tools_first(monkeypatch):
    from ds_core.device import ops_check

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(ops_check, "fused_adam_problem", lambda env=None: "no CUDA compiler (nvcc) in PATH")
    adam, said = _Builder(), []
    out = ops_check.build_ahead(said.append, _Accel("cuda", {"FusedAdamBuilder": adam}))
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0" and "'9.0a' -> '9.0'" in said[0]
    assert out == {"fused_adam": "no CUDA compiler (nvcc) in PATH"} and adam.loads == 0  # no compiler traceback


def test_make_setup_builds_the_ops_last_unless_told_not_to():
    """The Makefile hands BUILD_OPS (1 unless told, 0 for the budgeted GPU check) to the set-up program, whose last
    step before its stamp is the op build (tests/test_setup_steps.py runs its steps on a recorder)."""
    text = (REPO / "Makefile").read_text()
    recipe = text[text.index("$(STAMP): pyproject.toml"):text.index("demo: $(STAMP)")]
    assert "tools/setup_venv.py" in recipe and "--build_ops $(BUILD_OPS)" in recipe
    assert "\nBUILD_OPS ?= 1\n" in text
    assert "\ngpu-check: BUILD_OPS = 0\n" in text  # the budgeted GPU check builds in the parts that need the ops
    src = (REPO / "tools" / "setup_venv.py").read_text()
    steps = src[src.index("def setup("):src.index("def main(")]
    assert "if build_ops:" in steps and steps.index("-m\", \"ds_tools.build_ops") < steps.index('".installed"')
