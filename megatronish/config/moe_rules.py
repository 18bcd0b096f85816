"""The mixture-of-experts rules: ``model.moe`` and ``parallel.ep`` against the layout."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from megatronish.config.schema import MoEConfig, RouterConfig

if TYPE_CHECKING:
    from megatronish.config.schema import TrainConfig

SCORES = ("softmax", "sigmoid")  # model.moe.router.score
DISPATCH_ORDERS = ("tp_first", "ep_first")  # parallel.moe_dispatch_order


def moe_errors(cfg: TrainConfig, dp: int) -> list[str]:
    """Every rule of ``model.moe`` / ``parallel.ep`` that ``cfg`` breaks (``dp``: its data-parallel
    size, already checked against the world)."""
    moe, p = cfg.model.moe, cfg.parallel
    errors: list[str] = []
    if p.ep < 1:
        return [f"parallel.ep={p.ep} must be >= 1"]
    if p.moe_dispatch_order not in DISPATCH_ORDERS:
        errors.append(
            f"parallel.moe_dispatch_order={p.moe_dispatch_order} is not one of "
            f"{', '.join(DISPATCH_ORDERS)} (tp_first: gather over tp, then the all-to-all over "
            "ep; ep_first: Megatron-LM's, the all-to-all first)"
        )
    if moe.num_experts < 0:
        return [f"model.moe.num_experts={moe.num_experts} must be >= 0 (0: a dense model)"]
    if moe.num_experts == 0:
        if p.ep > 1:
            errors.append(
                f"parallel.ep={p.ep} needs experts to split: set model.moe.num_experts (a "
                "multiple of ep) or parallel.ep=1"
            )
        return errors + router_errors(moe.router, 0, moe.top_k)  # values a dense model ignores
    e, k = moe.num_experts, moe.top_k
    if not 1 <= k <= e:
        errors.append(f"model.moe.top_k={k} must be in [1, model.moe.num_experts={e}]")
    if moe.layer_freq < 1:
        errors.append(f"model.moe.layer_freq={moe.layer_freq} must be >= 1")
    if moe.shared_experts < 0:
        errors.append(f"model.moe.shared_experts={moe.shared_experts} must be >= 0")
    if moe.ffn_hidden_size is not None and moe.ffn_hidden_size < 1:
        errors.append(f"model.moe.ffn_hidden_size={moe.ffn_hidden_size} must be >= 1 or null")
    elif moe.ffn_hidden_size is not None and moe.ffn_hidden_size % p.tp:
        errors.append(
            f"model.moe.ffn_hidden_size={moe.ffn_hidden_size} is not divisible by "
            f"parallel.tp={p.tp} (experts are split over tp like the dense MLP)"
        )
    if moe.capacity_factor is not None and not moe.capacity_factor > 0:
        errors.append(
            f"model.moe.capacity_factor={moe.capacity_factor} must be > 0, or null (dropless)"
        )
    errors += router_errors(moe.router, e, k)
    if e % p.ep:
        errors.append(
            f"model.moe.num_experts={e} is not divisible by parallel.ep={p.ep}; every ep rank "
            "holds the same number of experts"
        )
    if (dp * p.cp) % p.ep:
        carved = f"dp*cp = {dp}*{p.cp} = {dp * p.cp}" if p.cp > 1 else f"dp={dp}"
        errors.append(
            f"parallel.ep={p.ep} must divide {carved}: expert parallelism is carved out of "
            "the data-parallel ranks; change parallel.ep or the world size"
        )
    if p.tp > 1 and not p.sp:
        errors.append(
            f"mixture-of-experts blocks with parallel.tp={p.tp} need parallel.sp=true (each tp "
            "rank routes its own sequence shard, as in Megatron-LM)"
        )
    return errors


def router_errors(router: RouterConfig, num_experts: int, top_k: int) -> list[str]:
    """The rules of ``model.moe.router``'s score, loss coefficients, expert bias and expert
    groups; ``num_experts=0`` (a dense model, which routes nothing): the values alone, not their
    fit to the experts."""
    errors = []
    if router.score not in SCORES:
        errors.append(
            f"model.moe.router.score={router.score} is not one of {', '.join(SCORES)} "
            "(softmax: Mixtral, Megatron's default; sigmoid: DeepSeek-V3)"
        )
    for key in ("aux_loss_coef", "z_loss_coef"):
        if getattr(router, key) < 0:
            errors.append(f"model.moe.router.{key}={getattr(router, key)} must be >= 0")
    rate = router.bias_update_rate
    if rate is not None and not rate >= 0:
        errors.append(
            f"model.moe.router.bias_update_rate={rate} must be >= 0 (0 keeps the expert bias "
            "fixed), or null for no expert bias"
        )
    groups, best = router.num_groups, router.max_groups
    if (groups is None) != (best is None):
        errors.append(
            "model.moe.router.num_groups and max_groups go together (group-limited routing): "
            f"got num_groups={groups}, max_groups={best}; set both or neither"
        )
    elif groups is not None:
        if groups < 1:
            errors.append(
                f"model.moe.router.num_groups={groups} must be >= 1 (the expert groups of "
                "group-limited routing), or null with max_groups=null for no groups"
            )
        elif num_experts and num_experts % groups:
            errors.append(
                f"model.moe.router.num_groups={groups} must divide model.moe.num_experts="
                f"{num_experts} (each group holds the same number of experts)"
            )
        elif not 1 <= best <= groups:
            errors.append(f"model.moe.router.max_groups={best} must be in [1, num_groups={groups}]")
        elif num_experts and (top_k % best or top_k // best > num_experts // groups):
            errors.append(
                f"model.moe.router.max_groups={best} must divide model.moe.top_k={top_k} with "
                f"top_k / max_groups <= {num_experts // groups} experts per group (each group "
                "is scored by its top_k / max_groups best experts)"
            )
    return errors


def moe_notes(cfg: TrainConfig) -> list[str]:
    """Mixture-of-experts settings that do nothing in ``cfg``: ``model.moe`` keys (and the
    dispatch order) on a dense model, ``parallel.moe_dispatch_order=ep_first`` at tp=1."""
    moe, p = cfg.model.moe, cfg.parallel
    order = p.moe_dispatch_order
    if moe.num_experts == 0:
        given = [
            *_changed(moe, MoEConfig(), "model.moe.", skip=("num_experts", "router")),
            *_changed(moe.router, RouterConfig(), "model.moe.router."),
            *([f"parallel.moe_dispatch_order={order}"] if order != DISPATCH_ORDERS[0] else []),
        ]
        if not given:
            return []
        verb = "has" if len(given) == 1 else "have"
        return [
            f"{', '.join(given)} {verb} no effect on a dense model (model.moe.num_experts=0: no "
            "block routes tokens to experts)"
        ]
    if order == "ep_first" and p.tp == 1:
        return [
            "parallel.moe_dispatch_order=ep_first has no effect with parallel.tp=1: it orders "
            "the all-to-all over ep and the gather over tp, and one tp rank gathers nothing"
        ]
    return []


def _changed(
    section: MoEConfig | RouterConfig,
    defaults: MoEConfig | RouterConfig,
    prefix: str,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """``prefix + key=value`` for each key of ``section`` (a config section) that differs from
    ``defaults``."""
    return [
        f"{prefix}{f.name}={getattr(section, f.name)}"
        for f in fields(defaults)
        if f.name not in skip and getattr(section, f.name) != getattr(defaults, f.name)
    ]
