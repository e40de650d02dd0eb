"""The rules Habana publishes for Gaudi, checked on a CPU at each decision point (ds_core.device.hpu): which
generation a device name is, where the media pipe runs, the dtypes metrics are summed in, lazy mode and compile, and
the ops the flat NVLAMB / LANS take on an HPU (tested equal to the CPU path here)."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from bert_ref import layerwise
from bert_ref.layerwise import LANS, NVLAMB, FlatLayout, partition_segments
from ds_core.device import hpu

pytestmark = pytest.mark.stack  # Habana's rules, on the stack a Gaudi image has too


# ------------------------------------------------------------------------------------------------ generations
@pytest.mark.parametrize("name, gen", [("GAUDI", "gaudi"), ("GAUDI2", "gaudi2"), ("GAUDI3", "gaudi3"),
                                       ("gaudi2", "gaudi2"), ("NVIDIA H100 80GB HBM3", None), ("", None)])
def test_device_names_map_to_generations(name, gen):
    assert hpu.generation(name) == gen


def test_media_pipe_runs_on_gaudi2_and_gaudi3_only():
    assert [g for g in hpu.GENERATIONS if hpu.media_pipe_supported(g)] == ["gaudi2", "gaudi3"]
    assert not hpu.media_pipe_supported(hpu.generation("GAUDI"))
    assert hpu.media_pipe_supported(hpu.generation("GAUDI2")) and hpu.media_pipe_supported(hpu.generation("GAUDI3"))
    assert not hpu.media_pipe_supported(None)


@pytest.mark.parametrize("device_name", ["GAUDI", "GAUDI2", "GAUDI3"])
def test_image_pipeline_on_each_gaudi(device_name, monkeypatch, capsys):
    """--image_pipeline auto takes the media pipe on Gaudi2/3 and the host pipeline on first-generation Gaudi (with
    the reason on one line); --image_pipeline device and --mediapipe_dataloader are refused on Gaudi1 before any data
    source is built, naming the option the user gave."""
    from bridgetower_ds import images
    from bridgetower_ds.configs import DataArgs
    from bridgetower_ds.image_pipeline import ImagePipeline
    from ds_core.errors import ConfigError

    monkeypatch.setattr(images, "hpu_available", lambda: (True, "HPU and habana_frameworks.mediapipe present"))
    monkeypatch.setattr(images.hpu_rules, "device_generation", lambda: hpu.generation(device_name))
    auto = ImagePipeline.resolve("auto", "hpu", "--image_pipeline auto")
    if device_name == "GAUDI":
        assert auto.name == "host" and "first-generation Gaudi" in auto.reason and "Gaudi2 and Gaudi3" in auto.reason
        auto.announce(0)
        assert capsys.readouterr().out.count("\n") == 1
        for argv, flag in (([], "--mediapipe_dataloader"), (["device"], "--image_pipeline device")):
            args = DataArgs(mediapipe_dataloader=not argv, image_pipeline=argv[0] if argv else "host")
            with pytest.raises(ConfigError, match=f"^{flag}: this is a first-generation Gaudi .*Gaudi2 and Gaudi3"):
                ImagePipeline.resolve(args.requested_pipeline, "hpu", args.pipeline_flag)
    else:
        assert auto.name == "device-hpu" and auto.media_pipe
        assert ImagePipeline.resolve("device", "hpu", "--mediapipe_dataloader").name == "device-hpu"


# ------------------------------------------------------------------------------------------------ dtypes
def test_metric_sums_use_hccl_dtypes_on_hpu_only():
    assert hpu.sum_dtype("hpu") == torch.float32 and hpu.sum_dtype("hpu") in hpu.HCCL_DTYPES
    assert hpu.count_dtype("hpu") == torch.int32 and hpu.count_dtype("hpu") in hpu.HCCL_DTYPES
    assert torch.float64 not in hpu.HCCL_DTYPES and torch.int64 not in hpu.HCCL_DTYPES
    assert hpu.sum_dtype("cpu") == hpu.sum_dtype("cuda") == torch.float64
    assert hpu.count_dtype("cpu") == torch.int64


def test_counts_stay_exact_in_float32_sums_over_ranks():
    """Counts far past float32's 2**24 summed over 4096 ranks in float32, as HCCL sums them: exact."""
    world, counts = hpu.MAX_RANKS_EXACT, [2**24 + 1, 7, 3 * 2**22 + 4095]
    parts = torch.tensor(hpu.count_parts(counts, torch.float32, world), dtype=torch.float32)
    summed = (parts.unsqueeze(0).expand(world, -1)).sum(0, dtype=torch.float32)  # one rank's parts, world times
    assert hpu.counts_from_parts(summed.tolist(), torch.float32) == [c * world for c in counts]
    # the plain float32 sum of the counts is not exact: what the split avoids
    plain = torch.tensor(counts, dtype=torch.float32).unsqueeze(0).expand(world, -1).sum(0, dtype=torch.float32)
    assert [int(v) for v in plain.tolist()] != [c * world for c in counts]
    assert hpu.count_parts(counts, torch.float64) == [float(c) for c in counts]
    assert hpu.count_width(torch.float32) == 2 and hpu.count_width(torch.float64) == 1
    with pytest.raises(ValueError, match="ranks"):
        hpu.count_parts(counts, torch.float32, world + 1)


def test_the_loops_step_vector_is_float32_on_hpu_with_exact_counts(monkeypatch):
    """The loop's one all-reduce per step carries losses, logs, counts and the stop flag: float64 on a CPU, float32
    on an HPU (HCCL's dtype), where tokens past 2**24 still come back exact and the losses as float32 sums."""
    from ds_core.run import readback, step

    outs = [step.StepOutput(loss=torch.tensor(2.5), samples=4096, tokens=2**24 + 3, logs={"mlm": torch.tensor(1.25),
                                                                                          "host": 0.5}),
            step.StepOutput(loss=torch.tensor(1.5), samples=4096, tokens=2**24 + 1, logs={"mlm": torch.tensor(0.75),
                                                                                          "host": 1.5})]
    real = hpu.sum_dtype
    for device_type, dtype in (("cpu", torch.float64), ("hpu", torch.float32)):
        monkeypatch.setattr(step.hpu, "sum_dtype", lambda t, _as=device_type: real(_as))  # the rule, as on that device
        acc = step.Accumulator(torch.device("cpu"))
        for out in outs:
            acc.add(out)
        acc.stop = True
        vec, keys = acc.reduce(world_size=8)
        assert vec.dtype == dtype and vec.dtype in (hpu.HCCL_DTYPES if device_type == "hpu" else (torch.float64,))
        norm = step._norm_part(torch.tensor(3.0), vec)  # the gradient norm joins in the same dtype
        assert norm[0].dtype == dtype
        r = readback.PendingStep(torch.cat([vec] + norm), keys, 0.1, False, True).read()
        assert (r.samples, r.tokens, r.stop) == (8192, 2**25 + 4, True)
        assert r.loss == 2.0 and r.logs == {"host": 1.0, "mlm": 1.0} and r.grad_norm == 3.0


def test_batches_are_pinned_and_graphs_marked_where_habana_says():
    from ds_core.run import step

    assert step.pin_batches(torch.device("hpu")) and step.pin_batches(torch.device("cuda"))
    assert not step.pin_batches(torch.device("cpu"))
    assert step.step_marker(torch.device("cpu")) is None  # eager CPU: nothing to cut


# ------------------------------------------------------------------------------------------------ execution mode
def test_lazy_mode_is_read_from_pt_hpu_lazy_mode():
    assert hpu.lazy_mode_from_env({"PT_HPU_LAZY_MODE": "1"})
    assert not hpu.lazy_mode_from_env({"PT_HPU_LAZY_MODE": "0"}) and not hpu.lazy_mode_from_env({})
    assert not hpu.lazy_mode()  # no Habana bridge on this machine


def test_mark_step_and_compile_refusal_apply_to_hpu_lazy_mode_only():
    assert hpu.mark_step_fn("cpu", True) is None and hpu.mark_step_fn("hpu", False) is None
    assert hpu.mark_step_fn("cuda", True) is None
    why = hpu.compile_refusal("hpu", True)
    assert why and "PT_HPU_LAZY_MODE=0" in why and "PT_HPU_LAZY_MODE=1" in why
    assert hpu.compile_refusal("hpu", False) is None and hpu.compile_refusal("cuda", True) is None


def test_every_compile_takes_the_accelerators_backend(monkeypatch):
    """BERT's compiled losses go through the backend DeepSpeed's accelerator names (hpu_backend on Gaudi), not
    torch.compile's default (inductor, which Gaudi does not support): a recording backend in its place is called."""
    from deepspeed.accelerator import get_accelerator

    from bert_ref import step
    from ds_core.rank.compile import compile_backend

    assert compile_backend() == get_accelerator().get_compile_backend()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(type(get_accelerator()), "get_compile_backend", lambda self: recording)
    torch._dynamo.reset()
    logits, nsp = torch.randn(2, 4, 8), torch.randn(2, 2)
    labels, nsl = torch.tensor([[1, -100, 3, -100], [-100, 2, -100, 5]]), torch.tensor([0, 1])
    mlm, nsp_loss = step.compiled_losses()(logits, nsp, labels, nsl)
    assert graphs, "the losses were compiled by another backend than the accelerator's"
    want = step.pretraining_losses(logits, nsp, labels, nsl)
    assert torch.allclose(mlm, want[0]) and torch.allclose(nsp_loss, want[1])
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ the op list
def test_the_op_list_has_no_segment_reduce_or_foreach_norm():
    for op in ("index_add_", "index_select", "repeat_interleave", "narrow", "pow", "sum", "stack", "norm"):
        assert hpu.op_on_device(op, "hpu"), op
    for op in ("segment_reduce", "_foreach_norm"):
        assert not hpu.op_on_device(op, "hpu") and hpu.op_on_device(op, "cpu") and hpu.op_on_device(op, "cuda")


class _Calls(TorchFunctionMode):
    """The torch functions called inside the mode, by name (attribute and size reads left out: no kernel)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if not self.paused and name not in ("__get__", "numel", "size", "dim"):
            self.names.add(name)
        return func(*args, **(kwargs or {}))


def _flat_run(opt_cls, monkeypatch, as_device: str, steps: int = 3, max_grad_norm: float = 0.0):
    """Weights after `steps` steps over one flat float64 tensor of 5 parameter tensors with padding, the norms taking
    the path `as_device` gets, and the torch functions the norm and spread helpers called."""
    monkeypatch.setattr(layerwise, "op_on_device", lambda op, dev: hpu.op_on_device(op, as_device))
    calls = _Calls()
    for name in ("_sq_norms", "_expand", "_global_clip"):
        original = getattr(opt_cls, name)

        def recorded(self, *a, _original=original, **k):
            with calls:
                return _original(self, *a, **k)

        monkeypatch.setattr(opt_cls, name, recorded)
    if hasattr(opt_cls, "_r"):  # LANS's update term, computed while its norms are taken: the update's ops, not theirs
        original_r = opt_cls._r

        def update_term(self, *a, **k):
            calls.paused = True
            try:
                return original_r(self, *a, **k)
            finally:
                calls.paused = False

        monkeypatch.setattr(opt_cls, "_r", update_term)
    torch.manual_seed(0)
    numels = [6, 1, 9, 4, 3]
    offsets = [sum(n + 2 for n in numels[:k]) for k in range(len(numels))]  # 2 elements of padding after each
    size = offsets[-1] + numels[-1] + 2
    flat = torch.nn.Parameter(torch.randn(size, dtype=torch.float64))
    opt = opt_cls([flat], lr=0.05, weight_decay=0.01, max_grad_norm=max_grad_norm)
    opt.attach({id(flat): FlatLayout(partition_segments(numels, offsets, 0, size), len(numels))}, None, False)
    for _ in range(steps):
        calls.names.clear()  # the last step's calls: the layout's index tensors are built (and cached) on the first
        flat.grad = torch.randn(size, dtype=torch.float64)
        opt.step()
    monkeypatch.undo()
    return flat.detach(), calls.names


@pytest.mark.parametrize("opt_cls", [NVLAMB, LANS])
def test_hpu_norm_path_takes_listed_ops_and_equals_the_segment_reduce_path(opt_cls, monkeypatch):
    """On an HPU the per-tensor norms take listed ops only (no segment_reduce, no _foreach_norm); on a CPU the same
    steps by both paths agree within float64 rounding (the two sum the same squares in another order)."""
    clip = 1.0 if opt_cls is NVLAMB else 0.0  # NVLAMB's own global clip: the model's tensors' norms too
    cpu_w, cpu_calls = _flat_run(opt_cls, monkeypatch, "cpu", max_grad_norm=clip)
    hpu_w, hpu_calls = _flat_run(opt_cls, monkeypatch, "hpu", max_grad_norm=clip)
    assert "segment_reduce" in cpu_calls  # the recorder sees the path each device takes
    assert hpu_calls - hpu.HPU_LISTED_OPS == set(), sorted(hpu_calls - hpu.HPU_LISTED_OPS)
    assert torch.allclose(hpu_w, cpu_w, rtol=1e-12, atol=1e-14), (hpu_w - cpu_w).abs().max()
