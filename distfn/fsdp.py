"""``mode="fsdp"``: fully sharded data parallel with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

What lives here, and who calls it:

* `FsdpOptions` / `parse_options`: the ``fsdp={...}`` mapping of ``@distributed``, validated at
  decoration time (``decorator.Options``).
* `plan_units` / `wrap`: the wrap policy (``Context.wrap``). Sub-modules become their own FSDP unit
  bottom-up, either by size (``min_params``) or by class (``module_classes``); the root is always sharded last.
* `save` / `load`: full-state-dict checkpoints (``Context.save`` / ``Context.load``), re-exported from
  `distfn.fsdp_state`, which gathers and scatters the full state dicts.
* `is_meta` / `materialize`: models built on the meta device, materialised shard by shard after sharding.
* `required_backend`: the process-group backend a run needs (``worker.run``).
* `begin` / `finish`: per-run bookkeeping (``worker.run``): the run's options and the save check-in.

The store-based check-in that turns a rank-0-only `ctx.save` into an error instead of a hang is in
`distfn.checkin`. Importing this module is cheap (option parsing happens at decoration time); the first
`wrap` imports `torch.distributed.fsdp`, which pulls in `torch._dynamo` (~1.5 s).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from . import checkin, fsdp_state
from .devices import collective_device
from .errors import ConfigError
from .fsdp_state import is_sharded, load, save

__all__ = ["FsdpOptions", "MixedPrecision", "begin", "finish", "is_meta", "is_sharded", "load", "materialize",
           "options", "parse_options", "plan_units", "required_backend", "save", "wrap"]

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
        from torch.distributed.fsdp import CPUOffloadPolicy

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


# --------------------------------------------------------------------------------------------------
# Wrap policy


def _numel(params: Mapping[int, nn.Parameter]) -> int:
    return sum(p.numel() for p in params.values())


def plan_units(model: nn.Module, options: FsdpOptions) -> list[nn.Module]:
    """The sub-modules of ``model`` to shard as their own FSDP units, children before parents (root excluded).

    Pure: inspects the module tree only, so it is testable without a process group.

    * With ``options.module_classes``: every sub-module that is an instance of one of them (a name matches the
      class's ``__name__`` or ``__qualname__``).
    * Otherwise, bottom-up by size: a sub-module becomes a unit when the parameters it holds that are not already
      in a unit below it number at least ``options.min_params``; what is left goes to the root's unit.

    Never chosen: modules that appear twice in the tree, and modules holding a parameter that is also registered
    outside them (tied weights such as a shared embedding / output matrix): a tied parameter must live in the
    unit that encloses all its users, so it stays with an ancestor (at worst the root).
    """
    # param id -> registrations in the whole tree, counting a module that appears twice twice: a unit must hold
    # every registration of each of its parameters, or a forward outside it would use a sharded parameter.
    owners: dict[int, int] = {}
    seen_modules: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        seen_modules[id(module)] = seen_modules.get(id(module), 0) + 1
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1

    classes = tuple(c for c in options.module_classes if isinstance(c, type))
    names = {c for c in options.module_classes if isinstance(c, str)}
    units: list[nn.Module] = []
    visited: dict[int, dict[int, int]] = {}  # module id -> registrations in its subtree

    def eligible(module: nn.Module, uncovered: Mapping[int, nn.Parameter], inside: Mapping[int, int]) -> bool:
        if seen_modules[id(module)] > 1 or any(inside[i] < owners[i] for i in inside):
            return False
        if options.module_classes:
            kind = type(module)
            return isinstance(module, classes) or kind.__name__ in names or kind.__qualname__ in names
        return _numel(uncovered) >= options.min_params

    def visit(module: nn.Module, is_root: bool) -> tuple[dict[int, nn.Parameter], dict[int, int]]:
        """-> (parameters of this subtree not yet in a unit, registrations of each parameter in the subtree)."""
        uncovered = {id(p): p for p in module._parameters.values() if p is not None}
        inside = dict.fromkeys(uncovered, 1)
        for child in module.children():
            if id(child) in visited:  # a shared sub-module: its parameters were collected under its first parent
                sub_uncovered: dict[int, nn.Parameter] = {}
                sub_inside = visited[id(child)]
            else:
                sub_uncovered, sub_inside = visit(child, False)
            uncovered.update(sub_uncovered)
            for i, n in sub_inside.items():
                inside[i] = inside.get(i, 0) + n
        visited[id(module)] = inside
        if not is_root and uncovered and eligible(module, uncovered, inside):
            units.append(module)
            return {}, inside
        return uncovered, inside

    visit(model, True)
    return units


def wrap(
    model: nn.Module, options: FsdpOptions, device: torch.device, *, init: Callable[[nn.Module], None] | None = None
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard``: the planned units, then the root.

    ``model`` may still be on the CPU: ``fully_shard`` moves each unit's parameters and buffers to ``device``
    just before sharding them, so the full model never sits on the device at once. A model built under
    ``torch.device("meta")`` is sharded first and then materialised (see `materialize`), so no rank ever holds
    more than its shards.

    Args:
        model: the bare module, on the CPU, on ``device`` or on the meta device.
        options: the run's options with ``ctx.wrap``'s overrides.
        device: this rank's device.
        init: for a meta model, initialises the materialised shards in place (called as ``init(model)`` under
            ``torch.no_grad()``); by default every submodule's ``reset_parameters()``. An error otherwise.

    Returns:
        The same module object, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.
    """
    from torch.distributed.fsdp import fully_shard

    meta = is_meta(model)
    if init is not None and not meta:
        raise ConfigError("ctx.wrap(model, init=...) initialises a model built on the meta device "
                          "(under `with torch.device('meta'):`); this model already holds its values: drop init=")
    if meta and init is None:
        _check_resettable(model)
    kwargs = options.fully_shard_kwargs(device)
    units = plan_units(model, options)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if meta:
        materialize(model, device, init=init, offload=options.cpu_offload)
    # Runs before FSDP's own pre-forward all-gather (prepend), so a rank that skipped a save is caught before it
    # blocks in a collective the others will never join.
    model.register_forward_pre_hook(_forward_hook(), prepend=True)
    fsdp_state.remember(model)
    total = sum(p.numel() for p in model.parameters())
    local = sum(_local(p).numel() for p in model.parameters())
    logger.debug("fsdp: {} unit(s) + root; {} of {} parameters held on this rank", len(units), local, total)
    return model


# --------------------------------------------------------------------------------------------------
# Models built on the meta device


def is_meta(model: nn.Module) -> bool:
    """True when some parameter or buffer of ``model`` is on the meta device (shapes only, no values)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _check_resettable(model: nn.Module) -> None:
    """Refuse, before any work, a meta model that ``reset_parameters()`` cannot fully initialise."""
    missing = [name or type(model).__name__ for name, module in model.named_modules()
               if (module._parameters or module._buffers) and not callable(getattr(module, "reset_parameters", None))]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(
            f"ctx.wrap got a model built on the meta device, but {shown} hold(s) parameters or buffers and ha(s/ve) "
            "no reset_parameters() to initialise them after materialisation (their values would be uninitialised "
            "memory). Pass ctx.wrap(model, init=fn), where fn(model) initialises every parameter and buffer in "
            "place, or give those modules a reset_parameters() method."
        )


@contextlib.contextmanager
def _shard_rng(device: torch.device) -> Iterator[None]:
    """On a CPU mesh DTensor's random ops draw each shard from the rank's own generator, and every rank's is
    seeded alike, so every shard would get the same values: draw from a per-rank stream instead (the caller's
    RNG state is restored afterwards). GPU meshes have DTensor's own offset-based tracker."""
    if device.type != "cpu":
        yield
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.manual_seed((torch.initial_seed() * 1_000_003 + rank + 1) % (2**63))
        yield


def materialize(model: nn.Module, device: torch.device, *, init: Callable[[nn.Module], None] | None = None,
                offload: bool = False) -> None:
    """Give the (sharded) meta tensors of ``model`` real memory and initialise them, in place.

    ``to_empty`` allocates each rank's shards only (on the CPU when offloading, where FSDP keeps them; buffers go
    to ``device``), then ``init(model)``, or every submodule's ``reset_parameters()``, fills them.
    """
    model.to_empty(device=torch.device("cpu") if offload else device)
    with torch.no_grad(), _shard_rng(device):
        if init is not None:
            init(model)
        else:
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    if offload and device.type != "cpu":
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


# The backend of a CPU-offloading run on GPUs: NCCL for the GPU collectives, gloo for those on CPU tensors.
OFFLOAD_BACKEND: Final = "cuda:nccl,cpu:gloo"


def required_backend(opts: FsdpOptions | None, backend: str) -> str:
    """The process-group backend an fsdp run needs, given the one it would otherwise use.

    With `cpu_offload` the sharded gradients and optimizer state live on the CPU, so gradient clipping
    (`ctx.step(opt, max_grad_norm=...)`, whose norm is all-reduced) and the fp16 GradScaler's overflow check
    all-reduce CPU tensors, which NCCL cannot take ("No backend type associated with device type cpu",
    pytorch#148532). A group that is NCCL alone then becomes the per-device `"cuda:nccl,cpu:gloo"`, as Accelerate
    and torchtune do. Any other backend (gloo, or a per-device form that already covers the CPU) is kept.

    Args:
        opts: the run's `fsdp={...}` options (`None`: the defaults, no offloading).
        backend: the backend chosen from `backend=` or the device (`"nccl"` on GPUs).
    """
    if opts is None or not opts.cpu_offload:
        return backend
    if collective_device(backend, torch.device("cuda")) is None:  # the group already takes CPU tensors
        return backend
    return OFFLOAD_BACKEND


# --------------------------------------------------------------------------------------------------
# Per-run state (the save check-in itself is in distfn.checkin)

_OPTIONS: FsdpOptions | None = None  # the current run's fsdp={...} options


def options() -> FsdpOptions:
    """The current run's options (defaults outside a run)."""
    return _OPTIONS if _OPTIONS is not None else FsdpOptions()


def begin(rank: int, world_size: int, opts: FsdpOptions | None) -> None:
    """Start this rank's fsdp run: remember its options and start the save check-in bookkeeping
    (`distfn.checkin`). Collective (one broadcast): call on every rank right after the process group is up."""
    global _OPTIONS
    _OPTIONS = opts or FsdpOptions()
    checkin.begin(rank, world_size, _OPTIONS.save_timeout)


def finish() -> None:
    """End this rank's fsdp run; tells ranks waiting in a save that this one will never join it."""
    global _OPTIONS
    _OPTIONS = None
    checkin.finish()


def _on_forward(module: nn.Module, args: Any) -> None:
    checkin.note_progress()


@functools.cache
def _forward_hook() -> Callable[[nn.Module, Any], None]:
    # Store I/O: under torch.compile run it eagerly instead of tracing into it. Made on first use, not at import:
    # torch.compiler.disable imports torch._dynamo (~1.5 s), which option parsing at decoration time never needs.
    return torch.compiler.disable(_on_forward)


