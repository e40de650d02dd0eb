"""AWS Batch multi-node parallel job entry: the same command runs on every node.

    python -m launch.aws_batch --profile efa --preset bert_large -- --input_dir /fsx/bert_h5

The main node (AWS_BATCH_JOB_NODE_INDEX == AWS_BATCH_JOB_MAIN_NODE_INDEX) listens on --register_port; every child
connects to AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS, sends its index and address, and waits. When all children
have registered (bounded by --register_timeout; a clear error names the missing node indices otherwise), the main
node writes the hostfile (node-index order, real addresses), sends it to every child, and each node starts DeepSpeed's
launcher with `--no_ssh --node_rank INDEX --master_addr MAIN` (launch.run's no_ssh mode). Options are those of
launch.run plus the ones below. The job's security group must allow TCP on --register_port and --master_port
between the nodes.

Only the job's nodes can register: the main node sends each connection a random challenge, and a child answers
with an HMAC-SHA256 over it, its index and its address, keyed by the job token (job_token: $LAUNCH_REGISTER_TOKEN, or
the job's own AWS_BATCH_JOB_ID and attempt); the main node's reply carries a MAC too, so a child takes a hostfile only
from the job's main node. A registration must be one JSON object line whose address is the one the connection comes
from; anything else (a wrong MAC, `[1]`, bytes that are not JSON) is refused with one line and the main node goes on
listening. Each connection is read in its own thread with a 30 s limit, so an idle one holds up no other.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import sys
import threading
import time
from typing import Mapping, Sequence

from ds_core.cli import cli_main
from launch import hostfile as hf, log, run
from launch.settings import LaunchSettings, add_run_arguments


class RegistrationError(RuntimeError):
    pass


TOKEN_ENV = "LAUNCH_REGISTER_TOKEN"
IDLE_S = 30.0  # a connection that has not completed its registration by then is closed (its own thread's clock)
MAX_PENDING = 64  # connections being read at once; more are closed at once (a flood cannot hold the main node)


def job_token(env: Mapping[str, str]) -> bytes:
    """The secret every node of this job holds and no other host does: $LAUNCH_REGISTER_TOKEN where the job definition
    sets one (a Secrets Manager secret in its environment), else the job's own identity, AWS_BATCH_JOB_ID (without
    the `#NODE` suffix child nodes see) and AWS_BATCH_JOB_ATTEMPT, which AWS gives every node of the attempt and
    which another host knows only with the right to describe the job."""
    given = env.get(TOKEN_ENV, "")
    if given:
        return given.encode()
    job = env.get("AWS_BATCH_JOB_ID", "").split("#", 1)[0]
    if not job:
        raise RegistrationError(f"AWS Batch registration: neither ${TOKEN_ENV} nor AWS_BATCH_JOB_ID is set, so there "
                                f"is no job secret to authenticate the nodes with")
    return f"{job}:{env.get('AWS_BATCH_JOB_ATTEMPT', '')}".encode()


def job_mac(token: bytes, *parts: object) -> str:
    return hmac.new(token, "\n".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def send_line(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


def recv_line(conn: socket.socket, deadline: float, what: str) -> dict:
    """One JSON object line (at most 64 KiB) before `deadline`; RegistrationError for anything else."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RegistrationError(f"timed out waiting for {what}")
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except socket.timeout:
            raise RegistrationError(f"timed out waiting for {what}") from None
        except OSError as e:
            raise RegistrationError(f"{what}: {e}") from None
        if not chunk:
            raise RegistrationError(f"connection closed while waiting for {what}")
        buf += chunk
        if len(buf) > 1 << 16:
            raise RegistrationError(f"{what}: message too long")
    try:
        msg = json.loads(buf.split(b"\n", 1)[0].decode())
    except ValueError as e:  # not UTF-8, not JSON
        raise RegistrationError(f"{what}: not a JSON line ({e})") from None
    if not isinstance(msg, dict):
        raise RegistrationError(f"{what}: a JSON {type(msg).__name__}, expected an object")
    return msg


def _addresses(name: str) -> set[str]:
    try:
        return {ai[4][0] for ai in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)}
    except OSError:
        return set()


def check_registration(msg: dict, peer: str, nonce: str, token: bytes, n: int, main_index: int) -> tuple[int, str]:
    """(index, address) of a child's registration, or RegistrationError saying what is wrong: the keys and their
    types, the MAC over the challenge (only the job's nodes hold the token), the index range, the address's form and
    that the connection comes from the address it declares."""
    idx, addr, mac = msg.get("index"), msg.get("addr"), msg.get("mac")
    if not (isinstance(idx, int) and not isinstance(idx, bool) and isinstance(addr, str) and isinstance(mac, str)):
        raise RegistrationError(f"expected {{\"index\": int, \"addr\": str, \"mac\": str}}, got keys "
                                f"{sorted(msg)[:6]}")
    if not hmac.compare_digest(mac, job_mac(token, "register", nonce, idx, addr)):
        raise RegistrationError("wrong job token (the MAC over the challenge does not match)")
    if idx == main_index or not 0 <= idx < n:
        raise RegistrationError(f"node index {idx} is not a child index of this {n}-node job")
    hf.check_host_name(addr, f"node {idx} address")
    if peer != addr and peer not in _addresses(addr):
        raise RegistrationError(f"node {idx} declares address {addr} but connected from {peer}")
    return idx, addr


class _Registrar:
    """The main node's side: each accepted connection is read in its own thread (its own IDLE_S clock), so an idle
    or slow peer holds up nothing; valid registrations arrive in `done`, first per index kept."""

    def __init__(self, token: bytes, n: int, main_index: int, deadline: float):
        self.token, self.n, self.main_index, self.deadline = token, n, main_index, deadline
        self.done: queue.Queue = queue.Queue()
        self.pending = threading.BoundedSemaphore(MAX_PENDING)

    def take(self, conn: socket.socket, peer: str) -> None:
        if not self.pending.acquire(blocking=False):
            conn.close()
            log.say(f"aws_batch: rejected a registration from {peer}: too many open connections", stderr=True)
            return
        threading.Thread(target=self._read, args=(conn, peer), name=f"aws-batch-register-{peer}",
                         daemon=True).start()

    def _read(self, conn: socket.socket, peer: str) -> None:
        try:
            nonce = secrets.token_hex(16)
            send_line(conn, {"challenge": nonce})
            msg = recv_line(conn, min(self.deadline, time.monotonic() + IDLE_S), "a child's registration")
            idx, addr = check_registration(msg, peer, nonce, self.token, self.n, self.main_index)
            self.done.put((idx, addr, conn, nonce))
        except (RegistrationError, hf.HostfileError, OSError) as e:
            log.say(f"aws_batch: rejected a registration from {peer}: {e}", stderr=True)
            conn.close()
        finally:
            self.pending.release()


def gather_children(info: dict, slots: int, port: int, timeout: float, token: bytes,
                    bind: str = "0.0.0.0") -> list[hf.Host]:
    """Main node: wait (bounded) until every child registered; reply with the hostfile; return the hosts."""
    n = info["num_nodes"]
    if n == 1:
        return [hf.Host("127.0.0.1", slots, 1)]
    deadline = time.monotonic() + timeout
    reg = _Registrar(token, n, info["main_index"], deadline)
    conns: dict[int, tuple[socket.socket, str]] = {}
    addrs: dict[int, str] = {}
    main_addr = info["main_addr"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((bind, port))
        srv.listen(n)
        srv.settimeout(0.2)
        try:
            while len(conns) < n - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(n)) - {info["main_index"]} - set(conns))
                    raise RegistrationError(
                        f"AWS Batch main node: {len(conns)} of {n - 1} child nodes registered within {timeout:g} s; "
                        f"missing node indices {missing}. Children connect to this node's port {port}: check the "
                        "security group allows it between nodes and that every node runs launch.aws_batch")
                try:
                    conn, peer = srv.accept()
                    reg.take(conn, peer[0])
                except socket.timeout:
                    pass
                while not reg.done.empty():
                    idx, addr, conn, nonce = reg.done.get()
                    if idx in conns:
                        log.say(f"aws_batch: rejected a second registration of node {idx} (from {addr})",
                                stderr=True)
                        conn.close()
                        continue
                    conns[idx], addrs[idx] = (conn, nonce), addr
                    # the address the child reached us on is our private address (AWS does not tell the main node)
                    main_addr = main_addr or conn.getsockname()[0]
                    log.say(f"aws_batch: node {idx} registered from {addr} ({len(conns)}/{n - 1})")
            addrs[info["main_index"]] = main_addr
            hosts = hf.hosts_from_names([addrs[i] for i in range(n)], slots, "aws batch node")
            text = hf.format_hostfile(hosts)
            for conn, nonce in conns.values():
                send_line(conn, {"hostfile": text, "master_addr": main_addr,
                             "mac": job_mac(token, "hostfile", nonce, text, main_addr)})
        finally:
            for conn, _ in conns.values():
                conn.close()
    return hosts


def register_with_main(info: dict, slots: int, port: int, timeout: float, token: bytes,
                       node_addr: str = "") -> tuple[str, str]:
    """Child node: connect (retrying until the main node listens), answer its challenge with the job token's MAC,
    wait for (hostfile text, master), whose MAC proves it comes from the job's main node."""
    deadline = time.monotonic() + timeout
    main = info["main_addr"]
    last = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RegistrationError(f"AWS Batch node {info['index']}: could not register with the main node "
                                    f"{main}:{port} within {timeout:g} s ({last})")
        try:
            sock = socket.create_connection((main, port), timeout=min(5.0, left),
                                            source_address=(node_addr, 0) if node_addr else None)
            break
        except OSError as e:
            last = str(e)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    where = f"the main node {main}:{port}"
    with sock:
        nonce = recv_line(sock, deadline, f"the challenge from {where}").get("challenge")
        if not isinstance(nonce, str):
            raise RegistrationError(f"{where}: no challenge in its first message")
        addr = node_addr or sock.getsockname()[0]
        send_line(sock, {"index": info["index"], "addr": addr, "slots": slots,
                     "mac": job_mac(token, "register", nonce, info["index"], addr)})
        reply = recv_line(sock, deadline, f"the hostfile from {where}")
    text, master, mac = reply.get("hostfile"), reply.get("master_addr"), reply.get("mac")
    if not (isinstance(text, str) and isinstance(master, str) and isinstance(mac, str)
            and hmac.compare_digest(mac, job_mac(token, "hostfile", nonce, text, master))):
        raise RegistrationError(f"{where}: its reply does not carry this job's MAC; not using its hostfile")
    return text, master


def resolve(settings: LaunchSettings, env: Mapping[str, str], register_port: int, register_timeout: float,
            node_addr: str = "") -> LaunchSettings:
    """The settings with hostfile / node_rank / master_addr / launcher (no_ssh) taken from the AWS Batch job (a new
    object), after the main node gathered every child's address; writes this node's hostfile."""
    info = hf.aws_batch_info(env)
    token = job_token(env) if info["num_nodes"] > 1 else b""
    if info["is_main"]:
        hosts = gather_children(info, settings.slots, register_port, register_timeout, token)
        master = hosts[info["main_index"]].name
    else:
        text, master = register_with_main(info, settings.slots, register_port, register_timeout, token, node_addr)
        hosts = hf.parse_hostfile(text, "hostfile from the main node")
    hf.write_hostfile(hosts, settings.hostfile)
    out = settings.replace(node_rank=info["index"], master_addr=settings.master_addr or master, launcher="no_ssh")
    log.say(f"aws_batch: node {info['index']} of {info['num_nodes']}, master {out.master_addr}, "
            f"hostfile {out.hostfile}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.aws_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_run_arguments(p)
    g = p.add_argument_group("AWS Batch")
    g.add_argument("--register_port", type=int, default=int(os.environ.get("LAUNCH_REGISTER_PORT", "29400")),
                   help="TCP port on the main node where children register; $LAUNCH_REGISTER_PORT, default 29400")
    g.add_argument("--register_timeout", type=float, default=float(os.environ.get("LAUNCH_REGISTER_TIMEOUT", "600")),
                   help="seconds the main node waits for all children (and a child for the main node) before "
                        "failing; $LAUNCH_REGISTER_TIMEOUT, default 600")
    g.add_argument("--node_addr", default="",
                   help="address this node registers with (default: the local address of its connection to the "
                        "main node)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    def body(args: argparse.Namespace, rest: list[str]) -> int:
        settings = resolve(LaunchSettings.from_args(args, rest), os.environ, args.register_port,
                           args.register_timeout, args.node_addr)
        return run.launch(settings)

    # OSError: the registration socket (port taken, network unreachable)
    return cli_main(argv, build_parser, body, (RegistrationError, *run.LAUNCH_ERRORS, OSError), passthrough=True)


if __name__ == "__main__":
    sys.exit(main())
