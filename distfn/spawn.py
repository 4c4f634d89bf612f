"""The launching process of a self-spawned job: start the workers, watch them, bring back a result or the first
failure, and leave nothing behind.

Shape (after ``torch/multiprocessing/spawn.py``, with its rough edges filed off):

* a loopback socket is bound *before* the workers start, so the port is ours (no "pick a free port and hope"
  race) and the rendezvous store is reachable from this machine only;
* each worker reports exactly once through its own pipe: ``("ok", pickled_result_or_None)`` or
  ``("error", Failure)``; a worker that dies without reporting is described from its exit code / signal;
* a second pipe per worker carries its ``faulthandler`` output: the Python stack of a crash (SIGSEGV, ...),
  and on request (``DUMP_SIGNAL``) every rank's stack when a collective timed out;
* the root cause leads (deaths, then the ranks' own errors, then errors about a lost peer), the others are
  stopped at once (SIGTERM, SIGKILL after a grace, the worker's whole process group), and it all becomes one
  ``WorkerError``;
* Ctrl-C, SIGTERM and SIGUSR2 reaching this process are forwarded to the workers (see ``preemption.py`` for
  what they do there); every worker also dies with this process (PR_SET_PDEATHSIG).

Under torchrun / srun / mpirun none of this runs: ``report_in_place`` is all a failing rank does there.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import faulthandler
import io
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from loguru import logger

from . import preemption, worker
from .errors import ConfigError, Terminated, WorkerError

if TYPE_CHECKING:
    from .decorator import Options

START_METHODS = ("auto", "fork", "forkserver", "spawn")

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

# Set in the environment of a worker being started with spawn/forkserver, which re-imports the user's script
# before distfn's entry point runs: a decorated call during that import is a nested launch.
_CHILD_ENV = "_DISTFN_STARTING_WORKER"


def _thread_ids() -> frozenset[str]:
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:
        return frozenset(str(t.native_id) for t in threading.enumerate())


# Threads of this process when distfn was imported (right after torch, before the script ran any op). A thread
# that is not among them at launch time (an OpenMP pool from an earlier torch op, a user's thread) makes fork
# unsafe: GNU OpenMP's pool does not survive fork, and the children hang at their first parallel op (measured).
# Thread ids, not a count: threads that torch starts during import may end later, and a count would then miss
# an OpenMP thread that took their place.
_BASELINE_THREADS = _thread_ids()


def _cuda_blocks_fork() -> str | None:
    """Why forked workers of this process could not use CUDA, or ``None``.

    Initialising CUDA is one way. Another is invisible from here: any call into the CUDA driver (e.g.
    ``torch.cuda.is_available()`` where NVML is not used) marks the process, and only a *child* can see the mark
    (``torch.cuda._is_in_bad_fork()``), so a throwaway child is asked. Only on CUDA builds with GPUs visible
    (counted through NVML, which leaves no mark): without GPUs nothing can break.
    """
    if torch.cuda.is_initialized():
        return "CUDA is already initialised in this process, and forked workers could not use it"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return None
    if worker.visible_gpus() == 0:
        return None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only reads a flag and exits
        try:
            os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 1:
        return ("this process already called into the CUDA driver (e.g. torch.cuda.is_available()), after which "
                "forked workers cannot use CUDA; count GPUs with torch.cuda.device_count() before the call to "
                "keep the faster fork start")
    return None


def choose_start_method(requested: str) -> tuple[str, str]:
    """Return ``(method, reason)``. ``"auto"`` forks when provably safe (fastest: torch is not re-imported),
    and falls back to ``spawn`` otherwise."""
    available = mp.get_all_start_methods()
    if requested != "auto":
        if requested not in available:
            raise ConfigError(
                f"start_method={requested!r} is not available on {sys.platform}; use one of {available}"
            )
        blocked = _cuda_blocks_fork() if requested == "fork" else None
        if blocked is not None:
            raise ConfigError(
                f"start_method='fork' cannot work here: {blocked}. Use start_method='spawn' or 'auto'."
            )
        return requested, f"start_method={requested!r} was asked for"
    if "fork" not in available or sys.platform == "darwin":
        return "spawn", f"fork is not safe on {sys.platform}"
    blocked = _cuda_blocks_fork()
    if blocked is not None:
        return "spawn", blocked
    new = _thread_ids() - _BASELINE_THREADS
    if new:
        return "spawn", (
            f"this process started {len(new)} thread(s) since `import distfn` (an OpenMP pool from an earlier "
            "torch op, or threads of your own), and forked workers can hang on them"
        )
    return "fork", "no CUDA context and no extra threads in this process, so forking is safe"


# --------------------------------------------------------------------------------------------------------------
# Checks that run before any worker starts
# --------------------------------------------------------------------------------------------------------------
def _is_main_guard(node: ast.AST) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    parts = [test.left, *test.comparators]
    names = [p for p in parts if isinstance(p, ast.Name) and p.id == "__name__"]
    mains = [p for p in parts if isinstance(p, ast.Constant) and p.value == "__main__"]
    return bool(names and mains and isinstance(test.ops[0], ast.Eq))


def check_main_guard(fn_name: str) -> None:
    """Refuse a launch from the top level of a script that lacks ``if __name__ == "__main__":``.

    Workers started with spawn/forkserver re-import the script; without the guard, each would launch again.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return  # interactive session, `python -c`, notebook: nothing is re-imported
    frame = sys._getframe()
    while frame is not None and frame.f_globals is not vars(main):
        frame = frame.f_back
    while frame is not None and frame.f_code.co_name != "<module>":
        frame = frame.f_back  # the call may be inside functions the script calls at top level
        if frame is not None and frame.f_globals is not vars(main):
            return
    if frame is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    line = frame.f_lineno
    for node in tree.body:
        if _is_main_guard(node) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    raise ConfigError(
        f"{fn_name}() is called at the top level of {path} (line {line}) without an "
        "`if __name__ == \"__main__\":` guard. Worker processes may import this script again, and each would "
        f"start the job again. Put the call under the guard:\n\n    if __name__ == \"__main__\":\n        {fn_name}(cfg)\n"
    )


def _describe(obj: Any) -> str:
    obj = getattr(obj, "__wrapped__", obj)  # a decorated function: point at the user's code
    code = getattr(obj, "__code__", None)
    if code is not None:
        kind = "a lambda" if getattr(obj, "__name__", "") == "<lambda>" else f"function {obj.__qualname__}"
        return f"{kind} defined at {code.co_filename}:{code.co_firstlineno}"
    if isinstance(obj, io.IOBase):
        return f"an open file object ({getattr(obj, 'name', '?')!r})"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


def _children(obj: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        return [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if attrs.has(type(obj)):
        return [(f"{path}.{a.name}", getattr(obj, a.name, None)) for a in attrs.fields(type(obj))]
    if hasattr(obj, "__dict__") and not callable(obj):
        return [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return []


def find_unpicklable(obj: Any, path: str, _depth: int = 0) -> tuple[str, Any, BaseException] | None:
    """The deepest ``(path, object, error)`` inside ``obj`` that cannot be pickled, or ``None``."""
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return None
    except Exception as exc:  # noqa: BLE001 - any pickling failure is what we look for
        error: BaseException = exc
    if _depth < 20:
        for child_path, child in _children(obj, path):
            found = find_unpicklable(child, child_path, _depth + 1)
            if found is not None:
                return found
    return path, obj, error


def unpicklable_message(found: tuple[str, Any, BaseException], purpose: str, fix: str) -> str:
    """A user-facing sentence for ``find_unpicklable``'s result."""
    path, obj, error = found
    return f"{path} ({_describe(obj)}) cannot be pickled, which {purpose}: {type(error).__name__}: {error}. {fix}"


def sendable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What to pickle for spawn/forkserver: the decorated wrapper, or the user's function under it.

    Pickle sends functions by name. With ``@distributed`` the module-level name is the wrapper; with
    ``job = distributed(...)(train)`` it is the bare ``train``, and the wrapper (which copies its name) cannot
    be found. The worker unwraps either way.
    """
    inner = getattr(fn, "__wrapped__", None)
    if inner is None or _pickles(fn) or not _pickles(inner):
        return fn  # when neither pickles, check_picklable explains the wrapper's problem
    return inner


def _pickles(obj: Any) -> bool:
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any pickling failure means no
        return False
    return True


def check_picklable(fn: Callable[..., Any], cfg: Any, method: str) -> None:
    """Under spawn/forkserver the function and cfg travel to the workers by pickle: check that now."""
    fix = (
        "Define functions at module level (functools.partial of one is fine), pass paths rather than open "
        "files, or use start_method='fork'."
    )
    found = find_unpicklable(fn, getattr(fn, "__qualname__", "the function"))
    if found is not None:
        raise ConfigError(unpicklable_message(found, f"start_method={method!r} needs to send it to the workers", fix))
    found = find_unpicklable(cfg, "cfg")
    if found is not None:
        raise ConfigError(unpicklable_message(found, f"start_method={method!r} needs to send it to the workers", fix))


# --------------------------------------------------------------------------------------------------------------
# Failure records
# --------------------------------------------------------------------------------------------------------------
_SIGNAL_HINTS = {
    "SIGKILL": "often the out-of-memory killer; see `dmesg` or the job's memory limit",
    "SIGSEGV": "a crash in native code (a CUDA/NCCL/extension bug or a corrupted tensor)",
    "SIGBUS": "often /dev/shm is too small for DataLoader workers (docker: --shm-size)",
    "SIGABRT": "native code aborted (see the worker's stderr above)",
    "SIGTERM": "terminated from outside (a scheduler time limit or preemption, or `kill`)",
    "SIGINT": "interrupted (Ctrl-C)",
    "SIGFPE": "an arithmetic fault in native code (integer division by zero)",
    "SIGILL": "an illegal instruction: a binary built for another CPU (check the wheels' CPU flags)",
}


@attrs.frozen
class Failure:
    """One worker's failure: where it happened and why."""

    rank: int
    host: str
    pid: int
    exc_type: str
    message: str
    traceback: str = ""
    time: float = attrs.field(factory=time.time)
    signal: str | None = None
    exitcode: int | None = None
    #: What the launching process worked out about the failure (which ranks did not arrive, ...); first only.
    diagnosis: str = ""
    #: The Python stacks of the other ranks when this failure was reported (for collective timeouts).
    stacks: str = ""

    def headline(self) -> str:
        where = f"rank {self.rank} (pid {self.pid} on {self.host})"
        if self.signal is not None:
            return f"{where} was killed by {self.signal}: {_SIGNAL_HINTS.get(self.signal, 'see its stderr')}"
        return f"{where} failed with {self.exc_type}: {self.message}"

    def details(self) -> str:
        """The diagnosis, the rank's traceback (or crash stack) and the other ranks' stacks, as one text."""
        parts = [self.diagnosis, self.traceback or f"(no Python traceback: exit code {self.exitcode})", self.stacks]
        return "\n\n".join(p.rstrip() for p in parts if p)

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> Failure:
        return cls(
            rank=rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            exc_type=type(exc).__qualname__,
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    @classmethod
    def from_exit(cls, rank: int, pid: int, exitcode: int, crash: str = "") -> Failure:
        """A worker that exited without reporting; ``crash`` is what its faulthandler wrote (if anything)."""
        if exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = f"signal {-exitcode}"
            return cls(rank, socket.gethostname(), pid, "Signal", name, traceback=crash, signal=name,
                       exitcode=exitcode)
        return cls(
            rank, socket.gethostname(), pid, "ExitCode",
            f"exited with code {exitcode} without reporting a result: os._exit in the function, or a failure "
            "while the worker started (importing your script under spawn, for one); see its stderr above",
            exitcode=exitcode,
        )


# Errors a rank reports because a peer went away: a consequence, never the root cause.
_PEER_LOSS = re.compile(r"connection closed by peer|connection reset by peer|broken pipe|remote worker crash"
                        r"|communicator was aborted|ncclRemoteError", re.IGNORECASE)


def report_in_place(rank: int, exc: BaseException) -> None:
    """Report a failing rank under torchrun / srun / mpirun, where no distfn parent collects it.

    Logs the traceback tagged with the rank, and writes torchrun's error file (``TORCHELASTIC_ERROR_FILE``, the
    JSON of ``torch.distributed.elastic``'s ``ErrorHandler.record_exception``) so torchrun names this rank as
    the root cause. The caller re-raises, so the process exits non-zero and the launcher tears the job down.
    A stop from outside (SIGTERM, Ctrl-C) is not a root cause: one warning line, no error file.
    """
    if isinstance(exc, (Terminated, KeyboardInterrupt)) or (isinstance(exc, SystemExit) and not exc.code):
        logger.warning("rank {} stopped: {}: {}", rank, type(exc).__name__, exc)
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    logger.error("rank {} failed with {}: {}\n{}", rank, type(exc).__qualname__, exc, text.rstrip())
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json  # here: nothing else needs it, and the launch path stays lean
    stamp = int(time.time())
    if _PEER_LOSS.search(str(exc)):
        # torchrun names the failure with the smallest timestamp (whole seconds, ties go to the lowest rank):
        # losing a peer is a consequence of that peer's failure, so it must sort after it
        stamp += 1
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(stamp)}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError as err:
        logger.warning("could not write TORCHELASTIC_ERROR_FILE={}: {}", path, err)


_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)', re.MULTILINE)
_BOOTSTRAP = re.compile(r'distfn[/\\](?:worker\.py", line \d+ in run|spawn\.py", line \d+ in _entry)')


def main_stack(dump: str) -> str:
    """The main thread's part of a ``faulthandler`` dump, cut above distfn's own start-up frames.

    A dump lists each thread ("most recent call first"); the worker's main thread is the one running
    ``_entry``. A leading "Fatal Python error: ..." line (a crash) is kept.
    """
    starts = [m.start() for m in _THREAD_HEADER.finditer(dump)]
    if not starts:
        return dump.strip()
    head = dump[:starts[0]].strip()
    blocks = [dump[a:b] for a, b in zip(starts, [*starts[1:], len(dump)])]
    block = next((b for b in blocks if " in _entry" in b), blocks[-1])
    lines = []
    for line in block.rstrip().splitlines():
        if _BOOTSTRAP.search(line):
            break
        lines.append(line)
    others = len(blocks) - 1
    if others:
        lines.append(f"  ({others} other thread(s) not shown)")
    return "\n".join([head, ""] if head else []) + "\n".join(lines)


def _innermost_user_frame(stack: str, recent_first: bool = True) -> str | None:
    """``func (file:line)`` of the most recent frame outside torch, distfn and the standard library, in a
    faulthandler dump (most recent call first) or a Python traceback (``recent_first=False``)."""
    ours = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    stdlib = os.path.dirname(os.__file__)
    frames = list(_FRAME.finditer(stack))
    for m in frames if recent_first else reversed(frames):
        path = m["file"]
        if path.startswith(ours) or (path.startswith(stdlib) and "-packages" not in path):
            continue
        return f"{m['func']} ({path}:{m['line']})"
    return None


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


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this worker when its parent dies, even by SIGKILL (no orphans).

    The parent is the launching process (fork, spawn), or under forkserver the fork server, which exits when
    the launching process does; ``parent_pid`` is 0 then, and only the launching process's own check applies.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent_pid and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples) detached and on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items()) if type(value) is dict else {
            k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_cpu(v) for v in value)
    return value


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    cfg: Any,
    opts: Options,
    conn: Connection,
    stack_conn: Connection,
    parent_pid: int,
    listen_fd: int,
) -> None:
    """The first code a worker runs (module-level so spawn can find it)."""
    os.environ.pop(_CHILD_ENV, None)
    _die_with_parent(parent_pid)
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
    from .topology import Topology

    # Visible to code that reads the torchrun-style variables (libraries, user code).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
    topology = Topology(
        launcher="spawn", rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
        node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=port,
        reason=f"self-spawned {world_size} workers",
    )
    failure: Failure | None = None
    payload: bytes | None = None
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, opts.timeout)
        if opts.init_method == "env://":
            # the environment is the one set above, whose store this process's launcher hosts: join it (with
            # env:// rank 0 would try to host a second store on the same port)
            opts = attrs.evolve(opts, init_method=None)
        result = worker.run(getattr(fn, "__wrapped__", fn), cfg, opts, topology, store=store)
        if rank == 0:
            payload = _pickle_result(result)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            failure = Failure.from_exception(rank, exc)
    except BaseException as exc:  # noqa: BLE001 - every failure, KeyboardInterrupt included, is reported
        failure = Failure.from_exception(rank, exc)
    # The function is over: a SIGTERM now (the launching process stopping the job) just ends the process,
    # rather than raising Terminated into the report being sent or into interpreter shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        conn.send(("error", failure) if failure is not None else ("ok", payload))
        conn.close()
    except (OSError, ValueError):
        pass  # the launcher is gone; PDEATHSIG ends us
    if failure is not None:
        sys.stderr.flush()
        os._exit(1)


def _pickle_result(result: Any) -> bytes:
    result = to_cpu(result)
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        found = find_unpicklable(result, "return value") or ("return value", result, RuntimeError("?"))
        raise ConfigError(unpicklable_message(
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


def _read_stacks(w: _Worker) -> bool:
    """Append what the worker's stack pipe holds to ``w.dump``; False once the pipe is closed."""
    if w.stacks is None:
        return False
    while True:
        try:
            chunk = os.read(w.stacks.fileno(), 65536)
        except BlockingIOError:
            return True
        except OSError:
            chunk = b""
        if not chunk:
            w.stacks.close()
            w.stacks = None
            return False
        w.dump += chunk


def _collect(workers: list[_Worker], failures: list[Failure], timeout: float) -> None:
    """Read what is ready (waiting at most ``timeout``), and describe workers that died without reporting.

    Failures are kept in the order they were seen; within one round, deaths without a report (a signal: the
    likely root cause) come before errors the surviving ranks report about losing their peer.
    """
    conns = {w.conn: w for w in workers if w.conn is not None}
    sentinels = [w.process.sentinel for w in workers if w.process.exitcode is None]
    ready = wait(list(conns) + sentinels, timeout=timeout)
    deaths: list[Failure] = []
    reported: list[Failure] = []
    for w in workers:
        if w.process.exitcode is not None and not w.reported:
            if w.conn is not None and w.conn.poll():
                _receive(w, reported)
            if not w.reported:
                w.reported = True
                _read_stacks(w)  # a crash (SIGSEGV, SIGABRT, ...) left its Python stack there
                crash = main_stack(w.dump.decode("utf-8", "replace")) if w.dump else ""
                deaths.append(Failure.from_exit(w.rank, w.process.pid, w.process.exitcode, crash))
    for obj in ready:
        w = conns.get(obj)  # type: ignore[arg-type]
        if w is not None and w.conn is not None:
            _receive(w, reported)
    failures.extend(deaths)
    failures.extend(sorted(reported, key=lambda f: f.time))


def order_failures(failures: list[Failure]) -> list[Failure]:
    """Likely root cause first: deaths without a report (signals, exit codes), then the ranks' own errors,
    then errors about losing a peer; by time within each group."""
    def key(f: Failure) -> tuple[int, float]:
        if f.exc_type in ("Signal", "ExitCode"):
            return 0, f.time
        return (2 if _PEER_LOSS.search(f.message) else 1), f.time

    return sorted(failures, key=key)


def _settle(workers: list[_Worker], failures: list[Failure], window: float = 0.5) -> None:
    """After the first failure, give the other ranks' reports ``window`` seconds to arrive, so that the root
    cause can be told from its consequences (a rank that raised reports after its peers saw it leave)."""
    deadline = time.monotonic() + window
    while not all(w.reported for w in workers) and time.monotonic() < deadline:
        _collect(workers, failures, timeout=min(0.05, max(0.0, deadline - time.monotonic())))


def _receive(w: _Worker, failures: list[Failure]) -> None:
    assert w.conn is not None
    try:
        kind, data = w.conn.recv()
    except (EOFError, OSError):
        w.conn.close()
        w.conn = None
        return
    w.reported = True
    if kind == "ok":
        w.ok = True
        w.result = data
    else:
        failures.append(data)
    w.conn.close()
    w.conn = None


def _signal_live(workers: list[_Worker], sig: int) -> None:
    for w in workers:
        if w.process.exitcode is None:
            try:
                os.kill(w.process.pid, sig)
            except ProcessLookupError:
                pass


def _kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a worker made itself its leader with setpgid).

    Used while the leader is alive or after it failed, when its children may outlive it: Linux does not reuse
    a pid while a live process still has it as its process group id, so this reaches exactly the worker's
    leftovers (DataLoader workers notice a dead parent only every 5 s).
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(workers: list[_Worker], sig: int | None, grace: float) -> None:
    """Send ``sig`` (if any) to the live workers, give them ``grace`` seconds, then SIGKILL what is left."""
    if sig is not None:
        _signal_live(workers, sig)
    deadline = time.monotonic() + grace
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.exitcode is None:
            _kill_group(w.process.pid)  # the rank and what it started (DataLoader workers, subprocesses)
            w.process.join(5)


def request_stacks(workers: list[_Worker], wait_s: float = DUMP_WAIT) -> dict[int, str]:
    """Ask the live workers for their Python stacks (``DUMP_SIGNAL``); ``{rank: main thread's stack}``."""
    live = [w for w in workers if w.process.exitcode is None and w.stacks is not None]
    for w in live:
        _read_stacks(w)
        w.dump = b""  # only the answer to this request
    _signal_live(live, DUMP_SIGNAL)
    deadline = time.monotonic() + wait_s
    pending = {w.stacks: w for w in live}
    answered: set[int] = set()
    while pending and time.monotonic() < deadline:
        # faulthandler writes a dump in many small writes: once every worker answered, stop at the first
        # quiet 0.1 s
        quiet = len(answered) == len(live)
        ready = wait(list(pending), timeout=0.1 if quiet else max(0.0, deadline - time.monotonic()))
        if not ready and quiet:
            break
        for conn in ready:
            w = pending[conn]  # type: ignore[index]
            if not _read_stacks(w):
                del pending[conn]
            if w.dump:
                answered.add(w.rank)
    return {w.rank: main_stack(w.dump.decode("utf-8", "replace")) for w in live if w.dump}


_TIMEOUT_WORDS = re.compile(r"time[ds]?[ _-]?out|deadline exceeded", re.IGNORECASE)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def diagnose(first: Failure, workers: list[_Worker], timeout_s: float, forwarded: str | None) -> Failure:
    """The first failure with what the launching process can add: a collective timeout's missing ranks and
    every other rank's stack, ranks that had already returned, a signal that this process forwarded."""
    notes: list[str] = []
    stacks = ""
    if forwarded:
        notes.append(f"The launching process received {forwarded} and forwarded it to the workers.")
    returned = [w.rank for w in workers if w.ok]
    if _TIMEOUT_WORDS.search(f"{first.exc_type} {first.message}"):
        dumps = request_stacks([w for w in workers if w.rank != first.rank and not w.reported])
        notes.append(f"A collective or the rendezvous timed out after {timeout_s:g} s (the `timeout` of "
                     "@distributed, 30 min by default).")
        away = {r: s for r, s in dumps.items() if "torch/distributed/" not in s.replace("\\", "/")}
        dead = [w.rank for w in workers if w.reported and not w.ok and w.rank != first.rank]
        if away:
            where = "; ".join(f"rank {r} was in {_innermost_user_frame(s) or 'code outside torch'}"
                              for r, s in sorted(away.items()))
            notes.append(f"{_ranks(sorted(away)).capitalize()} had not reached a collective: {where}.")
        elif dumps and not returned and not dead:
            notes.append("Every other rank was inside torch.distributed too: the ranks probably call different "
                         "collectives, or the same ones in a different order (compare the stacks below).")
        if dead:
            notes.append(f"{_ranks(dead).capitalize()} had already failed (listed below).")
        if dumps:
            stacks = "\n\n".join(
                [f"Python stacks of the other ranks when rank {first.rank} timed out (most recent call first):"]
                + [f"rank {r}:\n{s}" for r, s in sorted(dumps.items())])
    if returned:
        notes.append(f"{_ranks(returned).capitalize()} had already returned from the function: a collective "
                     "that only some ranks call (e.g. under `if ctx.is_main:`) makes the others fail or wait.")
    if not notes:
        return first
    return attrs.evolve(first, diagnosis=" ".join(notes), stacks=stacks)


def check_port_free(init_method: str | None) -> None:
    """Refuse, before any worker starts, a ``tcp://host:port`` of this machine that something already uses.

    torch would only find out in rank 0 (EADDRINUSE) while the other ranks wait for a store that never comes.
    """
    if not init_method or not init_method.startswith("tcp://"):
        return
    from urllib.parse import urlsplit

    try:
        url = urlsplit(init_method)
        host, port = url.hostname, url.port
    except ValueError:
        return  # malformed: torch's own error names it
    if not host or not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # not an address of this machine (another host serves the rendezvous), or unresolvable
            raise ConfigError(
                f"init_method={init_method!r}: {host}:{port} is already in use on this machine (another job or "
                f"program listens there; `ss -ltnp 'sport = :{port}'` shows which). Leave init_method unset so "
                "distfn picks a free loopback port for each job, or choose a free port."
            ) from None


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
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            self.previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.previous.clear()

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


def launch(fn: Callable[..., Any], cfg: Any, opts: Options, nprocs: int) -> Any:
    """Run ``fn`` on ``nprocs`` new local workers and return rank 0's value (or raise ``WorkerError``)."""
    check_port_free(opts.init_method)
    method, reason = choose_start_method(opts.start_method)
    if method == "fork":
        logger.trace("starting {} workers with fork: {}", nprocs, reason)
    else:
        logger.info("starting {} workers with {}: {}", nprocs, method, reason)
        fn = sendable(fn)
        check_picklable(fn, cfg, method)
    context = mp.get_context(method)

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # loopback only: nothing outside this machine can reach the store
    listener.listen(max(128, nprocs))
    port = listener.getsockname()[1]
    workers: list[_Worker] = []
    failures: list[Failure] = []
    forwarder = _Forwarder(workers)
    store = None
    interrupted = False
    try:
        for rank in range(nprocs):
            reader, writer = context.Pipe(duplex=False)
            stack_reader, stack_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_entry,
                args=(rank, nprocs, port, fn, cfg, opts, writer, stack_writer,
                      os.getpid() if method != "forkserver" else 0,
                      listener.fileno() if method == "fork" else -1),
                name=f"distfn-rank{rank}",
                daemon=False,  # daemonic processes may not have children: DataLoader workers need them
            )
            os.environ[_CHILD_ENV] = "1"
            try:
                process.start()
            finally:
                os.environ.pop(_CHILD_ENV, None)
            writer.close()
            stack_writer.close()
            os.set_blocking(stack_reader.fileno(), False)
            workers.append(_Worker(rank, process, reader, stack_reader))
        # After the forks, so that no worker inherits a handler that signals its siblings.
        forwarder.install()
        # The store is started after the forks so no worker inherits its threads; until it accepts, the
        # kernel queues the workers' connections on the listening socket.
        store = dist.TCPStore("127.0.0.1", port, None, True, opts.timeout, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the socket now and closes it when it is destroyed
        while not failures and not all(w.reported for w in workers) and not forwarder.expired():
            try:
                _collect(workers, failures, timeout=1.0)
            except KeyboardInterrupt:
                interrupted = True
                break
        if failures and not interrupted:
            _settle(workers, failures)
            failures[:] = order_failures(failures)
            failures[0] = diagnose(failures[0], workers, opts.timeout.total_seconds(), forwarder.received)
    finally:
        if interrupted:
            logger.warning("interrupted: stopping {} workers (Ctrl-C again to kill them at once)", nprocs)
            try:
                _stop(workers, signal.SIGINT, STOP_GRACE)
            except KeyboardInterrupt:
                _stop(workers, signal.SIGKILL, 0)
        elif forwarder.deadline is not None:
            # SIGTERM was forwarded: the workers are already stopping (saving, running finally blocks)
            _stop(workers, None, forwarder.remaining())
        elif failures:
            _stop(workers, signal.SIGTERM, 2.0)
        elif all(w.ok for w in workers):
            # every rank returned: let them exit by themselves (flushing their output, joining their own
            # children); only one that does not within the grace is killed
            _stop(workers, None, STOP_GRACE)
        else:
            _stop(workers, signal.SIGTERM, STOP_GRACE)  # this process failed (e.g. the store did not start)
        # Errors the other ranks reported while being stopped come after the first one; a rank that distfn
        # itself stopped after the first failure reports Terminated, which is no news.
        stopped: list[Failure] = []
        for w in workers:
            if w.conn is not None and not w.reported and w.conn.poll():
                _receive(w, stopped)
            if w.conn is not None:
                w.conn.close()
            if w.stacks is not None:
                w.stacks.close()
            w.process.join(1)
            if not w.ok:
                _kill_group(w.process.pid)
        failures.extend(f for f in stopped if forwarder.received or f.exc_type != Terminated.__qualname__)
        forwarder.restore()
        del store
        listener.close()
    if interrupted:
        where = [f"rank {f.rank} in {_innermost_user_frame(f.traceback, recent_first=False)}"
                 for f in sorted(stopped, key=lambda f: f.rank) if f.exc_type == "KeyboardInterrupt"]
        if where:
            logger.warning("interrupted {}", "; ".join(where))
        raise KeyboardInterrupt
    if failures:
        raise WorkerError(failures)
    if forwarder.expired() and not all(w.ok for w in workers):
        raise WorkerError([Failure(w.rank, socket.gethostname(), w.process.pid, "Terminated",
                                   f"still running {TERM_GRACE:g} s after SIGTERM was forwarded; killed")
                           for w in workers if not w.ok])
    payload = workers[0].result
    return None if payload is None else pickle.loads(payload)
