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

A restarted run must end with the uninterrupted run's weights (``identical_weights`` in the JSON), else the
benchmark fails. The worker count reaches the job through ``DISTFN_NPROCS``. Target (issue 32): restart ≤ 1.5× the
fresh launch at every worker count.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

JOB = c.REPO / "tests" / "scripts" / "restart_job.py"
KILL_AT = 10
FRESH = "fresh launch (call → first step)"
RESTART = "restart (death → restarted first step)"

Marks = dict[tuple[str, int], float]


def run_job(directory: Path, name: str, kill_at: int | None, workers: int = 2) -> tuple[str, Marks]:
    """Run ``restart_job.py`` once in ``directory`` (its checkpoints in ``directory/name``): the hash of its final
    weights (``""`` when it printed none) and its marks, ``{(event, attempt): time}``. Also used by
    ``bench/stress_faults.py``'s restart case."""
    marks = directory / f"{name}.marks"
    argv = [sys.executable, str(JOB), str(directory / name), str(marks)] + ([] if kill_at is None else [str(kill_at)])
    done = subprocess.run(argv, env=c.clean_env(DISTFN_NPROCS=str(workers)), capture_output=True, text=True,
                          timeout=600)
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


def measure(workers: int, rounds: int, tmp: Path) -> tuple[dict[str, list[float]], bool]:
    """``rounds`` interleaved rounds of both variants with ``workers`` workers; the samples, and whether every
    restarted run ended with the uninterrupted run's weights."""
    reference: set[str] = set()
    restarted: set[str] = set()
    runs = iter(range(10**6))

    def fresh() -> float:
        result, marks = run_job(tmp, f"fresh-{workers}-{next(runs)}", None, workers)
        if not result:
            raise RuntimeError("the uninterrupted run printed no result")
        reference.add(result)
        return launch_seconds(marks)

    def restart() -> float:
        result, marks = run_job(tmp, f"killed-{workers}-{next(runs)}", KILL_AT, workers)
        restarted.add(result)
        return restart_seconds(marks)

    samples = c.interleave({FRESH: fresh, RESTART: restart}, rounds, c.log)
    same = len(reference) == 1 and restarted == reference
    if not same:
        c.log(f"  {workers} workers: final weights differ (uninterrupted {sorted(reference)}, "
              f"restarted {sorted(restarted)})")
    return samples, same


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
            samples, same = measure(workers, args.rounds, Path(tmp))
            identical = identical and same
            tab = c.table(f"Restart after a rank's death vs a fresh launch: {workers} workers (gloo, CPU), "
                          "restart_job.py", "s", samples, baseline=FRESH,
                          targets=[{"variant": RESTART, "max_ratio": 1.5}],
                          notes={RESTART: f"rank 1 SIGKILLed at step {KILL_AT}, max_restarts=1, ctx.resume"})
            tab["workers"], tab["identical_weights"] = workers, same
            tables.append(tab)
    notes = ["fresh launch: the launching process's call -> rank 0's first step (the interpreter's start and "
             "imports excluded); restart: the dying rank's last mark -> rank 0's first step of attempt 1",
             "every restarted run ended with the uninterrupted run's weights" if identical
             else "a restarted run's final weights differ from the uninterrupted run's"]
    c.emit({"benchmark": "restart", "tables": tables, "identical_weights": identical, "notes": notes}, args.json)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
