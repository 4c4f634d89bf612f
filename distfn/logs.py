"""One log format for every distfn line, from the launching process and from the ranks; quiet outside a job.

Every line reads ``HH:MM:SS.mmm | LEVEL   | ORIGIN | message``, where ORIGIN is ``launcher`` in the process that
called the decorated function (it detects the launcher, starts and watches the workers) and ``rank r/n`` in a
rank. Lines the user's own code logs with loguru during the job get the same shape.

* ``DISTFN_LOG_LEVEL`` (default INFO) is the lowest level shown, in the launcher and in the ranks.
* In the ranks, INFO and below come from rank 0 only, WARNING and above from every rank;
  ``DISTFN_LOG_RANKS=all`` shows every rank at the chosen level.
* Only loguru's own default stderr handler is replaced while a job runs; sinks the user added stay, and the
  default handler comes back afterwards.

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
from collections.abc import Iterator
from typing import Any

import attrs
from loguru import logger

__all__ = ["FORMAT", "launcher", "setup", "teardown"]

#: The one line format; ``{origin}`` is ``launcher`` or ``rank r/n``.
FORMAT = ("<green>{{time:HH:mm:ss.SSS}}</green> | <level>{{level: <7}}</level> | <cyan>{origin}</cyan> | "
          "<level>{{message}}</level>")

logger.disable("distfn")  # a library is quiet unless asked (loguru's convention); setup() enables it for a job


@attrs.define
class _State:
    stack: list[tuple[int | None, int | None]] = attrs.field(factory=list)  # (rank, world_size); rank None: launcher
    handler: int | None = None  # distfn's sink
    default: int = 0  # loguru's stock stderr handler: 0 at import, a new id once distfn gave it back
    removed_default: bool = False
    was_enabled: bool = False  # the user had called logger.enable("distfn") before the job
    bad_level: str | None = None  # an invalid DISTFN_LOG_LEVEL already reported


_state = _State()


def _distfn_enabled() -> bool:
    """Whether loguru currently lets records of the ``distfn`` modules through (asked with a throwaway sink)."""
    seen: list[bool] = []
    probe = logger.add(lambda _: seen.append(True), level=0, filter=lambda r: r["extra"].get("distfn_probe", False))
    try:
        logger.bind(distfn_probe=True).trace("distfn's job logging starts")  # a record of distfn.logs itself
    finally:
        logger.remove(probe)
    return bool(seen)


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


def _install(rank: int | None, world_size: int | None) -> None:
    _remove(_state.handler)
    _state.handler = None
    origin = "launcher" if rank is None else f"rank {rank}/{world_size}"
    level = os.environ.get("DISTFN_LOG_LEVEL", "INFO")
    min_no = _level_no(level)
    show_all = rank is None or rank == 0 or os.environ.get("DISTFN_LOG_RANKS", "").strip().lower() == "all"
    warn_no = logger.level("WARNING").no

    def keep(record: Any) -> bool:
        no = record["level"].no
        if record["extra"].get("distfn_probe") or no < (min_no if min_no is not None else info_no):
            return False
        return show_all or no >= warn_no

    info_no = logger.level("INFO").no
    _state.handler = logger.add(sys.stderr, level=0, filter=keep, format=FORMAT.format(origin=origin))
    if min_no is None and _state.bad_level != level:  # said once, after the sink exists so that it is seen
        _state.bad_level = level
        logger.warning("DISTFN_LOG_LEVEL={!r} is not a loguru level; using INFO", level)


def setup(rank: int | None = None, world_size: int | None = None) -> Any:
    """Start distfn's logging for a rank (``rank`` given) or for the launching process (``rank=None``).

    Enables the ``distfn`` loggers, replaces loguru's default stderr handler with distfn's sink, and returns
    ``logger`` bound with the rank (``ctx.log``). Undo it with `teardown`; calls nest.
    """
    if not _state.stack:
        _state.was_enabled = _distfn_enabled()
        try:
            logger.remove(_state.default)  # would print every line a second time, in loguru's own format
            _state.removed_default = True
        except ValueError:
            _state.removed_default = False  # the user removed or replaced it: only distfn's sink is added
    logger.enable("distfn")
    _state.stack.append((rank, world_size))
    _install(rank, world_size)
    return logger.bind(rank=rank, world_size=world_size) if rank is not None else logger.bind(origin="launcher")


def teardown() -> None:
    """Undo the last `setup`: back to the enclosing one, or (the last) to the user's logging as it was."""
    if _state.stack:
        _state.stack.pop()
    if _state.stack:
        _install(*_state.stack[-1])
        return
    _remove(_state.handler)
    _state.handler = None
    if _state.removed_default:
        _state.default = logger.add(sys.stderr)
        _state.removed_default = False
    if not _state.was_enabled:
        logger.disable("distfn")


@contextlib.contextmanager
def launcher() -> Iterator[Any]:
    """distfn's logging in the launching process for the duration of a job (``launcher`` lines).

    The decorated call runs inside it (`distfn.decorator`), so detection, the spawn launcher and its failure
    reports all log in the one format; ranks run in place inside it switch to ``rank r/n``.
    """
    log = setup()
    try:
        yield log
    finally:
        teardown()
