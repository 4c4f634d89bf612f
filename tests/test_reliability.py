"""Launch reliability (issue 5): failures surface with rank and traceback, nothing hangs, nothing is left behind,
signals reach the workers, ports are private, and should_stop works on all ranks together.

The jobs run as real scripts (tests/scripts/rel_job.py) in their own session, the way users run them, so the
launching process is a fresh interpreter and leftovers can be found by session id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distfn import Terminated, distributed

from conftest import SCRIPTS, clean_env

sys.path.insert(0, str(SCRIPTS))
from rel_leftovers import alive, decode_addr, listening, outliving

JOB = str(SCRIPTS / "rel_job.py")
HOST = socket.gethostname()


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _start(args: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, JOB, *args], env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(marks: Path, pattern: str, count: int, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while len(list(marks.glob(pattern))) < count:
        if proc.poll() is not None:
            pytest.fail(f"job ended early: {proc.communicate()}")
        assert time.monotonic() < deadline, f"no {pattern} in {marks}"
        time.sleep(0.05)


# The fault matrix, twice over: 20 launches in a row in one process.
MATRIX = ["raise", "sigkill", "segv", "exit", "early_return", "unpicklable_return", "nested", "dataloader", "ok",
          "env_ok"]


@pytest.mark.slow  # over 5 s on an idle machine (conftest: the quick selection is for fast tests)
def test_twenty_launches_report_each_failure_and_leave_nothing_behind(tmp_path: Path) -> None:
    proc = _start([",".join(MATRIX), "-", "2"], TMPDIR=str(tmp_path))
    out, err = proc.communicate(timeout=300)
    recs = _records(out)
    assert [r["case"] for r in recs] == MATRIX * 2, err[-3000:]
    for r in recs:
        # after every launch: no worker, no listening socket, no /dev/shm segment, no temp file
        assert r["leftovers"] == [], r
        if r["case"] == "ok":
            assert r["ok"] and "'ranks': [0, 1]" in r["value"] and "tensor([0, 2, 4])" in r["value"]
            continue
        if r["case"] == "env_ok":  # init_method="env://" joins the launching process's store
            assert r["ok"] and r["value"] == "0", r
            continue
        assert not r["ok"] and r["type"] == "WorkerError", r
    by_case = {r["case"]: r["error"] for r in recs}
    head = f"on {HOST}) "
    # the first failure leads, with rank, host, pid, type, message and the worker's traceback
    e = by_case["raise"]
    assert e.startswith("rank 1 (pid ") and head + "failed with ValueError: boom on rank 1" in e.splitlines()[0]
    assert 'rel_job.py", line' in e and 'raise ValueError("boom on rank 1")' in e
    # killed by a signal: the name and a hint; a crash also brings its Python stack (faulthandler)
    assert head + "was killed by SIGKILL: often the out-of-memory killer" in by_case["sigkill"]
    e = by_case["segv"]
    assert head + "was killed by SIGSEGV: a crash in native code" in e
    assert "Fatal Python error: Segmentation fault" in e and 'rel_job.py", line' in e and " in body" in e
    assert "failed with SystemExit: 3" in by_case["exit"].splitlines()[0]
    # a rank that returned early leaves its peer failing: said so
    assert "Rank 1 had already returned from the function" in by_case["early_return"]
    # errors that can only happen in a worker still come with the rank and a fix
    e = by_case["unpicklable_return"]
    assert e.startswith("rank 0 ") and "return value['fn'] (a lambda defined at" in e and "Return plain data" in e
    assert by_case["nested"].startswith("rank 1 ") and "NestedLaunchError" in by_case["nested"]
    assert "failed while DataLoader workers run" in by_case["dataloader"].splitlines()[0]
    # the launching process's exit status follows its last launch (it returned)
    assert proc.returncode == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_forkserver_reports_crashes_and_leaves_nothing_after_exit(tmp_path: Path) -> None:
    """The same reports through forkserver (workers are children of the fork server, not of the launcher)."""
    proc = _start(["segv,ok", "-"], TMPDIR=str(tmp_path), REL_START_METHOD="forkserver")
    out, err = proc.communicate(timeout=240)
    recs = _records(out)
    assert [r["case"] for r in recs] == ["segv", "ok"], err[-3000:]
    segv, ok = recs
    assert "was killed by SIGSEGV" in segv["error"] and " in body" in segv["error"]
    assert ok["ok"] and "'ranks': [0, 1]" in ok["value"]
    assert all(r["leftovers"] == [] for r in recs), recs
    assert outliving(proc.pid) == []  # the fork server and resource tracker exit with the launching process
    assert [n for n in os.listdir(tmp_path) if not n.startswith("torchinductor_")] == []


@pytest.mark.slow
def test_collective_timeout_names_timeout_missing_rank_and_stacks() -> None:
    """Rank 1 sleeps while rank 0 waits at a barrier with timeout=10: the job ends well under a minute."""
    t0 = time.monotonic()
    proc = _start(["hang"], REL_UNCAUGHT="1")
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert elapsed < 45, elapsed
    assert proc.returncode == 1  # an uncaught WorkerError: `python script.py` fails
    assert "distfn.errors.WorkerError: rank 0 " in err
    assert "Timed out" in err and "timed out after 10 s" in err
    assert "Rank 1 had not reached a collective: rank 1 was in body (" in err
    stacks = err[err.index("Python stacks of the other ranks"):]
    assert "rank 1:" in stacks and 'rel_job.py", line' in stacks and "in body" in stacks


@pytest.mark.parametrize(
    ("case", "signals", "returncode", "needles"),
    [
        # Ctrl-C: the workers get it, run their finally blocks, exit; the caller sees KeyboardInterrupt
        ("sigint", [signal.SIGINT], -signal.SIGINT, ["interrupted rank 0 in body"]),
        # SIGTERM is forwarded the same way; a function that does not poll should_stop gets Terminated
        ("sigterm", [signal.SIGTERM], 1, ["failed with Terminated: received SIGTERM",
                                          "The launching process received SIGTERM and forwarded it"]),
        # a finally block that never ends: the second Ctrl-C kills at once
        ("stubborn", [signal.SIGINT, signal.SIGINT], -signal.SIGINT, []),
    ],
)
def test_signals_reach_the_workers(tmp_path: Path, case: str, signals: list[int], returncode: int,
                                   needles: list[str]) -> None:
    proc = _start([case, str(tmp_path)])
    _wait_for(tmp_path, f"{case}.rank*.ready", 2, proc)
    t0 = time.monotonic()
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.5)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15  # the stubborn finally sleeps 60 s
    assert proc.returncode == returncode, err[-3000:]
    assert len(list(tmp_path.glob(f"{case}.rank*.finally"))) == 2
    for needle in needles:
        assert needle in out + err
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert not [p for p in pids if alive(p)]


def test_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    proc = _start(["sigint", str(tmp_path)])
    _wait_for(tmp_path, "sigint.rank*.ready", 2, proc)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


@pytest.mark.slow
def test_three_concurrent_jobs_listen_on_loopback_only_and_stop_together(tmp_path: Path) -> None:
    """Three jobs at once (no fixed port); every socket they listen on is on 127.0.0.1; then SIGUSR2 or
    SIGTERM (to the launching process, or to one rank) makes ctx.should_stop true on all ranks of a job at the
    same step, and the jobs return."""
    marks = [tmp_path / str(i) for i in range(3)]
    procs = []
    for m in marks:
        m.mkdir()
        procs.append(_start(["preempt", str(m)]))
    for m, p in zip(marks, procs, strict=True):
        _wait_for(m, "preempt.rank*.ready", 2, p)
    pids = [p.pid for p in procs] + [int(f.read_text()) for m in marks for f in m.glob("*.pid")]
    sockets = [s for pid in pids for s in listening(pid)]
    assert len(sockets) >= 3, sockets  # at least each job's rendezvous store, and gloo's sockets
    assert all(s.startswith("listening 127.0.0.1:") for s in sockets), sockets
    # job 0: SIGUSR2 to the launching process (forwarded); job 1: SIGTERM likewise; job 2: SIGUSR2 to rank 1
    # only, as a scheduler that signals processes directly might: the all-reduce still stops both ranks
    procs[0].send_signal(signal.SIGUSR2)
    procs[1].send_signal(signal.SIGTERM)
    os.kill(int((marks[2] / "preempt.rank1.pid").read_text()), signal.SIGUSR2)
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        (rec,) = _records(out)
        value = rec["value"]
        assert "'rank': 0" in value
        steps = eval(value)["steps"]
        assert len(steps) == 2 and steps[0] == steps[1]  # every rank stopped at the same step


def test_decode_listen_addresses() -> None:
    assert decode_addr("0100007F") == "127.0.0.1"
    assert decode_addr("00000000000000000000000001000000") == "::1"


# ----------------------------------------------------------------------------------------------------------
# In this process: quick checks of single pieces
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_names_the_failing_rank_as_root_cause(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           JOB, "raise"], env=clean_env(REL_UNCAUGHT="1"), capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode != 0
    root = done.stderr[done.stderr.index("Root Cause"):]
    assert "rank      : 1" in root and "ValueError: boom on rank 1" in root
    assert "| rank 1/2 | rank 1 failed with ValueError: boom on rank 1" in done.stderr  # tagged log line


def test_should_stop_and_terminated_in_one_process() -> None:
    before = signal.getsignal(signal.SIGTERM)

    @distributed(mode="single")
    def polls(cfg, ctx):
        first = ctx.should_stop
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # a function that polls: only sets the flag
        return first, ctx.should_stop

    assert polls() == (False, True)

    @distributed(mode="single")
    def polls_later(cfg, ctx):
        os.kill(os.getpid(), signal.SIGTERM)  # before its first poll: its code polls, so no Terminated
        time.sleep(0.01)
        return ctx.should_stop

    assert polls_later() is True

    @distributed(mode="single")
    def ignores(cfg, ctx):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            ctx.log.info("finally ran")
        return "not reached"

    with pytest.raises(Terminated, match=r"poll ctx\.should_stop"):
        ignores()
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handlers are back
