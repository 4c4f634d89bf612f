"""The exception types distfn raises, so users can catch them precisely.

Every one survives pickle and copy with its message and fields (a job may run inside a `multiprocessing.Pool`
task or a `ProcessPoolExecutor`, which send exceptions back by pickle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .tracebacks import format_user_exception


class FailureRecord(Protocol):
    """One rank's failure as `WorkerError` holds it: the documented fields (docs/failures.md) and the two texts
    its message is made of. `distfn.failures.Failure` is the record distfn makes.

    A protocol, not that class: `distfn.failures` builds its records from these exceptions (which are retryable,
    which are a stop from outside), so importing it here would tie the two modules in an import cycle.
    """

    @property
    def rank(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def exc_type(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def traceback(self) -> str: ...
    @property
    def signal(self) -> str | None: ...
    @property
    def exitcode(self) -> int | None: ...

    def headline(self) -> str:
        """One line: the rank, where it ran, and what happened."""

    def details(self) -> str:
        """The diagnosis, the rank's traceback and the other ranks' stacks, as one text."""


class DistfnError(Exception):
    """Base class of every error raised by distfn itself."""

    def _render_traceback_(self) -> list[str]:
        """The traceback IPython and Jupyter show for it: the user's frames and the cause, without distfn's own
        frames or source (``DISTFN_DEBUG=1`` keeps them), as Python prints it."""
        return format_user_exception(self).rstrip("\n").split("\n")


class LauncherError(DistfnError, ValueError):
    """The launcher environment is missing or inconsistent (raised before any process group starts)."""


class ConfigError(DistfnError, ValueError):
    """An argument of ``@distributed`` or of the decorated call is invalid."""


class CheckpointError(DistfnError):
    """A checkpoint cannot be written or read as asked."""


class NestedLaunchError(ConfigError):
    """A decorated function was called from inside a running distfn worker."""


class Terminated(BaseException):
    """Raised in a rank's main thread when SIGTERM arrives and the function does not poll ``ctx.should_stop``.

    Like ``KeyboardInterrupt`` it derives from ``BaseException``, so ``except Exception`` in user code does not
    swallow it, while ``finally`` blocks and context managers still run. A function that polls
    ``ctx.should_stop`` opts out: SIGTERM then only makes ``should_stop`` true, and the loop decides.
    """


class WorkerError(DistfnError):
    """One or more self-spawned workers failed.

    The message leads with the *first* failure (rank, host, pid, exception type and message and the
    worker's traceback) and lists any later ones after it. ``failures`` holds them all, first first.
    With ``max_restarts=``, ``attempts`` holds the root cause of each earlier attempt that failed, in order
    (the last attempt is ``failures``).
    """

    def __init__(self, failures: Sequence[FailureRecord], attempts: Sequence[FailureRecord] | None = None) -> None:
        self.failures = list(failures)
        self.attempts = list(attempts or [])
        super().__init__(self._render())

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle and copy rebuild an exception from ``args`` (here the rendered text, not the failures): rebuild
        # it from the failures instead, and carry the attributes set on it (as torch's ProcessRaisedException)
        return type(self), (self.failures, self.attempts), self.__dict__

    @property
    def first(self) -> FailureRecord:
        """The failure that happened first (the likely root cause)."""
        return self.failures[0]

    def _render(self) -> str:
        if not self.failures:
            return "a worker failed without reporting why"
        first = self.failures[0]
        lines = [f"{first.headline()}", "", first.details().rstrip()]
        if len(self.failures) > 1:
            lines += ["", f"{len(self.failures) - 1} other rank(s) failed after it:"]
            lines += [f"  - {f.headline()}" for f in self.failures[1:]]
        if self.attempts:
            lines += ["", f"The job was started {len(self.attempts) + 1} times (max_restarts); the earlier attempts "
                          "failed with:"]
            lines += [f"  - attempt {i}: {f.headline()}" for i, f in enumerate(self.attempts)]
        return "\n".join(lines)
