"""How the function, ``cfg`` and the value travel to and from workers that are not forked from the launching
process (start methods forkserver and spawn; the fork server itself is `distfn.launch.forkserver`).

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
import io
import linecache
import os
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import attrs
import cloudpickle

from .. import preflight
from ..errors import ConfigError

__all__ = ["Parcel", "arrive", "dumps_result", "interactive_main", "loads_result", "main_for_workers", "pack",
           "unpack"]


@attrs.frozen
class Parcel:
    """The function or ``cfg`` as a worker receives it: ``value`` pickled the ordinary way (by name), or
    ``payload`` (cloudpickle's bytes, by value); ``environ``, when set, replaces the worker's environment first."""

    value: Any = None
    payload: bytes | None = None
    environ: dict[str, str] | None = None
    #: ``linecache`` entries of the cells that defined what ``payload`` holds, so tracebacks show their lines.
    sources: dict[str, Any] | None = None
    #: pickled ``{name: pickled value}`` of ``__main__`` globals to set in the worker first (`distfn.launch.pool`:
    #: forked kept ranks hold a copy of ``__main__`` from their start; what the function reads comes as it is now).
    main_globals: bytes | None = None


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
    """What `distfn.launch.local` hands to ``start_method=method`` for ``fn`` and ``cfg``, and how, in words.

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
    if method == "forkserver":  # the server is a copy from before: the environment as it is now goes along
        sent = attrs.evolve(sent, environ=dict(os.environ))
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
    if obj.main_globals is not None:
        vars(sys.modules["__main__"]).update({k: pickle.loads(v) for k, v in pickle.loads(obj.main_globals).items()})
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
