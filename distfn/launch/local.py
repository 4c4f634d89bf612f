"""Local workers: start a job's ranks as processes of this machine (fork, forkserver or spawn), watch them, bring
back a result or the first failure, and leave nothing behind.

Two callers: a self-spawned job (``python train.py``: the ranks meet on a loopback store this process hosts) and
a per-node launch (`distfn.launch.pernode`: the ranks of this node get their global places from a topology
callable and meet on the external launcher's master).

Shape (after ``torch/multiprocessing/spawn.py``, whose ``ProcessContext`` also owns its processes):

* `launch` reads start -> poll -> teardown; a `WorkerGroup` owns the workers, their reports, the signal
  forwarder and the rendezvous store;
* a loopback socket is bound *before* the workers start, so the port is ours (no "pick a free port and hope"
  race) and the rendezvous store is reachable from this machine only;
* each worker reports exactly once through its own pipe (`distfn.launch.protocol`: ``("ok", pickled value or
  None)``, ``("exit", Failure)`` or ``("error", Failure)``); a worker that dies without reporting is described
  from its exit code / signal;
* a second pipe per worker carries its ``faulthandler`` output: the Python stack of a crash (SIGSEGV, ...),
  and on request (``DUMP_SIGNAL``) every rank's stack when a collective timed out and the ranks could not
  collect the hang report among themselves (`distfn.hangs`: a rank aborted by NCCL's watchdog, a timeout
  before the responders started);
* the root cause leads (`protocol.root_cause_first`), the others are stopped at once (SIGTERM, SIGKILL
  after a grace, the worker's whole process group), and it all becomes one ``WorkerError``;
* Ctrl-C, SIGTERM and SIGUSR2 reaching this process are forwarded to the workers (see ``preemption.py`` for
  what they do there); every worker also dies with this process (PR_SET_PDEATHSIG).

The checks before the start are in `distfn.preflight`, the failure records in `distfn.failures`, what a rank does
around the function in `distfn.launch.protocol`, how the function and ``cfg`` travel under spawn/forkserver in
`distfn.launch.shipping`. Under torchrun / srun / mpirun none of this runs (`distfn.failures.report_in_place` is
all a failing rank does there).

A restart (``max_restarts``) is on the critical path of a job that lost a rank, so it waits for nothing it does
not need: the first one starts as soon as every worker is gone (`restart_delay`), a death by signal needs no
settle window (`WorkerGroup.cause_is_known`), and under fork the new workers inherit what ``ctx.wrap`` imported
(`WRAP_IMPORTS`). ``DISTFN_LAUNCH_TRACE`` (`TRACE_ENV`) times its parts for bench/bench_restart.py.

(About 750 lines: both ends of the pipes live here, so that they change together.)
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Final

import attrs
import torch.multiprocessing as mp
from loguru import logger

from .. import preemption, preflight, worker
from ..errors import ConfigError, Terminated, WorkerError
from ..failures import Failure, innermost_user_frame, main_stack
from ..options import Options
from ..topology import LOOPBACK, Topology
from ..tracking import key as tracking_key
from . import protocol, shipping

__all__ = ["BOOTSTRAP", "TRACE_ENV", "WorkerGroup", "before_restart", "launch", "restart_delay"]

#: Seconds the other workers get to exit after a failure or Ctrl-C before they are killed.
STOP_GRACE = 5.0

#: Seconds the workers get to finish (save a checkpoint, run ``finally`` blocks) after the launching process
#: received SIGTERM and forwarded it, before they are killed. SLURM kills the whole step 30 s (``KillWait``)
#: after its SIGTERM anyway; a second SIGTERM kills at once.
TERM_GRACE = 30.0

#: Asks a worker to write every thread's Python stack into its stack pipe (``faulthandler.register``).
DUMP_SIGNAL = signal.SIGUSR1

#: Seconds the launching process waits for the workers' stacks after asking for them.
DUMP_WAIT = 2.0

#: Seconds before the second restart of a failed job (``max_restarts``); doubled for each further one, at most
#: ``RESTART_BACKOFF_MAX``. The first restart starts at once (`restart_delay`).
RESTART_BACKOFF = 1.0
RESTART_BACKOFF_MAX = 30.0

#: A file the launcher appends its timestamps to ("<event> <attempt> <unix time>" lines: "started", the
#: attempt's workers forked; "noticed", its first failure seen; "settled", the failures ordered and explained;
#: "torn-down", every worker gone; "imported", `_warm_for_restart` done), for ``bench/bench_restart.py``'s
#: parts of a restart. Read once, here: unset (the default), an event costs one comparison.
TRACE_ENV = "DISTFN_LAUNCH_TRACE"
_TRACE_PATH = os.environ.get(TRACE_ENV) or None


def _trace(event: str, attempt: int) -> None:
    """Append ``event`` to the trace file of `TRACE_ENV`, if one was set (one short append: ``O_APPEND`` keeps
    the lines of several processes whole)."""
    if _TRACE_PATH is not None:
        with open(_TRACE_PATH, "a") as f:
            f.write(f"{event} {attempt} {time.time():.6f}\n")

# --------------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------------
# The write end of this worker's stack pipe; faulthandler writes to its raw descriptor, which must stay open.
_STACK_CONN: Connection | None = None


def _arm_faulthandler(conn: Connection) -> None:
    """Send this worker's Python stacks to the launching process on a crash and on ``DUMP_SIGNAL``.

    faulthandler writes from its C signal handler, so it works while the main thread is blocked inside a
    collective (where no Python code runs). The pipe is non-blocking: a full pipe loses a dump, never hangs.
    """
    global _STACK_CONN
    _STACK_CONN = conn
    fd = conn.fileno()
    os.set_blocking(fd, False)
    faulthandler.enable(file=fd, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True)


def _entry(
    fn: Callable[..., Any],
    cfg: Any,
    opts: Options,
    topology: Topology,
    store_port: int | None,
    conn: Connection,
    stack_conn: Connection,
    parent_pid: int,
    listen_fd: int,
    attempt: int = 0,
    keep_alive: bool = False,
) -> None:
    """The first code a worker runs (module-level so spawn can find it). ``topology``: this rank's place;
    ``store_port``: the loopback port of the launching process's store, or ``None`` where the ranks meet on the
    launcher's master instead (a per-node launch, `distfn.launch.pernode`); ``parent_pid``: see
    `protocol.die_with_parent` (0 under forkserver, whose server is the parent); ``attempt``: see
    `distfn.options.restart_attempt`; ``keep_alive``: after a success, wait on ``conn`` for the next call
    (`distfn.launch.pool`)."""
    shipping.arrive(fn)  # forkserver: the launching process's environment, as it is now
    protocol.die_with_parent(parent_pid)
    try:
        os.setpgid(0, 0)  # own process group: a terminal's Ctrl-C reaches the launcher, which forwards it once
    except OSError:
        pass
    _arm_faulthandler(stack_conn)
    # At once, not when the function starts: the launching process forwards SIGUSR2 as soon as the workers
    # exist, and SIGUSR2's default action would kill a worker that is still starting up.
    preemption.install()
    if listen_fd >= 0:
        try:
            os.close(listen_fd)  # forked copy of the launcher's rendezvous socket; only the launcher listens
        except OSError:
            pass
    worker.mark_active(True)
    protocol.export_rank_env(topology, attempt)
    store = None
    if store_port is not None:  # the ranks meet on this machine's loopback (a per-node launch meets across nodes)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
        if opts.init_method == "env://":
            # the environment is the one set above, whose store this process's launcher hosts: join it (with
            # env:// rank 0 would try to host a second store on the same port)
            opts = attrs.evolve(opts, init_method=None)

    deliver = functools.partial(_deliver, conn, keep_alive)

    try:
        if store_port is not None:
            store = protocol.join_store(LOOPBACK, store_port, topology.world_size, opts.timeout)
        fn, cfg = shipping.unpack(fn), shipping.unpack(cfg)  # spawn/forkserver: see distfn.launch.shipping
    except BaseException as exc:  # noqa: BLE001 - reported like a failure of the function
        message = protocol.classify(topology.rank, exc)
        deliver(message)
    else:
        message = protocol.run_rank(getattr(fn, "__wrapped__", fn), cfg, opts, topology, store=store,
                                    deliver=deliver, pack=_pickle_result, keep_group=keep_alive)
        if keep_alive and message[0] == "ok":
            message = _serve_calls(conn, topology, store, deliver)
    if message[0] == "error":
        _flush_stderr()
        os._exit(1)


def _deliver(conn: Connection, keep: bool, message: protocol.Message) -> None:
    """A worker's report of a call to the launching process (result, failure or early exit); ``keep``: the pipe
    stays open for the next call of a kept-alive job."""
    # The function is over: a SIGTERM now (the launching process stopping the job) just ends the process,
    # rather than raising Terminated into the report being sent or into interpreter shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        conn.send(message)
        if not keep:
            conn.close()
    except (OSError, ValueError):
        pass  # the launcher is gone; PDEATHSIG ends us


def _serve_calls(conn: Connection, topology: Topology, store: Any,
                 deliver: Callable[[protocol.Message], None]) -> protocol.Message:
    """A rank of a kept-alive job after its first call succeeded: run the calls that come on ``conn`` on the process
    group already up, until one does not succeed or the pool ends (then leave the group); the last report."""
    message: protocol.Message = ("ok", None)
    while message[0] == "ok" and (job := protocol.next_call(conn, topology)) is not None:
        try:
            fn, cfg, opts = shipping.unpack(pickle.loads(job[0])), shipping.unpack(pickle.loads(job[1])), job[2]
        except BaseException as exc:  # noqa: BLE001 - reported like a failure of the function
            message = protocol.classify(topology.rank, exc)
            deliver(message)
            return message  # the process group goes with the process
        message = protocol.run_rank(getattr(fn, "__wrapped__", fn), cfg, opts, topology, store=store,
                                    deliver=deliver, pack=_pickle_result, keep_group=True)
    if message[0] == "ok":
        worker.leave_group(failed=False)  # the pool ended: the launching process closed ``conn``
    return message


def _flush_stderr() -> None:
    if sys.stderr is not None:  # None: started with stderr closed (``2>&-``)
        sys.stderr.flush()


def _pickle_result(result: Any) -> bytes:
    result = protocol.to_cpu(result)
    try:
        return shipping.dumps_result(result)  # by value where the function came by value (a notebook's class)
    except Exception:  # noqa: BLE001
        found = preflight.find_unpicklable(result, "return value") or ("return value", result, RuntimeError("?"))
        raise ConfigError(preflight.unpicklable_message(
            found, "it must be to reach the caller",
            "Return plain data (numbers, strings, tensors, dicts/lists of them), not models or open resources.",
        )) from None


def _loopback_ifname() -> str:
    """The name of the loopback interface (gloo otherwise binds the interface the hostname resolves to)."""
    try:
        for _, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


# distfn's frames between a worker's start and the user's function: stack dumps are cut there.
BOOTSTRAP = (worker.run, protocol.run_rank, _entry)


# --------------------------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------------------------
@attrs.define
class _Worker:
    rank: int
    process: Any
    conn: Connection | None
    stacks: Connection | None = None  # read end of the worker's faulthandler pipe
    reported: bool = False
    ok: bool = False  # reported a result (the function returned)
    result: bytes | None = None
    dump: bytes = b""  # what came through the stack pipe so far
    early_exit: Failure | None = None  # the function ended with sys.exit(0): no error, unless the others fail

    def read_stacks(self) -> bool:
        """Append what the stack pipe holds to ``dump``; False once the pipe is closed."""
        if self.stacks is None:
            return False
        while True:
            try:
                chunk = os.read(self.stacks.fileno(), 65536)
            except BlockingIOError:
                return True
            except OSError:
                chunk = b""
            if not chunk:
                self.stacks.close()
                self.stacks = None
                return False
            self.dump += chunk

    def receive(self, failures: list[Failure], keep: bool = False) -> None:
        """Read the worker's one report of this call (a result, or a failure appended to ``failures``); ``keep``:
        the pipe stays open for the next call (a kept-alive job)."""
        assert self.conn is not None
        try:
            kind, data = self.conn.recv()
        except (EOFError, OSError):
            self.conn.close()
            self.conn = None
            return
        self.reported = True
        if kind == "ok":
            self.ok = True
            self.result = data
        elif kind == "exit":
            self.ok = True
            self.early_exit = data
        else:
            failures.append(data)
        if not keep:
            self.conn.close()
            self.conn = None

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None


def _signal_live(workers: list[_Worker], sig: int) -> None:
    for w in workers:
        if w.alive:
            try:
                os.kill(w.process.pid, sig)
            except ProcessLookupError:
                pass


def _kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a worker made itself its leader with setpgid).

    Used while the leader is alive or after it ended (failed or returned), when its children may outlive it:
    Linux does not reuse a pid while a live process still has it as its process group id, so this reaches
    exactly the worker's leftovers (DataLoader workers notice a dead parent only every 5 s).
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@attrs.define
class _Forwarder:
    """Forwards SIGTERM and SIGUSR2 from the launching process to the workers (main thread only).

    SIGUSR2 only makes ``ctx.should_stop`` true in the workers. SIGTERM does that too (or raises
    ``Terminated`` in a function that never polls ``should_stop``) and starts ``TERM_GRACE``; a second SIGTERM
    kills the workers at once. The handler only sends signals and sets fields: logging from a signal handler
    could deadlock on a lock the interrupted code holds.
    """

    workers: list[_Worker]
    previous: dict[int, Any] = attrs.field(factory=dict)
    received: str | None = None
    deadline: float | None = None

    def install(self) -> None:
        self.previous = preemption.set_handlers({signal.SIGTERM: self._handle, signal.SIGUSR2: self._handle})

    def restore(self) -> None:
        preemption.restore_handlers(self.previous)
        self.previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and self.deadline is not None:
            _signal_live(self.workers, signal.SIGKILL)
            return
        _signal_live(self.workers, signum)
        if self.received is None or signum == signal.SIGTERM:
            self.received = signal.Signals(signum).name
        if signum == signal.SIGTERM:
            self.deadline = time.monotonic() + TERM_GRACE

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def remaining(self) -> float:
        return 0.0 if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class WorkerGroup:
    """The workers of one self-spawned job and what the launching process keeps about them: their reports and
    failures, the signal forwarder and the rendezvous store (``start`` -> ``wait`` -> ``teardown`` ->
    ``outcome``)."""

    def __init__(self, method: str, nprocs: int, opts: Options, attempt: int = 0, *,
                 topology: Callable[[int], Topology] | None = None, own_store: bool = True,
                 keep_alive: bool = False) -> None:
        """``topology``: the place of local worker ``i`` (default: worker ``i`` of ``nprocs`` self-spawned on this
        machine); ``own_store``: this process hosts the ranks' rendezvous store on a loopback port (``False``
        where they meet elsewhere, e.g. on the master of a per-node launch); ``keep_alive``: the workers wait for
        further calls after a success (`call`, `succeeded`, `release`; `distfn.launch.pool`)."""
        self.method = method
        self.keep_alive = keep_alive
        self.own_store = own_store
        self.attempt = attempt  # 0 first, then one more for each restart (max_restarts)
        self.nprocs = nprocs
        self.opts = opts
        self.workers: list[_Worker] = []
        self.failures: list[Failure] = []
        self.stopped: list[Failure] = []  # errors reported by ranks while distfn stopped them
        self.forwarder = _Forwarder(self.workers)
        self.interrupted = False
        self.started = time.time()  # when the first worker was started (see `start`)
        self._context = mp.get_context(method)
        self._store: Any = None
        # loopback only: nothing outside this machine can reach the store
        self._listener = protocol.bind_listener(LOOPBACK, nprocs) if own_store else None
        self.port: int | None = self._listener.getsockname()[1] if self._listener is not None else None
        port = self.port or 0
        self.topology = topology or (lambda rank: Topology.self_spawned(rank, nprocs, port))

    # -- start ------------------------------------------------------------------------------------------------
    def start(self, fn: Callable[..., Any], cfg: Any) -> None:
        """Start every worker, then the forwarder and the store."""
        self.started = time.time()
        for rank in range(self.nprocs):
            self.workers.append(self._start_worker(rank, fn, cfg))
        _trace("started", self.attempt)
        # After the forks, so that no worker inherits a handler that signals its siblings.
        self.forwarder.install()
        # The store is started after the forks so no worker inherits its threads; until it accepts, the
        # kernel queues the workers' connections on the listening socket.
        if self._listener is not None:
            self._store = protocol.host_store(self._listener, LOOPBACK, None, self.opts.timeout)
            self._listener = None  # the store owns the socket now and closes it when it is destroyed

    def _start_worker(self, rank: int, fn: Callable[..., Any], cfg: Any) -> _Worker:
        # a kept-alive job's pipe carries the next calls to the worker too
        reader, writer = self._context.Pipe(duplex=self.keep_alive)
        stack_reader, stack_writer = self._context.Pipe(duplex=False)
        process = self._context.Process(  # type: ignore[attr-defined]
            target=_entry,
            args=(fn, cfg, self.opts, self.topology(rank), self.port, writer, stack_writer,
                  os.getpid() if self.method != "forkserver" else 0,
                  self._listener.fileno() if self.method == "fork" and self._listener is not None else -1,
                  self.attempt, self.keep_alive),
            name=f"{worker.WORKER_NAME}{rank}",  # marks the child as a worker (`worker.in_worker`)
            daemon=False,  # daemonic processes may not have children: DataLoader workers need them
        )
        process.start()
        writer.close()
        stack_writer.close()
        os.set_blocking(stack_reader.fileno(), False)
        return _Worker(self.topology(rank).rank, process, reader, stack_reader)  # reports name the global rank

    # -- the next call of a kept-alive job ----------------------------------------------------------------------
    def call(self, job: bytes, opts: Options) -> None:
        """Start the next call on the live workers of a kept-alive job (``job``: what `protocol.next_call` reads),
        then `wait` as for the first. Raises ``OSError`` where a worker's pipe is gone."""
        self.opts, self.interrupted, self.started = opts, False, time.time()
        self.failures.clear()
        self.stopped.clear()
        self.forwarder.received = self.forwarder.deadline = None
        for w in self.workers:
            w.reported, w.ok, w.result, w.early_exit, w.dump = False, False, None, None, b""
            assert w.conn is not None
            w.conn.send_bytes(job)
        self.forwarder.install()

    def succeeded(self) -> bool:
        """Every rank returned normally (no failure, no ``sys.exit``, no Ctrl-C, no stop signal forwarded): the
        workers of a kept-alive job are then fit for another call."""
        return not self.failures and not self.interrupted and self.forwarder.received is None \
            and all(w.ok and w.early_exit is None and w.conn is not None and w.alive for w in self.workers)

    def release(self) -> None:
        """End a kept-alive job: close the workers' pipes, so that each leaves the process group and exits;
        `teardown` then waits for them (and kills what does not go)."""
        for w in self.workers:
            if w.conn is not None:
                w.conn.close()
                w.conn = None

    # -- poll -------------------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Collect reports until every rank reported, one failed, SIGTERM's grace ran out or Ctrl-C came; after a
        failure, put the root cause first and explain it."""
        while not self.failures and not all(w.reported for w in self.workers) and not self.forwarder.expired():
            try:
                self.collect(timeout=1.0)
            except KeyboardInterrupt:
                self.interrupted = True
                return
        if self.failures:
            _trace("noticed", self.attempt)
            if not self.cause_is_known():
                self.settle()
            self.failures[:] = protocol.root_cause_first(
                self.failures, [w.early_exit for w in self.workers if w.early_exit is not None],
                timeout_s=self.opts.timeout.total_seconds(), forwarded=self.forwarder.received,
                returned=[w.rank for w in self.workers if w.ok and w.early_exit is None],
                failed=[w.rank for w in self.workers if w.reported and not w.ok],
                stacks=lambda first: self.request_stacks(
                    [w for w in self.workers if w.rank != first.rank and not w.reported]),
                elapsed_s=lambda first: first.time - self.started,
            )
            _trace("settled", self.attempt)

    def collect(self, timeout: float) -> None:
        """Read what is ready (waiting at most ``timeout``), and describe workers that died without reporting.

        Failures are kept in the order they were seen; within one round, deaths without a report (a signal: the
        likely root cause) come before errors the surviving ranks report about losing their peer.
        """
        conns: dict[Any, _Worker] = {w.conn: w for w in self.workers if w.conn is not None}
        sentinels = [w.process.sentinel for w in self.workers if w.alive]
        ready = wait(list(conns) + sentinels, timeout=timeout)
        deaths: list[Failure] = []
        reported: list[Failure] = []
        for w in self.workers:
            if not w.alive and not w.reported:
                if w.conn is not None and w.conn.poll():
                    w.receive(reported, keep=self.keep_alive)
                if not w.reported:
                    w.reported = True
                    w.read_stacks()  # a crash (SIGSEGV, SIGABRT, ...) left its Python stack there
                    crash = main_stack(w.dump.decode("utf-8", "replace"), BOOTSTRAP) if w.dump else ""
                    deaths.append(Failure.from_exit(w.rank, w.process.pid, w.process.exitcode, crash))
        for obj in ready:
            found = conns.get(obj)
            if found is not None and found.conn is not None:
                found.receive(reported, keep=self.keep_alive)
        self.failures.extend(deaths)
        self.failures.extend(sorted(reported, key=lambda f: f.time))

    def cause_is_known(self) -> bool:
        """Whether `settle` can be skipped: this attempt is going to be restarted and a rank of it was killed by a
        signal without reporting (SIGKILL, SIGSEGV, ...), which `distfn.failures.order_failures` puts first
        whatever the others report next (losing it, consequences). Their reports would only lengthen the warning
        about the failed attempt, at the cost of the whole window: a survivor first collects the hang report
        (`distfn.hangs`, at least its 0.5 s claim window), so the window always ran out (bench/bench_restart.py).
        The last attempt settles as before: its failures are what the caller gets."""
        return (self.attempt < self.opts.max_restarts and not self.interrupted and self.forwarder.received is None
                and any(f.signal is not None and f.retryable for f in self.failures))

    def settle(self, window: float = protocol.SETTLE_WINDOW) -> None:
        """After the first failure, give the other ranks' reports ``window`` seconds to arrive, so that the root
        cause can be told from its consequences (a rank that raised reports after its peers saw it leave)."""
        deadline = time.monotonic() + window
        while not all(w.reported for w in self.workers) and time.monotonic() < deadline:
            self.collect(timeout=min(0.05, max(0.0, deadline - time.monotonic())))

    def request_stacks(self, workers: list[_Worker], wait_s: float = DUMP_WAIT) -> dict[int, str]:
        """Ask live ``workers`` for their Python stacks (``DUMP_SIGNAL``); ``{rank: main thread's stack}``."""
        live = [w for w in workers if w.alive and w.stacks is not None]
        for w in live:
            w.read_stacks()
            w.dump = b""  # only the answer to this request
        _signal_live(live, DUMP_SIGNAL)
        deadline = time.monotonic() + wait_s
        pending: dict[Any, _Worker] = {w.stacks: w for w in live}
        answered: set[int] = set()
        while pending and time.monotonic() < deadline:
            # faulthandler writes a dump in many small writes: once every worker answered, stop at the first
            # quiet 0.1 s
            quiet = len(answered) == len(live)
            ready = wait(list(pending), timeout=0.1 if quiet else max(0.0, deadline - time.monotonic()))
            if not ready and quiet:
                break
            for conn in ready:
                w = pending[conn]
                if not w.read_stacks():
                    del pending[conn]
                if w.dump:
                    answered.add(w.rank)
        return {w.rank: main_stack(w.dump.decode("utf-8", "replace"), BOOTSTRAP) for w in live if w.dump}

    # -- teardown ---------------------------------------------------------------------------------------------
    def stop(self, sig: int | None, grace: float) -> None:
        """Send ``sig`` (if any) to the live workers, give them ``grace`` seconds, then SIGKILL what is left."""
        if sig is not None:
            _signal_live(self.workers, sig)
        deadline = time.monotonic() + grace
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.alive:
                _kill_group(w.process.pid)  # the rank and what it started (DataLoader workers, subprocesses)
                w.process.join(5)

    def _stop_all(self) -> None:
        if self.interrupted:
            logger.warning("interrupted: stopping {} workers (Ctrl-C again to kill them at once)", self.nprocs)
            try:
                self.stop(signal.SIGINT, STOP_GRACE)
            except KeyboardInterrupt:
                self.stop(signal.SIGKILL, 0)
        elif self.forwarder.deadline is not None:
            # SIGTERM was forwarded: the workers are already stopping (saving, running finally blocks)
            self.stop(None, self.forwarder.remaining())
        elif self.failures:
            self.stop(signal.SIGTERM, 2.0)
        elif all(w.ok for w in self.workers):
            # every rank returned: let them exit by themselves (flushing their output, joining their own
            # children); only one that does not within the grace is killed
            self.stop(None, STOP_GRACE)
        else:
            self.stop(signal.SIGTERM, STOP_GRACE)  # this process failed (e.g. the store did not start)

    def teardown(self) -> None:
        """Stop what still runs, read the last reports, close every pipe, restore the signal handlers and close
        the store: nothing of the job is left afterwards."""
        self._stop_all()
        # Errors the other ranks reported while being stopped come after the first one; a rank that distfn
        # itself stopped after the first failure reports Terminated, which is no news.
        for w in self.workers:
            if w.conn is not None and not w.reported and w.conn.poll():
                w.receive(self.stopped)
            if w.conn is not None:
                w.conn.close()
            if w.stacks is not None:
                w.stacks.close()
            w.process.join(1)
            # What the rank started and left running (a `sleep` from subprocess, a server it forgot to stop) is
            # ended on success as on failure: a job leaves nothing behind either way.
            _kill_group(w.process.pid)
        self.failures.extend(f for f in self.stopped
                             if self.forwarder.received or f.exc_type != Terminated.__qualname__)
        self.forwarder.restore()
        self._store = None
        if self._listener is not None:
            self._listener.close()
        _trace("torn-down", self.attempt)

    def retryable(self) -> bool:
        """Whether starting the job again could help: it failed by itself (not stopped by a signal from outside
        or Ctrl-C), and not with a ConfigError."""
        return bool(self.failures) and not self.interrupted and self.forwarder.received is None \
            and self.failures[0].retryable

    def outcome(self, earlier: list[Failure] | None = None) -> Any:
        """Rank 0's value, or the exception that describes how the job ended (``earlier``: the root causes of
        the attempts before this one)."""
        if self.interrupted:
            where = [f"rank {f.rank} in {innermost_user_frame(f.traceback, recent_first=False)}"
                     for f in sorted(self.stopped, key=lambda f: f.rank) if f.exc_type == "KeyboardInterrupt"]
            if where:
                logger.warning("interrupted {}", "; ".join(where))
            raise KeyboardInterrupt
        if self.failures:
            raise WorkerError(self.failures, earlier)
        if self.forwarder.expired() and not all(w.ok for w in self.workers):
            raise WorkerError([Failure(w.rank, socket.gethostname(), w.process.pid, "Terminated",
                                       f"still running {TERM_GRACE:g} s after SIGTERM was forwarded; killed")
                               for w in self.workers if not w.ok], earlier)
        payload = self.workers[0].result
        return None if payload is None else shipping.loads_result(payload)


def launch(fn: Callable[..., Any], cfg: Any, opts: Options, nprocs: int, *, method: str, reason: str,
           server: str | None = None, topology: Callable[[int], Topology] | None = None,
           keep: Callable[[WorkerGroup], None] | None = None, first: int = 0,
           earlier: list[Failure] | None = None) -> Any:
    """Run ``fn`` on ``nprocs`` new local workers and return rank 0's value (or raise ``WorkerError``).

    ``method``: the start method (`distfn.preflight.choose_start_method`) and ``reason`` why; ``server``: under
    forkserver, which fork server forks them (for the log line; the caller made sure one runs). ``topology``: the
    place of local worker ``i`` in a job that meets elsewhere (a per-node launch, where the value is ``None`` on
    every node but node 0); by default the workers are a job of their own on a loopback store of this process.

    A job that fails by itself is started again on fresh workers and a fresh rendezvous, up to
    ``opts.max_restarts`` times, after a back-off; never after a ConfigError or a stop from outside.

    ``keep``: the workers are kept alive (`distfn.launch.pool`): the group of an attempt that succeeded is handed to
    ``keep`` instead of torn down. ``first`` and ``earlier``: the attempt to start with and the root causes of
    the attempts before (a kept job's later call that failed, restarted on fresh workers).
    """
    preflight.check_port_free(opts.init_method)
    # every attempt of this job logs into one tracked run (distfn.tracking.key); set before the packing, which
    # takes the environment along to forkserver workers
    with tracking_key.exported():
        if method == "fork":
            logger.trace("starting {} workers, start method fork: {}", nprocs, reason)
        else:
            cfg = protocol.compact_views(cfg)  # travels by pickle: a view must not carry its whole storage
            fn, cfg, how = shipping.pack(preflight.sendable(fn), cfg, method, opts.start_method)
            logger.info("starting {} workers, start method {}: {}; {}", nprocs, method, reason,
                        f"{server}; {how}" if server else how)
        return _attempts(fn, cfg, opts, nprocs, method, topology, keep, first, list(earlier or ()))


def _attempts(fn: Callable[..., Any], cfg: Any, opts: Options, nprocs: int, method: str,
              topology: Callable[[int], Topology] | None, keep: Callable[[WorkerGroup], None] | None,
              first: int, earlier: list[Failure]) -> Any:
    """`launch`'s attempts: the first, then up to ``opts.max_restarts`` more after a failure (``earlier``: the
    root cause of each failed attempt before this one)."""
    for attempt in range(first, opts.max_restarts + 1):
        group = WorkerGroup(method, nprocs, opts, attempt, topology=topology, own_store=topology is None,
                            keep_alive=keep is not None)
        kept = False
        try:
            with shipping.main_for_workers(method):
                group.start(fn, cfg)
            group.wait()
            kept = keep is not None and group.succeeded()
        finally:
            if kept:
                group.forwarder.restore()  # the workers wait for the next call
            else:
                group.teardown()
        if keep is not None and kept:
            keep(group)
            return group.outcome(earlier)
        if attempt == opts.max_restarts or not group.retryable():
            return group.outcome(earlier)
        earlier.append(group.failures[0])
        before_restart(group, opts.max_restarts)
        _warm_for_restart(method, opts)
        _trace("imported", attempt + 1)
    raise AssertionError("unreachable: the last attempt returns or raises")


def restart_delay(failed_attempt: int) -> float:
    """Seconds to wait after attempt ``failed_attempt`` (0 first) failed, before the next one starts.

    The first restart starts at once: nothing of the failed attempt is left to wait for (every worker and what it
    started is gone once `WorkerGroup.teardown` returns, and the new attempt binds a fresh rendezvous port), so a
    wait would only add to the restart (it was 1 s of a 1.6 s overhead, bench/bench_restart.py). A job that fails
    again is likely failing for good or on something outside (a file system, a service): from the second restart on
    the wait is `RESTART_BACKOFF`, doubled each time up to `RESTART_BACKOFF_MAX`, so it does not spin.
    """
    if failed_attempt <= 0:
        return 0.0
    return min(RESTART_BACKOFF_MAX, RESTART_BACKOFF * 2 ** (failed_attempt - 1))


def before_restart(group: WorkerGroup, max_restarts: int) -> None:
    """Log the failed attempt (rank, traceback) and wait the back-off before fresh workers start."""
    delay = restart_delay(group.attempt)
    logger.warning("attempt {} of {} failed; starting the job again on fresh workers in {:g} s (max_restarts={}):"
                   "\n{}", group.attempt, max_restarts + 1, delay, max_restarts, WorkerError(group.failures))
    if delay:
        time.sleep(delay)


#: What ``ctx.wrap`` makes every rank import on its first call, which its launching process can import once for
#: all the workers it forks: DDP's constructor (and FSDP's ``fully_shard``) import ``torch._dynamo`` lazily, 1-2 s
#: per rank on this 2-core VM (5-12 s with 4 ranks contending for the cores; ``python -X importtime``, and the
#: "process group up -> ctx.wrap returned" part of bench/bench_restart.py). Importing it adds no thread.
WRAP_IMPORTS: Final = {"ddp": ("torch._dynamo",), "fsdp": ("torch._dynamo",)}


def _warm_for_restart(method: str, opts: Options) -> None:
    """Before the workers of a restart are forked: import in this process what the failed attempt's workers had to
    import in ``ctx.wrap`` (`WRAP_IMPORTS`), so that the new ones inherit it instead of each importing it again.

    Only under fork (spawn and forkserver workers do not inherit this process's modules) and only for a restart:
    a first launch must not wait for it here, while its workers import it in parallel. Never fails the restart: a
    module that cannot be imported is the workers' business, as it was on the first attempt.
    """
    if method != "fork":
        return
    for name in WRAP_IMPORTS.get(opts.mode, ()):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the workers import it again and report what fails
            logger.debug("not imported before the restart: {}: {}", name, exc)

