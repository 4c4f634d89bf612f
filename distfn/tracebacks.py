"""What a user sees of a traceback: their own frames and the cause, without distfn's (issue 44 item 2).

Used where distfn prints or carries an exception: a rank's `distfn.failures.Failure` (the worker's traceback in a
`WorkerError`), the excepthook of a process that ran a job (`distfn.failures.install_excepthook`) and IPython's
rendering of distfn's errors (`distfn.errors.DistfnError._render_traceback_`). ``DISTFN_DEBUG=1`` keeps every
frame. Imports nothing of distfn (the exception types use it).
"""

from __future__ import annotations

import os
import traceback
import types

__all__ = ["debug", "format_user_exception", "user_traceback"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_IPYTHON = f"{os.sep}IPython{os.sep}core{os.sep}"


def debug() -> bool:
    """Whether ``DISTFN_DEBUG=1``: tracebacks then keep distfn's own frames."""
    return os.environ.get("DISTFN_DEBUG") == "1"


def _hidden(frame: types.FrameType) -> bool:
    """A frame of distfn itself, or of IPython's cell runner (above the cell's own frame)."""
    name = frame.f_code.co_filename
    return name.startswith(_PACKAGE) or _IPYTHON in name


def user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without distfn's own frames (the decorator, the launcher, the rank bootstrap, the internals below
    a ``ctx`` call): what is left is the user's code and the libraries it called. ``tb`` itself under
    ``DISTFN_DEBUG=1``, or where every frame is distfn's (a failure of distfn before the user's code ran)."""
    if debug():
        return tb
    kept = []
    entry = tb
    while entry is not None:
        if not _hidden(entry.tb_frame):
            kept.append(entry)
        entry = entry.tb_next
    if not kept:
        return tb
    trimmed = None
    for entry in reversed(kept):  # a new chain: the exception's own traceback objects stay as they were
        trimmed = types.TracebackType(trimmed, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return trimmed


def format_user_exception(exc: BaseException) -> str:
    """``exc`` formatted as Python does, its traceback without distfn's frames (`user_traceback`)."""
    return "".join(traceback.format_exception(type(exc), exc, user_traceback(exc.__traceback__)))
