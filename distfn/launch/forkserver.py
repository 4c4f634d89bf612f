"""The fork server: where the workers of ``start_method="forkserver"`` fork from.

Re-importing torch in every spawned worker doubles the start-up time (measured: raw spawn 2.06x the raw-fork
floor). So where a call will start its workers with forkserver (the plan says so: `distfn.plan.CallPlan`), the
decorator asks for a server at decoration (`start_early`): while forking is still safe, a *copy of this process*,
single-threaded, with no CUDA context, torch already imported; where forking is already unsafe, a fresh interpreter
that imports distfn (and so torch), started in the background. It runs the standard library's fork-server loop
(`multiprocessing.forkserver`), so the workers fork from it later, however many threads or CUDA calls the
launching process has made since. A launch with no server yet starts one and waits for it (`ensure_server`).
A script gets its copy earlier, at its own ``from distfn import distributed`` (`distfn.decorator.copy_at_import`),
so that a torch op between that import and the decoration (the notebook order, in a script) still finds one; a
copy made in a script stays idle until a call needs it (`_await_first_use`, `wake`).

The server is named ``distfn-forksrv``, dies with the launching process (``PR_SET_PDEATHSIG`` and the standard
library's "alive" pipe; a copy is ended at the launching process's exit, `_stop_copy`) and never runs CUDA or user
code, nor a thread once it serves (a copy in a notebook readies itself in one low-priority thread first,
`_prepare`). Nothing
here may fail at decoration: a server that cannot start then (``TMPDIR`` too long for a Unix socket's path, ...)
is logged and tried again at the call, where it is a `ConfigError` naming the cause.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import os
import select
import shutil
import signal
import socket
import sys
import sysconfig
import threading
import time
import types
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Any, Final

from loguru import logger

from .. import logs, preflight
from ..errors import ConfigError
from .lifeline import die_with_parent

__all__ = ["SERVER_NAME", "ensure_server", "server_running", "start_early"]

#: What the fork server imports before it forks any worker, so that no worker imports it again: torch and the
#: modules a worker runs (``import distfn`` alone imports neither: the package is lazy, for an instant CLI; and
#: decorating imports none of the launch machinery, `distfn.execute`, so a copy made at decoration lacks it too).
#: Not the checkpoint writer and reader: like every rank, the server's load them at the first save or load.
PRELOAD: Final = ("distfn.execute",)

#: The fork server's process name (``/proc/PID/comm``, what ``ps`` and ``top`` show), at most 15 characters.
SERVER_NAME = "distfn-forksrv"

# How the current fork server came to be: "forked" (a copy of this process, made while forking was safe),
# "started" (a fresh interpreter that imported distfn), or None (none of ours).
_server_kind: str | None = None
# A copy made at a script's import before the pool probe answered (`start_early`'s ``copy_only``): its pid, until
# `_check_copy` read the answer.
_unverified: int | None = None
# When our copy was made, for the start-up log line (`server_description`).
_copied_at = "when the function was defined"
# The write end of the pipe that wakes a copy made idle at decoration (`wake`), until it is written or the copy goes.
_wake_fd: int | None = None
_server_lock = threading.Lock()  # two threads launching at once start one server


def _forkserver() -> Any:
    return forkserver._forkserver


# Python 3.14's fork server authenticates its clients with a key handed to it at start: there the standard
# library starts the server (preloading distfn, and so torch), and no copy of this process is made.
_OWN_SERVER = not hasattr(_forkserver(), "_forkserver_authkey") and hasattr(_forkserver(), "_forkserver_pid")


def server_running() -> bool:
    """True when a fork server (ours or one the standard library started) is alive for this process."""
    server = _forkserver()
    pid = server._forkserver_pid
    if pid is None:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        done = pid
    if done:  # dead: forget it, the next launch starts another
        _forget(server)
        return False
    return True


def _forget(server: Any) -> None:
    global _server_kind
    _close_wake()
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    _server_kind = None


def server_description() -> str:
    """Which fork server the workers fork from, for the start-up log line."""
    if _server_kind == "forked":
        return f"the fork server (a copy of this process made {_copied_at}, torch imported) forks them"
    if _server_kind == "started":
        return "the fork server (a fresh interpreter that imported torch) forks them"
    return "the standard library's fork server forks them"


def _serve(listener_fd: int, alive_r: int, address: str, parent_pid: int, copy: bool = False,
           wake_r: int | None = None) -> None:
    """The fork server's life: the standard library's loop, until the launching process is gone; then its socket
    (``TMPDIR/pymp-*/listener-*``) is removed, and the directory with it when nothing else is in it, or, when
    the launching process died, whole once its other users had time to end (`_remove_socket`).

    The launching process may die by SIGKILL, when none of its own clean-up runs: the server then gets SIGTERM
    from the kernel (``PR_SET_PDEATHSIG``), and the standard library's loop ends anyway when the "alive" pipe
    closes. Either way the loop ends with ``SystemExit`` here, and the socket goes.

    ``wake_r``: a copy made idle (`fork_server`) waits on it, the listener and the alive pipe before it prepares
    (`_await_first_use`).
    """
    server = os.getpid()

    def parent_died(signum: int, frame: Any) -> None:
        if os.getpid() != server:  # a worker just forked, before it set its own handler: die as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        signal.signal(signum, signal.SIG_IGN)  # once: the clean-up below must not be interrupted
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, parent_died)
    die_with_parent(0, SERVER_NAME, sig=signal.SIGTERM)  # a parent gone already: seen below, inside the try
    # This process only forks ranks: its objects stay out of the cyclic collector for good, in it and in the ranks
    # it forks (see `process.frozen_heap`: in a copy of a process that imported torch, the preload below would
    # otherwise trigger a full pass over torch's objects, 100-300 ms of CPU taken from the launching process).
    gc.freeze()
    try:
        if os.getppid() != parent_pid:  # it died before prctl took effect: clean up as for its SIGTERM
            raise SystemExit(0)
        if wake_r is not None and not _await_first_use(listener_fd, alive_r, wake_r):
            raise SystemExit(0)  # the launching process is gone without ever needing this copy
        _prepare(copy, low_priority=copy and wake_r is None)  # before the loop: a launch waits in the queue
        gc.freeze()  # and what the preparation made
        forkserver.main(listener_fd, alive_r, [])  # preload nothing more: done above
    finally:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except SystemExit:
            # The alive pipe's EOF ended the loop and the SIGTERM came a moment later, here (the kernel closes a
            # dying process's files before it sends the death signal): `parent_died` set SIG_IGN itself. Without
            # this catch its SystemExit left the clean-up below unrun and the ``pymp-*`` directory behind.
            pass
        _remove_socket(address, orphaned=_launcher_gone(parent_pid))


#: ``PF_EXITING`` in ``/proc/PID/stat``'s flags: the process is inside the kernel's exit (include/linux/sched.h).
_PF_EXITING: Final = 0x4


def _launcher_gone(parent_pid: int) -> bool:
    """Whether the launching process is dead or dying, as opposed to alive and closing the alive pipe on purpose.

    The server's loop ends at the alive pipe's EOF, and the kernel closes a dying process's files *before* it
    reparents its children: a server that asked ``getppid()`` alone saw its killed launcher as alive (it was still
    tearing down its memory), took the clean-up of a live launcher, and left the ``pymp-*`` directory with a dead
    rank's socket in it (3 runs of 4 in tests/test_shipping.py). A launcher in its exit is flagged ``PF_EXITING``
    from the start of the exit, before its files close.
    """
    if os.getppid() != parent_pid:
        return True
    try:
        with open(f"/proc/{parent_pid}/stat", "rb") as f:
            stat = f.read()
        flags = int(stat[stat.rindex(b")") + 2:].split()[6])  # field 9; the name before ")" may hold spaces
    except (OSError, ValueError, IndexError):
        return False  # no /proc (not Linux): the launcher's own exit removes its directory
    return bool(flags & _PF_EXITING)


#: How long a server whose launching process died waits for the rest of that process's multiprocessing
#: directory to go (sockets of processes still ending: a DataLoader worker notices a dead parent within 5 s and
#: unlinks its own) before it removes the directory whole.
LINGER_S: Final = 6.0


def _remove_socket(address: str, orphaned: bool = False) -> None:
    """Remove the server's socket, and its directory (multiprocessing's ``pymp-*`` of the launching process)
    when nothing else is in it. ``orphaned``: the launching process is dead (SIGKILL: its own clean-up, which
    removes that directory, never ran), so the directory goes whole once its other users had `LINGER_S` to end:
    the ranks forked from this server or from the launcher inherit it as *their* multiprocessing directory, and
    what they left in it (a rank's listener socket, killed with the launcher) would keep it for good."""
    if mp_util.is_abstract_socket_namespace(address):
        return
    with contextlib.suppress(OSError):
        os.unlink(address)
    directory = os.path.dirname(address)
    if not orphaned or not os.path.basename(directory).startswith("pymp-"):
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # only an empty directory: the launching process removes its own at exit
        return
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            if not os.listdir(directory):
                break
        except OSError:
            return  # gone already
        time.sleep(0.1)
    shutil.rmtree(directory, ignore_errors=True)


def serve(listener_fd: int, alive_r: int, parent_pid: int, address: str) -> None:
    """Entry point of a fork server started as a fresh interpreter (see `start_server`). The launching process
    may die while this one still imports torch (seconds): `_serve` is ready for that (its SIGTERM and the
    socket's removal) before the import, which `_prepare` does."""
    _serve(listener_fd, alive_r, address, parent_pid)


def _preload() -> None:
    """Import `PRELOAD` in the server (a no-op for what is imported already)."""
    for name in PRELOAD:
        importlib.import_module(name)


#: The nice value of the thread that prepares a copy made at decoration (`_prepare`): the lowest priority.
PREPARE_NICE: Final = 19


def _await_first_use(listener_fd: int, alive_r: int, wake_r: int) -> bool:
    """In a copy made idle at decoration: block until the launching process needs it (it wrote to the wake pipe,
    or a launch connected: the connection waits in the listener's queue for the loop), True; or until the launching
    process is gone (the alive pipe's EOF, or the wake pipe's without a byte), False.

    Idle costs nothing: in a plain script that is still safe to fork at the call, the workers fork from the
    launching process and this copy never runs a line more. Its preparation (`_prepare`: ~50-90 ms of CPU, the
    launch machinery's import among it) ran at once before, competing with the launching process's own import of
    the same modules and its workers' start on a 2-core machine (bench/bench_launch.py)."""
    while True:
        ready, _, _ = select.select([listener_fd, alive_r, wake_r], [], [])
        if alive_r in ready:
            return False
        if wake_r in ready:
            woken = os.read(wake_r, 1) != b""
            os.close(wake_r)  # the ranks forked from here must not hold it
            return woken
        return True  # a launch connected without waking it first (`ensure_server` wakes before it connects)


def _prepare(copy: bool, low_priority: bool = False) -> None:
    """Get the server ready to fork ranks: in a copy, forget the user's modules; import `PRELOAD`; add the sink.

    ``low_priority``: in a copy made ready at once at decoration (an interactive session: a notebook's cells
    leave idle time to prepare in; a script's copy waits idle instead, `_await_first_use`) this runs in a thread
    at the lowest CPU priority, joined before the server serves. Such a copy may still be a spare (a kernel that
    is still safe to fork at the call forks), and its preparation (~50-110 ms of CPU: the realpath of every
    module, ``distfn.execute``'s import, a loguru sink) would compete for the cores with the launching process
    importing the same modules and its workers starting (bench/bench_launch.py). At nice 19 it takes what the job
    leaves idle; where the copy is used (fork became unsafe before the call) the launching process waits for it,
    the cores are idle and the thread runs at full speed. The niceness is the thread's own (Linux keeps it per
    thread): the server's main thread, which forks every rank, keeps the launching process's priority, and the
    thread is gone before the first fork, so the server still forks single-threaded.
    """
    def work() -> None:
        if copy:
            _forget_user_modules()
        _preload()
        logs.install_sink()  # once here, so the ranks forked from this server do not each add one (~5 ms)

    if not low_priority:  # a fresh interpreter or a woken copy: the launch is waiting for it, nothing to yield to
        work()
        return
    failed: list[BaseException] = []

    def niced() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICE)  # this thread only
        except OSError:
            pass  # not allowed here (a seccomp profile): prepare at the normal priority
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised again in the server's main thread, below
            failed.append(exc)

    thread = threading.Thread(target=niced, name="distfn-prepare")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _listen() -> tuple[socket.socket, str, int, int]:
    listener = socket.socket(socket.AF_UNIX)
    address = mp_connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener.bind(address)
    if not mp_util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    return listener, address, alive_r, alive_w


def _register(kind: str, pid: int, address: str, alive_w: int) -> None:
    global _server_kind
    server = _forkserver()
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    _server_kind = kind


def _forget_user_modules() -> None:
    """In the forked server: drop the modules of the user's own code (not the standard library's, not installed
    packages', not distfn's), so that each worker imports them afresh, as under spawn, rather than keeping the
    version of decoration time (a module edited and reloaded in a notebook since)."""
    paths = sysconfig.get_paths()
    installed = tuple({os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "distfn" or name.startswith("distfn."):
            continue
        if not os.path.realpath(path).startswith(installed):
            del sys.modules[name]


def fork_server(idle: bool = False) -> None:
    """Fork the fork server from this process now (the caller checked that forking is safe). ``idle``: the copy
    prepares only once a launch needs it (`wake`, `_await_first_use`), not at once at the lowest priority."""
    global _wake_fd
    listener, address, alive_r, alive_w = _listen()
    wake_r, wake_w = os.pipe() if idle else (None, None)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the server's side
        try:
            os.close(alive_w)
            if wake_w is not None:
                os.close(wake_w)
            # The server's children re-import the user's script, as under spawn (multiprocessing skips that when
            # __main__ already has the script's file, which this copy of a half-run script has).
            sys.modules["__main__"] = types.ModuleType("__main__")
            _serve(listener.fileno(), alive_r, address, parent, copy=True, wake_r=wake_r)
        except BaseException:  # noqa: BLE001 - whatever happens, the server must not return into user code
            pass
        os._exit(0)
    os.close(alive_r)
    if wake_r is not None:
        os.close(wake_r)
    listener.close()
    _register("forked", pid, address, alive_w)
    _wake_fd = wake_w
    atexit.register(_stop_copy, pid)


def wake() -> None:
    """Have an idle copy (`fork_server`) prepare now, because a launch is about to use it. A no-op otherwise."""
    fd = _wake_fd
    if fd is None:
        return
    try:
        os.write(fd, b"w")
    except OSError:
        pass  # the copy is gone: the launch finds out (`server_running`) and starts another
    _close_wake()


def wake_if_needed(start_method: str) -> None:
    """At a call, before the launch machinery's import: wake an idle copy where the call will start its workers
    from it (``start_method="forkserver"``, or ``"auto"`` in a process that started threads since ``import
    distfn``: a torch op's OpenMP pool, `distfn.preflight.choose_start_method`), so that the copy prepares while
    this process imports the same modules. Where forking is still safe the copy stays idle: the workers fork from
    this process. (`ensure_server` wakes it in any case.)"""
    if _wake_fd is not None and (start_method == "forkserver" or (
            start_method == "auto" and preflight.thread_ids() - preflight.BASELINE_THREADS)):
        _check_copy()
        wake()


def _check_copy() -> None:
    """Before a copy made at a script's import is relied on (at decoration, at the call): read the pool probe's
    answer, started with it (`distfn.preflight.start_pool_probe`), and where an OpenMP pool was running already
    (a torch op before the import) end the copy, whose forked ranks would hang: a fresh server replaces it."""
    global _unverified
    if _unverified is None:
        return
    pid, _unverified = _unverified, None
    if preflight._pool_before_import() is not None:
        _stop_copy(pid)
    preflight.reap_probes()


def _close_wake() -> None:
    global _wake_fd
    if _wake_fd is not None:
        with contextlib.suppress(OSError):
            os.close(_wake_fd)
        _wake_fd = None


def _stop_copy(pid: int) -> None:
    """At this process's exit, before the interpreter's own clean-up: end the copy made at decoration and wait
    until it is gone.

    While the copy lives, every page the two processes share is copy-on-write, and the interpreter's clean-up
    writes to nearly all of them (reference counts of every module and object it frees): each first write is a
    page fault and a 4 KiB copy, ~20 ms of a plain script's exit on 2 cores with torch imported
    (bench/bench_launch.py). Once the copy is gone the pages are this process's alone again. The copy would end by
    itself at our exit anyway (the "alive" pipe, ``PR_SET_PDEATHSIG``); this only makes it end first. SIGKILL: no
    job runs at exit, and its one piece of clean-up, the socket, lies in the standard library's temporary
    directory, which this process removes next (a copy that removed it first made that removal fail loudly).
    Never raises.
    """
    server = _forkserver()
    if server._forkserver_pid != pid:
        return  # stopped or replaced since
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass  # gone already, or not our child any more
    _forget(server)


def start_server() -> None:
    """Start the fork server as a fresh interpreter that imports distfn, and so torch (this process is no longer
    safe to fork). Returns at once; a launch that comes before the server is ready waits for it."""
    listener, address, alive_r, alive_w = _listen()
    code = (f"import sys; sys.path[:] = {sys.path!r}; from distfn.launch.forkserver import serve; "
            f"serve({listener.fileno()}, {alive_r}, {os.getpid()}, {address!r})")
    exe = mp_spawn.get_executable()
    try:
        args = [exe, *mp_util._args_from_interpreter_flags(), "-c", code]  # type: ignore[attr-defined]
        pid = mp_util.spawnv_passfds(exe, args, [listener.fileno(), alive_r])  # type: ignore[arg-type]
    except BaseException:
        os.close(alive_w)
        raise
    finally:
        os.close(alive_r)
        listener.close()
    _register("started", pid, address, alive_w)


def _start(kind: str, idle: bool = False) -> None:
    """Start our fork server (``kind``: "fork" a copy of this process, ``idle`` until a launch needs it (see
    `fork_server`), else a fresh interpreter), unless one runs."""
    with _server_lock:
        if server_running():
            return
        if kind == "fork":
            fork_server(idle)
        else:
            start_server()


def _why_not(exc: OSError) -> str:
    tmp = os.environ.get("TMPDIR", "")
    if "too long" in str(exc).lower() or "AF_UNIX" in str(exc):
        return (f"its Unix socket's path under TMPDIR={tmp!r} ({len(tmp)} characters) is too long ({exc}); set "
                "TMPDIR to a shorter directory (e.g. /tmp), or use start_method='spawn'")
    return f"{type(exc).__name__}: {exc} (TMPDIR={tmp!r}); use start_method='spawn' if this persists"


def ensure_server() -> str:
    """Make sure a fork server runs before workers are started with forkserver; returns which server forks them,
    for the start-up log line.

    Raises:
        ConfigError: the server cannot start here (e.g. a ``TMPDIR`` too long for a Unix socket), naming why.
    """
    try:
        if not _OWN_SERVER:
            forkserver.set_forkserver_preload(list(PRELOAD))  # not __main__: the user's script must not run in it
            forkserver.ensure_running()
        else:
            _check_copy()
            _start("fresh")
            wake()  # a copy made idle at decoration: prepare now (it would at the connection anyway)
    except OSError as exc:
        raise ConfigError(f"start_method='forkserver': the fork server cannot start: {_why_not(exc)}") from None
    return server_description()


def start_early(idle: bool = False, at: str = "when the function was defined", copy_only: bool = False) -> None:
    """At decoration, where the call will start workers with forkserver: get a fork server ready now.

    While forking is safe (no thread started since ``import distfn``, no CUDA driver call), the server is a copy
    of this process (a fork: nothing to import); ``idle``: the copy prepares only when a launch needs it (a plain
    script's call that is still safe to fork never does: `_await_first_use`), else at once at the lowest
    priority. Otherwise a fresh interpreter is started in the background to import torch. Nothing happens when a
    server runs already. Never raises (this runs at the import of the user's module): a server that cannot start
    is logged, and the call says why (`ensure_server`). ``at``: when this is, for the start-up log line;
    ``copy_only``: where forking is unsafe already, start nothing (a fresh interpreter importing torch is worth
    its CPU only where a call will surely launch: decoration asks again).
    """
    global _copied_at, _unverified
    if not _OWN_SERVER:
        return
    if copy_only:
        # at import: no thread can have started since (the baseline is now); whether an OpenMP pool ran before
        # is the probe's to say, which is not waited for here (`_check_copy` reads it before the copy is used)
        try:
            if server_running() or preflight._cuda_blocks_fork() is not None:
                return
            preflight.start_pool_probe()
            _copied_at = at
            _start("fork", idle)
            _unverified = _forkserver()._forkserver_pid
        except OSError as exc:
            logger.debug("no early fork server: {}", _why_not(exc))
        return
    _check_copy()
    if not server_running():
        _copied_at = at
    try:
        method, _ = preflight.choose_start_method("auto", reap=False)  # reaped below, after the copy's fork
        _start(method, idle)
    except OSError as exc:
        logger.debug("no early fork server: {}", _why_not(exc))
        return
    finally:
        preflight.reap_probes()  # exited meanwhile: decoration leaves no child behind but the copy
    if method != "fork":
        _warm_launcher()


def _warm_launcher() -> None:
    """Import `PRELOAD` in this process too, and add its log sink, in a background thread, while the fresh server
    imports torch: the launching side of the first call needs the same modules (measured: ~0.2 s on the first
    call's critical path in a Jupyter kernel) and the sink (~5 ms: `distfn.logs`), and between the definition cell
    and the call cell the kernel is idle. Only where forking is already unsafe (a thread then changes nothing). A
    call that comes sooner waits on the import lock (or the sink's) for the rest, as it would have done it itself."""
    threading.Thread(target=_import_quietly, name="distfn-warm", daemon=True).start()


def _import_quietly() -> None:
    try:
        _preload()
        logs.install_sink()
    except Exception as exc:  # noqa: BLE001 - the call does it again and reports what is wrong
        logger.debug("warming the launcher failed: {}", exc)
