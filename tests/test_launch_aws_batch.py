"""AWS Batch registration on loopback: only the job's nodes can join. Before the real children register, other
connections reach the main node's port: one that stays idle, one that sends `[1]`, bytes that are not JSON, a
registration without the job's token (as any host on the network could send), and one with the token that
declares another address than the one it connects from. Each is refused in one line while the main node goes on
listening (none ends it, none holds it up: the main node's whole window is shorter than one idle connection's
limit), and the children, answering the challenge with the token, get the hostfile of the real addresses."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from conftest import free_port

TOKEN = b"job-0123:1"


def _forger(port: int, payload: bytes, got: list) -> None:
    """Connect, send `payload`, record every line the main node sends until it closes the connection."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(payload)
            buf = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
            got.append(buf.decode(errors="replace"))
    except OSError as e:
        got.append(f"error: {e}")


def test_forged_registrations_are_refused_and_the_job_registers(capsys):
    from launch import aws_batch

    port = free_port()
    main_info = {"num_nodes": 3, "index": 0, "main_index": 0, "main_addr": "", "is_main": True}
    out: dict = {}

    def main():
        try:
            out["hosts"] = aws_batch.gather_children(main_info, 1, port, 20.0, TOKEN, bind="127.0.0.1")
        except BaseException as e:  # noqa: BLE001 - the test reports whatever ended the main node
            out["error"] = repr(e)

    t = threading.Thread(target=main)
    t.start()
    idle = None
    for _ in range(100):  # the main node listens
        try:
            idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # stays silent until the end
            break
        except OSError:
            time.sleep(0.05)
    assert idle is not None
    forged = []
    forgers = [threading.Thread(target=_forger, args=(port, p, forged)) for p in (
        b"[1]\n", b"\xff\xfe not json\n", json.dumps({"index": 1, "addr": "127.0.0.1", "slots": 1}).encode() + b"\n")]
    for f in forgers:
        f.start()
    for f in forgers:
        f.join(30)
    info = {"num_nodes": 3, "main_index": 0, "main_addr": "127.0.0.1", "is_main": False}
    with pytest.raises(aws_batch.RegistrationError):  # the token, but another address than its connection's
        _mismatched(aws_batch, port)
    replies = {}

    def child(i: int, addr: str) -> None:
        replies[i] = aws_batch.register_with_main({**info, "index": i}, 1, port, 20.0, TOKEN, node_addr=addr)

    children = [threading.Thread(target=child, args=(i, f"127.0.0.{i + 1}")) for i in (1, 2)]
    for c in children:
        c.start()
    for c in children:
        c.join(30)
    t.join(30)
    idle.close()
    assert "error" not in out, out
    assert [h.name for h in out["hosts"]] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert all("hostfile" not in g for g in forged), forged
    for i in (1, 2):
        text, master = replies[i]
        assert master == "127.0.0.1" and "127.0.0.2 slots=1" in text and "127.0.0.3 slots=1" in text
    err = capsys.readouterr().err
    assert err.count("aws_batch: rejected a registration") >= 4, err
    assert "a JSON list, expected an object" in err and "not a JSON line" in err
    assert "declares address 127.0.0.9 but connected from 127.0.0.1" in err


def _mismatched(aws_batch, port: int):
    """A registration with the job's token whose declared address is not the connection's."""
    deadline = time.monotonic() + 20
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        nonce = aws_batch.recv_line(s, deadline, "challenge")["challenge"]
        aws_batch.send_line(s, {"index": 1, "addr": "127.0.0.9", "slots": 1,
                                "mac": aws_batch.job_mac(TOKEN, "register", nonce, 1, "127.0.0.9")})
        aws_batch.recv_line(s, deadline, "the hostfile")  # the main node closes it: RegistrationError


def test_the_job_token_comes_from_the_job():
    from launch.aws_batch import RegistrationError, job_token

    assert job_token({"AWS_BATCH_JOB_ID": "abc#2", "AWS_BATCH_JOB_ATTEMPT": "1"}) == \
        job_token({"AWS_BATCH_JOB_ID": "abc", "AWS_BATCH_JOB_ATTEMPT": "1"}) != \
        job_token({"AWS_BATCH_JOB_ID": "abd", "AWS_BATCH_JOB_ATTEMPT": "1"})
    assert job_token({"LAUNCH_REGISTER_TOKEN": "s", "AWS_BATCH_JOB_ID": "abc"}) == b"s"
    with pytest.raises(RegistrationError, match="no job secret"):
        job_token({})
