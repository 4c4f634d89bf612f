"""Failures and signals under a real Slurm and Open MPI (issue 5): what docs/failures.md promises.

* ``scancel --signal=USR2`` (what ``#SBATCH --signal=USR2@T`` does at T seconds before the end) makes
  ``ctx.should_stop`` true on every rank at the same step, whether the ranks are srun tasks on two nodes or
  workers distfn self-spawned inside a one-task step (where Slurm signals the workers *and* their launching
  process, so each worker gets the signal twice);
* a rank that raises under ``srun --kill-on-bad-exit=1`` or ``mpirun`` ends the job with a non-zero status, its
  traceback logged with its rank.

Skipped with the reason where Slurm or Open MPI is missing (``.ci/slurm-setup.sh up``, ``.ci/mpi-setup.sh up``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cluster import job_name, launch_env, require_slurm, require_tool

JOB = str(Path(__file__).resolve().parents[1] / "scripts" / "rel_job.py")
TIMEOUT = 240

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _srun(name: str, *args: str) -> list[str]:
    return ["srun", "-O", "--kill-on-bad-exit=1", "-J", name, *args]


def _signal_when_ready(cmd: list[str], env: dict[str, str], marks: Path, ready: int, name: str,
                       signal_name: str, batch: bool = False) -> subprocess.CompletedProcess[str]:
    """Start ``cmd``; once ``ready`` ranks are stepping, ``scancel --signal`` the job (its batch shell only
    with ``batch``); wait for the end."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    try:
        while len(list(marks.glob("*.ready"))) < ready:
            if proc.poll() is not None:
                pytest.fail(f"job ended before it was signalled:\n{proc.communicate()[0][-4000:]}")
            assert time.monotonic() < deadline, "the ranks never started stepping"
            time.sleep(0.1)
        subprocess.run(["scancel", f"--signal={signal_name}", *(["--batch"] if batch else []), "--name", name],
                       check=True, timeout=30)
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30, check=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _steps(output: str) -> list[list[int]]:
    """The ``steps`` lists (each rank's step count, gathered) of every record the job printed."""
    records = [line for line in output.splitlines() if line.startswith('{"case": "preempt"')]
    return [ast.literal_eval(json.loads(r)["value"])["steps"] for r in records]


@pytest.mark.parametrize(
    ("nodes", "signal_name", "records"),
    [(2, "USR2", 2),  # one rank per srun task on two nodes: every rank returns its own value
     (1, "TERM", 1)],  # one task, distfn self-spawns 2 workers that Slurm signals directly too; rank 0's value
    ids=["srun-tasks-usr2", "self-spawn-in-one-task-step-term"],
)
def test_scancel_signal_stops_every_rank_at_the_same_step(tmp_path: Path, nodes: int, signal_name: str,
                                                          records: int) -> None:
    require_slurm(nodes)
    name = job_name()
    cmd = _srun(name, f"-N{nodes}", f"-n{nodes}", sys.executable, JOB, "preempt", str(tmp_path))
    done = _signal_when_ready(cmd, launch_env(tmp_path), tmp_path, 2, name, signal_name)
    assert done.returncode == 0, done.stdout[-4000:]
    steps = _steps(done.stdout)
    assert len(steps) == records, done.stdout[-4000:]
    assert all(s == steps[0] and s[0] == s[1] for s in steps)  # all ranks stopped at the same step
    assert len(list(tmp_path.glob("*.finally"))) == 2


def test_failing_rank_ends_the_srun_step_with_its_traceback(tmp_path: Path) -> None:
    require_slurm(2)
    name = job_name()
    proc = subprocess.run(_srun(name, "-N2", "-n2", sys.executable, JOB, "raise"),
                          env=launch_env(tmp_path, REL_UNCAUGHT="1"), capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "| rank 1/2 | rank 1 failed with ValueError: boom on rank 1" in out
    assert 'raise ValueError("boom on rank 1")' in out


def test_failing_rank_ends_the_mpirun_job_with_its_traceback(tmp_path: Path) -> None:
    mpirun = require_tool("mpirun")
    proc = subprocess.run([mpirun, "-n", "2", sys.executable, JOB, "raise"],
                          env=launch_env(tmp_path, REL_UNCAUGHT="1"), capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "| rank 1/2 | rank 1 failed with ValueError: boom on rank 1" in out
    assert "exited with non-zero status" in out or "non-zero exit" in out


def test_sbatch_signal_to_the_batch_shell_reaches_self_spawned_workers(tmp_path: Path) -> None:
    """`#SBATCH --signal=B:USR2@T` signals the batch shell only; with `exec python ...` that is distfn's
    launching process, which forwards it (here sent at once with `scancel --batch --signal=USR2`)."""
    require_slurm(1)
    require_tool("sbatch")
    name = job_name()
    script = tmp_path / "job.sh"
    out = tmp_path / "out.txt"
    script.write_text(f"#!/bin/bash\n#SBATCH -J {name} -N1 -n1 -O -o {out}\n"
                      f"exec {sys.executable} {JOB} preempt {tmp_path}\n")
    done = _signal_when_ready(["sbatch", "--wait", str(script)], launch_env(tmp_path), tmp_path, 2, name,
                              "USR2", batch=True)
    assert done.returncode == 0, out.read_text()[-4000:] if out.exists() else done.stdout
    (steps,) = _steps(out.read_text())
    assert steps[0] == steps[1]
