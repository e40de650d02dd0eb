"""Start-up cost: launch to the end of the first optimizer step of the 2-rank BERT debug run, started the way the
docs say (`python -m launch.local_ranks -n 2 -m bert_ref.train ...`: bert_ref.train, ZeRO-1, ds_core), against a
plain `torchrun` + DistributedDataParallel script of the same model (bert_ref.model.build_model(debug()), torch AdamW,
one synthetic batch of the same shape), both measured in this run. The same run through DeepSpeed's launcher
(`deepspeed --num_gpus 2 --module bert_ref.train ...`, still supported) is measured too, for reference.

    python -m bench.startup [--ranks 2] [--repeats 3] [--skip_deepspeed_launcher]

The sides alternate within each repeat (ours, plain, deepspeed launcher; each repeat starts with the next side) and
each side's median over the repeats is kept (the machine may be shared; interleaving spreads other load over all
sides, and the rotation the first launch's cold caches). Ours is read from the first step record's wall time in
metrics.jsonl (ds_core.outputs.metrics writes `time`); the plain script prints its own. The last line is one JSON
object: ours_s, plain_s, startup_ratio = ours / plain (target <= 1.5), deepspeed_launcher_s and its ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, bench_env
from ds_core.compat.torch_releases import release_process_groups
from ds_core.rank.process_end import run_main
from ds_core.rank.rendezvous import free_port
from launch.local_ranks import deepspeed_launcher


def _env(ranks: int) -> dict:
    return bench_env(threads=max(1, (os.cpu_count() or 2) // ranks))


def _shards(tmp: Path) -> Path:
    from bert_ref.configs import debug
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    p = debug()
    d = tmp / "shards"
    d.mkdir(parents=True, exist_ok=True)
    write_shard(d / "part-00000.hdf5", synthetic_arrays(256, p.seq_len, p.max_predictions_per_seq,
                                                        vocab_size=p.vocab_size, seed=0), compression=None)
    return d


def _run(cmd: list[str], env: dict, log: Path, watch: Path | None = None) -> tuple[float, float | None]:
    """Run cmd to the end; returns (seconds in all, wall time when `watch` (a metrics.jsonl) first held a step
    record, polled: ds_core versions that do not write the record's own `time` are measured the same way)."""
    t0, seen = time.time(), None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if watch is not None and seen is None and watch.exists() and '"type": "step"' in watch.read_text():
                seen = time.time()
            time.sleep(0.05)
    if proc.returncode:
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"startup bench: {cmd[0]} failed (exit {proc.returncode}); log: {log}")
    return time.time() - t0, seen


def _train_args(data: Path, run: Path) -> list[str]:
    return ["--preset", "debug", "--deepspeed_config", "ds_configs/bert_debug_zero1_bf16.json", "--input_dir",
            str(data), "--run_dir", str(run), "--max_steps", "2", "--save_final_checkpoint", "false",
            "--progress_bar", "false"]


def ours(tmp: Path, data: Path, ranks: int, i: int, via_deepspeed: bool = False) -> tuple[float, float]:
    """Launch to the first step record: the documented local starter, or (via_deepspeed) DeepSpeed's launcher."""
    name = f"{'ds' if via_deepspeed else 'ours'}{i}"
    run = tmp / name
    if via_deepspeed:
        cmd = [*deepspeed_launcher(), "--num_gpus", str(ranks), "--master_port", str(free_port()),
               "--module", "bert_ref.train", *_train_args(data, run)]
    else:
        cmd = [sys.executable, "-m", "launch.local_ranks", "-n", str(ranks), "-m", "bert_ref.train",
               *_train_args(data, run)]
    t_launch = time.time()
    total, seen = _run(cmd, _env(ranks), tmp / f"{name}.log", watch=run / "metrics.jsonl")
    first = next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "step")
    return first.get("time", seen) - t_launch, total


def plain(tmp: Path, ranks: int, i: int) -> tuple[float, float]:
    out = tmp / f"plain{i}.json"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), "-m", "bench.startup", "--plain_worker", str(out)]
    t_launch = time.time()
    total, _ = _run(cmd, _env(ranks), tmp / f"plain{i}.log")
    return json.loads(out.read_text())["time"] - t_launch, total


def plain_worker(out: str) -> None:
    """The baseline: what any DDP script does before its first step, nothing more (no deepspeed import)."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bert_ref.configs import debug
    from bert_ref.model import build_model

    tdist.init_process_group("gloo")
    torch.manual_seed(42)
    p = debug()
    model = DDP(build_model(p))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, S = 4, p.seq_len  # bert_debug_zero1_bf16.json's micro batch
    ids = torch.randint(104, p.vocab_size, (B, S))
    labels = torch.full((B, S), -100)
    labels[:, 1:1 + p.max_predictions_per_seq] = ids[:, 1:1 + p.max_predictions_per_seq]
    res = model(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids))
    loss = F.cross_entropy(res.prediction_logits.reshape(-1, p.vocab_size).float(), labels.reshape(-1),
                           ignore_index=-100) + F.cross_entropy(res.seq_relationship_logits.float(),
                                                                torch.randint(0, 2, (B,)))
    loss.backward()
    opt.step()
    t = time.time()
    if tdist.get_rank() == 0:
        Path(out).write_text(json.dumps({"time": t}))
    release_process_groups()  # destroy_process_group without torch 2.6's deadlock


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="launches per side; the median is kept")
    ap.add_argument("--skip_deepspeed_launcher", action="store_true", help="do not also time `deepspeed --num_gpus`")
    ap.add_argument("--plain_worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.plain_worker:
        plain_worker(a.plain_worker)
        return {}
    sides = ["ours", "plain"] + ([] if a.skip_deepspeed_launcher else ["deepspeed_launcher"])
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as d:
        tmp = Path(d)
        data = _shards(tmp)
        launch = {"ours": lambda i: ours(tmp, data, a.ranks, i), "plain": lambda i: plain(tmp, a.ranks, i),
                  "deepspeed_launcher": lambda i: ours(tmp, data, a.ranks, i, via_deepspeed=True)}
        for i in range(a.repeats):
            # the first launch pays cold caches (page cache, .pyc): each repeat starts with another side
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                runs[side].append(launch[side](i))
            print(f"repeat {i}: " + ", ".join(f"{k} {v[-1][0]:.1f} s to first step ({v[-1][1]:.1f} s in all)"
                                               for k, v in runs.items()), flush=True)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
    o, p = med["ours"], med["plain"]
    res = dict(ranks=a.ranks, repeats=a.repeats, ours_s=round(o[0], 2), plain_s=round(p[0], 2),
               startup_ratio=round(o[0] / p[0], 2), ours_total_s=round(o[1], 2), plain_total_s=round(p[1], 2),
               target="<= 1.5")
    if "deepspeed_launcher" in med:
        res.update(deepspeed_launcher_s=round(med["deepspeed_launcher"][0], 2),
                   deepspeed_launcher_ratio=round(med["deepspeed_launcher"][0] / p[0], 2))
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
