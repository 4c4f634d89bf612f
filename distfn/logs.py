"""One log format for every distfn line, from the launching process and from the ranks; quiet outside a job.

Every line reads ``HH:MM:SS.mmm | LEVEL   | ORIGIN | message``, where ORIGIN is ``launcher`` in the process that
called the decorated function (it detects the launcher, starts and watches the workers) and ``rank r/n`` in a
rank. Lines the user's own code logs with loguru during the job get the same shape.

* ``DISTFN_LOG_LEVEL`` (default INFO) is the lowest level shown, in the launcher and in the ranks.
* In the ranks, INFO and below come from rank 0 only, WARNING and above from every rank;
  ``DISTFN_LOG_RANKS=all`` shows every rank at the chosen level.
* loguru's stock stderr handler is replaced, at the first job, by distfn's one sink, which outside a job prints
  the user's lines as that handler did (``LOGURU_FORMAT``, ``LOGURU_LEVEL``, stderr); sinks the user added stay.

Outside a job distfn is silent, as loguru asks of libraries: ``logger.disable("distfn")`` at import, enabled
by `setup` for the job and put back as it was by `teardown`. A plain `distfn.checkpoint.save` therefore prints
nothing; ``logger.enable("distfn")`` shows its lines (on the user's sinks) outside a job too.

`setup` and `teardown` nest: the decorated call is the launcher (`launcher`, a context manager), and a rank
run in place in that same process (one process, torchrun, srun, mpirun) switches to ``rank r/n`` until it
returns. A forked worker inherits the launcher's state and switches the same way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, Final

import attrs
from loguru import _defaults, logger  # _defaults: LOGURU_FORMAT / LOGURU_LEVEL, what loguru's stock handler uses

__all__ = ["FORMAT", "install_sink", "launcher", "setup", "teardown"]

#: The one line format; ``{origin}`` is ``launcher`` or ``rank r/n``.
FORMAT = ("<green>{{time:HH:mm:ss.SSS}}</green> | <level>{{level: <7}}</level> | <cyan>{origin}</cyan> | "
          "<level>{{message}}</level>")

#: What loguru's stock stderr handler prints (``LOGURU_FORMAT``), which distfn's sink prints outside a job.
_DEFAULT_FORMAT: Final = _defaults.LOGURU_FORMAT + "\n{exception}"

logger.disable("distfn")  # a library is quiet unless asked (loguru's convention); setup() enables it for a job


def _reopen_closed_std_fds() -> None:
    """Point a closed descriptor 0, 1 or 2 at ``/dev/null`` (a script started as ``python s.py >&- 2>&-``).

    Left closed, the next file, pipe or socket opened takes its number: a worker's pipe or a checkpoint file would
    then receive whatever C code (gloo, NCCL, torch's warnings) or a child process writes to "stderr". Python keeps
    ``sys.stdout`` / ``sys.stderr`` ``None`` there; distfn's sink then discards its lines (`_sink_target`).
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
            except OSError:
                return  # no /dev/null (a stripped chroot): nothing better to do
            if null != fd:  # a lower descriptor was closed too, and got this one: it is handled in its turn
                os.dup2(null, fd)
                os.close(null)
            else:
                os.set_inheritable(fd, True)  # os.open's descriptors are not; a child must inherit this one


_reopen_closed_std_fds()


@attrs.frozen
class _View:
    """What distfn's sink shows while a job runs: the line's ORIGIN, the lowest level, and whether INFO and below
    pass on this process (rank 0, the launcher, or ``DISTFN_LOG_RANKS=all``)."""

    format: str  # FORMAT with the origin filled in, plus loguru's "\n{exception}"
    min_no: int
    show_all: bool
    warn_no: int


@attrs.define
class _State:
    stack: list[tuple[int | None, int | None]] = attrs.field(factory=list)  # (rank, world_size); rank None: launcher
    view: _View | None = None  # None: no job runs in this process
    handler: int | None = None  # distfn's sink, added once per process (see `_ensure_sink`)
    stream: Any = None  # the sys.stderr it writes to (None: there is none, the sink discards)
    as_default: bool = False  # it stands in for loguru's stock stderr handler, which distfn removed
    default_no: int = 0  # that handler's level (LOGURU_LEVEL), which the sink keeps outside a job
    probes: int = 0  # probe records sent (`_probe`), and the last one the sink saw
    last_seen: int = 0
    was_enabled: bool = False  # the user had called logger.enable("distfn") before the job
    bad_level: str | None = None  # an invalid DISTFN_LOG_LEVEL already reported


_state = _State()
_PROBE: Final = "distfn_probe"
# A record from a module that is not distfn's, so that logger.disable("distfn") does not drop it: it tells whether
# distfn's sink is still installed (the user may have called logger.remove() since the last job).
_FOREIGN_PROBE: Final = compile("log.trace('is the sink of distfn installed?')", "<distfn.logs>", "exec")


def _filter(record: Any) -> bool:
    """distfn's sink: inside a job the job's view; outside one, what loguru's stock handler would show (when the
    sink stands in for it) or nothing."""
    extra = record["extra"]
    if _PROBE in extra:
        _state.last_seen = extra[_PROBE]
        return False
    no = record["level"].no
    view = _state.view
    if view is None:
        return _state.as_default and no >= _state.default_no
    return no >= view.min_no and (view.show_all or no >= view.warn_no)


def _format(record: Any) -> str:
    view = _state.view
    return view.format if view is not None else _DEFAULT_FORMAT


def _probe(foreign: bool) -> bool:
    """Whether distfn's sink sees a record now: from a foreign module (is the sink installed?) or from this one
    (is ``distfn`` enabled, given the sink is installed?)."""
    _state.probes = token = _state.probes + 1
    log = logger.bind(**{_PROBE: token})
    if foreign:
        exec(_FOREIGN_PROBE, {"__name__": "_distfn_probe", "log": log})  # a constant, compiled above
    else:
        log.trace("distfn's job logging starts")  # a record of distfn.logs itself
    return _state.last_seen == token


#: Serialises `_ensure_sink`: a notebook's definition cell installs the sink from a background thread
#: (`distfn.launch.forkserver`) while the call cell may already install it from the main thread; two at once would
#: each add one and print every line twice. Replaced in a forked child (`os.register_at_fork`), where a lock held
#: by a thread of the parent would stay held for good.
_sink_lock = threading.Lock()


def _new_sink_lock() -> None:
    global _sink_lock
    _sink_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_sink_lock)


def _ensure_sink() -> None:
    """Install distfn's one sink for this process, unless it is installed and writes to the current sys.stderr.

    One sink for the process's life, not one per job, rank, or nesting: ``logger.add`` costs ~5 ms (loguru's
    exception formatter scans every install scheme's paths; measured), paid on the critical path of every call in
    the launcher and of every rank's start. The first time, loguru's stock stderr handler is removed (it would
    print every line a second time, in loguru's own format) and the sink stands in for it outside a job: same
    stream, format (LOGURU_FORMAT) and level (LOGURU_LEVEL), so the user's own lines look as before.
    """
    with _sink_lock:
        _add_sink_unless_there()


def _add_sink_unless_there() -> None:
    if _state.handler is not None and _state.stream is sys.stderr and _probe(foreign=True):
        return
    if _state.handler is None:  # first time in this process (a forked rank inherits the launcher's)
        try:
            logger.remove(0)  # loguru's stock handler, installed at loguru's import
            _state.as_default = True
        except ValueError:
            _state.as_default = False  # the user removed or replaced it: only distfn's lines are added
        _state.default_no = _level_no(_defaults.LOGURU_LEVEL) or 0
    else:
        _remove(_state.handler)
        if _state.stream is sys.stderr:  # gone: the user removed it (logger.remove()), and the default with it
            _state.as_default = False
    _state.handler = logger.add(_sink_target(), level=0, filter=_filter, format=_format)
    _state.stream = sys.stderr


def _discard(message: Any) -> None:
    """The sink's target when there is no stderr: the lines go nowhere, the job runs."""


def _sink_target() -> Any:
    """``sys.stderr``, or `_discard` where Python has none (``None``: the process was started with descriptor 2
    closed, ``2>&-``, or by ``pythonw``), which loguru refuses as a sink."""
    return sys.stderr if sys.stderr is not None else _discard


def install_sink() -> None:
    """Install distfn's sink now, before any job (the fork server does, so that the ranks it forks inherit it
    instead of each adding its own at start-up)."""
    _ensure_sink()


def _level_no(name: str) -> int | None:
    """The number of loguru level ``name``, or ``None`` when there is no such level."""
    try:
        return int(logger.level(name.upper()).no)
    except ValueError:
        return None


def _remove(handler: int | None) -> None:
    if handler is not None:
        with contextlib.suppress(ValueError):  # the user's code removed every handler (logger.remove())
            logger.remove(handler)


def _show(rank: int | None, world_size: int | None) -> None:
    """Point the sink at this job level's view (the launcher, or rank r/n)."""
    origin = "launcher" if rank is None else f"rank {rank}/{world_size}"
    level = os.environ.get("DISTFN_LOG_LEVEL", "INFO")
    min_no = _level_no(level)
    show_all = rank is None or rank == 0 or os.environ.get("DISTFN_LOG_RANKS", "").strip().lower() == "all"
    _state.view = _View(format=FORMAT.format(origin=origin) + "\n{exception}",
                        min_no=min_no if min_no is not None else logger.level("INFO").no, show_all=show_all,
                        warn_no=logger.level("WARNING").no)
    if min_no is None and _state.bad_level != level:  # said once, after the view exists so that it is seen
        _state.bad_level = level
        logger.warning("DISTFN_LOG_LEVEL={!r} is not a loguru level; using INFO", level)


def setup(rank: int | None = None, world_size: int | None = None) -> Any:
    """Start distfn's logging for a rank (``rank`` given) or for the launching process (``rank=None``).

    Enables the ``distfn`` loggers, shows distfn's lines on its sink (which stands in for loguru's default stderr
    handler) in the job's format, and returns ``logger`` bound with the rank (``ctx.log``). Undo it with
    `teardown`; calls nest.
    """
    if not _state.stack:
        _ensure_sink()
        _state.was_enabled = _probe(foreign=False)
    logger.enable("distfn")
    _state.stack.append((rank, world_size))
    _show(rank, world_size)
    return logger.bind(rank=rank, world_size=world_size) if rank is not None else logger.bind(origin="launcher")


def teardown() -> None:
    """Undo the last `setup`: back to the enclosing one, or (the last) to the user's logging as it was."""
    if _state.stack:
        _state.stack.pop()
    if _state.stack:
        _show(*_state.stack[-1])
        return
    _state.view = None
    if not _state.was_enabled:
        logger.disable("distfn")


@contextlib.contextmanager
def launcher() -> Iterator[Any]:
    """distfn's logging in the launching process for the duration of a job (``launcher`` lines).

    The decorated call runs inside it (`distfn.decorator`), so detection, the spawn launcher and its failure
    reports all log in the one format; ranks run in place inside it switch to ``rank r/n``.
    """
    _flush_streams()  # what the caller printed before the call comes before the job's lines
    log = setup()
    try:
        yield log
    finally:
        teardown()
        _flush_streams()  # and the job's lines before the caller's result and its next print


def _flush_streams() -> None:
    """Flush the caller's stdout and stderr. Jupyter's kernel buffers each stream apart and sends them on a timer,
    so without this a ``print`` before a call reached the cell after the call's log lines, and those after the
    cell's result (issue 44 item 7)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or odd replacement stream: nothing to keep in order
            stream.flush()
