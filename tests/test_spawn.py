"""The launch of a self-spawned job (distfn.launch.local), seen from the caller: what comes back, and what may run
next to it."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from distfn.launch import protocol

from conftest import SCRIPTS, clean_env, run_python


@pytest.mark.slow
def test_two_threads_launch_at_once_without_a_false_nested_launch(tmp_path: Path) -> None:
    """Issue 16 item 3: the launcher marked its whole environment while a worker started, so a second thread's
    launch was refused as nested. The child is marked instead, and it is marked while spawn re-imports the
    script (where a decorated call at import time would be a nested launch)."""
    marks = tmp_path / "marks"
    done = run_python([str(SCRIPTS / "threads_job.py"), str(marks)], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {"a": "3", "b": "3"}, done.stderr[-3000:]
    assert marks.read_text().split() == ["True"] * 4  # 2 jobs x 2 workers, each marked during its import


def _caller_sees(case: str, method: str = "fork", **env: str) -> dict:
    done = run_python([str(SCRIPTS / "spawn_job.py"), case, method], timeout=180, env=clean_env(**env))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_namedtuple_and_dict_subclass_results_come_back_detached_on_the_cpu() -> None:
    """Issue 11 item 5: to_cpu skipped namedtuples and flattened dict subclasses to dict."""
    got = _caller_sees("namedtuple")
    assert got == {"type": "Result", "inner": "OrderedDict", "loss": 6.0, "grad": [False, False],
                   "devices": ["cpu", "cpu"]}


def test_to_cpu_keeps_container_types() -> None:
    Point = collections.namedtuple("Point", ["x", "y"])
    w = torch.ones(2, requires_grad=True)
    out = protocol.to_cpu({"p": Point(w * 2, [w * 3]), "d": collections.defaultdict(list, a=(w,))})
    assert type(out["p"]) is Point and type(out["d"]) is collections.defaultdict and out["d"].default_factory is list
    assert not out["p"].x.requires_grad and not out["p"].y[0].requires_grad and not out["d"]["a"][0].requires_grad
    assert torch.equal(out["p"].x, torch.full((2,), 2.0))


@pytest.mark.slow
def test_views_travel_with_their_own_bytes_only() -> None:
    """Issue 16 item 4: a 2-element slice of a 40 MB tensor, returned by rank 0 or passed in cfg under spawn,
    carried the whole storage (the caller's result owned 40 MB; a 400 MB one took 16-38 s)."""
    got = _caller_sees("view", "spawn")
    assert got["values"] == [1.0, 2.0] and got["storage_bytes"] == 8
    assert got["cfg"] == [3.0, 4.0] and got["cfg_bytes"] == 8
    big = torch.arange(1000.0)
    small = protocol.to_cpu({"a": big[10:12]})["a"]
    assert small.tolist() == [10.0, 11.0] and small.untyped_storage().nbytes() == 8
    whole = protocol.to_cpu(big)
    assert whole.data_ptr() == big.data_ptr()  # a tensor that is its whole storage is not copied


def test_an_exception_whose_str_raises_is_still_reported() -> None:
    """Issue 16 item 5: the report was lost ("exited with code 1 without reporting a result")."""
    error = _caller_sees("bad_str")["error"]
    first = error.splitlines()[0]
    assert first.startswith("rank 1 (pid ") and "failed with BadStr: <str() of BadStr raised RuntimeError" in first
    assert 'raise BadStr("lost")' in error  # the traceback


def test_an_early_sys_exit_0_leads_the_report() -> None:
    """Issue 16 (also): the first line was rank 0's gloo "Connection reset by peer", not rank 1's early exit."""
    error = _caller_sees("exit0")["error"]
    first = error.splitlines()[0]
    assert first.startswith("rank 1 (pid ") and "SystemExit" in first and "sys.exit(0)" in first, error
    assert "1 other rank(s) failed after it:" in error and "  - rank 0 " in error


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_options_per_call_and_from_the_environment(method: str) -> None:
    """Issue 18 item 3: `train.options(precision="bf16")(cfg)` runs with the changed options on every rank, also
    when spawn must find the function by name in the script; DISTFN_PRECISION overrides both."""
    assert _caller_sees("options", method) == {"ranks": [["bf16", 0], ["bf16", 1]]}
    assert _caller_sees("options", method, DISTFN_PRECISION="16") == {"ranks": [["16", 0], ["16", 1]]}


@pytest.mark.slow
def test_a_rank_aborted_after_the_timeout_gets_the_hang_report() -> None:
    """Issue 20 item 6, on CPU: NCCL's watchdog SIGABRTs a rank whose collective timed out (no Python error), and
    NCCL ranks wait at their next sync point in user code, not inside torch.distributed. The report must be the
    one a gloo timeout gets: the timeout, the rank that was elsewhere, every other rank's stack."""
    error = _caller_sees("watchdog")["error"]
    assert error.splitlines()[0].startswith("rank 0 (pid ") and "was killed by SIGABRT" in error
    assert "NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING)" in error and "timed out after 3 s" in error
    assert "Rank 1 had not reached a collective: rank 1 was in body (" in error
    assert "rank 2 was in" not in error  # waiting where rank 0 was: it had arrived
    stacks = error[error.index("Python stacks of the other ranks"):]
    assert "rank 1:" in stacks and "rank 2:" in stacks and "in body" in stacks


def test_a_failed_attempt_is_restarted_on_fresh_workers() -> None:
    """Issue 13 item 1: rank 1 raises on attempt 0 only; with max_restarts=1 the job finishes on attempt 1."""
    ranks = _caller_sees("restart")["ranks"]
    assert [r[:2] for r in ranks] == [[1, 0], [1, 1]]  # ctx.restart == 1 on every rank


@pytest.mark.slow
def test_the_last_failure_lists_every_attempt_and_config_errors_are_not_retried() -> None:
    error = _caller_sees("always", DISTFN_MAX_RESTARTS="2")["error"]
    assert error.splitlines()[0].startswith("rank 1 ") and "ValueError: attempt 2 fails" in error.splitlines()[0]
    assert "The job was started 3 times (max_restarts); the earlier attempts failed with:" in error
    assert "  - attempt 0: rank 1 (pid " in error and "ValueError: attempt 0 fails" in error
    assert "  - attempt 1: rank 1 (pid " in error and "ValueError: attempt 1 fails" in error
    error = _caller_sees("config", DISTFN_MAX_RESTARTS="2")["error"]
    assert "ConfigError: attempt 0 fails" in error and "The job was started" not in error


_CHILDREN_JOB = """
import json, subprocess, sys
import distfn

@distfn.distributed(mode="ddp", nprocs=2, start_method=sys.argv[1])
def job(cfg, ctx):
    pid = subprocess.Popen(["sleep", "303"]).pid  # started and forgotten by the user's function
    return ctx.gather_object(pid)

if __name__ == "__main__":
    print(json.dumps(job(None)))
"""


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_children_of_the_function_do_not_survive_a_successful_job(tmp_path: Path, method: str) -> None:
    """Issue 25 item 12: each rank starts `sleep 303`; on failure they were killed, on success both outlived the
    job. Now the worker's process group is ended on both paths."""
    import os
    import signal
    import time

    (tmp_path / "job.py").write_text(_CHILDREN_JOB)
    done = run_python([str(tmp_path / "job.py"), method], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] != "Z"  # a zombie is dead, waiting for init to reap it
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:  # do not leave them behind on the base code either
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
