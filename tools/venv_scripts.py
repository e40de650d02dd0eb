"""DeepSpeed's scripts in the venv where DeepSpeed is the image's, so that `deepspeed` runs this venv's Python.

    .venv/bin/python tools/venv_scripts.py .venv      (tools/setup_venv.py, after the install)

Why: on a Gaudi or GPU image DeepSpeed is inherited (`--system-site-packages`, tools/parent_site.py), not installed
into the venv, so the `deepspeed` an active venv finds on PATH is the image's script, whose interpreter is the
image's Python. DeepSpeed starts every rank with the launcher's own interpreter: the README's `deepspeed --num_gpus 8
--module bert_ref.train ...` would start ranks that see neither the toolkit nor what set-up installed into the venv.
This writes each Python script the installed DeepSpeed ships (the bin/ entries of its installed files: deepspeed,
ds_report, ds_ssh, ...) into the venv's bin/, as DeepSpeed wrote it with the venv's interpreter on its first line,
where the venv has no file of that name (a DeepSpeed installed into the venv brings its own). Prints what it wrote.
"""
from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path


def inherited_scripts(venv: Path) -> dict[str, str]:
    """{name: text for the venv's bin/} of the installed DeepSpeed's Python scripts the venv lacks."""
    try:
        dist = importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return {}
    out = {}
    for f in dist.files or []:
        if Path(f).parent.name != "bin":
            continue
        src = Path(dist.locate_file(f))
        dst = venv / "bin" / src.name
        if dst.exists() or not src.is_file():
            continue
        first, _, rest = src.read_text(errors="replace").partition("\n")
        if first.startswith("#!") and "python" in first:  # a Python script: run it with this venv's interpreter
            out[src.name] = f"#!{venv / 'bin' / 'python'}\n{rest}"
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python tools/venv_scripts.py VENV_DIR")
    venv = Path(argv[0]).absolute()
    if not (venv / "pyvenv.cfg").is_file():
        raise SystemExit(f"venv_scripts: {venv} is not a venv (no pyvenv.cfg)")
    scripts = inherited_scripts(venv)
    for name, text in scripts.items():
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    if scripts:
        print(f"[setup] DeepSpeed is the image's: its scripts {', '.join(sorted(scripts))} written into {venv}/bin "
              "to run this venv's Python")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
