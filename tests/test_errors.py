"""distfn's exception types (distfn.errors): each one survives pickle and copy with its message and fields, so
a WorkerError can cross a multiprocessing.Pool or a ProcessPoolExecutor (issue 16 item 2)."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import socket
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from distfn import errors
from distfn.failures import Failure

from conftest import run_python


def _worker_error() -> errors.WorkerError:
    own = Failure(1, socket.gethostname(), 11, "ValueError", "boom", traceback="Traceback ...\nValueError: boom\n",
                  time=2.0, diagnosis="rank 0 had already returned")
    peer = Failure(0, socket.gethostname(), 10, "RuntimeError", "Connection closed by peer", time=3.0)
    return errors.WorkerError([own, peer])


def _instances() -> list[BaseException]:
    return [errors.DistfnError("base"), errors.LauncherError("no MASTER_ADDR"), errors.ConfigError("bad nprocs"),
            errors.CheckpointError("torn file"), errors.NestedLaunchError("nested"), errors.Terminated("SIGTERM"),
            _worker_error(), errors.WorkerError([]),
            errors.WorkerError(_worker_error().failures, attempts=_worker_error().failures[:1])]


@pytest.mark.parametrize("exc", _instances(), ids=lambda e: type(e).__name__)
def test_every_exception_survives_pickle_and_copy(exc: BaseException) -> None:
    exc.note = "extra"  # type: ignore[attr-defined]  # an attribute set by whoever raised it travels too
    for clone in (pickle.loads(pickle.dumps(exc)), copy.copy(exc), copy.deepcopy(exc)):
        assert type(clone) is type(exc)
        assert str(clone) == str(exc) and clone.args == exc.args
        assert clone.note == "extra"  # type: ignore[attr-defined]
        if isinstance(exc, errors.WorkerError):
            assert clone.failures == exc.failures  # type: ignore[attr-defined]
            assert clone.attempts == exc.attempts  # type: ignore[attr-defined]


def _raise_worker_error(_: int) -> None:
    raise _worker_error()


def test_worker_error_crosses_a_pool_and_a_process_pool_executor() -> None:
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        result = pool.apply_async(_raise_worker_error, (0,))
        with pytest.raises(errors.WorkerError) as info:
            result.get(timeout=60)  # before the fix: the pool's result thread died and this hung
    assert info.value.first.message == "boom" and len(info.value.failures) == 2
    with ProcessPoolExecutor(1, mp_context=ctx) as executor:
        with pytest.raises(errors.WorkerError) as info:
            executor.submit(_raise_worker_error, 0).result(timeout=60)  # before: BrokenProcessPool
    assert info.value.first.rank == 1 and str(info.value).startswith("rank 1 (pid 11 on")


_FAILING_JOB = '''
import os, sys, traceback
import distfn

@distfn.distributed(nprocs=2)
def train(cfg, ctx):
    if ctx.rank == 1:
        raise ValueError("bad batch")

if __name__ == "__main__":
    os.environ["DISTFN_DEBUG"] = "1"
    try:
        train(None)
    except distfn.WorkerError:
        traceback.print_exc()
    print("=== default", file=sys.stderr, flush=True)
    del os.environ["DISTFN_DEBUG"]
    train(None)
'''


def test_an_uncaught_worker_error_leads_with_the_users_frame_and_the_cause(tmp_path: Path) -> None:
    """Issue 44 item 2: the error output starts with the user's call and the one-line cause; distfn's own frames
    (15 lines of them before) are hidden, in the caller's traceback and in the worker's, unless DISTFN_DEBUG=1."""
    script = tmp_path / "job.py"
    script.write_text(_FAILING_JOB)
    done = run_python([str(script)], timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    debug, default = done.stderr.split("=== default\n")
    assert 'distfn/decorator.py", line' in debug and 'distfn/worker.py", line' in debug  # DISTFN_DEBUG=1: all
    lines = [line for line in default.splitlines() if " | INFO " not in line]  # the launcher's log line
    assert lines[:4] == ["Traceback (most recent call last):", f'  File "{script}", line 18, in <module>',
                         "    train(None)", lines[3]], default
    assert lines[3].startswith("distfn.errors.WorkerError: rank 1 (pid ") and \
        lines[3].endswith(") failed with ValueError: bad batch")
    # the worker's traceback follows, from the user's function on; every fact is still there
    assert lines[5:9] == ["Traceback (most recent call last):", f'  File "{script}", line 8, in train',
                          '    raise ValueError("bad batch")', "ValueError: bad batch"], default
    assert "distfn/" not in default and len(lines) == 9
