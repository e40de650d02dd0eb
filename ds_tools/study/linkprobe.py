"""Measure an emulated link's per-call cost of a collective (alpha) before a multi-node cell trains over it.

One process per "node" (each inside its namespace, ds_tools.study.netns), a gloo process group over the shaped link,
then many tiny collectives, each after a barrier so that both ranks start it together (arrival skew is the phase
timing's `wait`, not the link's cost):

    alpha_all_reduce_s    median seconds of a 1-element fp32 all_reduce
    alpha_all_gather_s    median seconds of a 1-element-per-rank all_gather_into_tensor
    busbw_Bps             bus bandwidth of an --nbytes fp32 all_reduce (NCCL's definition: 2 (n-1)/n S / (t - alpha),
                          median t), i.e. what the shaped link delivers to gloo on this host now

A tiny message's time is all latency: gloo's software path per call (pair setup of the op, the TCP round trips of
its algorithm over the veth/bridge hop, the processes being scheduled on a shared host). `ds_tools.study.emulated`
feeds alpha to the model as the fabric's per-call cost (`fabrics.Fabric.call_us`) and busbw / line rate as its one
efficiency factor: measured here, at other message sizes than the training's, never fitted to the run it predicts.
Rank 0 writes the JSON.

    python -m ds_tools.study.linkprobe --rank R --world_size 2 --master_addr A --master_port P --out FILE
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main
from ds_core.compat.torch_releases import release_process_groups
from ds_core.rank.process_end import run_main

WARMUP = 10


def probe(rank: int, world_size: int, master_addr: str, master_port: int, calls: int, nbytes: int) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size)
    try:
        x = torch.ones(1)
        out = torch.empty(world_size)
        times: dict[str, list[float]] = {"all_reduce": [], "all_gather": []}
        for i in range(WARMUP + calls):
            for kind in times:
                dist.barrier()
                t = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(x)
                else:
                    dist.all_gather_into_tensor(out, x)
                if i >= WARMUP:
                    times[kind].append(time.perf_counter() - t)
        big, ts = torch.ones(max(1, nbytes // 4)), []
        for i in range(2 + max(3, calls // 10)):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(big)
            if i >= 2:
                ts.append(time.perf_counter() - t)
        big_s = statistics.median(ts)
        res = {"world_size": world_size, "calls": calls, "backend": "gloo", "torch": torch.__version__,
               "big_nbytes": big.numel() * 4, "big_all_reduce_s": big_s, "big_calls": len(ts),
               "how": "median of 1-element collectives, each after a barrier (ds_tools.study.linkprobe)"}
        for kind, ts in times.items():
            q = statistics.quantiles(ts, n=10)
            res[f"alpha_{kind}_s"] = statistics.median(ts)
            res[f"p10_{kind}_s"], res[f"p90_{kind}_s"] = q[0], q[-1]
        moved = 2 * (world_size - 1) / world_size * res["big_nbytes"]
        res["busbw_Bps"] = moved / max(big_s - res["alpha_all_reduce_s"], 1e-9)
        return res
    finally:
        release_process_groups()  # destroy_process_group without torch 2.6's deadlock


def main(argv: Sequence[str] | None = None) -> int:
    def build_parser() -> ArgumentParser:
        p = ArgumentParser(allow_abbrev=False, prog="python -m ds_tools.study.linkprobe",
                           description=__doc__.split("\n\n")[0])
        p.add_argument("--rank", type=int, required=True)
        p.add_argument("--world_size", type=int, required=True)
        p.add_argument("--master_addr", required=True)
        p.add_argument("--master_port", type=int, required=True)
        p.add_argument("--calls", type=int, default=100)
        p.add_argument("--nbytes", type=int, default=1 << 20, help="the bandwidth all_reduce's size (default 1 MiB)")
        p.add_argument("--out", type=Path, help="JSON written by rank 0")
        return p

    def body(a) -> int:
        if a.calls < 10:
            raise ValueError(f"--calls {a.calls}: expected >= 10 (a median of fewer is noise)")
        res = probe(a.rank, a.world_size, a.master_addr, a.master_port, a.calls, a.nbytes)
        if a.rank == 0:
            text = json.dumps(res, indent=2)
            if a.out:
                a.out.write_text(text + "\n")
            print(text)
        return 0

    return cli_main(argv, build_parser, body, (ValueError, OSError, RuntimeError))


if __name__ == "__main__":
    # ends as a rank does, without the interpreter's finalisation: probe()'s group is released, not freed, and gloo's
    # live threads do not survive finalisation (ds_core.rank.process_end)
    run_main(lambda: sys.exit(main()))
