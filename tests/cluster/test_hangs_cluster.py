"""Hang reports under a real Slurm (``srun -N2``) and Open MPI (``mpirun -np 2``), issue 26.

Rank 1 sleeps in user code while rank 0 waits at a barrier with ``timeout=10``: rank 0's error holds the report
(rank 1's line and stack, the ledger line), once; every process is gone within timeout + 15 s of the barrier
(plain ``srun``, no ``--kill-on-bad-exit``: distfn ends the waiting rank itself). The same on self-spawn, env://
pods, per-node, torchrun and Ray: tests/test_hangs.py. Skipped with the reason where Slurm or Open MPI is missing
(``SLURM_CI_NODES=2 bash .ci/slurm-setup.sh up``, ``bash .ci/mpi-setup.sh up``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cluster import job_name, launch_env, require_slurm, require_tool

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
JOB = SCRIPTS / "hang_job.py"
TIMEOUT = 10.0
SLEEP_LINE = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if "HANG-SLEEP-LINE" in line)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _failing(cmd: list[str], env: dict[str, str], slurm_job: str | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` (expected to fail); its status, output and the time it ended. Killed after 180 s."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        if slurm_job:
            subprocess.run(["scancel", "--name", slurm_job], capture_output=True, timeout=15, check=False)
        pytest.fail(f"{' '.join(cmd)} did not end in 180 s:\n{proc.communicate()[0][-4000:]}")
    return proc.returncode, out, time.time()


def _check(out: str, ended: float) -> None:
    assert "timed out after 10 s" in out, out[-4000:]
    assert f"Rank 1 had not reached a collective: rank 1 was in sleepy ({JOB}:{SLEEP_LINE})" in out, out[-4000:]
    assert f'hang_job.py", line {SLEEP_LINE} in sleepy' in out
    assert "Collectives: rank 0 is in barrier #2" in out
    assert out.count("Python stacks of the other ranks") == 1, "the report must appear once"
    started = next(float(line.split("STARTED ")[1].split()[0]) for line in out.splitlines() if "STARTED " in line)
    assert ended - started < TIMEOUT + 15


def test_srun_two_nodes_reports_the_sleeping_rank(tmp_path: Path) -> None:
    require_slurm(2)
    name = job_name()
    code, out, ended = _failing(["srun", "-N2", "-n2", "-J", name, sys.executable, str(JOB), "sleep", str(TIMEOUT)],
                                launch_env(tmp_path), slurm_job=name)
    assert code != 0
    _check(out, ended)


def test_mpirun_two_ranks_reports_the_sleeping_rank(tmp_path: Path) -> None:
    mpirun = require_tool("mpirun")
    code, out, ended = _failing([mpirun, "-n", "2", sys.executable, str(JOB), "sleep", str(TIMEOUT)],
                                launch_env(tmp_path))
    assert code != 0
    _check(out, ended)
