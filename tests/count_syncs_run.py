"""A short bert_ref.train run with every host read of a tensor counted per optimizer step; driven by
tests/test_step_syncs.py.

    python -m launch.local_ranks -n 1 tests/count_syncs_run.py OUT.json -- <bert_ref.train arguments>

Counted from the first optimizer step to the last: aten::_local_scalar_dense (`.item()`, `float(t)`, `bool(t)`, seen
by ds_tools.op_count.OpCounter) and Tensor.tolist() / Tensor.numpy() (on the CPU they read memory without an aten op).
Step k's window runs from the end of the loop's handling of step k - 1 to the end of its handling of step k. Each
read is listed with its site (innermost frame outside torch/); the loop's deferred reads (ds_core.run.readback
PendingStep.read) also say which step's values they read, to tell a read of an earlier step (its work is done: on an
accelerator the device is already busy with the next step) from a stall."""
from __future__ import annotations

import json
import sys
import traceback

import torch

from ds_core.rank.process_end import run_main
from ds_tools.op_count import OpCounter


def _site() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in fr.filename and "count_syncs_run.py" not in fr.filename \
                and "op_count.py" not in fr.filename:
            return f"{'/'.join(fr.filename.split('/')[-2:])}:{fr.lineno} {fr.name}"
    return "?"


def main() -> None:
    cut = sys.argv.index("--")
    out_path = [a for a in sys.argv[1:cut] if not a.startswith("--local_rank")][0]  # the launcher adds --local_rank
    rest = sys.argv[cut + 1:]
    from bert_ref import train
    from ds_core.run import readback, trainer

    counter = OpCounter(where=True)
    state = {"step": 0, "reads": [], "steps": {}, "lagged": []}

    def host_read(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            if _active:
                state["reads"].append(_site())
            return orig(self, *a, **k)
        return read

    _active: list = []
    for name in ("tolist", "numpy"):
        setattr(torch.Tensor, name, host_read(name))
    pending_cls = getattr(readback, "PendingStep", None)
    if pending_cls is not None:
        orig_read = pending_cls.read

        def read(self):
            state["lagged"].append([state["step"], self.step])  # (the loop's step now, the step read)
            return orig_read(self)
        pending_cls.read = read

    orig_after, orig_batches = trainer.Trainer._after_optimizer_step, trainer.Trainer._micro_batches

    def after(self, *a, **k):
        try:
            return orig_after(self, *a, **k)
        finally:
            syncs = [s for s, n in counter.sync_sites.items() for _ in range(n)] + state["reads"]
            state["steps"][self.step] = syncs
            counter.sync_sites.clear()
            state["reads"] = []
            state["step"] = self.step

    def batches(self):  # counting while the loop runs: from its first next(batch) until it breaks or ends
        with counter:
            _active.append(counter)
            try:
                yield from orig_batches(self)
            finally:
                _active.clear()

    trainer.Trainer._after_optimizer_step, trainer.Trainer._micro_batches = after, batches
    sys.argv = [sys.argv[0], *rest]
    try:
        train.main()
    finally:
        with open(out_path, "w") as f:
            json.dump({"steps": state["steps"], "lagged": state["lagged"]}, f, indent=1)


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
