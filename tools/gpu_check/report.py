"""Section results, their progress lines, and the markdown report (``docs/gpu.md``)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

OK, FAILED, NOT_APPLICABLE, SKIPPED = "ok", "FAILED", "not applicable", "skipped"
NOT_RUN = "not run"
PENDING = (
    "the run had not reached it when this report was written (the report is rewritten after "
    "each section, so a run stopped at its time limit still leaves what it measured)."
)
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

Carrying it to an offline GPU machine and the report back: `.gpu-wheels/` is ignored by git, so a
copy of the work tree that takes tracked and unignored files only leaves it behind: name it among
the paths the run carries. The report is written into the tree (`docs/gpu.md`) unless `--out`
says otherwise: where only files under an output folder come back (`$OUT`), run
`PYTHON=python3 make gpu-check ARGS="--out $OUT/gpu.md"` and copy the returned file over
`docs/gpu.md` here.

`make gpu-env-check` (about 25 s of CPU time, on a machine with network for one wheel) runs that
offline path, `make gpu-check` included, in Pythons that see only the GPU machine's packages
(`.venv`'s torch and the rest, no Hydra, wandb or datasets), without network
(`tools/gpu_check/bare_python.py`).

### Time

The budget (`--budget-s`, default 540 s on a GPU, for a machine that gives a run about ten
minutes with start-up) is a deadline for the whole run. Each section needs seconds no timing
share bounds: building its models, warm-up steps and, in two of them, `torch.compile`'s first
compiles (inductor: minutes, not seconds). `FIXED_S` in `tools/gpu_check/run.py` estimates them
(below; not yet measured on a GPU: a GPU report's seconds column replaces the guesses). A section
starts only while its fixed seconds are left, else it is skipped with the rerun that takes it
(`--sections NAME`); the timed repeats share what the selected sections' fixed seconds leave of
the budget, in proportion to their shares, never taking a later section's fixed seconds. The
fixed estimates add up to about 13 minutes (8 of them compiles), more than one run has: a run of
all sections reports the first ten (the timed ones at their minimum of two repeats) and skips
`compiled`; `--sections documents,compiled` (about
8 minutes) or `--sections compiled` in a second run measures the rest. The report is rewritten
after every section (whole, by a rename), and a SIGTERM (a time limit's `timeout`) ends the run
after writing it: a run stopped at its limit still leaves what it measured, the sections not
reached marked "not run".

| section | smoke run, CPU (s) | GPU: fixed estimate (s) | what bounds it on a GPU |
|---|---|---|---|
| throughput | 1.6 | 45 | building the sized model and the reference; timed repeats: its share |
| flash | 0.4 | 20 | one two-layer model, the profiler's start-up |
| memory | 0.6 | 30 | the sized model alone, 3 steps |
| resume | 0.7 | 30 | 9 steps in deterministic mode, a save and a load |
| recompute | 0.5 | 60 | the sized model per policy; timed repeats: its share |
| syncs | 0.8 | 30 | dense and MoE two-layer models, 6 steps each |
| moe_experts | 0.4 | 20 | 2-3 MoE layers; timed repeats: its share |
| async_save | 0.3 | 45 | about 0.9 GiB written three times |
| documents | 0.3 | 180 | FlexAttention and its block mask compiled twice (inductor) |
| ring_kernels | 0.2 | 15 | three blocks' forward and backward |
| compiled | 5.3 | 300 | the block compiled three times (megatronish, fp8, reference) |

The smoke column is one `--smoke` run on the 2-core CPU machine (torch 2.13, fp32, one thread):
11 s for the sections, 15 s with start-up; the same run took 27 s for the sections while the
machine was loaded (load average 10)."""


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
    number: int = 0  # its place in the full run (0: its place in the report)
    stopped: bool = False  # a SIGTERM or Ctrl-C ended the run in this section

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
    results: list[SectionResult],
    facts: list[tuple[str, str]],
    summary: str,
    smoke: bool,
    pending: list[tuple[int, str]] = (),
) -> str:
    """The markdown report; ``pending``: (number, title) of the sections still to run."""
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
        *[f"| {title} | {NOT_RUN} | |" for _, title in pending],
    ]
    for i, r in enumerate(results, 1):
        lines += ["", f"## {r.number or i}. {r.title}", "", f"Status: **{r.status}**."]
        lines += ["", *[f"- {line}" for line in r.lines]] if r.lines else []
        for t in r.tables:
            lines += ["", t.markdown()]
    for n, title in pending:
        lines += ["", f"## {n}. {title}", "", f"Status: **{NOT_RUN}**: {PENDING}"]
    lines += ["", HOW_TO_RUN]
    return "\n".join(lines) + "\n"


def write_report(path: Path, text: str) -> None:
    """``text`` to ``path`` whole or not at all (a run killed while writing leaves the last
    complete report)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
