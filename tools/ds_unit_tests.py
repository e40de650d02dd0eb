"""DeepSpeed's own unit tests with the toolkit's changes inside DeepSpeed on, then off: every outcome must be equal.

    python tools/ds_unit_tests.py                        (make test-ds-unit; DS_TESTS=path names the tests archive)

The toolkit replaces a few DeepSpeed internals (ds_core/compat/changes.py). Our own tests check each change against
DeepSpeed's result; this holds them to DeepSpeed's own tests too. DeepSpeed's `tests/` folder of each release in the
support matrix (stacks/) is kept as an archive beside the checkout (shared/third_party/, whose README names the
commits): the one for the installed DeepSpeed is extracted, and a subset that exercises every change (ZeRO-1/2/3,
the bf16 optimizer with gradient clipping, universal checkpoints, coalesced collectives, the launcher's exports, op
loads) runs twice on the CPU accelerator: with the changes applied as a run applies them (tools/ds_unit_plugin.py
calls ds_core.compat.changes at each stage) and with DS_TOOLKIT_CHANGES=off (DeepSpeed's own path; a release's
Suite may keep a fork-on-CPU-only fix on, named with the reason, where its tests hang without it). Each
test's outcome (passed / failed / skipped / error) must be the same in both runs, and every change the installed
DeepSpeed gets must have been applied in the first run: a comparison in which a change never ran would prove nothing.

DeepSpeed's tests run as DeepSpeed's CPU CI runs them (`pytest --forked`), which needs pytest < 8.4 (DeepSpeed's own
pin; the toolkit's venv has a newer one): PYTEST_PINS are installed with pip into a folder of the venv and put first
on PYTHONPATH for these runs only. LOCAL_SIZE=2 makes the CPU accelerator count two devices (else it counts NUMA
nodes, and every 2-rank test skips). Standard library only, apart from the venv's Python it drives.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).resolve().with_name("ds_unit_plugin.py")
# pytest-forked needs pytest < 8.4 (DeepSpeed's requirements-dev.txt pins pytest<8.4.0; with 8.4+ every forked test
# exits with status 3) and the `py` package's py.process, which pytest's own `py` shim lacks
PYTEST_PINS = ("pytest==8.3.5", "pytest-forked==1.6.0", "py==1.11.0")
SWITCH = "DS_TOOLKIT_CHANGES"  # ds_core.compat.changes' switch: "off" is DeepSpeed's own path
OUTCOMES = ("passed", "failed", "error", "skipped")
HANG_S = 180


@dataclass(frozen=True)
class Suite:
    """DeepSpeed's tests of one release: its archive (a name pattern in the tests folder), the DeepSpeed release
    (major, minor) it tests, the tests that exercise the changes, as pytest node ids under its tests/ folder, and
    the changes kept on in the run with the others off ({name: why}): fork-on-CPU-only fixes (fork_cpu_only in
    ds_core/compat/changes.py) of a fault of that release's own path on the CPU accelerator, where the comparison
    runs, without which its tests hang or crash at random."""
    archive: str
    release: tuple[int, int]
    tests: tuple[str, ...]
    kept_on: tuple[tuple[str, str], ...] = ()


# What each test exercises, by change (ds_core/compat/changes.py). Every engine a test builds goes through
# process_start (op_build_lock_holder, cached_cpu_info: the FusedAdam and shm op loads), before_initialize
# (lazy_muon_import, ZeRO's dtype buckets and ZeRO-3's gather where the release needs them) and after_initialize
# (comm_phase_timing, engine_grad_norm, zero_partition_layout and the optimizer wrapper's own changes).
_UC = "unit/checkpoint/test_universal_checkpoint.py::TestZeROUniversalCheckpointDP::test_dp_world_size_2to2"
SUITES = (
    # upstream moved the engine tests under unit/v1/; gradient_clipping defaults to 1.0 there
    Suite("deepspeed-tests-*.tar.gz", (0, 19), (
        # BF16_Optimizer (ZeRO-1, bf16, fp32 accumulation): exact fp32 gradient sums (one_op_grad_hook), then
        # steps clipped at the default 1.0 (flat_grad_norm_bf16, device_clip)
        "unit/v1/zero/test_zero.py::TestBF16OptimizerGradReduction",
        "unit/runtime/test_multiple_models.py::TestMultipleModels::test_bf16_optimizer[False-1]",
        # ZeRO-2 bf16 with gradient_clipping 1.0 (flat_grad_norm_zero); ZeRO-3 clipping and its norm
        "unit/v1/half_precision/test_bf16.py::TestZero2ReduceScatterOff",
        "unit/runtime/zero/test_zero_grad_clip.py::TestZeroGradClip::test_grad_clip_and_norm_update[bf16-0.05-none]",
        # universal checkpoint, ZeRO-1 and ZeRO-3, bf16, optimizer states loaded (universal_load_links where needed)
        f"{_UC}[-1-True-False-1-dtype0]",
        f"{_UC}[-1-True-False-3-dtype0]",
        # coalesced collectives; an engine's deepspeed.comm (comm_phase_timing wraps its backend's methods)
        "unit/runtime/comm/test_coalesced_collectives.py::TestReduceScatterCoalesced::test_two_inputs",
        "unit/comm/test_dist.py::TestDistInitWithModel::test_no_init[False]",
        # the launcher's runners that export variables (mpi_exports_as_given); test_slurm_runner is left out: the
        # archive's version of it predates 0.19.8's check of the hostfile's slots and fails on either path
        *(f"unit/launcher/test_multinode_runner.py::test_{r}_runner" for r in ("pdsh", "openmpi", "mpich", "mvapich")),
    )),
    # Habana's fork (0.16.1): the engine tests under unit/runtime/; the CPU accelerator has no fp16 there, so tests
    # that pick fp16 where the device has it run bf16; bf16 without ZeRO gets BF16_Optimizer
    Suite("habana-deepspeed-*-tests.tar.gz", (0, 16), (
        # BF16_Optimizer, two micro batches per step (one_op_grad_hook, flat_grad_norm_bf16, device_clip installed)
        "unit/runtime/test_multi_output_model.py::TestTwoOutputModel",
        # ZeRO-2 bf16 (cpu_gradient_buckets, flat_grad_norm_zero, nonfinite_group_norm); the fork's own CI leaves
        # TestZero2ReduceScatterOff to A100 machines (its a100 marker), so its pytest.ini deselects it
        "unit/runtime/half_precision/test_bf16.py::TestZeroDtypeCocktail::test[default-bf16]",
        # universal checkpoint, bf16, optimizer states loaded: ZeRO-1 (universal_load_links) and ZeRO-3, whose
        # coalesced all-gathers run (zero3_gather_waits)
        f"{_UC}[False-True-False-1-dtype0]",
        f"{_UC}[False-True-False-3-dtype0]",
        "unit/runtime/comm/test_coalesced_collectives.py::TestReduceScatterCoalesced::test_two_inputs",
        "unit/comm/test_dist.py::TestDistInitWithModel::test_no_init[False]",
        *(f"unit/launcher/test_multinode_runner.py::test_{r}_runner" for r in ("pdsh", "openmpi", "mpich", "mvapich")),
    ), kept_on=(
        ("zero3_gather_waits", "the fork's ZeRO-3 coalesced all-gather waits for the last parameter's handle only; "
                               "over gloo on the CPU accelerator a ZeRO-3 test then hangs or crashes at random (on a "
                               "device the change is not applied: its collectives run in stream order)"),
    )),
)


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "0.16.1+unknown" -> (0, 16)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise SystemExit(f"error: cannot read a DeepSpeed version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def suite_for(version: str) -> Suite:
    """The suite of the installed DeepSpeed's release; an error naming the releases there are suites for."""
    rel = release_of(version)
    for suite in SUITES:
        if suite.release == rel:
            return suite
    known = ", ".join(f"{s.release[0]}.{s.release[1]}" for s in SUITES)
    raise SystemExit(f"error: no DeepSpeed unit-test subset for DeepSpeed {version} (there are for {known}): add a "
                     f"Suite to {Path(__file__).name} with that release's tests archive")


def tests_folders(repo: Path, origin: str | None) -> list[Path]:
    """Where CI keeps the archives: shared/third_party beside the checkout, or beside the repository it was cloned
    from (as tools/ci.py finds Habana's fork)."""
    found = [repo.parent / "shared" / "third_party"]
    if origin:
        local = Path(origin[len("file://"):] if origin.startswith("file://") else origin)
        if local.is_absolute():
            found.append(local.parent / "shared" / "third_party")
    return found


def find_archive(suite: Suite, given: str | None, folders: list[Path]) -> Path:
    """The tests archive: `given` (an archive, or a folder holding it) or the newest matching one in `folders`."""
    if given:
        path = Path(given)
        if path.is_file():
            return path
        if not path.is_dir():
            raise SystemExit(f"error: DS_TESTS={given}: no such file or folder (expected DeepSpeed's tests archive "
                             f"{suite.archive} or the folder holding it)")
        folders = [path]
    for folder in folders:
        hits = sorted(folder.glob(suite.archive))
        if hits:
            return hits[-1]
    where = ", ".join(str(f) for f in folders)
    raise SystemExit(f"error: DeepSpeed's tests archive {suite.archive} not found in {where}: set DS_TESTS to the "
                     f"archive or its folder")


def extract(archive: Path, dest: Path) -> Path:
    """The archive's tests/ folder, extracted under `dest` (kept while the archive is unchanged); members that would
    land outside `dest` are refused."""
    stamp = dest / ".extracted"
    key = f"{archive.resolve()} {archive.stat().st_size} {archive.stat().st_mtime_ns}"
    if not (stamp.is_file() and stamp.read_text() == key):
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                target = (dest / member.name).resolve()
                if not str(target).startswith(str(dest.resolve()) + os.sep) or member.issym() or member.islnk():
                    raise SystemExit(f"error: {archive}: member {member.name!r} is a link or leaves the folder")
            # every member checked above; tarfile's "data" filter too where this Python has it
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        stamp.write_text(key)
    found = sorted(p for p in dest.glob("*/tests") if (p / "unit" / "common.py").is_file())
    if not found:
        raise SystemExit(f"error: {archive}: no <folder>/tests/unit/common.py inside (expected DeepSpeed's tests/)")
    return found[0]


def ensure_pytest(python: str, target: Path) -> None:
    """PYTEST_PINS installed into `target` (pip --target: the venv's own pytest stays as it is); kept once there."""
    stamp = target / ".pins"
    if stamp.is_file() and stamp.read_text() == " ".join(PYTEST_PINS):
        return
    if target.exists():
        shutil.rmtree(target)
    cmd = [python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *PYTEST_PINS]
    print(f"[ds-unit] installing {' '.join(PYTEST_PINS)} into {target}", flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"error: pip could not install {' '.join(PYTEST_PINS)} into {target}")
    stamp.write_text(" ".join(PYTEST_PINS))


def run_env(base: dict[str, str], pytest_dir: Path, plugin_dir: Path) -> dict[str, str]:
    """The environment of the runs: the pinned pytest and the plugin first on PYTHONPATH, two CPU devices, no plugin
    of the venv's pytest loaded behind our back."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pytest_dir), str(plugin_dir), base.get("PYTHONPATH")) if p)
    env["LOCAL_SIZE"] = "2"
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env.setdefault("DS_ACCELERATOR", "cpu")
    # a distributed test that hangs ends the session after this many seconds (the slowest here takes ~35 s on 2
    # busy cores), not DeepSpeed's default 600; upstream and the fork read different variables
    for name in ("DS_UNITTEST_TIMEOUT", "DEEPSPEED_TEST_TIMEOUT"):
        env.setdefault(name, str(HANG_S))
    return env


def run_suite(python: str, tests_dir: Path, node_ids: tuple[str, ...], env: dict[str, str], junit: Path,
              timeout_s: float) -> int:
    """pytest --forked over the node ids, in its own process group, ended after timeout_s; its exit status."""
    cmd = [python, "-m", "pytest", "--forked", "-p", "pytest_forked", "-p", "ds_unit_plugin", "-rfE",
           "--junitxml", str(junit), *node_ids]
    proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"error: DeepSpeed's tests ran past {timeout_s:.0f} s ({env[SWITCH] or 'on'}): stopped")


def parse_junit(text: str) -> dict[str, str]:
    """{test id: outcome} from pytest's JUnit XML; a test reported twice (a failure and an error at teardown) keeps
    the worse outcome (error > failed > skipped > passed)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    out: dict[str, str] = {}
    for case in ET.fromstring(text).iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        outcome = ("error" if "error" in tags else "failed" if "failure" in tags else
                   "skipped" if "skipped" in tags else "passed")
        if test not in out or rank[outcome] > rank[out[test]]:
            out[test] = outcome
    return out


def differences(on: dict[str, str], off: dict[str, str]) -> list[str]:
    """Every test whose outcome differs between the two runs (one missing from a run included), one line each."""
    lines = []
    for test in sorted(on.keys() | off.keys()):
        a, b = on.get(test, "absent"), off.get(test, "absent")
        if a != b:
            lines.append(f"{test}: {a} with the changes on, {b} with them off")
    return lines


def counts(outcomes: dict[str, str]) -> str:
    """"N tests: a passed, b failed, c error, d skipped" (outcomes with no test left out)."""
    n = {o: sum(1 for v in outcomes.values() if v == o) for o in OUTCOMES}
    parts = ", ".join(f"{n[o]} {o}" for o in OUTCOMES if n[o])
    return f"{len(outcomes)} tests: {parts or 'none ran'}"


def applied_changes(records: list[dict]) -> set[str]:
    """The changes some process of a run applied: records are the JSON lines tools/ds_unit_plugin.py writes, each
    {"stage": ..., "states": {name: state}} as ds_core.compat.changes.apply_stage returned them."""
    return {name for r in records for name, state in r.get("states", {}).items() if state == "on"}


def read_records(folder: Path) -> list[dict]:
    """Every JSON line the plugin wrote under `folder` (one file per process)."""
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: {path}:{n}: not a JSON record ({e})") from None
    return out


def deselected(records: list[dict]) -> list[str]:
    """The selected tests the suite's own configuration deselected (its pytest.ini markers), as the plugin recorded
    them: a selection that never runs would compare nothing."""
    return sorted({test for r in records for test in r.get("deselected", [])})


def unexercised(expected_on: set[str], records: list[dict]) -> set[str]:
    """The changes the installed DeepSpeed gets (expected_on) that no process of the run applied."""
    return expected_on - applied_changes(records)


def off_switch(names: list[str], kept_on: tuple[tuple[str, str], ...]) -> str:
    """The DS_TOOLKIT_CHANGES value of the run with the changes off: "off", or every change but the kept ones."""
    kept = {name for name, _ in kept_on}
    return f"off:{','.join(n for n in names if n not in kept)}" if kept else "off"


def predicted(env: dict[str, str]) -> dict[str, str]:
    """{change: state} as ds_core.compat.changes says the installed DeepSpeed gets it with the switch on."""
    code = "import json; from ds_core.compat import changes; print(json.dumps(changes.states()))"
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, **{SWITCH: "on"}), capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"error: ds_core.compat.changes.states() failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_run(label: str, switch: str, tests_dir: Path, suite: Suite, env: dict[str, str], work: Path,
            timeout_s: float) -> tuple[dict[str, str], list[dict]]:
    """({test: outcome}, stage records) of the suite with DS_TOOLKIT_CHANGES=switch; label: "on" or "off"."""
    record = work / f"record-{label}"
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir(parents=True)
    junit = work / f"junit-{label}.xml"
    junit.unlink(missing_ok=True)
    print(f"[ds-unit] {len(suite.tests)} test selections, {SWITCH}={switch}", flush=True)
    t0 = time.monotonic()
    rc = run_suite(sys.executable, tests_dir, suite.tests, dict(env, **{SWITCH: switch, "DS_UNIT_RECORD":
                                                                         str(record)}), junit, timeout_s)
    if rc not in (0, 1) or not junit.is_file():  # 1: some test failed (compared, not an error of the run)
        raise SystemExit(f"error: pytest over DeepSpeed's tests exited with status {rc} (changes {label}); see above")
    outcomes = parse_junit(junit.read_text())
    print(f"[ds-unit] changes {label}: {counts(outcomes)} ({time.monotonic() - t0:.0f} s)", flush=True)
    return outcomes, read_records(record)


def verdict(version: str, archive: Path, on: dict[str, str], off: dict[str, str], expected: set[str],
            on_records: list[dict], off_records: list[dict], kept: frozenset[str] = frozenset()) -> list[str]:
    """The problems of a comparison, one line each (none: it holds); kept: the changes left on in the off run."""
    problems = differences(on, off)
    if not on:
        problems.append("no test ran")
    if never := sorted(unexercised(expected, on_records)):
        problems.append(f"on for DeepSpeed {version} but applied by no test of the subset: {', '.join(never)} "
                        f"(add a test of {archive.name} that reaches it)")
    if dropped := deselected(on_records + off_records):
        problems.append(f"deselected by {archive.name}'s own pytest configuration: {', '.join(dropped)}")
    if leaked := sorted(applied_changes(off_records) - kept):
        problems.append(f"applied with {SWITCH}=off: {', '.join(leaked)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tests", default=os.environ.get("DS_TESTS"),
                   help="DeepSpeed's tests archive, or the folder holding it (default: $DS_TESTS, else "
                        "shared/third_party beside the checkout or beside the repository it was cloned from)")
    p.add_argument("--work", default=None, help="where the tests are extracted and run (default: <venv>/ds-unit-tests)")
    p.add_argument("--timeout", type=float, default=900, help="seconds each of the two runs may take (default 900)")
    args = p.parse_args(argv)

    import importlib.metadata as md

    version = md.version("deepspeed")
    suite = suite_for(version)
    origin = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"], capture_output=True,
                            text=True).stdout.strip()
    archive = find_archive(suite, args.tests, tests_folders(REPO, origin or None))
    work = Path(args.work or Path(sys.prefix) / "ds-unit-tests").resolve()
    tests_dir = extract(archive, work / "tests")
    ensure_pytest(sys.executable, work / "pytest")
    plugin_dir = work / "plugin"
    plugin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PLUGIN, plugin_dir / PLUGIN.name)
    env = run_env(dict(os.environ), work / "pytest", plugin_dir)
    # the venv's op cache, where set-up built DeepSpeed's CPU ops (as the Makefile and ds_core.rank.venv set it)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    print(f"[ds-unit] DeepSpeed {version}: {archive.name}, {len(suite.tests)} test selections, changes on then off",
          flush=True)
    states = predicted(env)
    expected = {name for name, state in states.items() if state == "on"}
    for name, why in suite.kept_on:
        print(f"[ds-unit] {name} stays on in the run with the changes off: {why}", flush=True)
    on, on_records = one_run("on", "on", tests_dir, suite, env, work, args.timeout)
    off, off_records = one_run("off", off_switch(list(states), suite.kept_on), tests_dir, suite, env, work,
                               args.timeout)
    problems = verdict(version, archive, on, off, expected, on_records, off_records,
                       frozenset(name for name, _ in suite.kept_on))
    print(f"[ds-unit] DeepSpeed {version} ({archive.name}): changes on: {counts(on)}; off: {counts(off)}")
    print(f"[ds-unit] applied in the run with the changes on: {', '.join(sorted(applied_changes(on_records)))}")
    for line in problems:
        print(f"[ds-unit] FAIL {line}")
    if not problems:
        print(f"[ds-unit] every outcome equal with the changes on and off ({len(on)} tests)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
