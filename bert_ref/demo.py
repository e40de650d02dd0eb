"""`make demo`: a generated text corpus -> bert-prep (text -> vocab -> shards, one held-out test shard) -> 2-rank
ZeRO-1 pretraining of the debug preset (the run's precision rule) with an end-of-run eval -> metrics.jsonl ->
throughput summary. A few minutes on 2 CPU cores; nothing is downloaded.

    python -m bert_ref.demo --out demo_out [--steps 60] [--ranks 2]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from ds_core.files import claim_output_dir
from ds_core.rank.rendezvous import rank_env

REPO = Path(__file__).resolve().parents[1]

# A small generated "encyclopedia": each document keeps to one topic, so next-sentence prediction has a signal
# (a random next sentence usually comes from another topic) and masked words are predictable from their context.
_TOPICS = {
    "river": ("water", "bank", "boat", "fish", "bridge", "current", "delta", "valley"),
    "castle": ("tower", "wall", "king", "gate", "knight", "moat", "hall", "banner"),
    "forest": ("tree", "fox", "path", "leaf", "owl", "moss", "deer", "trail"),
    "harbor": ("ship", "sailor", "dock", "crane", "cargo", "lighthouse", "pier", "anchor"),
    "mountain": ("peak", "glacier", "climber", "ridge", "snow", "cabin", "goat", "pass"),
    "city": ("street", "market", "tram", "square", "bakery", "museum", "clock", "station"),
}
_ADJ = ("old", "quiet", "bright", "narrow", "ancient", "busy", "cold", "green", "small", "famous", "northern", "wide")
_VERB = ("crosses", "faces", "guards", "follows", "surrounds", "reaches", "overlooks", "shelters", "joins", "hides")
_PLACE = ("near the coast", "in the spring", "after the storm", "before dawn", "during the festival",
          "by the old road", "at the edge of town", "under a grey sky")


def make_corpus(path: Path, docs: int = 240, seed: int = 0) -> None:
    """Plain text, documents separated by blank lines (bert-prep text's plain format)."""
    rng = random.Random(seed)
    out = []
    for _ in range(docs):
        topic = rng.choice(sorted(_TOPICS))
        words = _TOPICS[topic]
        sents = [f"The {topic} is {rng.choice(_ADJ)} and well known."]
        for _ in range(rng.randint(6, 12)):
            a, b = rng.sample(words, 2)
            sents.append(f"The {rng.choice(_ADJ)} {a} {rng.choice(_VERB)} the {b} {rng.choice(_PLACE)}.")
        out.append(" ".join(sents))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(out) + "\n")


def _run(cmd: list[str], env: dict | None = None, log: Path | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    if log is None:
        subprocess.run(cmd, check=True, cwd=REPO, env=env)
        return
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.stdout.write(log.read_text()[-6000:])
        raise SystemExit(f"demo: {cmd[0]} failed (exit {proc.returncode}); full log: {log}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--out", default="demo_out",
                    help="output directory: made, or replaced where an earlier run of this demo made it; any "
                         "other non-empty directory is refused")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps")
    ap.add_argument("--ranks", type=int, default=2, help="local ranks (python -m launch.local_ranks -n)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out).resolve()
    try:  # a directory of the user's is never replaced: only what an earlier run of this demo made
        said = claim_output_dir(out, "bert_ref.demo")
    except FileExistsError as e:
        raise SystemExit(f"demo: {e}") from None
    if said:
        print(said, flush=True)
    py = sys.executable
    prep = [py, "-m", "bert_ref.prep"]

    make_corpus(out / "raw" / "corpus.txt")
    _run([*prep, "text", "--input", str(out / "raw"), "--output", str(out / "text"), "--num_shards", "3",
          "--workers", "1", "--no_progress"])
    # <= 1024 tokens: the debug preset's vocabulary
    _run([*prep, "vocab", "--input", str(out / "text"), "--output", str(out / "vocab.txt"), "--vocab_size", "1000",
          "--no_progress"])
    _run([*prep, "shards", "--input", str(out / "text"), "--vocab", str(out / "vocab.txt"), "--output",
          str(out / "hdf5_seq128_pred20"), "--max_seq_length", "128", "--max_predictions_per_seq", "20",
          "--dupe_factor", "2", "--num_test_shards", "1", "--workers", "1", "--no_progress"])
    t_prep = time.perf_counter() - t0

    env = rank_env(pythonpath=[REPO], extra={"TOKENIZERS_PARALLELISM": "false"})
    if env.get("DS_ACCELERATOR") == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.ranks)))
    run_dir = out / "run"
    # the documented local start (docs: python -m launch.local_ranks -n 2 -m bert_ref.train ...)
    _run([py, "-m", "launch.local_ranks", "-n", str(args.ranks), "-m", "bert_ref.train",
          "--preset", "debug", "--deepspeed_config", "ds_configs/bert_debug_zero1_bf16.json",
          "--input_dir", str(out / "hdf5_seq128_pred20"), "--run_dir", str(run_dir), "--max_steps", str(args.steps),
          "--optimizer", "lamb", "--learning_rate", "0.02", "--warmup_proportion", "0.1",
          "--num_steps_per_checkpoint", str(max(1, args.steps // 2)), "--progress_bar", "false"],
         env=env, log=out / "train.log")

    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recs if r["type"] == "step"]
    s = next(r for r in reversed(recs) if r["type"] == "summary")
    ev = next((r for r in reversed(recs) if r["type"] == "eval"), None)

    def fmt(v, spec=".3g"):
        return "n/a" if v is None else format(v, spec)

    print("\n== BERT debug pretraining demo: ZeRO-%s %s, %d ranks x micro batch %d, seq %d ==" % (
        s["zero_stage"], s["precision"], s["world_size"], s["micro_batch"], s["seq_len"]))
    print(f"steps {s['steps']} (throughput over {s['measured_steps']} steps after {s['warmup_steps_excluded']} "
          f"warm-up steps, {fmt(s['measured_seconds'], '.2f')} s)")
    k = max(1, min(5, len(steps) // 4))
    avg = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    print(f"MLM loss {avg(steps[:k], 'mlm_loss'):.3f} -> {avg(steps[-k:], 'mlm_loss'):.3f}   NSP loss "
          f"{avg(steps[:k], 'nsp_loss'):.3f} -> {avg(steps[-k:], 'nsp_loss'):.3f}   (mean of first / last {k} steps)")
    if ev is not None:
        print(f"held-out ({ev['samples']} samples): MLM loss {ev['mlm_loss']:.3f}, accuracy {ev['mlm_accuracy']:.3f}; "
              f"NSP loss {ev['nsp_loss']:.3f}, accuracy {ev['nsp_accuracy']:.3f}")
    print(f"samples/s {fmt(s['samples_per_s'])}   seqs/s per accelerator {fmt(s['seqs_per_s_per_accelerator'])}   "
          f"tokens/s {fmt(s['tokens_per_s'])}")
    where = "measured matmul on this CPU" if s["accelerator"] == "cpu" else s["accelerator"]
    print(f"TFLOPs per accelerator {fmt(s['tflops_per_accelerator'])}   MFU {fmt(s['mfu'])} "
          f"(peak {fmt(s['peak_tflops_per_accelerator'])} {s['precision']} TFLOPs, {where})")
    for key in ("precision_note", "mfu_note"):
        if s.get(key):
            print(f"{key}: {s[key]}")
    print(f"checkpoints {fmt(s.get('checkpoint_s'), '.2f')} s and eval {fmt(s.get('eval_s'), '.2f')} s, outside "
          f"the throughput window; peak memory per rank {[round(m, 2) for m in s.get('peak_memory_gb_per_rank', [])]} "
          f"GiB ({s.get('peak_memory_kind', 'n/a')})")
    print(f"prep {t_prep:.0f} s, total {time.perf_counter() - t0:.0f} s; training log: {out / 'train.log'}")
    print(f"metrics: {metrics}")
    return s


if __name__ == "__main__":
    main()
