"""Kept-alive ranks: ``@distributed(keep_alive=True)`` runs the second and later calls on the ranks of the first.

In a notebook or an interactive session the same function is called again and again (a hyper-parameter changed,
a cell rerun), and every call of a self-spawned job pays a launch: new processes, a new process group, and on a
GPU a CUDA context per rank and an NCCL communicator. With ``keep_alive=True`` the ranks of a call that succeeded
stay up (`distfn.launch.local.WorkerGroup` with ``keep_alive``): each waits on its pipe for the next call, and the
launching process keeps the rendezvous store (the process group's) up. A later call sends only the function, the
``cfg``, the options and the environment's changes (pickled once for every rank, by name or by value as
`distfn.launch.shipping` decides); every rank runs it through the whole bootstrap (`distfn.worker.run` with
``keep_group``: a fresh `distfn.run.Run`, whose channel keys are the next run's, the seed, the thread pool) on the
process group already up.

Safety, each rule a test in ``tests/test_pool.py``:

* **the same options or fresh ranks**: the ranks are reused only by a call of the same decorated function (or one
  of its ``fn.options(...)`` variants) whose process-level options are the same (`pool_key`: the process count,
  ``mode``, ``backend``, ``devices``, ``timeout``, ``init_method``, ``fsdp``, the start method asked for, and
  ``CUDA_VISIBLE_DEVICES``); ``seed``, ``precision``, ``track``, ``max_restarts`` and ``requeue`` travel with each
  call. Anything else ends the ranks and the call starts fresh ones (one pool per process at a time);
* **a call that did not succeed ends them**: a failure, a hang (the hang report as without a pool), Ctrl-C, a
  forwarded stop signal or ``sys.exit`` in the function tears the pool down as a launch without it would; the next
  call starts fresh (a failed later call is restarted on fresh ranks where ``max_restarts`` allows);
* **a rank that died between calls** (the OOM killer) is noticed before the next call, which then starts fresh;
* **nothing outlives this process**: `shutdown` runs at exit (``atexit``), and every rank dies with it anyway
  (``PR_SET_PDEATHSIG``, `distfn.launch.lifeline`), a kernel killed by SIGKILL included; no port (the store
  closes with the group), shared memory or file is left.

What lives on in a rank between calls is the process: its imported modules, their globals, objects the function
stored in them, the CUDA context and torch's caching allocator (emptied after each call, `protocol.next_call`).
The RNGs are reseeded at each call when ``seed=`` is given, so results equal a fresh launch's.
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import attrs
from loguru import logger

from .. import preflight
from ..options import Options
from ..tracking import key as tracking_key
from . import local, protocol, shipping

__all__ = ["Pool", "current", "pool_key", "run", "shutdown"]


@attrs.define(eq=False)
class Pool:
    """The live ranks of a kept-alive job.

    Attributes:
        key: what a call must match to run on them (`pool_key`).
        group: the workers, their pipes and the rendezvous store.
        method: the start method they were started with (later calls ship the function accordingly).
        environ: the launching process's environment as the ranks last received it (only changes are sent).
        calls: how many calls ran on them.
    """

    key: tuple[Any, ...]
    group: local.WorkerGroup
    method: str
    environ: dict[str, str]
    calls: int = 1

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank 0 first."""
        return [w.process.pid for w in self.group.workers]


_current: Pool | None = None
_lock = threading.Lock()  # one call at a time starts, reuses or ends the pool
_registered = False


def current() -> Pool | None:
    """The pool of this process, if one is alive."""
    return _current


def pool_key(sendable: Callable[..., Any], opts: Options, nprocs: int) -> tuple[Any, ...]:
    """What a call must match to run on the kept ranks: the function (its decorated origin), the process count, the
    options fixed for a process's life (everything but the per-call ``seed``, ``precision``, ``track``,
    ``max_restarts``, ``requeue``), and ``CUDA_VISIBLE_DEVICES``."""
    fixed = attrs.evolve(opts, seed=None, precision="32", track=None, max_restarts=0, requeue=False)
    return sendable, nprocs, fixed, os.environ.get("CUDA_VISIBLE_DEVICES")


def shutdown(fn: Callable[..., Any] | None = None) -> None:
    """End the kept ranks, if any (``fn``: only where they were kept for that decorated function, what
    ``train.shutdown()`` asks): each leaves the process group and exits (killed after a grace); the store
    closes. Runs at this process's exit; call it to free the ranks' memory (GPU memory included) sooner."""
    global _current
    if _current is None or (fn is not None and _current.key[0] is not fn):
        return
    pool, _current = _current, None
    pool.group.release()
    pool.group.teardown()
    logger.debug("keep_alive: {} ranks ended after {} call(s)", pool.group.nprocs, pool.calls)


def run(sendable: Callable[..., Any], cfg: Any, opts: Options, nprocs: int,
        start: Callable[[], tuple[str, str, str | None]]) -> Any:
    """One call of a kept-alive job: on the live ranks where they fit (`pool_key`), else on fresh ones, kept
    when the call succeeds. ``start``: the start method, why, and the fork server, asked only for fresh ranks (a
    launching process that hosts the store has threads, so "auto" would say forkserver for later calls)."""
    key = pool_key(sendable, opts, nprocs)
    with _lock:
        pool = _current
        if pool is not None and (pool.key != key or not pool.group.succeeded()):
            why = "options changed" if pool.key != key else "a rank died since the last call"
            logger.info("keep_alive: starting fresh ranks ({})", why)
            shutdown()
            pool = None
        if pool is None:
            return _fresh(sendable, cfg, opts, nprocs, key, start)
        return _again(pool, sendable, cfg, opts, nprocs, key, start)


def _fresh(sendable: Callable[..., Any], cfg: Any, opts: Options, nprocs: int, key: tuple[Any, ...],
           start: Callable[[], tuple[str, str, str | None]], first: int = 0,
           earlier: list[Any] | None = None) -> Any:
    global _registered
    method, reason, server = start()
    environ: dict[str, str] = {}

    def keep(group: local.WorkerGroup) -> None:
        global _current
        _current = Pool(key, group, method, environ)

    # the environment the workers receive is the one inside the tracking key's export (`local.launch`)
    with tracking_key.exported():
        environ.update(os.environ)
        value = local.launch(sendable, cfg, opts, nprocs, method=method, reason=reason, server=server, keep=keep,
                             first=first, earlier=earlier)
    if not _registered:
        atexit.register(shutdown)  # before multiprocessing's own exit handler, which would join the ranks
        _registered = True
    return value


def _job(pool: Pool, sendable: Callable[..., Any], cfg: Any, opts: Options) -> bytes:
    """The next call as the ranks read it (`protocol.next_call`), pickled once for all of them."""
    cfg = protocol.compact_views(cfg)
    fn, cfg, _ = shipping.pack(preflight.sendable(sendable), cfg, pool.method, opts.start_method)
    if isinstance(fn, shipping.Parcel):  # the environment goes as its changes, below, not whole
        fn = attrs.evolve(fn, environ=None)
    now = dict(os.environ)
    changed = {k: v for k, v in now.items() if pool.environ.get(k) != v}
    gone = [k for k in pool.environ if k not in now]
    pool.environ = now
    # the function and cfg as bytes of their own: a rank that cannot load them (a class it cannot import) reports
    # that as the call's failure, instead of dying while it reads the call
    parts = (pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL), pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))
    return pickle.dumps((*parts, opts, changed, gone), protocol=pickle.HIGHEST_PROTOCOL)


def _again(pool: Pool, sendable: Callable[..., Any], cfg: Any, opts: Options, nprocs: int, key: tuple[Any, ...],
           start: Callable[[], tuple[str, str, str | None]]) -> Any:
    """A later call on the live ranks; whatever does not succeed ends them (and may restart on fresh ones)."""
    global _current
    group = pool.group
    try:
        with tracking_key.exported():  # a job of its own: a tracked run of its own
            job = _job(pool, sendable, cfg, opts)
        group.call(job, opts)
        group.wait()
    except BaseException:
        shutdown()
        raise
    if group.succeeded():
        group.forwarder.restore()  # the workers wait for the next call
        pool.calls += 1
        return group.outcome()
    _current = None
    group.teardown()
    if group.retryable() and opts.max_restarts > 0:
        local.before_restart(group, opts.max_restarts)
        return _fresh(sendable, cfg, opts, nprocs, key, start, first=1, earlier=[group.failures[0]])
    return group.outcome()
