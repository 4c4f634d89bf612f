"""What this process is, known before any job starts and without the launch machinery: a distfn worker or a
process running a decorated function (the nested-launch guard), and the legacy launcher's ``--local-rank``.

Both are asked at decoration (`distfn.decorator`), where only what a decorating user needs may be imported (the
rank bootstrap, `distfn.worker`, loads the process-group machinery: ~60 ms after torch, measured with
``python -X importtime``). `distfn.worker` sets the guard while a function runs and re-exports these names.

`in_worker` is the one nested-launch check: true while a decorated function runs in this process, and in a
distfn worker process from its start (its name begins with `WORKER_NAME`, which multiprocessing sets before
spawn/forkserver re-import the user's script, before distfn's entry point runs).

`frozen_heap` keeps the cyclic garbage collector off the objects that exist when a call starts (see there).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
from collections.abc import Iterator, MutableMapping

from .errors import LauncherError
from .topology import split_local_rank

__all__ = ["WORKER_NAME", "adopt_legacy_local_rank", "frozen_heap", "in_worker", "mark_active", "stat"]

#: distfn's worker processes are named ``distfn-rank<N>``. multiprocessing names the child before a spawn or
#: forkserver child re-imports the user's script, so a decorated call during that import is a nested launch, seen
#: in the child alone: the launching process (where other threads may launch jobs of their own) is never marked.
WORKER_NAME = "distfn-rank"

# True while a distfn-decorated function runs in this process: calling another decorated function then would
# start a second job from inside a rank (a fork bomb under self-spawn), so the decorator refuses it.
_ACTIVE = False


def in_worker() -> bool:
    """True inside a running distfn function, or in a distfn worker process (named `WORKER_NAME`...)."""
    return _ACTIVE or multiprocessing.current_process().name.startswith(WORKER_NAME)


def mark_active(value: bool) -> None:
    """Set the nested-launch guard (used by the spawn entry point before the user's module is imported)."""
    global _ACTIVE
    _ACTIVE = value


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While a call runs, the objects that existed before it are left out of the cyclic garbage collector's passes
    (`gc.freeze`), and given back to it after (`gc.unfreeze`).

    Why: after ``import torch`` a process holds ~175,000 tracked objects. Importing the launch machinery at the
    first call allocates enough to trigger a full (generation-2) collection, which walks all of them: 100-300 ms
    on this project's 2-core machine (``gc.callbacks``), on the critical path of every launch and, under
    torchrun, of every rank. Frozen, that pass walks only what the call made. Workers forked during the call
    inherit the frozen heap and keep it for their life: their collections never walk the launching process's
    objects, which would also write to every object's header and un-share those copy-on-write pages (what the
    `gc.freeze` docs recommend before ``fork``). The cost: garbage cycles among the frozen objects are collected
    only after the call (never, in a forked worker, which exits). A process that manages freezing itself
    (``gc.get_freeze_count() > 0``) is left alone.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def adopt_legacy_local_rank(argv: list[str] | None = None,
                            env: MutableMapping[str, str] | None = None) -> int | None:
    """Move the ``--local-rank=N`` of ``python -m torch.distributed.launch`` from argv into ``LOCAL_RANK``.

    The legacy launcher (without ``--use-env``) appends the flag to the script's arguments, so a script's own
    ``argparse`` fails with "unrecognized arguments". distfn takes it out of ``sys.argv`` at ``import distfn``
    and again when a function is decorated, before the user's code parses its arguments, and puts the value
    where ``--use-env`` and torchrun put it (``ctx.local_rank`` reads it from there). Only when the process was
    started by a launcher (``RANK`` and ``WORLD_SIZE`` set) and ``LOCAL_RANK`` is unset or agrees; otherwise
    argv is left alone and detection explains what is wrong.

    Returns:
        The local rank taken from argv, or ``None`` when nothing was changed.
    """
    argv = sys.argv if argv is None else argv
    env = os.environ if env is None else env
    try:
        found = split_local_rank(argv)
    except LauncherError:
        return None  # a malformed flag: detection names it when the decorated function is called
    if found is None or not env.get("RANK", "").strip() or not env.get("WORLD_SIZE", "").strip():
        return None
    rest, local_rank = found
    if env.get("LOCAL_RANK", "").strip() not in ("", str(local_rank)):
        return None
    env["LOCAL_RANK"] = str(local_rank)
    argv[:] = rest
    return local_rank


def stat(path: str) -> tuple[str, str] | None:
    """``(name, state)`` from a ``/proc/PID/stat`` (or ``/proc/PID/task/TID/stat``) file, ``None`` where it cannot
    be read (the process ended, or no ``/proc``: not Linux). The state is the scheduler's letter (``R``, ``S``,
    ``T`` stopped, ``Z`` zombie, ...). The name sits between the first ``(`` and the *last* ``)``: a program may set
    one holding spaces and parentheses."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    end = text.rfind(")")
    fields = text[end + 2:].split()
    if end < 0 or not fields:
        return None
    return text[text.find("(") + 1:end], fields[0]
