"""Rank-0 output helpers: a tqdm progress bar (`ctx.progress`) and a TensorBoard writer (`ctx.writer`).

Both do their work on rank 0 only and cost nothing on the other ranks, so logging code needs no
`if ctx.is_main:`. tqdm (a dependency) and TensorBoard (the `tensorboard` extra) are imported when first used
(tqdm 0.1-0.2 s, TensorBoard ~1 s).

Where the output is not a terminal (a batch job's log: ``sbatch``, ``nohup``, CI), tqdm draws nothing, so the
bar becomes plain log lines in distfn's log format instead: one every `LOG_PERCENT` % of the loop or every
`LOG_SECONDS` seconds, whichever comes first (step, rate, ETA, the running means), and one at the end. That is
what ``tail -f slurm-*.out`` shows of a long loop; a loop shorter than `MIN_GAP_S` logs only its end line.

While a loop runs under ``ctx.progress``, rank 0's straggler warning (`distfn.timings`: "rank 3 (node7) is the
straggler: data wait 210 ms/step vs 12 ms median — ...") is written through the bar (``tqdm.write``, so the bar
is redrawn below it) or, off a terminal, logged as a WARNING line between the progress lines.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from loguru import logger

if TYPE_CHECKING:
    from .timings import Timings

T = TypeVar("T")

#: Default cadence of the log lines off a terminal: every 10 % of a loop of known length ...
LOG_PERCENT = 10.0
#: ... or every 60 s, whichever comes first: a job's log shows life at least once a minute.
LOG_SECONDS = 60.0
#: Never two lines within 5 s (or ``log_seconds``, if smaller): a short loop's log is its end line only.
MIN_GAP_S = 5.0


def _make_bar(iterable: Any, **kwargs: Any) -> Any:
    from tqdm.auto import tqdm  # a declared dependency; deferred: 0.1-0.2 s (tqdm.auto probes for a notebook)

    kwargs.setdefault("file", sys.stderr)
    if kwargs["file"] is None:  # started with stderr closed (``2>&-``): no bar to draw
        kwargs["disable"] = True
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("disable", None)  # tqdm's "off when the file is not a terminal"
    return tqdm(iterable, **kwargs)


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item())
    return float(value)


def _duration(seconds: float) -> str:
    """``M:SS``, or ``H:MM:SS`` from an hour on (tqdm's style, so the log reads like the bar)."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _rate(steps: int, seconds: float) -> str:
    if seconds <= 0 or steps == 0:
        return "? it/s"
    per_second = steps / seconds
    return f"{per_second:.3g} it/s" if per_second >= 1 else f"{1 / per_second:.3g} s/it"


class Progress(Generic[T]):
    """Iterate like ``iterable``, with a tqdm bar on rank 0 only (nothing on other ranks).

    ``log(loss=...)`` records values (tensors or numbers) and shows their running means as the bar's postfix;
    on other ranks it returns at once, so it costs nothing there and is safe to call on every rank. The values
    are this rank's: log ``ctx.all_reduce(loss)`` for the mean over ranks (a collective every rank must make).

    When the output is not a terminal (a batch job's log file) tqdm stays silent, and rank 0 logs INFO lines
    instead, so a long job's log shows it is alive: ``epoch 3: 1200/5000 (24%) in 1:37, 12.4 it/s, ETA 5:06,
    mean loss=0.4312`` every ``log_percent`` % of the loop or every ``log_seconds`` seconds, whichever comes
    first (never two within `MIN_GAP_S`), and ``epoch 3: 5000 iterations, mean loss=0.4107 in 6:43
    (12.4 it/s)`` at the end. A loop of unknown length (no ``len()`` and no ``total``) gets the time cadence
    only.

    Args:
        iterable: what to iterate.
        enabled: draw or log anything at all (rank 0's ``ctx.progress``; False on the other ranks).
        desc: the bar's label, and the start of each log line.
        total: the number of items when ``iterable`` has no ``len()``.
        refresh_s: how often ``log`` refreshes the bar's postfix, in seconds.
        log_percent: off a terminal, a line every this many percent of the loop (default `LOG_PERCENT`).
        log_seconds: off a terminal, a line at least this often, in seconds (default `LOG_SECONDS`).
        timings: the run's `distfn.timings.Timings`, whose straggler warning this loop shows while it runs.
        tqdm_kwargs: passed to ``tqdm`` (``file``, ``disable``, ``mininterval``, ...).
    """

    def __init__(self, iterable: Iterable[T], *, enabled: bool, desc: str | None = None,
                 total: int | None = None, refresh_s: float = 0.5, log_percent: float = LOG_PERCENT,
                 log_seconds: float = LOG_SECONDS, timings: Timings | None = None, **tqdm_kwargs: Any) -> None:
        if log_percent <= 0 or log_seconds < 0:
            raise ValueError(f"ctx.progress needs log_percent > 0 and log_seconds >= 0 (got log_percent="
                             f"{log_percent!r}, log_seconds={log_seconds!r}); the defaults are {LOG_PERCENT:g} "
                             f"and {LOG_SECONDS:g}")
        self.iterable = iterable
        self.enabled = enabled
        self.desc = desc
        self.refresh_s = refresh_s
        self.timings = timings
        self.log_percent = log_percent
        self.log_seconds = log_seconds
        self._sums: dict[str, Any] = {}  # floats, or detached tensors so log() never waits for the GPU
        self._counts: dict[str, int] = {}
        self._last_refresh = 0.0
        self._steps = 0
        #: The loop's length for the bar and the log lines' percentage and ETA (None: unknown, time cadence only).
        self.total: int | None = total if total is not None else _length(iterable)
        # tqdm gets the length, never the iterable: its constructor calls iter(iterable), which for a DataLoader
        # starts the worker processes (or draws a sampler seed from the global RNG) once more, on rank 0 only.
        # The bar is advanced by hand in __iter__, so the one loop over `iterable` is ours.
        self.bar: Any = _make_bar(None, desc=desc, total=self.total, **tqdm_kwargs) if enabled else None
        #: True when a bar is drawn: rank 0, and the output is a terminal (or disable=False).
        self.visible: bool = self.bar is not None and not self.bar.disable
        self._started = 0.0  # time.monotonic() when the iteration began
        self._last_line = (0.0, 0)  # (time, steps) of the last log line, or of the start

    @property
    def means(self) -> dict[str, float]:
        """Running means of the values given to ``log`` (empty on ranks other than 0)."""
        return {k: _as_float(self._sums[k]) / self._counts[k] for k in self._sums}

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        # The bar is advanced by hand (not iterated) so the final postfix lands before it closes.
        logs = self.enabled and not self.visible  # rank 0 off a terminal: log lines instead of the bar
        self._steps, self._started = 0, time.monotonic()
        self._last_line = (self._started, 0)
        shown = self.timings if self.enabled else None  # rank 0 shows the straggler warning in the loop's output
        before = shown.display if shown is not None else None
        if shown is not None:
            shown.display = self._warn
        try:
            for item in self.iterable:
                self._steps += 1
                yield item
                if self.visible:
                    self.bar.update(1)
                elif logs and self._line_due():
                    self._log_line()
        finally:
            if shown is not None and before is not None:
                shown.display = before
        if self.visible:
            self._refresh()
            self.bar.close()
        elif logs:
            self._log_end()

    def _warn(self, message: str) -> None:
        """A warning from the run (the straggler line): through the bar when it is drawn, else logged."""
        if self.visible:
            self.bar.write(f"WARNING: {message}", file=self.bar.fp)  # where the bar is drawn (stderr)
        else:
            logger.warning(message)

    def _line_due(self) -> bool:
        """Whether the step just done gets a log line: the time or the percentage came up, the gap is kept."""
        now = time.monotonic()
        since, steps_then = now - self._last_line[0], self._last_line[1]
        if since < min(MIN_GAP_S, self.log_seconds) or (self.total is not None and self._steps >= self.total):
            return False  # too soon after the last line, or the last step: the end line reports it
        by_percent = self.total is not None and (self._steps - steps_then) * 100 >= self.log_percent * self.total
        return by_percent or since >= self.log_seconds

    def _means_text(self) -> str:
        return ", ".join(f"{k}={v:.4g}" for k, v in self.means.items())

    def _log_line(self) -> None:
        """``desc: 1200/5000 (24%) in 1:37, 12.4 it/s, ETA 5:06, mean loss=0.43`` (no % and ETA without a length)."""
        now = time.monotonic()
        self._last_line = (now, self._steps)
        elapsed = now - self._started
        where = (f"{self._steps}/{self.total} ({100 * self._steps / self.total:.0f}%)" if self.total
                 else f"{self._steps} steps")
        parts = [f"{where} in {_duration(elapsed)}", _rate(self._steps, elapsed)]
        if self.total:  # the rest at the average rate so far (a step has been done: _steps >= 1)
            parts.append(f"ETA {_duration((self.total - self._steps) * elapsed / self._steps)}")
        if self._sums:
            parts.append(f"mean {self._means_text()}")
        logger.info("{}: {}", self.desc or "progress", ", ".join(parts))

    def _log_end(self) -> None:
        elapsed = time.monotonic() - self._started
        done = f"{self._steps} iterations"
        if self._sums:
            done += f", mean {self._means_text()}"
        logger.info("{}: {} in {} ({})", self.desc or "progress", done, _duration(elapsed),
                    _rate(self._steps, elapsed))

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, **values: Any) -> None:
        """Add values (e.g. ``loss=loss``) to the running means shown as the postfix (rank 0 only)."""
        if not self.enabled:
            return
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().float().mean()
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1
        now = time.monotonic()
        if self.visible and now - self._last_refresh >= self.refresh_s:
            self._refresh()
            self._last_refresh = now

    def _refresh(self) -> None:
        if self._sums:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in self.means.items()}, refresh=True)

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        """tqdm's ``set_postfix`` on rank 0's bar; a no-op elsewhere."""
        if self.visible:
            self.bar.set_postfix(*args, **kwargs)

    def write(self, message: str) -> None:
        """Print ``message`` on rank 0 without breaking the bar; a no-op elsewhere."""
        if not self.enabled:
            return
        if self.visible:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Close rank 0's bar (also done when the iteration ends)."""
        if self.bar is not None:
            self.bar.close()


def _length(iterable: Any) -> int | None:
    try:
        return len(iterable)
    except TypeError:  # a generator or an IterableDataset's loader: no length, no percentage or ETA
        return None


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class NullWriter:
    """What ranks other than 0 get from ``ctx.writer``: ``SummaryWriter``'s methods (``add_*``, ``flush``,
    ``close``, ``get_logdir``), all doing nothing, so logging code needs no ``if ctx.is_main``."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("add_") or name in ("flush", "close"):
            return _noop
        raise AttributeError(f"{type(self).__name__} (the TensorBoard writer of a rank other than 0) has no {name!r}")

    def get_logdir(self) -> str | None:
        """The log directory rank 0 writes to (``None`` when it was left to TensorBoard's default)."""
        return self.log_dir

    def __enter__(self) -> NullWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_TENSORBOARD_HINT = "ctx.writer needs TensorBoard, which is not installed: pip install 'distfn[tensorboard]'"


def writer(is_main: bool, log_dir: str | None = None, **kwargs: Any) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on rank 0, a ``NullWriter`` on the other ranks.

    Raises ``ImportError`` naming the ``distfn[tensorboard]`` extra on every rank when TensorBoard is missing
    (checked on all ranks so they fail alike rather than one rank failing while the others wait).
    """
    if not is_main:
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(_TENSORBOARD_HINT)
        return NullWriter(None if log_dir is None else str(log_dir))
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(f"{_TENSORBOARD_HINT} ({exc})") from exc
    return SummaryWriter(log_dir=None if log_dir is None else str(log_dir), **kwargs)
