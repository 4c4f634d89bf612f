"""Checks that run in the launching process before any worker starts, so that a job that cannot work fails at
once with a `ConfigError` naming the fix, rather than in a worker (or not at all):

* `choose_start_method`: fork when provably safe (no CUDA driver call, no threads started since
  ``import distfn``), else forkserver (spawn where there is none); an explicit ``start_method`` that cannot
  work is refused;
* `check_main_guard`: a script that launches at its top level without ``if __name__ == "__main__":``;
* `check_picklable` / `sendable`: what spawn and forkserver must pickle (the function, ``cfg``), with the path to
  the first part that cannot be pickled (`find_unpicklable`);
* `check_port_free`: an explicit ``tcp://host:port`` of this machine that something already listens on.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import errno
import io
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import attrs
import torch
import torch.multiprocessing as mp

from . import devices
from .errors import ConfigError
from .tree import children, is_container


def thread_ids() -> frozenset[str]:
    """The ids of this process's threads (the kernel's view: threads started by C code count too)."""
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:
        return frozenset(str(t.native_id) for t in threading.enumerate())


# Threads of this process when distfn was imported (right after torch, before the script ran any op). A thread
# that is not among them at launch time (an OpenMP pool from an earlier torch op, a user's thread) makes fork
# unsafe: GNU OpenMP's pool does not survive fork, and the children hang at their first parallel op (measured).
# Thread ids, not a count: threads that torch starts during import may end later, and a count would then miss
# an OpenMP thread that took their place. `import distfn` imports this module (decorator -> preflight).
BASELINE_THREADS = thread_ids()


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
    if devices.visible_gpus() == 0:
        return None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only reads a flag and exits
        try:
            os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
        except BaseException:  # noqa: BLE001 - whatever happens, the child must not return
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 1 and not devices.counts_without_driver():
        return ("NVML cannot count the GPUs here (no libnvidia-ml, or MIG UUIDs in CUDA_VISIBLE_DEVICES), so counting "
                "them had to call into the CUDA driver, after which forked workers cannot use CUDA")
    if os.waitstatus_to_exitcode(status) == 1:
        return ("this process already called into the CUDA driver (e.g. torch.cuda.is_available()), after which "
                "forked workers cannot use CUDA; count GPUs with torch.cuda.device_count() before the call to "
                "keep the faster fork start")
    return None


#: How long the throwaway child of `_pool_before_import` may take for one small parallel op before its parent's
#: OpenMP pool is judged broken for forked children (it takes milliseconds when the pool survives fork).
POOL_PROBE_S = 2.0
_pool_verdict: list[str | None] = []  # the probe's answer, once per process (the baseline does not change)
_probes: list[int] = []  # probe children that answered and are exiting, to reap
# The probe started ahead of its question (`start_pool_probe`): (pid, read end of its pipe, monotonic start).
_pending: list[tuple[int, int, float]] = []


def reap_probes() -> None:
    """Wait for the probe child of `_pool_before_import` to be gone. It answers before it begins to exit, and its
    exit, unmapping a copy of this process, costs more than the probe itself (~3 ms): `choose_start_method` waits
    for it before it returns, unless its caller does other work first and reaps afterwards
    (`distfn.launch.forkserver.start_early` forks its copy meanwhile)."""
    while _probes:
        with contextlib.suppress(ChildProcessError):  # reaped by someone else (a SIGCHLD handler of the user's)
            os.waitpid(_probes[0], 0)
        _probes.pop(0)


def _pool_before_import() -> str | None:
    """Why forked workers could hang on an OpenMP pool that was already running at ``import distfn``, or ``None``.

    The thread baseline (`BASELINE_THREADS`) cannot tell a pool started by a torch op *before* ``import distfn``
    from torch's own threads, and GNU OpenMP's pool does not survive fork: the children hang at their first
    parallel op (reproduced: a matmul before ``import distfn``, ``torch.set_num_threads(2)`` in the workers). So a
    throwaway child runs one small parallel op; if it does not finish within `POOL_PROBE_S`, it is killed and
    fork is unsafe. Asked once per process (a fork and a few milliseconds).
    """
    if _pool_verdict:
        return _pool_verdict[0]
    start_pool_probe()
    pid, read_end, started = _pending.pop()
    try:
        # Woken by the child's byte (or by its end, which closes the pipe) at once: polling its exit every few
        # milliseconds cost more than the probe itself, at every decoration of a plain script.
        left = max(0.0, POOL_PROBE_S - (time.monotonic() - started))
        finished = bool(select.select([read_end], [], [], left)[0])
    finally:
        os.close(read_end)
    why = None
    if finished:
        _probes.append(pid)  # reaped by `reap_probes`, after other work: its exit takes longer than the probe
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        why = ("a thread pool (OpenMP) was already running when distfn was imported (a torch op before "
               "`import distfn`), and forked workers hang on it; import distfn before the first torch op to keep "
               "the faster fork start")
    _pool_verdict.append(why)
    return why


def start_pool_probe() -> None:
    """Fork the throwaway child of `_pool_before_import` now, and leave its answer to be read when asked: a
    script's ``from distfn import distributed`` starts it and copies itself meanwhile, rather than waiting
    (`distfn.decorator.copy_at_import`; the copy is used only once the answer says it may be,
    `distfn.launch.forkserver`). Its answer is about this process as it is now. A no-op once asked or started."""
    if _pool_verdict or _pending:
        return
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child runs one parallel region, says so and exits
        try:
            os.close(read_end)
            # a probe that hangs ends itself (SIGALRM's default action) even where nobody asks for its answer
            signal.alarm(int(POOL_PROBE_S) + 2)
            torch.set_num_threads(2)
            torch.ones(1 << 20).add_(1)  # TensorIterator splits it with at::parallel_for: an OpenMP region
            os.write(write_end, b"1")
            os._exit(0)
        except BaseException:  # noqa: BLE001 - whatever happens, the child must not return
            os._exit(2)
    os.close(write_end)
    _pending.append((pid, read_end, time.monotonic()))
    atexit.register(_end_pending_probe, pid)


def _end_pending_probe(pid: int) -> None:
    """At exit: end a probe whose answer nobody asked for (a script that never launched); it may hang forever."""
    if _pending and _pending[0][0] == pid:
        _, read_end, _ = _pending.pop()
        with contextlib.suppress(OSError):
            os.close(read_end)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _fallback(why: str) -> tuple[str, str]:
    """The start method when fork is unsafe: forkserver (workers fork from a clean server process that has
    torch imported, see `distfn.launch.forkserver`) where it exists, else spawn (every worker imports torch again)."""
    if "forkserver" in mp.get_all_start_methods() and sys.platform.startswith("linux"):
        return "forkserver", why
    return "spawn", why


def choose_start_method(requested: str, *, reap: bool = True) -> tuple[str, str]:
    """Return ``(method, reason)``. ``"auto"`` forks when provably safe (fastest: torch is not re-imported),
    and falls back to ``forkserver`` otherwise (``spawn`` where there is no forkserver). ``reap=False``: leave a
    probe child that answered to the caller's `reap_probes`, after work that overlaps its exit."""
    try:
        return _choose_start_method(requested)
    finally:
        if reap:
            reap_probes()


def _choose_start_method(requested: str) -> tuple[str, str]:
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
        return _fallback(blocked)
    new = thread_ids() - BASELINE_THREADS
    if new:
        return _fallback(
            f"this process started {len(new)} thread(s) since `import distfn` (an OpenMP pool from an earlier "
            "torch op, or threads of your own), and forked workers can hang on them"
        )
    pool = _pool_before_import()
    if pool is not None:
        return _fallback(pool)
    return "fork", "no CUDA context and no extra threads in this process, so forking is safe"


# -- main guard, picklability, port ------------------------------------------------------------------------------
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
    frame: FrameType | None = sys._getframe()
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
        "start the job again. Put the call under the guard:\n\n"
        f"    if __name__ == \"__main__\":\n        {fn_name}(cfg)\n"
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
    if is_container(obj):
        return [(f"{path}[{k!r}]", v) for k, v in children(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    if attrs.has(type(obj)):
        return [(f"{path}.{a.name}", getattr(obj, a.name, None)) for a in attrs.fields(type(obj))]
    if hasattr(obj, "__dict__") and not callable(obj):
        return [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return []


def find_unpicklable(obj: Any, path: str, _depth: int = 0, *,
                     dumps: Callable[..., bytes] = pickle.dumps) -> tuple[str, Any, BaseException] | None:
    """The deepest ``(path, object, error)`` inside ``obj`` that ``dumps`` (default: `pickle.dumps`; also
    ``cloudpickle.dumps``) cannot pickle, or ``None``."""
    try:
        dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return None
    except Exception as exc:  # noqa: BLE001 - any pickling failure is what we look for
        error: BaseException = exc
    if _depth < 20:
        for child_path, child in _children(obj, path):
            found = find_unpicklable(child, child_path, _depth + 1, dumps=dumps)
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



def check_port_free(init_method: str | None) -> None:
    """Refuse, before any worker starts, a ``tcp://host:port`` of this machine that something already uses.

    torch would only find out in rank 0 (EADDRINUSE) while the other ranks wait for a store that never comes.
    """
    if not init_method or not init_method.startswith("tcp://"):
        return
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
