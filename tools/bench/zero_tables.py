"""Tables of the ZeRO benchmark section (``bench_zero.py``): cells formatted from raw results."""

from __future__ import annotations

from collections.abc import Callable

from sections import table

MIB = 2**20


def time_table(
    med: dict[str, float],
    ratios: dict[str, float],
    cpu_ratios: dict[str, float],
    tokens: int,
    peers: dict[str, str],
) -> dict:
    """Median step time and tokens/s of every variant, megatronish / peer ratios (wall clock
    and CPU time)."""
    rows = []
    for name, step in med.items():
        if name not in peers and name not in peers.values():
            continue
        peer = peers.get(name)
        rows.append([
            name, f"{step * 1000:.0f}", f"{tokens / step:,.0f}",
            f"{step / med[peer]:.2f}x vs {peer}" if peer else "",
            f"{ratios[name]:.2f}x" if peer else "",
            f"{cpu_ratios[name]:.2f}x" if peer else "",
        ])  # fmt: skip
    return table(
        "Step time (median over repeats; target: megatronish <= 1.00x its peer). The 1-rank "
        "pair is the model and trainer without data parallelism",
        [
            "variant",
            "step ms",
            "tokens/s",
            "step time / peer's",
            "median of per-repeat ratios",
            "CPU time / peer's (all ranks and threads, median of per-repeat ratios)",
        ],  # fmt: skip
        rows,
    )


def scaling_table(med: dict[str, float], scaling: dict[str, dict], tokens: int) -> dict:
    """Tokens/s with 1 rank and with 2 ranks at the same global batch, scaling efficiencies,
    and where each rank's main thread spent a step."""
    rows = []
    for name, s in scaling.items():
        ranks = 1 if "wall" not in s else 2
        t = s["main_thread"]
        rows.append([
            name, ranks, f"{med[name] * 1000:.0f}", f"{tokens / med[name]:,.0f}",
            f"{s['wall']:.0%}" if ranks == 2 else "", f"{s['cpu']:.0%}" if ranks == 2 else "",
            f"{t['process_cpu'] * 1000:.0f}",
            " / ".join(f"{t[k] * 1000:.0f}" for k in ("on_cpu", "cpu_wait", "blocked")),
        ])  # fmt: skip
    rows.sort(key=lambda r: r[1])
    return table(
        "Data-parallel scaling at the same global batch: 1 rank vs 2 ranks (efficiencies are "
        "medians of per-repeat ratios to the same implementation's 1-rank run: megatronish's "
        "for zero 0/3, the reference GPT's for DDP/FSDP2)",
        ["variant", "ranks", "step ms", "tokens/s", "wall-clock efficiency",
         "CPU-time efficiency", "CPU ms per step per rank (all threads)",
         "main thread ms per step: on CPU / waiting for a CPU / blocked"],
        rows,
    )  # fmt: skip


def loss_table(losses: dict[str, list[float]], base: str) -> dict:
    """First and last loss of every variant (same batches in the same order) and the largest
    step-by-step difference from ``base``."""
    rows = []
    for name, ls in losses.items():
        n = min(len(ls), len(losses[base]))
        diff = max(abs(a - b) for a, b in zip(ls[:n], losses[base][:n]))
        rows.append([name, f"{ls[0]:.5f}", len(ls), f"{ls[-1]:.5f}", f"{diff:.1e}"])
    return table(
        "Equal losses: every variant trains the same global batches from the same weights",
        ["variant", "step 1 loss", "steps", "last loss", f"max |loss - {base}| over steps"],
        rows,
    )


def memory_table(
    model: str,
    mem: dict[str, list[dict]],
    formula: Callable[[int, int, int], float],
    runtime: int = 0,
) -> dict:
    """Memory per rank of one model (``model``: its description): state bytes vs ZeRO's
    formulas, RSS above start, and the planner's peak next to the measured one. ``mem``:
    variant -> per-rank reports (``zero_memory.measure``); states and plan are rank 0's (ranks
    agree), RSS the larger rank's; ``runtime``: the training loop's own bytes beside tensors,
    added to the plan."""
    psi = mem["zero 0"][0]["psi"]
    dp = len(mem["zero 0"])
    names = {0: "16Ψ", 1: "8Ψ + 8Ψ/dp", 2: "4Ψ + 12Ψ/dp", 3: "16Ψ/dp"}
    peers = {"DDP": 0, "FSDP2": 3}  # the stage each peer's state corresponds to
    rows = []
    for variant, ranks in mem.items():
        r = ranks[0]
        built = max(x["rss_built"] - x["rss_start"] for x in ranks)
        peak = max(x["rss_peak"] - x["rss_start"] for x in ranks)
        stage = int(variant.split()[1]) if variant.startswith("zero") else peers[variant]
        f = formula(stage, psi, dp)
        if "state" in r:
            s = r["state"]
            total = s["params"] + s["grads"] + s["optimizer"]
            cells = [f"{s[k] / MIB:.1f}" for k in ("params", "grads", "optimizer")]
            cells += [f"{total / MIB:.1f}", f"{names[stage]} = {f / MIB:.1f}"]
        else:
            cells = ["", "", "", "", f"({names[stage]} = {f / MIB:.1f})"]
        cells += [f"{built / MIB:.0f}", f"{peak / MIB:.0f}"]
        if "plan" in r:
            planned = r["plan"]["peak"] + runtime
            cells += [f"{planned / MIB:.0f}", f"{peak / planned:.2f}"]
        else:
            cells += ["", ""]
        label = variant if variant in peers else f"megatronish {variant}"
        rows.append([label, *cells])
    return table(
        f"Memory per rank (MiB), {model}: Ψ = {psi / 1e6:.2f} M, dp = {dp}",
        ["variant", "params", "grads", "Adam state", "state total", "ZeRO formula",
         "RSS after build, above start", "peak RSS in steps, above start",
         "planned peak + runtime", "measured / planned"],
        rows,
    )  # fmt: skip


def optimizer_table(optim: dict[str, float]) -> dict:
    """Thread-CPU milliseconds of the optimizer-side candidates (``zero_optim.py``)."""
    return table(
        "Optimizer-side work of one step, tiny model, zero 0, one thread (thread CPU ms, median)",
        ["operation", "ms"],
        [[name, f"{ms:.1f}"] for name, ms in optim.items()],
    )
