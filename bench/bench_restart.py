"""Restart vs a fresh launch: the time from a rank's death to the restarted job's first step, beside the time from a
fresh call to its first step, with 2 and 4 workers.

The job is ``tests/scripts/restart_job.py`` (the one ``bench/stress_faults.py``'s restart case runs): a small DDP
model trained for 24 steps with ``max_restarts=1``, a checkpoint every 4 steps and ``ctx.resume`` at the start.
Each round runs, in a rotated order:

* ``fresh launch``: an uninterrupted run; the sample is its "call" mark (the launching process, just before the
  decorated call) to rank 0's "first-step" mark (the first step of attempt 0);
* ``restart``: the same job with rank 1 SIGKILLing itself at step 10 of attempt 0; the sample is its "death"
  mark (rank 1, just before the kill) to rank 0's first step of attempt 1. That covers noticing the death,
  tearing the job down, starting the workers again, the process group, and resuming from the checkpoint.

Beside the two totals, the **parts** (median per part, in a table of their own and under ``"parts"`` in the
JSON): the launcher's marks (``DISTFN_LAUNCH_TRACE``, `distfn.launch.local.TRACE_ENV`: "started", "noticed",
"settled", "torn-down", "imported") and the job's ("group-up", "wrapped", "resumed", "first-step") split each total into
consecutive spans, so the parts of one run add up to its total.

A restarted run must end with the uninterrupted run's weights (``identical_weights`` in the JSON), else the
benchmark fails. The worker count reaches the job through ``DISTFN_NPROCS``. Target (issue 32): restart ≤ 1.5× the
fresh launch at every worker count.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

JOB = c.REPO / "tests" / "scripts" / "restart_job.py"
KILL_AT = 10
FRESH = "fresh launch (call → first step)"
RESTART = "restart (death → restarted first step)"

Marks = dict[tuple[str, int], float]

#: The consecutive spans of each total: (part, from mark, to mark); a mark is (event, attempt).
#: The parts inside the ranks, the same for every attempt: (part, from event, to event).
_IN_RANKS = (
    ("workers started → process group up", "started", "group-up"),
    ("process group up → ctx.wrap returned", "group-up", "wrapped"),
    ("ctx.wrap returned → ctx.resume returned", "wrapped", "resumed"),
    ("ctx.resume returned → first step", "resumed", "first-step"),
)


def _in_ranks(attempt: int) -> tuple[tuple[str, tuple[str, int], tuple[str, int]], ...]:
    return tuple((part, (start, attempt), (end, attempt)) for part, start, end in _IN_RANKS)


FRESH_PARTS = (("call → workers started", ("call", 0), ("started", 0)), *_in_ranks(0))
RESTART_PARTS = (
    ("death → the launcher noticed it", ("death", 0), ("noticed", 0)),
    ("noticed → failures settled and explained", ("noticed", 0), ("settled", 0)),
    ("settled → every worker gone", ("settled", 0), ("torn-down", 0)),
    ("every worker gone → ctx.wrap's imports done (fork)", ("torn-down", 0), ("imported", 1)),
    ("imports done → new workers started", ("imported", 1), ("started", 1)),
    *_in_ranks(1),
)


def run_job(directory: Path, name: str, kill_at: int | None, workers: int = 2) -> tuple[str, Marks]:
    """Run ``restart_job.py`` once in ``directory`` (its checkpoints in ``directory/name``): the hash of its final
    weights (``""`` when it printed none) and its marks, ``{(event, attempt): time}``. Also used by
    ``bench/stress_faults.py``'s restart case."""
    marks = directory / f"{name}.marks"
    argv = [sys.executable, str(JOB), str(directory / name), str(marks)] + ([] if kill_at is None else [str(kill_at)])
    env = c.clean_env(DISTFN_NPROCS=str(workers), DISTFN_LAUNCH_TRACE=str(marks))  # the launcher's marks too
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    result = next((ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), "")
    if not result:
        c.log(f"  {name}: no result (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    times: Marks = {}
    for line in marks.read_text().splitlines() if marks.exists() else []:
        event, attempt, t = line.split()
        times[(event, int(attempt))] = float(t)
    return result, times


def launch_seconds(marks: Marks) -> float:
    """Call -> first step of attempt 0 (a fresh launch)."""
    return marks[("first-step", 0)] - marks[("call", 0)]


def restart_seconds(marks: Marks) -> float:
    """Rank 1's death -> rank 0's first step of attempt 1 (the restarted job)."""
    return marks[("first-step", 1)] - marks[("death", 0)]


def parts(runs: list[Marks], spans: tuple[tuple[str, tuple[str, int], tuple[str, int]], ...]) -> dict[str, float]:
    """The median of each span over ``runs`` (spans whose marks a run lacks are left out of that run)."""
    out = {}
    for name, start, end in spans:
        values = [m[end] - m[start] for m in runs if start in m and end in m]
        if values:
            out[name] = statistics.median(values)
    return out


def parts_rows(fresh: list[Marks], restarted: list[Marks]) -> list[dict[str, Any]]:
    """One row per part: ``{"part", "fresh", "restart"}`` (seconds, ``None`` where the total has no such part);
    the parts both totals share ("workers started → ...") side by side."""
    f, r = parts(fresh, FRESH_PARTS), parts(restarted, RESTART_PARTS)
    names = [n for n, _, _ in RESTART_PARTS[:5]] + [FRESH_PARTS[0][0]] + [n for n, _, _ in FRESH_PARTS[1:]]
    return [{"part": n, "fresh": f.get(n), "restart": r.get(n)} for n in names]


def format_parts(workers: int, rows: list[dict[str, Any]]) -> str:
    """The parts as a Markdown table."""
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"
    lines = [f"**The parts, {workers} workers (median per part)**", "", "| part | fresh launch | restart |",
             "| --- | ---: | ---: |"]
    lines += [f"| {row['part']} | {cell(row['fresh'])} | {cell(row['restart'])} |" for row in rows]
    return "\n".join(lines)


def measure(workers: int, rounds: int, tmp: Path) -> tuple[dict[str, list[float]], bool, list[dict[str, Any]]]:
    """``rounds`` interleaved rounds of both variants with ``workers`` workers; the samples, whether every
    restarted run ended with the uninterrupted run's weights, and the parts (`parts_rows`)."""
    reference: set[str] = set()
    restarted: set[str] = set()
    marks_of: dict[str, list[Marks]] = {FRESH: [], RESTART: []}
    runs = iter(range(10**6))

    def fresh() -> float:
        result, marks = run_job(tmp, f"fresh-{workers}-{next(runs)}", None, workers)
        if not result:
            raise RuntimeError("the uninterrupted run printed no result")
        reference.add(result)
        marks_of[FRESH].append(marks)
        return launch_seconds(marks)

    def restart() -> float:
        result, marks = run_job(tmp, f"killed-{workers}-{next(runs)}", KILL_AT, workers)
        restarted.add(result)
        marks_of[RESTART].append(marks)
        return restart_seconds(marks)

    samples = c.interleave({FRESH: fresh, RESTART: restart}, rounds, c.log)
    same = len(reference) == 1 and restarted == reference
    if not same:
        c.log(f"  {workers} workers: final weights differ (uninterrupted {sorted(reference)}, "
              f"restarted {sorted(restarted)})")
    return samples, same, parts_rows(marks_of[FRESH], marks_of[RESTART])


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=5)
    p.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds, args.workers = 1, "2"
    c.warm_bytecode()
    tables, identical = [], True
    with tempfile.TemporaryDirectory(prefix="distfn-bench-restart-") as tmp:
        for workers in (int(w) for w in args.workers.split(",")):
            c.log(f"restart: {workers} workers, {args.rounds} round(s) of {FRESH} and {RESTART}")
            samples, same, rows = measure(workers, args.rounds, Path(tmp))
            identical = identical and same
            tab = c.table(f"Restart after a rank's death vs a fresh launch: {workers} workers (gloo, CPU), "
                          "restart_job.py", "s", samples, baseline=FRESH,
                          targets=[{"variant": RESTART, "max_ratio": 1.5}],
                          notes={RESTART: f"rank 1 SIGKILLed at step {KILL_AT}, max_restarts=1, ctx.resume"})
            tab["workers"], tab["identical_weights"], tab["parts"] = workers, same, rows
            tables.append(tab)
    notes = ["fresh launch: the launching process's call -> rank 0's first step (the interpreter's start and "
             "imports excluded); restart: the dying rank's last mark -> rank 0's first step of attempt 1",
             "every restarted run ended with the uninterrupted run's weights" if identical
             else "a restarted run's final weights differ from the uninterrupted run's"]
    c.emit({"benchmark": "restart", "tables": tables, "identical_weights": identical, "notes": notes}, args.json)
    for tab in tables:
        print("\n" + format_parts(tab["workers"], tab["parts"]), flush=True)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
