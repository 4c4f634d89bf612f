"""Soak: 300 launches and 50 restarts in one launching process, then launches across processes; nothing may grow.

The job is ``tests/scripts/soak_job.py`` (the one tests/test_reliability_soak.py runs with 20 and 5): 2-rank gloo
jobs of one all_reduce, and jobs whose rank 1 SIGKILLs itself in attempt 0 (``max_restarts=1``), interleaved. After
each job the launching process samples its open descriptors, threads (Python's and the OS's), listening TCP
sockets, new ``/dev/shm`` entries no live process uses, ``TMPDIR`` entries (its own), live children, and RSS.

Tables: (1) each resource's lasting growth from the warm-up (the first restart: every module imported, Python's
multiprocessing helpers started) to the end (the least of the last 5 samples: a leak shows in all of them, a
passing blip in one), target 0 (RSS: at most 25 MiB, the allocator's
slack); (2) the seconds of a launch and of a restart (medians); (3) across ``--processes`` fresh processes of a
few launches each: the first sample of each process beside the first process's (growth across processes, target 0),
and what the session left after each exited (processes, ``TMPDIR`` entries; target 0).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c

JOB = c.REPO / "tests" / "scripts" / "soak_job.py"
sys.path.insert(0, str(JOB.parent))
from rel_leftovers import growth, processes

RSS_SLACK_MIB = 25.0
NAMES = {"fds": "open descriptors", "threads": "Python threads", "os_threads": "OS threads",
         "listening": "listening TCP sockets", "shm": "/dev/shm entries (unused, new)", "tmp": "TMPDIR entries",
         "children": "live child processes", "rss_mib": "RSS (MiB)"}


def run_soak(launches: int, restarts: int, tmp: Path) -> tuple[list[dict[str, Any]], int]:
    """One process of ``soak_job.py``: its samples, and how many processes of its session outlived it."""
    env = c.clean_env(TMPDIR=str(tmp), OMP_NUM_THREADS="1",
                      PYTHONPATH=os.pathsep.join([str(c.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.Popen([sys.executable, str(JOB), str(launches), str(restarts)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60 + 5 * (launches + 4 * restarts))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode != 0 or "DONE" not in out:
        raise RuntimeError(f"soak_job.py exited {proc.returncode}: {err.strip()[-1500:]}")
    failed = [line for line in out.splitlines() if line.startswith("RESTART FAILED")]
    if failed:
        raise RuntimeError(f"{len(failed)} restart(s) failed: {failed[0]}")
    samples = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("SAMPLE ")]
    return samples, len(processes(proc.pid, session=True))


def _targets(values: dict[str, float]) -> list[dict[str, Any]]:
    return [{"variant": NAMES[k], "max_value": RSS_SLACK_MIB if k == "rss_mib" else 0} for k in values]


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__.splitlines()[0], rounds=1)
    p.add_argument("--launches", type=int, default=300, help="launches in the one process (default 300)")
    p.add_argument("--restarts", type=int, default=50, help="restarts in the one process (default 50)")
    p.add_argument("--processes", type=int, default=10, help="fresh processes of 5 launches and a restart each")
    args = p.parse_args(argv)
    if args.tiny:
        args.launches, args.restarts, args.processes = 3, 1, 2
    per_process = (1, 1) if args.tiny else (5, 1)
    c.warm_bytecode()
    tables: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="distfn-bench-soak-") as root:
        tmp = Path(root) / "tmp"
        tmp.mkdir()
        c.log(f"soak: {args.launches} launches and {args.restarts} restarts in one process")
        samples, outlived = run_soak(args.launches, args.restarts, tmp)
        grew = growth(samples)
        tables.append(c.table(
            f"Growth over {args.launches} launches and {args.restarts} restarts in one process (after the warm-up)",
            "", {NAMES[k]: [v] for k, v in grew.items()}, baseline=None, targets=_targets(grew),
            notes={NAMES["rss_mib"]: f"{samples[0]['rss_mib']} MiB after the first launch, "
                                     f"{samples[-1]['rss_mib']} MiB after the last job"}))
        times = {kind: [s["seconds"] for s in samples if s["kind"] == kind] for kind in ("launch", "restart")}
        tables.append(c.table("Seconds per job in the soak (the launching process's call to its return)", "s",
                              {"launch (2 ranks, one all_reduce)": times["launch"],
                               "restart (rank 1 SIGKILLed in attempt 0, max_restarts=1)": times["restart"]},
                              baseline="launch (2 ranks, one all_reduce)"))
        c.log(f"soak: {args.processes} processes of {per_process[0]} launch(es) and {per_process[1]} restart(s)")
        firsts, left_processes, left_tmp = [], [outlived], [_leftover_tmp(tmp)]
        for _ in range(args.processes):
            more, outlived = run_soak(*per_process, tmp)
            firsts.append(more[0])
            left_processes.append(outlived)
            left_tmp.append(_leftover_tmp(tmp))
        across = {k: max(s[k] for s in firsts) - samples[0][k] for k in ("fds", "threads", "os_threads", "listening")}
        across_rows = {f"{NAMES[k]}: first sample vs the first process's": [v] for k, v in across.items()}
        across_rows["processes of a session left after its exit"] = [max(left_processes)]
        across_rows["TMPDIR entries left after a process's exit"] = [max(left_tmp)]
        tables.append(c.table(f"Across {args.processes + 1} processes (growth and leftovers)", "", across_rows,
                              baseline=None, targets=[{"variant": k, "max_value": 0} for k in across_rows]))
    met = all(t.get("met") is not False for tab in tables for t in tab["targets"])
    notes = [f"launch median {statistics.median(times['launch']):.3f} s, restart median "
             f"{statistics.median(times['restart']):.3f} s" if times["restart"] else "no restart ran",
             "every resource flat after the warm-up" if met else "a resource grew: see the targets"]
    c.emit({"benchmark": "soak", "tables": tables, "notes": notes}, args.json)
    return 0 if met else 1


def _leftover_tmp(tmp: Path) -> int:
    """Entries of the soak's TMPDIR once its process exited (torch's compile cache is kept on purpose)."""
    return sum(1 for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


if __name__ == "__main__":
    sys.exit(main())
