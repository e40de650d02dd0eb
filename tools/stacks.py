"""The support matrix: the package stacks the toolkit is tested on, one file each under stacks/, and what set-up does
with them.

    python tools/stacks.py constraints --stack auto --out .venv/constraints.txt   (make setup)
    python tools/stacks.py image --stack gaudi-1.21 --fork PATH --venv .gaudi-image-1.21  (make test-gaudi)
    python tools/stacks.py which                                                   (the stack this Python matches)
    python tools/stacks.py freeze --stack latest                                   (rewrite a stack file from here)

A stack file is a pip constraints file: `name==version` for every package the toolkit installs (its requirements and
theirs), so that a fresh `make setup` installs what CI tested and a new upstream release cannot change it unseen.
Lines marked `# image` are the packages the stack's image ships (a Gaudi image's torch, DeepSpeed fork, transformers,
...): the Gaudi lane installs those first to play the image (`image`), and set-up never replaces them.

`constraints` is set-up's step: it picks the stack (auto: the one whose DeepSpeed and transformers match the installed
ones) and writes the constraints pip installs with. A package this Python already has is not pinned (pip keeps it
where it satisfies the toolkit's requirements), except torch, DeepSpeed and transformers, which are pinned to the
installed version: an image's builds are never replaced, and one older than the oldest tested stops set-up with the
reason. Standard library only: it runs in a venv that has nothing installed yet.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STACKS = REPO / "stacks"
# set-up never replaces these where the Python it starts from has them (an image's builds: HPU / CUDA torch, Habana's
# DeepSpeed fork, the transformers its model code was validated with)
KEPT = ("torch", "deepspeed", "transformers")
# packages of a CUDA torch build (the Gaudi stack's torch comes from PyPI as the CUDA build): the image's, not pinned
IMAGE_RUNTIME = re.compile(r"^(nvidia-.*|triton|cuda-.*)$")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string ("0.16.1+unknown" -> (0, 16, 1), "2.13.0+cpu" -> (2, 13, 0))."""
    nums = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in nums.group(0).split(".")) if nums else ()


def read_stack(name: str) -> tuple[dict[str, str], set[str]]:
    """(name -> pinned version, names marked `# image`) of stacks/<name>.txt; errors name the file and line."""
    path = STACKS / f"{name}.txt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in STACKS.glob("*.txt")))
        raise SystemExit(f"error: no stack {name!r}: {path} does not exist (stacks: {known})")
    pins, image = {}, set()
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line, _, comment = raw.partition("#")
        line = line.strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([0-9][^\s;]*)", line)
        if not m:
            raise SystemExit(f"error: {path}:{n}: expected `name==version`, got {line!r}")
        pins[canon(m.group(1))] = m.group(2)
        if comment.strip().startswith("image"):
            image.add(canon(m.group(1)))
    return pins, image


def stack_names() -> list[str]:
    return sorted(p.stem for p in STACKS.glob("*.txt"))


def installed(inherited_only: bool = False) -> dict[str, str]:
    """name -> version of every distribution this Python imports from (the first on sys.path wins, as for imports);
    inherited_only: those outside this venv (an image's: the base interpreter's or a parent venv's site-packages)."""
    found: dict[str, str] = {}
    own = Path(sys.prefix).resolve()
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if not name or canon(name) in found:
            continue
        if inherited_only and own != Path(sys.base_prefix).resolve():
            where = Path(str(dist.locate_file(""))).resolve()
            if where == own or own in where.parents:
                found[canon(name)] = ""  # this venv's own: shadows an inherited copy, not inherited itself
                continue
        found[canon(name)] = dist.version
    return {k: v for k, v in found.items() if v}


def choose(stack: str, have: dict[str, str]) -> tuple[str, str]:
    """(stack name, why). auto: the stack the installed torch, DeepSpeed and transformers are closest to: each must
    have the stack's major release (DeepSpeed: major.minor), then the stack whose versions match at major.minor
    most often wins (an image of a Gaudi release between two tested ones, 1.22's torch 2.7 and transformers 4.51,
    takes the stack of its transformers and DeepSpeed). Nothing installed yet, or no stack matching, gives `latest`."""
    if stack != "auto":
        read_stack(stack)
        return stack, "asked for"
    best, best_score = None, -1
    for name in stack_names():
        pins, _ = read_stack(name)
        found = [p for p in KEPT if p in have and p in pins]
        major = {"deepspeed": 2, "transformers": 1, "torch": 1}
        if not any(p != "torch" for p in found) or any(
                release(have[p])[:major[p]] != release(pins[p])[:major[p]] for p in found):
            continue
        score = sum(release(have[p])[:2] == release(pins[p])[:2] for p in found)
        if score > best_score or (score == best_score and best is not None and name < best):
            best, best_score = name, score
    if best is None:
        return "latest", "nothing installed matches another stack"
    return best, "installed " + ", ".join(f"{p} {have[p]}" for p in KEPT if p in have)


# Intel Gaudi software releases in use and the PyTorch each ships (Intel Gaudi support matrix,
# https://docs.habana.ai/en/latest/Support_Matrix/Support_Matrix.html and its per-release pages): set-up names the
# release an image's torch belongs to. 1.21 is the last release for first-gen Gaudi (AWS DL1); 1.22 and 1.23 run
# Gaudi 2 and Gaudi 3.
GAUDI_TORCH = {"1.21": (2, 6), "1.22": (2, 7), "1.23": (2, 9)}


def stack_meta(name: str) -> dict[str, str]:
    """The `# key: value` lines of a stack file's header (gaudi: the Gaudi software release; python: the Python
    version its lane runs)."""
    meta = {}
    for line in (STACKS / f"{name}.txt").read_text().splitlines():
        m = re.fullmatch(r"#\s*(gaudi|python):\s*(\S+)\s*", line)
        if m:
            meta[m.group(1)] = m.group(2)
    return meta


def gaudi_release(have: dict[str, str]) -> str | None:
    """The Intel Gaudi software release these packages are: habana-torch-plugin's version where installed (a Gaudi
    image), else the release whose PyTorch the installed torch is, where DeepSpeed is the 0.16 line of Habana's fork."""
    plugin = have.get("habana-torch-plugin")
    if plugin:
        return ".".join(map(str, release(plugin)[:2]))
    if "torch" not in have or release(have.get("deepspeed", ""))[:2] != (0, 16):
        return None
    return next((rel for rel, torch in GAUDI_TORCH.items() if release(have["torch"])[:2] == torch), None)


def describe(name: str, have: dict[str, str]) -> str:
    """What set-up says of the stack it chose: the Gaudi release the packages match, and whether CI tests it as such
    or it lies between two tested stacks."""
    rel, meta = gaudi_release(have), stack_meta(name)
    if rel is None:
        return f"stack {name}"
    tested = sorted((stack_meta(s)["gaudi"], s) for s in stack_names() if "gaudi" in stack_meta(s))
    if meta.get("gaudi") == rel:
        return f"Intel Gaudi software {rel}: stack {name}"
    lower = [s for r, s in tested if release(r) < release(rel)]
    upper = [s for r, s in tested if release(r) > release(rel)]
    where = (f"between the tested stacks {lower[-1]} and {upper[0]}, covered by both ends" if lower and upper else
             "outside the tested Gaudi releases")
    return f"Intel Gaudi software {rel} ({where}): stack {name}"


def kept_too_old(have: dict[str, str]) -> list[str]:
    """KEPT packages installed below the oldest version any stack tests: set-up stops rather than replace them."""
    oldest: dict[str, tuple[str, tuple]] = {}
    for name in stack_names():
        pins, _ = read_stack(name)
        for pkg in KEPT:
            if pkg in pins and (pkg not in oldest or release(pins[pkg]) < oldest[pkg][1]):
                oldest[pkg] = (f"{pins[pkg]} in stacks/{name}.txt", release(pins[pkg]))
    return [f"{pkg} {have[pkg]} is older than the oldest tested ({oldest[pkg][0]})"
            for pkg in KEPT if pkg in have and pkg in oldest and release(have[pkg]) < oldest[pkg][1]]


def constraint_lines(pins: dict[str, str], image: dict[str, str]) -> list[str]:
    """pip constraints: KEPT packages the image has at their installed version; nothing for the image's other packages
    (pip keeps them where they satisfy the toolkit); the stack's pins for everything else, this venv's own included
    (a stack file that moved on moves them too)."""
    lines = [f"{pkg}=={image[pkg]}" for pkg in KEPT if pkg in image]
    lines += [f"{pkg}=={ver}" for pkg, ver in pins.items() if pkg not in image]
    return lines


def cmd_constraints(args: argparse.Namespace) -> int:
    have, image = installed(), installed(inherited_only=True)
    name, why = choose(args.stack, have)
    old = kept_too_old(image)
    if old:
        print(f"[setup] error: {'; '.join(old)}. Set-up keeps an image's torch, DeepSpeed and transformers rather than "
              f"replace them: use a Python whose packages are in the support matrix (docs/gaudi.md), or a plain "
              f"Python without them (set-up then installs stacks/latest.txt)", file=sys.stderr)
        return 1
    pins, _ = read_stack(name)
    lines = constraint_lines(pins, image)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(f"# written by tools/stacks.py from stacks/{name}.txt; {why}\n" + "\n".join(lines) + "\n")
    kept = ", ".join(f"{p} {image[p]}" for p in KEPT if p in image) or "none: no image packages"
    print(f"[setup] {describe(name, have)} (stacks/{name}.txt; {why}); kept as installed: {kept}")
    return 0


def cmd_which(args: argparse.Namespace) -> int:
    have = installed()
    name, why = choose("auto", have)
    pins, _ = read_stack(name)
    # a pinned package this environment does not have is an extra it was not set up with (`mpich`), no difference
    off = [f"{p} {have[p]} (tested: {v})" for p, v in pins.items()
           if not IMAGE_RUNTIME.match(p) and p in have and release(have[p]) != release(v)]
    absent = sorted(p for p in pins if p not in have and not IMAGE_RUNTIME.match(p))
    print(f"{describe(name, have)} ({why}): " + ("every package as tested" if not off else
                                       f"{len(off)} package(s) differ from it: " + "; ".join(off))
          + (f" (not installed here: {', '.join(absent)})" if absent else ""))
    return 0


def fingerprint(stack: str, fork: Path, python: str) -> str:
    """What an image venv was built from: the stack's `# image` pins, its Python and the fork's bytes (a directory:
    its file list). The stack's other pins are set-up's, not the image's: re-freezing them keeps the image."""
    pins, image = read_stack(stack)
    h = hashlib.sha256(("\n".join(f"{p}=={pins[p]}" for p in sorted(image)) + f"\npython {python}\n").encode())
    if fork.is_file():
        h.update(fork.read_bytes())
    else:
        for f in sorted(fork.rglob("*")):
            if f.is_file():
                h.update(f"{f.relative_to(fork)}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()


def cmd_image(args: argparse.Namespace) -> int:
    """A venv that plays the stack's image: its `# image` packages as the image has them, DeepSpeed from the fork."""
    pins, image = read_stack(args.stack)
    fork, venv = Path(args.fork).resolve(), Path(args.venv)
    if not fork.exists():
        print(f"error: --fork {args.fork}: no such file or directory (Habana's DeepSpeed fork: its source tree or "
              f"release archive, e.g. habana-deepspeed-1.21.0.tar.gz)", file=sys.stderr)
        return 2
    version = stack_meta(args.stack).get("python")
    stamp, want = venv / ".image", fingerprint(args.stack, fork, args.python or version or "")
    py = venv / "bin" / "python"
    if stamp.is_file() and stamp.read_text().strip() == want and py.exists():
        print(f"[image] {venv}: already built from stacks/{args.stack}.txt's image and {fork.name}")
        return 0
    pip = [str(py), "-m", "pip", "install", "-q", "-c", str(STACKS / f"{args.stack}.txt")]
    run([args.python or find_python(version), "-m", "venv", "--clear", str(venv)])
    # the fork builds without pip's isolated environment (its setup.py imports torch): wheel must be there
    run(pip + ["wheel", "setuptools"])
    run(pip + sorted(f"{p}=={pins[p]}" for p in image if p != "deepspeed"))
    run(pip + ["--no-build-isolation", str(fork)], env=dict(os.environ, DS_BUILD_OPS="0"))
    got = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    if "deepspeed" in pins and release(got) != release(pins["deepspeed"]):
        print(f"error: --fork {args.fork} installed deepspeed {got}; stacks/{args.stack}.txt tests "
              f"{pins['deepspeed']}", file=sys.stderr)
        return 2
    stamp.write_text(want + "\n")
    print(f"[image] {venv}: " + ", ".join(f"{p}=={pins[p]}" for p in sorted(image)) + f" (deepspeed {got})")
    return 0


def find_python(version: str | None) -> str:
    """An interpreter of `version` (X.Y; None: this one): `pythonX.Y` on PATH where it runs (a pyenv shim of a version
    not selected does not), else pyenv's install of it, else /usr/bin's. The image's Python is the stack's: Gaudi
    1.21's images run Ubuntu 22.04's Python 3.10."""
    import glob
    import shutil

    if version is None or ".".join(map(str, sys.version_info[:2])) == version:
        return sys.executable
    exe = f"python{version}"
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    pyenv = [f for r in roots if r for f in sorted(glob.glob(f"{r}/versions/{version}.*/bin/{exe}"), reverse=True)]
    for cand in [shutil.which(exe), *pyenv, f"/usr/bin/{exe}"]:
        if cand and os.access(cand, os.X_OK) and subprocess.run([cand, "-c", "pass"],
                                                                capture_output=True).returncode == 0:
            return cand
    raise SystemExit(f"error: the stack's Python {version} was not found (no working {exe} on PATH, in pyenv's "
                     f"versions or /usr/bin): install it, or give --python")


def run(cmd: list[str], env: dict | None = None) -> None:
    print("[image] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def requirement_closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version of every distribution the roots require, transitively (markers evaluated here)."""
    from packaging.requirements import Requirement

    have, seen, todo = installed(), {}, [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canon(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})) or name not in have:
            continue
        seen[name] = have[name]
        dist = md.distribution(req.name)
        for r in dist.requires or []:
            sub = Requirement(r)
            if not sub.marker or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(Requirement(str(sub).split(";")[0]))
    return seen


def cmd_freeze(args: argparse.Namespace) -> int:
    """Rewrite stacks/<stack>.txt from this environment: its header and `# image` marks kept, every version read
    from what is installed here (local labels such as +cpu dropped: the constraint then matches either build)."""
    path = STACKS / f"{args.stack}.txt"
    old_pins, image = read_stack(args.stack)
    header = [ln for ln in path.read_text().splitlines() if ln.startswith("#")]
    found = requirement_closure([f"ds-scale-toolkit[{args.extras}]", *old_pins])
    found.pop("ds-scale-toolkit", None)
    lines = []
    for name in sorted(found):
        if IMAGE_RUNTIME.match(name) or name in ("pip", "setuptools", "wheel"):
            continue
        ver = found[name].split("+")[0]
        lines.append(f"{name}=={ver}" + ("  # image" if name in image else ""))
    path.write_text("\n".join(header + lines) + "\n")
    print(f"{path}: {len(lines)} packages")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/stacks.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("constraints", help="write the pip constraints set-up installs with", allow_abbrev=False)
    c.add_argument("--stack", default="auto", help="auto (the stack the installed packages match), or a stack name")
    c.add_argument("--out", required=True, help="the constraints file to write")
    sub.add_parser("which", help="the stack this Python matches, and what differs from it", allow_abbrev=False)
    i = sub.add_parser("image", help="a venv playing a stack's image (its `# image` packages, DeepSpeed from --fork)",
                       allow_abbrev=False)
    i.add_argument("--stack", default="gaudi-1.23")
    i.add_argument("--python", default="", help="the image's Python (default: the stack's `# python:` version)")
    i.add_argument("--fork", required=True, help="Habana's DeepSpeed fork: source tree or release archive")
    i.add_argument("--venv", required=True, help="the venv to make (reused where built from the same files)")
    f = sub.add_parser("freeze", help="rewrite a stack file from this environment", allow_abbrev=False)
    f.add_argument("--stack", required=True)
    f.add_argument("--extras", default="mpi,mpich,test")
    args = p.parse_args(argv)
    cmds = {"constraints": cmd_constraints, "which": cmd_which, "image": cmd_image, "freeze": cmd_freeze}
    return cmds[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
