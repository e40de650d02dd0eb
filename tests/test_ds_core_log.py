"""ds_core.log: the one logger ds_core speaks through: "[ds_core] " lines, rank 0's only unless a line is about the
rank itself, on the stream current when the line is written."""
from __future__ import annotations

from ds_core import log


def test_rank_zero_speaks_other_ranks_only_when_asked(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    log.say("once per run")
    log.warn("a warning", stderr=True)
    out, err = capsys.readouterr()
    assert out == "[ds_core] once per run\n" and err == "[ds_core] warning: a warning\n"
    monkeypatch.setenv("RANK", "1")
    log.say("once per run")
    log.say("about this rank", every_rank=True)
    out, err = capsys.readouterr()
    assert out == "[ds_core] about this rank\n" and err == ""
