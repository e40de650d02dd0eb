"""The test drivers' one fault-injection hook (tests/faults.py): a fault is named, typed and refused when unknown, so
a test cannot inject nothing by a typo; tiny_train.py reads no other variable of its own."""
import re

import pytest

import faults
from conftest import REPO


def test_faults_round_trip_and_refuse_what_is_not_a_fault():
    env = faults.env(nan_at_step=5, slow_rank=1, slow_s=0.5, sample_log=REPO / "x")
    got = faults.read(env)
    assert (got.nan_at_step, got.slow_rank, got.slow_s, got.sample_log) == (5, 1, 0.5, str(REPO / "x"))
    assert got.kill_in_save == 0 and faults.read({}) == faults.Faults()
    with pytest.raises(ValueError, match="unknown fault nan_at"):
        faults.env(nan_at=5)
    with pytest.raises(ValueError, match="nan_at_step must be int"):
        faults.env(nan_at_step="5")
    with pytest.raises(ValueError, match="eval must be bool"):
        faults.read({faults.VAR: '{"eval": 1}'})
    with pytest.raises(ValueError, match="a JSON object"):
        faults.read({faults.VAR: "[1]"})


def test_the_driver_takes_its_faults_only_through_the_hook():
    for name in ("tiny_train.py", *(p.name for p in (REPO / "tests").glob("test_*.py"))):
        text = (REPO / "tests" / name).read_text()
        assert not re.findall(r"TINY_(?!FAULTS)[A-Z_]+", text), name
