"""Start-up cost: launch to the end of the first optimizer step of the 2-rank BERT debug run (deepspeed launcher,
bert_ref.train, ZeRO-1, ds_core) against a plain `torchrun` + DistributedDataParallel script of the same model
(bert_ref.model.build_model(debug()), torch AdamW, one synthetic batch of the same shape), both measured in this run.

    python bench/startup.py [--ranks 2] [--repeats 1]

Each side is launched `--repeats` times (alternating, ours first) and the best time kept. Ours is read from the first
step record's wall time in metrics.jsonl (ds_core.metrics writes `time`); the plain script prints its own. The last
line is one JSON object: ours_s, plain_s, startup_ratio = ours / plain (target <= 1.5), and both total run times.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # today's bench pattern (bench becomes a package in another issue)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(ranks: int) -> dict:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // ranks)))
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


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


def ours(tmp: Path, data: Path, ranks: int, i: int) -> tuple[float, float]:
    run = tmp / f"ours{i}"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
           str(_free_port()), "--module", "bert_ref.train", "--preset", "debug", "--deepspeed_config",
           "ds_configs/bert_debug_zero1_bf16.json", "--input_dir", str(data), "--run_dir", str(run),
           "--max_steps", "2", "--save_final_checkpoint", "false", "--progress_bar", "false"]
    t_launch = time.time()
    total, seen = _run(cmd, _env(ranks), tmp / f"ours{i}.log", watch=run / "metrics.jsonl")
    first = next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "step")
    return first.get("time", seen) - t_launch, total


def plain(tmp: Path, ranks: int, i: int) -> tuple[float, float]:
    out = tmp / f"plain{i}.json"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks), "--master_port",
           str(_free_port()), str(Path(__file__).resolve()), "--plain_worker", str(out)]
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
    tdist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="launches per side; the best is kept")
    ap.add_argument("--plain_worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.plain_worker:
        plain_worker(a.plain_worker)
        return {}
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as d:
        tmp = Path(d)
        data = _shards(tmp)
        runs_ours, runs_plain = [], []
        for i in range(a.repeats):
            runs_ours.append(ours(tmp, data, a.ranks, i))
            runs_plain.append(plain(tmp, a.ranks, i))
            print(f"repeat {i}: ours {runs_ours[-1][0]:.1f} s to first step ({runs_ours[-1][1]:.1f} s in all), "
                  f"plain torchrun+DDP {runs_plain[-1][0]:.1f} s ({runs_plain[-1][1]:.1f} s)", flush=True)
    o, p = min(runs_ours), min(runs_plain)
    res = dict(ranks=a.ranks, ours_s=round(o[0], 2), plain_s=round(p[0], 2), startup_ratio=round(o[0] / p[0], 2),
               ours_total_s=round(o[1], 2), plain_total_s=round(p[1], 2), target="<= 1.5")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
