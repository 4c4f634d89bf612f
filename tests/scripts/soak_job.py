"""Soak: many launches and restarts in one launching process, its resources sampled after each.

``python soak_job.py LAUNCHES RESTARTS`` runs LAUNCHES 2-rank gloo jobs (an all_reduce each) and RESTARTS jobs
whose rank 1 SIGKILLs itself in attempt 0 (``max_restarts=1``), interleaved (one restart after every
``LAUNCHES // RESTARTS`` launches), and prints one ``SAMPLE {json}`` line after each job: open descriptors,
threads, TCP sockets listening, new ``/dev/shm`` entries no live process uses, entries of ``TMPDIR``, RSS, live
child processes, and the job's seconds. Then
``DONE``. Used by tests/test_reliability_41.py (a small count) and bench/bench_soak.py (300 and 50).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distfn import WorkerError, distributed

from rel_leftovers import listening, processes, shm_segments


@distributed(mode="ddp", nprocs=2, backend="gloo")
def launch(cfg, ctx):
    return ctx.all_reduce(ctx.rank + 1, op="sum")


@distributed(mode="ddp", nprocs=2, backend="gloo", max_restarts=1)
def restart(cfg, ctx):
    if ctx.restart == 0 and ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return ctx.all_reduce(ctx.restart, op="sum")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def sample(kind: str, seconds: float) -> dict:
    """This process's resources now (what must not grow from launch to launch)."""
    return {"kind": kind, "seconds": seconds, "fds": _count("/proc/self/fd"), "threads": threading.active_count(),
            "os_threads": _count("/proc/self/task"), "listening": len(listening(os.getpid())),
            "shm": len(shm_segments()), "tmp": _count(tempfile.gettempdir()), "rss_mib": round(_rss_mib(), 1),
            "children": len(processes(os.getpid(), session=False))}


def main() -> None:
    launches, restarts = int(sys.argv[1]), int(sys.argv[2])
    every = max(1, launches // max(1, restarts))
    done_restarts = 0
    for i in range(launches):
        started = time.perf_counter()
        assert launch(None) == 3
        print("SAMPLE", json.dumps(sample("launch", time.perf_counter() - started)), flush=True)
        if done_restarts < restarts and (i + 1) % every == 0:
            started = time.perf_counter()
            try:
                assert restart(None) == 2  # attempt 1 on both ranks
            except WorkerError as exc:  # reported, and the soak goes on: the test names it
                print("RESTART FAILED", str(exc).splitlines()[0], flush=True)
            print("SAMPLE", json.dumps(sample("restart", time.perf_counter() - started)), flush=True)
            done_restarts += 1
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
