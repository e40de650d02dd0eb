"""tools/ds_unit_tests.py's comparison of DeepSpeed's own unit tests with the toolkit's changes on and off: the pure
parts (reading pytest's JUnit XML, the test-by-test comparison, what counts as a change applied, the suite and
archive picked for a DeepSpeed version), and that every selected test is in its release's tests archive. Running
DeepSpeed's suite is the tool's job (make test-ds-unit), not this file's."""
from __future__ import annotations

import importlib.util
import sys
import tarfile

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("ds_unit_tests_tool", REPO / "tools" / "ds_unit_tests.py")
tool = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tool  # dataclasses look their module up while the class is made
_spec.loader.exec_module(tool)

pytestmark = pytest.mark.stack

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.comm.test_dist.TestDistAllReduce" name="test[3]" time="4.2"/>
<testcase classname="unit.v1.zero.test_zero.TestZero3" name="test" time="1"><skipped message="cpu"/></testcase>
<testcase classname="unit.launcher.test_multinode_runner" name="test_slurm_runner"><failure message="x"/></testcase>
<testcase classname="unit.ckpt.TestUC" name="test_2to2[bf16]"><failure message="assert"/></testcase>
<testcase classname="unit.ckpt.TestUC" name="test_2to2[bf16]"><error message="teardown"/></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_test_by_test():
    got = tool.parse_junit(JUNIT)
    assert got == {
        "unit.comm.test_dist.TestDistAllReduce::test[3]": "passed",
        "unit.v1.zero.test_zero.TestZero3::test": "skipped",
        "unit.launcher.test_multinode_runner::test_slurm_runner": "failed",
        "unit.ckpt.TestUC::test_2to2[bf16]": "error",  # a failure, then an error at teardown: the worse one
    }
    assert tool.counts(got) == "4 tests: 1 passed, 1 failed, 1 error, 1 skipped"
    assert tool.counts({}) == "0 tests: none ran"


def test_every_difference_is_named_including_a_test_missing_from_one_run():
    on = {"a": "passed", "b": "skipped", "c": "failed", "d": "passed"}
    off = {"a": "passed", "b": "passed", "c": "failed", "e": "passed"}
    assert tool.differences(on, off) == [
        "b: skipped with the changes on, passed with them off",
        "d: passed with the changes on, absent with them off",
        "e: absent with the changes on, passed with them off",
    ]
    assert tool.differences(on, dict(on)) == []


def test_a_change_counts_as_applied_only_where_a_stage_left_it_on():
    records = [
        {"stage": "process_start", "states": {"op_build_lock_holder": "on", "cached_cpu_info": "on"}},
        {"stage": "after_initialize", "states": {"flat_grad_norm_bf16": "not needed: ZeRO's wrapper",
                                                 "flat_grad_norm_zero": "on"}},
        {"stage": "after_initialize", "states": {"flat_grad_norm_zero": "off: switched off"}},
        {"deselected": ["unit/x.py::T::test"]},
    ]
    assert tool.applied_changes(records) == {"op_build_lock_holder", "cached_cpu_info", "flat_grad_norm_zero"}
    expected = {"op_build_lock_holder", "flat_grad_norm_bf16", "flat_grad_norm_zero"}
    assert tool.unexercised(expected, records) == {"flat_grad_norm_bf16"}
    assert tool.deselected(records) == ["unit/x.py::T::test"]


def test_verdict_fails_on_a_difference_a_change_never_applied_a_leak_and_a_deselection(tmp_path):
    archive = tmp_path / "deepspeed-tests-x.tar.gz"
    on_records = [{"stage": "after_initialize", "states": {"device_clip": "on"}}]
    same = {"t": "passed"}
    assert tool.verdict("0.19.8", archive, same, dict(same), {"device_clip"}, on_records, []) == []
    problems = tool.verdict("0.19.8", archive, {"t": "passed"}, {"t": "failed"}, {"device_clip", "one_op_grad_hook"},
                            on_records + [{"deselected": ["u::T"]}], on_records)
    assert problems == [
        "t: passed with the changes on, failed with them off",
        "on for DeepSpeed 0.19.8 but applied by no test of the subset: one_op_grad_hook (add a test of "
        "deepspeed-tests-x.tar.gz that reaches it)",
        "deselected by deepspeed-tests-x.tar.gz's own pytest configuration: u::T",
        "applied with DS_TOOLKIT_CHANGES=off: device_clip",
    ]
    assert tool.verdict("0.19.8", archive, {}, {}, set(), [], []) == ["no test ran"]
    # a change a suite keeps on in the off run is no leak there
    assert tool.verdict("0.16.1", archive, same, dict(same), {"device_clip"}, on_records, on_records,
                        frozenset({"device_clip"})) == []


def test_the_off_run_switches_off_every_change_but_the_kept_ones():
    from ds_core.compat.changes import BY_NAME, parse_switch

    names = list(BY_NAME)
    assert tool.off_switch(names, ()) == "off"
    assert set(parse_switch(tool.off_switch(names, (("device_clip", "why"),)))) == set(names) - {"device_clip"}
    for suite in tool.SUITES:  # a kept change is one of the list, with its reason: a fork-on-CPU-only fix, which
        # no Gaudi user meets and without which the CPU comparison itself hangs
        assert all(name in BY_NAME and BY_NAME[name].fork_cpu_only and why for name, why in suite.kept_on)


def test_suite_and_archive_by_installed_release(tmp_path):
    assert tool.suite_for("0.16.1+unknown").archive.startswith("habana-deepspeed-")
    assert tool.suite_for("0.19.8").release == (0, 19)
    with pytest.raises(SystemExit, match=r"no DeepSpeed unit-test subset for DeepSpeed 0\.12\.0 \(there are for "):
        tool.suite_for("0.12.0")
    with pytest.raises(SystemExit, match="cannot read a DeepSpeed version"):
        tool.release_of("unknown")
    suite = tool.suite_for("0.19.8")
    for name in ("deepspeed-tests-aaa.tar.gz", "deepspeed-tests-bbb.tar.gz", "habana-deepspeed-1.21.0-tests.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    assert tool.find_archive(suite, None, [tmp_path / "absent", tmp_path]).name == "deepspeed-tests-bbb.tar.gz"
    assert tool.find_archive(suite, str(tmp_path), []).name == "deepspeed-tests-bbb.tar.gz"
    given = tmp_path / "deepspeed-tests-aaa.tar.gz"
    assert tool.find_archive(suite, str(given), []) == given
    with pytest.raises(SystemExit, match=r"DS_TESTS=.*nope: no such file or folder"):
        tool.find_archive(suite, str(tmp_path / "nope"), [])
    with pytest.raises(SystemExit, match=r"deepspeed-tests-\*\.tar\.gz not found in .*absent: set DS_TESTS"):
        tool.find_archive(suite, None, [tmp_path / "absent"])
    # beside the checkout, and beside the repository a CI clone came from
    assert tool.tests_folders(tmp_path / "repo", "/src/main/.git") == [
        tmp_path / "shared" / "third_party", tool.Path("/src/main/shared/third_party")]
    assert tool.tests_folders(tmp_path / "repo", "https://example.invalid/x.git") == [
        tmp_path / "shared" / "third_party"]


def test_an_archive_member_outside_its_folder_is_refused(tmp_path):
    archive = tmp_path / "bad.tar.gz"
    evil = tmp_path / "evil.py"
    evil.write_text("x = 1\n")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(evil, arcname="../evil.py")
    with pytest.raises(SystemExit, match="member '../evil.py' is a link or leaves the folder"):
        tool.extract(archive, tmp_path / "out")


@pytest.mark.parametrize("suite", tool.SUITES, ids=lambda s: s.archive)
def test_every_selected_test_file_is_in_its_archive(suite):
    """A selection whose file the archive lacks would end the run with pytest's "not found"; checked here, fast,
    against the archive's member list where the archive is beside the checkout (as in CI)."""
    found = [p for folder in tool.tests_folders(REPO, None) for p in sorted(folder.glob(suite.archive))]
    if not found:
        pytest.skip(f"{suite.archive} is not in {REPO.parent / 'shared' / 'third_party'} (DeepSpeed's tests archives)")
    with tarfile.open(found[-1]) as tar:
        files = {m.name.split("/tests/", 1)[-1] for m in tar.getmembers() if "/tests/" in m.name}
    assert suite.tests
    missing = [t for t in suite.tests if t.split("::")[0] not in files]
    assert not missing, f"{found[-1].name} has no {missing}"
