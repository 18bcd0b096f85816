"""The documented commands (``tools/docs_check.py``, ``make docs-check``), without running any:
extraction from markdown, every command of README.md and docs/*.md classified (a skip with its
reason), every documented training launch's overrides composed and validated in this process
(a mistyped key in a doc fails here), and every ``python tools/X.py`` and ``python -m
megatronish.X`` the docs name exists. ``make docs-check`` runs them."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from docs_check.extract import (
    Command,
    all_commands,
    doc_paths,
    extract_commands,
    fenced_blocks,
    is_command_block,
    module_exists,
    named_entry_points,
    split_comment,
)
from docs_check.identity import (
    identity_problem,
    resolved_config,
    without_missing_tokenizer,
)
from docs_check.rules import (
    CLASSES,
    RULES,
    Check,
    check_script,
    classify,
    dry_launch,
    expected_codes,
    is_sweep,
    job_overrides,
)
from docs_check.sandbox import STAMP, link_venv
from omegaconf import OmegaConf

from megatronish.checkpoint.run_identity import ConfigChanged, RunComplete, check_same_run
from megatronish.config.compose import load_config
from megatronish.config.validate import config_errors
from megatronish.testing.cli import assert_one_line, run_main

ROOT = Path(__file__).resolve().parents[2]
FENCE = "```"


def md(*blocks: tuple[str, str]) -> str:
    """A markdown text of ``(tag, body)`` fenced blocks with prose between them."""
    return "\n".join(f"Some prose.\n\n{FENCE}{tag}\n{body}\n{FENCE}\n" for tag, body in blocks)


def texts(markdown: str) -> list[str]:
    return [c.text for c in extract_commands(markdown, "x.md")]


# -- extraction ---------------------------------------------------------------------------------


def test_continuations_are_joined_and_trailing_comments_dropped():
    got = extract_commands(
        md(("bash", "python tools/a.py --x 1 \\\n    --y 2   # does a thing\nmake lint")), "x.md"
    )
    assert [c.text for c in got] == ["python tools/a.py --x 1 --y 2", "make lint"]
    assert got[0].comment == "does a thing" and got[0].line == 4 and got[1].line == 6


@pytest.mark.parametrize(
    "line, code, comment",
    [
        ("python -m x prompt='a # b' # c", "python -m x prompt='a # b'", "c"),
        ('python -m x prompt="# b"', 'python -m x prompt="# b"', ""),
        ("python -m x a#b", "python -m x a#b", ""),
        ("# only a comment", "", "only a comment"),
        ("python -m x prompt=\\#", "python -m x prompt=\\#", ""),
    ],
)
def test_comments_are_found_outside_quotes_only(line, code, comment):
    assert split_comment(line) == (code, comment)


def test_a_comment_line_above_a_command_is_its_comment():
    got = extract_commands(md(("bash", "# data parallel\ntorchrun -m x\n\ntorchrun -m y")), "x.md")
    assert [(c.text, c.comment) for c in got] == [
        ("torchrun -m x", "data parallel"),
        ("torchrun -m y", ""),
    ]


def test_a_heredoc_is_one_command_with_its_body():
    body = "cat > f.py <<'EOF'\nimport os  # a comment in the file\nprint(1)\nEOF\npython f.py"
    assert texts(md(("", body))) == [
        "cat > f.py <<'EOF'\nimport os  # a comment in the file\nprint(1)\nEOF",
        "python f.py",
    ]


def test_variable_lines_reach_the_later_commands_of_their_block_only():
    markdown = md(
        ("bash", 'DATA="data.prefix=d data.tokenizer_model=t"\nsbatch s.sbatch $DATA'),
        ("bash", "sbatch s.sbatch $DATA"),
    )
    first, second = extract_commands(markdown, "x.md")
    assert first.variables == ('DATA="data.prefix=d data.tokenizer_model=t"',)
    assert second.variables == ()


def test_blocks_of_output_trees_formulas_and_other_languages_are_not_commands():
    markdown = md(
        ("", "step      5/10 | loss 5.3063 | lr 2.58e-03"),
        ("", "checkpoint.dir/\n  latest   # the newest step"),
        ("", "busy_r = compute_r + recompute_r"),
        ("", "[data] train blend of 480 samples:"),
        ("json", '{"file": "model-rank00003.safetensors"}'),
        ("python", "python = 3"),
        ("yaml", "make: train"),
    )
    assert texts(markdown) == []


def test_a_console_transcript_gives_its_prompted_lines():
    markdown = md(
        ("", "$ python -m megatronish.plan world_size=8 \\\n    top=5\n8 ranks on 1 node")
    )
    assert texts(markdown) == ["python -m megatronish.plan world_size=8 top=5"]


def test_an_indented_fence_in_a_list_is_read():
    markdown = "- a step:\n\n  ```bash\n  make lint\n  ```\n"
    assert texts(markdown) == ["make lint"]


@pytest.mark.parametrize(
    "first_line",
    [
        "python3 -m megatronish.train",
        "torchrun --nproc-per-node 2 -m megatronish.train",
        "make train",
        "sbatch scripts/slurm/train.sbatch",
        "scripts/slurm/chain.sh 2",
        "tools/x.sh",
        "cat > f.py <<'EOF'\nEOF",
        'DATA="a b"',
        "LAUNCH=srun sbatch --ntasks-per-node=8 scripts/slurm/train.sbatch",
        'TORCHRUN_ARGS="--max-restarts 2" scripts/launch_local.sh 8',
        "PYTHON=python3 make gpu-check",
    ],
)
def test_a_block_starting_with_a_command_is_a_command_block(first_line):
    (block,) = fenced_blocks(md(("", first_line)), "x.md")
    assert is_command_block(block)


# -- classification -----------------------------------------------------------------------------


def command(text: str, comment: str = "", variables: tuple[str, ...] = ()) -> Command:
    return Command("x.md", 1, text, comment, variables)


@pytest.mark.parametrize(
    "text, comment, cls",
    [
        ("make test", "", "make"),
        ("make train", "", "make"),
        ("make docs-check", "", "make"),
        ("make lint", "", "run"),
        ("python -m megatronish.train --cfg job", "", "run"),
        ("python -m megatronish.train +experiment=gpt_1b trainer.dry_run=true", "", "run"),
        ("python -m megatronish.train", "the default job", "dry"),
        ("python -m megatronish.train", "after make train: complete, exit 7", "run"),
        ("python -m megatronish.train name=p trainer.max_steps=10", "", "run"),
        ("python -m megatronish.train -m a=1,2 trainer.max_steps=10", "", "dry"),
        ("python -m megatronish.train +experiment=gpt_1b trainer.max_steps=10", "", "dry"),
        ("python -m megatronish.train name=p trainer.max_steps=300", "", "dry"),
        ("torchrun --nproc-per-node 2 -m megatronish.train name=dp2", "", "dry"),
        ("scripts/launch_local.sh 8", "", "dry"),
        ("LAUNCH=srun sbatch scripts/slurm/train.sbatch", "", "dry"),
        ("scripts/slurm/chain.sh 10 +experiment=gpt_7b", "", "dry"),
        ("python tools/train_tokenizer.py --input corpus.jsonl", "", "skip"),
        ("torchrun --nproc-per-node 8 -m megatronish.train ...", "", "skip"),
        ("python tools/checkpoint_info.py outputs/tiny/checkpoints", "", "run"),
    ],
)
def test_commands_are_classified_by_the_rules(text, comment, cls):
    assert classify(command(text, comment)).cls == cls


def test_every_rule_names_a_class_and_a_reason():
    assert all(r.cls in CLASSES and r.reason for r in RULES)
    assert RULES[-1].pattern == ""  # a catch-all: every command gets a class


def test_only_a_comment_saying_so_allows_exit_7():
    assert expected_codes(command("x", "complete after make train: exit 7")) == (0, 7)
    assert expected_codes(command("x", "trains 70 steps")) == (0,)


@pytest.mark.parametrize(
    "text, variables, overrides, world, template",
    [
        ("python -m megatronish.train name=a", (), ("name=a",), 1, False),
        (
            "torchrun --nproc-per-node 4 -m megatronish.train parallel.tp=2",
            (),
            ("parallel.tp=2",),
            4,
            False,
        ),
        ("torchrun --nproc-per-node=2 -m megatronish.train", (), (), 2, False),
        (
            'TORCHRUN_ARGS="--max-restarts 2" scripts/launch_local.sh 8 name=e',
            (),
            ("name=e",),
            8,
            False,
        ),
        (
            "LAUNCH=srun sbatch --ntasks-per-node=8 scripts/slurm/train.sbatch +experiment=gpt_1b "
            "$DATA",
            ('DATA="data.prefix=d data.tokenizer_model=t"',),
            ("+experiment=gpt_1b", "data.prefix=d", "data.tokenizer_model=t"),
            8,
            False,
        ),
        (
            "scripts/slurm/chain.sh 10 +experiment=gpt_7b ${DATA}",
            ("DATA=data.prefix=d",),
            ("+experiment=gpt_7b", "data.prefix=d"),
            8,
            False,
        ),
        (
            "torchrun --nproc-per-node 8 --signals-to-handle SIGTERM -m megatronish.train ...",
            (),
            (),
            8,
            True,
        ),
        (
            "python -m megatronish.train a=1 <the printed model.* overrides> b=2",
            (),
            ("a=1", "b=2"),
            1,
            True,
        ),
        (
            "python -m megatronish.train +experiment=gpt_1b trainer.dry_run=true world_size=8",
            (),
            ("+experiment=gpt_1b", "trainer.dry_run=true", "world_size=8"),
            8,
            False,
        ),
    ],
)
def test_a_launch_gives_its_overrides_and_world_size(text, variables, overrides, world, template):
    launch = dry_launch(command(text, variables=variables))
    assert (launch.overrides, launch.world, launch.template) == (overrides, world, template)


def test_other_commands_are_no_launch():
    assert dry_launch(command("python tools/export_hf.py a b")) is None
    assert dry_launch(command("python -m megatronish.plan +experiment=gpt_7b")) is None


def test_a_sweep_composes_every_combination_and_keeps_bracketed_commas():
    launch = dry_launch(command("python -m megatronish.train -m a=1,2 b=[5,7] c=x,y"))
    assert job_overrides(launch) == [
        ["a=1", "b=[5,7]", "c=x"],
        ["a=1", "b=[5,7]", "c=y"],
        ["a=2", "b=[5,7]", "c=x"],
        ["a=2", "b=[5,7]", "c=y"],
    ]
    plain = dry_launch(command("python -m megatronish.train b=[5,7] 'c=[[0.7,a],[0.3,b]]'"))
    assert job_overrides(plain) == [["b=[5,7]", "c=[[0.7,a],[0.3,b]]"]]


def test_each_class_is_checked_by_its_script():
    def script(text, cls, variables=()):
        return check_script(Check(command(text, variables=variables), cls, "why"))

    assert script("PYTHON=python3 make gpu-check", "make") == "PYTHON=python3 make -n gpu-check"
    assert script("sbatch s.sbatch $D", "run", ("D=1",)) == "D=1\nsbatch s.sbatch $D"
    assert script("torchrun --nproc-per-node 2 -m megatronish.train 'a=[1, 2]'", "dry") == (
        "python -m megatronish.train 'a=[1, 2]' trainer.dry_run=true world_size=2"
    )
    with pytest.raises(ValueError, match="not run"):
        script("python tools/x.py", "skip")


# -- the documented commands --------------------------------------------------------------------

DOCUMENTED = [classify(c) for c in all_commands(ROOT)]
LAUNCHES = [
    (check, dry_launch(check.command))
    for check in DOCUMENTED
    if check.cls in ("run", "dry")
    and dry_launch(check.command) is not None
    and not {"--cfg", "--help"} & set(dry_launch(check.command).overrides)
]


def test_the_docs_hold_commands_of_every_class():
    assert {c.cls for c in DOCUMENTED} == set(CLASSES)
    assert any(c.command.doc == "README.md" for c in DOCUMENTED)
    assert LAUNCHES


@pytest.mark.parametrize("check", DOCUMENTED, ids=lambda c: f"{c.command.doc}:{c.command.line}")
def test_every_documented_command_has_a_class_and_a_check(check):
    assert check.cls in CLASSES and check.reason
    if check.cls != "skip":
        assert check_script(check)


@pytest.mark.parametrize(
    "check, launch",
    LAUNCHES,
    ids=lambda x: f"{x.command.doc}:{x.command.line}" if isinstance(x, Check) else "",
)
def test_every_documented_training_launch_composes_and_validates(check, launch):
    for overrides in job_overrides(launch):
        cfg = load_config(overrides)
        errors = config_errors(cfg, launch.world, data=False)
        assert not errors, f"{check.command.doc}:{check.command.line}: {errors}"


@pytest.mark.slow
def test_no_documented_launch_is_refused_by_or_complete_in_the_run_of_make_train():
    """After ``make train`` outputs/tiny holds the default job complete: a launch continuing it
    must be that run and say it exits 7; any other launch needs its own ``name=``."""
    default = load_config([])
    saved = OmegaConf.to_container(default, resolve=True)
    for check, launch in LAUNCHES:
        if is_sweep(launch):
            continue  # each job of a sweep gets a directory of its own
        (overrides,) = job_overrides(launch)
        cfg = load_config(overrides)
        if cfg.trainer.dry_run or cfg.checkpoint.dir != default.checkpoint.dir:
            continue
        if cfg.checkpoint.resume != "auto":
            continue
        current = OmegaConf.to_container(cfg, resolve=True)
        where = f"{check.command.doc}:{check.command.line}"
        try:
            check_same_run(saved, default.trainer.max_steps, current, default.checkpoint.dir)
        except ConfigChanged as e:
            pytest.fail(f"{where}: refused after make train (exit 2), give it a name=: {e}")
        except RunComplete:
            assert 7 in expected_codes(check.command), f"{where} exits 7 after make train"


def test_every_tool_and_module_the_docs_name_exists():
    tools, modules = set(), set()
    for path in doc_paths(ROOT):
        found = named_entry_points(path.read_text())
        tools |= found[0]
        modules |= found[1]
    assert "tools/export_hf.py" in tools and "megatronish.train" in modules
    assert not [t for t in sorted(tools) if not (ROOT / t).is_file()]
    assert not [m for m in sorted(modules) if not module_exists(ROOT, m)]


# -- a launch against the runs the sandbox holds ------------------------------------------------

DRY_OUTPUT = """note: something worth knowing
name: tiny
out_dir: outputs/tiny
checkpoint:
  dir: outputs/tiny/checkpoints
  resume: auto
trainer:
  max_steps: 300
optimizer:
  lr: 0.001

derived:
  world_size: 1
"""


def saved(tmp_path: Path, step: int, lr: float) -> None:
    step_dir = tmp_path / "outputs/tiny/checkpoints" / f"step_{step:07d}"
    step_dir.mkdir(parents=True)
    (step_dir.parent / "latest").write_text(step_dir.name)
    config = {"name": "tiny", "trainer": {"max_steps": 300}, "optimizer": {"lr": lr}}
    (step_dir / "metadata.json").write_text(json.dumps({"config": config, "step": step}))


def test_a_dry_runs_printed_config_is_read():
    config = resolved_config(DRY_OUTPUT)
    assert config["checkpoint"]["dir"] == "outputs/tiny/checkpoints"
    assert resolved_config("invalid config: ...") is None


def test_a_launch_that_the_saved_run_would_refuse_or_find_complete_is_a_problem(tmp_path):
    config = resolved_config(DRY_OUTPUT)
    assert identity_problem(config, tmp_path, (0,)) == ""  # nothing saved: a new run
    saved(tmp_path, 300, 0.001)
    assert "would exit 7" in identity_problem(config, tmp_path, (0,))
    assert identity_problem(config, tmp_path, (0, 7)) == ""
    longer = {**config, "trainer": {"max_steps": 400}}
    assert identity_problem(longer, tmp_path, (0,)) == ""  # resumes it
    other = {**longer, "optimizer": {"lr": 0.0006}}
    assert "refused (exit 2)" in identity_problem(other, tmp_path, (0,))


def test_a_dry_check_drops_a_tokenizer_the_sandbox_lacks(tmp_path):
    script = "python -m megatronish.train data.tokenizer_model=tok.model trainer.dry_run=true"
    got, note = without_missing_tokenizer(script, tmp_path)
    assert got == "python -m megatronish.train trainer.dry_run=true" and "tok.model" in note
    (tmp_path / "tok.model").write_text("")
    assert without_missing_tokenizer(script, tmp_path) == (script, "")


def test_the_sandbox_venv_links_the_environment_but_has_its_own_install_stamp(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / STAMP).write_text("")
    os.utime(venv / STAMP, (0, 0))  # an old stamp: make would reinstall through a link to it
    link_venv(venv, tmp_path / "sandbox")
    assert (tmp_path / "sandbox/bin").resolve() == (venv / "bin").resolve()
    stamp = tmp_path / "sandbox" / STAMP
    assert not stamp.is_symlink() and stamp.stat().st_mtime > 0


# -- the tool's report and arguments ------------------------------------------------------------


def load_cli():
    """tools/docs_check.py (its name is its package's: loaded from the file, registered)."""
    spec = importlib.util.spec_from_file_location("docs_check_cli", ROOT / "tools/docs_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TOOL = load_cli()


def test_each_command_reports_one_line_and_the_summary_counts_failures():
    ran = TOOL.Outcome(Check(command("make lint"), "run", "seconds"), 2, 1.25, "exit 2, expected 0")
    skipped = TOOL.Outcome(Check(command("python tools/a.py corpus.jsonl"), "skip", "why"), None, 0)
    assert TOOL.report_line(ran) == "FAIL run     2    1.2  x.md:1  make lint"
    assert TOOL.report_line(skipped).endswith("python tools/a.py corpus.jsonl   [why]")
    assert TOOL.summary([ran, skipped], 61.0, "5 s").startswith(
        "docs-check: 2 commands (1 run, 1 skip), 1 failed; make train 5 s; 61 s"
    )


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--after-train", "{tmp}"], "no checkpoints/ there"),
        (["--after-train", "{tmp}/trained", "--in-place"], "drop --in-place"),
        (["--timeout", "0"], "--timeout 0"),
        (["--keeep"], "--keep"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(argv, fragment, tmp_path, capfd):
    (tmp_path / "trained" / "checkpoints").mkdir(parents=True)
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, _, err = run_main(TOOL.main, argv, capfd)
    assert_one_line(code, err, 2, fragment)
