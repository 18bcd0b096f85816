"""The advisor benchmark's scatter plot: predicted vs measured step time per layout."""

from __future__ import annotations

from pathlib import Path


def draw(rows: list[dict], path: Path) -> None:
    """One point per layout (``predicted_s``, ``measured_s``, ``world``, ``label``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 6))
    # 4-rank labels to the right of their point, 8-rank labels to the left (they often meet).
    for world, marker, dx, align in ((4, "o", 5, "left"), (8, "s", -5, "right")):
        pts = [r for r in rows if r["world"] == world]
        ax.scatter([r["predicted_s"] for r in pts], [r["measured_s"] for r in pts],
                   marker=marker, label=f"{world} ranks")  # fmt: skip
        for r in pts:
            ax.annotate(r["label"], (r["predicted_s"], r["measured_s"]), fontsize=7,
                        xytext=(dx, -3), textcoords="offset points", ha=align)  # fmt: skip
    hi = max(v for r in rows for v in (r["predicted_s"], r["measured_s"])) * 1.15
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="measured = predicted")
    ax.set(xlim=(0, hi), ylim=(0, hi),
           xlabel="predicted step time (s)", ylabel="measured step time (s, median)",
           title="Layout advisor's step-time model vs CPU runs (gloo)")  # fmt: skip
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
