"""Logging: levels, ranks and user sinks, and the CPU thread sizing line, run as real scripts (stderr
captured)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import SCRIPTS, clean_env, run_python


def _logs_run(tmp_path: Path, name: str, **env: str) -> tuple[list[int], str, str]:
    sink = tmp_path / f"{name}.log"
    inherited = ("DISTFN_LOG_RANKS", "DISTFN_LOG_LEVEL", "OMP_NUM_THREADS")  # only what this run sets
    environment = {k: v for k, v in clean_env(**env).items() if k not in inherited or k in env}
    proc = run_python([str(SCRIPTS / "logs_job.py"), str(sink)], env=environment)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, sink.read_text()


def test_logging_levels_ranks_user_sinks_and_thread_sizing(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    threads, err, user = _logs_run(tmp_path, "default", OMP_NUM_THREADS="2")
    assert threads == [min(2, cpus)] * 2  # OMP_NUM_THREADS wins (torch caps it at the core count)
    assert "info from rank 0" in err and "info from rank 1" not in err
    assert "warning from rank 0" in err and "warning from rank 1" in err
    assert "debug from rank" not in err
    assert any("launcher: spawn" in line and "(OMP_NUM_THREADS=2)" in line for line in err.splitlines())
    assert any("rank 1/2" in line and "warning from rank 1" in line for line in err.splitlines())
    for rank in (0, 1):  # the user's own sink is kept and sees everything it asked for
        assert f"debug from rank {rank}" in user and f"info from rank {rank}" in user

    threads, err, _ = _logs_run(tmp_path, "all", DISTFN_LOG_RANKS="all", DISTFN_LOG_LEVEL="TRACE")
    assert threads == [max(1, cpus // 2)] * 2  # OMP_NUM_THREADS unset: the cores are split between the ranks
    assert "info from rank 1" in err and "debug from rank 1" in err
    sized = [line for line in err.splitlines() if "CPU thread(s) per process" in line]
    assert len(sized) == 1 and "rank 0/2" in sized[0]  # rank 0's start-up line says how the cores were split
    assert f"{max(1, cpus // 2)} CPU thread(s) per process ({cpus} CPUs / 2 processes on this node)" in sized[0]
