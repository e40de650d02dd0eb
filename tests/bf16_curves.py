"""What a bf16 run against the same run in fp32 must show, for tests/test_gpu_train.py (bf16 on CUDA) and its CPU
variant tests/test_bf16_curves.py (bf16 on the CPU), so the checks themselves run without a GPU:

1. it computed in bf16: every nn.Linear forward of the training process saw bf16 weights and bf16 inputs (a global
   module forward hook in the training process, `python -m` run through runpy), and the fp32 run's saw fp32;
2. both runs learned: the mean of the last LAST losses is at least MIN_DROP below the first step's;
3. the curves agree as far as bf16 rounding lets them: |bf16 - fp32| / fp32 <= BF16_UNIT = 2^-8 at every step.
   bf16 keeps 8 significant bits, so rounding one value to bf16 changes it by at most 2^-9 relative; the loss is an
   fp32 mean of log-softmax terms over hundreds of masked tokens, computed from bf16 logits, so the rounding errors
   of its terms largely cancel, and one full bf16 unit (twice a single rounding) is the bound at each step. Step 1
   is computed from the same weights on the same batch; later steps also carry the rounding of each update, which
   LAMB's per-tensor normalisation keeps in proportion (the same bound holds, measured: 5.1e-5 at step 1 and at most
   1.7e-4 over 20 steps, the debug BERT, ZeRO-1, CPU with emulated bf16; the old 5 % band was 300 times that). A run
   that never applied bf16 passes this check by being exact, which is why check 1 exists; a run that diverged (a bf16
   overflow, a lost update) fails it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BF16_UNIT = 2.0 ** -8
LAST = 5
# The debug BERT (vocabulary 1024, MLM + NSP) starts at the loss of uniform predictions, ln(1024) + ln(2) = 7.62.
# LAMB at LR 0.02 takes the mean of the last 5 of 20 steps 0.154 below the first step's loss (7.637 -> 7.483, CPU,
# fp32 and bf16 alike); the same run at LR 1e-12, whose weights do not move, ends 0.011 above it (7.637 -> 7.648; its
# batches' losses spread by +-0.05). 0.1 tells the two apart.
MIN_DROP = 0.1

# Run `python -m MODULE ARGS` with a forward hook on every nn.Linear recording (weight dtype, input dtype) pairs into
# the JSON file named by the first argument, rewritten whenever a new pair appears (a rank may end through os._exit,
# ds_core.rank.process_end, so nothing is left to an exit handler).
HOOKED_MAIN = """
import json, runpy, sys, torch
out, module, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
seen = {}
def record(mod, args, result):
    if isinstance(mod, torch.nn.Linear) and args and torch.is_tensor(args[0]):
        key = f"{str(mod.weight.dtype).replace('torch.', '')}/{str(args[0].dtype).replace('torch.', '')}"
        if key not in seen:
            seen[key] = type(mod).__name__
            open(out, 'w').write(json.dumps(sorted(seen)))
torch.nn.modules.module.register_module_forward_hook(record)
sys.argv = [module, *argv]
runpy.run_module(module, run_name='__main__', alter_sys=True)
"""


def run_recording_dtypes(args: list[str], env: dict, dtypes_json: Path, timeout: float = 900,
                         cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m args[0] args[1:]` with the Linear dtype recorder; the returned process has stdout+stderr."""
    return subprocess.run([sys.executable, "-c", HOOKED_MAIN, str(dtypes_json), *args], cwd=cwd, env=env, check=False,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


def linear_dtypes(dtypes_json: Path) -> set[str]:
    """{"weight/input", ...} that the run's nn.Linear forwards saw."""
    return set(json.loads(dtypes_json.read_text()))


def check_bf16_against_fp32(bf16: dict[int, float], fp32: dict[int, float], what: str) -> list[str]:
    """Checks 2 and 3 above on two loss curves {step: loss}; returns the failures (empty: all good) after printing
    the numbers either way."""
    steps = sorted(fp32)
    problems = [] if sorted(bf16) == steps and steps == list(range(1, len(steps) + 1)) else \
        [f"{what}: steps differ: bf16 {sorted(bf16)}, fp32 {steps}"]
    if problems:
        return problems
    for name, curve in (("bf16", bf16), ("fp32", fp32)):
        drop = curve[1] - sum(curve[s] for s in steps[-LAST:]) / LAST
        print(f"{what}: {name} loss {curve[1]:.4f} -> mean of the last {LAST} {curve[1] - drop:.4f} (drop {drop:.3f})")
        if drop < MIN_DROP:
            problems.append(f"{what}: the {name} run did not learn: drop {drop:.3f} < {MIN_DROP}")
    rel = {s: abs(bf16[s] - fp32[s]) / abs(fp32[s]) for s in steps}
    worst = max(steps, key=rel.get)
    print(f"{what}: relative loss difference bf16 vs fp32: step 1 {rel[1]:.2e}, largest {rel[worst]:.2e} at step "
          f"{worst} (bound 2^-8 = {BF16_UNIT:.2e})")
    problems += [f"{what}: step {s}: |bf16 - fp32| / fp32 = {rel[s]:.2e} > 2^-8 (bf16 {bf16[s]:.6f}, fp32 "
                 f"{fp32[s]:.6f})" for s in steps if rel[s] > BF16_UNIT]
    return problems
