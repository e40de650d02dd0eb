"""Rank-side wrapper of one study cell: run the training module unchanged, then write what its metrics do not hold.

    deepspeed --num_gpus 2 --module ds_tools.study.cell --study_target bridgetower_ds.train --run_dir R ...

`--study_target M` (anywhere in the arguments, so every launcher's own argument order works) names the module; it is
run with runpy as `python -m M` would run it (a path ending in .py: as `python PATH`). Afterwards each rank writes
`R/cell_stats/rank<RANK>.json`: DeepSpeed's communication-logger records (`comms_logger` in the DeepSpeed JSON;
deepspeed.comm.comms_logger) up to the end of ds_core.run.trainer.Trainer.fit (the whole run where the module never
calls it), and the process's peak memory. Done here rather than in ds_core.run.trainer so that the trainer stays the
same for study and non-study runs, and because the logger's records are complete only once the module has finished.
"""
from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
from pathlib import Path


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == flag and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value, i = a.split("=", 1)[1], i + 1
            continue
        out.append(a)
        i += 1
    return value, out


def comms_records() -> dict:
    """{op: {"count": n, "bytes": total, "sizes": {msg_size: count}, "latency_ms": total}} from DeepSpeed's logger.

    DeepSpeed appends, per call, its timer's elapsed(reset=False) (comm/comm.py log_wrapper). In 0.19 that is the
    running total of every call of that op so far (utils/timer.py _get_elapsed_msec sums all records and keeps them):
    the op's total time is the largest value recorded. Habana's fork (0.16.1) clears the records on each read, so each
    value is that call's own time: the total is their sum. Which one is read from the installed DeepSpeed
    (ds_core.compat.deepspeed_behaviour.comms_timer_cumulative)."""
    from deepspeed.comm import comm

    from ds_core.compat.deepspeed_behaviour import comms_timer_cumulative

    total = max if comms_timer_cumulative() else sum
    out = {}
    for op, by_size in comm.comms_logger.comms_dict.items():
        sizes = {str(size): int(rec[0]) for size, rec in by_size.items()}
        # the timer is per op, not per message size: the largest running total over all sizes, or every call's sum
        per_size = [total(rec[1]) for rec in by_size.values() if rec[1]]
        latency = total(per_size) if per_size else 0.0
        out[op] = {"count": sum(sizes.values()), "bytes": sum(int(s) * n for s, n in sizes.items()),
                   "sizes": sizes, "latency_ms": float(latency)}
    return out


def peak_memory() -> dict:
    """Peak memory of this rank: the accelerator's allocator peak where there is one, and the host RSS peak."""
    mem = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    try:
        import torch

        if torch.cuda.is_available():
            mem["device_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        elif hasattr(torch, "hpu") and torch.hpu.is_available():  # pragma: no cover - HPU only
            mem["device_peak_allocated_bytes"] = int(torch.hpu.max_memory_allocated())
    except Exception:  # pragma: no cover - no accelerator API: host figure only  # noqa: BLE001
        pass
    return mem


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    target, rest = _take(argv, "--study_target")
    if not target:
        raise SystemExit("ds_tools.study.cell: --study_target MODULE is required")
    run_dir, _ = _take(rest, "--run_dir")
    sys.argv = [target, *rest]
    # The comms counts a study reports are per optimizer step, so they are taken when ds_core.run.trainer.Trainer.fit
    # returns, before what an entry point does after training (BridgeTower's fp32 save_model gathers every parameter
    # with one all-reduce each under ZeRO-1: ~200 on the debug model, which once read as 66 "gradient collectives per
    # step").
    from ds_core.rank import process_end
    from ds_core.run.trainer import Trainer

    taken: dict = {}
    real_fit = Trainer.fit

    def fit_then_take_comms(self, *args, **kwargs):
        summary = real_fit(self, *args, **kwargs)
        taken["comms"] = comms_records()
        engine = self.engine
        try:   # the gradient size a prediction needs (ds_tools.study.emulated); ZeRO-3 partitions keep ds_numel
            taken["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        except AttributeError:
            pass
        # ZeRO 1/2 all-gather each parameter group's partitions in its own call (utils.py:1021 all_gather_dp_groups)
        opt = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
        if getattr(opt, "param_groups", None) is not None:
            taken["param_groups"] = len(opt.param_groups)
        return summary

    Trainer.fit = fit_then_take_comms  # every entry point trains through Trainer.fit
    written: list[bool] = []

    def write_stats(completed: bool) -> None:
        if written or not run_dir:
            return
        written.append(True)
        rank = int(os.environ.get("RANK", "0"))
        out = Path(run_dir) / "cell_stats"
        out.mkdir(parents=True, exist_ok=True)
        rec = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
               "comms": taken.get("comms") or comms_records(), "comms_window": "training" if taken else "run",
               "memory": peak_memory(), "completed": completed,
               "params": taken.get("params"), "param_groups": taken.get("param_groups")}
        tmp = out / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        os.replace(tmp, out / f"rank{rank}.json")

    # A target whose __main__ ends through ds_core.rank.process_end.run_main (every training entry) leaves with os._exit
    # after the atexit handlers, so the `finally` below never runs there: the handler writes the stats instead.
    atexit.register(lambda: write_stats(process_end.exit_status == 0))
    try:
        if target.endswith(".py"):  # a script path, as `deepspeed script.py` would run it: the script's folder
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # first on sys.path (its own imports)
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    finally:
        write_stats(sys.exc_info()[0] is None)

if __name__ == "__main__":
    main()
