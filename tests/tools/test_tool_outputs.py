"""Tools write their results under outputs/ (ignored by git) unless told where: never over
tracked files by default (``make bench`` and ``make gpu-check`` regenerate docs/ on purpose)."""

from pathlib import Path

from megatronish.testing.cli import load_tool

REPO = Path(__file__).resolve().parents[2]


def test_pipeline_timeline_writes_under_outputs_unless_given_out():
    assert "outputs/" in (REPO / ".gitignore").read_text().splitlines()
    tool = load_tool("pipeline_timeline")
    assert tool.parse_args([]).out.startswith("outputs/")
    assert tool.parse_args(["--out", "docs/pipeline"]).out == "docs/pipeline"
