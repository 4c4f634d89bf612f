"""Run every benchmark in ``bench/`` in one go: one table per benchmark, then a summary of medians, ratios
and targets; JSON into ``bench/results/``; the documentation's results page from the same run.

    python bench/run.py                 # everything, default rounds (30-40 minutes on 2 cores): rewrites the docs
    python bench/run.py --rounds 3      # quicker, noisier: rewrites the docs too
    python bench/run.py --only launch,step   # JSON only: the docs keep the results of one whole run
    python bench/run.py --tiny          # one tiny round of each: a smoke test, results not kept in docs/
    python bench/run.py --redraw        # run nothing: redraw the page and its charts from the committed JSON

Each ``bench/bench_<name>.py`` runs in its own fresh process (so no benchmark inherits another's threads or
imports), with ``--json PATH`` and ``--tiny``/``--rounds`` (the convention in ``bench/_common.py``); inside
each, the variants are interleaved over rounds. ``docs/assets/benchmarks.md`` (included by
docs/benchmarks.md) is rewritten only by a run of every benchmark, so every figure on the page comes from one
commit, stated at its top. The same run's JSON is kept beside it (``docs/assets/benchmarks.json``), and
``bench/charts.py`` draws its charts with matplotlib (the ``bench`` extra; without it the page has no charts and
says nothing false): every ratio target against the floor, and the scaling curves with the floor drawn. Below
them, one bar chart per question, drawn as an HTML table (legible at any size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c
import charts

_common = c

#: Benchmarks in the order they are shown; any other bench_*.py found is run after these.
ORDER = ("launch", "import", "step", "checkpoint", "sharded", "collectives", "restart", "accumulation")
RESULTS = c.BENCH_DIR / "results"
ASSETS = c.REPO / "docs" / "assets"
#: The JSON of the run the docs show (committed: ``--redraw`` redraws the page and its charts from it).
PUBLISHED = ASSETS / "benchmarks.json"
#: What each chart shows, for its alt text (`bench/charts.py` draws them).
CHART_ALT = {
    "bench-ratios.svg": "Every ratio target of this run: distfn's measured ratio against the floor (1.0×) and the "
                        "target's limit, missed targets in red",
    "bench-scaling.svg": "Scaling curves: distfn's median against the floor's at each number of workers, ranks or "
                         "size, with the band its target allows",
}


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


def _bar_table(tab: dict[str, Any]) -> str:
    """One question as an HTML table: each variant's median as a bar (distfn's in orange), ratio beside it."""
    rows = [r for r in tab["rows"] if r["median"] is not None]
    if not rows:
        return ""
    longest = max(r["median"] for r in rows) or 1.0
    versus = f"ratio vs {tab['baseline']}" if tab.get("baseline") else "ratio"
    out = ['<table class="bench-bars">',
           f"<tr><th>variant</th><th>median</th><th>{versus}</th><th>runs</th><th style='width:45%'></th></tr>"]
    for r in rows:
        ours = r["variant"].startswith(("distfn", "ctx."))
        color = "#d9480f" if ours else "#868e96"
        ratio = f"{r['ratio']:.2f}×" if r.get("ratio") is not None else ""
        width = max(0.5, 100 * r["median"] / longest)
        name = f"<b>{r['variant']}</b>" if ours else r["variant"]
        out.append(f"<tr><td>{name}</td><td align='right'>{c._fmt(r['median'], tab['unit'])}</td>"
                   f"<td align='right'>{ratio}</td><td align='right'>{r.get('runs', len(r['samples']))}</td>"
                   f"<td><div style='background:{color};width:{width:.1f}%;height:0.9em'></div></td></tr>")
    out.append("</table>")
    return "\n".join(out)


def markdown(results: list[dict[str, Any]], machine: dict[str, Any], charts: Sequence[str] = ()) -> str:
    """The results page the documentation includes: where and when (one commit), the targets, the charts drawn
    (`bench/charts.py`: names under docs/assets/), then one bar chart per question with its table."""
    load = machine.get("load")
    md = [f"All figures below come from one run of `python bench/run.py` at commit `{machine.get('commit', '?')}`, "
          f"{machine.get('when', '?')}, on `{machine.get('host', '?')}`: {machine.get('cpus', '?')} CPUs, no GPU, "
          f"torch {machine.get('torch', '?')}, Python {machine.get('python', '?')}. "
          + (f"Load average {load} when the run started" if load else "")
          + (f", {machine['load_end']} when it ended" if machine.get("load_end") else "")
          + (" (1-, 5- and 15-minute averages on these CPUs)" if load else "")
          + (f"; the run took {machine['minutes']} minutes" if machine.get("minutes") else "")
          + (". " if load or machine.get("minutes") else "")
          + "Absolute times vary from run to run, the ratios (variants interleaved round by round) much less.",
          "", "| benchmark | target | measured | met? |", "| --- | --- | ---: | --- |"]
    for res in results:
        for tab in res["tables"]:
            for t in tab.get("targets", []):
                goal, got, verdict = c.describe_target(t, tab)
                verdict = "**missed**" if verdict == "MISSED" else verdict
                md.append(f"| {res['benchmark']} | {t['variant']} {goal} | {got} | {verdict} |")
    md.append("")
    for name in charts:
        md += [f"![{CHART_ALT[name]}](assets/{name})", ""]
    for res in results:
        md.append(f"### {res['benchmark']}\n")
        if res.get("error"):
            md.append(f"**{res['error']}**\n")
        for tab in res["tables"]:
            md.append(f"**{tab['title']}**\n")
            md.append(_bar_table(tab) + "\n")
            notes = [f"{row['variant']}: {row['note']}" for row in tab["rows"] if row.get("note")]
            md += [f"- {n}" for n in notes] + ([""] if notes else [])
        md += [f"- {n}" for n in res.get("notes", [])] + [""]
    return "\n".join(md) + "\n"


def publish(combined: dict[str, Any]) -> None:
    """The docs' results from one whole run: its JSON (`PUBLISHED`), the charts and the page that shows them."""
    ASSETS.mkdir(parents=True, exist_ok=True)
    PUBLISHED.write_text(json.dumps(combined, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    drawn = charts.draw(combined["benchmarks"], combined["machine"], ASSETS)
    (ASSETS / "benchmarks.md").write_text(markdown(combined["benchmarks"], combined["machine"], drawn))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run all distfn benchmarks side by side.")
    p.add_argument("--only", default="", help="comma-separated subset, e.g. launch,step")
    p.add_argument("--rounds", type=int, default=None, help="rounds for every benchmark (default: each its own)")
    p.add_argument("--tiny", action="store_true", help="one tiny round of each (smoke test); docs/ untouched")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per benchmark")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    p.add_argument("--redraw", action="store_true",
                   help="run nothing: redraw the docs' results page and charts from docs/assets/benchmarks.json")
    p.add_argument("--peers-python", default=None,
                   help="interpreter with accelerate / lightning / ignite installed, for the launch and import peers")
    args = p.parse_args(argv)
    if args.redraw:
        publish(json.loads(PUBLISHED.read_text(encoding="utf-8")))
        return 0
    names = discover()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            p.error(f"unknown benchmark(s) {unknown}; present: {names}")
        names = [n for n in names if n in wanted]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    machine = {**c.machine(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    parts = args.out / f"parts-{stamp}"
    results = [run_one(n, parts / f"{n}.json", args.tiny, args.rounds, args.timeout, args.peers_python)
               for n in names]
    machine["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    machine["minutes"] = round(sum(r.get("seconds", 0) for r in results) / 60, 1)
    table = summary(results)
    print("## Summary\n\n" + table, flush=True)
    combined = {"machine": machine, "tiny": args.tiny, "benchmarks": results}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench-{stamp}{'-tiny' if args.tiny else ''}.json"
    out.write_text(json.dumps(combined, indent=2, default=str) + "\n")
    for f in parts.glob("*.json"):
        f.unlink()
    parts.rmdir() if parts.exists() else None
    c.log(f"results: {out}")
    if args.tiny:
        drawn = charts.draw(results, combined["machine"], args.out)
        (args.out / "tiny-benchmarks.md").write_text(markdown(results, combined["machine"], drawn))
    elif not args.only:  # (a benchmark added to bench/ while this ran is not a reason to keep old figures)
        # Only a run of every benchmark rewrites the docs: every figure there then comes from one commit.
        (args.out / "latest.json").write_text(json.dumps(combined, indent=2, default=str) + "\n")
        publish(json.loads(json.dumps(combined, default=str)))
        c.log(f"docs: {ASSETS / 'benchmarks.md'}, its charts and {PUBLISHED.name}")
    else:
        c.log("--only: the docs keep the results of the last whole run (one commit for every figure)")
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
