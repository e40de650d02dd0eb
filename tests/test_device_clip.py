"""ds_core.compat.flat_norm.device_clip against DeepSpeed's clip_tensors_by_global_norm, in this process: the same bits
whether the norm is over or under the threshold, and no host read of the norm (DeepSpeed's reads it once)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.utils import clip_tensors_by_global_norm

from ds_core.compat.flat_norm import device_clip
from ds_tools.op_count import OpCounter

pytestmark = [pytest.mark.stack, pytest.mark.each_gaudi]


def _buffers(scale: float, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(1000 + 37 * i, generator=g) * scale for i in range(n)]  # flat fp32 gradient buffers


@pytest.mark.parametrize("scale", [1e-3, 10.0], ids=["under", "over"])
@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.float64])
def test_device_clip_gives_deepspeeds_bits_without_a_host_read(scale, norm_dtype):
    ours, theirs = _buffers(scale), _buffers(scale)
    norm = torch.linalg.vector_norm(torch.cat(ours)).to(norm_dtype)
    with OpCounter() as c_theirs:
        clip_tensors_by_global_norm(theirs, max_norm=1.0, global_norm=norm.clone())
    with OpCounter() as c_ours:
        returned = device_clip(clip_tensors_by_global_norm)(ours, max_norm=1.0, global_norm=norm.clone())
    assert returned.item() == norm.item()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert c_theirs.syncs == 1 and c_ours.syncs == 0
    if scale > 1:
        assert not torch.equal(ours[0], _buffers(scale)[0])  # over the threshold: clipped, not left alone
    many = _buffers(scale, 30)
    with OpCounter() as c_many:
        device_clip(clip_tensors_by_global_norm)(many, max_norm=1.0, global_norm=norm.clone())
    assert c_many.total == c_ours.total  # the coefficient and one multi-tensor multiply: not one op per tensor


def test_a_captured_clip_is_deepspeeds_path():
    """use_graph (Habana's fork: BF16_Optimizer's clip under HPU graph capture) goes to DeepSpeed's own function, as
    given; without it DeepSpeed's function is not called (0.19's takes no use_graph)."""
    calls = []

    def host_clip(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6, **kw):
        calls.append(kw)
        return global_norm

    clip = device_clip(host_clip)
    norm = torch.tensor(5.0)
    clip(_buffers(1.0), max_norm=1.0, global_norm=norm, use_graph=True)
    clip(_buffers(1.0), max_norm=1.0, global_norm=norm)
    assert calls == [{"use_graph": True}]


def test_a_norm_given_as_a_number_is_deepspeeds_path():
    ours, theirs = _buffers(10.0), _buffers(10.0)
    norm = float(torch.linalg.vector_norm(torch.cat(ours)))
    device_clip(clip_tensors_by_global_norm)(ours, max_norm=1.0, global_norm=norm)
    clip_tensors_by_global_norm(theirs, max_norm=1.0, global_norm=norm)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_installed_in_bf16_optimizer_once():
    from deepspeed.runtime import bf16_optimizer

    from ds_core.compat import changes

    before = bf16_optimizer.clip_tensors_by_global_norm
    engine = SimpleNamespace(optimizer=object.__new__(bf16_optimizer.BF16_Optimizer))  # the wrapper a run gets
    try:
        assert changes.apply_change("device_clip", engine=engine, device_type="cpu").state is changes.State.APPLIED
        installed = bf16_optimizer.clip_tensors_by_global_norm
        changes.apply_change("device_clip", engine=engine, device_type="cpu")
        assert installed is bf16_optimizer.clip_tensors_by_global_norm
        assert changes.applied(installed) == "device_clip" and changes.original(installed) is before
        # switched off: DeepSpeed's own function back in its place
        os.environ[changes.ENV] = "off:device_clip"
        off = changes.apply_change("device_clip", engine=engine, device_type="cpu")
        assert off.state is changes.State.SWITCHED_OFF and str(off).startswith("off: switched off"), off
        assert bf16_optimizer.clip_tensors_by_global_norm is before
    finally:
        os.environ.pop(changes.ENV, None)
        bf16_optimizer.clip_tensors_by_global_norm = before
