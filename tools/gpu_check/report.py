"""Section results, their progress lines, and the markdown report (``docs/gpu.md``)."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

OK, FAILED, NOT_APPLICABLE, SKIPPED = "ok", "FAILED", "not applicable", "skipped"
# The page's last part, the same in docs/gpu.md's outline (a test keeps the two equal).
HOW_TO_RUN = """## Running it

With the project's `.venv` (`make install`): `make gpu-check` on a machine with one NVIDIA GPU.

On a GPU machine with its own Python and torch but no `.venv`, no Hydra and no network: first, on a
machine with network, `make gpu-wheels` downloads the wheels it lacks (hydra-core, omegaconf,
antlr4-python3-runtime; PyYAML and packaging in case; CPython 3.12, manylinux x86_64, the
`.venv`'s versions, about 1.3 MiB) into `.gpu-wheels/` (ignored by git) and prints its size
against the 64 MiB a run carries: bring that folder along with the tree. There,
`PYTHON=python3 make gpu-check` (`scripts/gpu_env.sh`; plain `make gpu-check` too where there is
a wheelhouse and no `.venv`) installs them with `pip install --no-index --no-deps
--only-binary=:all: --target` a temporary directory (PyYAML and packaging only when that Python
cannot import them, so they never shadow its own), with no pip configuration read, puts that
directory and the source tree on `PYTHONPATH` and runs `tools/gpu_check.py` on that Python's own
torch. It never installs torch and never reaches for the network. A `--target` directory rather
than a venv with `--system-site-packages`: it needs only pip (no `venv` or `ensurepip` module),
works on an externally managed (PEP 668) system Python too, leaves the interpreter's packages
untouched, and is deleted after the run.

`make gpu-env-check` (about 25 s of CPU time, on a machine with network for one wheel) runs that
offline path, `make gpu-check` included, in Pythons that see only the GPU machine's packages
(`.venv`'s torch and the rest, no Hydra, wandb or datasets), without network
(`tools/gpu_check/bare_python.py`)."""


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |"]
        lines.append("|" + "---|" * len(self.columns))
        lines += [
            "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in self.rows
        ]
        return "\n".join(lines)


@dataclass
class SectionResult:
    """What a section found; every line is printed as it is added."""

    name: str
    title: str
    status: str = OK
    lines: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    seconds: float = 0.0

    def note(self, text: str) -> None:
        self.lines.append(text)
        print(f"[{self.name}] {text}", flush=True)

    def fail(self, why: str) -> None:
        self.status = FAILED
        self.note(f"FAILED: {why}")

    def not_applicable(self, why: str) -> None:
        if self.status == OK:
            self.status = NOT_APPLICABLE
        self.note(f"not applicable: {why}")

    def table(self, title: str, columns: list[str], rows: list[list[str]]) -> None:
        self.tables.append(Table(title, columns, rows))
        print(f"[{self.name}] {title}", flush=True)
        width = [max(len(str(c)) for c in col) for col in zip(columns, *rows)]
        for row in [columns, *rows]:
            print("    " + "  ".join(str(c).ljust(w) for c, w in zip(row, width)), flush=True)

    @property
    def passed(self) -> bool:
        return self.status in (OK, NOT_APPLICABLE)


def git_commit(root: Path) -> str:
    """The checkout's commit (``+ local changes`` when the tree differs), or ``unknown``."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip()

    try:
        sha, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + (" + local changes" if dirty else "")


def config_libraries() -> str:
    """Hydra's and omegaconf's versions and the directory they were imported from (on the GPU
    machine: the temporary one the wheelhouse was installed into)."""
    import hydra
    import omegaconf

    where = Path(hydra.__file__).resolve().parents[1]
    return f"hydra-core {hydra.__version__}, omegaconf {omegaconf.__version__} from {where}"


def environment(device: torch.device, root: Path) -> list[tuple[str, str]]:
    """What the numbers were measured on."""
    facts = [("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts += [
            (
                "device",
                f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                f"{props.multi_processor_count} SMs",
            ),
            ("CUDA", f"{torch.version.cuda} (cuDNN {torch.backends.cudnn.version()})"),
        ]
    else:
        facts.append(
            (
                "device",
                f"CPU ({platform.processor() or platform.machine()}), "
                f"{torch.get_num_threads()} threads",
            )
        )
    facts += [
        ("torch", torch.__version__),
        ("python", f"{sys.version.split()[0]} ({sys.executable})"),
        ("configuration", config_libraries()),
        ("megatronish", git_commit(root)),
    ]
    return facts


def render(
    results: list[SectionResult], facts: list[tuple[str, str]], summary: str, smoke: bool
) -> str:
    """The markdown report."""
    title = "# megatronish on one GPU"
    lines = [title + (" (smoke run: toy sizes on the CPU, not a measurement)" if smoke else "")]
    lines += [
        "",
        "Written by `make gpu-check` (`tools/gpu_check.py`); run it again to refresh. "
        "Each section is independent: a failure is reported and the others still run.",
        "",
        *[f"- {k}: {v}" for k, v in facts],
        f"- {summary}",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
        *[f"| {r.title} | {r.status} | {r.seconds:.0f} |" for r in results],
    ]
    for i, r in enumerate(results, 1):
        lines += ["", f"## {i}. {r.title}", "", f"Status: **{r.status}**."]
        lines += ["", *[f"- {line}" for line in r.lines]] if r.lines else []
        for t in r.tables:
            lines += ["", t.markdown()]
    lines += ["", HOW_TO_RUN]
    return "\n".join(lines) + "\n"
