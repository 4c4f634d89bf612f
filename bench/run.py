"""Run every benchmark in ``bench/`` in one go: one table per benchmark, then a summary of medians, ratios
and targets; JSON into ``bench/results/``; a chart into ``docs/assets/`` when matplotlib is installed.

    python bench/run.py                 # everything, default rounds (~15 minutes on 2 cores)
    python bench/run.py --rounds 3      # quicker, noisier
    python bench/run.py --only launch,step
    python bench/run.py --tiny          # one tiny round of each: a smoke test, results not kept in docs/

Each ``bench/bench_<name>.py`` runs in its own fresh process (so no benchmark inherits another's threads or
imports), with ``--json PATH`` and ``--tiny``/``--rounds`` (the convention in ``bench/_common.py``); inside
each, the variants are interleaved over rounds. The chart (``docs/assets/benchmarks.png``) and the Markdown
table (``docs/assets/benchmarks.md``) that the documentation shows are rewritten by a full run only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

_common = c

#: Benchmarks in the order they are shown; any other bench_*.py found is run after these.
ORDER = ("launch", "import", "step", "checkpoint", "accumulation")
RESULTS = c.BENCH_DIR / "results"
ASSETS = c.REPO / "docs" / "assets"


def discover() -> list[str]:
    """Names of the benchmarks present (``bench/bench_<name>.py``), in display order."""
    found = sorted(p.stem.removeprefix("bench_") for p in c.BENCH_DIR.glob("bench_*.py"))
    return [n for n in ORDER if n in found] + [n for n in found if n not in ORDER]


#: Benchmarks that compare against peers installed in another interpreter (``--peers-python``).
WITH_PEERS = ("launch", "import", "step")


def run_one(name: str, json_path: Path, tiny: bool, rounds: int | None, timeout: float,
            peers_python: str | None = None) -> dict[str, Any]:
    """Run ``bench_<name>.py`` in a fresh process; its tables (or an error record) as a dict."""
    cmd = [sys.executable, str(c.BENCH_DIR / f"bench_{name}.py"), "--json", str(json_path)]
    if peers_python and name in WITH_PEERS:
        cmd += ["--peers-python", peers_python]
    if tiny:
        cmd.append("--tiny")
    elif rounds is not None:
        cmd += ["--rounds", str(rounds)]
    c.log(f"== {name}: {' '.join(cmd[1:])}")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=c.clean_env(), timeout=timeout, stdout=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return {"benchmark": name, "tables": [], "error": f"timed out after {timeout:.0f} s"}
    elapsed = time.perf_counter() - start
    print(proc.stdout, end="", flush=True)
    if json_path.exists():
        result = json.loads(json_path.read_text())
    else:
        result = {"benchmark": name, "tables": []}
    if proc.returncode != 0:
        result["error"] = f"exited with status {proc.returncode}"
    result.setdefault("benchmark", name)
    result.setdefault("tables", [])
    result["seconds"] = round(elapsed, 1)
    return result


def summary(results: list[dict[str, Any]]) -> str:
    """One Markdown table over all benchmarks: each variant's median and ratio, and the targets."""
    lines = ["| benchmark | variant | median | ratio | target |", "| --- | --- | ---: | ---: | --- |"]
    for res in results:
        if res.get("error"):
            lines.append(f"| {res['benchmark']} | **{res['error']}** | | | |")
        for tab in res["tables"]:
            goals = {t["variant"]: t for t in tab.get("targets", [])}
            for row in tab["rows"]:
                goal = goals.get(row["variant"])
                target = ""
                if goal is not None:
                    limit, _, verdict = c.describe_target(goal, tab)
                    target = f"{limit}: {verdict}"
                ratio = f"{row['ratio']:.3f}×" if row.get("ratio") is not None else ""
                lines.append(f"| {res['benchmark']} | {row['variant']} | {c._fmt(row['median'], tab['unit'])} | "
                             f"{ratio} | {target} |")
    return "\n".join(lines)


def chart(results: list[dict[str, Any]], path: Path) -> Path | None:
    """One horizontal bar chart per table (medians, ratio labels); ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        c.log("matplotlib is not installed (pip install 'distfn[bench]'): no chart")
        return None
    tables = [t for r in results for t in r["tables"] if any(row["median"] is not None for row in t["rows"])]
    if not tables:
        return None
    cols = 2 if len(tables) > 3 else 1
    grid = [tables[i:i + cols] for i in range(0, len(tables), cols)]
    heights = [max(len(t["rows"]) for t in row) + 2 for row in grid]
    fig, axes = plt.subplots(len(grid), cols, figsize=(9 * cols, 0.5 + 0.42 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax in axes.flat[len(tables):]:
        ax.set_visible(False)
    for ax, tab in zip(axes.flat, tables, strict=False):  # spare axes hidden above
        rows = [r for r in tab["rows"] if r["median"] is not None]
        small = tab["unit"] == "s" and max(r["median"] for r in rows) < 1
        scale, unit = (1000.0, "ms") if small else (1.0, tab["unit"])
        values = [r["median"] * scale for r in rows]
        colors = ["#d9480f" if r["variant"].startswith(("distfn", "ctx.")) else "#868e96" for r in rows]
        bars = ax.barh([r["variant"] for r in rows], values, color=colors)
        ax.invert_yaxis()
        for bar, r in zip(bars, rows, strict=True):
            label = f" {bar.get_width():.3g} {unit}" + (f"  ({r['ratio']:.2f}×)" if r.get("ratio") is not None else "")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
        ax.set_title(tab["title"], fontsize=9, loc="left")
        ax.set_xlabel(f"median ({unit}), lower is better", fontsize=8)
        ax.set_xlim(0, max(values) * 1.35)
        ax.tick_params(labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge(latest: Path, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The benchmarks of ``latest`` (a previous run.py JSON) with those in ``results`` replaced, in display order.
    A benchmark that failed this time keeps its previous result."""
    by_name: dict[str, dict[str, Any]] = {}
    if latest.exists():
        try:
            by_name = {b["benchmark"]: b for b in json.loads(latest.read_text()).get("benchmarks", [])}
        except (ValueError, KeyError, TypeError):
            by_name = {}
    for res in results:
        if not res.get("error") or res["benchmark"] not in by_name:
            by_name[res["benchmark"]] = res
    order = [n for n in ORDER if n in by_name] + sorted(n for n in by_name if n not in ORDER)
    return [by_name[n] for n in order]


def markdown(results: list[dict[str, Any]]) -> str:
    """The tables the documentation includes, each benchmark with where and when it was measured."""
    md = ["| benchmark | target | measured | |", "| --- | --- | ---: | --- |"]
    for res in results:
        for tab in res["tables"]:
            for t in tab.get("targets", []):
                goal, got, verdict = c.describe_target(t, tab)
                verdict = "**missed**" if verdict == "MISSED" else verdict
                md.append(f"| {res['benchmark']} | {t['variant']} {goal} | {got} | {verdict} |")
    md.append("")
    for res in results:
        m = res.get("machine", {})
        md.append(f"### {res['benchmark']}\n")
        md.append(f"Measured {m.get('when', '?')} on `{m.get('host', '?')}` ({m.get('cpus', '?')} CPUs, torch "
                  f"{m.get('torch', '?')}, Python {m.get('python', '?')}, commit {m.get('commit', '?')}).\n")
        if res.get("error"):
            md.append(f"**{res['error']}**\n")
        md += [c.format_table(t) + "\n" for t in res["tables"]]
        md += [f"- {n}" for n in res.get("notes", [])] + [""]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run all distfn benchmarks side by side.")
    p.add_argument("--only", default="", help="comma-separated subset, e.g. launch,step")
    p.add_argument("--rounds", type=int, default=None, help="rounds for every benchmark (default: each its own)")
    p.add_argument("--tiny", action="store_true", help="one tiny round of each (smoke test); docs/ untouched")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per benchmark")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    p.add_argument("--redraw", action="store_true",
                   help="run nothing: redraw the docs' chart and tables from bench/results/latest.json")
    p.add_argument("--peers-python", default=None,
                   help="interpreter with accelerate / lightning / ignite installed, for the launch and import peers")
    args = p.parse_args(argv)
    if args.redraw:
        merged = merge(args.out / "latest.json", [])
        chart(merged, ASSETS / "benchmarks.png")
        (ASSETS / "benchmarks.md").write_text(markdown(merged))
        return 0
    names = discover()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            p.error(f"unknown benchmark(s) {unknown}; present: {names}")
        names = [n for n in names if n in wanted]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parts = args.out / f"parts-{stamp}"
    results = [run_one(n, parts / f"{n}.json", args.tiny, args.rounds, args.timeout, args.peers_python)
               for n in names]
    table = summary(results)
    print("## Summary\n\n" + table, flush=True)
    combined = {"machine": c.machine(), "tiny": args.tiny, "benchmarks": results}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench-{stamp}{'-tiny' if args.tiny else ''}.json"
    out.write_text(json.dumps(combined, indent=2, default=str) + "\n")
    for f in parts.glob("*.json"):
        f.unlink()
    parts.rmdir() if parts.exists() else None
    c.log(f"results: {out}")
    if not args.tiny:
        # latest.json keeps the newest result of every benchmark, so `--only step` refreshes just that part
        merged = merge(args.out / "latest.json", results)
        (args.out / "latest.json").write_text(json.dumps({"machine": combined["machine"], "benchmarks": merged},
                                                         indent=2, default=str) + "\n")
        drawn = chart(merged, ASSETS / "benchmarks.png")
        if drawn:
            c.log(f"chart: {drawn}")
        ASSETS.mkdir(parents=True, exist_ok=True)
        (ASSETS / "benchmarks.md").write_text(markdown(merged))
    else:
        chart(results, args.out / "tiny-chart.png")
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
