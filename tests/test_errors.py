"""distfn's exception types (distfn.errors): each one survives pickle and copy with its message and fields, so
a WorkerError can cross a multiprocessing.Pool or a ProcessPoolExecutor (issue 16 item 2)."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import socket
from concurrent.futures import ProcessPoolExecutor

import pytest

from distfn import errors
from distfn.failures import Failure


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
