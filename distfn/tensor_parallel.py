"""``ctx.wrap(model, parallelize=plan)``: tensor parallelism on the mesh's ``tp`` dimension, before FSDP.

A plan is either torch's own (a mapping of module paths, ``fnmatch`` patterns per dotted segment as torch reads
them, to ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` / any ``ParallelStyle``), applied with
``parallelize_module`` on the ``tp`` sub-mesh, or a function ``fn(model, mesh) -> model`` that gets the whole named
``DeviceMesh`` and does it itself (torchtitan's ``parallelize_fn``, Lightning's ``parallelize_fn``).

What is checked first, on every rank alike, before any collective (`check_plan`): every path names a module (torch
itself only warns and skips a path that matches nothing, so a typo trains an unsplit layer), the style fits the
module (column / row splits exist for ``nn.Linear`` and ``nn.Embedding``), and the split dimension divides by the
``tp`` size (otherwise the shards would be uneven and a later reshape in the user's forward fails far from here).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from .errors import ConfigError

#: A ``parallelize=`` value: torch's plan (module path -> ParallelStyle) or ``fn(model, mesh) -> model``.
Parallelize = Mapping[str, Any] | Callable[[nn.Module, Any], nn.Module]


def resolve(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` that ``path`` names, as ``parallelize_module`` matches them (each dotted segment an
    ``fnmatch`` pattern over child names; ``""`` is the model itself)."""
    if path == "":
        return [("", model)]
    found = [("", model)]
    for token in path.split("."):
        found = [(f"{where}.{name}" if where else name, child) for where, module in found
                 for name, child in module.named_children() if fnmatch.fnmatch(name, token)]
    return found


def _split_dim(style: Any, module: nn.Module) -> int | None:
    """Which dimension of the module's weight a column / row style splits (``None``: the style splits none)."""
    kind = type(style).__name__
    if kind not in ("ColwiseParallel", "RowwiseParallel"):
        return None
    colwise = kind == "ColwiseParallel"
    if isinstance(module, nn.Linear):
        return 0 if colwise else 1
    if isinstance(module, nn.Embedding):
        return 1 if colwise else 0
    raise ConfigError(f"parallelize=: {kind} splits nn.Linear and nn.Embedding modules, but the plan gives it a "
                      f"{type(module).__name__}; give that module another style (SequenceParallel, or none) or "
                      "split its Linear layers instead")


def check_plan(model: nn.Module, plan: Mapping[str, Any], tp_size: int) -> None:
    """Refuse a plan that names no module, puts a style on a module it cannot split, or splits a dimension that
    ``tp_size`` does not divide: each a `ConfigError` naming the path and the fix."""
    for path, style in plan.items():
        if not isinstance(path, str):
            raise ConfigError(f"parallelize=: the plan's keys are module paths (str), got {path!r}")
        if not hasattr(style, "_apply"):  # torch's ParallelStyle: a class with _apply(module, mesh)
            raise ConfigError(f"parallelize={{{path!r}: {style!r}}}: a value must be a torch ParallelStyle such as "
                              "ColwiseParallel() (torch.distributed.tensor.parallel)")
        matched = resolve(model, path)
        if not matched:
            names = [name for name, _ in model.named_modules() if name][:8]
            raise ConfigError(f"parallelize=: the plan's path {path!r} names no module of {type(model).__name__} "
                              f"(its modules include {', '.join(map(repr, names))}); fix the path (dotted names; "
                              "'*' matches any one segment, e.g. 'blocks.*.fc1')")
        for where, module in matched:
            dim = _split_dim(style, module)
            weight = getattr(module, "weight", None)
            if dim is None or weight is None:
                continue
            if weight.shape[dim] % tp_size:
                raise ConfigError(f"parallelize=: {type(style).__name__} on {where!r} splits dimension {dim} of its "
                                  f"weight {tuple(weight.shape)}, which the tp size {tp_size} does not divide; use a "
                                  f"tp size that divides {weight.shape[dim]}, or leave {where!r} out of the plan")


def apply(model: nn.Module, parallelize: Parallelize, mesh: Any, tp_mesh: Any) -> nn.Module:
    """``model`` with ``parallelize`` applied: torch's plan on ``tp_mesh`` (checked first), or
    ``parallelize(model, mesh)`` (whose result must be a module)."""
    if isinstance(parallelize, Mapping):
        from torch.distributed.tensor.parallel import parallelize_module  # deferred: loads DTensor (~0.6 s)

        check_plan(model, parallelize, tp_mesh.size())
        return parallelize_module(model, tp_mesh, dict(parallelize))
    if not callable(parallelize):
        raise ConfigError(f"parallelize= takes a plan (module path -> ParallelStyle) or a function "
                          f"fn(model, mesh) -> model, got {type(parallelize).__name__}")
    result = parallelize(model, mesh)
    if result is None:
        return model  # a function that parallelised in place and returned nothing
    if not isinstance(result, nn.Module):
        raise ConfigError(f"parallelize=: the function returned {type(result).__name__}, not the module; return the "
                          "model it parallelised")
    return result
