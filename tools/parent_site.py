"""Make a new venv see the packages of the Python that created it, when that Python is itself a venv.

    $(PYTHON) tools/parent_site.py .venv    (tools/setup_venv.py, after `$(PYTHON) -m venv --system-site-packages`)

Why: `--system-site-packages` gives the new venv the *base* interpreter's site-packages. When $(PYTHON) is a venv
(a GPU image whose python3 is a venv holding the CUDA torch), its own site-packages, where torch
lives, is not the base's, so the new venv would see no torch: offline `make setup` stops, online it installs a second
torch that shadows the image's build. This writes `<venv site-packages>/_parent_env.pth` with one line that calls
site.addsitedir on each of the parent's site-packages directories: they come after the venv's own (so what pip
installs into the venv wins where versions were not good enough), and the parent's own .pth files are processed too.
pip reads installed distributions from sys.path, so it sees the parent's torch, transformers, ... as installed and
does not download them again. A conda env's python is a base interpreter (sys.prefix == sys.base_prefix): there
`--system-site-packages` already sees the env's packages and nothing is written. Prints what it did.
"""
from __future__ import annotations

import site
import sys
import sysconfig
from pathlib import Path

PTH = "_parent_env.pth"


def parent_site_dirs() -> list[str]:
    """This interpreter's site-packages directories when it is a venv (empty for a base or conda interpreter)."""
    if sys.prefix == sys.base_prefix:
        return []
    dirs = [*site.getsitepackages(), *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))]
    user = site.getusersitepackages()  # a user's ~/.local packages stay out, as in any venv
    return list(dict.fromkeys(str(Path(d).resolve()) for d in dirs if Path(d).is_dir() and d != user))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python tools/parent_site.py VENV_DIR")
    venv = Path(argv[0]).resolve()
    if not (venv / "pyvenv.cfg").is_file():
        raise SystemExit(f"parent_site: {venv} is not a venv (no pyvenv.cfg)")
    target = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    if not target.is_dir():
        raise SystemExit(f"parent_site: {target} does not exist: was {venv} made by this Python ({sys.executable})?")
    dirs = parent_site_dirs()
    if not dirs:
        print(f"[setup] {sys.executable} is not a venv: {venv} sees its packages through --system-site-packages")
        return 0
    # one line: site runs a .pth line that starts with "import" (exec'd, so no comprehension: it could not see `site`)
    (target / PTH).write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")
    print(f"[setup] {sys.executable} is a venv: {venv} also sees its site-packages {dirs} ({target / PTH})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
