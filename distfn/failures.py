"""Failure records of ranks: what failed where, which failure is the root cause, and how to tell the user.

Used by both paths: the launcher of a self-spawned job (`distfn.launch.local`) collects a `Failure` per rank, orders
them (`order_failures`), adds what it can see from outside (`diagnose`) and raises one `WorkerError`; a rank
started by torchrun / srun / mpirun has no distfn parent and reports itself (`report_in_place`). This module
never imports the launcher (like torch's ``elastic/multiprocessing/errors``, which its launcher imports).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from loguru import logger

from .errors import ConfigError, LauncherError, Terminated
from .tracebacks import debug, format_user_exception, user_traceback

_SIGNAL_HINTS = {
    "SIGKILL": "often the out-of-memory killer; see `dmesg` or the job's memory limit",
    "SIGSEGV": "a crash in native code (a CUDA/NCCL/extension bug or a corrupted tensor)",
    "SIGBUS": "often /dev/shm is too small for DataLoader workers (docker: --shm-size)",
    "SIGABRT": "native code aborted (see the worker's stderr above; NCCL's watchdog aborts a rank whose "
               "collective timed out)",
    "SIGTERM": "terminated from outside (a scheduler time limit or preemption, or `kill`)",
    "SIGINT": "interrupted (Ctrl-C)",
    "SIGFPE": "an arithmetic fault in native code (integer division by zero)",
    "SIGILL": "an illegal instruction: a binary built for another CPU (check the wheels' CPU flags)",
}

# Errors a rank reports because a peer went away: a consequence, never the root cause.
_PEER_LOSS = re.compile(r"connection closed by peer|connection reset by peer|broken pipe|remote worker crash"
                        r"|communicator was aborted|ncclRemoteError|reported a hang of the job", re.IGNORECASE)

_TIMEOUT_WORDS = re.compile(r"time[ds]?[ _-]?out|deadline exceeded", re.IGNORECASE)

# A traceback frame (or faulthandler line) inside a collective: torch.distributed itself, DDP's reducer, or
# distfn's own collectives (which call torch.distributed, but a crash stack may stop above it).
_COLLECTIVE_FRAME = re.compile(r'File "[^"]*(?:torch[/\\]distributed[/\\][^"]*|torch[/\\]nn[/\\]parallel[/\\]'
                               r'distributed\.py|distfn[/\\](?:collectives|checkin)\.py)"')


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder naming the type when the exception's own ``__str__`` raises (the report
    must still reach the user with the rank, the type and the traceback)."""
    try:
        return str(exc)
    except Exception as err:  # noqa: BLE001 - any failure of user code in __str__
        try:
            detail = f"{type(err).__name__}: {err}"
        except Exception:  # noqa: BLE001
            detail = type(err).__name__
        return f"<str() of {type(exc).__qualname__} raised {detail}>"


# -- what the user sees of a traceback ------------------------------------------------------------------------------
#: Set on an exception that `report_in_place` has already reported in full: the rank's own excepthook prints
#: one line for it instead of the traceback again (`install_excepthook`).
_REPORTED_ATTR = "_distfn_reported"


def _excepthook(etype: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
    """`sys.excepthook` of a process that ran a job: an uncaught error shows the user's frames and the cause,
    not distfn's; one `report_in_place` already reported in full is one line."""
    if getattr(value, _REPORTED_ATTR, False) and not debug():
        if isinstance(value, Exception):  # a stop from outside (SIGTERM, Ctrl-C) was one warning line: no more
            name = etype.__qualname__ if etype.__module__ == "builtins" else f"{etype.__module__}.{etype.__qualname__}"
            first = (exception_text(value).splitlines() or [""])[0]
            sys.stderr.write(f"{name}: {first} (reported above; DISTFN_DEBUG=1 shows the whole traceback)\n")
        return
    trimmed = user_traceback(tb)
    # Python's own hook prints the exception's __traceback__, not the one it is given
    sys.__excepthook__(etype, value.with_traceback(trimmed), trimmed)


def install_excepthook() -> None:
    """Let this process's uncaught errors lead with the user's code (`_excepthook`), unless someone else
    replaced Python's excepthook already (theirs is left alone). IPython does not use `sys.excepthook`: there
    distfn's errors render themselves (`distfn.errors.DistfnError._render_traceback_`)."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook


# The hang report a rank collected (or received) for its exception (`distfn.hangs`), kept on the exception itself:
# the exception is what every reporting path (the launcher's pipe, report_in_place) already carries.
_REPORT_ATTR = "_distfn_hang_report"


def attach_report(exc: BaseException, diagnosis: str, stacks: str, *, reporter: int) -> None:
    """Attach the cross-rank report of ``exc`` (`distfn.hangs`): `Failure.from_exception` then carries it, and
    `report_in_place` prints it on ``reporter``, the one rank that collected it, only."""
    setattr(exc, _REPORT_ATTR, (diagnosis, stacks, reporter))


def attached_report(exc: BaseException) -> tuple[str, str, int] | None:
    """``(diagnosis, stacks, reporter)`` attached to ``exc`` by `attach_report`, or ``None``."""
    found = getattr(exc, _REPORT_ATTR, None)
    return found if isinstance(found, tuple) else None


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
    #: Whether starting the job again could help (``max_restarts=``): not for a ConfigError or LauncherError.
    retryable: bool = True
    #: The rank that collected the cross-rank hang report of this failure (`distfn.hangs`), if any: on any other
    #: rank this failure is a consequence, and its diagnosis only points there.
    reporter: int | None = None
    #: Whether the full traceback (before distfn's frames were cut from `traceback`) went through a collective.
    collective: bool = False

    def headline(self) -> str:
        """One line: the rank, where it ran, and what happened."""
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
        """The failure of this process, rank ``rank``, which raised ``exc`` (with its hang report, if any)."""
        diagnosis, stacks, reporter = attached_report(exc) or ("", "", None)
        return cls(
            rank=rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            exc_type=type(exc).__qualname__,
            message=exception_text(exc),
            traceback=format_user_exception(exc),
            collective=bool(_COLLECTIVE_FRAME.search("".join(traceback.format_tb(exc.__traceback__)))),
            retryable=not isinstance(exc, (ConfigError, LauncherError)),
            diagnosis=diagnosis,
            stacks=stacks,
            reporter=reporter,
        )

    @classmethod
    def from_early_exit(cls, rank: int, exc: SystemExit) -> Failure:
        """This process, rank ``rank``, ended the function with ``sys.exit(0)`` (or ``sys.exit()``): no error by
        itself, but the root cause when the other ranks then fail waiting for it."""
        return attrs.evolve(
            cls.from_exception(rank, exc), exitcode=0,
            message=f"{exception_text(exc) or 'None'} (sys.exit({exc.code!r}) ended the function on this rank while "
                    "the other ranks were still running it)",
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


def order_failures(failures: list[Failure]) -> list[Failure]:
    """Likely root cause first: ranks that left without an error (signals, exit codes, ``sys.exit(0)``), then
    the ranks' own errors, then errors about losing a peer or a hang another rank reported; by time within each
    group."""
    def key(f: Failure) -> tuple[int, float]:
        if f.exc_type in ("Signal", "ExitCode") or f.exitcode == 0:
            return 0, f.time
        consequence = _PEER_LOSS.search(f.message) or f.reporter not in (None, f.rank)
        return (2 if consequence else 1), f.time

    return sorted(failures, key=key)


def report_in_place(rank: int, exc: BaseException) -> None:
    """Report a failing rank under torchrun / srun / mpirun, where no distfn parent collects it: each report once
    in the job's output.

    Under torchrun (``TORCHELASTIC_ERROR_FILE``) the whole report (the diagnosis, the traceback without distfn's
    frames, the other ranks' stacks) goes into torchrun's error file (the JSON of ``torch.distributed.elastic``'s
    ``ErrorHandler.record_exception``), which torchrun prints in its summary and uses to name this rank as the
    root cause; the log has one line (the cause and the user's frame) and the diagnosis. Elsewhere the log has the
    whole report. A rank whose hang another rank reported logs one line either way. The caller re-raises, so the
    process exits non-zero and the launcher tears the job down; the exception is marked as reported, so the rank's
    excepthook (`install_excepthook`) prints one line for it instead of the traceback again.
    A stop from outside (SIGTERM, Ctrl-C) is not a root cause: one warning line, no error file.
    """
    message = exception_text(exc)
    with contextlib.suppress(Exception):  # an exception that takes no attributes is printed in full once more
        setattr(exc, _REPORTED_ATTR, True)
    if isinstance(exc, (Terminated, KeyboardInterrupt)) or (isinstance(exc, SystemExit) and not exc.code):
        logger.warning("rank {} stopped: {}: {}", rank, type(exc).__name__, message)
        return
    failure = Failure.from_exception(rank, exc)
    report = attached_report(exc)
    where = innermost_user_frame(failure.traceback, recent_first=False)
    headline = f"rank {rank} failed with {type(exc).__qualname__}: {message}" + (f"\nin {where}" if where else "")
    consequence = _PEER_LOSS.search(message) is not None or (report is not None and report[2] != rank)
    if report is not None and report[2] != rank:
        # another rank collected the hang report and prints it: one line here, so the job's output has it once
        text = headline + ("" if report[0] == "" else f"\n({report[0]})")
    else:
        text = f"{headline}\n{failure.details().rstrip()}"
    if _write_error_file(exc, message, text, consequence=consequence):
        if text != headline and not (report is not None and report[2] != rank):
            text = "\n".join([headline, *([failure.diagnosis] if failure.diagnosis else []),
                              "(the whole report, with the traceback, is in torchrun's summary below)"])
    logger.error("{}", text)


def _write_error_file(exc: BaseException, message: str, text: str, *, consequence: bool) -> bool:
    """Write torchrun's error file (``TORCHELASTIC_ERROR_FILE``) with ``text``; whether it was written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    stamp = int(time.time())
    if consequence:
        # torchrun names the failure with the smallest timestamp (whole seconds, ties go to the lowest rank):
        # losing a peer is a consequence of that peer's failure, so it must sort after it
        stamp += 1
    data = {"message": {"message": f"{type(exc).__name__}: {message}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(stamp)}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError as err:
        logger.warning("could not write TORCHELASTIC_ERROR_FILE={}: {}", path, err)
        return False
    return True


# -- stacks -------------------------------------------------------------------------------------------------------
_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)', re.MULTILINE)


def _frame_pattern(functions: Sequence[Callable[..., Any]]) -> re.Pattern[str]:
    """A faulthandler frame line of any of ``functions`` (matched by ``distfn/<file>`` and name, so that a dump
    from another installation of the same version matches too)."""
    parts = []
    for fn in functions:
        code = getattr(fn, "__code__", None)
        if code is not None:
            parts.append(r"distfn[/\\]" + re.escape(os.path.basename(code.co_filename)) + r'", line \d+ in '
                         + re.escape(code.co_name) + r"\b")
    return re.compile("|".join(parts) or r"(?!)")


def main_stack(dump: str, bootstrap: Sequence[Callable[..., Any]] = (), *, others: bool = False) -> str:
    """The main thread's part of a ``faulthandler`` dump, cut above distfn's own start-up frames.

    A dump lists each thread ("most recent call first"); the worker's main thread is the one running one of
    ``bootstrap`` (distfn's functions between the process start and the user's function), which are cut with
    everything below them. A leading "Fatal Python error: ..." line (a crash) is kept. ``others``: the other
    threads follow in full (except the dumping thread itself, "Current thread", when it is not the main one);
    else only their number.
    """
    starts = [m.start() for m in _THREAD_HEADER.finditer(dump)]
    if not starts:
        return dump.strip()
    cut = _frame_pattern(bootstrap)
    head = dump[:starts[0]].strip()
    blocks = [dump[a:b] for a, b in zip(starts, [*starts[1:], len(dump)], strict=True)]
    block = next((b for b in blocks if cut.search(b)), blocks[-1])
    lines = []
    for line in block.rstrip().splitlines():
        if cut.search(line):
            break
        lines.append(line)
    rest = [b for b in blocks if b is not block]
    if others:
        lines += ["", *(b.rstrip() for b in rest if not b.startswith("Current thread"))]
    elif rest:
        lines.append(f"  ({len(rest)} other thread(s) not shown)")
    return "\n".join([head, ""] if head else []) + "\n".join(lines)


def innermost_user_frame(stack: str, recent_first: bool = True) -> str | None:
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


# -- diagnosis ----------------------------------------------------------------------------------------------------
# NCCL's own words for a collective that did not finish in time (a Python DistBackendError under
# TORCH_NCCL_BLOCKING_WAIT, or text a rank reports about it).
_NCCL_TIMEOUT = re.compile(r"watchdog caught collective operation timeout|ran for \d+ milliseconds before timing out"
                           r"|nccl.*time[ds]?[ _-]?out", re.IGNORECASE)


def ranks_phrase(ranks: Sequence[int]) -> str:
    """"rank 1" or "ranks 0, 2"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))



def hang_kind(first: Failure, *, timeout_s: float, elapsed_s: float | None = None) -> str | None:
    """Whether ``first`` is a collective (or rendezvous) that timed out, and how it was seen: ``"timeout"`` (a
    rank's exception says so: gloo, NCCL's blocking wait, the store), ``"watchdog"`` (the rank was aborted with
    SIGABRT at least ``timeout_s`` into the job: NCCL's watchdog, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ends a
    rank whose collective did not finish in time that way, before Python can report anything), or ``None``."""
    if _NCCL_TIMEOUT.search(f"{first.message}\n{first.traceback}") or \
            _TIMEOUT_WORDS.search(f"{first.exc_type} {first.message}"):
        return "timeout"
    if first.signal == "SIGABRT" and elapsed_s is not None and elapsed_s >= timeout_s:
        return "watchdog"
    return None


def peer_loss(failure: Failure) -> bool:
    """Whether ``failure`` is an error about losing a peer (gloo's "Connection closed by peer", ...)."""
    return _PEER_LOSS.search(failure.message) is not None


def in_collective(failure: Failure) -> bool:
    """Whether ``failure`` happened inside a collective: its traceback (or crash stack) has a torch.distributed,
    DDP or distfn collective frame, or its message is a peer's loss (gloo's "Connection closed by peer").

    Only then can ranks that had returned be the cause; an error only rank 0 can have (a `ctx.save` error, a
    return value that cannot be pickled) involves no collective, and a hint about one would mislead.
    """
    return bool(failure.collective or _COLLECTIVE_FRAME.search(failure.traceback) or _PEER_LOSS.search(failure.message))


def _position(first: Failure) -> str | None:
    """Where in the user's code the first failing rank was (its traceback, or the stack of its crash)."""
    crash = first.signal is not None
    return innermost_user_frame(first.traceback, recent_first=crash) if first.traceback else None


def away_ranks(first: Failure, dumps: dict[int, str]) -> dict[int, str]:
    """``{rank: where}`` for the ranks whose stack shows they had not reached the collective that timed out.

    A rank waiting in a collective is inside torch.distributed under gloo; under NCCL collectives are
    asynchronous, so it waits at the next point that synchronises with the GPU (``.item()``, ``.cpu()``), which
    is user code. So a rank counts as waiting when it is inside torch.distributed *or* at the same place in the
    user's code as the rank that timed out; any other rank is away.
    """
    here = _position(first)
    away: dict[int, str] = {}
    for rank, stack in sorted(dumps.items()):
        where = innermost_user_frame(stack)
        if "torch/distributed/" in stack.replace("\\", "/") or (here is not None and where == here):
            continue
        away[rank] = where or "code outside torch"
    return away


def _hang_notes(first: Failure, kind: str, timeout_s: float, dumps: dict[int, str], returned: Sequence[int],
                dead: list[int]) -> list[str]:
    notes = []
    if kind == "watchdog":
        notes.append(f"Rank {first.rank} was aborted (SIGABRT) after the `timeout` of @distributed had passed: "
                     "NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING) ends a rank whose collective did not "
                     "finish in time; its own stderr above has NCCL's message.")
    if first.exc_type.rsplit(".", 1)[-1] == "CheckInTimeout":
        # a checkpoint call's own, shorter wait (its message says how long and how to wait longer), not `timeout`
        notes.append("A checkpoint call waited past its check-in deadline for the ranks that did not arrive.")
    else:
        notes.append(f"A collective or the rendezvous timed out after {timeout_s:g} s (the `timeout` of "
                     "@distributed, 30 min by default).")
    away = away_ranks(first, dumps)
    if away:
        where = "; ".join(f"rank {r} was in {w}" for r, w in away.items())
        notes.append(f"{ranks_phrase(list(away)).capitalize()} had not reached a collective: {where}.")
    elif dumps and not returned and not dead:
        notes.append("Every other rank was waiting in a collective too: the ranks probably call different "
                     "collectives, or the same ones in a different order (compare the stacks below).")
    if dead:
        notes.append(f"{ranks_phrase(dead).capitalize()} had already failed (listed below).")
    return notes


def diagnose(
    first: Failure,
    *,
    timeout_s: float,
    forwarded: str | None = None,
    returned: Sequence[int] = (),
    failed: Sequence[int] = (),
    stacks: Callable[[], dict[int, str]] = dict,
    elapsed_s: float | None = None,
) -> Failure:
    """The first failure with what the launching process can add from outside.

    Args:
        first: the likely root cause (see `order_failures`).
        timeout_s: the job's ``timeout`` in seconds.
        forwarded: the signal the launching process received and forwarded to the ranks, if any.
        returned: ranks that had returned from the function.
        failed: other ranks that had reported a failure already.
        stacks: asks the ranks still running for their main thread's stack (``{rank: stack}``); called only
            for a collective timeout.
        elapsed_s: seconds from the start of the job to ``first`` (to recognise NCCL's watchdog, see
            `hang_kind`).
    """
    if first.diagnosis:
        return first  # the ranks collected the report among themselves (`distfn.hangs`): it is the better one
    notes: list[str] = []
    text = ""
    if forwarded:
        notes.append(f"The launching process received {forwarded} and forwarded it to the workers.")
    kind = hang_kind(first, timeout_s=timeout_s, elapsed_s=elapsed_s)
    if kind is not None:
        dumps = stacks()
        notes += _hang_notes(first, kind, timeout_s, dumps, returned, [r for r in failed if r != first.rank])
        if dumps:
            text = "\n\n".join(
                [f"Python stacks of the other ranks when rank {first.rank} timed out (most recent call first):"]
                + [f"rank {r}:\n{s}" for r, s in sorted(dumps.items())])
    if returned and (kind is not None or in_collective(first)):
        notes.append(f"{ranks_phrase(list(returned)).capitalize()} had already returned from the function: a "
                     "collective that only some ranks call (e.g. under `if ctx.is_main:`) makes the others fail or "
                     "wait.")
    if not notes:
        return first
    return attrs.evolve(first, diagnosis=" ".join(notes), stacks=text)
