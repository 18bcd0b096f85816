"""The wheelhouse that lets ``make gpu-check`` run on a GPU machine with its own Python and torch
and no network: what it holds, how ``make gpu-wheels`` fills it here, how the check installs it
there. Standard library only: it runs before anything is installed.

The check imports, beyond what that machine has (torch, numpy, safetensors, tqdm, transformers,
pytest, ...), only Hydra's stack: hydra-core, omegaconf, antlr4-python3-runtime, which are
always installed (``make gpu-env-check`` proves that set is enough). PyYAML and packaging, which
omegaconf and hydra need too, are required by transformers and pytest, so that machine has them;
their wheels ride along for a machine without, and are installed only where the interpreter
cannot import them, so they never shadow its own. Versions are the ``.venv``'s, read when the
wheels are downloaded and written to the wheelhouse's ``requirements.txt``, which the install
pins exactly.

Usage: ``python tools/gpu_check/wheelhouse.py download --dest DIR [--python-version 3.12]``
(here, with network) and ``python3 tools/gpu_check/wheelhouse.py install --wheelhouse DIR
--target DIR`` (there: ``--no-index``, ``--no-deps``, wheels only, no pip configuration).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MiB = 2**20
CARRY_LIMIT = 64 * MiB  # what travels to the GPU machine: the working tree and the wheelhouse
WHEELHOUSE_LIMIT = 8 * MiB  # measured 1.3 MiB (2026-12)
MANIFEST = "requirements.txt"
# manylinux tags the GPU machine accepts: its torch 2.11 wheel is manylinux_2_28, so glibc >= 2.28.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Wheel:
    """A distribution the check needs on the GPU machine."""

    name: str  # as on PyPI
    module: str  # what the check imports from it
    always: bool  # False: installed only where ``module`` is not importable
    from_sdist: bool = False  # no wheel on PyPI for the pinned version: built here (pure Python)


WHEELS = (
    Wheel("hydra-core", "hydra", always=True),
    Wheel("omegaconf", "omegaconf", always=True),
    # omegaconf 2.3 needs antlr4 4.9.*, published as an sdist only.
    Wheel("antlr4-python3-runtime", "antlr4", always=True, from_sdist=True),
    Wheel("PyYAML", "yaml", always=False),
    Wheel("packaging", "packaging", always=False),
)


def canonical(name: str) -> str:
    """PEP 503 normalised name (``PyYAML`` -> ``pyyaml``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(version=importlib.metadata.version) -> dict[str, str]:
    """``{name: version}`` of every wheel, as installed in this interpreter (the .venv)."""
    return {w.name: version(w.name) for w in WHEELS}


def pip_env() -> dict[str, str]:
    """This environment without pip's variables and with no pip configuration file, so that
    the command line alone says where pip looks (a machine's config may add indexes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


# -- here: download ---------------------------------------------------------------------------
def download_commands(dest: Path, python_version: str, versions: dict[str, str]) -> list[list]:
    """pip commands that put every wheel for CPython ``python_version`` on manylinux x86_64
    into ``dest``: one download of the published wheels, one build per sdist-only one."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    abi = "cp" + python_version.replace(".", "")
    target = ["--python-version", python_version, "--implementation", "cp", "--abi", abi]
    for platform in PLATFORMS:
        target += ["--platform", platform]
    published = [f"{w.name}=={versions[w.name]}" for w in WHEELS if not w.from_sdist]
    commands = [
        [*pip, "download", "--no-deps", "--only-binary=:all:", *target, "-d", str(dest), *published]
    ]
    commands += [
        [*pip, "wheel", "--no-deps", "-w", str(dest), f"{w.name}=={versions[w.name]}"]
        for w in WHEELS
        if w.from_sdist
    ]
    return commands


def wheel_files(wheelhouse: Path) -> dict[str, Path]:
    """``{canonical name: wheel file}`` in ``wheelhouse``."""
    return {canonical(p.name.split("-")[0]): p for p in sorted(wheelhouse.glob("*.whl"))}


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels: tracked and untracked, not ignored, files."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True,
        check=True,
    ).stdout
    paths = (root / p for p in listed.decode().split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def download(dest: Path, python_version: str) -> int:
    """Fill ``dest`` (its old wheels removed) and write its manifest; 1 when over budget."""
    versions = pins()
    dest.mkdir(parents=True, exist_ok=True)
    for old in [*dest.glob("*.whl"), dest / MANIFEST]:
        old.unlink(missing_ok=True)
    for command in download_commands(dest, python_version, versions):
        print("[gpu-wheels] " + shlex.join(command), flush=True)
        subprocess.run(command, check=True)
    found = wheel_files(dest)
    for w in WHEELS:
        built = found.get(canonical(w.name))
        if built is None:
            raise SystemExit(f"[gpu-wheels] no wheel of {w.name} in {dest}")
        if w.from_sdist and not built.name.endswith("-none-any.whl"):
            raise SystemExit(f"[gpu-wheels] {built.name} is not pure Python: it runs here only")
    lines = [f"{w.name}=={versions[w.name]}" for w in WHEELS]
    (dest / MANIFEST).write_text(
        "# written by `make gpu-wheels`; installed by `make gpu-check`\n" + "\n".join(lines) + "\n"
    )
    size, tree = sum(p.stat().st_size for p in found.values()), tree_bytes()
    print(
        f"[gpu-wheels] {dest}: {len(found)} wheels for CPython {python_version}, "
        f"{size / MiB:.1f} MiB (limit {WHEELHOUSE_LIMIT / MiB:.0f}); with the working tree "
        f"({tree / MiB:.1f} MiB) {(size + tree) / MiB:.1f} MiB of the "
        f"{CARRY_LIMIT / MiB:.0f} MiB a check carries"
    )
    if size <= WHEELHOUSE_LIMIT and size + tree <= CARRY_LIMIT:
        return 0
    print("[gpu-wheels] over budget: a GPU run could not carry this", file=sys.stderr)
    return 1


# -- there: install ---------------------------------------------------------------------------
def read_manifest(wheelhouse: Path) -> dict[str, str]:
    """``{name: version}`` from the wheelhouse's manifest."""
    found = {}
    for line in (wheelhouse / MANIFEST).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            found[name] = version
    return found


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def needed(versions: dict[str, str], importable=importable) -> list[str]:
    """Pins to install: the always-installed wheels, and the others whose module is missing."""
    return [f"{w.name}=={versions[w.name]}" for w in WHEELS if w.always or not importable(w.module)]


def install_command(wheelhouse: Path, target: Path, requirements: list[str]) -> list[str]:
    """pip install of ``requirements`` from ``wheelhouse`` only into ``target``: no index, no
    dependency resolution (the interpreter's torch is never considered), no source builds."""
    return [
        sys.executable,
        "-m",
        "pip",
        "--disable-pip-version-check",
        "install",
        "--no-index",
        "--find-links",
        str(wheelhouse),
        "--no-deps",
        "--only-binary=:all:",
        "--no-compile",
        "--no-cache-dir",
        "--quiet",
        "--target",
        str(target),
        *requirements,
    ]


def install(wheelhouse: Path, target: Path) -> int:
    """Install what this interpreter lacks into ``target``; 2 when it cannot start."""
    if not importable("torch"):
        print(
            f"[gpu-env] {sys.executable} has no torch: this path runs the check on the "
            "interpreter's own torch and installs none",
            file=sys.stderr,
        )
        return 2
    if not (wheelhouse / MANIFEST).is_file():
        print(
            f"[gpu-env] no wheelhouse at {wheelhouse}: run `make gpu-wheels` on a machine "
            "with network and bring that folder along",
            file=sys.stderr,
        )
        return 2
    versions = read_manifest(wheelhouse)
    requirements = needed(versions)
    kept = [w.name for w in WHEELS if f"{w.name}=={versions[w.name]}" not in requirements]
    print(
        f"[gpu-env] installing {', '.join(requirements)} from {wheelhouse} into {target}"
        + (f"; the interpreter's own {', '.join(kept)}" if kept else ""),
        flush=True,
    )
    return subprocess.run(
        install_command(wheelhouse, target, requirements), env=pip_env()
    ).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    down = sub.add_parser("download", help="here, with network: fill the wheelhouse")
    down.add_argument("--dest", type=Path, required=True)
    down.add_argument("--python-version", default="3.12", help="the GPU machine's (3.12)")
    inst = sub.add_parser("install", help="there, offline: install into a directory")
    inst.add_argument("--wheelhouse", type=Path, required=True)
    inst.add_argument("--target", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "download":
        return download(args.dest, args.python_version)
    return install(args.wheelhouse, args.target)


if __name__ == "__main__":
    sys.exit(main())
