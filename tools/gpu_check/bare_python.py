"""``make gpu-env-check``: ``make gpu-check``'s offline path (``PYTHON=... make gpu-check``) run
here, in Pythons that see only what the GPU machine has.

Each is a fresh venv of .venv's base interpreter (no pip, no site-packages of its own) whose one
``.pth`` file names a directory of links to the top-level files of the GPU machine's
distributions (``/work/shared/PLATFORM.md``: torch, numpy, safetensors, sentencepiece,
transformers, tqdm, pytest, pyarrow, pip; triton has no CPU build) and of everything they
require, all taken from .venv. Hydra, omegaconf, antlr4, wandb and datasets are not among them;
each machine's imports are probed before its run. The machines:

1. as described: PyYAML and packaging present (transformers and pytest require them), so the
   wheelhouse of ``make gpu-wheels`` (CPython 3.12 wheels) installs its three pure-Python ones;
2. without PyYAML and packaging too: the wheelhouse installs them as well, from a copy with a
   PyYAML wheel for this interpreter added (the one download, before any run);
3. as 1 with a wheelhouse that lacks hydra-core: the install must fail without looking elsewhere.

Every run is ``make gpu-check PYTHON=<that venv's python> ARGS="--smoke ..."`` inside a network
namespace with no interface (``unshare -n``, where the kernel lets us make one). A run passes when
every section does and the report says hydra came from the run's temporary directory.

Usage (``make gpu-env-check``): ``cd tools && python -m gpu_check.bare_python --wheelhouse DIR``
(a module of this package, so that ``gpu_check.wheelhouse`` imports).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement

from gpu_check.wheelhouse import MANIFEST, ROOT, canonical

GPU_MACHINE = (
    "torch",
    "numpy",
    "safetensors",
    "sentencepiece",
    "transformers",
    "tqdm",
    "pytest",
    "pyarrow",
    "pip",
    "triton",
)
NOT_THERE = ("hydra", "omegaconf", "antlr4", "wandb", "datasets")
WITHOUT_YAML = ("pyyaml", "packaging")


def distributions(roots, leave_out=()) -> dict[str, importlib.metadata.Distribution]:
    """The .venv distributions ``roots`` name and all they require (no extras), but
    ``leave_out``; a root that .venv lacks (triton) is absent here too."""
    found, todo = {}, list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in found or name in leave_out:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def link_view(dists, view: Path) -> None:
    """Links in ``view`` to every top-level file or folder of ``dists``."""
    view.mkdir(parents=True)
    for dist in dists.values():
        site = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for top in tops:
            if not (view / top).exists() and (site / top).exists():
                (view / top).symlink_to(site / top)


def machine(where: Path, leave_out=()) -> Path:
    """A venv that sees only the GPU machine's packages (less ``leave_out``); its python."""
    link_view(distributions(GPU_MACHINE, leave_out), where / "site")
    subprocess.run(
        [sys._base_executable, "-m", "venv", "--without-pip", str(where / "venv")], check=True
    )
    python = where / "venv" / "bin" / "python"
    where_purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run(
        [python, "-c", where_purelib], capture_output=True, text=True, check=True
    ).stdout.strip()
    (Path(purelib) / "gpu_machine.pth").write_text(f"{where / 'site'}\n")
    return python


def importable(python: Path, modules) -> list[str]:
    probe = f"import importlib.util as u; print(*[m for m in {list(modules)!r} if u.find_spec(m)])"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True)
    return done.stdout.split()


def offline() -> list[str]:
    """A command prefix without network, or [] where no namespace can be made (not root)."""
    ok = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"]).returncode == 0
    return ["unshare", "-n"] if ok else []


def gpu_check(python: Path, wheels: Path, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"  # as the suite's smoke run; the machine may be shared
    args = f"--smoke --budget-s 120 --out {out}"
    command = [
        *offline(),
        "make",
        "-C",
        str(ROOT),
        "gpu-check",
        f"PYTHON={python}",
        f"GPU_WHEELS={wheels}",
        f"ARGS={args}",
    ]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def run_case(title: str, python: Path, wheels: Path, out: Path, expect_ok: bool) -> list[str]:
    """Run one machine's check; its problems (empty: as expected)."""
    t0 = time.monotonic()
    done = gpu_check(python, wheels, out)
    text = done.stdout + done.stderr
    install = next((line for line in text.splitlines() if line.startswith("[gpu-env]")), "")
    print(f"\n== {title}: exit {done.returncode} in {time.monotonic() - t0:.1f} s\n{install}")
    problems = []
    if "Looking in indexes" in text:
        problems.append("pip looked at an index")
    if not expect_ok:
        if done.returncode == 0 or "No matching distribution found for hydra-core" not in text:
            problems.append("the install did not fail on the missing wheel")
        return problems
    summary = re.search(r"\d+ of \d+ sections passed.*", done.stdout)
    print(summary.group(0) if summary else text[-3000:])
    if done.returncode != 0:
        problems.append(f"exit {done.returncode}")
    report = out.read_text() if out.exists() else ""
    site = re.search(r"- configuration: (.*)", report)
    print(site.group(0) if site else "no configuration line in the report")
    if not site or "megatronish-gpu-site." not in site.group(1):
        problems.append("hydra did not come from the wheelhouse's temporary directory")
    return problems


def copy_wheelhouse(wheels: Path, dest: Path, leave_out: str | None = None) -> Path:
    """A copy of ``wheels`` without ``leave_out``'s wheel (its manifest still names it)."""
    dest.mkdir()
    for f in wheels.iterdir():
        if leave_out is None or canonical(f.name.split("-")[0]) != canonical(leave_out):
            shutil.copy2(f, dest / f.name)
    return dest


def add_local_pyyaml(dest: Path) -> Path:
    """``dest`` with a PyYAML wheel (the .venv's version) for this interpreter added."""
    version = importlib.metadata.version("PyYAML")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(dest),
            f"PyYAML=={version}",
        ],
        check=True,
    )
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheelhouse", type=Path, default=ROOT / ".gpu-wheels")
    wheels = ap.parse_args(argv).wheelhouse.resolve()
    if not (wheels / MANIFEST).is_file():
        print(f"no wheelhouse at {wheels}: run `make gpu-wheels` first", file=sys.stderr)
        return 2
    print("network:", "none (unshare -n)" if offline() else "reachable: unshare -n is not allowed")
    problems = {}
    with tempfile.TemporaryDirectory(prefix="gpu_env_check_") as tmp:
        tmp = Path(tmp)
        with_yaml = add_local_pyyaml(copy_wheelhouse(wheels, tmp / "wheels-local-yaml"))
        no_hydra = copy_wheelhouse(wheels, tmp / "wheels-no-hydra", leave_out="hydra-core")
        cases = [
            ("1. the GPU machine as described", (), wheels, True),
            ("2. without PyYAML and packaging", WITHOUT_YAML, with_yaml, True),
            ("3. a wheelhouse without hydra-core", (), no_hydra, False),
        ]
        for i, (title, leave_out, house, expect_ok) in enumerate(cases, 1):
            python = machine(tmp / f"machine{i}", leave_out)
            seen = importable(python, ("torch", "yaml", "packaging", *NOT_THERE))
            print(f"\n{title}: importable before the install: {' '.join(seen)}")
            wrong = [
                m for m in (*NOT_THERE, *(("yaml", "packaging") if leave_out else ())) if m in seen
            ] + ([] if "torch" in seen else ["torch missing"])
            problems[title] = (
                [f"wrong machine: {wrong}"]
                if wrong
                else run_case(title, python, house, tmp / f"report{i}" / "gpu.md", expect_ok)
            )
    for title, found in problems.items():
        print(f"{title}: {'ok' if not found else 'FAILED: ' + '; '.join(found)}")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
