"""Gradient accumulation without needless all-reduces (`ctx.accumulate`, `ctx.no_sync`).

The usual loop, with accumulation over 4 micro-batches:

```python
acc = ctx.accumulate(model, every=4)
for x, y in loader:
    with acc:                       # DDP's all-reduce only on every 4th micro-batch
        ctx.backward(loss_fn(model(x), y))   # divided by 4 inside `acc`
        ctx.step(opt)               # steps (and zero_grads) only when the window closes
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
from torch import nn

from .data import LastLoader
from .errors import ConfigError
from .precision import LoopState
from .timings import continue_step


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Skip gradient synchronisation inside the block: DDP's (and FSDP1's) ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``; a no-op for models without either (single process, DataParallel).

    Both the forward and the backward pass must be inside the block: DDP decides during forward whether the
    backward will all-reduce.
    """
    if hasattr(model, "no_sync"):
        return model.no_sync()  # type: ignore[operator]
    if hasattr(model, "set_requires_gradient_sync"):
        return _gradient_sync_off(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@attrs.define(eq=False)
class Accumulator:
    """Counts micro-batches and turns gradient synchronisation on only for the last one of each window.

    ``with acc:`` wraps one micro-batch (forward and backward). Inside it, ``ctx.backward`` divides the loss by
    ``every`` (so the accumulated gradient is the mean over the window, as with one big batch) and ``ctx.step``
    steps only when ``acc.sync`` is true: on every ``every``-th micro-batch, and on the last batch of a distfn
    loader's epoch so no partial window leaks into the next epoch (that shorter window is still divided by
    ``every``, as in most frameworks).

    Attributes:
        every: micro-batches per optimizer step.
        sync: whether the current (or last) micro-batch closes its window: gradients are all-reduced and
            ``ctx.step`` steps.
        micro_steps: micro-batches entered so far.
        steps: windows closed so far (optimizer steps due).
        loaders: the run's `distfn.data.LastLoader` (``ctx.accumulate`` passes it): a window also closes at the last
            batch of the loader that handed out a batch most recently. ``None``: windows close every ``every``.
    """

    model: nn.Module
    every: int
    state: LoopState = attrs.field(factory=LoopState, repr=False)
    sync: bool = True
    micro_steps: int = 0
    steps: int = 0
    loaders: LastLoader | None = attrs.field(default=None, kw_only=True, repr=False)
    _in_window: int = attrs.field(default=0, init=False)
    _inside: bool = attrs.field(default=False, init=False)
    _left_open: bool = attrs.field(default=False, init=False)  # the last `with acc:` ended mid-window
    _no_sync: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"accumulate(every=...) must be a positive int, got {self.every!r}")
        if not isinstance(self.model, nn.Module):
            raise ConfigError(f"accumulate expects the (wrapped) model, got {type(self.model).__name__}")
        self.state.track(self.model)  # ctx.step(max_grad_norm=) clips in the model's parameter order

    def __enter__(self) -> Accumulator:
        if self._inside:
            raise ConfigError("`with acc:` blocks of one accumulator cannot be nested")
        self.micro_steps += 1
        self._in_window += 1
        self.sync = self._in_window >= self.every or (self.loaders is not None and self.loaders.at_last_batch())
        self.state.accumulator = self
        self._inside = True
        if self._in_window > 1:  # ctx.timings() counts optimizer steps: this forward is no step boundary
            continue_step(self.model, True)
        if not self.sync:
            self._no_sync = no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inside = False
        continue_step(self.model, False)
        self._left_open = not self.sync
        if self.sync:
            self._in_window = 0
            self.steps += 1
        if self._no_sync is not None:
            cm, self._no_sync = self._no_sync, None
            cm.__exit__(*exc)

    @property
    def inside(self) -> bool:
        """True inside ``with acc:``."""
        return self._inside

    def holds_step(self) -> bool:
        """Whether ``ctx.step`` must wait: inside a micro-batch that does not close its window, or called once
        right after one (``ctx.step`` placed after the ``with`` block). Only that one call is held, so a loop
        that left a window open does not silence later plain ``ctx.step`` calls."""
        if self._inside:
            return not self.sync
        held, self._left_open = self._left_open, False
        return held
