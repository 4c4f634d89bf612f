"""Training-loop helpers behind ``ctx``: gradient accumulation without needless all-reduces, mixed precision,
a rank-0 progress bar, a rank-0 TensorBoard writer and DataParallel's per-device losses.

The usual loop, with accumulation over 4 micro-batches and the run's precision::

    acc = ctx.accumulate(model, every=4)
    bar = ctx.progress(loader, desc="train")        # a tqdm bar on rank 0, nothing elsewhere
    for x, y in bar:
        with acc:                                   # DDP's all-reduce only on every 4th micro-batch
            with ctx.autocast():                    # bf16 / fp16 per @distributed(precision=...)
                loss = loss_fn(model(x), y)
            ctx.backward(loss)                      # divided by 4 inside `acc`; scaled by a GradScaler for fp16
            ctx.step(opt)                           # steps (and zero_grads) only when the window closes
        bar.log(loss=loss)

Every function here works without a process group (``mode="single"``/``"dp"``) and has no hidden collective,
so calling one on some ranks only cannot hang the job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
import torch
from loguru import logger
from torch import nn

from .errors import ConfigError

if TYPE_CHECKING:
    from torch.optim import Optimizer

T = TypeVar("T")

#: Accepted values of ``@distributed(precision=...)``: full fp32, bf16 autocast, fp16 autocast + GradScaler.
PRECISIONS = ("32", "bf16", "16")
_ALIASES = {32: "32", 16: "16", "fp32": "32", "float32": "32", "fp16": "16", "float16": "16",
            "bfloat16": "bf16"}


def check_precision(value: Any) -> str:
    """Normalise ``precision`` to one of ``PRECISIONS`` (``32``/``16`` as ints and "fp16"-style names are
    accepted), raising ``ConfigError`` otherwise."""
    if isinstance(value, bool):
        value = None  # never a precision; falls through to the error
    name = _ALIASES.get(value, value) if isinstance(value, (int, str)) else None
    if name not in PRECISIONS:
        raise ConfigError(f"precision={value!r} is not valid; use one of {', '.join(map(repr, PRECISIONS))} "
                          "(full float32, bfloat16 autocast, float16 autocast with a GradScaler)")
    return name


@attrs.define(eq=False)
class LoopState:
    """Per-process state of the loop helpers: the precision, the GradScaler (fp16), the active accumulator."""

    precision: str = attrs.field(default="32", converter=check_precision)
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    accumulator: Accumulator | None = None
    _scaler: Any = attrs.field(default=None, init=False)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler of an fp16 run (created on first use), else ``None``."""
        if self.precision != "16":
            return None
        if self._scaler is None:
            self._scaler = torch.amp.GradScaler(self.device.type)
        return self._scaler


# -- gradient accumulation ----------------------------------------------------------------------------------------
def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Skip gradient synchronisation inside the block: DDP's (and FSDP1's) ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``; a no-op for models without either (single process, DataParallel).

    Both the forward and the backward pass must be inside the block: DDP decides during forward whether the
    backward will all-reduce.
    """
    if hasattr(model, "no_sync"):
        return model.no_sync()  # type: ignore[no-any-return]
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
    """

    model: nn.Module
    every: int
    state: LoopState = attrs.field(factory=LoopState, repr=False)
    sync: bool = True
    micro_steps: int = 0
    steps: int = 0
    _in_window: int = attrs.field(default=0, init=False)
    _inside: bool = attrs.field(default=False, init=False)
    _left_open: bool = attrs.field(default=False, init=False)  # the last `with acc:` ended mid-window
    _no_sync: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"accumulate(every=...) must be a positive int, got {self.every!r}")
        if not isinstance(self.model, nn.Module):
            raise ConfigError(f"accumulate expects the (wrapped) model, got {type(self.model).__name__}")

    def __enter__(self) -> Accumulator:
        from . import data

        if self._inside:
            raise ConfigError("`with acc:` blocks of one accumulator cannot be nested")
        self.micro_steps += 1
        self._in_window += 1
        loader = data.current_loader()
        self.sync = self._in_window >= self.every or (loader is not None and loader.at_last_batch())
        self.state.accumulator = self
        self._inside = True
        if not self.sync:
            self._no_sync = no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inside = False
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


# -- precision ----------------------------------------------------------------------------------------------------
def autocast(state: LoopState, *, enabled: bool | None = None, dtype: torch.dtype | None = None) -> Any:
    """``torch.autocast`` on the run's device with the run's precision (bf16 or fp16); a no-op for ``"32"``.

    ``enabled=False`` switches it off for a block; ``dtype`` overrides the precision's dtype.
    """
    if enabled is None:
        enabled = state.precision != "32" or dtype is not None
    if not enabled:
        return contextlib.nullcontext()
    if dtype is None:
        dtype = torch.float16 if state.precision == "16" else torch.bfloat16
    return torch.autocast(device_type=state.device.type, dtype=dtype)


def backward(state: LoopState, loss: torch.Tensor, **kwargs: Any) -> None:
    """``loss.backward()``, divided by the accumulation window inside ``with acc:`` and scaled by the
    GradScaler for fp16. ``kwargs`` go to ``Tensor.backward`` (``retain_graph``, ...)."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"ctx.backward expects the loss tensor, got {type(loss).__name__}")
    if loss.dim() > 0:
        raise ConfigError(
            f"ctx.backward expects a scalar loss, got shape {tuple(loss.shape)}; in mode='dp' a loss computed "
            "inside forward comes back with one value per GPU: pass ctx.reduce_loss(loss)"
        )
    acc = state.accumulator
    if acc is not None and acc.inside and acc.every > 1:
        loss = loss / acc.every
    scaler = state.scaler
    if scaler is not None:
        loss = scaler.scale(loss)
    loss.backward(**kwargs)


def step(
    state: LoopState, *optimizers: Optimizer, max_grad_norm: float | None = None, zero_grad: bool = True
) -> bool:
    """Step ``optimizers`` unless an accumulation window is still open; returns whether it stepped.

    With fp16 the GradScaler unscales, skips steps whose gradients overflowed and updates its scale once
    for all optimizers. ``max_grad_norm`` clips the (unscaled) gradients of all their parameters first.
    ``zero_grad`` sets the gradients to ``None`` afterwards.
    """
    if not optimizers:
        raise ConfigError("ctx.step needs the optimizer(s) to step: ctx.step(optimizer)")
    acc = state.accumulator
    if acc is not None and acc.holds_step():
        return False
    scaler = state.scaler
    if max_grad_norm is not None:
        if scaler is not None:
            for opt in optimizers:
                scaler.unscale_(opt)
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        nn.utils.clip_grad_norm_(params, max_grad_norm)
    for opt in optimizers:
        if scaler is not None:
            scaler.step(opt)
        else:
            opt.step()
    if scaler is not None:
        scaler.update()
    if zero_grad:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
    return True


def reduce_loss(loss: torch.Tensor) -> torch.Tensor:
    """One scalar from a loss that ``nn.DataParallel`` gathered as one value per GPU (its mean); a scalar is
    returned as is.

    In ``mode="dp"`` the usual way to spread the loss computation over the GPUs is to compute it inside
    ``forward``; DataParallel then returns a vector with each replica's loss. Its mean equals the loss over the
    whole batch when the batch splits evenly over the GPUs (DataParallel gives the last GPU fewer samples
    otherwise).
    """
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"reduce_loss expects a tensor, got {type(loss).__name__}")
    return loss.mean() if loss.dim() > 0 else loss


# -- progress -----------------------------------------------------------------------------------------------------
_warned_no_tqdm = False


def _make_bar(iterable: Any, **kwargs: Any) -> Any:
    global _warned_no_tqdm
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if not _warned_no_tqdm:
            logger.warning("ctx.progress shows no bar: tqdm is not installed (pip install 'distfn[progress]')")
            _warned_no_tqdm = True
        return None
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
        #: True when a bar is drawn: rank 0, tqdm installed, and the output is a terminal (or disable=False).
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


# -- TensorBoard --------------------------------------------------------------------------------------------------
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


# -- models -------------------------------------------------------------------------------------------------------
def convert_sync_batchnorm(model: nn.Module, device: torch.device, *, warn: bool = True) -> nn.Module:
    """``model`` with its BatchNorm layers turned into ``SyncBatchNorm`` (statistics over all ranks).

    On CPU the model is returned unchanged with a warning (when ``warn``): torch's SyncBatchNorm raises on CPU
    tensors in training, and a GPU script should still run on CPUs for development, with per-rank statistics.
    """
    if device.type == "cpu":
        if warn and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            logger.warning("sync_batchnorm=True is ignored on CPU (torch's SyncBatchNorm needs a GPU); "
                           "BatchNorm statistics stay per rank")
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)
