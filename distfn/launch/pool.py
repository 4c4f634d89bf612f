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
  the environment variables a rank reads once, `PROCESS_ENV_PREFIXES`, ``CUDA_VISIBLE_DEVICES`` and ``NCCL_*``
  among them); ``seed``, ``rank_seeds``, ``precision``, ``track``, ``max_restarts`` and ``requeue`` travel with
  each call. Anything else ends the ranks and the call starts fresh ones (one pool per process at a time);
* **a later call sees what a fresh launch would**: the environment, the working directory and ``sys.path`` as they
  are at the call; under fork a function of ``__main__`` goes by value, with the current values of the globals it
  uses (the ranks' ``__main__`` is a copy from their start); the torch settings a call changed (grad mode, default
  dtype, threads, deterministic algorithms, matmul precision) are put back (`protocol.TorchState`). A call that
  cannot reach the kept ranks (a ``cfg`` only fork can send, a pipe gone) runs on fresh ranks instead;
* **a call that did not succeed ends them**: a failure, a hang (the hang report as without a pool), Ctrl-C, a
  forwarded stop signal or ``sys.exit`` in the function tears the pool down as a launch without it would; the next
  call starts fresh (a failed later call is restarted on fresh ranks where ``max_restarts`` allows);
* **a rank unfit for a call** (dead since the last one: the OOM killer, its fork server killed; stopped by SIGSTOP
  or a debugger; a zombie) is noticed before the next call, which then starts fresh instead of waiting for the
  collective timeout;
* **one owner, one call at a time**: calls from several threads run one after the other, and ``shutdown`` from
  another thread waits for the call in flight; a child of the launching process (``os.fork``) forgets the pool
  (`_forget_in_child`): its calls start ranks of its own, its exit leaves the parent's alone;
* **nothing outlives this process**: `shutdown` runs at exit (``atexit``), and every rank dies with it anyway
  (``PR_SET_PDEATHSIG``, `distfn.launch.lifeline`), a kernel killed by SIGKILL included; no port (the store
  closes with the group), shared memory or file is left.

What lives on in a rank between calls is the process: its imported modules, their globals (under fork: of modules
other than ``__main__``), objects the function stored in them, threads and child processes it left running, files
it left open, signal handlers it set, the CUDA context and torch's caching allocator (emptied after each call,
`protocol.next_call`). The RNGs are reseeded at each call when ``seed=`` is given, so results equal a fresh
launch's; distfn's own per-call state (the `distfn.run.Run`: stop flags, timings, tracker, check-ins) is new each
call.
"""

from __future__ import annotations

import atexit
import multiprocessing.process
import os
import pickle
import signal
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from loguru import logger

from .. import preflight, process
from ..options import Options
from ..tracking import key as tracking_key
from . import local, protocol, shipping

__all__ = ["PROCESS_ENV_PREFIXES", "Pool", "current", "pool_key", "run", "shutdown"]


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
    owner: int = attrs.field(factory=os.getpid)  # the launching process: a fork of it (os.fork) owns no ranks

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank 0 first."""
        return [w.process.pid for w in self.group.workers]


_current: Pool | None = None
# One call at a time starts, reuses or ends the pool, `shutdown` included (re-entrant: `run` ends a pool that does
# not fit through `shutdown`): a second thread's call, or its ``train.shutdown()``, waits for the call in flight.
_lock = threading.RLock()
_registered = False
_exiting = False  # `_at_exit` ran: later calls keep no ranks
#: How long `shutdown` at exit waits for a call still in flight in another (daemon) thread before it ends the ranks.
EXIT_WAIT_S = 5.0


def _forget_in_child() -> None:
    """In a child forked from the launching process (the user's ``os.fork``, a DataLoader or a rank forked while a
    pool lives): the ranks are the parent's. Forget them without touching them (no call, no teardown at the
    child's exit, which would end the parent's ranks) and close the child's copies of their pipes, so that they
    still see the parent end the pool; a fresh lock (the parent's may have been held by another thread). The ranks
    leave multiprocessing's list of this process's children too: at the child's exit it would join them (and
    fail: "can only join a child process")."""
    global _current, _lock
    pool, _current, _lock = _current, None, threading.RLock()
    if pool is None:
        return
    children = getattr(multiprocessing.process, "_children", None)  # private, stable since Python 3.4
    for w in pool.group.workers:
        if isinstance(children, set):
            children.discard(w.process)
        for conn in (w.conn, w.stacks):
            if conn is not None:
                try:
                    conn.close()
                except OSError:
                    pass
        w.conn = w.stacks = None


os.register_at_fork(after_in_child=_forget_in_child)


def current() -> Pool | None:
    """The pool of this process, if one is alive."""
    return _current


#: Environment variables read once in a rank's life (by the process group, NCCL, gloo, CUDA, the OpenMP pool): a
#: change to any of them between calls ends the kept ranks, as the next call's ranks must start with it.
PROCESS_ENV_PREFIXES = ("CUDA_", "NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_GLOO_",
                        "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def pool_key(sendable: Callable[..., Any], opts: Options, nprocs: int,
             environ: Mapping[str, str] | None = None) -> tuple[Any, ...]:
    """What a call must match to run on the kept ranks: the function (its decorated origin), the process count, the
    options fixed for a process's life (everything but the per-call ``seed``, ``rank_seeds``, ``precision``,
    ``track``, ``max_restarts``, ``requeue``), and the environment variables read once per process
    (`PROCESS_ENV_PREFIXES`, ``CUDA_VISIBLE_DEVICES`` among them) of ``environ`` (default: this process's)."""
    # rank_seeds with them: it only says how ``seed`` seeds each rank (and may not stay True without a seed)
    fixed = attrs.evolve(opts, seed=None, rank_seeds=False, precision="32", track=None, max_restarts=0, requeue=False)
    env = os.environ if environ is None else environ
    process_env = tuple(sorted((k, v) for k, v in env.items() if k.startswith(PROCESS_ENV_PREFIXES)))
    return sendable, nprocs, fixed, process_env


def shutdown(fn: Callable[..., Any] | None = None) -> None:
    """End the kept ranks, if any (``fn``: only where they were kept for that decorated function, what
    ``train.shutdown()`` asks): each leaves the process group and exits (killed after a grace); the store
    closes. Runs at this process's exit; call it to free the ranks' memory (GPU memory included) sooner. Waits for
    a call in flight in another thread to end first."""
    with _lock:
        _end(fn)


def _at_exit() -> None:
    """`shutdown` at this process's exit; a call still in flight in a daemon thread is not waited for long. A call
    made after it (from an exit handler that runs later) keeps no ranks: nothing would end them before
    multiprocessing's own exit handler waits for them."""
    global _exiting
    _exiting = True
    got = _lock.acquire(timeout=EXIT_WAIT_S)
    try:
        _end(None)
    finally:
        if got:
            _lock.release()


def _end(fn: Callable[..., Any] | None = None) -> None:
    global _current
    if _current is None or (fn is not None and _current.key[0] is not fn):
        return
    pool, _current = _current, None
    if pool.owner != os.getpid():  # a copy of the parent's: its ranks are not ours to end (`_forget_in_child`)
        return
    for w in pool.group.workers:  # a stopped rank (SIGSTOP, `_unfit`) could not leave by itself: let it
        if w.alive:
            try:
                os.kill(w.process.pid, signal.SIGCONT)
            except OSError:
                pass
    pool.group.release()
    pool.group.teardown()
    logger.debug("keep_alive: {} ranks ended after {} call(s)", pool.group.nprocs, pool.calls)


def _unfit(pool: Pool, key: tuple[Any, ...]) -> str | None:
    """Why the kept ranks cannot take the next call (then fresh ones do), or ``None``: other options or
    process-level environment, a rank that died, or one stopped (SIGSTOP, a debugger) or a zombie, which would
    stall the call until the collective timeout (30 min by default) instead of starting it."""
    if pool.key[3] != key[3]:
        was, now = dict(pool.key[3]), dict(key[3])
        names = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
        return f"{', '.join(names)} changed, which a rank reads once when it starts"
    if pool.key[0] is not key[0]:
        return f"another function: {getattr(key[0], '__qualname__', key[0])}"
    if pool.key != key:
        return "options changed"
    if not pool.group.succeeded():
        return "a rank died since the last call"
    for pid in pool.pids:
        found = process.stat(f"/proc/{pid}/stat")  # None without /proc (not Linux): the check above is all
        if found is not None and found[1] in ("T", "t", "Z", "X"):
            return f"rank {pool.pids.index(pid)} (pid {pid}) is stopped or gone"
    return None


def run(sendable: Callable[..., Any], cfg: Any, opts: Options, nprocs: int,
        start: Callable[[], tuple[str, str, str | None]]) -> Any:
    """One call of a kept-alive job: on the live ranks where they fit (`pool_key`), else on fresh ones, kept
    when the call succeeds. ``start``: the start method, why, and the fork server, asked only for fresh ranks (a
    launching process that hosts the store has threads, so "auto" would say forkserver for later calls)."""
    key = pool_key(sendable, opts, nprocs)
    if _exiting:
        method, reason, server = start()
        return local.launch(sendable, cfg, opts, nprocs, method=method, reason=reason, server=server)
    with _lock:
        pool = _current
        why = None if pool is None else _unfit(pool, key)
        if why is not None:
            logger.info("keep_alive: starting fresh ranks ({})", why)
            _end()
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
        atexit.register(_at_exit)  # before multiprocessing's own exit handler, which would join the ranks
        _registered = True
    return value


def _job(pool: Pool, sendable: Callable[..., Any], cfg: Any, opts: Options) -> bytes:
    """The next call as the ranks read it (`protocol.next_call`), pickled once for all of them: the function, the
    ``cfg``, the options, and what a fresh launch would have taken from this process as it is now: the environment
    (its changes), the working directory and ``sys.path``.

    Forked ranks hold a copy of ``__main__`` from when they started: a function of ``__main__`` goes by name along
    (`_main_globals`) with the current values of the ``__main__`` globals it reads, as a fresh fork would see them.

    Raises:
        Exception: the call cannot be sent (a ``cfg`` or global neither pickle nor cloudpickle can send): `_again`
            starts fresh ranks instead, where fork needs no pickle and any other start method reports it.
    """
    cfg = protocol.compact_views(cfg)
    sendable = preflight.sendable(sendable)
    fn, cfg, _ = shipping.pack(sendable, cfg, pool.method, opts.start_method)
    if isinstance(fn, shipping.Parcel):  # the environment goes as its changes, below, not whole
        fn = attrs.evolve(fn, environ=None)
        if pool.method == "fork" and fn.payload is None:  # by name, found in the ranks' copy of __main__
            fn = attrs.evolve(fn, main_globals=_main_globals(getattr(sendable, "__wrapped__", sendable)))
    now = dict(os.environ)
    changed = {k: v for k, v in now.items() if pool.environ.get(k) != v}
    gone = [k for k in pool.environ if k not in now]
    # the function and cfg as bytes of their own: a rank that cannot load them (a class it cannot import) reports
    # that as the call's failure, instead of dying while it reads the call
    parts = (pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL), pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))
    job = pickle.dumps((*parts, opts, changed, gone, os.getcwd(), list(sys.path)), protocol=pickle.HIGHEST_PROTOCOL)
    pool.environ = now  # only once the call can go: a call that could not leaves the ranks' environment as it was
    return job


def _main_globals(fn: Callable[..., Any]) -> bytes | None:
    """The ``__main__`` globals that ``fn`` (a function of ``__main__``) and the ``__main__`` functions it calls read,
    pickled, for forked kept ranks to take on before the call (`shipping.unpack`): their ``__main__`` is a copy
    from their start, and a fresh fork would see the values as they are now (a global rebound or changed in place
    between calls). Modules, functions and classes are left out (the ranks resolve them by name, as they resolve
    ``fn``), and so is a value plain pickle cannot send (a lock, an open writer): the ranks keep their own copy.
    Cheaper than sending ``fn`` by value (cloudpickle takes milliseconds on a function that uses torch)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(fn, "__module__", None) != "__main__":
        return None
    space = vars(main)
    values: dict[str, Any] = {}
    seen: set[int] = set()
    todo = [getattr(fn, "__code__", None)]
    while todo:
        code = todo.pop()
        if not isinstance(code, types.CodeType) or id(code) in seen:
            continue
        seen.add(id(code))
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))  # nested functions, lambdas
        for name in code.co_names:
            if name not in space or name in values or name.startswith("__"):
                continue
            value = space[name]
            if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
                todo.append(value.__code__)  # a helper of the script: the globals it reads too
            if isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)):
                continue
            try:
                values[name] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - anything plain pickle refuses stays the ranks' own
                continue
    return pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL) if values else None  # {name: its own pickle}


def _again(pool: Pool, sendable: Callable[..., Any], cfg: Any, opts: Options, nprocs: int, key: tuple[Any, ...],
           start: Callable[[], tuple[str, str, str | None]]) -> Any:
    """A later call on the live ranks; whatever does not succeed ends them (and may restart on fresh ones). A call
    that cannot reach them (it cannot be pickled, a rank's pipe is gone) runs on fresh ranks instead: nothing of it
    ran yet, and a fresh launch may take what the kept ranks cannot (fork sends nothing by pickle)."""
    global _current
    group = pool.group
    try:
        try:
            with tracking_key.exported():  # a job of its own: a tracked run of its own
                job = _job(pool, sendable, cfg, opts)
            group.call(job, opts)
        except Exception as exc:  # noqa: BLE001 - any reason the call cannot reach the ranks: fresh ones take it
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            logger.info("keep_alive: starting fresh ranks (the call cannot reach the kept ones: {})", why)
            _end()
            return _fresh(sendable, cfg, opts, nprocs, key, start)
        group.wait()
    except BaseException:
        _end()
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
