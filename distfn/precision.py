"""Mixed precision and the optimizer step behind `ctx.autocast`, `ctx.backward` and `ctx.step`.

`@distributed(precision=...)` picks full fp32, bf16 autocast, or fp16 autocast with a `GradScaler`. The state of
one rank's loop (`LoopState`: precision, device, the fp16 scaler, the active accumulator) lives here, and so do
the two calls that depend on it: `backward` (divided by the accumulation window, scaled for fp16) and `step`
(unscale, clip, step, update the scale, zero the gradients). Accumulation windows are in `distfn.accumulation`.

Every function here works without a process group (`mode="single"`/`"dp"`) and has no hidden collective, so
calling one on some ranks only cannot hang the job.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from .errors import ConfigError
from .options import Precision, check_precision

if TYPE_CHECKING:
    from torch.optim import Optimizer


class Window(Protocol):
    """What `backward` and `step` ask of the active accumulation window (`distfn.accumulation.Accumulator`).

    A protocol rather than the class itself: `Accumulator` holds a `LoopState`, so naming it here would tie the
    two modules in an import cycle.
    """

    @property
    def every(self) -> int:
        """Micro-batches per optimizer step (what ``backward`` divides the loss by)."""

    @property
    def inside(self) -> bool:
        """True inside ``with acc:``."""

    def holds_step(self) -> bool:
        """Whether ``ctx.step`` must wait for the window to close."""


@attrs.define(eq=False)
class LoopState:
    """Per-process state of the loop helpers: the precision, the GradScaler (fp16), the active accumulator."""

    precision: Precision = attrs.field(default="32", converter=check_precision)
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    accumulator: Window | None = None
    _scaler: Any = attrs.field(default=None, init=False)
    _told_cpu_autocast: bool = attrs.field(default=False, init=False)
    _modules: list[weakref.ref[nn.Module]] = attrs.field(factory=list, init=False, repr=False)

    def track(self, module: nn.Module) -> None:
        """Remember ``module`` (``ctx.wrap`` and ``ctx.accumulate`` call this) so that ``step`` clips its
        parameters in the module's order; held weakly, once."""
        if not any(ref() is module for ref in self._modules):
            self._modules.append(weakref.ref(module))

    def clip_order(self, optimizers: tuple[Optimizer, ...]) -> list[nn.Parameter]:
        """The parameters of ``optimizers`` in the order ``step`` clips them: those of the tracked modules in
        ``module.parameters()`` order, then any others in the optimizers' order.

        The order is part of the result: ``clip_grad_norm_`` stacks the per-tensor norms and reduces them, and
        float addition is not associative. The hand-written idiom is ``clip_grad_norm_(model.parameters())``,
        while an optimizer with two param groups (decay / no decay, as nanoGPT's) lists them in another order;
        following the module's order makes ``ctx.step(max_grad_norm=)`` bit-identical to the idiom.
        """
        in_opt = {id(p): p for opt in optimizers for group in opt.param_groups for p in group["params"]}
        ordered: dict[int, nn.Parameter] = {}
        for ref in self._modules:
            module = ref()
            if module is not None:
                ordered.update((id(p), p) for p in module.parameters() if id(p) in in_opt)
        ordered.update((key, p) for key, p in in_opt.items() if key not in ordered)
        return list(ordered.values())

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler of an fp16 run (created on first use), else ``None``."""
        if self.precision != "16":
            return None
        if self._scaler is None:
            self._scaler = torch.amp.GradScaler(self.device.type)
        return self._scaler


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
    if state.device.type == "cpu" and state.precision != "32" and not state._told_cpu_autocast:
        _tell_cpu_autocast(state, dtype)
    return torch.autocast(device_type=state.device.type, dtype=dtype)


def _tell_cpu_autocast(state: LoopState, dtype: torch.dtype) -> None:
    """One line on rank 0, at the first ``ctx.autocast()`` of the job: autocast on a CPU is easy to miss (a port
    that maps a script's ``dtype`` to ``precision`` runs its CPU tests in half precision and silently diverges
    from the original's float32 there)."""
    state._told_cpu_autocast = True
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    name = "bfloat16" if dtype == torch.bfloat16 else "float16" if dtype == torch.float16 else str(dtype)
    logger.info("precision={!r}: autocast runs matmuls and convolutions on the CPU in {} (weights and gradients "
                "stay float32), so losses and weights differ from a float32 run in the 3rd-4th significant digit; "
                "use precision='32' to compare against a float32 original", state.precision, name)


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
    for all optimizers. ``max_grad_norm`` clips the (unscaled) gradients of all their parameters first, as
    ``clip_grad_norm_(model.parameters(), max_grad_norm)`` does for the tracked model(s) (`LoopState.clip_order`).
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
        nn.utils.clip_grad_norm_(state.clip_order(optimizers), max_grad_norm)
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
