"""AWS Batch multi-node parallel job entry: the same command runs on every node.

    python -m launch.aws_batch --profile efa --preset bert_large -- --input_dir /fsx/bert_h5

The main node (AWS_BATCH_JOB_NODE_INDEX == AWS_BATCH_JOB_MAIN_NODE_INDEX) listens on --register_port; every child
connects to AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS, sends its index and address, and waits. When all children
have registered (bounded by --register_timeout; a clear error names the missing node indices otherwise), the main
node writes the hostfile (node-index order, real addresses), sends it to every child, and each node starts DeepSpeed's
launcher with `--no_ssh --node_rank INDEX --master_addr MAIN` (launch.run's no_ssh mode). Options are those of
launch.run plus the ones below. The job's security group must allow TCP on --register_port and --master_port
between the nodes.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Mapping, Sequence

from ds_core.cli import cli_main
from launch import hostfile as hf, run
from launch.settings import LaunchSettings, add_run_arguments


class RegistrationError(RuntimeError):
    pass


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


def _recv_line(conn: socket.socket, deadline: float, what: str) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RegistrationError(f"timed out waiting for {what}")
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except socket.timeout:
            raise RegistrationError(f"timed out waiting for {what}") from None
        if not chunk:
            raise RegistrationError(f"connection closed while waiting for {what}")
        buf += chunk
        if len(buf) > 1 << 20:
            raise RegistrationError(f"{what}: message too long")
    return json.loads(buf.decode())


def gather_children(info: dict, slots: int, port: int, timeout: float, bind: str = "0.0.0.0") -> list[hf.Host]:
    """Main node: wait (bounded) until every child registered; reply with the hostfile; return the hosts."""
    n = info["num_nodes"]
    if n == 1:
        return [hf.Host("127.0.0.1", slots, 1)]
    deadline = time.monotonic() + timeout
    conns: dict[int, socket.socket] = {}
    addrs: dict[int, str] = {}
    main_addr = info["main_addr"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((bind, port))
        srv.listen(n)
        try:
            while len(conns) < n - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(n)) - {info["main_index"]} - set(conns))
                    raise RegistrationError(
                        f"AWS Batch main node: {len(conns)} of {n - 1} child nodes registered within {timeout:g} s; "
                        f"missing node indices {missing}. Children connect to this node's port {port}: check the "
                        "security group allows it between nodes and that every node runs launch.aws_batch")
                srv.settimeout(left)
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    continue
                try:
                    msg = _recv_line(conn, min(deadline, time.monotonic() + 30), "a child's registration")
                    idx = int(msg["index"])
                    if idx in conns or idx == info["main_index"] or not 0 <= idx < n:
                        raise RegistrationError(f"bad or repeated node index {idx}")
                    hf.check_host_name(str(msg["addr"]), f"node {idx} address")
                except (RegistrationError, ValueError, KeyError, hf.HostfileError) as e:
                    print(f"aws_batch: rejected a registration: {e}", file=sys.stderr)
                    conn.close()
                    continue
                conns[idx], addrs[idx] = conn, str(msg["addr"])
                # the address the child reached us on is our private address (AWS does not tell the main node)
                main_addr = main_addr or conn.getsockname()[0]
                print(f"aws_batch: node {idx} registered from {addrs[idx]} ({len(conns)}/{n - 1})", flush=True)
            addrs[info["main_index"]] = main_addr
            hosts = hf.hosts_from_names([addrs[i] for i in range(n)], slots, "aws batch node")
            text = hf.format_hostfile(hosts)
            for conn in conns.values():
                _send(conn, {"hostfile": text, "master_addr": main_addr})
        finally:
            for conn in conns.values():
                conn.close()
    return hosts


def register_with_main(info: dict, slots: int, port: int, timeout: float, node_addr: str = "") -> tuple[str, str]:
    """Child node: connect (retrying until the main node listens), register, wait for (hostfile text, master)."""
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
    with sock:
        _send(sock, {"index": info["index"], "addr": node_addr or sock.getsockname()[0], "slots": slots})
        reply = _recv_line(sock, deadline, f"the hostfile from the main node {main}:{port}")
    return reply["hostfile"], reply["master_addr"]


def resolve(settings: LaunchSettings, env: Mapping[str, str], register_port: int, register_timeout: float,
            node_addr: str = "") -> LaunchSettings:
    """The settings with hostfile / node_rank / master_addr / launcher (no_ssh) taken from the AWS Batch job (a new
    object), after the main node gathered every child's address; writes this node's hostfile."""
    info = hf.aws_batch_info(env)
    if info["is_main"]:
        hosts = gather_children(info, settings.slots, register_port, register_timeout)
        master = hosts[info["main_index"]].name
    else:
        text, master = register_with_main(info, settings.slots, register_port, register_timeout, node_addr)
        hosts = hf.parse_hostfile(text, "hostfile from the main node")
    hf.write_hostfile(hosts, settings.hostfile)
    out = settings.replace(node_rank=info["index"], master_addr=settings.master_addr or master, launcher="no_ssh")
    print(f"aws_batch: node {info['index']} of {info['num_nodes']}, master {out.master_addr}, "
          f"hostfile {out.hostfile}", flush=True)
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
