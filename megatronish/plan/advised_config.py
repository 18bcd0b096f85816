"""Write an advised layout as a Hydra ``parallel`` group file, and the command line to run it.

The file holds the ``parallel`` keys (dp stays null: derived from the world size). The layout's
trainer keys (micro batch size, recompute) belong to another group, so the file's header lists
them and :func:`run_overrides` adds them to the command line. Experiments are applied after the
config groups, so an experiment that sets ``parallel`` keys itself (``gpt_1b``, ``gpt_7b``)
would override ``parallel=NAME``; :func:`run_overrides` composes the command to check, and
falls back to explicit ``parallel.*`` overrides when the group file would be overridden.
"""

from __future__ import annotations

from pathlib import Path

from megatronish.config import compose
from megatronish.plan.layout import Layout

# Overrides of the user's command that the advised layout replaces.
LAYOUT_KEYS = ("parallel", "trainer.micro_batch_size", "trainer.recompute", "world_size")


def parallel_values(layout: Layout) -> dict[str, object]:
    return {
        "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "dp": None,
        "sp": layout.sequence_parallel, "zero_stage": layout.zero_stage,
    }  # fmt: skip


def trainer_overrides(layout: Layout) -> list[str]:
    out = [f"trainer.micro_batch_size={layout.micro_batch_size}"]
    out.append(f"trainer.recompute={layout.recompute}")
    if layout.recompute == "full":
        out += [f"trainer.recompute_method={layout.recompute_method}",
                f"trainer.recompute_num_layers={layout.recompute_num_layers}"]  # fmt: skip
    return out


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def parallel_file_text(layout: Layout, summary: str, command: str) -> str:
    """The YAML text of the group file (``summary``: one line on where it comes from)."""
    header = [
        f"# {summary}",
        f"# Layout: {layout.describe()} on {layout.world_size} ranks (dp is derived).",
        "# It also needs these trainer keys (not part of the parallel group):",
        f"#   {' '.join(trainer_overrides(layout))}",
        f"# Run: {command}",
    ]
    body = [f"{k}: {_yaml(v)}" for k, v in parallel_values(layout).items()]
    return "\n".join([*header, *body]) + "\n"


def group_name(path: Path) -> str | None:
    """``NAME`` when ``path`` is ``configs/parallel/NAME.yaml`` of this checkout, else None."""
    parallel_dir = Path(compose.CONFIG_DIR) / "parallel"
    path = path.resolve()
    return path.stem if path.suffix == ".yaml" and path.parent == parallel_dir else None


def _kept(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith(LAYOUT_KEYS)]


def run_overrides(overrides: list[str], layout: Layout, name: str | None) -> list[str]:
    """Overrides that run ``layout``: the user's (less their layout keys), ``parallel=NAME``
    when the group file ``name`` exists and wins, else explicit ``parallel.*`` keys, and the
    trainer keys."""
    kept = [*_kept(overrides), *trainer_overrides(layout)]
    if name is not None:
        candidate = [*kept, f"parallel={name}"]
        try:
            cfg = compose.load_config(candidate)
        except Exception:  # noqa: BLE001 - e.g. an experiment that overrides the group itself
            cfg = None
        if cfg is not None and all(
            cfg.parallel[k] == v for k, v in parallel_values(layout).items()
        ):
            return candidate
    explicit = [f"parallel.{k}={_yaml(v)}" for k, v in parallel_values(layout).items()]
    return [*kept, *explicit]


def write_parallel_file(path: Path, layout: Layout, overrides: list[str], summary: str) -> str:
    """Write the group file; returns the command line that runs the layout."""
    name = group_name(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written first without a command, so that composing ``parallel=NAME`` can check it.
    path.write_text(parallel_file_text(layout, summary, "(see below)"))
    command = "python -m megatronish.train " + " ".join(run_overrides(overrides, layout, name))
    command += f"   (on {layout.world_size} ranks: torchrun, srun or scripts/slurm/train.sbatch)"
    if name is None:
        command += f"; or copy this file to configs/parallel/ and use parallel={path.stem}"
    path.write_text(parallel_file_text(layout, summary, command))
    return command
