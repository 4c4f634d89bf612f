"""Full state dicts of sharded (FSDP2) models and optimizers: gathered for `ctx.save`, scattered by `ctx.load`.

The file is the same single safetensors file as in DDP mode, written by `distfn.checkpoint.save` on rank 0, so
a model trained with FSDP loads into a bare model with `distfn.load`, and a DDP file resumes an FSDP run. Both
are collectives when the state holds sharded objects: every rank checks in first (the run's check-in,
`distfn.run.Run.check_in`), so a rank-0-only call is an error instead of a hang. `distfn.fsdp` re-exports `save`
and `load`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint
from .checkpoint.layout import Location
from .checkpoint.objects import owner_of
from .modules import indexed_optimizer_state, named_optimizer_state
from .tree import tree_leaves, tree_map

if TYPE_CHECKING:
    from .run import Run

__all__ = ["indexed_optimizer_state", "is_sharded", "load", "named_optimizer_state", "save"]


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(t, "placements") and hasattr(t, "device_mesh")


def is_sharded(obj: Any) -> bool:
    """True for a module with a sharded (``DTensor``) parameter or buffer, or an optimizer over such parameters."""
    if isinstance(obj, nn.Module):
        return any(_is_dtensor(t) for t in obj.parameters()) or any(_is_dtensor(t) for t in obj.buffers())
    if isinstance(obj, torch.optim.Optimizer):
        return any(_is_dtensor(p) for g in obj.param_groups for p in g["params"])
    return False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# --------------------------------------------------------------------------------------------------
# Gathering for save


def _full_options() -> Any:
    # deferred (here and below): torch.distributed.checkpoint loads torch._dynamo (~1.8-2.8 s measured), which only
    # a checkpoint call with sharded objects needs
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _owner(optimizer: torch.optim.Optimizer, candidates: Sequence[nn.Module]) -> nn.Module:
    return owner_of(optimizer, candidates, missing=(
        "cannot find the sharded model this optimizer belongs to: save/load it together with its model in one "
        "mapping (e.g. {'model': model, 'optimizer': opt}); one optimizer over several separately wrapped models "
        "is not supported"))


def _is_state_object(value: Any) -> bool:
    return isinstance(value, (nn.Module, torch.optim.Optimizer))


def _state_objects(obj: Any) -> list[Any]:
    """Every module and optimizer in ``obj`` (a value or nested containers), in a fixed order."""
    return [x for x in tree_leaves(obj, is_leaf=_is_state_object) if _is_state_object(x)]


def _candidates(found: Sequence[Any], run: Run | None) -> list[nn.Module]:
    """Where an optimizer's model may be: the sharded models in the state, then every model the run sharded
    (an optimizer saved or loaded without its model still finds it)."""
    return [*(m for m in found if isinstance(m, nn.Module) and is_sharded(m)), *(run.wrapped if run else ())]


def _gather(obj: Any, models: Sequence[nn.Module]) -> Any:
    """``obj`` with every sharded module / optimizer replaced by its full state dict (on CPU, on rank 0; empty
    elsewhere). Collective: every rank walks the same structure in the same order."""
    # deferred: see _full_options
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    def full(value: Any) -> Any:
        if isinstance(value, nn.Module) and is_sharded(value):
            return get_model_state_dict(value, options=_full_options())
        if isinstance(value, torch.optim.Optimizer) and is_sharded(value):
            model = _owner(value, models)
            return indexed_optimizer_state(get_optimizer_state_dict(model, value, options=_full_options()))
        return value

    return tree_map(full, obj, is_leaf=_is_state_object)


def save(
    obj: Any,
    path: str | os.PathLike[str] | Location,
    *,
    rank: int,
    metadata: Mapping[str, Any] | None = None,
    keep: int | None = None,
    checked_in: bool = False,
    write: Any = None,
    run: Run | None = None,
) -> PurePath:
    """``ctx.save`` in fsdp mode: gather full state dicts to CPU on rank 0, which writes one safetensors file.

    When ``obj`` holds a sharded module or optimizer this must run on every rank (checked through ``run``, see
    the module docstring; ``checked_in=True`` when the caller already did, see `distfn.run.Run.check_in`);
    otherwise it behaves exactly like DDP mode (rank 0 writes, no collective). ``path``: a `Location` (what
    ``ctx.save`` resolved, with its storage options) is written as it is, never resolved again from its text.
    """
    found = _state_objects(obj)
    if any(is_sharded(x) for x in found):
        if not checked_in and run is not None:
            run.check_in("ctx.save")
        with run.collective("ctx.save") if run is not None else contextlib.nullcontext():  # ledger, deadline
            obj = _gather(obj, _candidates(found, run))
    if rank == 0:
        written = (write or checkpoint.save)(obj, path, metadata=metadata, keep=keep)  # write: e.g. a background save
        return written.path if isinstance(written, Location) else written
    return path.path if isinstance(path, Location) else Path(path)


# --------------------------------------------------------------------------------------------------
# Loading into sharded objects


class _ModuleTarget(nn.Module):
    """Stands in for a sharded module inside `distfn.checkpoint.load_into`.

    ``state_dict()`` describes the *full* (unsharded) tensors without holding their data, so the checkpoint
    engine validates names, shapes and tied weights exactly as for a bare module; ``load_state_dict`` then
    receives full CPU tensors and hands them to ``set_model_state_dict``, which keeps each rank's shard.

    Only rank 0's tensors are used (``broadcast_from_rank0``): they go out one at a time and every rank keeps
    its slice. The engine's tensors are views of a memory-mapped file, so on the other ranks, which never touch
    them, the full model is never read into memory: a node running 8 ranks does not hold 8 copies of it.
    """

    _sharded: nn.Module
    _strict: bool

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
        # deferred: see _full_options
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
    """Stands in for an optimizer over sharded parameters inside `distfn.checkpoint.load_into`: the engine
    checks the param-group layout against the live groups, then rank 0's full (indexed) state goes through
    ``set_optimizer_state_dict(broadcast_from_rank0=True)``, and each rank keeps its shard of every moment."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        # Deliberately no super().__init__: this object only forwards load_state_dict.
        self.param_groups = optimizer.param_groups
        self._optimizer = optimizer
        self._model = model

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # deferred: see _full_options
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        named = named_optimizer_state(state_dict, self._optimizer, self._model) if _rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(self._model, self._optimizer, named, options=options)

    def __repr__(self) -> str:
        return f"sharded {type(self._optimizer).__name__}"


def _targets(into: Any, models: Sequence[nn.Module], strict: bool) -> Any:
    def target(value: Any) -> Any:
        if isinstance(value, nn.Module) and is_sharded(value):
            return _ModuleTarget(value, strict)
        if isinstance(value, torch.optim.Optimizer) and is_sharded(value):
            return _OptimizerTarget(value, _owner(value, models))
        return value

    return tree_map(target, into, is_leaf=_is_state_object)


def load(
    path: str | os.PathLike[str] | Location,
    into: nn.Module | Mapping[str, Any],
    *,
    device: torch.device,
    strict: bool = True,
    run: Run | None = None,
) -> dict[str, Any]:
    """``ctx.load`` in fsdp mode: restore sharded modules and optimizers (and everything else) from a full file.

    Every rank opens the file (as in DDP mode: header validation, plain values, unsharded objects); the sharded
    tensors are read on rank 0 only and broadcast, each rank keeping its shard. The file may come from DDP or
    fsdp mode, written by any world size. Collective when ``into`` holds sharded objects: call it on every rank.
    ``run``: the run whose check-in and wrapped models to use. Returns the values not restored in place
    (``step``, ...), like `distfn.checkpoint.load_into`.
    """
    found = _state_objects(into)
    hook: Any = contextlib.nullcontext()
    if any(is_sharded(x) for x in found) and run is not None:
        run.check_in("ctx.load")
        hook = run.collective("ctx.load")  # the run's hook around the scatter: ledger, deadline, timing
    with hook:
        return checkpoint.load_into(path, _targets(into, _candidates(found, run), strict), device=device,
                                    strict=strict)
