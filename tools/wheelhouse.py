"""Build an offline wheelhouse: every wheel the toolkit needs on a target beyond what the target already has.

    python tools/wheelhouse.py --out wheelhouse --python 3.12 --platform manylinux_2_28_x86_64 \
        --base tools/base/cuda_image.txt [--extras mpi,test]
    (make wheelhouse PY=3.12 PLATFORM=manylinux_2_28_x86_64 BASE=tools/base/cuda_image.txt)

then on the target, with no network: `make setup WHEELHOUSE=wheelhouse`: every wheel installed from requirements.txt
with `pip install --no-index --require-hashes` (each checked against the sha256 recorded here), then the toolkit
itself, editable, from the checkout.

Why a script and not one `pip download -r`: pip has no "these packages are already installed on the target" switch,
so a plain download also fetches torch and its CUDA libraries (gigabytes) that a GPU image ships. This walks the
requirement graph itself, one `pip download --no-deps` per package (for the target's Python and platform, binary
wheels only), reads each wheel's Requires-Dist, evaluates the markers for the target and stops at every name in the
base list (a name, or name==version: a pinned base version that does not satisfy a requirement is downloaded too,
and pip upgrades it there). DeepSpeed ships only an sdist: it is built here into a wheel with DS_BUILD_OPS=0 (its ops
are built just in time on the target, or ds_core.device.ops_check falls back to torch's AdamW where no compiler is
there).
The toolkit's own build requirements (setuptools, wheel) and everything they require (wheel needs packaging) go in
even when the base has them: the hashed install puts them into the venv, and the editable install is built with
those (no isolated build environment, which would take them from the wheelhouse unchecked). MANIFEST.json lists
every file, its size, its sha256, why it is there, and the base names that were left out; requirements.txt pins every
wheel but the toolkit's with its hash.
"""
from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9 / 3.10 (e.g. Gaudi images): the same parser as a package
    import tomli as tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
SDIST_ONLY = {"deepspeed"}  # published without wheels: built here
TOOLKIT = "ds-scale-toolkit"
REQUIREMENTS = "requirements.txt"  # every wheel pinned with its sha256, for `pip install --require-hashes`


def read_base(path: str | None) -> dict[str, Version | None]:
    """name -> pinned version (or None) from a base list: one `name` or `name==version` per line, # comments."""
    base: dict[str, Version | None] = {}
    if not path:
        return base
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, ver = line.partition("==")
        try:
            base[canonicalize_name(name.strip())] = Version(ver.strip()) if ver.strip() else None
        except Exception as e:  # noqa: BLE001
            raise SystemExit(f"{path}:{n}: expected 'name' or 'name==version', got {line!r} ({e})") from None
    return base


def in_base(req: Requirement, base: dict[str, Version | None]) -> bool:
    """Whether the target's own copy serves `req`: a pinned base version must satisfy it; a bare name is trusted for
    a lower bound only (an upper bound such as datasets' fsspec<=X may exclude the image's newer copy, and pip could
    not downgrade it offline, so the newest allowed wheel goes in)."""
    name = canonicalize_name(req.name)
    if name not in base:
        return False
    if base[name] is not None:
        return req.specifier.contains(base[name], prereleases=True)
    return not any(s.operator in ("<", "<=", "==", "===", "~=") for s in req.specifier)


def target_env(python: str, platform: str) -> dict[str, str]:
    """Marker environment of the target (Linux x86_64 / aarch64 CPython `python`)."""
    env = dict(default_environment())
    machine = "aarch64" if "aarch64" in platform else "x86_64"
    env.update(python_version=python, python_full_version=python + ".0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               os_name="posix", platform_machine=machine)
    return env


def compatible_platforms(platform: str) -> list[str]:
    """The platform tags a target of `platform` installs: pip's --platform takes tags literally, so
    manylinux_2_28_x86_64 would refuse the (more common) manylinux_2_17 / manylinux2014 wheels the target runs."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    return [f"manylinux_2_{v}_{arch}" for v in range(glibc, 16, -1)] + [f"manylinux2014_{arch}"]


def wheel_requires(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return msg.get_all("Requires-Dist") or []


def pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"wheelhouse: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")


def download(req: Requirement, out: Path, python: str, platform: str, pip_args: list[str]) -> Path:
    """One wheel for the target (no dependencies); DeepSpeed from its sdist, built here."""
    name = canonicalize_name(req.name)
    spec = f"{req.name}{req.specifier}"
    before = set(out.glob("*.whl"))
    if name in SDIST_ONLY:
        with tempfile.TemporaryDirectory() as d:
            pip("download", "--no-deps", "--no-binary", ":all:", "--dest", d, spec, *pip_args)
            sdist = next(Path(d).iterdir())
            # DS_BUILD_OPS=0: a pure-Python wheel; ops are JIT-built on the target where ninja + nvcc exist
            pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(sdist),
                env=dict(os.environ, DS_BUILD_OPS="0"))
    else:
        abi = "cp" + python.replace(".", "")
        plats = [a for p in compatible_platforms(platform) for a in ("--platform", p)]
        pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python, *plats,
            "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none", "--dest", str(out), spec,
            *pip_args)
    new = set(out.glob("*.whl")) - before
    for w in sorted(out.glob("*.whl")):  # already there (a re-run): find it by name
        if not new and canonicalize_name(parse_wheel_filename(w.name)[0]) == name:
            new = {w}
    if len(new) != 1:
        raise SystemExit(f"wheelhouse: expected one wheel for {spec}, got {sorted(p.name for p in new)}")
    return new.pop()


def toolkit_requirements(extras: list[str]) -> list[tuple[Requirement, str]]:
    py = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [(Requirement(r), "ds-scale-toolkit") for r in py["project"]["dependencies"]]
    for e in extras:
        if e not in py["project"].get("optional-dependencies", {}):
            raise SystemExit(f"--extras: pyproject.toml has no extra {e!r}")
        reqs += [(Requirement(r), f"ds-scale-toolkit[{e}]") for r in py["project"]["optional-dependencies"][e]]
    reqs += [(Requirement(r), "build-system.requires") for r in py["build-system"]["requires"]]
    return reqs


def build(out: Path, python: str, platform: str, base: dict[str, Version | None], extras: list[str],
          pip_args: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = target_env(python, platform)
    todo = toolkit_requirements(extras)
    got: dict[str, tuple[Path, Version]] = {}
    why: dict[str, str] = {}
    extras_done: set[tuple[str, str]] = set()
    skipped: dict[str, str] = {}
    while todo:
        req, parent = todo.pop(0)
        for_build = parent.startswith("build-system.requires")
        name = canonicalize_name(req.name)
        if name == "torch" and name not in base:
            raise SystemExit("wheelhouse: torch is not in the base list; a wheelhouse never carries torch (the "
                             "target's CUDA / Gaudi build must be kept): add it to --base")
        # build requirements and theirs always go in: pip's isolated build environment (the editable install)
        # cannot see the target's installed setuptools, wheel or packaging
        if not for_build and in_base(req, base):
            skipped[name] = f"in base{'' if base[name] is None else ' ' + str(base[name])} (needed by {parent})"
            continue
        if name in got:
            if not req.specifier.contains(got[name][1], prereleases=True):
                raise SystemExit(f"wheelhouse: {parent} needs {req}, but {got[name][0].name} was chosen for "
                                 f"{why[name]}")
        else:
            whl = download(req, out, python, platform, pip_args)
            got[name] = (whl, parse_wheel_filename(whl.name)[1])
            why[name] = parent
            print(f"[wheelhouse] {whl.name} ({whl.stat().st_size / 1e6:.2f} MB) for {parent}", flush=True)
        # this package's requirements, for each extra it is asked with ("" = none)
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in extras_done:
                continue
            extras_done.add((name, extra))
            for r in map(Requirement, wheel_requires(got[name][0])):
                if extra and (r.marker is None or "extra" not in str(r.marker)):
                    continue  # the plain requirements were taken in the "" pass
                if r.marker is None or r.marker.evaluate({**env, "extra": extra}):
                    label = f"{req.name}{f'[{extra}]' if extra else ''}"
                    todo.append((r, f"build-system.requires ({label})" if for_build else label))
    pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(REPO))  # the toolkit itself
    return write_manifest(out, python, platform, extras, why, skipped)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(out: Path, python: str, platform: str, extras: list[str], why: dict, skipped: dict) -> dict:
    """MANIFEST.json (each wheel: size, sha256, which requirement pulled it in; the base names left out) and
    requirements.txt: `name==version --hash=sha256:...` for every wheel but the toolkit's own, what the offline
    set-up installs with `pip --require-hashes` (a wheel changed on the way is refused by name)."""
    files = sorted(out.glob("*.whl"))
    entries, lines = [], []
    for f in files:
        name, version = parse_wheel_filename(f.name)[:2]
        digest = sha256_of(f)
        entries.append({"wheel": f.name, "mb": round(f.stat().st_size / 1e6, 3), "sha256": digest,
                        "for": why.get(canonicalize_name(name), "the toolkit")})
        if canonicalize_name(name) != canonicalize_name(TOOLKIT):  # installed editable from the checkout
            lines.append(f"{name}=={version} --hash=sha256:{digest}")
    manifest = {"python": python, "platform": platform, "extras": extras,
                "total_mb": round(sum(f.stat().st_size for f in files) / 1e6, 2), "files": entries,
                "from_base": skipped}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    (out / REQUIREMENTS).write_text("".join(line + "\n" for line in lines))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", default="wheelhouse", help="directory for the wheels and MANIFEST.json")
    ap.add_argument("--python", default="3.12", help="target Python (major.minor)")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64", help="target wheel platform tag")
    ap.add_argument("--base", default="", help="packages already on the target: 'name' or 'name==version' lines")
    ap.add_argument("--extras", default="", help="toolkit extras to include, comma separated (e.g. mpi,test)")
    ap.add_argument("--constraints", default="",
                    help="pip constraints every download honours: the stack's file (stacks/*.txt), so that the "
                         "wheelhouse holds the versions `make setup` installs with")
    ap.add_argument("--max_mb", type=float, default=0, help="fail when the wheelhouse is larger (0: no limit)")
    ap.add_argument("--pip_arg", action="append", default=[],
                    help="extra argument for pip download (repeatable), e.g. --pip_arg=--no-index "
                         "--pip_arg=--find-links=DIR")
    a = ap.parse_args(argv)
    extras = [e for e in a.extras.split(",") if e]
    pip_args = a.pip_arg + (["-c", str(Path(a.constraints).resolve())] if a.constraints else [])
    m = build(Path(a.out), a.python, a.platform, read_base(a.base), extras, pip_args)
    print(json.dumps({"wheelhouse": a.out, "files": len(m["files"]), "total_mb": m["total_mb"],
                      "from_base": len(m["from_base"])}))
    if a.max_mb and m["total_mb"] > a.max_mb:
        print(f"wheelhouse: {m['total_mb']} MB > --max_mb {a.max_mb}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
