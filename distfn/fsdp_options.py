"""The ``fsdp={...}`` options of ``@distributed``: `FsdpOptions`, `MixedPrecision` and `parse_options`.

Kept apart from `distfn.fsdp` so that `distfn.options` (the bottom of the import graph) can validate them at
decoration time without depending on the FSDP runtime, which depends on devices, topology and options in turn.
Plain values only: picklable and hashable, with no FSDP import until a policy object is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs
import torch
from torch import nn

from .errors import ConfigError

DEFAULT_MIN_PARAMS: Final = 1_000_000
DEFAULT_SAVE_TIMEOUT: Final = 300.0

_DTYPE_NAMES: Final[dict[str, torch.dtype]] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


# --------------------------------------------------------------------------------------------------
# Options


def _dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower().removeprefix("torch.")]
    raise ConfigError(f"fsdp={{'mixed_precision': ...}}: {what}={value!r} is not a dtype; use torch.bfloat16, "
                      f"'bf16', 'fp16' or 'fp32'")


_MP_FIELDS: Final = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


@attrs.frozen
class MixedPrecision:
    """The fields of ``torch.distributed.fsdp.MixedPrecisionPolicy``, kept as plain values (picklable, hashable,
    and importable without loading FSDP at decoration time)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def parse(cls, value: Any) -> MixedPrecision | None:
        """``None``, a dtype (or ``"bf16"``...: compute in it, reduce gradients in fp32), a mapping of
        ``MixedPrecisionPolicy`` fields, or a ``MixedPrecisionPolicy`` instance."""
        if value is None or value is False:
            return None
        if isinstance(value, (torch.dtype, str)):
            return cls(param_dtype=_dtype(value, "param_dtype"), reduce_dtype=torch.float32)
        if not isinstance(value, Mapping):
            if all(hasattr(value, f) for f in _MP_FIELDS):  # a MixedPrecisionPolicy (a frozen dataclass)
                value = {f: getattr(value, f) for f in _MP_FIELDS}
            else:
                raise ConfigError(f"fsdp={{'mixed_precision': {value!r}}}: give a dtype such as 'bf16', a mapping of "
                                  f"{', '.join(_MP_FIELDS)}, or a torch.distributed.fsdp.MixedPrecisionPolicy")
        unknown = sorted(set(map(str, value)) - set(_MP_FIELDS))
        if unknown:
            raise ConfigError(f"fsdp={{'mixed_precision': ...}}: unknown key(s) {unknown}; valid keys are "
                              f"{', '.join(_MP_FIELDS)}")
        cast = value.get("cast_forward_inputs", True)
        if not isinstance(cast, bool):
            raise ConfigError(f"fsdp={{'mixed_precision': ...}}: cast_forward_inputs must be a bool, got {cast!r}")
        param, reduce, output = (_dtype(value.get(f), f) for f in _MP_FIELDS[:3])
        return cls(param, reduce, output, cast_forward_inputs=cast)

    def policy(self) -> Any:
        # deferred: torch.distributed.fsdp loads torch._dynamo (~1.7 s measured); option parsing at decoration never
        # needs it, only the first ctx.wrap of an fsdp run
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(self.param_dtype, self.reduce_dtype, self.output_dtype, self.cast_forward_inputs)


def _mixed_precision(value: Any) -> MixedPrecision | None:
    return MixedPrecision.parse(value)


def _classes(value: Any) -> tuple[type | str, ...]:
    items = [value] if isinstance(value, (str, type)) else value
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise ConfigError(f"fsdp={{'module_classes': {value!r}}}: give module classes or class names, e.g. "
                          "[Block] or ['Block']")
    out: list[type | str] = []
    for item in items:
        if (isinstance(item, type) and issubclass(item, nn.Module)) or (isinstance(item, str) and item):
            out.append(item)
        else:
            raise ConfigError(f"fsdp={{'module_classes': ...}}: {item!r} is not an nn.Module subclass or a class name")
    return tuple(out)


def _min_params(value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e6
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"fsdp={{'min_params': {value!r}}} must be a positive int (parameters per unit)")
    return value


def _reshard(value: Any) -> bool | int | None:
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise ConfigError(f"fsdp={{'reshard_after_forward': {value!r}}} must be a bool or a positive int "
                      "(the size of the smaller world to reshard to)")


def _timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ConfigError(f"fsdp={{'save_timeout': {value!r}}} must be a positive number of seconds")
    return float(value)


def _offload(value: Any) -> tuple[bool, bool]:
    """``cpu_offload``: a bool, ``{"pin_memory": bool}`` or a ``CPUOffloadPolicy`` -> (offload, pin_memory)."""
    if isinstance(value, bool):
        return value, True
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - {"pin_memory"})
        if unknown or not isinstance(value.get("pin_memory", True), bool):
            raise ConfigError(f"fsdp={{'cpu_offload': {dict(value)!r}}}: the only key is 'pin_memory' (a bool)")
        return True, value.get("pin_memory", True)
    if hasattr(value, "pin_memory"):  # torch.distributed.fsdp.CPUOffloadPolicy
        return True, bool(value.pin_memory)
    raise ConfigError(f"fsdp={{'cpu_offload': {value!r}}}: give True/False, {{'pin_memory': False}} or a "
                      "CPUOffloadPolicy")


@attrs.frozen
class FsdpOptions:
    """The validated ``fsdp={...}`` options of ``@distributed(mode="fsdp")``.

    Attributes:
        min_params: size policy: a sub-module becomes its own FSDP unit when the parameters it holds that are not
            already in a smaller unit number at least this (default 1,000,000). Ignored with ``module_classes``.
        module_classes: class policy: every sub-module of one of these classes (or class names) becomes a unit,
            e.g. the transformer block class. Recommended for transformers (one all-gather per block).
        mixed_precision: ``MixedPrecisionPolicy`` fields, or ``None`` for full precision.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU (``CPUOffloadPolicy``).
        pin_memory: pin the offloaded memory (only with CUDA; ignored on CPU-only machines).
        reshard_after_forward: free gathered parameters after forward (``True``, ZeRO-3-like), keep them until
            backward (``False``, ZeRO-2-like: faster, more memory) or reshard to a smaller world (an int).
            ``None`` (default) is torch's own default: ``True`` for every unit but the root, whose parameters
            backward needs first anyway.
        save_timeout: seconds a rank waits in ``ctx.save`` for the other ranks before reporting that they did not
            call it.
    """

    min_params: int = attrs.field(default=DEFAULT_MIN_PARAMS, converter=_min_params)
    module_classes: tuple[type | str, ...] = attrs.field(default=(), converter=_classes)
    mixed_precision: MixedPrecision | None = attrs.field(default=None, converter=_mixed_precision)
    cpu_offload: bool = False
    pin_memory: bool = True
    reshard_after_forward: bool | int | None = attrs.field(default=None, converter=_reshard)
    save_timeout: float = attrs.field(default=DEFAULT_SAVE_TIMEOUT, converter=_timeout)

    def fully_shard_kwargs(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments for ``fully_shard`` (the same for every unit)."""
        from torch.distributed.fsdp import CPUOffloadPolicy  # deferred: see policy()

        kwargs: dict[str, Any] = {}
        if self.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = self.reshard_after_forward
        if self.mixed_precision is not None:
            kwargs["mp_policy"] = self.mixed_precision.policy()
        if self.cpu_offload:
            # Pinning needs an accelerator: on a CPU-only machine torch raises "Cannot access accelerator device".
            pin = self.pin_memory and device.type != "cpu" and torch.cuda.is_available()
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
        return kwargs


VALID_KEYS: Final = ("min_params", "module_classes", "mixed_precision", "cpu_offload", "reshard_after_forward",
                     "save_timeout")


def parse_options(value: Mapping[str, Any] | FsdpOptions | None, **overrides: Any) -> FsdpOptions | None:
    """Validate an ``fsdp={...}`` mapping (plus ``overrides``); raise ``ConfigError`` naming the valid keys.

    Args:
        value: the mapping given to ``@distributed``, already parsed options, or ``None``.
        overrides: keys given later (``ctx.wrap(model, min_params=...)``), validated the same way.

    Returns:
        The options, or ``None`` when nothing was given.
    """
    if value is None and not overrides:
        return None
    if isinstance(value, FsdpOptions):
        base: dict[str, Any] = {}
        current = value
    elif value is None or isinstance(value, Mapping):
        base = dict(value or {})
        current = FsdpOptions()
    else:
        raise ConfigError(f"fsdp= takes a mapping of options ({', '.join(VALID_KEYS)}), got {type(value).__name__}")
    given = {**base, **overrides}
    unknown = sorted(str(k) for k in given if k not in VALID_KEYS)
    if unknown:
        raise ConfigError(f"fsdp option(s) {', '.join(map(repr, unknown))} are not known; valid keys are: "
                          f"{', '.join(VALID_KEYS)}")
    if "cpu_offload" in given:
        offload, pin = _offload(given.pop("cpu_offload"))
        given.update(cpu_offload=offload, pin_memory=pin)
    return attrs.evolve(current, **given)
