"""Issue 41 part B: a soak of launches and restarts, in one launching process and across processes, checking that
nothing grows: open descriptors, threads, listening ports, /dev/shm entries, temp files, child processes, RSS.

The CI count is small (20 launches and 5 restarts in one process, then a second process); bench/bench_soak.py
runs the same job with 300 launches and 50 restarts and prints the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import SCRIPTS, clean_env

sys.path.insert(0, str(SCRIPTS))
from rel_leftovers import EXACT, growth, outliving

JOB = SCRIPTS / "soak_job.py"
#: RSS may move by the allocator's whims, not by a launch's worth each time.
RSS_GROWTH_MIB = 25.0


def soak(tmp: Path, launches: int, restarts: int, timeout: float) -> list[dict[str, Any]]:
    """Run tests/scripts/soak_job.py with its own TMPDIR; its samples (it must end with DONE)."""
    proc = subprocess.Popen([sys.executable, str(JOB), str(launches), str(restarts)], env=clean_env(
        TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(SCRIPTS.parent.parent),
                                                                           os.environ.get("PYTHONPATH", "")])),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "DONE" in out, out[-2000:] + err[-3000:]
    assert outliving(proc.pid) == []  # nothing of the session outlives it
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert "RESTART FAILED" not in done.stdout, done.stdout
    return [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("SAMPLE ")]


@pytest.mark.slow
def test_launches_and_restarts_leave_nothing_growing_in_one_process_and_across_processes(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    samples = soak(tmp, 20, 5, timeout=240)
    assert len(samples) == 25 and sum(s["kind"] == "restart" for s in samples) == 5
    grew = growth(samples)
    assert {k: grew[k] for k in EXACT if grew[k] > 0} == {}, grew
    assert grew["rss_mib"] < RSS_GROWTH_MIB, grew
    assert all(s["listening"] == 0 and s["children"] == 0 for s in samples)  # between jobs: nothing of them
    kept = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert kept == []  # the process has exited: its multiprocessing directories went with it
    again = soak(tmp, 2, 1, timeout=120)  # a second process after the first: the same numbers
    assert [again[0][k] for k in ("fds", "threads", "listening")] == [samples[0][k] for k in ("fds", "threads",
                                                                                              "listening")]
    assert sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")) == []
