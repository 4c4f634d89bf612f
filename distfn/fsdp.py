"""``mode="fsdp"``: fully sharded data parallel with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

What lives here, and who calls it:

* :class:`FsdpOptions` / :func:`parse_options`: the ``fsdp={...}`` mapping of ``@distributed``, validated at
  decoration time (``decorator.Options``).
* :func:`plan_units` / :func:`wrap`: the wrap policy (``Context.wrap``). Sub-modules become their own FSDP unit
  bottom-up, either by size (``min_params``) or by class (``module_classes``); the root is always sharded last.
* :func:`save` / :func:`load`: full-state-dict checkpoints (``Context.save`` / ``Context.load``). The file is the
  same single safetensors file as in DDP mode, written by :func:`distfn.checkpoint.save` on rank 0, so a model
  trained with FSDP loads into a bare model with ``distfn.load``, and a DDP file resumes an FSDP run.
* :func:`begin` / :func:`finish`: per-run bookkeeping (``worker.run``) for the save check-in below.

Why a check-in before every gathering save
------------------------------------------
Gathering a full state dict is a collective. If only rank 0 calls ``ctx.save`` (the habit from DDP mode:
``if ctx.is_main: ctx.save(...)``), rank 0 would block in the all-gather while the other ranks block in their
next forward's all-gather, and the job would hang until the 30-minute collective timeout, or worse, pair
mismatched collectives. So before gathering, every rank checks in through the process group's key-value store
(no collective) and waits for the others. A rank that skips the save is caught by positive evidence rather than
a guess: every rank posts ``(saves, progress)`` to the store at each *sync point* (a forward of a wrapped model,
a distfn collective such as ``ctx.barrier()`` / ``ctx.all_reduce``) and on exit. In a correct program every rank
reaches the same number of sync points between two saves.

* a rank that reaches a sync point while another rank waits in save number ``k`` it never started sees the
  pending check-in and raises at once;
* a waiting rank that sees another rank past the save point (more progress than itself, or finished) without
  having checked in raises within about a second;
* anything else (e.g. the other rank blocked in a raw ``torch.distributed`` call) ends after ``save_timeout``
  seconds (default 300) with the same error instead of a silent hang.
"""

from __future__ import annotations

import math
import os
import secrets
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import torch
from loguru import logger
from torch import nn

from .errors import CheckpointError, ConfigError

__all__ = ["FsdpOptions", "begin", "check_in", "finish", "is_sharded", "load", "note_progress", "parse_options", "plan_units",
           "save", "wrap"]

DEFAULT_MIN_PARAMS: Final = 1_000_000
DEFAULT_SAVE_TIMEOUT: Final = 300.0
_EXITED: Final = 2**62  # the forward count a finished rank posts: "past every save point"

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
        return cls(*(_dtype(value.get(f), f) for f in _MP_FIELDS[:3]), cast_forward_inputs=cast)

    def policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(self.param_dtype, self.reduce_dtype, self.output_dtype, self.cast_forward_inputs)


def _classes(value: Any) -> tuple[type | str, ...]:
    items = [value] if isinstance(value, (str, type)) else value
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise ConfigError(f"fsdp={{'module_classes': {value!r}}}: give module classes or class names, e.g. "
                          "[Block] or ['Block']")
    out: list[type | str] = []
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module) or isinstance(item, str) and item:
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
    if value is None or isinstance(value, bool) or isinstance(value, int) and value >= 1:
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
    mixed_precision: MixedPrecision | None = attrs.field(default=None, converter=MixedPrecision.parse)
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
                sub_uncovered, sub_inside = {}, visited[id(child)]
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


# Models wrapped by distfn in this process (weakly held): lets ctx.save / ctx.load find the model an optimizer
# belongs to when only the optimizer is named.
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def wrap(model: nn.Module, options: FsdpOptions, device: torch.device) -> nn.Module:
    """Shard ``model`` (already on ``device``) in place with ``fully_shard``: the planned units, then the root.

    Returns the same module object, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.
    """
    from torch.distributed.fsdp import fully_shard

    kwargs = options.fully_shard_kwargs(device)
    units = plan_units(model, options)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    # Runs before FSDP's own pre-forward all-gather (prepend), so a rank that skipped a save is caught before it
    # blocks in a collective the others will never join.
    model.register_forward_pre_hook(_on_forward, prepend=True)
    _WRAPPED.add(model)
    total = sum(p.numel() for p in model.parameters())
    local = sum(_local(p).numel() for p in model.parameters())
    logger.debug("fsdp: {} unit(s) + root; {} of {} parameters held on this rank", len(units), local, total)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(t, "placements") and hasattr(t, "device_mesh")


def is_sharded(obj: Any) -> bool:
    """True for a module with a sharded (``DTensor``) parameter or buffer, or an optimizer over such parameters."""
    if isinstance(obj, nn.Module):
        return any(_is_dtensor(t) for t in obj.parameters()) or any(_is_dtensor(t) for t in obj.buffers())
    if isinstance(obj, torch.optim.Optimizer):
        return any(_is_dtensor(p) for g in obj.param_groups for p in g["params"])
    return False


# --------------------------------------------------------------------------------------------------
# Save check-in (see the module docstring)


@attrs.define
class _Run:
    """This rank's view of the current fsdp run's save bookkeeping in the store."""

    store: Any
    prefix: str
    rank: int
    world_size: int
    options: FsdpOptions
    saves: int = 0  # gathering saves this rank started
    progress: int = 0  # sync points this rank reached: forwards of wrapped models and distfn collectives

    def key(self, *parts: Any) -> str:
        return self.prefix + "/".join(map(str, parts))

    def post(self, progress: int | None = None) -> None:
        self.store.set(self.key("rank", self.rank), f"{self.saves} {self.progress if progress is None else progress}")

    def read_all(self) -> dict[int, tuple[int, int]]:
        """Every rank's posted ``(saves, progress)``, in two store round trips when all ranks have posted."""
        keys = [self.key("rank", r) for r in range(self.world_size)]
        if self.store.check(keys):
            values = dict(zip(range(self.world_size), self.store.multi_get(keys)))
        else:  # a rank that never got going: read the others one by one (get() would block on a missing key)
            values = {r: self.store.get(k) for r, k in enumerate(keys) if self.store.check([k])}
        out = {}
        for rank, raw in values.items():
            saves, progress = raw.decode().split()
            out[rank] = (int(saves), int(progress))
        return out


_RUN: _Run | None = None


def options() -> FsdpOptions:
    """The current run's options (defaults outside a run)."""
    return _RUN.options if _RUN is not None else FsdpOptions()


def begin(rank: int, world_size: int, opts: FsdpOptions | None) -> None:
    """Start this rank's bookkeeping for an fsdp run. Collective (one broadcast): call on every rank right after
    the process group is up.

    The run gets a fresh key prefix from rank 0, so keys of an earlier run in the same store (torchrun restarts,
    several decorated calls in one process) never count.
    """
    global _RUN
    import torch.distributed as dist

    from . import collectives

    token = collectives.broadcast_object(secrets.token_hex(8) if rank == 0 else None)
    try:
        store = dist.distributed_c10d._get_default_store()  # private, but stable since torch 1.x
    except (AttributeError, RuntimeError) as exc:
        logger.warning("fsdp: no process-group store ({}); ctx.save on rank 0 only cannot be detected", exc)
        store = None
    _RUN = _Run(store, f"distfn/fsdp/{token}/", rank, world_size, opts or FsdpOptions())
    if store is not None:
        _RUN.post()
        collectives.SYNC_HOOKS.append(note_progress)


def finish() -> None:
    """End this rank's bookkeeping; tells ranks waiting in a save that this one will never join it."""
    global _RUN
    from . import collectives

    run, _RUN = _RUN, None
    if note_progress in collectives.SYNC_HOOKS:
        collectives.SYNC_HOOKS.remove(note_progress)
    if run is not None and run.store is not None:
        try:
            run.post(progress=_EXITED)
        except Exception as exc:  # noqa: BLE001 - the store may be gone when the job is being torn down
            logger.trace("fsdp: could not post exit: {}", exc)


_WHY: Final = {
    "ctx.save": "it gathers the sharded model, a collective; only rank 0 writes the file",
    "ctx.load": "every rank receives its shard from rank 0, a collective",
}


def _skip_message(what: str, rank: int, number: int, late_rank: int) -> str:
    return (f"{what} in mode='fsdp' must be called on every rank ({_WHY[what]}). Rank {rank} is in {what} "
            f"(checkpoint call #{number}) but rank {late_rank} went on without calling it. Call {what} on every "
            "rank, not under `if ctx.is_main:`.")


def note_progress() -> None:
    """A sync point: a forward of a wrapped model or a distfn collective, which every rank reaches equally often
    in a correct program. Post it, then raise if another rank waits in a ``ctx.save`` this rank skipped."""
    run = _RUN
    if run is None or run.store is None:
        return
    run.progress += 1
    run.post()  # post first, then look: with the saver doing the opposite, one of the two always notices
    pending = run.key("save", run.saves + 1)
    if run.store.check([pending]):
        what = run.store.get(pending + "/what").decode() if run.store.check([pending + "/what"]) else "ctx.save"
        raise CheckpointError(
            f"rank {run.rank} went on (a forward pass or a collective) while another rank is in {what} (checkpoint "
            f"call #{run.saves + 1}), which this rank never called. In mode='fsdp' {what} must be called on every "
            f"rank ({_WHY.get(what, 'a collective')}), not under `if ctx.is_main:`."
        )


@torch.compiler.disable  # store I/O: under torch.compile run it eagerly instead of tracing into it
def _on_forward(module: nn.Module, args: Any) -> None:
    note_progress()


def check_in(what: str) -> None:
    """Every rank calls this before the collectives of a checkpoint call (``what``: ``"ctx.save"`` or
    ``"ctx.load"``): it returns once all ranks are in, and raises ``CheckpointError`` naming a rank that went on
    without calling it (or after ``save_timeout``). A no-op outside an fsdp run."""
    if _RUN is not None and _RUN.store is not None:
        _check_in(_RUN, what)


def _check_in(run: _Run, what: str) -> None:
    """Wait until every rank has entered this checkpoint call (``what``: ``"ctx.save"`` or ``"ctx.load"``, which
    share one count), or raise ``CheckpointError`` naming the rank that will not."""
    run.saves += 1
    number = run.saves
    run.post()
    key = run.key("save", number)
    run.store.set(key + "/what", what)  # before the key exists: whoever sees the key can name the call
    everyone = run.key("save", number, "all")
    if run.store.add(key, 1) >= run.world_size:
        run.store.set(everyone, "1")  # the last to arrive releases the others
        return
    start = time.monotonic()
    deadline = start + run.options.save_timeout
    # Ranks normally arrive within milliseconds of each other: poll fast, then back off to 4 checks a second
    # (store.wait with a timeout would do, but TCPStore logs a C++ warning for every wait that times out). The
    # others' progress is read only after a while, once a second: two store round trips per waiting rank, so a
    # large world does not flood the store.
    pause, next_scan = 0.001, start + 0.5
    while True:
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
        if run.store.check([everyone]):
            return
        now = time.monotonic()
        if now < next_scan and now < deadline:
            continue
        next_scan = now + 1.0
        states = run.read_all()
        missing = [r for r in range(run.world_size) if r not in states or states[r][0] < number]
        for other in missing:
            if other in states and states[other][1] > run.progress:  # went past this save point, or finished
                raise CheckpointError(_skip_message(what, run.rank, number, other))
        if now >= deadline:
            raise CheckpointError(
                f"{what} in mode='fsdp' must be called on every rank; rank {run.rank} waited "
                f"{run.options.save_timeout:g} s in {what} (checkpoint call #{number}) and rank(s) "
                f"{missing or 'unknown'} did not arrive. Call {what} on every rank (not under `if ctx.is_main:`); "
                "if some rank legitimately "
                "arrives much later, allow a longer wait with the fsdp option for it (docs/modes.md)."
            )


# --------------------------------------------------------------------------------------------------
# Gathering for save


def _full_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _indexed(named: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter names -> ``Optimizer.state_dict()``'s layout (ints).

    The ints number the parameters across ``param_groups`` in order, as ``torch.optim.Optimizer.state_dict``
    does, so the file matches one written in DDP mode and loads into a bare optimizer.
    """
    if not named:
        return {}
    index: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        ids = [index.setdefault(fqn, len(index)) for fqn in group["params"]]
        groups.append({**group, "params": ids})
    state = {index[fqn]: value for fqn, value in named["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _named(indexed: Mapping[Any, Any], optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The inverse of :func:`_indexed` for ``optimizer``: ints -> the parameter names ``model`` uses."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {order[int(i)]: v for i, v in indexed["state"].items()}
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in indexed["param_groups"]]
    return {"state": state, "param_groups": groups}


def _owner(optimizer: torch.optim.Optimizer, candidates: Sequence[nn.Module]) -> nn.Module:
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in [*candidates, *_WRAPPED]:
        if wanted <= {id(p) for p in model.parameters()}:
            return model
    raise CheckpointError(
        "cannot find the sharded model this optimizer belongs to: save/load it together with its model in one "
        "mapping (e.g. {'model': model, 'optimizer': opt}); one optimizer over several separately wrapped models "
        "is not supported"
    )


def _walk(obj: Any) -> list[Any]:
    """Every module and optimizer in ``obj`` (a value or nested mappings / lists / tuples), in a fixed order."""
    if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        return [obj]
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in _walk(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _walk(v)]
    return []


def _gather(obj: Any, models: Sequence[nn.Module]) -> Any:
    """``obj`` with every sharded module / optimizer replaced by its full state dict (on CPU, on rank 0; empty
    elsewhere). Collective: every rank walks the same structure in the same order."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(obj, nn.Module) and is_sharded(obj):
        return get_model_state_dict(obj, options=_full_options())
    if isinstance(obj, torch.optim.Optimizer) and is_sharded(obj):
        model = _owner(obj, models)
        return _indexed(get_optimizer_state_dict(model, obj, options=_full_options()))
    if isinstance(obj, Mapping):
        return {k: _gather(v, models) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_gather(v, models) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    rank: int,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
    checked_in: bool = False,
) -> Path:
    """``ctx.save`` in fsdp mode: gather full state dicts to CPU on rank 0, which writes one safetensors file.

    When ``obj`` holds a sharded module or optimizer this must run on every rank (checked, see the module
    docstring; ``checked_in=True`` when the caller already did, see :func:`check_in`); otherwise it behaves
    exactly like DDP mode (rank 0 writes, no collective).
    """
    from . import checkpoint

    found = _walk(obj)
    if any(is_sharded(x) for x in found):
        if not checked_in:
            check_in("ctx.save")
        obj = _gather(obj, [m for m in found if isinstance(m, nn.Module) and is_sharded(m)])
    if rank == 0:
        return checkpoint.save(obj, path, metadata=metadata, keep=keep)
    return Path(path)


# --------------------------------------------------------------------------------------------------
# Loading into sharded objects


class _ModuleTarget(nn.Module):
    """Stands in for a sharded module inside :func:`distfn.checkpoint.load_into`.

    ``state_dict()`` describes the *full* (unsharded) tensors without holding their data, so the checkpoint
    engine validates names, shapes and tied weights exactly as for a bare module; ``load_state_dict`` then
    receives full CPU tensors and hands them to ``set_model_state_dict``, which keeps each rank's shard.

    Only rank 0's tensors are used (``broadcast_from_rank0``): they go out one at a time and every rank keeps
    its slice. The engine's tensors are views of a memory-mapped file, so on the other ranks, which never touch
    them, the full model is never read into memory: a node running 8 ranks does not hold 8 copies of it.
    """

    def __init__(self, model: nn.Module, strict: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_sharded", model)  # not a registered sub-module: no recursion into it
        object.__setattr__(self, "_strict", strict)
        self._ties: dict[str, str] = {}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        out: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}
        for name, value in self._sharded.state_dict().items():
            if not isinstance(value, torch.Tensor):
                continue
            if id(value) in first:  # the same parameter under two names (tied): same stand-in, same storage
                self._ties[name] = first[id(value)]
                out[name] = out[first[id(value)]]
                continue
            first[id(value)] = name
            # One element of real memory per tensor, viewed at the full shape: distinct storages keep tie
            # detection honest, and nothing of the model's size is allocated.
            out[name] = torch.empty((1,) * value.dim(), dtype=value.dtype).expand(value.shape)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = {}
        if _rank() == 0:
            full = dict(state_dict)  # set_model_state_dict replaces the values of the dict it is given
            for alias, stored in self._ties.items():
                if alias not in full and stored in full:
                    full[alias] = full[stored]
                elif stored not in full and alias in full:
                    full[stored] = full[alias]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=self._strict)
        return set_model_state_dict(self._sharded, full, options=options)


class _OptimizerTarget(torch.optim.Optimizer):
    """Stands in for an optimizer over sharded parameters inside :func:`distfn.checkpoint.load_into`: the engine
    checks the param-group layout against the live groups, then rank 0's full (indexed) state goes through
    ``set_optimizer_state_dict(broadcast_from_rank0=True)``, and each rank keeps its shard of every moment."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        # Deliberately no super().__init__: this object only forwards load_state_dict.
        self.param_groups = optimizer.param_groups
        self._optimizer = optimizer
        self._model = model

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        named = _named(state_dict, self._optimizer, self._model) if _rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(self._model, self._optimizer, named, options=options)

    def __repr__(self) -> str:
        return f"sharded {type(self._optimizer).__name__}"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _targets(into: Any, models: Sequence[nn.Module], strict: bool) -> Any:
    if isinstance(into, nn.Module) and is_sharded(into):
        return _ModuleTarget(into, strict)
    if isinstance(into, torch.optim.Optimizer) and is_sharded(into):
        return _OptimizerTarget(into, _owner(into, models))
    if isinstance(into, Mapping):
        return {k: _targets(v, models, strict) for k, v in into.items()}
    return into


def load(
    path: str | os.PathLike[str],
    into: nn.Module | Mapping[str, Any],
    *,
    device: torch.device,
    strict: bool = True,
) -> dict[str, Any]:
    """``ctx.load`` in fsdp mode: restore sharded modules and optimizers (and everything else) from a full file.

    Every rank opens the file (as in DDP mode: header validation, plain values, unsharded objects); the sharded
    tensors are read on rank 0 only and broadcast, each rank keeping its shard. The file may come from DDP or
    fsdp mode, written by any world size. Collective when ``into`` holds sharded objects: call it on every rank.
    Returns the values not restored in place (``step``, ...), like :func:`distfn.checkpoint.load_into`.
    """
    from . import checkpoint

    found = _walk(into)
    if any(is_sharded(x) for x in found):
        check_in("ctx.load")
    models = [m for m in found if isinstance(m, nn.Module) and is_sharded(m)]
    return checkpoint.load_into(path, _targets(into, models, strict), device=device, strict=strict)
