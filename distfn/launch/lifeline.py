"""No orphans: a process started by distfn dies with the process that started it (``PR_SET_PDEATHSIG``).

Its own module, beneath `distfn.launch.protocol`, because the fork server asks for it too, and the fork server's
module is imported at decoration, where the rank protocol (which imports the rank bootstrap, `distfn.worker`,
~60 ms after torch, measured with ``python -X importtime``) must not be. Imports nothing of distfn.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Final

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NAME: Final = 15


def die_with_parent(parent_pid: int = 0, name: str | None = None, sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` (SIGKILL: no orphans) to this process when its parent dies, even by SIGKILL;
    ``name``: the process name ``ps`` shows (at most 15 characters). The fork server asks for SIGTERM, which it
    handles by removing its socket before it exits.

    ``parent_pid``: when given and the parent is already another process (it died before ``prctl`` took effect),
    exit at once.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig)
            if name is not None:
                libc.prctl(_PR_SET_NAME, name.encode())
        except (OSError, AttributeError):
            pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)
