"""What Habana documents about running on Gaudi (HPU), in one place, each rule with the page it comes from.

Nothing here imports habana_frameworks at module level: this file is imported on every machine, and the few functions
that ask the device do it inside a guard. Every decision is a plain function of names and values (a device name, a
device type, an environment value), so the CPU test suite checks each one (tests/test_hpu_rules.py).

Sources (the pages each rule below names):
  [matrix]   Intel Gaudi docs, "PyTorch Support Matrix"
             (https://docs.habana.ai/en/latest/PyTorch/Reference/PyTorch_Support_Matrix.html): eager +
             torch.compile is the default mode, lazy mode "a legacy fallback that is no longer developed";
             torch.compile(backend="hpu_backend") runs in eager mode only, backend "inductor" is not supported; the
             data types listed are fp32, bf16, fp16, fp8 and integers: no float64.
  [flags]    Intel Gaudi docs, "Runtime Environment Variables" (https://docs.habana.ai/en/latest/PyTorch/
             Runtime_Flags.html): PT_HPU_LAZY_MODE 0 = torch.compile and eager mode, 1 = lazy mode.
  [ops]      Intel Gaudi docs, "PyTorch Operators" (https://docs.habana.ai/en/latest/Pytorch_Operators/
             Pytorch_Operators.html; the same table as docs/Pytorch_Operators.rst of HabanaAI/gaudi-pytorch-bridge,
             release 1.19.0): the torch functions with an HPU kernel and their data types.
  [hccl]     Intel Gaudi docs, HCCL "C API" (https://docs.habana.ai/en/latest/API_Reference_Guides/HCCL_APIs/
             C_API.html), hcclDataType_t: "the following HCCL data types are currently supported by the collective
             operations: hcclFloat32, hcclBfloat16, hcclFloat16, hcclInt32, hcclUint32"; reductions sum, min, max.
  [media]    Intel Gaudi docs, "MediaPipe" (https://docs.habana.ai/en/latest/Media_Pipeline/index.html): "Includes
             Gaudi 3 and Gaudi 2 support"; optimum-habana's examples/contrastive-image-text/README.md: "Please note
             `--mediapipe_dataloader` is not supported on Gaudi1."
  [trainer]  optimum-habana, optimum/habana/transformers/trainer.py (GaudiTrainer): in lazy mode htcore.mark_step()
             after each training step's backward and after the optimizer step; Model-References' DeepSpeed BERT
             (PyTorch/nlp/DeepSpeedExamples/deepspeed-bert/run_pretraining.py) marks the same two places.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

import torch

from ds_core.device.accelerators import from_device_name

GENERATIONS = ("gaudi", "gaudi2", "gaudi3")


# ------------------------------------------------------------------------------------------------ which Gaudi
def generation(device_name: str) -> str | None:
    """The Gaudi generation of a device name as habana_frameworks.torch.hpu.get_device_name() reports it ("GAUDI",
    "GAUDI2", "GAUDI3"; case and suffixes do not matter): "gaudi", "gaudi2" or "gaudi3"; None for a name that is
    not a Gaudi's."""
    return from_device_name(device_name) if "gaudi" in device_name.lower() else None


def device_generation() -> str | None:
    """The generation of the HPU this process sees; None without habana_frameworks or without an HPU. A name the
    bridge does not give (an empty string) is first-generation Gaudi: the bridge names Gaudi2 and Gaudi3."""
    try:
        import habana_frameworks.torch.hpu as hthpu
    except ImportError:
        return None
    try:
        if not hthpu.is_available():
            return None
        name = hthpu.get_device_name()
    except Exception:  # noqa: BLE001 - a bridge that cannot answer has no device to speak of  # pragma: no cover
        return None
    return generation(name or "") or "gaudi"


# ------------------------------------------------------------------------------------------------ media pipe
MEDIA_PIPE_GENERATIONS = frozenset({"gaudi2", "gaudi3"})  # [media]


def media_pipe_supported(gen: str | None) -> bool:
    """Whether Habana's media pipe (habana_frameworks.mediapipe) runs on this generation [media]."""
    return gen in MEDIA_PIPE_GENERATIONS


# ------------------------------------------------------------------------------------------------ collectives
HCCL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint32)  # [hccl]


def sum_dtype(device_type: str) -> torch.dtype:
    """The float dtype the toolkit sums its metrics in, on the device and across ranks: float64 where the device and
    its collective library have it (CPU / gloo, CUDA / NCCL), float32 on HPU, which has no float64 [matrix] and
    whose HCCL reduces none [hccl]."""
    return torch.float32 if device_type == "hpu" else torch.float64


def count_dtype(device_type: str) -> torch.dtype:
    """The integer dtype counts are summed in on the device: int32 on HPU (HCCL's integer type [hccl]; int64 is
    limited there [matrix]), int64 elsewhere."""
    return torch.int32 if device_type == "hpu" else torch.int64


# Counts travel in the same float vector as the losses (one collective per optimizer step). A float32 sum is exact
# while every partial sum stays below 2**24, so in float32 each count goes as two numbers, c // COUNT_SPLIT and
# c % COUNT_SPLIT: the low parts of up to MAX_RANKS_EXACT ranks sum below 2**24, and the high parts stay exact up to
# 2**24 * COUNT_SPLIT = 2**36 (6.9e10) summed over the ranks: far above a step's tokens.
COUNT_SPLIT = 1 << 12
MAX_RANKS_EXACT = (1 << 24) // COUNT_SPLIT


def count_parts(counts: list[int], dtype: torch.dtype, world_size: int = 1) -> list[float]:
    """Counts as entries of a `dtype` vector whose sum over `world_size` ranks is exact (see COUNT_SPLIT)."""
    if dtype == torch.float64:
        return [float(c) for c in counts]
    if world_size > MAX_RANKS_EXACT:
        raise ValueError(f"exact float32 counts: {world_size} ranks > {MAX_RANKS_EXACT}")
    return [float(x) for c in counts for x in divmod(int(c), COUNT_SPLIT)]


def counts_from_parts(values: list[float], dtype: torch.dtype) -> list[int]:
    """The counts back from count_parts' entries (summed over ranks or not)."""
    if dtype == torch.float64:
        return [int(round(v)) for v in values]
    return [int(round(hi)) * COUNT_SPLIT + int(round(lo)) for hi, lo in zip(values[::2], values[1::2])]


def count_width(dtype: torch.dtype) -> int:
    """Entries per count in a `dtype` vector (count_parts)."""
    return 1 if dtype == torch.float64 else 2


# ------------------------------------------------------------------------------------------------ execution mode
def lazy_mode_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """PT_HPU_LAZY_MODE as the bridge reads it [flags]: lazy mode where it is 1. Unset, Habana's default applies,
    which is 0 (eager + torch.compile) in the current docs and 1 in the 1.19 docs: lazy_mode() asks the
    bridge itself; this is for a machine without one."""
    environ = os.environ if environ is None else environ
    return environ.get("PT_HPU_LAZY_MODE", "").strip() == "1"


def lazy_mode() -> bool:
    """Whether the HPU bridge runs in lazy mode, asked of the bridge (the check Habana's DeepSpeed FusedAdam makes:
    habana_frameworks.torch.utils.internal.is_lazy); False without habana_frameworks."""
    try:
        from habana_frameworks.torch.utils.internal import is_lazy
    except ImportError:
        try:
            import habana_frameworks.torch.hpu as hthpu  # noqa: F401 - only: is there a bridge at all
        except ImportError:
            return False
        return lazy_mode_from_env()  # pragma: no cover - a bridge without the helper: the variable decides
    return bool(is_lazy())  # pragma: no cover - HPU only


def mark_step_fn(device_type: str, lazy: bool) -> Callable[[], None] | None:
    """htcore.mark_step on an HPU in lazy mode (where it cuts and runs the accumulated graph [trainer]); None
    elsewhere, where there is nothing to mark."""
    if device_type != "hpu" or not lazy:
        return None
    import habana_frameworks.torch.core as htcore  # pragma: no cover - HPU only

    return htcore.mark_step  # pragma: no cover


def compile_refusal(device_type: str, lazy: bool) -> str | None:
    """Why torch.compile cannot run here, or None: on an HPU in lazy mode, where Habana lists no torch.compile
    backend [matrix]."""
    if device_type == "hpu" and lazy:
        return ("torch.compile runs on Gaudi in eager mode only (PT_HPU_LAZY_MODE=0; Habana's PyTorch Support Matrix "
                "lists no torch.compile backend for lazy mode), and this process runs in lazy mode "
                "(PT_HPU_LAZY_MODE=1)")
    return None


# ------------------------------------------------------------------------------------------------ supported ops
# [ops]: the torch functions the flat NVLAMB / LANS norms and clip (bert_ref.layerwise) call, as the page lists them
# (torch.linalg.vector_norm by its function's name; in-place forms where the page lists those). Not on the page:
# torch.segment_reduce and torch._foreach_norm; the bridge's own table (scripts/ops_list/ops_table.csv of
# HabanaAI/gaudi-pytorch-bridge 1.19.0) gives aten::segment_reduce and aten::_foreach_norm.Scalar no HPU kernel
# either. On an HPU those norms take a path of listed ops (bert_ref.layerwise).
HPU_LISTED_OPS = frozenset({
    "add", "add_", "cat", "clamp", "div", "div_", "index_add_", "index_select", "linalg_vector_norm", "mul", "mul_",
    "narrow", "new_ones", "norm", "pow", "repeat_interleave", "reshape", "select", "sqrt", "stack", "sum", "to",
    "view", "where", "zeros",
})


def op_on_device(op: str, device_type: str) -> bool:
    """Whether the torch function `op` may run on `device_type`: on an HPU only the ones Habana lists [ops]; every
    op elsewhere."""
    return device_type != "hpu" or op in HPU_LISTED_OPS


__all__ = ["GENERATIONS", "generation", "device_generation", "MEDIA_PIPE_GENERATIONS", "media_pipe_supported",
           "HCCL_DTYPES", "sum_dtype", "count_dtype", "COUNT_SPLIT", "MAX_RANKS_EXACT", "count_parts",
           "counts_from_parts", "count_width", "lazy_mode_from_env", "lazy_mode", "mark_step_fn", "compile_refusal",
           "HPU_LISTED_OPS", "op_on_device"]
