"""The trainer's start-up memory check: stop before allocating a layout that cannot fit, and
say which changes would make it fit."""

from __future__ import annotations

import itertools

from omegaconf import OmegaConf

from megatronish.config.derived import data_parallel_size
from megatronish.config.schema import TrainConfig
from megatronish.config.validate import ConfigError, config_errors
from megatronish.plan.devices import GiB
from megatronish.plan.estimate import make_plan
from megatronish.plan.layout import layout_from_config, spec_of


class LayoutDoesNotFit(ConfigError):
    """The planned peak memory of a rank exceeds what the device offers."""

    def __init__(self, message: str):
        self.errors = [message]
        ValueError.__init__(self, message)


def _changes(cfg: TrainConfig, world: int) -> list[tuple[str, dict]]:
    """Single changes that lower memory per rank (as ``key -> value`` overrides)."""
    p, t = cfg.parallel, cfg.trainer
    dp = data_parallel_size(p, world)
    out: list[tuple[str, dict]] = []
    if dp % 2 == 0:
        out.append((f"parallel.tp={2 * p.tp}", {"parallel.tp": 2 * p.tp, "parallel.dp": None}))
        out.append((f"parallel.cp={2 * p.cp}", {"parallel.cp": 2 * p.cp, "parallel.dp": None}))
        out.append((f"parallel.pp={2 * p.pp}", {"parallel.pp": 2 * p.pp, "parallel.dp": None}))
    experts, ep = cfg.model.moe.num_experts, p.get("ep", 1)
    if experts and (dp * p.cp) % (2 * ep) == 0 and experts % (2 * ep) == 0:
        out.append((f"parallel.ep={2 * ep}", {"parallel.ep": 2 * ep}))
    if p.tp > 1 and not p.sp:
        out.append(("parallel.sp=true", {"parallel.sp": True}))
    if dp * p.cp > 1:
        for z in range(p.zero_stage + 1, 4):
            out.append((f"parallel.zero_stage={z}", {"parallel.zero_stage": z}))
    if t.recompute == "none":
        out.append(("trainer.recompute=selective", {"trainer.recompute": "selective"}))
    if t.recompute != "full":
        out.append(("trainer.recompute=full", {"trainer.recompute": "full"}))
    if t.micro_batch_size > 1:
        mbs = t.micro_batch_size // 2
        out.append((f"trainer.micro_batch_size={mbs}", {"trainer.micro_batch_size": mbs}))
    if not p.get("optimizer_offload", False):
        out.append(("parallel.optimizer_offload=true", {"parallel.optimizer_offload": True}))
    return out


def _apply(cfg: TrainConfig, changes: dict):
    new = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in changes.items():
        OmegaConf.update(new, key, value, merge=False)
    return new


def fitting_options(
    cfg: TrainConfig, world: int, vocab: int, budget: int, runtime: int, limit: int = 6
):
    """Up to ``limit`` (overrides, peak bytes) of the fewest changes that fit, smallest first."""
    found = []
    changes = _changes(cfg, world)
    for n in (1, 2, 3):
        for combo in itertools.combinations(changes, n):
            keys = [k for _, c in combo for k in c if k != "parallel.dp"]
            if len(keys) != len(set(keys)):  # two values for one key
                continue
            merged = {k: v for _, c in combo for k, v in c.items()}
            new = _apply(cfg, merged)
            if config_errors(new, world, data=False):  # the data is checked (and unchanged)
                continue
            plan = make_plan(spec_of(new, vocab), layout_from_config(new, world))
            if plan.peak_bytes + runtime <= budget:
                found.append((" ".join(name for name, _ in combo), plan.peak_bytes))
        if found:
            break
    found.sort(key=lambda item: item[1])
    return found[:limit]


def memory_fit_error(
    cfg, world: int, vocab: int, budget: int, runtime: int, where: str
) -> str | None:
    """None when the planned peak fits ``budget`` bytes per rank; else the message to stop with."""
    plan = make_plan(spec_of(cfg, vocab), layout_from_config(cfg, world))
    need = plan.peak_bytes + runtime
    if need <= budget:
        return None
    worst = max(plan.stages, key=lambda s: s.peak)
    st = worst.states
    lines = [
        f"this layout does not fit in memory: a rank of pipeline stage {worst.pp_rank} needs about "
        f"{need / GiB:.1f} GiB ({st.params / GiB:.1f} params + {st.grads / GiB:.1f} grads + "
        f"{st.optimizer / GiB:.1f} optimizer + {(st.params_step + st.grads_step) / GiB:.1f} "
        f"gathered in the step + {worst.activations.peak / GiB:.1f} activations + "
        f"{runtime / GiB:.1f} runtime) but {where} offers {budget / GiB:.1f} GiB.",
    ]
    options = fitting_options(cfg, world, vocab, budget, runtime)
    if options:
        lines.append("Layouts that would fit (planned peak per rank):")
        lines += [f"  {o}   ({(peak + runtime) / GiB:.1f} GiB)" for o, peak in options]
    else:
        lines.append(
            "No combination of up to three changes (tp, cp, pp, ep, sp, zero stage, recompute, "
            "micro batch, optimizer offload) fits on this many ranks: use more devices or a "
            "smaller model."
        )
    lines.append(
        "`python -m megatronish.plan` with the same overrides prints the full plan; "
        "trainer.check_memory=false skips this check."
    )
    return "\n".join(lines)


def host_fit_error(cfg, world: int, vocab: int, local_ranks: int, available: int) -> str | None:
    """None when the host state of optimizer offload (``parallel.optimizer_offload``) of the
    ``local_ranks`` ranks on this host fits in its ``available`` bytes; else the message to stop
    with (one line)."""
    if not cfg.parallel.get("optimizer_offload", False):
        return None
    plan = make_plan(spec_of(cfg, vocab), layout_from_config(cfg, world))
    per_rank = max(s.states.host for s in plan.stages)
    if per_rank * local_ranks <= available:
        return None
    return (
        f"parallel.optimizer_offload=true keeps about {per_rank / GiB:.1f} GiB of host memory "
        f"per rank, pinned blocks as torch rounds them ({local_ranks} rank(s) here: "
        f"{per_rank * local_ranks / GiB:.1f} GiB) "
        f"but this host has {available / GiB:.1f} GiB available: shard the optimizer over more "
        "ranks (a higher parallel.zero_stage, more dp ranks) or set parallel.optimizer_offload="
        "false"
    )
