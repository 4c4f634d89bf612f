"""The results page's charts, drawn with matplotlib from ``bench/run.py``'s JSON (never a dependency of distfn:
matplotlib is in the ``bench`` and ``docs`` extras).

- ``bench-ratios.svg``: every ratio target of the run: distfn's measured ratio as a dot on a line from the floor
  (1.0×, the raw call, drawn as a vertical line), its limit as a bar; a missed target in red.
- ``bench-scaling.svg``: every scaling table (rows ``"<variant>, <N> workers|ranks|MiB|GiB"``): the median against
  N for each variant, the floor at each point dashed, and the band up to the target's limit over the floor shaded,
  so a curve inside the band meets its target at every N.

Both are deterministic for a given JSON and matplotlib (no date, a fixed id salt, text kept as text), so a redraw
of the committed JSON (``python bench/run.py --redraw``) changes nothing unless the numbers or this code did.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ORANGE, GREY, RED, INK = "#d9480f", "#868e96", "#c92a2a", "#1b1b1b"
#: A scaling row: "<variant>, <N> <unit>".
POINT = re.compile(r"^(?P<name>.+), (?P<n>\d+(?:\.\d+)?) (?P<unit>workers?|ranks?|MiB|GiB)$")
NAMES = ("bench-ratios.svg", "bench-scaling.svg")
#: The longest label of the ratio chart (characters at 8 pt in its left 45 %).
LABEL = 50


def _ours(variant: str) -> bool:
    return variant.startswith(("distfn", "ctx."))


def ratio_targets(results: list[dict[str, Any]]) -> list[tuple[str, float, float, bool | None]]:
    """``(label, measured ratio, limit, met)`` of every ratio target with a measurement, in the page's order."""
    found: list[tuple[str, float, float, bool | None]] = []
    for res in results:
        for number, tab in enumerate(res["tables"], 1):
            for t in tab.get("targets", []):
                if "max_ratio" in t and t.get("ratio") is not None:
                    label = f"{res['benchmark']}: {t['variant']}"
                    if any(f[0].startswith(label) for f in found):  # the same call in another table: say which
                        size = re.search(r"\d+ (?:ranks?|workers?)", tab["title"])
                        label += f" ({size.group(0) if size else f'table {number}'})"
                    versus = f" vs {tab.get('baseline') or 'the floor'}"
                    found.append((label + versus if len(label + versus) <= LABEL else label, float(t["ratio"]),
                                  float(t["max_ratio"]), t.get("met")))
    return found


def scaling_tables(results: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """``(benchmark, table, unit of N)`` of every table whose rows are a variant at several points."""
    found = []
    for res in results:
        for tab in res["tables"]:
            matches = [POINT.match(r["variant"]) for r in tab["rows"]]
            if not matches or not all(matches):
                continue
            names = {m["name"] for m in matches if m}
            points = {m["n"] for m in matches if m}
            if len(names) >= 2 and len(points) >= 2:
                found.append((res["benchmark"], tab, matches[0]["unit"].rstrip("s") if matches[0] else ""))
    return found


def _short(text: str, size: int = 70) -> str:
    """``text`` cut to ``size`` characters, as plain text for matplotlib (a ``$`` is not mathtext: an unpaired one
    in a variant's name raised a ValueError from deep inside matplotlib)."""
    return (text if len(text) <= size else text[: size - 1] + "…").replace("$", r"\$")


def _setup() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "distfn-bench", "font.size": 8.5,
                         "font.family": "DejaVu Sans", "axes.edgecolor": GREY, "axes.labelcolor": INK,
                         "xtick.color": INK, "ytick.color": INK, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


#: Inches wide: 7.2 in is 518 pt, shown at 691 px, the width of the docs' content column in a 1280 px window
#: (measured in Chromium), so the charts are shown at their own size and their 8-9 pt text at 11-12 px.
WIDTH = 7.2


def _save(plt: Any, fig: Any, path: Path, title: str) -> None:
    """The figure as SVG at ``path``, with a ``<title>`` (what screen readers and tooltips say)."""
    import io
    from html import escape

    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": "bench/run.py (matplotlib)"})
    plt.close(fig)
    text = buffer.getvalue()
    start = text.index("<svg ")
    end = text.index(">", start) + 1
    path.write_text(f"{text[:end]}\n <title>{escape(title)}</title>{text[end:]}", encoding="utf-8")


def draw_ratios(results: list[dict[str, Any]], path: Path, subtitle: str) -> bool:
    """``bench-ratios.svg``; False (nothing written) when the run has no ratio target."""
    targets = ratio_targets(results)
    if not targets:
        return False
    plt = _setup()
    height = max(1.8, 1.1 + 0.2 * len(targets))  # the margins take 1.3 in: one target alone had no room left
    fig, ax = plt.subplots(figsize=(WIDTH, height))
    fig.subplots_adjust(left=0.45, right=0.97, top=1 - 0.55 / height, bottom=0.75 / height)
    ys = list(range(len(targets)))[::-1]
    top = max(max(r, lim) for _, r, lim, _ in targets) * 1.12
    for y, (_, ratio, limit, met) in zip(ys, targets, strict=True):
        color = RED if met is False else ORANGE if met else GREY
        ax.plot([1.0, ratio], [y, y], color=color, linewidth=1.2)
        ax.plot([ratio], [y], "o", color=color, markersize=4)
        ax.plot([limit, limit], [y - 0.35, y + 0.35], color=INK, linewidth=1.2)
        ax.text(max(ratio, limit, 1.0) + 0.015 * top, y, f"{ratio:.2f}×", ha="left", va="center", fontsize=8,
                color=RED if met is False else INK)
    ax.axvline(1.0, color=INK, linestyle="--", linewidth=0.8)
    ax.set_yticks(ys, [_short(label, LABEL) for label, *_ in targets], fontsize=8)
    ax.set_xlim(0, top)
    ax.set_ylim(-0.8, len(targets) - 0.2)
    ax.set_xlabel("ratio to the floor (dashed: 1.0×, the raw call)\nblack bar: the target's limit; red: missed")
    title = _short(f"Every ratio target: distfn against the floor ({subtitle})", 200)
    fig.text(0.01, 1 - 0.12 / height, title, fontsize=9, va="top", fontweight="bold")
    _save(plt, fig, path, title)
    return True


def draw_scaling(results: list[dict[str, Any]], path: Path, subtitle: str) -> bool:
    """``bench-scaling.svg``; False (nothing written) when the run has no scaling table."""
    tables = scaling_tables(results)
    if not tables:
        return False
    plt = _setup()
    cols = 2
    rows = -(-len(tables) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(WIDTH, 2.9 * rows + 0.5), squeeze=False)
    for ax, (bench, tab, unit) in zip(axes.flat, tables, strict=False):
        curves: dict[str, list[tuple[float, float, float | None]]] = {}
        for row in tab["rows"]:
            m = POINT.match(row["variant"])
            if m and row["median"] is not None:
                curves.setdefault(m["name"], []).append((float(m["n"]), float(row["median"]), row.get("ratio")))
        floors = [n for n, pts in curves.items() if all(r is not None and abs(r - 1.0) < 1e-9 for *_, r in pts)]
        floor = floors[0] if len(floors) == 1 else None
        limits = {t["variant"].rsplit(", ", 1)[0]: t["max_ratio"] for t in tab.get("targets", []) if "max_ratio" in t}
        if floor is not None and limits:
            xs, ys = zip(*[(n, v) for n, v, _ in sorted(curves[floor])], strict=True)
            limit = max(limits.values())
            ax.fill_between(xs, ys, [v * limit for v in ys], color=ORANGE, alpha=0.12, linewidth=0,
                            label=f"within the target (≤ {limit:g}× the floor)")
        for name, pts in curves.items():
            xs, ys = zip(*[(n, v) for n, v, _ in sorted(pts)], strict=True)
            if name == floor:
                ax.plot(xs, ys, "--", color=INK, linewidth=1.2, marker="s", markersize=3,
                        label=_short(f"floor: {name}"))
            elif _ours(name):
                ax.plot(xs, ys, color=ORANGE, linewidth=2, marker="o", markersize=4, label=_short(name))
            else:
                ax.plot(xs, ys, color=GREY, linewidth=1, marker="o", markersize=3, label=_short(name))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({n for pts in curves.values() for n, *_ in pts}))
        ax.get_xaxis().set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.minorticks_off()
        if unit in ("MiB", "GiB"):
            ax.set_yscale("log")
        ax.set_xlabel(f"{unit}s" if unit in ("worker", "rank") else unit)
        ax.set_ylabel(_short(f"median ({tab['unit']})"))
        ax.set_title(_short(f"{bench}: {tab['title']}", 50), fontsize=8, loc="left")
        ax.legend(fontsize=7.5, frameon=False)
    for ax in list(axes.flat)[len(tables):]:
        ax.set_visible(False)
    title = _short(f"Scaling: distfn against the floor at each point ({subtitle})", 200)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left", fontweight="bold")
    fig.tight_layout()
    _save(plt, fig, path, title)
    return True


def draw(results: list[dict[str, Any]], machine: dict[str, Any], directory: Path) -> list[str]:
    """Draw both charts into ``directory``; the names of those written ([] without matplotlib: a warning)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench/run.py: no charts (matplotlib is not installed: pip install -e '.[bench]')", flush=True)
        return []
    separate = "".join(f"; {r['benchmark']} at {r['run'].get('commit', '?')}" for r in results if r.get("run"))
    subtitle = (f"commit {machine.get('commit', '?')}{separate}, {machine.get('cpus', '?')} CPUs, "
                f"torch {machine.get('torch', '?')}")
    directory.mkdir(parents=True, exist_ok=True)
    drawn = []
    if draw_ratios(results, directory / NAMES[0], subtitle):
        drawn.append(NAMES[0])
    if draw_scaling(results, directory / NAMES[1], subtitle):
        drawn.append(NAMES[1])
    return drawn
