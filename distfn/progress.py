"""Rank-0 output helpers: a tqdm progress bar (`ctx.progress`) and a TensorBoard writer (`ctx.writer`).

Both do their work on rank 0 only and cost nothing on the other ranks, so logging code needs no
`if ctx.is_main:`. tqdm (a dependency) and TensorBoard (the `tensorboard` extra) are imported when first used
(tqdm 0.1-0.2 s, TensorBoard ~1 s).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
from loguru import logger

T = TypeVar("T")


def _make_bar(iterable: Any, **kwargs: Any) -> Any:
    from tqdm.auto import tqdm  # a declared dependency; deferred: 0.1-0.2 s (tqdm.auto probes for a notebook)

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("disable", None)  # tqdm's "off when the file is not a terminal"
    return tqdm(iterable, **kwargs)


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item())
    return float(value)


class Progress(Generic[T]):
    """Iterate like ``iterable``, with a tqdm bar on rank 0 only (nothing on other ranks).

    ``log(loss=...)`` records values (tensors or numbers) and shows their running means as the bar's postfix;
    on other ranks it returns at once, so it costs nothing there and is safe to call on every rank. When the
    output is not a terminal (a batch job's log file) tqdm stays silent, and rank 0 logs one INFO line with the
    means when the iteration ends. The values are this rank's: log ``ctx.all_reduce(loss)`` for the mean over
    ranks (a collective every rank must make).
    """

    def __init__(self, iterable: Iterable[T], *, enabled: bool, desc: str | None = None,
                 total: int | None = None, refresh_s: float = 0.5, **tqdm_kwargs: Any) -> None:
        self.iterable = iterable
        self.enabled = enabled
        self.desc = desc
        self.refresh_s = refresh_s
        self._sums: dict[str, Any] = {}  # floats, or detached tensors so log() never waits for the GPU
        self._counts: dict[str, int] = {}
        self._last_refresh = 0.0
        self._steps = 0
        self.bar: Any = _make_bar(iterable, desc=desc, total=total, **tqdm_kwargs) if enabled else None
        #: True when a bar is drawn: rank 0, and the output is a terminal (or disable=False).
        self.visible: bool = self.bar is not None and not self.bar.disable

    @property
    def means(self) -> dict[str, float]:
        """Running means of the values given to ``log`` (empty on ranks other than 0)."""
        return {k: _as_float(self._sums[k]) / self._counts[k] for k in self._sums}

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        # The bar is advanced by hand (not iterated) so the final postfix lands before it closes.
        for item in self.iterable:
            self._steps += 1
            yield item
            if self.visible:
                self.bar.update(1)
        if self.visible:
            self._refresh()
            self.bar.close()
        elif self.enabled and self._sums:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in self.means.items())
            logger.info("{}: {} iterations, mean {}", self.desc or "progress", self._steps, shown)

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
