"""Run every benchmark in ``bench/`` in one go: one table per benchmark, then a summary of medians, ratios
and targets; JSON into ``bench/results/``; the documentation's results page from the same run.

    python bench/run.py                 # everything, default rounds (30-40 minutes on 2 cores): rewrites the docs
    python bench/run.py --rounds 3      # quicker, noisier: rewrites the docs too
    python bench/run.py --only launch,step   # JSON only: the docs keep the results of one whole run
    python bench/run.py --only mesh --add    # these benchmarks' sections of the docs replaced, each stamped
    python bench/run.py --tiny          # one tiny round of each: a smoke test, results not kept in docs/
    python bench/run.py --redraw        # run nothing: redraw the page and its charts from the committed JSON

Each ``bench/bench_<name>.py`` runs in its own fresh process (so no benchmark inherits another's threads or
imports), with ``--json PATH`` and ``--tiny``/``--rounds`` (the convention in ``bench/_common.py``); inside
each, the variants are interleaved over rounds. ``docs/assets/benchmarks.md`` (included by
docs/benchmarks.md) is rewritten only by a run of every benchmark, so every figure on the page comes from one
commit, stated at its top; ``--only NAMES --add`` replaces (or adds) those benchmarks' sections alone, and the page
then states, on each such section, the run it came from (commit, time, load) and, at its top, that those sections
are not the whole run's. The same run's JSON is kept beside it (``docs/assets/benchmarks.json``), and
``bench/charts.py`` draws its charts with matplotlib (the ``bench`` extra; without it the page has no charts and
says nothing false): every ratio target against the floor, and the scaling curves with the floor drawn. Below
them, one bar chart per question, drawn as an HTML table (legible at any size).
"""

from __future__ import annotations

import argparse
import html
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


def _h(text: object) -> str:
    """A text of the results as page text: ``<PRELOAD>`` in a variant's name was read by the browser as a tag (and
    not shown), ``|`` would end a table cell."""
    return html.escape(str(text), quote=False).replace("|", "&#124;")


def _bar_table(tab: dict[str, Any]) -> str:
    """One question as an HTML table: each variant's median as a bar (distfn's in orange), ratio beside it."""
    rows = [r for r in tab["rows"] if r["median"] is not None]
    if not rows:
        return ""
    longest = max(r["median"] for r in rows) or 1.0
    versus = f"ratio vs {_h(tab['baseline'])}" if tab.get("baseline") else "ratio"
    out = ['<table class="bench-bars">',
           f"<tr><th>variant</th><th>median</th><th>{versus}</th><th>runs</th><th style='width:45%'></th></tr>"]
    for r in rows:
        ours = r["variant"].startswith(("distfn", "ctx."))
        color = "#d9480f" if ours else "#868e96"
        ratio = f"{r['ratio']:.2f}×" if r.get("ratio") is not None else ""
        width = max(0.5, 100 * r["median"] / longest)
        name = f"<b>{_h(r['variant'])}</b>" if ours else _h(r["variant"])
        out.append(f"<tr><td>{name}</td><td align='right'>{c._fmt(r['median'], tab['unit'])}</td>"
                   f"<td align='right'>{ratio}</td><td align='right'>{r.get('runs', len(r['samples']))}</td>"
                   f"<td><div style='background:{color};width:{width:.1f}%;height:0.9em'></div></td></tr>")
    out.append("</table>")
    return "\n".join(out)


def markdown(results: list[dict[str, Any]], machine: dict[str, Any], charts: Sequence[str] = ()) -> str:
    """The results page the documentation includes: where and when (one commit), the targets, the charts drawn
    (`bench/charts.py`: names under docs/assets/), then one bar chart per question with its table."""
    load = machine.get("load")
    separate = [res["benchmark"] for res in results if res.get("run")]
    md = [f"All figures below come from one run of `python bench/run.py` at commit `{machine.get('commit', '?')}`, "
          f"{machine.get('when', '?')}, on `{machine.get('host', '?')}`: {machine.get('cpus', '?')} CPUs, no GPU, "
          f"torch {machine.get('torch', '?')}, Python {machine.get('python', '?')}. "
          + (f"Load average {load} when the run started" if load else "")
          + (f", {machine['load_end']} when it ended" if machine.get("load_end") else "")
          + (" (1-, 5- and 15-minute averages on these CPUs)" if load else "")
          + (f"; the run took {machine['minutes']} minutes" if machine.get("minutes") else "")
          + (". " if load or machine.get("minutes") else "")
          + "Absolute times vary from run to run, the ratios (variants interleaved round by round) much less."
          + ("" if not separate else f" Except the section(s) {', '.join(f'**{_h(n)}**' for n in separate)}: "
             "each comes from a later run of that benchmark alone (`python bench/run.py --only NAME --add`), "
             "whose commit and load it states."),
          "", "| benchmark | target | measured | met? |", "| --- | --- | ---: | --- |"]
    for res in results:
        for tab in res["tables"]:
            for t in tab.get("targets", []):
                goal, got, verdict = c.describe_target(t, tab)
                verdict = "**missed**" if verdict == "MISSED" else verdict
                md.append(f"| {_h(res['benchmark'])} | {_h(t['variant'])} {_h(goal)} | {got} | {verdict} |")
    md.append("")
    for name in charts:
        md += [f"![{CHART_ALT[name]}](assets/{name})", ""]
    for res in results:
        md.append(f"### {_h(res['benchmark'])}\n")
        if res.get("run"):
            md.append(_separate_run(res["benchmark"], res["run"]) + "\n")
        if res.get("error"):
            md.append(f"**{_h(res['error'])}**\n")
        for tab in res["tables"]:
            md.append(f"**{_h(tab['title'])}**\n")
            md.append(_bar_table(tab) + "\n")
            notes = [_h(f"{row['variant']}: {row['note']}") for row in tab["rows"] if row.get("note")]
            md += [f"- {n}" for n in notes] + ([""] if notes else [])
        md += [f"- {_h(n)}" for n in res.get("notes", [])] + [""]
    return "\n".join(md) + "\n"


def _separate_run(name: str, run: dict[str, Any]) -> str:
    """The line under a section that ``--add`` put on the page: which run measured it."""
    load = (f"; load average {_h(run['load'])} when it started" if run.get("load") else "") + (
        f", {_h(run['load_end'])} when it ended" if run.get("load_end") else "")
    command = run.get("command") or f"python bench/run.py --only {name} --add"
    return (f"*A separate run of this benchmark alone* (`{_h(command)}`) at commit "
            f"`{_h(run.get('commit', '?'))}`, {_h(run.get('when', '?'))}{load}.")


def added(published: dict[str, Any], results: list[dict[str, Any]], machine: dict[str, Any],
          command: str | None = None) -> dict[str, Any]:
    """``published`` (a whole run's results) with ``results`` in place of the same benchmarks' (a benchmark the
    whole run lacks goes last), each stamped with the run that measured it (``"run"``: its commit, time, load
    and ``command``), so that the page never credits these figures to the whole run's commit."""
    stamp = {k: str(machine[k]) for k in ("commit", "when", "load", "load_end") if machine.get(k)}
    if command:
        stamp["command"] = command
    fresh = {r["benchmark"]: {**r, "run": stamp} for r in results}
    merged = [fresh.pop(r["benchmark"], r) for r in published["benchmarks"]]
    return {**published, "benchmarks": merged + list(fresh.values())}


# -- reading the published JSON back (--redraw): a damaged file is a clear error, never a traceback from matplotlib
#: The largest results JSON ``--redraw`` reads (a whole run's is about 100 kB).
MAX_PUBLISHED = 16 << 20
#: The most benchmarks, tables per benchmark, rows or targets per table, samples per row or notes (a run has at
#: most 15, 6, 12, 40): a chart of more is no chart anyone reads, and drawing it would take minutes.
MAX_ITEMS = 500
#: The largest number drawn: a median, ratio or limit beyond it is a damaged file (matplotlib overflows near 1e300).
LARGEST = 1e12


class BadResults(ValueError):
    """``docs/assets/benchmarks.json`` is not what a run of ``bench/run.py`` writes; the message names where."""


def _kind(value: Any, expected: type | tuple[type, ...], where: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return value
    if (isinstance(value, bool) and expected is not bool) or not isinstance(value, expected):
        raise BadResults(f"{where} is {_shown(value)}, not {_names(expected)}{' or null' if optional else ''}")
    if isinstance(value, float | int) and not isinstance(value, bool) and not -LARGEST <= value <= LARGEST:
        raise BadResults(f"{where} is {_shown(value)}, not a finite number within ±{LARGEST:g}")
    if isinstance(value, list) and len(value) > MAX_ITEMS:
        raise BadResults(f"{where} holds {len(value):,} items, more than a run writes (at most {MAX_ITEMS})")
    return value


def _names(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    words = {str: "a text", int: "an integer", float: "a number", list: "a list", dict: "an object", bool: "true/false"}
    return " or ".join(words.get(k, k.__name__) for k in kinds)


def _shown(value: Any) -> str:
    text = json.dumps(value, allow_nan=True)[:60] if not isinstance(value, dict | list) else type(value).__name__
    return text


def check_results(combined: Any) -> dict[str, Any]:
    """``combined`` when it has the shape ``bench/run.py`` writes (every field the page and charts read, of its
    kind, numbers finite and at most `LARGEST`, lists at most `MAX_ITEMS` long), else `BadResults` naming the first
    field that is not."""
    num = (int, float)
    _kind(combined, dict, "the file")
    benchmarks = combined.get("benchmarks")
    if isinstance(benchmarks, list):  # in all: the ratio chart is 0.2 in a target, the page a table a row
        rows = sum(len(t.get("rows") or []) + len(t.get("targets") or []) for r in benchmarks if isinstance(r, dict)
                   for t in (r.get("tables") or []) if isinstance(t, dict) and isinstance(t.get("rows") or [], list)
                   and isinstance(t.get("targets") or [], list))
        if rows > MAX_ITEMS * 4:
            raise BadResults(f"the tables hold {rows:,} rows and targets in all, more than a run writes (at most "
                             f"{MAX_ITEMS * 4:,})")
    _kind(combined.get("machine"), dict, "machine")
    for res_at, res in enumerate(_kind(combined.get("benchmarks"), list, "benchmarks")):
        where = f"benchmarks[{res_at}]"
        _kind(res, dict, where)
        _kind(res.get("benchmark"), str, f"{where}.benchmark")
        _kind(res.get("error"), str, f"{where}.error", optional=True)
        for key, value in _kind(res.get("run", {}), dict, f"{where}.run").items():
            _kind(value, str, f"{where}.run.{key}")
        for i, note in enumerate(_kind(res.get("notes", []), list, f"{where}.notes")):
            _kind(note, str, f"{where}.notes[{i}]")
        for tab_at, tab in enumerate(_kind(res.get("tables"), list, f"{where}.tables")):
            at = f"{where}.tables[{tab_at}]"
            _kind(tab, dict, at)
            for key in ("title", "unit"):
                _kind(tab.get(key), str, f"{at}.{key}")
            _kind(tab.get("baseline"), str, f"{at}.baseline", optional=True)
            for i, row in enumerate(_kind(tab.get("rows"), list, f"{at}.rows")):
                _kind(row, dict, f"{at}.rows[{i}]")
                _kind(row.get("variant"), str, f"{at}.rows[{i}].variant")
                median = _kind(row.get("median"), num, f"{at}.rows[{i}].median", optional=True)
                if median is not None and median < 0:
                    raise BadResults(f"{at}.rows[{i}].median is {median}, not a time or size (>= 0)")
                for key in ("min", "ratio"):
                    _kind(row.get(key), num, f"{at}.rows[{i}].{key}", optional=True)
                _kind(row.get("runs"), int, f"{at}.rows[{i}].runs", optional=True)
                _kind(row.get("note"), str, f"{at}.rows[{i}].note", optional=True)
                for k, x in enumerate(_kind(row.get("samples", []), list, f"{at}.rows[{i}].samples")):
                    _kind(x, num, f"{at}.rows[{i}].samples[{k}]")
            for i, goal in enumerate(_kind(tab.get("targets", []), list, f"{at}.targets")):
                _kind(goal, dict, f"{at}.targets[{i}]")
                _kind(goal.get("variant"), str, f"{at}.targets[{i}].variant")
                _kind(goal.get("met"), bool, f"{at}.targets[{i}].met", optional=True)
                limit = "max_ratio" if "max_ratio" in goal else "max_value"
                _kind(goal.get(limit), num, f"{at}.targets[{i}].{limit}")
                _kind(goal.get("ratio" if limit == "max_ratio" else "median"), num, f"{at}.targets[{i}]."
                      f"{'ratio' if limit == 'max_ratio' else 'median'}", optional=True)
    return combined


def load_published(path: Path) -> dict[str, Any]:
    """The results JSON at ``path``, checked (`check_results`); `BadResults` naming what is wrong otherwise."""
    try:
        if not path.is_file():
            raise BadResults("not a regular file")
        if path.stat().st_size > MAX_PUBLISHED:
            raise BadResults(f"over {MAX_PUBLISHED >> 20} MiB: not a run's results")
        return check_results(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadResults(f"{path}: {exc}" if not isinstance(exc, RecursionError) else
                         f"{path}: nested too deep to be a run's results") from None


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
    p.add_argument("--add", action="store_true",
                   help="with --only: put these benchmarks' results on the docs' page in place of the published "
                        "run's, each section stamped with this run's commit and load")
    p.add_argument("--redraw", action="store_true",
                   help="run nothing: redraw the docs' results page and charts from docs/assets/benchmarks.json")
    p.add_argument("--peers-python", default=None,
                   help="interpreter with accelerate / lightning / ignite installed, for the launch and import peers")
    args = p.parse_args(argv)
    if args.add and (not args.only or args.tiny or args.redraw):
        p.error("--add publishes the benchmarks named by --only (not with --tiny or --redraw)")
    published: dict[str, Any] | None = None
    if args.add:  # read (and checked) before anything runs: a damaged page is an error now, not after the run
        try:
            published = load_published(PUBLISHED)
        except BadResults as exc:
            p.exit(2, f"bench/run.py --add: {exc}\n(rebuild it with a whole run: python bench/run.py)\n")
    if args.redraw:
        try:
            combined = load_published(PUBLISHED)
        except BadResults as exc:
            p.exit(2, f"bench/run.py --redraw: {exc}\n(rebuild it with a whole run: python bench/run.py)\n")
        publish(combined)
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
    elif published is not None:
        command = " ".join(["python bench/run.py", *(sys.argv[1:] if argv is None else argv)])
        publish(json.loads(json.dumps(added(published, results, machine, command), default=str)))
        c.log(f"docs: the section(s) {', '.join(names)} of {ASSETS / 'benchmarks.md'} replaced, stamped with this "
              f"run; its charts and {PUBLISHED.name} redrawn")
    else:
        c.log("--only: the docs keep the results of the last whole run (one commit for every figure)")
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
