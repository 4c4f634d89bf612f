"""How a job reaches workers that are not forked from the launching process (start methods forkserver and spawn).

Two things, both for the case where forking the workers directly is unsafe (the launching process ran a torch op,
so an OpenMP pool is alive, or it called into the CUDA driver):

* **The fork server, started early.** Re-importing torch in every spawned worker doubles the start-up time
  (measured: raw spawn 2.06× the raw-fork floor). So when a decorated function is defined in a process that will
  launch workers itself, and forking is still safe at that moment, `start_early` forks a *fork server* right then:
  a copy of this process, single-threaded, with no CUDA context, torch already imported. It runs the standard
  library's fork-server loop (`multiprocessing.forkserver`), so the workers of ``start_method="forkserver"`` fork
  from it later, however many threads or CUDA calls the launching process has made since. Where forking was
  already unsafe at decoration, a fresh interpreter that imports distfn (and so torch) is started in the
  background instead; a launch with no server yet starts that one and waits for it.
  The server is named ``distfn-forksrv``, dies with the launching process (``PR_SET_PDEATHSIG`` and the
  standard library's "alive" pipe) and never runs a thread, CUDA, or user code.
* **Shipping by value.** Under forkserver and spawn the function and ``cfg`` travel by pickle, which sends
  functions and classes *by name*; a worker re-imports the user's script to find them. What was defined
  interactively (a notebook cell, ``python -c``, a script on standard input, code typed into IPython) has no
  file to re-import, so it is shipped *by value* with cloudpickle, as Ray and submitit do (`pack`, `unpack`).
  Workers of the fork server also get the launching process's environment as it is at launch (`Parcel.environ`):
  the server is a copy from decoration time, and e.g. ``CUDA_VISIBLE_DEVICES`` may have been set since.
  Rank 0's return value comes back the same way (`dumps_result`, `loads_result`): an instance of a class defined
  in a cell comes back as an instance of that class.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import linecache
import os
import pickle
import signal
import socket
import sys
import sysconfig
import threading
import types
from collections.abc import Iterator
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Any

import attrs
import cloudpickle

from . import devices, preflight, topology, worker
from .errors import ConfigError
from .options import Options, default_nprocs, with_env

#: The fork server's process name (``/proc/PID/comm``, what ``ps`` and ``top`` show), at most 15 characters.
SERVER_NAME = "distfn-forksrv"

# How the current fork server came to be: "forked" (a copy of this process, made while forking was safe),
# "started" (a fresh interpreter that imported distfn), or None (none of ours).
_server_kind: str | None = None
_server_lock = threading.Lock()  # two threads launching at once start one server


# -- shipping by value ------------------------------------------------------------------------------------------
@attrs.frozen
class Parcel:
    """The function or ``cfg`` as a worker receives it: ``value`` pickled the ordinary way (by name), or
    ``payload`` (cloudpickle's bytes, by value); ``environ``, when set, replaces the worker's environment first."""

    value: Any = None
    payload: bytes | None = None
    environ: dict[str, str] | None = None
    #: ``linecache`` entries of the cells that defined what ``payload`` holds, so tracebacks show their lines.
    sources: dict[str, Any] | None = None


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, keeping each function's file name (a cell's ``/tmp/ipykernel_*/N.py``; cloudpickle writes
    ``<dynamic-code>``), and noting the names, whose lines `pack` sends along for the workers' tracebacks."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.filenames: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        reduce_code = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
        if type(obj) is types.CodeType and reduce_code is not None:
            self.filenames.add(obj.co_filename)
            make, args = reduce_code(obj)
            return make, tuple(obj.co_filename if isinstance(a, str) and a == "<dynamic-code>" else a for a in args)
        return super().reducer_override(obj)


def _cloudpickle(obj: Any) -> tuple[bytes, dict[str, Any]]:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    cache: dict[str, Any] = linecache.cache  # (size, mtime, lines, name); mtime None: never checked on disk
    sources = {name: (entry[0], None, entry[2], entry[3]) for name in pickler.filenames
               if len(entry := cache.get(name, ())) == 4 and not os.path.isfile(name)}
    return buffer.getvalue(), sources


def interactive_main() -> bool:
    """True when ``__main__`` has no file a worker could re-import: a notebook, ``python -c``, standard input,
    an interactive interpreter (inside IPython's ``%run`` it has the script's file)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return not (path and os.path.isfile(path))


def _by_value(obj: Any, path: str, method: str) -> Parcel:
    found = preflight.find_unpicklable(obj, path, dumps=cloudpickle.dumps)
    if found is not None:
        raise ConfigError(preflight.unpicklable_message(
            found, f"start_method={method!r} needs to send it to the workers",
            "Pass paths rather than open resources, and create locks, threads and connections inside the function.",
        ))
    payload, sources = _cloudpickle(obj)
    return Parcel(payload=payload, sources=sources or None)


def pack(fn: Any, cfg: Any, method: str, requested: str = "auto") -> tuple[Any, Any, str]:
    """What `distfn.spawn` hands to ``start_method=method`` for ``fn`` and ``cfg``, and how, in words.

    By name (ordinary pickle, the workers import the script) where that works; by value (cloudpickle) what was
    defined interactively, and, unless the start method was asked for by name (``requested``), what ordinary
    pickle cannot send (a lambda in ``cfg``, a function defined inside another): the fallback from fork must not
    refuse what fork would have run.

    Raises:
        ConfigError: ``fn`` or ``cfg`` cannot be sent, naming the part that cannot and the fix.
    """
    interactive = interactive_main()
    if not interactive and requested != "auto":
        preflight.check_picklable(fn, cfg, method)
    name = getattr(fn, "__qualname__", "the function")
    unwrapped = getattr(fn, "__wrapped__", fn)  # the user's function: the worker calls it inside its own wrapper
    by_name = not interactive and preflight.find_unpicklable(fn, name) is None
    sent = Parcel(value=fn) if by_name else _by_value(unwrapped, name, method)
    cfg_by_name = not interactive and preflight.find_unpicklable(cfg, "cfg") is None
    cfg = Parcel(value=cfg) if cfg_by_name else _by_value(cfg, "cfg", method)
    if interactive:
        how = "what was defined interactively is shipped by value (cloudpickle)"
    elif by_name and cfg_by_name:
        how = "the workers import the script to find the function"
    else:
        how = "what pickle cannot send by name is shipped by value (cloudpickle)"
    if method == "forkserver":
        ensure_server()
        sent = attrs.evolve(sent, environ=dict(os.environ))
        how = f"{server_description()}; {how}"
    return sent, cfg, how


@contextlib.contextmanager
def main_for_workers(method: str) -> Iterator[None]:
    """While workers start: hide a ``__main__.__file__`` that names no file (``<stdin>``), which multiprocessing
    would otherwise tell every spawn/forkserver worker to run (they would fail with FileNotFoundError)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if method == "fork" or main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def arrive(fn: Any) -> None:
    """In the worker, before anything else: take on the launching process's environment sent with ``fn``."""
    if isinstance(fn, Parcel) and fn.environ is not None:
        os.environ.clear()
        os.environ.update(fn.environ)


# In a worker: whether something arrived by value, so that rank 0's return value may go back the same way.
_received_by_value = False


def unpack(obj: Any) -> Any:
    """In the worker: the object `pack` sent (anything else is returned as it is)."""
    global _received_by_value
    if not isinstance(obj, Parcel):
        return obj
    if obj.payload is None:
        return obj.value
    _received_by_value = True
    linecache.cache.update(obj.sources or {})
    return cloudpickle.loads(obj.payload)


def dumps_result(result: Any) -> bytes:
    """In the worker: rank 0's return value for the launching process. By name (ordinary pickle); and where that
    fails in a worker that received the job by value, by value: an instance of a class defined in a notebook
    cell then comes back as an instance of the notebook's own class (cloudpickle recognises the classes it
    sent)."""
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        if not _received_by_value:
            raise
        return cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


class _ResultUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # A worker that imported the user's script names its classes ``__mp_main__.X``; in this process that is
        # whatever ``__main__`` is now (multiprocessing's alias is fixed at its import: under IPython's %run it
        # would name the notebook, not the script being run).
        return super().find_class("__main__" if module == "__mp_main__" else module, name)


def loads_result(payload: bytes) -> Any:
    """In the launching process: rank 0's return value from `dumps_result`'s bytes."""
    return _ResultUnpickler(io.BytesIO(payload)).load()


# -- the fork server ---------------------------------------------------------------------------------------------
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
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    _server_kind = None


def server_description() -> str:
    """Which fork server the workers fork from, for the start-up log line."""
    if _server_kind == "forked":
        return "the fork server (a copy of this process made when the function was defined, torch imported) forks them"
    if _server_kind == "started":
        return "the fork server (a fresh interpreter that imported torch) forks them"
    return "the standard library's fork server forks them"


def _become_server() -> None:
    """Die with the launching process, and be named `SERVER_NAME`."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            libc.prctl(15, SERVER_NAME.encode())  # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def _serve(listener_fd: int, alive_r: int) -> None:
    """The fork server's life: the standard library's loop, until the launching process is gone."""
    forkserver.main(listener_fd, alive_r, [])  # preload nothing: torch is imported already


def serve(listener_fd: int, alive_r: int, parent_pid: int) -> None:
    """Entry point of a fork server started as a fresh interpreter (see `start_server`)."""
    _become_server()
    if os.getppid() != parent_pid:
        os._exit(0)
    _serve(listener_fd, alive_r)


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


def fork_server() -> None:
    """Fork the fork server from this process now (the caller checked that forking is safe)."""
    listener, address, alive_r, alive_w = _listen()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the server's side
        try:
            _become_server()
            os.close(alive_w)
            if os.getppid() != parent:
                os._exit(0)
            # The server's children re-import the user's script, as under spawn (multiprocessing skips that when
            # __main__ already has the script's file, which this copy of a half-run script has).
            sys.modules["__main__"] = types.ModuleType("__main__")
            _forget_user_modules()
            _serve(listener.fileno(), alive_r)
        except BaseException:  # noqa: BLE001 - whatever happens, the server must not return into user code
            pass
        os._exit(0)
    os.close(alive_r)
    listener.close()
    _register("forked", pid, address, alive_w)


def start_server() -> None:
    """Start the fork server as a fresh interpreter that imports distfn, and so torch (this process is no longer
    safe to fork). Returns at once; a launch that comes before the server is ready waits for it."""
    listener, address, alive_r, alive_w = _listen()
    code = (f"import sys; sys.path[:] = {sys.path!r}; from distfn.shipping import serve; "
            f"serve({listener.fileno()}, {alive_r}, {os.getpid()})")
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


def ensure_server() -> None:
    """Make sure a fork server runs before workers are started with forkserver."""
    if not _OWN_SERVER:
        forkserver.set_forkserver_preload(["distfn"])  # not __main__: the user's script must not run in it
        forkserver.ensure_running()
        return
    with _server_lock:
        if not server_running():
            start_server()


def _will_launch(opts: Options) -> bool:
    """Whether calling a function decorated with ``opts`` here would start workers (not run in place)."""
    try:
        opts = with_env(opts, os.environ)  # DISTFN_LAUNCHER=ray, DISTFN_START_METHOD=spawn, ... as the call sees them
    except ConfigError:
        return False  # the call explains what is wrong
    if sys.platform != "linux" or opts.start_method not in ("auto", "forkserver") or worker.in_worker():
        return False
    if opts.launcher == "ray":
        return False  # Ray starts the ranks as actors on its own nodes
    try:
        if topology.detect(os.environ, sys.argv, opts.launcher) is not None:
            return False
        return default_nprocs(opts, os.environ, devices.visible_gpus) > 1
    except ConfigError:
        return False  # the call explains what is wrong


def start_early(opts: Options) -> None:
    """At decoration: when calling the function will start workers here, get a fork server ready now.

    While forking is safe (no thread started since ``import distfn``, no CUDA driver call), the server is a copy
    of this process (a fork: about 50 ms, nothing to import). Otherwise a fresh interpreter is started in the
    background to import torch. Nothing happens when a server runs already, or when the call will not launch
    (under torchrun / srun / mpirun, one process, inside a worker).
    """
    if not _OWN_SERVER or not _will_launch(opts):
        return
    with _server_lock:
        if server_running():
            return
        method, _ = preflight.choose_start_method("auto")
        if method == "fork":
            fork_server()
        else:
            start_server()
