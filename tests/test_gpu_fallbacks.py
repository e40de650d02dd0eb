"""What a CUDA machine without torchvision or without a DeepSpeed ops compiler gets: a named error or the fallback
taken, before any worker starts; and images whose aspect ratio resizes to 0 px are bad images, not a worker crash.
The CPU-testable half (the CUDA half runs in tests/test_gpu_*.py): torchvision hidden from the import in a fresh
interpreter; a CUDA_HOME without nvcc."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from conftest import REPO, dist_env

HIDE_TORCHVISION = "import sys; sys.modules['torchvision'] = None; sys.modules['torchvision.io'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_TORCHVISION + code], cwd=REPO, env=dist_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def test_cuda_device_pipeline_without_torchvision_is_a_named_error_and_auto_falls_back():
    proc = _python(
        "import json, torch\n"
        "from bridgetower_ds import images\n"
        "out = {}\n"
        "try:\n"
        "    images.make_device_decoder('device-cuda', 32, 'cpu')\n"
        "except RuntimeError as e:\n"
        "    out['error'] = str(e)\n"
        "torch.cuda.is_available = lambda: True  # what a CUDA machine reports; only the import is at stake here\n"
        "out['check'] = images.cuda_available()\n"
        "out['auto_on_cpu'] = images.resolve_pipeline('auto', 'cpu')\n"
        "try:\n"
        "    images.resolve_pipeline('device', 'cuda')\n"
        "except RuntimeError as e:\n"
        "    out['device_error'] = str(e)\n"
        "print('OUT ' + json.dumps(out))\n")
    line = next((x for x in proc.stdout.splitlines() if x.startswith("OUT ")), None)
    assert line, proc.stdout[-3000:]
    out = json.loads(line[4:])
    assert "torchvision" in out["error"] and "--image_pipeline host" in out["error"]
    assert out["check"] == [False, "CUDA is present but torchvision (for nvJPEG decode_jpeg) is not importable"]
    assert "torchvision" in out["device_error"] and "CUDA" in out["device_error"]
    assert out["auto_on_cpu"][0] == "device-cpu" and "torchvision" in out["auto_on_cpu"][1]


def test_no_nvcc_gives_torch_adamw_with_the_reason(tmp_path):
    from ds_core.device.ops_check import fused_adam_problem, prepare_optimizer_ops

    def fallback(cfg: dict, accel: str, **kw) -> tuple[dict, str | None]:
        said: list[str] = []
        return prepare_optimizer_ops(cfg, accel, say=said.append, **kw), (said[-1] if said else None)

    env = {"CUDA_HOME": str(tmp_path), "PATH": str(tmp_path)}  # a CUDA_HOME without bin/nvcc, no ninja on PATH
    problem = fused_adam_problem(env)
    assert problem is not None and ("nvcc" in problem or "ninja" in problem)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    cfg = json.loads((REPO / "ds_configs" / "bridgetower_zero1_bf16.json").read_text())
    got, note = fallback(cfg, "cuda", env=env, load=lambda op: "no CUDA compiler (nvcc) in /opt/x")
    assert got["optimizer"]["params"]["torch_adam"] is True and "torch_adam" not in cfg["optimizer"]["params"]
    assert "fused_adam" in note and ("nvcc" in note or "ninja" in note)
    # the CPU accelerator's fused_adam is a C++ JIT build: loaded, nothing changes; unbuildable, the same fallback
    assert fallback(cfg, "cpu", load=lambda op: None) == (cfg, None)
    assert fallback(cfg, "cpu", load=lambda op: "x")[0]["optimizer"]["params"]["torch_adam"] is True
    no_opt = {k: v for k, v in cfg.items() if k != "optimizer"}  # bert_ref builds its optimizer in code
    assert fallback(no_opt, "cuda", load=lambda op: "x") == (no_opt, None)


@pytest.mark.parametrize("w,h", [(4000, 100), (100, 3000)])
@pytest.mark.parametrize("transform", ["processor", "run_bridgetower"])
def test_extreme_aspect_ratio_decodes_not_a_crash(w, h, transform):
    """4000 x 100 at 294 px: the processor's divisor flooring used to give a 0-px side and an interpolate error inside
    a loader worker; a side now never rounds to 0, on the host and the thread-pool pipeline alike."""
    from PIL import Image

    from bridgetower_ds.images import ThreadDecoder, host_transform

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (120, 80, 40)).save(buf, "JPEG")
    assert host_transform(buf.getvalue(), "strip.jpg", 294, transform=transform).shape == (3, 294, 294)
    dec = ThreadDecoder(294, "cpu", threads=1, transform=transform)
    try:
        pix, keep, bad = dec([buf.getvalue()], ["strip.jpg"])
    finally:
        dec.close()
    assert keep == [0] and bad == [] and tuple(pix.shape) == (1, 3, 294, 294)
