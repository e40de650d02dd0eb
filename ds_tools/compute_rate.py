"""What a sequence costs to compute, for ds-tune and for the validation of published points: 6 x parameters x tokens
per sequence, and the MFU (model FLOPs utilisation of the accelerator's dense peak) the published 1-node figures
(ds_tools.published) imply.
"""
from __future__ import annotations

from ds_core.device import accelerators
from ds_tools import published as pub
from ds_tools.zero_memory_model import ModelShape


def flops_per_seq(shape: ModelShape) -> float | None:
    """6 x parameters x tokens of one sequence; None for a model of several towers (no single token count)."""
    return 6.0 * shape.params * shape.towers[0].seq if len(shape.towers) == 1 else None


# the dense bf16/fp16 peak of the accelerator each published fabric is built from (ds_core.device.accelerators)
_PEAK_OF = {"dgx-a100": "a100-80g", "dl1": "gaudi"}


def table_mfu(t: pub.PublishedTable) -> float | None:
    """The MFU a published table's 1-node figure implies at 6 x parameters x tokens against its accelerator's dense
    16-bit peak; None where the table's gradients are not 16-bit (TF32 has another peak) or no peak is known."""
    from ds_tools.calibration import params_of

    if t.setting("grad_bytes").values != (2,) or t.fabric not in _PEAK_OF:
        return None
    per_acc = t.table[1] / t.per_node
    return 6 * params_of(t.model, t.seq_len) * t.seq_len * per_acc / (accelerators.get(_PEAK_OF[t.fabric])
                                                                       .bf16_tflops * 1e12)


def mfu_range() -> tuple:
    """(lowest, highest) MFU the published 1-node figures (ds_tools.published) imply on their accelerators at
    6 x parameters x tokens, for the tables whose precision has a published dense peak, with the tables' keys."""
    got = [(table_mfu(t), t.key) for t in pub.PUBLISHED if table_mfu(t) is not None]
    lo, hi = min(got), max(got)
    return lo[0], hi[0], [k for _m, k in sorted(got)]
