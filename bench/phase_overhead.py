"""What sampled phase timing (ds_core.outputs.phases) costs a run: 2 CPU ranks train the tiny model of
tests/tiny_train.py (fp32, ZeRO-1, accumulation 2; steps of a few ms, so the timer's fixed cost weighs as much as it
ever will) with --phase_timing_every 0 (off), the default 10, and 1 (every step), in interleaved rounds, and reports per
setting:

  self      the timer's own host time over the run (phase_timing_overhead_s of rank 0's summary: marks, collective
            wrapper, reading, the all_gather of sampled steps) divided by the run's training time
  e2e       samples/s relative to the "off" run of the same round (median over rounds; noisy on a shared machine)

    python -m bench.phase_overhead                 # last line: {"bench": "phase_overhead", "self_frac": ...}
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.common import REPO, bench_env, run_local_ranks
from ds_core.config import DS_CONFIG_DIR

SETTINGS = (0, 10, 1)


def run_once(tmp: Path, every: int, steps: int, tag: str) -> dict:
    cfg = json.loads((DS_CONFIG_DIR / "zero1_bf16.json").read_text())
    cfg.update(gradient_accumulation_steps=2, bf16={"enabled": False})
    ds = tmp / "zero1_fp32.json"
    ds.write_text(json.dumps(cfg))
    run = tmp / f"run_{tag}"
    run_local_ranks(2, [str(REPO / "tests" / "tiny_train.py"), "--run_dir", str(run), "--deepspeed_config", str(ds),
                        "--max_steps", str(steps), "--phase_timing_every", str(every), "--progress_bar", "false",
                        "--save_final_checkpoint", "false", "--throughput_warmup_steps", "5", "--log_every", "10",
                        "--num_samples", "4096"],
                    env=bench_env(threads=1, DS_ACCELERATOR="cpu"), log=tmp / f"{tag}.log", timeout_s=900,
                    what=f"tiny run, --phase_timing_every {every}")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in recs if r["type"] == "summary")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    rows: dict[int, list] = {k: [] for k in SETTINGS}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for every in SETTINGS:
                rows[every].append(run_once(Path(d), every, a.steps, f"r{r}_k{every}"))
    out = {}
    print(f"tiny model, 2 CPU ranks, fp32 ZeRO-1, accumulation 2, {a.steps} steps x {a.rounds} rounds")
    print("| --phase_timing_every | samples/s (median) | e2e vs off (median) | timer's own time / training time |")
    print("|---:|---:|---:|---:|")
    for every in SETTINGS:
        sps = [s["samples_per_s"] for s in rows[every]]
        ratio = [s["samples_per_s"] / off["samples_per_s"] for s, off in zip(rows[every], rows[0])]
        self_frac = [s.get("phase_timing_overhead_s", 0.0) / s["measured_seconds"] for s in rows[every]]
        out[every] = {"samples_per_s": statistics.median(sps), "e2e_ratio": statistics.median(ratio),
                      "e2e_ratio_range": [min(ratio), max(ratio)], "self_frac": max(self_frac)}
        print(f"| {every} | {statistics.median(sps):.1f} | {statistics.median(ratio):.3f} "
              f"({min(ratio):.3f}-{max(ratio):.3f}) | {100 * max(self_frac):.2f} % |")
    print(json.dumps({"bench": "phase_overhead", "self_frac_default": round(out[10]["self_frac"], 5),
                      "self_frac_every_step": round(out[1]["self_frac"], 5), "target": 0.02,
                      "settings": {str(k): v for k, v in out.items()}}))


if __name__ == "__main__":
    main()
