"""``make gpu-check`` (tools/gpu_check.py): the smoke run on the CPU reports every section,
writes its report outside docs/ and imports nothing the GPU machine and the wheelhouse lack; the
resume comparison catches any difference; the planner sizes the GPU model; one failing section
does not stop the others; the wheelhouse installs offline, from itself only, and fits the carry
(``make gpu-env-check`` runs the whole offline path in emulated GPU-machine Pythons)."""

import importlib.metadata
import math
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from gpu_check import async_save, moe_experts, syncs, wheelhouse
from gpu_check.bare_python import GPU_MACHINE, distributions
from gpu_check.context import CheckContext
from gpu_check.flash import forced_flash_error
from gpu_check.report import FAILED, HOW_TO_RUN, OK, SectionResult, render
from gpu_check.resume import Continuation, compare_continuation
from gpu_check.run import SECTIONS as SECTION_MODULES
from gpu_check.run import run_all
from gpu_check.sizing import choose, largest

from megatronish.config.compose import load_config
from megatronish.config.validate import config_errors
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
SECTIONS = [
    "throughput",
    "flash",
    "memory",
    "resume",
    "recompute",
    "syncs",
    "moe_experts",
    "async_save",
    "documents",
    "ring_kernels",
    "compiled",
]
# Imported by torch when installed, done without otherwise (torch.utils._import_utils).
TORCH_USES_IF_PRESENT = {"dill"}


def test_smoke_run_reports_every_section(tmp_path):
    docs = ROOT / "docs" / "gpu.md"
    before = docs.read_bytes() if docs.exists() else None
    out = tmp_path / "report" / "gpu.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            str(ROOT / "tools" / "gpu_check.py"),
            "--smoke",
            "--out",
            str(out),
            "--budget-s",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + _without_importtime(r.stderr)[-3000:]
    beyond = _imported_distributions(r.stderr) - _gpu_machine_and_wheelhouse()
    assert beyond - TORCH_USES_IF_PRESENT == set()  # e.g. wandb or datasets imported eagerly
    for name in SECTIONS:
        assert f"[{name}] ok in" in r.stdout or f"[{name}] not applicable in" in r.stdout, name
    assert "[flash] not applicable: flash attention is a CUDA kernel" in r.stdout
    assert "bit-identical" in r.stdout and "11 of 11 sections passed" in r.stdout
    report = out.read_text()
    assert report.startswith("# megatronish on one GPU (smoke run")
    for i in range(1, len(SECTIONS) + 1):
        assert f"\n## {i}. " in report
    assert "| megatronish |" in report and "| reference |" in report  # throughput rows
    assert "| peak |" in report and "| full (uniform, 1 layer) |" in report
    assert re.search(r"\| dense \| n/a \| \d+ \|", report)  # syncs: the CPU harness's count
    assert "| 64 | 4 | " in report  # moe_experts: 256 routed rows over 64 experts
    assert "| asynchronous save |" in report
    assert "| megatronish compiled |" in report and "| reference compiled |" in report
    assert (docs.read_bytes() if docs.exists() else None) == before  # docs/gpu.md untouched
    assert report.endswith(HOW_TO_RUN + "\n")


def test_docs_gpu_md_says_how_to_run_it_as_the_generated_page_does():
    assert (ROOT / "docs" / "gpu.md").read_text().endswith(HOW_TO_RUN + "\n")


def _without_importtime(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


def _imported_distributions(importtime: str) -> set[str]:
    """Installed distributions (canonical names) whose modules a ``-X importtime`` run
    imported; the standard library, the source tree and tools/ belong to none."""
    owners = importlib.metadata.packages_distributions()
    tops = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in importtime.splitlines()
        if line.startswith("import time:")
    }
    return {wheelhouse.canonical(d) for top in tops for d in owners.get(top, [])} - {"megatronish"}


def _gpu_machine_and_wheelhouse() -> set[str]:
    return set(distributions(GPU_MACHINE)) | {
        wheelhouse.canonical(w.name) for w in wheelhouse.WHEELS
    }


def test_a_check_importing_wandb_would_be_caught():
    imports = (
        "import time: 1 | 2 | torch\nimport time: 1 | 2 |   wandb.sdk\nimport time: 1 | 2 | os"
    )
    assert _imported_distributions(imports) - _gpu_machine_and_wheelhouse() == {"wandb"}


def _continuation() -> Continuation:
    g = torch.Generator().manual_seed(0)
    params = {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(5, generator=g)}
    return Continuation([2.5, 2.25, float("nan")], params)


def test_identical_continuations_compare_equal():
    a, b = _continuation(), _continuation()
    assert compare_continuation(a, b) == []  # nan losses on both sides count as equal


def test_one_ulp_in_a_loss_or_a_parameter_is_a_difference():
    a, b = _continuation(), _continuation()
    b.losses[1] = math.nextafter(b.losses[1], 3.0)
    assert compare_continuation(a, b) == [f"loss of step +2: 2.25 vs {b.losses[1]!r}"]
    b = _continuation()
    b.params["b.weight"][3] = torch.nextafter(b.params["b.weight"][3], torch.tensor(9.0))
    (problem,) = compare_continuation(a, b)
    assert problem.startswith("b.weight: max |difference|")
    b = _continuation()
    b.params["a.weight"] = b.params["a.weight"].double()
    assert "a.weight: torch.float32[4, 3] vs torch.float64[4, 3]" in compare_continuation(a, b)
    del b.params["a.weight"]
    b.losses.pop()
    problems = compare_continuation(a, b)
    assert "3 vs 2 steps" in problems and any("names differ" in p for p in problems)


def test_largest_finds_the_last_fitting_size():
    assert largest(24, lambda n: n <= 15) == 15
    assert largest(24, lambda n: True) == 24
    assert largest(24, lambda n: False) == 0


@pytest.mark.parametrize("gib", [139, 79])
def test_the_full_model_fits_an_h100_or_h200_beside_the_reference(gib):
    ctx = CheckContext(torch.device("cpu"), False, 420.0, precision="bf16")
    size = choose(ctx, gib * GiB, int(1.5 * GiB))
    assert (size.layers, size.alone_layers, size.full_layers, size.micro_batch_size) == (
        24,
    ) * 3 + (4,)
    assert size.plan.layout.precision == "bf16" and size.plan.spec.hidden_size == 2048
    assert size.overrides == [
        "model.num_layers=24",
        "trainer.micro_batch_size=4",
        "trainer.global_batch_size=4",
    ]


def test_a_smaller_gpu_gets_fewer_layers_and_a_tiny_one_none():
    ctx = CheckContext(torch.device("cpu"), False, 420.0, precision="bf16")
    runtime = int(1.5 * GiB)
    size = choose(ctx, 39 * GiB, runtime)
    assert 0 < size.layers < size.alone_layers <= 24  # the reference takes room
    assert size.side_by_side_bytes <= 39 * GiB
    assert choose(ctx, 45 * GiB, runtime).layers > size.layers
    with pytest.raises(RuntimeError, match="not even one layer"):
        choose(ctx, 3 * GiB, runtime)


def test_a_failing_section_fails_alone():
    def broken(ctx, out):
        out.note("starting")
        raise ValueError("boom\nsecond line")

    def fine(ctx, out):
        out.note("done")

    sections = [
        types.SimpleNamespace(NAME=n, TITLE=n.title(), run=f)
        for n, f in (("bad", broken), ("good", fine))
    ]
    bad, good = run_all(CheckContext(torch.device("cpu"), True, 60.0), sections)
    assert (bad.status, good.status) == (FAILED, OK)
    assert bad.lines[-1] == "FAILED: ValueError: boom" and not bad.passed
    (late,) = run_all(CheckContext(torch.device("cpu"), True, 0.0), sections[1:])
    assert late.status == "skipped" and not late.passed
    text = render([bad, good, late], [("device", "cpu")], "1 of 3 passed", smoke=True)
    assert "| Bad | FAILED |" in text and "## 2. Good" in text  # numbered as run
    assert [m.NAME for m in SECTION_MODULES] == SECTIONS


def test_forced_flash_reports_the_error_and_torchs_reasons():
    def unsupported():
        import warnings

        warnings.warn("Flash attention kernel not used because: reason one", stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.\ndetails")

    assert forced_flash_error(lambda: None) == (None, [])
    error, reasons = forced_flash_error(unsupported)
    assert error == "No available kernel. Aborting execution."
    assert reasons == ["Flash attention kernel not used because: reason one"]


def test_section_result_tables_render_as_markdown(capsys):
    out = SectionResult("x", "X")
    out.table("T", ["a", "b"], [["1", "2"]])
    assert "| a | b |\n|---|---|\n| 1 | 2 |" in out.tables[0].markdown()
    assert "[x] T" in capsys.readouterr().out


def test_the_new_sections_gpu_sizes_are_valid_configs_of_the_stated_size():
    """The GPU-only shapes of sections 6-8 (the smoke run takes toy ones) compose and pass the
    config rules (but the data's: the check trains on synthetic batches); the save section's
    model holds about 0.9 GiB of checkpointed state."""
    ctx = CheckContext(torch.device("cpu"), False, 420.0, precision="bf16")
    moe = ctx.config([*ctx.small(), *syncs.MOE, *syncs.FULL_MOE_FFN])
    assert config_errors(moe, 1, data=False) == []
    assert (moe.model.num_layers, moe.model.moe.num_experts, moe.model.moe.ffn_hidden_size) == (
        2,
        8,
        1024,
    )
    save = ctx.config(async_save.FULL)
    assert config_errors(save, 1, data=False) == []
    params = make_plan(spec_of(save), layout_from_config(save, 1)).parameters
    assert 0.75 * GiB < 12 * params < 1.25 * GiB  # fp32 main params and two Adam moments
    for experts in moe_experts.EXPERTS:
        layer = load_config([*moe_experts.FULL, f"model.moe.num_experts={experts}"]).model
        assert (layer.hidden_size, layer.moe.ffn_hidden_size, layer.moe.top_k) == (2048, 1024, 8)
        assert layer.moe.num_experts == experts and layer.seq_length == 4096


# -- the wheelhouse (tools/gpu_check/wheelhouse.py) and the offline path -----------------------
def test_the_wheelhouse_holds_what_hydra_needs_beyond_the_gpu_machine():
    there, needed = set(distributions(GPU_MACHINE)), set(distributions(["hydra-core"]))
    always = {wheelhouse.canonical(w.name) for w in wheelhouse.WHEELS if w.always}
    in_case = {wheelhouse.canonical(w.name) for w in wheelhouse.WHEELS if not w.always}
    assert needed - there == always == {"hydra-core", "omegaconf", "antlr4-python3-runtime"}
    assert in_case <= needed & there and {"wandb", "datasets"}.isdisjoint(there)


def test_downloads_are_wheels_for_the_gpu_machines_python_at_the_venvs_versions():
    versions = wheelhouse.pins()
    assert versions["hydra-core"] == importlib.metadata.version("hydra-core")
    (published, built) = wheelhouse.download_commands(Path("wh"), "3.12", versions)
    assert published[4:6] == ["download", "--no-deps"] and "--only-binary=:all:" in published
    for flag, value in [
        ("--python-version", "3.12"),
        ("--abi", "cp312"),
        ("--implementation", "cp"),
        ("--platform", "manylinux_2_28_x86_64"),
        ("-d", "wh"),
    ]:
        assert published[published.index(flag) + 1] == value
    assert f"PyYAML=={versions['PyYAML']}" in published
    antlr = f"antlr4-python3-runtime=={versions['antlr4-python3-runtime']}"
    assert built[4:] == ["wheel", "--no-deps", "-w", "wh", antlr]  # no wheel on PyPI: built here


def test_the_install_is_offline_and_installs_only_what_the_interpreter_lacks(monkeypatch):
    versions = {w.name: "1.0" for w in wheelhouse.WHEELS}
    lacks_yaml = wheelhouse.needed(versions, importable=lambda m: m != "yaml")
    assert lacks_yaml == [
        "hydra-core==1.0",
        "omegaconf==1.0",
        "antlr4-python3-runtime==1.0",
        "PyYAML==1.0",
    ]
    command = wheelhouse.install_command(Path("wh"), Path("site"), lacks_yaml)
    assert command[:3] == [sys.executable, "-m", "pip"] and command[-4:] == lacks_yaml
    for flag, value in [("--find-links", "wh"), ("--target", "site")]:
        assert command[command.index(flag) + 1] == value
    assert {"--no-index", "--no-deps", "--only-binary=:all:"} <= set(command)
    assert not any("index-url" in c or "://" in c for c in command)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "http://127.0.0.1:9/simple")
    env = wheelhouse.pip_env()
    assert [k for k in env if k.startswith("PIP_")] == ["PIP_CONFIG_FILE"]
    assert env["PIP_CONFIG_FILE"] == os.devnull  # pip reads no configuration file


def test_the_install_refuses_without_torch_or_a_wheelhouse(tmp_path, monkeypatch, capsys):
    argv = ["install", "--wheelhouse", str(tmp_path), "--target", str(tmp_path / "t")]
    assert wheelhouse.main(argv) == 2
    assert "no wheelhouse at" in capsys.readouterr().err
    monkeypatch.setattr(wheelhouse, "importable", lambda module: module != "torch")
    assert wheelhouse.install(tmp_path, tmp_path / "t") == 2
    assert "has no torch" in capsys.readouterr().err


def _wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """A minimal pure-Python wheel of one module."""
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
    return path


def test_the_install_succeeds_from_the_wheelhouse_only(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(wheelhouse, "WHEELS", (wheelhouse.Wheel("demo-pkg", "demo_pkg", True),))
    house = tmp_path / "wheelhouse"
    wheel = _wheel(house, "demo-pkg", "1.0", "demo_pkg")
    (house / wheelhouse.MANIFEST).write_text("demo-pkg==1.0\n")
    # pip's configuration offers the same wheel elsewhere and an index: both must be ignored.
    _wheel(tmp_path / "elsewhere", "demo-pkg", "1.0", "demo_pkg")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    assert wheelhouse.install(house, tmp_path / "site") == 0
    assert (tmp_path / "site" / "demo_pkg" / "__init__.py").is_file()
    wheel.unlink()
    assert wheelhouse.install(house, tmp_path / "site2") != 0
    output = capfd.readouterr()
    assert "No matching distribution found for demo-pkg==1.0" in output.err
    assert "Looking in indexes" not in output.out + output.err


def test_the_tree_and_the_wheelhouse_fit_what_a_gpu_run_carries():
    assert wheelhouse.tree_bytes() + wheelhouse.WHEELHOUSE_LIMIT <= wheelhouse.CARRY_LIMIT


def _make_gpu_check(tmp_path, *overrides, python_from_env=None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS", "MFLAGS")}
    if python_from_env:
        env["PYTHON"] = python_from_env
    done = subprocess.run(
        [
            "make",
            "-n",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "gpu-check",
            "ARGS=--smoke",
            *overrides,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return done.stdout.splitlines()[-1]


def test_make_gpu_check_takes_the_offline_path_when_python_is_given_or_no_venv_is_there(tmp_path):
    venv, wheels, none = tmp_path / "venv", tmp_path / "wheels", tmp_path / "none"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    wheels.mkdir()
    (wheels / wheelhouse.MANIFEST).touch()
    in_venv = f"{venv}/bin/python tools/gpu_check.py --smoke"
    offline = f"PYTHON=python3 GPU_WHEELS={wheels} bash scripts/gpu_env.sh --smoke"
    venv_and_wheels = (tmp_path, f"VENV={venv}", f"GPU_WHEELS={wheels}")
    assert _make_gpu_check(*venv_and_wheels) == in_venv
    assert _make_gpu_check(*venv_and_wheels, "PYTHON=python3") == offline
    assert _make_gpu_check(*venv_and_wheels, python_from_env="python3") == offline
    assert _make_gpu_check(tmp_path, f"VENV={none}", f"GPU_WHEELS={wheels}") == offline
    # Neither a .venv nor a wheelhouse: as before, install .venv and run there.
    no_wheels = _make_gpu_check(tmp_path, f"VENV={none}", f"GPU_WHEELS={none}")
    assert no_wheels == f"{none}/bin/python tools/gpu_check.py --smoke"
