"""The restart path (``max_restarts``, issue 32 item 4): what stays when it was made faster.

The first restart starts at once (`distfn.launch.local.restart_delay`), a rank killed by a signal makes the
launcher skip the settle window before a restart (`WorkerGroup.cause_is_known`), and under fork the launcher
imports what ``ctx.wrap`` imports once, for the restart's workers to inherit (`local.WRAP_IMPORTS`). What must
hold all the same: every worker of the failed attempt, and what it started, is gone before the new attempt's
workers start; the restart happens; the failed attempt is still reported with its rank, host and how it died.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distfn.errors import ConfigError
from distfn.failures import Failure
from distfn.launch import local
from distfn.options import Options

from conftest import clean_env

HOST = socket.gethostname()


def test_the_first_restart_starts_at_once_and_later_ones_back_off() -> None:
    assert local.restart_delay(0) == 0.0  # nothing of the failed attempt is left to wait for
    assert [local.restart_delay(a) for a in (1, 2, 3)] == [local.RESTART_BACKOFF * f for f in (1, 2, 4)]
    assert local.restart_delay(50) == local.RESTART_BACKOFF_MAX  # a job failing for good does not spin


def _group(attempt: int, max_restarts: int = 1) -> local.WorkerGroup:
    return local.WorkerGroup("fork", 2, Options(mode="ddp", nprocs=2, max_restarts=max_restarts), attempt,
                             own_store=False)


def test_the_settle_window_is_skipped_only_before_a_restart_after_a_death_by_signal() -> None:
    killed = Failure.from_exit(1, 4242, -9)  # SIGKILL, no report: order_failures puts it first anyway
    raised = Failure.from_exception(1, ValueError("boom"))
    group = _group(attempt=0)
    group.failures = [killed]
    assert group.cause_is_known()
    group.failures = [raised]
    assert not group.cause_is_known()  # a rank's own error: the others' reports may name an earlier root cause
    group.failures = [Failure.from_exception(1, ConfigError("bad"))]
    assert not group.cause_is_known()
    last = _group(attempt=1)  # the last attempt: its failures are what the caller gets, all of them
    last.failures = [killed]
    assert not last.cause_is_known()
    stopped = _group(attempt=0)
    stopped.failures = [killed]
    stopped.forwarder.received = "SIGTERM"  # stopped from outside: no restart
    assert not stopped.cause_is_known()


def test_what_ctx_wrap_imports_is_imported_once_before_a_forked_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []

    def record(name: str) -> None:
        imported.append(name)
        if name == "missing":
            raise ImportError(name)

    monkeypatch.setattr(local.importlib, "import_module", record)
    local._warm_for_restart("fork", Options(mode="ddp"))
    assert imported == ["torch._dynamo"]
    imported.clear()
    local._warm_for_restart("spawn", Options(mode="ddp"))  # spawn / forkserver workers inherit nothing
    local._warm_for_restart("forkserver", Options(mode="fsdp"))
    local._warm_for_restart("fork", Options(mode="single"))
    assert imported == []
    monkeypatch.setitem(local.WRAP_IMPORTS, "ddp", ("missing",))
    local._warm_for_restart("fork", Options(mode="ddp"))  # never fails the restart: the workers report it
    assert imported == ["missing"]


_JOB = """
import json, os, signal, subprocess, sys, time
from pathlib import Path
import distfn

DIR = Path(sys.argv[1])

def gone(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie has ended: only its parent (reaper) has not read its status yet

@distfn.distributed(mode="ddp", nprocs=2, max_restarts=1, start_method=sys.argv[2])
def job(cfg, ctx):
    if ctx.restart == 0:
        child = subprocess.Popen(["sleep", "301"]).pid  # left running by the function
        (DIR / f"pids-{ctx.rank}").write_text(json.dumps([os.getpid(), child]))
        ctx.barrier()  # both ranks wrote their pids
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.barrier()  # rank 0, the survivor: fails on losing its peer
        time.sleep(60)
    inherited = "torch._dynamo" in sys.modules  # before ctx.wrap: imported by the launcher before the fork
    old = [pid for r in range(2) for pid in json.loads((DIR / f"pids-{r}").read_text())]
    return ctx.gather_object({"rank": ctx.rank, "attempt": ctx.restart, "alive": [p for p in old if not gone(p)],
                              "inherited": inherited})

if __name__ == "__main__":
    print("RESULT", json.dumps(job(None)))
"""


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_rank_killed_by_a_signal_is_restarted_after_every_old_worker_is_gone(tmp_path: Path, method: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), method], env=clean_env(), capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    result = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert result is not None, done.stderr[-3000:]
    ranks = json.loads(result.split(" ", 1)[1])
    # the restart happened, and no worker of attempt 0 (nor the `sleep` it started) was left when it began
    inherited = method == "fork"  # what ctx.wrap imports came with the fork, not imported again by each worker
    assert ranks == [{"rank": 0, "attempt": 1, "alive": [], "inherited": inherited},
                     {"rank": 1, "attempt": 1, "alive": [], "inherited": inherited}]
    # the failed attempt is still reported: its root cause with rank, host and how it died
    assert "attempt 0 of 2 failed; starting the job again on fresh workers in 0 s" in done.stderr
    assert "rank 1 (pid " in done.stderr and f"on {HOST}) was killed by SIGKILL" in done.stderr
