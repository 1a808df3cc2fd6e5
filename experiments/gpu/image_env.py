"""The CPU dry run's copy of the device's Python environment.

    python experiments/gpu/image_env.py VENV

Makes a fresh virtual environment (no pip of its own, no system site-packages) that sees only the
distributions the device image has (image_packages.txt), taken from the Python running this
script, with what those need as installed here (this machine's versions can need packages the
image's versions do not: a newer huggingface-hub needs httpx2, a newer typer pydantic), except the
testbed's own dependencies, which must come from the wheels. Each one's top-level files are linked
into VENV/image, which a .pth file puts on the path. Whatever else the testbed imports must then come
from the carried wheels, as on the device, so a wheel missing from wheels.txt fails the dry run with
an ImportError here instead of failing a device call. A venv with --system-site-packages would not: it sees simpy and Hydra from this
machine's own installation. The versions are this Python's, not the image's (Python 3.12, torch
2.11, transformers 5.17 there): the copy checks which packages are present, not their versions.
"""
from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def image_names() -> set[str]:
    lines = (HERE / "image_packages.txt").read_text().splitlines()
    return {canonicalize_name(s) for line in lines if (s := line.split("#")[0].strip())}


def the_image(installed: dict) -> tuple[list, list[str]]:
    """The installed distributions standing for the image: its own, then what they need here (not
    the testbed's own dependencies); and the names of those added as needs."""
    image = image_names()
    project = {canonicalize_name(Requirement(r).name)
               for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    todo = sorted(n for n in image if n in installed)
    chosen, added = set(todo), []
    while todo:
        for r in installed[todo.pop()].requires or []:
            req = Requirement(r)
            name = canonicalize_name(req.name)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if name in chosen or name not in installed or (name in project and name not in image):
                continue
            chosen.add(name)
            added.append(name)
            todo.append(name)
    return [installed[n] for n in sorted(chosen)], sorted(added)


def main() -> int:
    target = Path(sys.argv[1]).resolve()
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=True, clear=True).create(target)
    view = target / "image"
    view.mkdir()
    installed = {}
    for dist in md.distributions():  # the first of a name on the path is the one Python imports
        installed.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist)
    dists, added = the_image(installed)
    for dist in dists:
        base = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files or [] if f.parts}
        for top in sorted(tops):
            if top in ("..", "__pycache__") or top.endswith(".pth"):  # scripts, caches, other path hooks
                continue
            src, dst = base / top, view / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(target), "platbase": str(target)}))
    (site / "_image.pth").write_text(f"{view}\n")
    print(f"image_env: {target}: {len(dists) - len(added)} of the image's {len(image_names())} distributions "
          f"from {sys.executable}, and what this machine's versions of them need: {', '.join(added) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
