"""A rank that finished its work exits with its own status, never with an abort from interpreter finalisation.

The hazard, made certain: a gloo work thread runs a future's Python callback that is still going (sleeping, GIL
released) when the main thread returns. Python then finalises, the callback thread needs the GIL back, CPython 3.11
ends it with pthread_exit through torch's noexcept C++ frames: "terminate called without an active exception",
SIGABRT. In real runs the same happens, rarely, when gloo's thread drops the last reference to a collective's tensors
late (a loaded machine): one 2-rank run per full CI suite failed so, in a different test each time.
`ds_core.rank.process_end.run_main` (every rank entry's `__main__`) ends the process without finalising, after what
Python's exit does first: joining non-daemon threads, atexit handlers, flushing stdout.
"""
import signal
import subprocess
import sys

import pytest

from conftest import REPO

RANK = """
import atexit, sys, threading, time
from pathlib import Path
import torch, torch.distributed as dist
from ds_core.rank.dist import shutdown_distributed
from ds_core.rank.process_end import run_main

out = Path(sys.argv[1])
HELD = []
def main():
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
    side = dist.new_group([0])  # the late work runs on a group of its own: the end's barrier (WORLD) does not wait
    t = torch.ones(4)
    work = dist.all_reduce(t, group=side, async_op=True)
    def late(fut):  # runs in gloo's thread, which outlives the main thread
        time.sleep(1.5)
        return fut.value()
    work.get_future().then(late)
    time.sleep(0.2)
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    def writer():  # a non-daemon thread still working when main() returns: Python waits for it, so do we
        time.sleep(0.5)
        (out / "thread").write_text("done")
    threading.Thread(target=writer).start()
    HELD.extend([dist.group.WORLD, side])  # as DeepSpeed's engine holds its groups until the process ends
    shutdown_distributed()
    print("main done", end="")  # no newline, no flush: the exit must flush it
    if sys.argv[3] == "raise":  # a failed run: its error escapes main
        raise RuntimeError("a failed step")
    if sys.argv[3] != "0":
        raise SystemExit(int(sys.argv[3]))

if sys.argv[2] == "run_main":
    run_main(main)
else:
    main()
"""


def _run(tmp_path, how: str, status) -> subprocess.CompletedProcess:
    out = tmp_path / f"{how}_{status}"
    out.mkdir()
    mode = how.rstrip("0123456789")  # "plain1": the second try of the plain control
    return subprocess.run([sys.executable, "-c", RANK, str(out), mode, str(status)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


# how the finalising interpreter ends the late thread: an abort (pthread_exit through noexcept frames, or CPython's
# fatal error) or, when it meets the thread's state half torn down, a segfault
CRASHES = (-signal.SIGABRT, 128 + signal.SIGABRT, -signal.SIGSEGV, 128 + signal.SIGSEGV)
CONTROL_TRIES = 3


def test_plain_exit_aborts_where_run_main_exits_with_the_rank_status(tmp_path):
    # the control: without run_main this torch + CPython crashes at exit (if a future version stops doing so, this
    # says it). It is a race against finalisation: on a loaded machine the interpreter can, rarely, be gone before the
    # late thread wakes, and the process exits 0. A quiet machine crashes every time; three clean exits in a row
    # mean the hazard is gone.
    tries = []
    for i in range(CONTROL_TRIES):
        plain = _run(tmp_path, f"plain{i}", 0)
        tries.append((plain.returncode, plain.stderr[-2000:]))
        if plain.returncode in CRASHES:
            break
    assert plain.returncode in CRASHES, tries
    if plain.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT):
        assert ("terminate called without an active exception" in plain.stderr
                or "Fatal Python error" in plain.stderr), plain.stderr[-2000:]

    for status in (0, 75):  # 75: the trainer's planned stop (SystemExit) keeps its status
        res = _run(tmp_path, "run_main", status)
        assert res.returncode == status, (res.returncode, res.stderr[-2000:])
        assert "terminate called" not in res.stderr and "Fatal Python error" not in res.stderr
        assert res.stdout.endswith("main done")  # flushed at exit (torch 2.9's gloo prints a line of its own first)
        out = tmp_path / f"run_main_{status}"
        assert (out / "atexit").read_text() == "ran"
        assert (out / "thread").read_text() == "done"


def test_a_failed_run_prints_its_traceback_and_exits_1_not_through_finalisation(tmp_path):
    """An error escaping main: Python's own path finalises with gloo's thread alive (an abort after the traceback,
    or, the race going the other way, a process that never exits: a launcher then waits for it for good); run_main
    prints the traceback as Python does and ends with status 1, after joining threads and running atexit."""
    tries = []
    for i in range(CONTROL_TRIES):  # the control, as above: the hazard on the error path
        plain = _run(tmp_path, f"plain{i}", "raise")
        tries.append((plain.returncode, plain.stderr[-2000:]))
        if plain.returncode in CRASHES:
            break
    assert plain.returncode in CRASHES, tries
    res = _run(tmp_path, "run_main", "raise")
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    assert "RuntimeError: a failed step" in res.stderr and "Traceback" in res.stderr, res.stderr[-2000:]
    assert "terminate called" not in res.stderr and "Fatal Python error" not in res.stderr
    assert res.stdout.endswith("main done")
    out = tmp_path / "run_main_raise"
    assert (out / "atexit").read_text() == "ran" and (out / "thread").read_text() == "done"


@pytest.mark.parametrize("module", ["bert_ref/train.py", "bridgetower_ds/train.py", "tests/tiny_train.py",
                                    "tests/zero_trust_step.py", "bench/bert_step.py",
                                    "bench/zero_memory.py", "bench/startup.py"])
def test_every_rank_entry_ends_through_run_main(module):
    src = (REPO / module).read_text()
    main_block = src[src.index('if __name__ == "__main__":'):]
    assert "run_main(main)" in main_block, f"{module}: its __main__ must call ds_core.rank.process_end.run_main(main)"


RELEASE = """
import os, sys
import torch, torch.distributed as dist
from ds_core.compat.torch_releases import release_process_groups

rank, store, cycles = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sys.setswitchinterval(10)  # this thread keeps the GIL from the collective's end to the group's release
for i in range(cycles):
    dist.init_process_group("gloo", init_method=f"file://{store}{i}", rank=rank, world_size=2)
    out = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(out, torch.ones(1))  # gloo's thread frees this work's tensors after the wait returns
    del out
    release_process_groups()
print("released", cycles, flush=True)
os._exit(0)
"""


@pytest.mark.stack  # torch 2.6 (Gaudi 1.21) is the one that deadlocked
@pytest.mark.each_gaudi
def test_releasing_a_gloo_group_right_after_a_collective_never_deadlocks(tmp_path):
    """ds_core.compat.torch_releases.release_process_groups, as every rank's end (shutdown_distributed) calls it: a
    group released while gloo's thread still frees the last collective's tensors. torch.distributed's own
    destroy_process_group() here (torch 2.6) left a rank in ~ProcessGroupGloo joining a thread that waited for the
    GIL, for good: 6 of 6 two-rank runs of 20 cycles hung; 40 cycles miss it with a chance of about 1 in 1000."""
    cycles = 40
    procs = [subprocess.Popen([sys.executable, "-c", RELEASE, str(r), str(tmp_path / "store"), str(cycles)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank still ran after 120 s: deadlocked releasing a group\n{p.communicate()[0][-3000:]}")
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(f"released {cycles}" in o for o in outs), outs
