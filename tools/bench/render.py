"""Render the stored results (``docs/bench/*.json``) into docs/benchmarks.md (only between its
``<!-- bench:NAME:begin -->`` and ``<!-- bench:NAME:end -->`` markers), docs/benchmarks.json and
docs/advisor.png, without measuring. Run: ``.venv/bin/python tools/bench/render.py``.
"""

from __future__ import annotations

import datetime
import json

from common import DOCS, machine_info

ORDER = (
    "single",
    "tp",
    "compile",
    "pp",
    "zero",
    "dp_comm",
    "checkpoint",
    "memory",
    "advisor",
    "cp",
    "data",
    "moe",
    "moe_dispatch",
    "packed",
)
PAGE = DOCS / "benchmarks.md"
COMBINED = DOCS / "benchmarks.json"


def cell(value: object, fmt: str) -> str:
    """``value`` formatted with the format spec ``fmt`` (a trailing ``x`` stays as a suffix);
    lists are joined with `` / ``, None is empty, booleans are yes / no."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return " / ".join(cell(v, fmt) for v in value)
    if isinstance(value, str) or not fmt:
        return str(value)
    if len(fmt) > 1 and fmt.endswith("x"):
        return format(value, fmt[:-1]) + "x"
    return format(value, fmt)


def markdown_table(t: dict) -> str:
    heads, fmts = zip(*t["columns"], strict=True)
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in t["rows"]:
        lines.append("| " + " | ".join(cell(v, f) for v, f in zip(row, fmts, strict=True)) + " |")
    return f"**{t['caption']}**\n\n" + "\n".join(lines)


def section_block(sec: dict) -> str:
    """The generated part of one benchmark: when and where it ran, its tables and facts."""
    m = sec["machine"]
    quick = " (`--quick`)." if sec.get("quick") else "."
    parts = [
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
        f"1-minute load average {m.get('loadavg_1m') or 0:.1f} at the end, in "
        f"{sec['seconds']:.0f} s{quick}"
    ]
    parts += [markdown_table(t) for t in sec["tables"]]
    if sec.get("facts"):
        parts.append("\n".join(f"- {label}: {cell(v, f)}" for label, v, f in sec["facts"]))
    return "\n\n".join(parts)


def replace_block(page: str, name: str, body: str, title: str) -> str:
    """``page`` with the block ``name`` replaced by ``body`` (appended under ``title`` if new)."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    if begin not in page:
        return f"{page.rstrip()}\n\n## {title}\n\n{begin}\n{body}\n{end}\n"
    head, rest = page.split(begin, 1)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def run_block(run: dict | None) -> str:
    m = (run or {}).get("machine") or machine_info()
    text = f"Machine: {m['cpu']} ({m['cores']} cores), torch {m['torch']}, Python {m['python']}."
    if run:
        text += f" Last `make bench` ({run['machine']['date']}): {', '.join(run['ran'])} in "
        text += f"{run['total_seconds']:.0f} s"
        failed = ", ".join(run["failed"])
        text += f"; failed (tables from their last good run): {failed}." if failed else "."
    return text


def draw_advisor(rows: list[dict], path) -> None:
    """Predicted vs measured step time, one point per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 6))
    # 4-rank labels to the right of their point, 8-rank labels to the left (they often meet).
    for world, marker, dx, align in ((4, "o", 5, "left"), (8, "s", -5, "right")):
        pts = [r for r in rows if r["world"] == world]
        ax.scatter(
            [r["predicted_s"] for r in pts],
            [r["measured_s"] for r in pts],
            marker=marker,
            label=f"{world} ranks",
        )
        for r in pts:
            ax.annotate(
                r["label"],
                (r["predicted_s"], r["measured_s"]),
                fontsize=7,
                xytext=(dx, -3),
                textcoords="offset points",
                ha=align,
            )
    hi = max(v for r in rows for v in (r["predicted_s"], r["measured_s"])) * 1.15
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="measured = predicted")
    ax.set(
        xlim=(0, hi),
        ylim=(0, hi),
        xlabel="predicted step time (s)",
        ylabel="measured step time (s, median)",
        title="Layout advisor's step-time model vs CPU runs (gloo)",
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(run: dict | None = None) -> None:
    """Rewrite the generated blocks, docs/benchmarks.json and the plot from the stored results;
    ``run``: what ``run_all.py`` just ran (default: the last run in benchmarks.json)."""
    paths = {n: DOCS / "bench" / f"{n}.json" for n in ORDER}
    sections = {n: json.loads(p.read_text()) for n, p in paths.items() if p.exists()}
    if run is None and COMBINED.exists():
        run = json.loads(COMBINED.read_text()).get("run")
    page = replace_block(PAGE.read_text(), "run", run_block(run), "Benchmarks")
    for name, sec in sections.items():
        page = replace_block(page, name, section_block(sec), sec["title"])
    PAGE.write_text(page)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    combined = {"generated": now, "run": run, "sections": sections}
    COMBINED.write_text(json.dumps(combined, indent=2) + "\n")
    if "advisor" in sections:
        draw_advisor(sections["advisor"]["results"]["rows"], DOCS / "advisor.png")
    print(f"rendered {len(sections)} benchmarks into docs/benchmarks.md and docs/benchmarks.json")


if __name__ == "__main__":
    render()
