"""`make gpu-check`: what one CUDA machine can tell about the toolkit in a few minutes, one JSON line at the end.

It is meant for a GPU machine you have for a short time and that may have no package registry: the Makefile installs
from a wheelhouse (`setup WHEELHOUSE=dir`), then this module plans its parts into a time budget (`--budget`, seconds,
counted from `--started_at` so the install is included; the Makefile's GPU_CHECK_BUDGET=480) and runs them most
valuable first. A part whose estimated cost no longer fits the budget left is recorded as skipped with its estimate.
The plan and each part's estimate are printed at the start; gpu_check_out/results.json is rewritten (valid JSON) after
every measurement, so a killed call keeps what it had:

  bert_large   BERT-Large phase 1 (seq 128, bf16, ZeRO-1, NVLAMB) at micro batch 256 (NVIDIA's phase-1 micro batch
               per GPU on 80 GB cards), halved while it does not fit (down to 16): bench.bert_step, ours and
               transformers Trainer on the same model, data and optimizer, at accumulation 8 (the recipe's
               per-GPU step, the optimizer amortised), ours compiled (`--compile on`) at 8, and both at 1 (the
               optimizer's share; only with `--part bert_large`, so the default budget holds both models); each
               window profiled over 2 warm-up steps.
  bridgetower  BridgeTower-Large architecture (random init, 294 px, bf16, ZeRO-1, batch 48) through
               `python -m bridgetower_ds.train` with the device image pipeline (and the host one with `--part
               bridgetower`) at 2 dataloader workers (the published best), and the plain transformers Trainer
               baseline (bench.bt_e2e's baseline process); each profiled over 2 warm-up steps (--profile_steps).
  tests        `pytest -m gpu tests`: the CUDA tests; passed / skipped / failed and the reasons.
  bert_1p5b    BERT-1.5B: the largest micro batch that trains with ZeRO-1 and with ZeRO-3 on one GPU (doubling /
               halving from ds-tune's prediction until the edge is found), next to ds-tune's prediction.

The results file also holds the device, `nvidia-smi`, the versions and the tail of every log (kept under 16 MB).
`--part NAME` runs one part. `--cpu_smoke` (the default where no CUDA device is visible) runs the same plan on the CPU
with the debug presets and tiny sizes, so the check cannot rot; CI runs it (tests/test_gpu_check.py). A part that
fails records its error and the log's tail and the check goes on; the exit status is 1 when any part failed.

    python -m bench.gpu_check [--part all|bert_large|bridgetower|tests|bert_1p5b] [--budget S] [--cpu_smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, a requirement there
    import tomli as tomllib

from bench.common import REPO, bench_env, photo_like

PARTS = ("bert_large", "bridgetower", "tests", "bert_1p5b")  # most valuable first: the plan's order
# estimated seconds per part on one H100/H200 (from an H200's start-up times and rates, less the large cells' init and
# save; bert_large at micro 256: 335 s with its accumulation-1 cells, which only `--part bert_large` runs) and on
# the CPU smoke (2 shared cores); a part is run only when its estimate fits in the budget left
ESTIMATE_S = {"gpu": {"bert_large": 275, "bridgetower": 140, "tests": 170, "bert_1p5b": 120},
              "cpu_smoke": {"bert_large": 110, "bridgetower": 90, "tests": 45, "bert_1p5b": 95}}
LOG_TAIL_CHARS = 4000
MAX_RESULT_BYTES = 16 * 2**20
OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


class Ctx:
    """What every part needs: where to write, smoke or GPU, the environment of its processes, the part's deadline."""

    def __init__(self, out: Path, smoke: bool):
        self.out, self.smoke = out, smoke
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        # smoke: the CPU accelerator, one thread per process (CI's 2 cores); GPU: DeepSpeed finds CUDA
        self.env = bench_env(threads=1, DS_ACCELERATOR="cpu") if smoke else bench_env(DS_ACCELERATOR="cuda")
        self.deadline = 0.0
        self.part_alone = False  # `--part NAME`: the part has the whole budget
        self.progress = lambda partial: None  # main sets it: writes a part's measurements the moment they exist

    def run(self, name: str, cmd: list[str], env: dict | None = None) -> tuple[int, str]:
        """Run cmd in its own session with its output in logs/<name>.log; killed (whole group) at the part's
        deadline. Returns (exit status, output); 124 on timeout."""
        log = self.logs / f"{name}.log"
        left = max(5.0, self.deadline - time.monotonic())
        with log.open("w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            p = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 124
        return rc, log.read_text(errors="replace")


class PartFailed(RuntimeError):
    pass


def _check(rc: int, out: str, what: str) -> None:
    if rc:
        raise PartFailed(f"{what} failed (exit {rc}{', part deadline reached' if rc == 124 else ''}):\n{out[-3000:]}")


def _last_json(out: str) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise PartFailed(f"no JSON line in the output:\n{out[-3000:]}")


def _summary(run_dir: Path) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in recs if r["type"] == "summary")


def device_info() -> dict:
    """The device this check ran on: torch's name for it and ds_core.device.accelerators' row (None: no peak, no
    MFU)."""
    import torch

    from ds_core.device.accelerators import from_device_name

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                            # as the machine sets it; the runs' processes hand DeepSpeed's op builder a form it
                            # parses through the toolkit's own start-up, not through this check
                            "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        info.update(device=name, accelerator_row=from_device_name(name), gpus=torch.cuda.device_count(),
                    cuda=torch.version.cuda)
    else:
        info.update(device="cpu", accelerator_row=None, gpus=0)
    for mod in ("deepspeed", "transformers", "torchvision"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - a missing optional package is a finding, not a crash
            info[mod] = f"not importable: {type(e).__name__}: {e}"
    return info


def _one_image(path_seed: tuple[str, int]) -> None:
    import numpy as np

    path, seed = path_seed
    photo_like(np.random.default_rng(seed)).save(path, "JPEG", quality=90)


def make_images_all_cores(root: Path, n: int) -> None:
    """bench.common's photo-like 640x480 JPEGs, one seed per image so a pool on every core can write them (one core
    took 40 s for 500 on a 16-core GPU machine); reused when all are there."""
    from multiprocessing import get_context

    root.mkdir(parents=True, exist_ok=True)
    todo = [(str(root / f"{i:05d}.jpg"), i) for i in range(n)]
    todo = [t for t in todo if not (Path(t[0]).exists() and Path(t[0]).stat().st_size > 0)]
    if todo:
        with get_context("spawn").Pool(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
            pool.map(_one_image, todo, chunksize=8)


def nvidia_smi() -> str:
    """`nvidia-smi`'s report, or why there is none (a CPU machine)."""
    try:
        proc = subprocess.run(["nvidia-smi"], check=False, capture_output=True, text=True, timeout=30)
        return proc.stdout[-8000:]
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi not run: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------------------- parts
def part_tests(ctx: Ctx) -> dict:
    """`pytest -m gpu tests`; counts from its JUnit XML. On CPU every test skips with its reason (what CI checks)."""
    import xml.etree.ElementTree as ET

    xml = ctx.work / "junit_gpu.xml"
    rc, out = ctx.run("tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                f"--junitxml={xml}", "tests"])
    if not xml.exists():
        raise PartFailed(f"pytest wrote no report (exit {rc}):\n{out[-3000:]}")
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    res: dict[str, Any] = {"collected": len(cases), "passed": 0, "skipped": 0, "failed": 0, "failures": {},
                           "skip_reasons": {}}
    for c in cases:
        name = f"{c.get('classname')}::{c.get('name')}"
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            res["failed"] += 1
            res["failures"][name] = (bad.get("message") or "")[:500]
        elif c.find("skipped") is not None:
            res["skipped"] += 1
            reason = c.find("skipped").get("message") or ""
            res["skip_reasons"][reason] = res["skip_reasons"].get(reason, 0) + 1
        else:
            res["passed"] += 1
    res["pytest_exit"] = rc
    if rc not in (0, 5) or res["failed"] or not cases:  # 5: nothing collected (then `not cases` says so)
        raise PartFailed(f"pytest -m gpu: {res['failed']} failed, exit {rc}, {len(cases)} collected: "
                         f"{json.dumps(res['failures'])[:2000]}")
    return res


def part_bert_large(ctx: Ctx) -> dict:
    """bench.bert_step on the whole BERT-Large (GPU) / the debug preset (smoke): ours and the Trainer at the recipe's
    accumulation per GPU (8 micro batches per optimizer step: the optimizer amortised as NVIDIA's is), ours compiled
    (`--compile on`) at the same accumulation (what decides whether compile turns on by default on CUDA), then ours and
    the Trainer at accumulation 1 (the optimizer's share of a step is the difference; when the part runs alone, and in
    the smoke)."""
    if ctx.smoke:
        # fp32: transformers' TrainingArguments refuses bf16 without a GPU (and CI's CPUs may lack native bf16)
        tries, accums, common = [2], (2, 1), ["--model", "debug", "--steps", "2", "--warmup", "4", "--threads", "1",
                                              "--precision", "fp32", "--profile_steps", "2"]
    else:
        tries, accums = [256, 128, 64, 32, 16], (8, 1)
        common = ["--model", "bert_large", "--steps", "4", "--warmup", "4", "--threads", "0", "--precision", "bf16",
                  "--profile_steps", "2"]
    cells = [(f"accum{accums[0]}", accums[0], []),
             (f"accum{accums[0]}_compiled", accums[0], ["--compile", "on", "--skip_trainer"]),
             (f"accum{accums[1]}", accums[1], [])][:3 if ctx.part_alone or ctx.smoke else 2]
    res: dict[str, Any] = {}
    for name, accum, extra in cells:
        if ctx.smoke and "--compile" in extra:
            # inductor's compile of even the debug model takes minutes on 2 CPU cores: tests/test_bert_compile.py
            # covers --compile there, and this cell's bench wiring is the same flag bench.bert_step passes through
            res[name] = {"skipped": "cpu smoke: no compile"}
            continue
        try:
            res[name] = _bert_large_at(ctx, tries, [*common, *extra], accum)
        except PartFailed as e:
            if not extra:
                raise
            res[name] = {"error": str(e)[-2000:]}  # the compiled cell failing is a finding; the eager cells go on
        ctx.progress(res)
        tries = [res[name].get("micro_batch") or tries[0]]  # the micro batch that fitted; accumulation adds none
    eager, compiled = res[cells[0][0]], res[cells[1][0]]
    if compiled.get("ours_samples_per_s"):
        res["compiled_over_eager"] = compiled["ours_samples_per_s"] / eager["ours_samples_per_s"]
    return res


def _bert_large_at(ctx: Ctx, tries: list[int], common: list[str], accum: int) -> dict:
    for micro in tries:
        rc, out = ctx.run(f"bert_large_micro{micro}_accum{accum}{'_compiled' if '--compile' in common else ''}", [
            sys.executable, "-m", "bench.bert_step", "--micro_batch", str(micro), "--grad_accum", str(accum),
            "--rounds", "1", "--skip_bound", *common])
        if rc and OOM.search(out) and micro != tries[-1]:
            continue  # the next smaller micro batch
        _check(rc, out, f"bench.bert_step micro {micro} accumulation {accum}")
        r = _last_json(out)
        keep = ("precision", "micro_batch", "grad_accum", "ours_samples_per_s", "mfu", "peak_tflops",
                "flops_per_seq", "trainer_samples_per_s", "step_ratio", "both_optimizer", "mlm_head", "ours_compiled")
        res = {k: r.get(k) for k in keep}
        res["ours_tflops"] = res["ours_samples_per_s"] * r["flops_per_seq"] / 1e12
        if res["trainer_samples_per_s"] and res["peak_tflops"]:  # the same FLOPs count: the same model and MLM work
            res["trainer_mfu"] = res["trainer_samples_per_s"] * r["flops_per_seq"] / 1e12 / res["peak_tflops"]
        res["oom_tried"] = [m for m in tries if m > micro]
        first = r.get("windows", [{}])[0]  # where the time went: ds_core.outputs.profile of each side's first window
        res["profile"] = {side: first.get(side, {}).get("profile") for side in ("ours", "trainer")}
        if res["mfu"] is not None and not 0 < res["mfu"] <= 1:
            raise PartFailed(f"MFU {res['mfu']} outside (0, 1]: FLOPs count or peak is wrong ({res})")
        return res
    raise AssertionError("unreachable")


def _tokenizer_dir(ctx: Ctx) -> Path:
    """bridgetower_ds.train needs a tokenizer directory for a non-debug preset: the debug tokenizer, saved (the
    Trainer baseline tokenizes with the same one, so both sides see the same ids)."""
    from bridgetower_ds.tokenizer import debug_tokenizer

    d = ctx.work / "bt_tokenizer"
    if not (d / "tokenizer.json").exists():
        debug_tokenizer().save_pretrained(str(d))
    return d


def part_bridgetower(ctx: Ctx) -> dict:
    from bench.bt_e2e import MAX_SEQ, make_manifest

    if ctx.smoke:
        n, batch, steps, warmup, grid = 24, 4, 2, 3, [("host", 0, False), ("device", 1, False)]
        model, base_flags = ["--preset", "debug"], []
    else:
        # 2 workers: the published best; the device pipeline only (the faster one: a host cell, ~60 s more, and the
        # compiled cell (`--compile on`: what decides whether `auto` compiles BridgeTower on CUDA), with its compile, do
        # not fit the default budget beside BERT-Large's four windows; `--part bridgetower` alone has room)
        n, batch, steps, warmup = 300, 48, 8, 4
        grid = [("device", 2, False)] + ([("device", 2, True), ("host", 2, False)] if ctx.part_alone else [])
        model = ["--preset", "bridgetower_large", "--image_size", "294", "--tokenizer_name_or_path",
                 str(_tokenizer_dir(ctx)), "--bf16"]
        # run_bridgetower.py's own torchvision transform (needs torchvision, which a CUDA image has)
        base_flags = ["--preset", "bridgetower_large", "--image_size", "294", "--bf16",
                      "--transform", "run_bridgetower"]
    ds = json.loads((REPO / "ds_configs" / "bridgetower_zero1_bf16.json").read_text())  # ZeRO-1, bf16, AdamW
    ds["train_micro_batch_size_per_gpu"] = batch
    ds_path = ctx.work / "bt_ds.json"
    ds_path.write_text(json.dumps(ds))
    make_images_all_cores(ctx.work / "bt_images", n)
    manifest = make_manifest(ctx.work / "bt_images", ctx.work / "bt_manifest")
    table: dict[str, Any] = {}
    for pipeline, workers, compiled in grid:
        cell = f"{pipeline}_w{workers}{'_compiled' if compiled else ''}"
        run_dir = ctx.work / f"bt_{cell}"
        rc, out = ctx.run(f"bt_{cell}", [
            sys.executable, "-m", "bridgetower_ds.train", "--do_train", *model, "--dataset_path", str(manifest),
            "--validation_fraction", "0", "--test_fraction", "0", "--deepspeed_config", str(ds_path),
            "--run_dir", str(run_dir), "--overwrite_run_dir", "true", "--max_steps", str(steps + warmup),
            "--throughput_warmup_steps", str(warmup), "--profile_steps", str(warmup - 2),
            "--micro_batch_size", str(batch),
            "--dataloader_num_workers", str(workers), "--max_seq_length", str(MAX_SEQ), "--pad_to_max_length", "true",
            "--image_pipeline", pipeline, "--save_final_checkpoint", "false", "--save_model", "false",
            "--progress_bar", "false", "--compile", "on" if compiled else "off"])
        if rc:  # recorded, and the grid goes on: one broken cell should not hide the others' numbers
            table[cell] = {"error": f"exit {rc}{' (part deadline)' if rc == 124 else ''}: {out[-1500:]}"}
            if rc == 124:
                break
            continue
        s = _summary(run_dir)
        taken = re.search(r"image pipeline: (\S+)", out)
        table[cell] = {"samples_per_s": s["samples_per_s"], "mfu": s.get("mfu"),
                       "pipeline_taken": taken.group(1) if taken else None, "profile": s.get("profile")}
        ctx.progress({"samples_per_s": table})
    base_out = ctx.work / "bt_baseline.json"
    rc, out = ctx.run("bt_trainer_baseline", [
        sys.executable, "-m", "bench.bt_e2e", "--baseline", "--manifest", str(manifest), "--out", str(base_out),
        f"--steps={steps}", f"--warmup={warmup}", f"--batch={batch}", f"--workers={max(w for _, w, _ in grid)}",
        f"--profile_steps={warmup - 2}", *base_flags])  # plain Trainer (DDP, bf16), as the published A100 baseline ran
    base_rec = json.loads(base_out.read_text()) if rc == 0 and base_out.exists() else {}
    base = base_rec.get("samples_per_s")
    rates = [v["samples_per_s"] for v in table.values() if "samples_per_s" in v]
    # the baseline's MFU from ours: the same model and batch, so the same FLOPs per sample (ours' MFU / ours' rate)
    per_sample = [v["mfu"] / v["samples_per_s"] for v in table.values() if v.get("mfu")]
    res = {"batch": batch, "images": n, "steps": steps, "warmup": warmup, "samples_per_s": table,
           "trainer_baseline_samples_per_s": base,
           "trainer_baseline_mfu": base * per_sample[0] if base and per_sample else None,
           "trainer_baseline_profile": base_rec.get("profile"),
           "best_over_baseline": max(rates) / base if rates and base else None}
    if table.get("device_w2_compiled", {}).get("samples_per_s") and table["device_w2"].get("samples_per_s"):
        res["compiled_over_eager"] = table["device_w2_compiled"]["samples_per_s"] / table["device_w2"]["samples_per_s"]
    failed = [k for k, v in table.items() if "error" in v]
    if base is None:
        failed.append("trainer_baseline")
        res["trainer_baseline_error"] = f"exit {rc}: {out[-1500:]}"
    if failed:
        res["errors"] = failed
    return res


def ds_tune_command() -> list[str]:
    """How to run `ds-tune` from this checkout: the module its console script names in pyproject.toml (the script
    may sit in another package after a restructure; the pyproject is the one place that says where)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["ds-tune"].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func} as m; sys.exit(m())"]


def tune_predictions(ctx: Ctx, row: str) -> dict[int, int]:
    """ds-tune's largest micro batch predicted to fit for bert_1p5b on one `row` accelerator, per ZeRO stage (1, 3),
    without activation checkpointing (the measured runs have none); 0 where nothing fits."""
    rc, out = ctx.run("ds_tune", [
        *ds_tune_command(), "--model", "bert_1p5b", "--accelerator", row, "--accelerators_per_node", "1",
        "--nodes", "1", "--global_batch", "512", "--stages", "1,3", "--activation_checkpointing", "off",
        "--json", "--all", "--out", str(ctx.work / "ds_config_tuned.json")])  # not into the checkout
    _check(rc, out, "ds-tune")
    feasible = json.loads(out[out.index("\n{") + 1:] if not out.startswith("{") else out)["feasible"]
    return {s: max([o["micro_batch"] for o in feasible if o["stage"] == s], default=0) for s in (1, 3)}


def _fits(ctx: Ctx, shards: Path, preset: str, stage: int, micro: int) -> bool:
    cfg = "bert_debug_zero{}_bf16.json" if preset == "debug" else "bert_1p5b_zero{}_bf16.json"
    run_dir = ctx.work / f"b15_z{stage}_m{micro}"
    rc, out = ctx.run(f"bert_1p5b_zero{stage}_micro{micro}", [
        sys.executable, "-m", "bert_ref.train", "--preset", preset, "--input_dir", str(shards),
        "--deepspeed_config", f"ds_configs/{cfg.format(stage)}", "--micro_batch_size", str(micro),
        "--gradient_accumulation_steps", "1", "--max_steps", "2", "--run_dir", str(run_dir),
        "--overwrite_run_dir", "true", "--save_final_checkpoint", "false", "--no_export_hf",
        "--progress_bar", "false", "--precision", "bf16"])
    if rc and OOM.search(out):
        return False
    _check(rc, out, f"bert_ref.train {preset} ZeRO-{stage} micro {micro}")
    return True


def part_bert_1p5b(ctx: Ctx) -> dict:
    """Largest micro batch that trains (2 steps) per ZeRO stage: start at ds-tune's prediction, double while it
    fits / halve while it does not (at most `limit` runs per stage); the edge is [largest fit, smallest OOM)."""
    from bert_ref.configs import get_preset as bert_preset
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    name, row, limit, cap = ("debug", "h100", 1, 4) if ctx.smoke else ("bert_1p5b", None, 3, 512)
    if row is None:
        row = device_info()["accelerator_row"]
        if row is None:
            raise PartFailed("this GPU has no row in ds_core.device.accelerators: no ds-tune prediction to compare")
    p = bert_preset(name)
    shards = ctx.work / f"shards_{name}"
    if not (shards / "part-00000.hdf5").exists():
        shards.mkdir(parents=True, exist_ok=True)
        write_shard(shards / "part-00000.hdf5", synthetic_arrays(3 * cap, p.seq_len, p.max_predictions_per_seq,
                                                                 vocab_size=min(p.vocab_size, 30522), seed=0),
                    vocab_size=p.vocab_size)
    res: dict[str, Any] = {"model": name, "ds_tune_accelerator": row}
    predictions = tune_predictions(ctx, row)
    for stage in (1, 3):
        predicted = predictions[stage]
        micro, fit, oom, runs = max(1, min(predicted, cap)), 0, None, 0
        while runs < limit and micro <= cap and (oom is None or micro < oom) and micro > fit:
            runs += 1
            if _fits(ctx, shards, name, stage, micro):
                fit = micro
                micro = micro * 2 if oom is None else (micro + oom) // 2
            else:
                oom = micro
                micro = max(fit, micro // 2) if fit == 0 else (fit + micro) // 2
                if micro == 0:
                    break
        res[f"zero{stage}"] = {"ds_tune_predicted_micro": predicted, "largest_fit_micro": fit,
                               "smallest_oom_micro": oom, "runs": runs}
    return res


RUNNERS = {"tests": part_tests, "bert_large": part_bert_large, "bridgetower": part_bridgetower,
           "bert_1p5b": part_bert_1p5b}


def plan(parts: tuple[str, ...], mode: str, budget: float) -> list[tuple[str, float, bool]]:
    """(part, estimated seconds, planned) in run order: a part is planned when the estimates of the planned parts
    before it and its own fit in the budget (a later, cheaper part may still fit where a dearer one did not)."""
    used, out = 0.0, []
    for part in parts:
        est = ESTIMATE_S[mode][part]
        fits = used + est <= budget
        used += est if fits else 0
        out.append((part, est, fits))
    return out


def write_results(path: Path, results: dict, logs: Path) -> None:
    """The one results file, valid JSON after every write (written beside and renamed over), under 16 MB: the tail of
    every log goes in, shortened further if the whole would not fit."""
    tail = LOG_TAIL_CHARS
    while True:
        results["log_tails"] = {f.stem: f.read_text(errors="replace")[-tail:] for f in sorted(logs.glob("*.log"))}
        data = json.dumps(results, indent=1)
        if len(data.encode()) < MAX_RESULT_BYTES or tail < 100:
            break
        tail //= 4
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data)
    tmp.replace(path)


def _run_part(ctx: Ctx, part: str, est: float, end: float, save) -> dict:
    left = end - time.monotonic()
    if est > left:
        print(f"[gpu_check] {part}: skipped (estimate {est:.0f} s, {left:.0f} s left)", flush=True)
        return {"ok": True, "skipped_for_budget": True, "estimate_s": est, "reason": f"{left:.0f} s of the budget left"}
    t0 = time.monotonic()
    ctx.deadline = end  # a part may overrun its estimate, never the budget
    ctx.progress = lambda partial: save({"running": True, "estimate_s": est, **partial})
    print(f"[gpu_check] {part} (estimate {est:.0f} s, {left:.0f} s left) ...", flush=True)
    try:
        rec = RUNNERS[part](ctx)
        rec = {"ok": not rec.get("errors"), **rec}
    except Exception as e:  # noqa: BLE001 - one part's failure is recorded; the other parts still run
        rec = {"ok": False, "error": f"{type(e).__name__}: {e}"[-4000:]}
    rec.update(estimate_s=est, seconds=round(time.monotonic() - t0, 1))
    print(f"[gpu_check] {part}: {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']} s", flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--part", default="all", choices=("all", *PARTS), help="one part only")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check, install included")
    ap.add_argument("--started_at", type=float, default=None,
                    help="epoch seconds the check (its install) began; the budget counts from here (default: now)")
    ap.add_argument("--cpu_smoke", action="store_true",
                    help="debug presets and tiny sizes on the CPU (the default where no CUDA device is visible)")
    ap.add_argument("--out", default=str(REPO / "gpu_check_out"), help="results.json and logs/ go here")
    a = ap.parse_args(argv)
    import torch

    smoke = a.cpu_smoke or not torch.cuda.is_available()
    mode = "cpu_smoke" if smoke else "gpu"
    spent = max(0.0, time.time() - a.started_at) if a.started_at else 0.0
    t_all = time.monotonic()
    end = t_all + a.budget - spent
    out = Path(a.out)
    ctx = Ctx(out, smoke)
    ctx.part_alone = a.part != "all"
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if results.get("mode") != mode:
        results = {}  # a smoke run's numbers never mix with a GPU run's
    steps = plan(PARTS if a.part == "all" else (a.part,), mode, a.budget - spent)
    results.update(mode=mode, budget_s=a.budget, spent_before_s=round(spent, 1), device=device_info(),
                   nvidia_smi=nvidia_smi(), plan=[{"part": p, "estimate_s": e, "planned": f} for p, e, f in steps])
    results.setdefault("parts", {})
    print(f"[gpu_check] {mode}, budget {a.budget:.0f} s ({spent:.0f} s spent before): "
          + ", ".join(f"{p} ~{e:.0f} s{'' if f else ' (will not fit)'}" for p, e, f in steps), flush=True)
    for part, est, _ in steps:
        def save(rec, part=part):
            results["parts"][part] = rec
            write_results(results_path, results, ctx.logs)
        save(_run_part(ctx, part, est, end, save))
    results["seconds"] = round(time.monotonic() - t_all, 1)
    results["ok"] = all(p["ok"] for p in results["parts"].values())
    write_results(results_path, results, ctx.logs)
    print(json.dumps({"gpu_check": mode, "ok": results["ok"], "results": str(results_path),
                      "bytes": results_path.stat().st_size, "device": results["device"].get("device"),
                      "seconds": results["seconds"], "parts": results["parts"]}), flush=True)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
