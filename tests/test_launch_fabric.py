"""launch.fabric: the scale-out mode HCCL will pick, by Habana's "Scale-out via Host NIC" priorities, from what a
host reports (kernel, libfabric and its providers, Gaudi NIC ports) and the variables its ranks see; the shipped
profiles leave that choice to HCCL; preflight's fabric rows on emulated DL1, Gaudi2 host-NIC and Gaudi2/3 Gaudi-NIC
hosts (stand-in `hl-smi` and `fi_info` that print what the real tools print)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import dist_env, free_port
from launch import env as envmod, fabric


def card(name="HL-225", state="UP", ports=("8", "22", "23"), bus="0000:19:00.0"):
    return {"bus": bus, "name": name, "external": {p: state for p in ports}}


DL1 = {"kernel": "5.15.0-1051-aws", "libfabric": "1.18.2amzn1.0", "providers": ["efa", "tcp"],
       "cards": [card("HL-205", "DOWN", ("7", "8", "9"))]}
G2_HOSTNIC = {"kernel": "5.15.0-101-generic", "libfabric": "1.20.0", "providers": ["verbs", "tcp"],
              "cards": [card("HL-225", "DOWN")]}
G2_ROCE = {"kernel": "5.15.0-101-generic", "libfabric": None, "providers": None, "cards": [card(), card(bus="b")]}


def test_parsers_read_what_the_tools_print():
    out = "fi_info: 1.18.2amzn1.0\nlibfabric: 1.18.2amzn1.0\nlibfabric api: 1.18\n"
    assert fabric.parse_fi_version(out) == "1.18.2amzn1.0" and fabric.version_tuple("1.18.2amzn1.0") == (1, 18, 2)
    assert fabric.parse_fi_version("fi_info: \nlibfabric: \nlibfabric api: 1.20\n") is None
    assert fabric.version_tuple("5.15.0-1051-aws") == (5, 15, 0) and fabric.version_tuple("") == ()
    ports = "port 0: internal\nport 8: external\nport 22: external\nport 23: external\n"
    link = "port  0:        UP\nport  8:        UP\nport 22:        DOWN\nport 23:        UP\n"
    assert fabric.parse_ports(ports, link) == {"8": "UP", "22": "DOWN", "23": "UP"}
    assert [fabric.generation_of(n) for n in ("HL-205", "HL-225", "HL-325L", "HL-999")] == \
        ["gaudi", "gaudi2", "gaudi3", None]


def test_auto_detection_follows_habanas_priorities():
    efa_env = envmod.resolve_profile("efa", {})
    assert fabric.hccl_scaleout(DL1, efa_env)[0] == fabric.P1  # EFA, libfabric >= 1.16.1, kernel >= 5.12
    mode, why = fabric.hccl_scaleout({**DL1, "kernel": "5.10.0"}, efa_env)
    assert mode == fabric.P2 and "kernel 5.10.0 < 5.12" in why
    mode, why = fabric.hccl_scaleout({**DL1, "libfabric": "1.15.2"}, efa_env)
    assert mode == fabric.P2 and "libfabric 1.15.2 < 1.16.1" in why
    mode, why = fabric.hccl_scaleout(DL1, {})  # Habana's Gaudi Direct setup on EFA asks for both variables
    assert mode == fabric.P2 and "FI_EFA_USE_DEVICE_RDMA=1 and RDMAV_FORK_SAFE=1 not set" in why
    verbs_env = envmod.resolve_profile("hostnic", {})
    assert fabric.hccl_scaleout(G2_HOSTNIC, verbs_env)[0] == fabric.P1  # verbs: libfabric >= 1.20.0, Gaudi 2
    mode, why = fabric.hccl_scaleout({**G2_HOSTNIC, "libfabric": "1.18.0"}, verbs_env)
    assert mode == fabric.P2 and "1.18.0 < 1.20.0" in why
    mode, why = fabric.hccl_scaleout({**G2_HOSTNIC, "cards": [card("HL-205", "DOWN")]}, verbs_env)
    assert mode == fabric.P2 and "Gaudi 2 and Gaudi 3" in why
    assert fabric.hccl_scaleout({**G2_HOSTNIC, "providers": ["tcp"]}, {})[0] == fabric.P2
    assert fabric.hccl_scaleout(G2_ROCE, {})[0] == fabric.P0  # Gaudi NICs first, whatever else is there
    assert fabric.hccl_scaleout({**G2_ROCE, "providers": ["tcp"], "libfabric": "1.20.0"}, {})[0] == fabric.P0
    down = {**G2_ROCE, "cards": [card(), card(state="DOWN")]}
    assert fabric.hccl_scaleout(down, {})[0] == fabric.P3
    assert fabric.hccl_scaleout({"kernel": "6.8", "cards": None, "providers": None}, {})[0] == fabric.P3


def test_hccl_over_ofi_turns_the_choice_off():
    """Setting HCCL_OVER_OFI at all: 1 forces host memory (P2) even where Gaudi Direct or Gaudi NICs would be taken;
    0 never uses host NICs. Next to FI_EFA_USE_DEVICE_RDMA=1 it asks for Gaudi Direct and forbids it."""
    efa_env = envmod.resolve_profile("efa", {})
    assert fabric.hccl_scaleout(DL1, {**efa_env, "HCCL_OVER_OFI": "1"})[0] == fabric.P2
    assert fabric.hccl_scaleout({**G2_ROCE, "providers": ["tcp"], "libfabric": "1.20.0"},
                                {"HCCL_OVER_OFI": "1"})[0] == fabric.P2
    assert fabric.hccl_scaleout(DL1, {**efa_env, "HCCL_OVER_OFI": "0"})[0] == fabric.P3
    assert fabric.hccl_scaleout(G2_ROCE, {"HCCL_OVER_OFI": "0"})[0] == fabric.P0
    old_efa = {**efa_env, "HCCL_OVER_OFI": "1"}  # what the efa profile used to set
    assert any("asks for Gaudi Direct" in c for c in fabric.conflicts(old_efa))
    old_roce = {"HCCL_OVER_OFI": "0", "HCCL_OVER_TCP": "0"}
    assert any("HCCL_OVER_TCP is not read" in c for c in fabric.conflicts(old_roce))
    assert any("stops" in c for c in fabric.conflicts({"HCCL_GAUDI_DIRECT": "1"}))


@pytest.mark.parametrize("profile", ["efa", "hostnic", "roce"])
def test_shipped_gaudi_profiles_leave_the_choice_to_hccl(profile):
    values = envmod.resolve_profile(profile, {})
    assert "HCCL_OVER_OFI" not in values and "HCCL_OVER_TCP" not in values and "HCCL_GAUDI_DIRECT" not in values
    assert fabric.conflicts(values) == []
    if profile == "efa":  # Habana's Host NIC Gaudi Direct setup on AWS EFA
        assert values["FI_EFA_USE_DEVICE_RDMA"] == "1" and values["RDMAV_FORK_SAFE"] == "1"
    if profile == "hostnic":  # ... and with the verbs provider
        assert values["RDMAV_FORK_SAFE"] == "1" and values["MLX5_SCATTER_TO_CQE"] == "0"


def test_bus_bandwidth_is_nccl_tests_definition():
    from launch import allreduce

    # each byte crosses a link 2 (n - 1) / n times in a ring all-reduce
    assert allreduce.bus_gbit(10**9, 1.0, 2) == pytest.approx(8.0)
    assert allreduce.bus_gbit(10**9, 1.0, 4) == pytest.approx(12.0)
    assert allreduce.bus_gbit(10**9, 1.0, 1) == 0.0


def test_expected_bandwidth_names_its_source():
    assert fabric.expected_gbit("efa", "gaudi")[0] == 400.0
    assert fabric.expected_gbit("roce", "gaudi2")[0] == 300.0 and fabric.expected_gbit("roce", "gaudi3")[0] == 600.0
    assert fabric.expected_gbit("hostnic", "gaudi2")[0] is None and "--expect_gbit" in fabric.expected_gbit(
        "hostnic", "gaudi2")[1]


# ------------------------------------------------------------------------------------------------ emulated hosts
HL_SMI = """#!/bin/bash
# stand-in hl-smi: $FAKE_CARDS cards named $FAKE_CARD, external ports $FAKE_EXTERNAL in state $FAKE_LINK
case "$1 $2" in
  "-Q bus_id,name") for i in $(seq 1 "$FAKE_CARDS"); do echo "0000:$((16 + i)):00.0, $FAKE_CARD"; done ;;
  "-n ports") echo "port 0: internal"; for p in $FAKE_EXTERNAL; do echo "port $p: external"; done ;;
  "-n link") echo "port  0:        UP"; for p in $FAKE_EXTERNAL; do echo "port $p:        $FAKE_LINK"; done ;;
  *) exit 1 ;;
esac
"""
FI_INFO = """#!/bin/bash
# stand-in fi_info: libfabric $FAKE_LIBFABRIC with devices for the providers in $FAKE_PROVIDERS (none: no libfabric)
[ -n "$FAKE_LIBFABRIC" ] || { echo "fi_info: error while loading shared libraries: libfabric.so.1"; exit 127; }
if [ "$1" = "--version" ]; then
  printf 'fi_info: %s\\nlibfabric: %s\\nlibfabric api: 1.20\\n' "$FAKE_LIBFABRIC" "$FAKE_LIBFABRIC"; exit 0
fi
if [ "$1" = "-p" ]; then
  for p in $FAKE_PROVIDERS; do [ "$p" = "$2" ] && { echo "provider: $2"; exit 0; }; done
  echo "fi_getinfo: -61 (No data available)"; exit 61
fi
exit 1
"""
HOSTS = {  # name: (profile, fake tools' settings, .deepspeed_env additions)
    "dl1-efa": ("efa", {"FAKE_CARDS": "8", "FAKE_CARD": "HL-205", "FAKE_EXTERNAL": "7 8 9", "FAKE_LINK": "DOWN",
                        "FAKE_LIBFABRIC": "1.18.2amzn1.0", "FAKE_PROVIDERS": "efa tcp"}, ["HCCL_SOCKET_IFNAME=ens32"]),
    "gaudi2-hostnic": ("hostnic", {"FAKE_CARDS": "8", "FAKE_CARD": "HL-225", "FAKE_EXTERNAL": "8 22 23",
                                   "FAKE_LINK": "DOWN", "FAKE_LIBFABRIC": "1.20.0", "FAKE_PROVIDERS": "verbs tcp"},
                       []),
    "gaudi2-roce": ("roce", {"FAKE_CARDS": "8", "FAKE_CARD": "HL-225", "FAKE_EXTERNAL": "8 22 23", "FAKE_LINK": "UP"},
                    []),
    "gaudi3-roce": ("roce", {"FAKE_CARDS": "8", "FAKE_CARD": "HL-325L", "FAKE_EXTERNAL": "8 22 23",
                             "FAKE_LINK": "UP"}, []),
}


def fake_tools(d: Path) -> Path:
    d.mkdir(exist_ok=True)
    for name, text in (("hl-smi", HL_SMI), ("fi_info", FI_INFO)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return d


def emulated_preflight(tmp_path: Path, host: str, *extra_env: str) -> tuple[int, dict, str]:
    """preflight on one emulated Gaudi host: the profile written as the docs say, the stand-in tools on PATH."""
    profile, tools, sets = HOSTS[host]
    bin_dir = fake_tools(tmp_path / "bin")
    (tmp_path / "hostfile").write_text("localhost slots=1\n")  # the ranks of an emulated host are CPU processes
    env = dist_env(DS_ACCELERATOR="cpu", PATH=f"{bin_dir}:{__import__('os').environ['PATH']}", **tools)
    wrote = subprocess.run([sys.executable, "-m", "launch.env", "write", "--profile", profile, "--replace",
                            *[a for s in sets + list(extra_env) for a in ("--set", s)]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert wrote.returncode == 0, wrote.stderr
    proc = subprocess.run([sys.executable, "-m", "launch.preflight", "--hostfile", "hostfile", "--profile", profile,
                           "--master_port", str(free_port()), "--json"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    rows = {r["check"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"] if r["host"] != "(job)"}
    print(f"--- {host}: launch.env show --profile {profile}\n" + envmod.format_env(envmod.resolve_profile(profile, {}))
          + f"--- {host}: launch.preflight --profile {profile}\n" + "\n".join(proc.stdout.splitlines()[:-1]))
    return proc.returncode, rows, proc.stdout


@pytest.mark.parametrize("host, mode", [("dl1-efa", fabric.P1), ("gaudi2-hostnic", fabric.P1),
                                        ("gaudi2-roce", fabric.P0), ("gaudi3-roce", fabric.P0)])
def test_preflight_says_which_mode_hccl_will_pick(tmp_path, host, mode):
    code, rows, out = emulated_preflight(tmp_path, host)
    assert rows["hccl scale-out"]["result"] == "PASS" and rows["hccl scale-out"]["detail"].startswith(mode), out
    if HOSTS[host][0] == "roce":
        assert rows["gaudi nics"]["result"] == "PASS" and "24 of 24 external ports UP" in rows["gaudi nics"]["detail"]
        assert "libfabric" not in rows
    else:
        assert rows["gaudi nics"]["result"] == "-" and "not used by this profile" in rows["gaudi nics"]["detail"]
        assert rows["libfabric"]["result"] == "PASS" and HOSTS[host][1]["FAKE_LIBFABRIC"] in rows["libfabric"]["detail"]
    assert code == 0, out


def test_preflight_fails_a_forced_mode_and_a_down_port(tmp_path):
    """The efa profile as it used to be (HCCL_OVER_OFI=1 next to FI_EFA_USE_DEVICE_RDMA=1) fails with the reason."""
    code, rows, out = emulated_preflight(tmp_path, "dl1-efa", "HCCL_OVER_OFI=1")
    assert code == 1 and rows["hccl scale-out"]["result"] == "FAIL", out
    assert rows["hccl scale-out"]["detail"].startswith(fabric.P2) and "asks for Gaudi Direct" in out
